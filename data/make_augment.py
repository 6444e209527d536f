"""Write data/augment.parquet: short product reviews for ``--prompt-template`` runs.

Example: batchgen run data/augment.parquet --prompt-template \
    "Rewrite this review in a different style, keeping its sentiment:\n{text}"
The ``text`` and ``label`` columns are carried through to the output.
Rerun with ``python data/make_augment.py`` after editing REVIEWS.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

REVIEWS: list[tuple[str, str]] = [
    ("The kettle boils fast and the handle stays cool. Very happy with it.", "positive"),
    ("Stopped charging after two weeks and support never replied.", "negative"),
    ("Comfortable headphones, though the case feels a bit flimsy.", "mixed"),
    ("These socks kept my feet dry on a three-day hike. Buying more.", "positive"),
    ("The lamp arrived with a cracked shade and a loose switch.", "negative"),
    ("Good blender for smoothies, but it is louder than I expected.", "mixed"),
    ("Setup took five minutes and the app just works.", "positive"),
    ("The zipper broke the first time I packed the bag fully.", "negative"),
    ("Nice colour and fit; the fabric pills a little after washing.", "mixed"),
    ("Sharp knife, balanced weight, and it came properly boxed.", "positive"),
    ("Instructions were missing and two screws did not fit.", "negative"),
    ("Great battery life, average camera, fair price overall.", "mixed"),
]


def build_table() -> pa.Table:
    return pa.table({"text": [t for t, _ in REVIEWS], "label": [lbl for _, lbl in REVIEWS]})


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "augment.parquet")
    pq.write_table(build_table(), out)
    print(f"wrote {len(REVIEWS)} rows to {out}")


if __name__ == "__main__":
    main()
