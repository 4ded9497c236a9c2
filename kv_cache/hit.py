"""What a lookup returns: how many prompt tokens are reused and how to put their rows back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .rows import Rows


@dataclass(frozen=True)
class Piece:
    """Restore positions [start, start + length) from one stored node. `start` is a block start;
    `rows` are the node's rows as stored, which may cover more positions than `length` (the
    engine takes the leading slots)."""

    start: int
    length: int
    rows: Rows
    source: str  # "host" or "disk"


@dataclass
class Hit:
    """Rows [0, live_tokens) are already in the engine's buffers (keep them, drop the rest);
    `pieces` cover [live_tokens, reused_tokens) contiguously, in order, and must be written back
    with `restore`. The engine then prefills [reused_tokens, len(prompt))."""

    reused_tokens: int = 0
    live_tokens: int = 0
    pieces: list[Piece] = field(default_factory=list)

    def restore(self, write_rows: Callable[[int, int, Rows], None]) -> None:
        """write_rows(start, length, rows) per piece, in order."""
        for p in self.pieces:
            write_rows(p.start, p.length, p.rows)

    @property
    def sources(self) -> list[str]:
        return [p.source for p in self.pieces]
