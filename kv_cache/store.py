"""Host tier: nodes (full blocks and tails) in CPU memory under a byte budget, LRU, shared
prefixes stored once.

Entries form a tree (a node's parent is the block before it in its chain; chains that share a
prefix share those nodes). A node is inserted only under a present parent (or the root), and
evicting a node also evicts its descendants, so everything held is reachable from the root and
memory goes to nodes a lookup can return. Touches go from the tip of a chain to its root, so a
parent is always more recent than its children: the LRU victim is then a leaf and eviction trims
chains from their ends. Inserting a node removes the siblings it dominates (node.py); a tail that
an existing sibling dominates is not inserted.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable, Sequence

from .keys import Tokens
from .node import Node, dominates
from .rows import rows_nbytes

log = logging.getLogger("kv_cache")


class HostStore:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.evictions = 0  # nodes evicted for room, descendants included
        self.replaced = 0  # nodes removed because a sibling dominates them
        self._nodes: "OrderedDict[bytes, tuple[Node, int]]" = OrderedDict()  # front = least recently used
        self._children: dict[bytes, set[bytes]] = {}  # parent hash (the root included) -> child hashes

    def __contains__(self, h: bytes) -> bool:
        return h in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, h: bytes) -> Node | None:
        entry = self._nodes.get(h)
        return None if entry is None else entry[0]

    def children(self, parent: bytes) -> list[Node]:
        return [self._nodes[c][0] for c in self._children.get(parent, ())]

    def dominated(self, parent: bytes, tokens: Tokens) -> bool:
        """Whether a sibling under `parent` already dominates a node with these tokens."""
        return any(dominates(s.tokens, tokens) for s in self.children(parent))

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, tip first, so every parent ends up more recent than its child."""
        for h in reversed(hashes):
            if h in self._nodes:
                self._nodes.move_to_end(h)

    def put_chain(self, root: bytes, nodes: Sequence[Node]) -> int:
        """Insert the chain's absent nodes, in order (a node's rows may be None when it is
        already held). Makes room by evicting other chains; stores the longest prefix that fits
        the budget. Returns how many nodes were inserted."""
        if not nodes:
            return 0
        # the chain and its held ancestors stay: evicting an ancestor would orphan the chain
        protect = {n.hash for n in nodes} | self._ancestors(nodes[0].parent)
        # room only for what the loop below can insert: up to the first node absent without rows
        # or whose parent is not reachable (with a disk tier a chain may continue a prefix only the
        # disk holds; making room for it would evict other chains for nothing)
        new, reachable = [], {root}
        for node in nodes:
            if node.hash not in self._nodes:
                if node.rows is None or (node.parent not in reachable and node.parent not in self._nodes):
                    break
                new.append(node)
            reachable.add(node.hash)
        need = sum(rows_nbytes(n.rows) - self._bytes(self._victims(n)) for n in new)
        self._make_room(need, protect)
        inserted = 0
        for node in new:
            if self.dominated(node.parent, node.tokens):
                continue  # a tail a sibling already covers (a tail is last in its chain)
            victims = self._victims(node)
            size = rows_nbytes(node.rows)
            if self.used_bytes - self._bytes(victims) + size > self.budget_bytes:
                break
            for s in victims:
                self.replaced += self._remove(s.hash)
            self._nodes[node.hash] = (node, size)
            self._children.setdefault(node.parent, set()).add(node.hash)
            self.used_bytes += size
            inserted += 1
        self.touch_chain([n.hash for n in nodes])
        return inserted

    def _victims(self, node: Node) -> list[Node]:
        """The siblings `node` dominates (removed when it is inserted)."""
        return [s for s in self.children(node.parent) if dominates(node.tokens, s.tokens)]

    def _bytes(self, nodes: Iterable[Node]) -> int:
        return sum(self._nodes[n.hash][1] for n in nodes)

    def _ancestors(self, h: bytes) -> set[bytes]:
        out = set()
        while h in self._nodes and h not in out:
            out.add(h)
            h = self._nodes[h][0].parent
        return out

    def _make_room(self, need: int, protect: Iterable[bytes]) -> None:
        protect = set(protect)
        before, nodes = self.used_bytes, 0
        for victim in list(self._nodes):
            if self.used_bytes + need <= self.budget_bytes:
                break
            if victim in protect or victim not in self._nodes:
                continue
            nodes += self.evict(victim)
        if nodes:
            log.info("kv_cache host evict: %d chunks, %d bytes (budget %d)", nodes, before - self.used_bytes,
                     self.budget_bytes)

    def evict(self, h: bytes) -> int:
        """Remove a node and every descendant; returns the number of nodes removed."""
        removed = self._remove(h)
        self.evictions += removed
        if removed:
            log.debug("kv_cache host evict %s (+%d descendants)", h.hex()[:12], removed - 1)
        return removed

    def _remove(self, h: bytes) -> int:
        """Remove a node and its subtree (iteratively: chains can be thousands of blocks deep)."""
        removed, todo = 0, [h]
        while todo:
            x = todo.pop()
            entry = self._nodes.pop(x, None)
            if entry is None:
                continue
            node, size = entry
            self.used_bytes -= size
            removed += 1
            siblings = self._children.get(node.parent)
            if siblings is not None:
                siblings.discard(x)
                if not siblings:
                    del self._children[node.parent]
            todo.extend(self._children.pop(x, ()))
        return removed
