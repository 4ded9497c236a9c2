"""The fixed prefill grid: chunk k covers absolute positions [k*C, (k+1)*C).

Boundaries are a function of absolute position only, never of the prompt's length or of where a
resume begins. A resume at a grid boundary therefore prefills exactly the chunks a cold run would
have prefilled from there on, with the same tiling, so every row is computed by the same
arithmetic (see DESIGN.md).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResumePlan:
    """How to prefill `length` tokens when rows [0, reused) are restored."""

    reused: int
    length: int
    chunks: tuple[tuple[int, int], ...]  # [start, end) pieces to prefill, in order

    @property
    def prefill_tokens(self) -> int:
        return self.length - self.reused


@dataclass(frozen=True)
class Grid:
    chunk_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r} "
                             "(set TF_GLM53_PREFILL_CHUNK to a positive integer)")

    def chunk_of(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return position // self.chunk_size

    def chunk_range(self, k: int) -> tuple[int, int]:
        if k < 0:
            raise ValueError(f"chunk index must be >= 0, got {k}")
        return k * self.chunk_size, (k + 1) * self.chunk_size

    def floor(self, n: int) -> int:
        """The largest grid boundary <= n."""
        return (n // self.chunk_size) * self.chunk_size

    def full_chunks(self, n: int) -> int:
        """How many whole chunks lie in [0, n)."""
        return n // self.chunk_size

    def pieces(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """[start, end) cut at every grid boundary: the prefill pieces, in order."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got start={start} end={end}")
        out = []
        pos = start
        while pos < end:
            stop = min(self.floor(pos) + self.chunk_size, end)
            out.append((pos, stop))
            pos = stop
        return tuple(out)

    def resume_plan(self, reused: int, length: int) -> ResumePlan:
        """Prefill [reused, length) on the grid. `reused` off a boundary yields a first partial
        piece [reused, next boundary), which a cold run computed as part of a longer piece;
        callers that need bitwise reuse pass a boundary (see `reuse_length`)."""
        if not 0 <= reused <= length:
            raise ValueError(f"need 0 <= reused <= length, got reused={reused} length={length}")
        return ResumePlan(reused, length, self.pieces(reused, length))

    def reuse_length(self, common_prefix: int, frontier: int, prompt_length: int,
                     boundary_only: bool = True) -> int:
        """Rows a new prompt may take over: within the common prefix, within the canonical
        prefill frontier, leaving at least one token to prefill (the last position's logits
        must be computed), and floored to the grid when `boundary_only`."""
        n = max(0, min(common_prefix, frontier, prompt_length - 1))
        return self.floor(n) if boundary_only else n
