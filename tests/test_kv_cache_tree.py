"""The prefix cache's tree policy (kv_cache/tree.py): LRU that trims chains from the tip and never
orphans, subtree eviction, dominated siblings, chains it cannot insert. Every policy test runs on
both tiers, the host store and the disk tier, which differ in storage only: budgets are counted in
each tier's own node sizes (rows in memory; a file with its header on disk)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_cache import DiskTier, HostStore, Node, chain_hashes, diskfile
from kv_cache.keys import root_hash
from kv_cache.rows import rows_nbytes
from kv_cache.tree import CacheTree, Entry
from test_kv_cache_store import key, nodes_of

Tier = HostStore | DiskTier


class Tiers:
    """Makes a tier of the kind under test and sizes nodes the way that tier counts them."""

    def __init__(self, kind: str, folder: Path) -> None:
        self.kind, self.folder = kind, folder

    def size(self, node: Node) -> int:
        if self.kind == "host":
            return rows_nbytes(node.rows)
        pieces = diskfile.encode(json.loads(key().to_json()), node)
        return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)

    def sizes(self, nodes: list[Node]) -> int:
        return sum(self.size(n) for n in nodes)

    def make(self, budget: int) -> Tier:
        return HostStore(budget) if self.kind == "host" else DiskTier(self.folder, key(), budget, threads=1)


@pytest.fixture(params=["host", "disk"])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Tiers:
    return Tiers(request.param, tmp_path)


def test_lru_eviction_trims_chains_from_the_tip_and_never_orphans(tiers: Tiers):
    k = key()
    root = root_hash(k)
    a = list(range(100, 132))  # 4 blocks
    b = list(range(200, 232))  # 4 blocks, unrelated
    store = tiers.make(tiers.sizes(nodes_of(k, b)) + tiers.size(nodes_of(k, a)[0]))
    assert store.put_chain(root, nodes_of(k, a)) == 4
    assert store.put_chain(root, nodes_of(k, b)) == 4
    # b is newer; a's blocks were evicted tip first, and what remains of a is a prefix
    ha, hb = chain_hashes(k, a), chain_hashes(k, b)
    assert store.used_bytes <= store.budget_bytes
    assert all(h in store for h in hb)
    kept_a = [h in store for h in ha]
    assert kept_a == sorted(kept_a, reverse=True), "a kept block must have all its parents kept"
    assert sum(kept_a) == 1 and store.evictions == 3


def test_a_chain_it_cannot_insert_evicts_nothing(tiers: Tiers):
    """A store may continue a prefix only the other tier holds: the chain then starts at a parent
    this tier does not hold, and none of its nodes can be inserted. Other chains must not be
    evicted to make room for them (they were once: the host tier drained)."""
    k = key()
    root = root_hash(k)
    y = list(range(200, 232))  # 4 blocks: the budget
    store = tiers.make(tiers.sizes(nodes_of(k, y)))
    assert store.put_chain(root, nodes_of(k, y)) == 4
    x = list(range(100, 148))  # 6 blocks, of which this tier gets the last 2 (the first 4 elsewhere)
    assert store.put_chain(root, nodes_of(k, x)[4:]) == 0
    assert store.evictions == 0 and all(h in store for h in chain_hashes(k, y))
    # a chain that can be inserted still makes its room
    assert store.put_chain(root, nodes_of(k, x)[:2]) == 2 and store.evictions == 2


def test_budget_eviction_with_tails_takes_the_leaf_first(tiers: Tiers):
    k = key()
    root = root_hash(k)
    a = list(range(100, 120))  # 2 blocks + a 4-token tail
    b = list(range(300, 316))  # 2 blocks
    store = tiers.make(tiers.sizes(nodes_of(k, a)) + tiers.sizes(nodes_of(k, b)))
    assert store.put_chain(root, nodes_of(k, a)) == 3
    assert store.used_bytes == tiers.sizes(nodes_of(k, a))
    store.touch_chain(chain_hashes(k, a))  # a's blocks newer than its tail: the tail is a's LRU leaf
    one_more = nodes_of(k, b + [1, 2, 3])  # 2 blocks + a 3-token tail: one tail over budget
    assert store.put_chain(root, one_more) == 3
    tail_a = nodes_of(k, a)[-1].hash
    assert tail_a not in store and all(h in store for h in chain_hashes(k, a))
    assert store.evictions == 1 and store.used_bytes <= store.budget_bytes


def test_evicting_a_parent_evicts_its_descendants_and_shared_prefix_is_stored_once(tiers: Tiers):
    k = key()
    root = root_hash(k)
    store = tiers.make(1 << 20)
    base = list(range(24))
    x, y = base + [1] * 8, base + [2] * 8 + [5, 6]  # y: another block 3 and a tail
    store.put_chain(root, nodes_of(k, x))
    ny = nodes_of(k, y)
    want = tiers.sizes(nodes_of(k, x)) + tiers.sizes(ny[3:])
    for n in ny[:3]:
        n.rows = None  # already held: no rows needed
    assert store.put_chain(root, ny) == 2
    assert len(store) == 6 and store.used_bytes == want
    assert store.evict(chain_hashes(k, x)[1]) == 5  # block 1, block 2, both blocks 3 and the tail
    assert len(store) == 1 and chain_hashes(k, x)[0] in store


def test_dominated_siblings_are_replaced_and_never_inserted(tiers: Tiers):
    k = key()
    root = root_hash(k)
    store = tiers.make(1 << 20)
    p = list(range(50, 66))  # 2 blocks
    short, longer, other = nodes_of(k, p, 11)[-1], nodes_of(k, p, 14)[-1], nodes_of(k, p[:10] + [7, 7])[-1]
    store.put_chain(root, nodes_of(k, p, 11))  # block 0 + tail [8, 11)
    assert short.hash in store
    assert store.put_chain(root, [other]) == 1  # [8, 12) differs at 10: a sibling, not dominated
    assert store.put_chain(root, [longer]) == 1  # [8, 14) extends [8, 11): replaces it
    assert short.hash not in store and other.hash in store and store.replaced == 1
    assert store.put_chain(root, [nodes_of(k, p, 11)[-1]]) == 0  # dominated: not inserted again
    assert store.put_chain(root, nodes_of(k, p)) == 1  # the full block 1 dominates [8, 14)
    assert longer.hash not in store and other.hash in store and store.replaced == 2
    assert store.evictions == 0  # replacement is not a budget eviction
    assert store.used_bytes == tiers.sizes(nodes_of(k, p)) + tiers.size(other)


def test_chain_larger_than_budget_keeps_its_longest_prefix(tiers: Tiers):
    k = key()
    t = list(range(43))
    store = tiers.make(tiers.sizes(nodes_of(k, t)[:2]) + 1)
    assert store.put_chain(root_hash(k), nodes_of(k, t)) == 2
    h = chain_hashes(k, t)
    assert h[0] in store and h[1] in store and h[2] not in store


def test_making_room_for_a_chain_never_evicts_its_held_ancestors(tiers: Tiers):
    """The chain's ancestors are older than the other chains here, yet evicting one would orphan
    the chain being stored: room comes from the other chain."""
    k = key()
    root = root_hash(k)
    a = list(range(100, 124))  # 3 blocks
    b = list(range(200, 216))  # 2 blocks, newer
    store = tiers.make(tiers.sizes(nodes_of(k, a)) + tiers.sizes(nodes_of(k, b)))
    store.put_chain(root, nodes_of(k, a)[:2])
    store.put_chain(root, nodes_of(k, b))
    store.put_chain(root, nodes_of(k, a)[2:])  # fits: nothing evicted
    longer = nodes_of(k, a + list(range(500, 516)))  # a's 3 blocks held, 2 more blocks
    assert store.put_chain(root, longer[3:]) == 2
    assert all(h in store for h in chain_hashes(k, a)) and store.evictions == 2
    assert not any(h in store for h in chain_hashes(k, b))


# ---- the tree alone ------------------------------------------------------------------------------
def _tree_of(chains: list[list[Node]]) -> CacheTree[str]:
    tree: CacheTree[str] = CacheTree()
    for chain in chains:
        for n in chain:
            tree.add(n.hash, Entry(n.parent, n.tokens, len(n.tokens), n.hash.hex()))
    return tree


def test_touching_a_chain_makes_its_root_newest_and_its_tip_the_first_victim():
    k = key()
    a, b = nodes_of(k, list(range(24))), nodes_of(k, list(range(300, 316)))
    tree = _tree_of([a, b])
    tree.touch_chain([n.hash for n in b])
    touched = tree.touch_chain([n.hash for n in a])
    assert [h for h, _ in touched] == [n.hash for n in reversed(a)]  # tip first
    order = [h for h, _ in tree.items()]
    assert order == [n.hash for n in reversed(b)] + [n.hash for n in reversed(a)]
    freed: list[bytes] = []
    evicted = tree.make_room(1, tree.used_bytes, protect=(), free=lambda removed: freed.extend(h for h, _ in removed))
    assert evicted == 1 and freed == [b[-1].hash]  # the least recently used chain's tip
    evicted = tree.make_room(1, tree.used_bytes, protect={b[0].hash}, free=lambda removed: freed.extend(h for h, _ in removed))
    assert evicted == 1 and freed[1:] == [a[-1].hash]  # b's root is protected: the next leaf goes


def test_new_nodes_stop_at_a_node_without_rows_or_an_unreachable_parent():
    k = key()
    root = root_hash(k)
    chain = nodes_of(k, list(range(40)))
    tree = _tree_of([chain[:2]])
    assert [n.hash for n in tree.new_nodes(root, chain)] == [n.hash for n in chain[2:]]
    chain[3].rows = None
    assert [n.hash for n in tree.new_nodes(root, chain)] == [chain[2].hash]
    assert tree.new_nodes(root, chain[3:]) == []  # its parent (block 2) is not held
    assert tree.protected(chain[2:]) == {n.hash for n in chain}


def test_a_removed_subtree_frees_its_bytes_and_the_index():
    k = key()
    x, y = nodes_of(k, list(range(24)) + [1] * 8), nodes_of(k, list(range(24)) + [2] * 8)
    tree = _tree_of([x, y[3:]])
    removed = tree.remove_subtree(x[1].hash)
    assert {h for h, _ in removed} == {x[1].hash, x[2].hash, x[3].hash, y[3].hash}
    assert removed[0][0] == x[1].hash
    assert len(tree) == 1 and tree.used_bytes == len(x[0].tokens)
    assert tree.children(x[0].hash) == [] and [h for h, _ in tree.children(x[0].parent)] == [x[0].hash]

