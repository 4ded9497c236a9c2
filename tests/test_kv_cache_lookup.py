"""Token-granular lookup: a partial match inside a block, tails (extended, longer or shorter than
what the prompt needs), an edit in block 0, live rows against stored nodes, the boundary floor,
and DCP agreement over several PrefixCache instances whose stored extents differ."""
from __future__ import annotations

import threading

import pytest
import torch

from kv_cache import CacheKey, PrefixCache
from kv_cache.keys import token_array

B = 8


def key(**kw) -> CacheKey:
    base = dict(model_revision="r", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                dcp=False, chunk_size=B, device_kind="cpu", kit_version="t")
    base.update(kw)
    return CacheKey(**base)


def rows_of(tokens: list[int]):
    """rows_for(start, stop): position p's row is a function of tokens[:p + 1]."""
    t = torch.tensor(tokens, dtype=torch.int64)
    acc = (t * torch.arange(1, len(tokens) + 1)).cumsum(0)
    return lambda a, b: {"latent.0": acc[a:b, None].repeat(1, 3)}


def restored(hit, prompt: list[int], live: list[int] | None = None) -> torch.Tensor:
    """The rows the engine holds after the hit (live rows, then each piece's leading slots)."""
    parts = [rows_of(live or prompt)(0, hit.live_tokens)["latent.0"]]

    def write(start: int, n: int, rows):
        assert start == sum(len(p) for p in parts)
        parts.append(rows["latent.0"][:n].clone())  # valid during the call only
    hit.restore(write)
    return torch.cat(parts)


def exact(hit, prompt: list[int], live: list[int] | None = None) -> bool:
    got = restored(hit, prompt, live)
    return len(got) == hit.reused_tokens and torch.equal(got, rows_of(prompt)(0, hit.reused_tokens)["latent.0"])


def spans(hit) -> list[tuple[int, int]]:
    return [(p.start, p.length) for p in hit.pieces]


P = [(i * 7919) % 1000 + 1 for i in range(45)]  # 5 blocks + a 5-token tail


def stored(prompt=P, frontier=None, **kw) -> PrefixCache:
    cache = PrefixCache(key(), host_bytes=1 << 20, **kw)
    cache.store(prompt, len(prompt) if frontier is None else frontier, rows_of(prompt))
    return cache


