"""Host tier: chunk rows in CPU memory under a byte budget, LRU, shared prefixes stored once.

Entries form a tree (a chunk's parent is the chunk before it in its chain; chains that share a
prefix share those nodes). Reachability: a lookup walks a chain from chunk 0 and stops at the
first absent chunk, so a chunk whose parent is gone can never be returned. To keep memory for
reachable chunks only, evicting a chunk also evicts all its descendants, and touches go from the
tip of a chain to its root so a parent is always more recent than its children: the LRU victim
is then a leaf and eviction trims chains from their ends.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .rows import Rows, rows_nbytes

log = logging.getLogger("kv_cache")


@dataclass
class _Node:
    parent: bytes
    rows: Rows
    nbytes: int
    children: set[bytes] = field(default_factory=set)


class HostStore:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._nodes: "OrderedDict[bytes, _Node]" = OrderedDict()  # front = least recently used

    def __contains__(self, h: bytes) -> bool:
        return h in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, h: bytes) -> Rows | None:
        node = self._nodes.get(h)
        return None if node is None else node.rows

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, tip first, so every parent ends up more recent than its child."""
        for h in reversed(hashes):
            if h in self._nodes:
                self._nodes.move_to_end(h)

    def put_chain(self, root: bytes, hashes: Sequence[bytes], rows: Sequence[Rows | None]) -> int:
        """Insert the chain's absent chunks (rows[i] is None for chunks already present).
        Makes room by evicting other chains; stores the longest prefix that fits the budget.
        Returns how many chunks were inserted."""
        protect = set(hashes)
        need = sum(rows_nbytes(r) for h, r in zip(hashes, rows) if r is not None and h not in self._nodes)
        self._make_room(need, protect)
        inserted = 0
        parent = root
        for h, r in zip(hashes, rows):
            if h not in self._nodes:
                if r is None:
                    break  # caller claimed present, but it is gone: the rest is unreachable
                if parent != root and parent not in self._nodes:
                    break
                size = rows_nbytes(r)
                if self.used_bytes + size > self.budget_bytes:
                    break
                self._nodes[h] = _Node(parent, r, size)
                if parent in self._nodes:
                    self._nodes[parent].children.add(h)
                self.used_bytes += size
                inserted += 1
            parent = h
        self.touch_chain(hashes)
        return inserted

    def _make_room(self, need: int, protect: Iterable[bytes]) -> None:
        protect = set(protect)
        before, chunks = self.used_bytes, 0
        for victim in list(self._nodes):
            if self.used_bytes + need <= self.budget_bytes:
                break
            if victim in protect or victim not in self._nodes:
                continue
            chunks += self.evict(victim)
        if chunks:
            log.info("kv_cache host evict: %d chunks, %d bytes (budget %d)", chunks, before - self.used_bytes,
                     self.budget_bytes)

    def evict(self, h: bytes) -> int:
        """Remove a chunk and every descendant; returns the number of chunks removed."""
        node = self._nodes.pop(h, None)
        if node is None:
            return 0
        self.used_bytes -= node.nbytes
        self.evictions += 1  # chunks evicted, descendants included
        parent = self._nodes.get(node.parent)
        if parent is not None:
            parent.children.discard(h)
        removed = 1
        for child in list(node.children):
            removed += self.evict(child)
        log.debug("kv_cache host evict %s (+%d descendants)", h.hex()[:12], removed - 1)
        return removed
