"""What the engine needs of a constrained sample's grammar: the `Matcher` protocol, and the mask
of the tokens each constrained row of a step allows next.

The grammar itself (compiling constraints, the tokenizer's view of them) lives above the engine,
in pipeline/text/grammar.py, whose matchers implement this protocol; the engine sees token ids
and masks only. The masks of all constrained rows of a step are filled into one bitmask, one row
after the other on the calling thread (why serial: pipeline/text/grammar.py).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


class Matcher(Protocol):
    """One sample's position in its grammar."""

    n_vocab: int  # its tokenizer's vocabulary: the width of the masks it fills

    def accept(self, token: int) -> None:
        """The sample took `token` (a refused token leaves the matcher in its error state)."""

    @property
    def accepting(self) -> bool:
        """The text so far is complete: ending here (EOS) is allowed."""

    @property
    def done(self) -> bool:
        """The text is complete and the grammar allows nothing more: the sample ends."""

    @property
    def error(self) -> str | None:
        """Why no token can continue the text, or None."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32, (R, ceil(n_vocab / 32)):
        bit j of word i allows token 32 i + j)."""


def allowed_tokens(matchers: Sequence[Matcher], vocab: int) -> torch.Tensor:
    """(R, vocab) bool: the tokens each matcher allows next."""
    words = (matchers[0].n_vocab + 31) // 32  # one tokenizer per run: one mask width
    bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(bitmask, i)
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(matchers), words * 32).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    # ids past the tokenizer's vocabulary (padding of the model's output layer) are never allowed
    return torch.cat([bits, bits.new_zeros(len(matchers), vocab - bits.shape[1])], dim=1)
