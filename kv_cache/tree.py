"""The prefix cache's tree policy, one for both tiers (store.py holds rows in host memory, disk.py
files): which nodes a tier keeps, which it replaces, which it evicts. The tiers differ in storage
only; each keeps its payload (rows, a file's entry) in the tree beside the policy's fields.

- A tree per key: a node's parent is the full block before it (the key's root for block 0), so
  chains that share a prefix share those nodes. A node joins only under a present parent (or the
  root), and evicting a node evicts its subtree: everything held is reachable from the root, and
  the bytes go to nodes a lookup can return.
- LRU with parents newer than children: a chain is touched tip first, so the least recently used
  node is a leaf and eviction trims chains from their ends.
- Domination (node.py): a node replaces the siblings it dominates; a tail a sibling dominates is
  not stored.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .keys import Tokens
from .node import Node, dominates

Payload = TypeVar("Payload")


@dataclass
class Entry(Generic[Payload]):
    parent: bytes
    tokens: Tokens
    size: int  # the bytes this node costs its tier's budget
    payload: Payload


class CacheTree(Generic[Payload]):
    """Nodes by chain hash with their parent/child index, LRU order and byte count. Not thread-safe:
    a tier that is shared across threads holds its own lock around every call."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, Entry[Payload]] = OrderedDict()  # front = least recently used
        self._children: dict[bytes, set[bytes]] = {}  # parent hash (the root included) -> child hashes
        self.used_bytes = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, h: bytes) -> Entry[Payload] | None:
        return self._entries.get(h)

    def items(self) -> list[tuple[bytes, Entry[Payload]]]:
        return list(self._entries.items())

    def children(self, parent: bytes) -> list[tuple[bytes, Entry[Payload]]]:
        return [(c, self._entries[c]) for c in self._children.get(parent, ())]

    # ---- domination ---------------------------------------------------------------------------
    def dominated(self, parent: bytes, tokens: Tokens) -> bool:
        """Whether a sibling under `parent` already dominates a node with these tokens."""
        return any(dominates(e.tokens, tokens) for _, e in self.children(parent))

    def replaced_by(self, parent: bytes, tokens: Tokens) -> list[bytes]:
        """The siblings a node with these tokens dominates: removed when it joins."""
        return [c for c, e in self.children(parent) if dominates(tokens, e.tokens)]

    # ---- what a chain adds -------------------------------------------------------------------
    def new_nodes(self, root: bytes, nodes: Sequence[Node]) -> list[Node]:
        """The chain's absent nodes that can join, in order: up to the first absent node without
        rows or whose parent would not be reachable (a chain may continue a prefix only another
        tier holds; room made for it would evict other chains for nothing)."""
        new, reachable = [], {root}
        for node in nodes:
            if node.hash not in self._entries:
                if node.rows is None or (node.parent not in reachable and node.parent not in self._entries):
                    break
                new.append(node)
            reachable.add(node.hash)
        return new

    def protected(self, nodes: Sequence[Node]) -> set[bytes]:
        """What making room for a chain must not evict: the chain and its held ancestors
        (evicting an ancestor would orphan the chain)."""
        out = {n.hash for n in nodes}
        if nodes:
            h = nodes[0].parent
            while h in self._entries and h not in out:
                out.add(h)
                h = self._entries[h].parent
        return out

    # ---- membership and order ----------------------------------------------------------------
    def add(self, h: bytes, entry: Entry[Payload]) -> None:
        """Join as the most recently used node (replacing an entry under the same hash)."""
        self.discard(h)
        self._entries[h] = entry
        self._children.setdefault(entry.parent, set()).add(h)
        self.used_bytes += entry.size

    def discard(self, h: bytes) -> Entry[Payload] | None:
        """Take one node out of the index (its children stay: callers remove whole subtrees)."""
        entry = self._entries.pop(h, None)
        if entry is None:
            return None
        self.used_bytes -= entry.size
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[entry.parent]
        return entry

    def remove_subtree(self, h: bytes) -> list[tuple[bytes, Entry[Payload]]]:
        """Remove a node and every descendant (iteratively: chains can be thousands of blocks
        deep); returns what was removed, the node first, for the tier to free its storage."""
        removed, todo = [], [h]
        while todo:
            x = todo.pop()
            todo.extend(self._children.get(x, ()))
            entry = self.discard(x)
            if entry is not None:
                removed.append((x, entry))
        return removed

    def touch_chain(self, hashes: Sequence[bytes]) -> list[tuple[bytes, Entry[Payload]]]:
        """Mark a chain used, tip first, so every parent ends up more recent than its child.
        Returns the touched nodes in that order (a tier that persists the order records it)."""
        touched = []
        for h in reversed(hashes):
            entry = self._entries.get(h)
            if entry is not None:
                self._entries.move_to_end(h)
                touched.append((h, entry))
        return touched

    def make_room(self, need: int, budget: int, protect: Iterable[bytes],
                  free: Callable[[list[tuple[bytes, Entry[Payload]]]], None]) -> int:
        """Evict least recently used subtrees (never a protected node) until `need` more bytes fit
        the budget; `free` releases each evicted subtree's storage. Returns the nodes evicted."""
        protect = set(protect)
        evicted = 0
        for victim in list(self._entries):
            if self.used_bytes + need <= budget:
                break
            if victim in protect or victim not in self._entries:
                continue
            removed = self.remove_subtree(victim)
            free(removed)
            evicted += len(removed)
        return evicted
