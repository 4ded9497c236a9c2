"""Exact verification of a draft window: one target forward, serial-equivalent acceptance.

The window is [pending token] + drafts at positions [L, L + 1 + k), L = target.length(). Row i of
the forward predicts position L + 1 + i; its target token is drawn by the *same* sampler serial
decoding uses, keyed by the request seed and that absolute position, so the token a position
receives does not depend on whether it was reached serially or inside a window. Drafts are kept
while they equal the targets; the first mismatch (or the row after the last draft) contributes
its target token. Rows of rejected drafts are truncated at once.

Relaxed top-2 acceptance (a draft inside the target row's top two is kept even when the sampler
would have chosen the other) CHANGES THE OUTPUT: it is lossy, off unless asked for by name, and
every use is logged as such.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .target import Steps, Target, TargetContractError, Window, check_window

log = logging.getLogger("drafter.verify")

# sample(logits_row, position) -> token id; position is the absolute position of the token drawn.
Sampler = Callable[[torch.Tensor, int], int]


@dataclass
class VerifyResult:
    start: int               # position of the pending token (first row of the window)
    proposed: int            # drafts offered
    accepted: int            # drafts kept
    tokens: list[int]        # newly committed tokens: the kept drafts + one target token
    written: range           # cache rows this forward wrote (all past the canonical frontier)
    kept_rows: int           # rows kept: the pending token's row + one per kept draft
    beyond_frontier: bool    # True: no row written here may be offered to the prefix cache
    lossy: bool              # True only when relaxed acceptance changed a token
    output: WindowOutput     # the forward's output (sources read hidden states / taps from it)


def verify_window(
    target: Target,
    pending: int,
    drafts: Sequence[int],
    sample: Sampler,
    *,
    taps: Sequence[int] = (),
    relaxed_top2: bool = False,
) -> Steps[VerifyResult]:
    """Verify `drafts` after the pending token with ONE forward; commit the exact prefix. A generator of
    that forward (drafter.target.Steps): it yields its Window and is sent the output; `drive(target,
    verify_window(...))` runs it through target.forward, the batched runtime beside other windows."""
    start = target.length()
    frontier = target.canonical_frontier()
    if start < frontier:
        raise TargetContractError(
            f"verification window at position {start} would overwrite canonical prefill rows "
            f"(frontier {frontier}); decode must start at or after the frontier")
    window = [int(pending), *(int(d) for d in drafts)]
    out = yield Window(window, start, tuple(taps))
    check_window(target, out, start, len(window))

    committed: list[int] = []
    lossy = False
    accepted = 0
    for i, row in enumerate(out.logits):
        chosen = sample(row, start + 1 + i)
        if i == len(drafts):
            committed.append(chosen)          # the row after the last draft: a free token
            break
        draft = window[1 + i]
        if draft == chosen:
            committed.append(draft)
            accepted += 1
            continue
        if relaxed_top2 and draft in torch.topk(row, 2).indices.tolist():
            log.warning("LOSSY relaxed top-2 acceptance at position %d: kept draft %d over target %d",
                        start + 1 + i, draft, chosen)
            committed.append(draft)
            accepted += 1
            lossy = True
            continue
        committed.append(chosen)              # first mismatch: the target's token, then stop
        break

    kept_rows = accepted + 1
    if kept_rows < len(window):
        target.truncate(start + kept_rows)    # rows of rejected drafts never survive
    return VerifyResult(
        start=start, proposed=len(drafts), accepted=accepted, tokens=committed,
        written=range(start, start + len(window)), kept_rows=kept_rows,
        beyond_frontier=start >= frontier, lossy=lossy, output=out)
