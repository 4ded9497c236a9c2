"""A stored node: one span of a prefix, a full block [kB, (k+1)B) or a tail [kB, frontier).

Nodes form a tree per key: a node's parent is the full block before it (the key's root for
block 0). Siblings share a parent and differ in their tokens; a tail is always a leaf (no chain
hash of a full block has it as parent). A node *dominates* a sibling whose tokens are a strict
prefix of its own: it serves every prompt the sibling serves, for at least as many tokens, so
the sibling is redundant (only tails can be dominated: siblings hold at most B tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .keys import Tokens
from .rows import Rows


@dataclass(eq=False)
class Node:
    hash: bytes
    parent: bytes
    tokens: Tokens  # int64 ids of this node's positions
    rows: Rows | None = None  # this rank's rows of those positions; None: not at hand (already stored)

    @property
    def length(self) -> int:
        return len(self.tokens)


def dominates(a: Tokens, b: Tokens) -> bool:
    """Whether a node with tokens `a` dominates a sibling with tokens `b` (b a strict prefix of a)."""
    return len(b) < len(a) and bool(np.array_equal(a[:len(b)], b))
