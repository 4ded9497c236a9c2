"""The target protocol: what the drafter needs from a model that owns a KV (or state) cache.

Conventions (every module of the drafter relies on them):

- The cache holds rows for positions [0, length()). The request's *pending* token (committed to
  the reply but not yet run through the model) sits at position length().
- `forward(tokens, start)` runs one forward over the window of tokens at absolute positions
  [start, start + len(tokens)) on top of the cache, writes their rows, and returns one logits row
  per position: row i holds the distribution of the token at position start + i + 1.
  `start` must equal length(): windows always continue the cache.
- `truncate(length)` discards every row at position >= length (rejected drafts).
- `canonical_frontier()` is where the prefix cache's reusable extent ends (the canonical prefill
  frontier). Rows written by decode or draft verification lie at or beyond it and must never be
  offered for reuse; the verifier checks and reports this.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Protocol, Sequence, TypeVar, runtime_checkable

import torch


@dataclass
class WindowOutput:
    """What one forward over a window returns.

    logits: [k, vocab] float; row i predicts position start + i + 1.
    hidden: [k, H] the target's last hidden state per row, as the family's MTP layer consumes it
            (None when the target does not expose it).
    taps:   layer id -> [k, H] output of that target layer per row (only the layers asked for).
    """

    start: int
    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    taps: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.logits.shape[0])


@runtime_checkable
class Target(Protocol):
    """A model with a truncatable cache, seen by one request."""

    vocab_size: int

    def length(self) -> int:
        """Number of cache rows written (positions [0, length()))."""
        ...

    def forward(self, tokens: Sequence[int], start: int, *, taps: Sequence[int] = ()) -> WindowOutput:
        """One forward over tokens at positions [start, start + len(tokens)); start == length()."""
        ...

    def truncate(self, length: int) -> None:
        """Discard rows at positions >= length."""
        ...

    def canonical_frontier(self) -> int:
        """End of the prefix cache's reusable (canonical prefill) extent for this request."""
        ...


@runtime_checkable
class TargetHeads(Protocol):
    """Optional: the target's token embedding and LM head, for drafters that share them (DFlash2)."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n] ids -> [n, H] float embeddings."""
        ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] post-norm hidden -> [n, vocab] float logits."""
        ...


class TargetContractError(RuntimeError):
    """A target broke the window contract (wrong start, wrong row count)."""


def check_window(target: Target, out: WindowOutput, start: int, count: int) -> None:
    """Fail loudly when a target returns something other than one logits row per window token."""
    if out.rows != count:
        raise TargetContractError(
            f"{type(target).__name__}.forward returned {out.rows} logits rows for a window of {count} "
            f"tokens at position {start}; the contract is one row per token")
    if out.start != start:
        raise TargetContractError(
            f"{type(target).__name__}.forward reported start {out.start}, asked for {start}")


@dataclass(frozen=True)
class Window:
    """A forward a loop asks of its target: tokens at positions [start, start + len(tokens)), with taps."""

    tokens: list[int]
    start: int
    taps: tuple[int, ...] = ()


Result = TypeVar("Result")
# a loop written as a generator: it yields each Window it needs, is sent the target's WindowOutput for it,
# and returns its result. Whoever drives it decides how the forward runs: alone (drive) or in a batch
# beside other sequences' windows (glm53/runtime/drafted.py), with no thread in between.
Steps = Generator[Window, WindowOutput, Result]


def drive(target: Target, steps: "Steps[Result]") -> Result:
    """Run a loop's windows one by one through target.forward; the loop's result."""
    try:
        window = next(steps)
        while True:
            window = steps.send(target.forward(window.tokens, window.start, taps=window.taps))
    except StopIteration as done:
        return done.value
