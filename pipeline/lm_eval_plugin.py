"""`lm_eval --model batchgen`: lm-eval's own command line finds the batchgen backend.

lm-eval 0.4.13 looks `--model` up in its own table of models only: it loads no entry points and
has no plugin hook, and its command line resolves the name before any code of the user's runs.
Its registry does take a lazy target ("module:Class") for a name, so batchgen puts one there: the
`.pth` file this writes into site-packages (`python -m batchgen.pipeline.lm_eval_plugin`; `make setup` runs
it) makes Python's `site` run `batchgen_lm_eval_hook.install()` at start-up, which adds an import
hook that registers `batchgen` when lm-eval reads its table. `batchgen-lm-eval` runs lm-eval's
command line without the `.pth` file.
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from batchgen_lm_eval_hook import NAME

PTH = "batchgen-lm-eval.pth"
# `site` runs a .pth line that starts with "import"; an error there would print at every start of
# Python (once batchgen is uninstalled, say), so the line swallows it
LINE = 'import sys; exec("try:\\n import batchgen_lm_eval_hook as h\\n h.install()\\nexcept Exception:\\n pass")\n'
# what earlier versions wrote into the same file (their hook was `pipeline.lm_eval_hook`, which
# imported the package at every start): writing replaces it, and `--remove` removes either
OLD_LINE = 'import sys; exec("try:\\n import pipeline.lm_eval_hook as h\\n h.install()\\nexcept Exception:\\n pass")\n'


def write_pth(site_dir: Path) -> Path:
    """Write the hook's .pth file into `site_dir`, replacing an earlier version's line."""
    path = Path(site_dir) / PTH
    path.write_text(LINE)
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m batchgen.pipeline.lm_eval_plugin [--remove]`: write (or remove) the .pth file in this
    Python's site-packages."""
    args = sys.argv[1:] if argv is None else argv
    site_dir = Path(sysconfig.get_path("purelib"))
    if args == ["--remove"]:
        (site_dir / PTH).unlink(missing_ok=True)
        print(f"removed {site_dir / PTH}")
    elif not args:
        old = (site_dir / PTH).is_file() and (site_dir / PTH).read_text() == OLD_LINE
        print(f"wrote {write_pth(site_dir)}{' (replacing the old hook)' if old else ''}: "
              f"`lm_eval --model {NAME}` runs batchgen")
    else:
        sys.exit("usage: python -m batchgen.pipeline.lm_eval_plugin [--remove]")


if __name__ == "__main__":
    main()
