"""What a lookup returns: how many prompt tokens are reused and how to put their rows back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .rows import Rows

WriteRows = Callable[[int, int, Rows], None]


@dataclass(frozen=True)
class Piece:
    """Restore positions [start, start + length) from one stored node. `start` is a block start;
    `rows` are a host node's rows as stored, which may cover more positions than `length` (the
    engine takes the leading slots); a disk node's rows are None until `Hit.restore` reads its
    file (`node`: its chain hash)."""

    start: int
    length: int
    rows: Rows | None
    source: str  # "host" or "disk"
    node: bytes = b""


@dataclass
class Hit:
    """Rows [0, live_tokens) are already in the engine's buffers (keep them, drop the rest);
    `pieces` cover [live_tokens, reused_tokens) contiguously, in order, and must be written back
    with `restore`, which says how far they really reach (a disk file that fails verification
    ends them early). The engine then prefills from there to len(prompt)."""

    reused_tokens: int = 0
    live_tokens: int = 0
    pieces: list[Piece] = field(default_factory=list)
    # set by the cache: writes the pieces, reading disk nodes as it goes (restore.Restorer.restore;
    # always set when there are pieces), and settles the result (every rank's minimum, the stats)
    reader: Callable[[list[Piece], WriteRows, object], int] | None = field(default=None, repr=False, compare=False)
    settle: Callable[["Hit", int], int] | None = field(default=None, repr=False, compare=False)
    # set by the cache on a counted hit: takes it out of the stats if restore raises
    abandon: Callable[["Hit"], None] | None = field(default=None, repr=False, compare=False)

    def restore(self, write_rows: WriteRows, device: object = None) -> int:
        """write_rows(start, length, rows) per piece, in order (rows valid during the call only:
        copy them; `device`: where the engine's cache lives, so disk rows go there in one transfer
        per file). Returns the reused length the engine keeps: reused_tokens, or less where a disk
        file was a miss (agreed over ranks)."""
        try:
            end = self.reader(self.pieces, write_rows, device) if self.pieces else self.reused_tokens
            return self.settle(self, end) if self.settle is not None else end
        except BaseException:
            if self.abandon is not None:
                self.abandon(self)
            raise

    @property
    def sources(self) -> list[str]:
        return [p.source for p in self.pieces]
