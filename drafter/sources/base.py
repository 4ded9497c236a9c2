"""The draft-source interface the decode loop drives."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from ..target import WindowOutput

Sampler = Callable[[torch.Tensor, int], int]


class DraftSource(Protocol):
    name: str
    # Target layer ids whose outputs this source needs in WindowOutput.taps (DFlash2); () if none.
    taps: tuple[int, ...]
    # Whether this source needs WindowOutput.hidden (MTP).
    needs_hidden: bool
    # The deepest window this source can fill in one proposal.
    max_depth: int

    def commit(self, tokens: Sequence[int], out: WindowOutput, kept_rows: int) -> None:
        """Rows [out.start, out.start + kept_rows) of `out` are now committed.

        `tokens` is the whole committed sequence (prompt + reply) ending with the pending token,
        whose position is out.start + kept_rows. Called after the prefill and after every verify.
        """
        ...

    def propose(self, tokens: Sequence[int], depth: int, sample: Sampler | None) -> list[int]:
        """Up to `depth` draft tokens for positions after the pending token (tokens[-1]).

        `sample` is the request's sampler (keyed by absolute position); a source may use it to draw
        its drafts the way the target will, or ignore it and draft greedily."""
        ...