def test_an_edit_inside_a_block_reuses_exactly_up_to_the_edit():
    cache = stored()
    for e in (17, 20, 23, 24, 41):
        p = P[:e] + [0] + P[e + 1:] + [5, 6]
        hit = cache.lookup(p)
        assert hit.reused_tokens == e and exact(hit, p), e
        last = hit.pieces[-1]
        assert (last.start, last.length) == ((e // B * B, e % B) if e % B else (e - B, B)), e
    # the partial piece carries the whole stored block's rows: the engine takes the leading slots
    hit = cache.lookup(P[:20] + [0] * 30)
    assert spans(hit) == [(0, 8), (8, 8), (16, 4)] and hit.pieces[-1].rows["latent.0"].shape[0] == B


def test_an_edit_in_the_first_block():
    cache = stored()
    p = P[:3] + [0] + P[4:]
    hit = cache.lookup(p)
    assert hit.reused_tokens == 3 and spans(hit) == [(0, 3)] and exact(hit, p)
    assert cache.lookup([0] + P[1:]).reused_tokens == 0


def test_a_prompt_that_extends_a_stored_tail_reuses_the_whole_tail():
    cache = stored()
    for p in (P + [9], P + list(range(40)), P + [P[-1]] * 3):
        hit = cache.lookup(p)
        assert hit.reused_tokens == 45 and spans(hit)[-1] == (40, 5) and exact(hit, p)


def test_a_prompt_ending_inside_a_tail_or_a_tail_shorter_than_the_remainder():
    cache = stored()
    # the prompt's remainder [40, 43) is shorter than the tail [40, 45): its leading slots
    hit = cache.lookup(P[:43])
    assert hit.reused_tokens == 42 and spans(hit)[-1] == (40, 2) and exact(hit, P[:43])  # last token left
    # the tail [40, 45) shorter than the remainder [40, 48) of a prompt that diverges after it
    p = P + [1, 2, 3] + list(range(10))
    hit = cache.lookup(p)
    assert hit.reused_tokens == 45 and exact(hit, p)


def test_the_best_sibling_wins_and_an_extended_tail_replaces_the_shorter_one():
    cache = stored()
    q = P[:42] + [7, 7, 7, 7, 7, 7]  # block 5 = [40, 48) differs from the tail at 42
    cache.store(q, len(q), rows_of(q))
    for p, want in ((P + [1], 45), (q + [1], 48), (P[:44] + [7, 8], 44), (P[:42] + [7, 7, 0], 44)):
        hit = cache.lookup(p)
        assert hit.reused_tokens == want and exact(hit, p), p[40:]
    longer = P + [3, 3]  # [40, 47) extends [40, 45): the shorter tail is replaced
    cache.store(longer, len(longer), rows_of(longer))
    assert cache.host.replaced == 1 and len(cache.host) == 5 + 2
    assert cache.lookup(longer + [0]).reused_tokens == 47
    assert cache.lookup(P + [0]).reused_tokens == 45  # the longer tail serves the shorter prompt


def test_live_rows_against_stored_nodes():
    live = P[:30]
    cache = stored(P, frontier=16)  # stored: [0, 16) only
    hit = cache.lookup(P + [1], live_tokens=live, live_frontier=30)
    assert (hit.reused_tokens, hit.live_tokens, hit.pieces) == (30, 30, [])  # live is longer: no copy
    cache = stored()  # stored: [0, 45)
    hit = cache.lookup(P + [1], live_tokens=live, live_frontier=30)
    # live rows kept up to their block start (24), the rest restored block by block
    assert (hit.reused_tokens, hit.live_tokens) == (45, 24) and spans(hit) == [(24, 8), (32, 8), (40, 5)]
    assert exact(hit, P + [1], live)
    # rows written by decode past the frontier are never kept
    hit = cache.lookup(P[:30] + [0] * 5, live_tokens=live + [9, 9], live_frontier=28)
    assert hit.reused_tokens == 30 and hit.live_tokens == 24 and exact(hit, P[:30] + [0] * 5, live)
    # live on a block start: the pieces start right there
    hit = cache.lookup(P + [1], live_tokens=P[:32], live_frontier=32)
    assert hit.live_tokens == 32 and spans(hit) == [(32, 8), (40, 5)]


def test_the_walk_starts_at_the_live_block_and_blocks_below_it_need_not_be_stored():
    cache = stored()
    cache.host.evict(cache.host.children(cache._root)[0].hash)  # block 0 and everything under it
    assert len(cache.host) == 0
    hit = cache.lookup(P + [1], live_tokens=P[:45], live_frontier=45)
    assert (hit.reused_tokens, hit.pieces) == (45, [])
    # later blocks stored, [0, 40) not (held live instead): the chain hash commits to the whole
    # prefix, so the walk may start at the live extent's block
    q = P[:40] + list(range(100, 124))
    held, nodes, todo = cache._nodes_of(token_array(q), len(q))
    assert held == []  # the host holds nothing: every node is made
    for node, a, b in todo:
        node.rows = rows_of(q)(a, b)
    assert cache.host.put_chain(nodes[4].hash, nodes[5:]) == 3  # as if [0, 40) were the root
    hit = cache.lookup(q + [1], live_tokens=P[:45], live_frontier=45)
    assert hit.reused_tokens == 64 and hit.live_tokens == 40 and spans(hit) == [(40, 8), (48, 8), (56, 8)]
    assert exact(hit, q + [1], P[:45])


def test_boundary_floors_reuse_live_and_what_is_stored():
    # boundary == B: exactly the grid behaviour (whole blocks only, no tails stored)
    cache = stored(boundary=B)
    assert len(cache.host) == 5
    assert cache.lookup(P + [1]).reused_tokens == 40
    assert cache.lookup(P[:20] + [0] * 9).reused_tokens == 16
    hit = cache.lookup(P + [1], live_tokens=P[:30], live_frontier=30)
    assert (hit.reused_tokens, hit.live_tokens) == (40, 24) and exact(hit, P + [1], P[:30])
    # any other boundary is just a floor (here 3, not a divisor of B)
    cache = stored(boundary=3)
    assert len(cache.host) == 6  # 45 is a multiple of 3: the tail is kept
    for p, want in ((P + [1], 45), (P[:20] + [0] * 9, 18), (P[:43], 42)):
        hit = cache.lookup(p)
        assert hit.reused_tokens == want and exact(hit, p), p
    hit = cache.lookup(P[:29] + [0] * 3, live_tokens=P[:29], live_frontier=29)
    assert (hit.reused_tokens, hit.live_tokens, hit.pieces) == (27, 27, [])
    stored3 = stored(P, frontier=44, boundary=3)  # stores [0, 42) only
    assert stored3.lookup(P + [1]).reused_tokens == 42
    # a boundary above B: live rows past the last boundary are not kept, even inside a block
    cache = stored(boundary=16)  # stores [0, 32)
    hit = cache.lookup(P + [1], live_tokens=P[:30], live_frontier=30)
    assert (hit.reused_tokens, hit.live_tokens) == (32, 16) and spans(hit) == [(16, 8), (24, 8)]
    assert exact(hit, P + [1], P[:30])


def test_one_token_is_always_left_to_prefill():
    cache = stored(P[:40])
    assert cache.lookup(P[:40]).reused_tokens == 39
    assert cache.lookup(P[:1]).reused_tokens == 0
    assert cache.lookup([]).reused_tokens == 0
    hit = cache.lookup(P[:40], live_tokens=P[:40], live_frontier=40)
    assert (hit.reused_tokens, hit.pieces) == (39, [])


# ---- DCP: several ranks, each with its own cache and stored extent ---------------------------
class FakeGroup:
    """agree() = MIN over all ranks' proposals, rank threads meeting at a barrier per round."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.values: dict[int, int] = {}
        self.rounds = 0

    def agree_for(self, rank: int):
        def agree(x: int) -> int:
            self.values[rank] = x
            self.barrier.wait()
            out = min(self.values.values())
            if self.barrier.wait() == 0:
                self.rounds += 1
            return out
        return agree


def run_ranks(group: FakeGroup, body) -> list:
    """body(rank) on one thread per rank; the first error is raised here."""
    world = group.world
    out: list = [None] * world
    errs: list = []

    def main(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)
            group.barrier.abort()
    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errs:
        raise errs[0]
    return out


def own(start: int, n: int, rank: int, world: int) -> int:
    """How many of positions [start, start + n) this rank holds (p % world == rank)."""
    return sum(1 for p in range(start, start + n) if p % world == rank)


def dcp_rows(world: int, rank: int, tokens: list[int]):
    """This rank's rows of [a, b): positions p % world == rank, each a function of the prefix."""
    full = rows_of(tokens)

    def rows_for(a: int, b: int):
        pos = torch.arange(a, b)
        return {"latent.0": full(a, b)["latent.0"][pos % world == rank]}
    return rows_for


def test_dcp_agreement_is_the_extent_every_rank_can_serve():
    world = 3
    frontiers = {0: 45, 1: 30, 2: 37}  # different stored extents, as after different evictions
    group = FakeGroup(world)
    prompt = P + [1, 2]

    def body(r: int):
        cache = PrefixCache(key(ranks=world, rank=r, dcp=True), host_bytes=1 << 20, agree=group.agree_for(r))
        cache.store(P, frontiers[r], dcp_rows(world, r, P))
        hit = cache.lookup(prompt)
        got = []
        hit.restore(lambda s, n, rows: got.append(rows["latent.0"][:own(s, n, r, world)].clone()))
        want = dcp_rows(world, r, prompt)(0, hit.reused_tokens)["latent.0"]
        return hit.reused_tokens, spans(hit), torch.equal(torch.cat(got), want)
    res = run_ranks(group, body)
    assert all(r[0] == 30 for r in res) and all(r[2] for r in res)
    assert {tuple(r[1]) for r in res} == {((0, 8), (8, 8), (16, 8), (24, 6))}  # same pieces on every rank
    assert group.rounds == 1  # one round of agreement


def test_dcp_with_live_rows_and_a_rank_that_stored_nothing():
    world = 2
    group = FakeGroup(world)
    prompt = P + [1]

    def body(r: int):
        cache = PrefixCache(key(ranks=world, rank=r, dcp=True), host_bytes=1 << 20, agree=group.agree_for(r))
        if r == 0:
            cache.store(P, 45, dcp_rows(world, r, P))
        hit = cache.lookup(prompt, live_tokens=P[:21], live_frontier=21)
        return hit.reused_tokens, hit.live_tokens, spans(hit)
    assert run_ranks(group, body) == [(21, 21, []), (21, 21, [])]


def test_an_agree_that_is_not_a_minimum_is_refused():
    cache = stored(agree=lambda x: x + 1)
    with pytest.raises(RuntimeError, match="ranks disagree"):
        cache.lookup(P + [1])
    cache = stored(agree=lambda x: x - 1, boundary=4)  # not a multiple of the boundary
    with pytest.raises(RuntimeError, match="ranks disagree"):
        cache.lookup(P + [1])


def test_a_lookup_hashes_only_the_blocks_past_its_common_prefix_with_the_last_prompt(monkeypatch):
    import kv_cache.keys as keys

    cache = stored()
    cache.lookup(P + [1])
    hashed = []
    real = keys.block_hash
    monkeypatch.setattr(keys, "block_hash", lambda parent, t: hashed.append(len(t)) or real(parent, t))
    q = P[:20] + [999] + P[21:] + list(range(50, 70))  # differs inside block 2; 65 tokens: 8 blocks
    hit = cache.lookup(q)
    assert hashed == [B] * (len(q) // B - 2)  # blocks 2..7 only; 0 and 1 from the last lookup
    monkeypatch.undo()
    assert cache._last_chain[1] == keys.chain_hashes(key(), q) and hit.reused_tokens == 20
    assert exact(hit, q)


def test_a_store_makes_nodes_only_from_the_first_block_a_tier_lacks():
    cache = stored()  # P: 5 blocks + a 5-token tail
    longer = P + list(range(300, 330))  # 75 tokens: 9 blocks + a 3-token tail
    held, nodes, todo = cache._nodes_of(token_array(longer), len(longer))
    assert held == keys_of(longer)[:5]
    assert [n.length for n in nodes] == [B] * 4 + [3] and [(a, b) for _, a, b in todo] == [
        (40, 48), (48, 56), (56, 64), (64, 72), (72, 75)]
    assert nodes[0].parent == held[-1]
    assert cache.store(longer, len(longer), rows_of(longer)) == 5
    assert cache.host.replaced == 1  # block 5 replaced P's tail [40, 45)
    hit = cache.lookup(longer + [1])
    assert hit.reused_tokens == 75 and exact(hit, longer + [1])


def keys_of(tokens: list[int]) -> list[bytes]:
    from kv_cache.keys import chain_hashes
    return chain_hashes(key(), tokens)
