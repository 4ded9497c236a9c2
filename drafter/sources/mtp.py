"""MTP drafts: chained steps through the target checkpoint's multi-token-prediction layer.

The MTP layer (DeepSeek-V3 style, which GLM-5.3 follows) at position q combines the target's
hidden state at q with the embedding of the token at q + 1 and predicts the token at q + 2. It
has its own small cache. After every commit the source feeds it the committed pairs
(target hidden at q, token at q + 1), computed from the *target's* hidden states, so the MTP cache
always matches what a serial run would have; speculative chained rows (the MTP's own output
hidden fed back in) are truncated before the next commit.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..target import WindowOutput
from .base import Sampler


class MtpAdapter(Protocol):
    """The family's MTP layer, for one request."""

    def forward(self, hidden: torch.Tensor, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions [start, start + r): row j combines hidden[j] (the target's hidden state
        at position start + j, or the MTP's own output when chaining) with tokens[j] (the token at
        position start + j + 1). Writes the MTP cache rows; returns (logits [r, V] predicting
        position start + j + 2, output hidden [r, H])."""
        ...

    def truncate(self, length: int) -> None:
        """Discard MTP cache rows at positions >= length."""
        ...


class MtpSource:
    name = "mtp"
    taps: tuple[int, ...] = ()
    needs_hidden = True

    def __init__(self, adapter: MtpAdapter, *, max_depth: int = 13) -> None:
        self.adapter = adapter
        self.max_depth = max_depth
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None   # (logits, hidden) for the pending token
        self._pending_pos = -1

    def commit(self, tokens: Sequence[int], out: WindowOutput, kept_rows: int) -> None:
        if out.hidden is None:
            raise ValueError("MTP drafts need the target's hidden states; the target returned none "
                             "(WindowOutput.hidden is None)")
        start = out.start
        self.adapter.truncate(start)           # drop speculative chained rows from the last proposal
        pairs = [int(t) for t in tokens[start + 1:start + 1 + kept_rows]]
        logits, hidden = self.adapter.forward(out.hidden[:kept_rows], pairs, start)
        self._next = (logits[-1], hidden[-1])
        self._pending_pos = start + kept_rows

    def propose(self, tokens: Sequence[int], depth: int, sample: Sampler | None = None) -> list[int]:
        if self._next is None or self._pending_pos != len(tokens) - 1:
            return []                          # not in step with this sequence: propose nothing
        depth = min(depth, self.max_depth)
        pick = (lambda row, pos: sample(row, pos)) if sample is not None else (lambda row, pos: int(row.argmax()))
        logits, hidden = self._next
        pos = self._pending_pos                # MTP row of the pending token's hidden is pos - 1
        drafts: list[int] = []
        while len(drafts) < depth:
            token = pick(logits, pos + 1 + len(drafts))
            drafts.append(token)
            if len(drafts) == depth:
                break
            step_logits, step_hidden = self.adapter.forward(hidden[None], [token], pos + len(drafts) - 1)
            logits, hidden = step_logits[-1], step_hidden[-1]
        return drafts
