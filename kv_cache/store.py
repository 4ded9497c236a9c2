"""Host tier: nodes (full blocks and tails) in CPU memory under a byte budget, LRU, shared
prefixes stored once.

Which nodes it keeps, replaces and evicts is tree.py's policy, shared with the disk tier; this
module holds the rows and counts their bytes.
"""
from __future__ import annotations

import logging
from typing import Sequence

from .keys import Tokens
from .node import Node
from .rows import rows_nbytes
from .tree import CacheTree, Entry

log = logging.getLogger("kv_cache")


class HostStore:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.evictions = 0  # nodes evicted for room, descendants included
        self.replaced = 0  # nodes removed because a sibling dominates them
        self._tree: CacheTree[Node] = CacheTree()

    @property
    def used_bytes(self) -> int:
        return self._tree.used_bytes

    def __contains__(self, h: bytes) -> bool:
        return h in self._tree

    def __len__(self) -> int:
        return len(self._tree)

    def get(self, h: bytes) -> Node | None:
        entry = self._tree.get(h)
        return None if entry is None else entry.payload

    def nodes(self) -> list[Node]:
        """Every node held, least recently used first."""
        return [e.payload for _, e in self._tree.items()]

    def children(self, parent: bytes) -> list[Node]:
        return [e.payload for _, e in self._tree.children(parent)]

    def dominated(self, parent: bytes, tokens: Tokens) -> bool:
        """Whether a sibling under `parent` already dominates a node with these tokens."""
        return self._tree.dominated(parent, tokens)

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, tip first, so every parent ends up more recent than its child."""
        self._tree.touch_chain(hashes)

    def put_chain(self, root: bytes, nodes: Sequence[Node]) -> int:
        """Insert the chain's absent nodes, in order (a node's rows may be None when it is
        already held). Makes room by evicting other chains; stores the longest prefix that fits
        the budget. Returns how many nodes were inserted."""
        if not nodes:
            return 0
        tree = self._tree
        new = tree.new_nodes(root, nodes)
        need = sum(rows_nbytes(n.rows) - self._bytes(tree.replaced_by(n.parent, n.tokens)) for n in new)
        self._make_room(need, tree.protected(nodes))
        inserted = 0
        for node in new:
            if tree.dominated(node.parent, node.tokens):
                continue  # a tail a sibling already covers (a tail is last in its chain)
            victims = tree.replaced_by(node.parent, node.tokens)
            size = rows_nbytes(node.rows)
            if tree.used_bytes - self._bytes(victims) + size > self.budget_bytes:
                break
            for v in victims:
                self.replaced += len(tree.remove_subtree(v))
            tree.add(node.hash, Entry(node.parent, node.tokens, size, node))
            inserted += 1
        tree.touch_chain([n.hash for n in nodes])
        return inserted

    def _bytes(self, hashes: list[bytes]) -> int:
        return sum(self._tree.get(h).size for h in hashes)

    def _make_room(self, need: int, protect: set[bytes]) -> None:
        before = self.used_bytes
        nodes = self._tree.make_room(need, self.budget_bytes, protect, free=lambda removed: None)
        self.evictions += nodes
        if nodes:
            log.info("kv_cache host evict: %d chunks, %d bytes (budget %d)", nodes, before - self.used_bytes,
                     self.budget_bytes)

    def evict(self, h: bytes) -> int:
        """Remove a node and every descendant; returns the number of nodes removed."""
        removed = len(self._tree.remove_subtree(h))
        self.evictions += removed
        if removed:
            log.debug("kv_cache host evict %s (+%d descendants)", h.hex()[:12], removed - 1)
        return removed
