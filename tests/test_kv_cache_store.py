"""Host tier LRU under a small budget, and the PrefixCache facade (lookup/restore/store, off
switch, live rows, DCP minimum agreement across real gloo processes)."""
from __future__ import annotations

import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kv_cache import CacheKey, HostStore, PrefixCache, chain_hashes
from kv_cache.cache import CacheConfigError, parse_bytes
from kv_cache.keys import root_hash

C = 8
ROW_BYTES = 4 * 2  # 4 bf16 values per position


def key(**kw) -> CacheKey:
    base = dict(model_revision="r", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                dcp=False, chunk_size=C, device_kind="cpu", kit_version="t")
    base.update(kw)
    return CacheKey(**base)


def fake_rows_of(tokens: list[int]):
    """Rows that are a deterministic function of the prefix (stands for what prefill writes)."""
    def rows_for(k: int):
        seg = torch.tensor(tokens[:(k + 1) * C], dtype=torch.float32)
        val = seg.cumsum(0)[k * C:(k + 1) * C]
        return {"latent.0": val[:, None].repeat(1, 4).to(torch.bfloat16)}
    return rows_for


def chunk_bytes() -> int:
    return C * ROW_BYTES


# ---- HostStore ------------------------------------------------------------------------------
def test_lru_eviction_trims_chains_from_the_tip_and_never_orphans():
    k = key()
    root = root_hash(k)
    store = HostStore(budget_bytes=5 * chunk_bytes())
    a = list(range(100, 132))  # 4 chunks
    b = list(range(200, 232))  # 4 chunks, unrelated
    ha, hb = chain_hashes(k, a), chain_hashes(k, b)
    assert store.put_chain(root, ha, [fake_rows_of(a)(i) for i in range(4)]) == 4
    assert store.put_chain(root, hb, [fake_rows_of(b)(i) for i in range(4)]) == 4
    # b is newer; a's chunks were evicted tip first, and what remains of a is a prefix
    assert store.used_bytes <= store.budget_bytes
    assert all(h in store for h in hb)
    kept_a = [h in store for h in ha]
    assert kept_a == sorted(kept_a, reverse=True), "a kept chunk must have all its parents kept"
    assert sum(kept_a) == 1 and store.evictions == 3


def test_evicting_a_parent_evicts_its_descendants_and_shared_prefix_is_stored_once():
    k = key()
    root = root_hash(k)
    store = HostStore(budget_bytes=100 * chunk_bytes())
    base = list(range(24))
    x, y = base + [1] * 8, base + [2] * 8
    hx, hy = chain_hashes(k, x), chain_hashes(k, y)
    store.put_chain(root, hx, [fake_rows_of(x)(i) for i in range(4)])
    assert store.put_chain(root, hy, [None, None, None, fake_rows_of(y)(3)]) == 1
    assert len(store) == 5 and store.used_bytes == 5 * chunk_bytes()
    assert store.evict(hx[1]) == 4  # chunk 1, chunk 2 and both chunk-3 branches
    assert len(store) == 1 and hx[0] in store


def test_chain_larger_than_budget_keeps_its_longest_prefix():
    k = key()
    store = HostStore(budget_bytes=2 * chunk_bytes() + 1)
    t = list(range(40))
    h = chain_hashes(k, t)
    assert store.put_chain(root_hash(k), h, [fake_rows_of(t)(i) for i in range(5)]) == 2
    assert h[0] in store and h[1] in store and h[2] not in store


# ---- PrefixCache ------------------------------------------------------------------------------
def test_store_then_lookup_restores_exact_rows_for_each_extension_pattern():
    cache = PrefixCache(key(), host_bytes=1 << 20)
    prompt = [(i * 7919) % 1000 for i in range(45)]  # 5 whole chunks + 5
    assert cache.lookup(prompt).reused_tokens == 0
    assert cache.store(prompt, frontier=45, rows_for=fake_rows_of(prompt)) == 5
    cases = {
        "append": (prompt + list(range(30)), 40),
        "identical resend": (prompt, 40),
        "one-word extension": (prompt + [5], 40),
        "middle edit at 20": (prompt[:20] + [999] + prompt[21:], 16),
        "edit in chunk 0": ([1] + prompt[1:], 0),
        "prompt of exactly 5 chunks resent": (prompt[:40], 32),  # keep a token to prefill
    }
    for name, (p, want) in cases.items():
        hit = cache.lookup(p)
        assert hit.reused_tokens == want, name
        restored = {}
        hit.restore(lambda k, rows: restored.__setitem__(k, rows))
        assert sorted(restored) == list(range(want // C)), name
        for k, rows in restored.items():
            assert torch.equal(rows["latent.0"], fake_rows_of(p)(k)["latent.0"]), (name, k)


def test_frontier_limits_reuse_to_rows_written_by_prefill():
    cache = PrefixCache(key(), host_bytes=1 << 20)
    turn1 = list(range(1, 21))  # prefill frontier 20; decode then wrote 12 more rows
    reply = list(range(500, 512))
    assert cache.store(turn1 + reply, frontier=20, rows_for=fake_rows_of(turn1 + reply)) == 2
    turn2 = turn1 + reply + [7, 8, 9]
    assert cache.lookup(turn2).reused_tokens == 16  # not 32: rows 20..31 came from decode


def test_live_rows_are_reused_in_place():
    cache = PrefixCache(key(), host_bytes=1 << 20)
    live = list(range(30))
    hit = cache.lookup(live + [1, 2], live_tokens=live, live_frontier=30)
    assert hit.reused_tokens == 24 and hit.live_tokens == 24 and hit.chunks == []
    cache_exact = PrefixCache(key(), host_bytes=1 << 20, boundary_only=False)
    hit = cache_exact.lookup(live + [1, 2], live_tokens=live, live_frontier=30)
    assert hit.reused_tokens == 30
    # live beats nothing, stored beyond live is restored from the host tier
    longer = list(range(60))
    cache.store(longer, 60, fake_rows_of(longer))
    hit = cache.lookup(longer + [3], live_tokens=live, live_frontier=30)
    assert (hit.reused_tokens, hit.live_tokens, hit.first_chunk, len(hit.chunks)) == (56, 24, 3, 4)


def test_prefix_cache_off_reuses_nothing(monkeypatch):
    monkeypatch.setenv("TF_GLM53_PREFIX_CACHE", "0")
    cache = PrefixCache.from_env(key())
    p = list(range(50))
    assert cache.store(p, 50, fake_rows_of(p)) == 0
    assert cache.lookup(p + [1]).reused_tokens == 0
    assert cache.stats.lookups == 0


def test_env_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("TF_GLM53_PREFIX_CACHE", "maybe")
    with pytest.raises(CacheConfigError, match="TF_GLM53_PREFIX_CACHE"):
        PrefixCache.from_env(key())
    assert parse_bytes("X", "2M") == 2 << 20 and parse_bytes("X", "512") == 512
    with pytest.raises(CacheConfigError, match="TF_GLM53_HOST_CACHE_BYTES"):
        parse_bytes("TF_GLM53_HOST_CACHE_BYTES", "lots")


def test_stats_and_logging(caplog):
    cache = PrefixCache(key(), host_bytes=3 * chunk_bytes())
    with caplog.at_level(logging.INFO, logger="kv_cache"):
        a = list(range(33))
        cache.lookup(a)
        cache.store(a, 33, fake_rows_of(a))
        cache.lookup(a + [1])
        b = list(range(1000, 1033))
        cache.store(b, 33, fake_rows_of(b))
    s = cache.stats_dict()
    assert (s["lookups"], s["hits"], s["misses"], s["cached_tokens"]) == (2, 1, 1, 24)
    assert s["host_evictions"] == 3 and s["evictions"] == 3  # a's 3 chunks were trimmed for b's 3
    assert any("kv_cache hit: 24 of 34" in r.message for r in caplog.records)
    assert any("kv_cache miss" in r.message for r in caplog.records)
    assert any("kv_cache host evict: 3 chunks" in r.message for r in caplog.records)


# ---- DCP: each rank holds its own rows; a hit counts only where every rank holds it ----------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dcp_worker(rank: int, world: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        def agree(n: int) -> int:
            t = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return int(t.item())

        k = key(ranks=world, rank=rank, dcp=True)
        cache = PrefixCache(k, host_bytes=1 << 20, agree=agree)
        prompt = list(range(3, 3 + 8 * C))
        # rank r holds its rows of the first 8 - 2r chunks (as if the others were evicted there)
        held = 8 - 2 * rank

        def rows_for(kk: int):  # this rank's positions of chunk kk: p % world == rank
            pos = torch.arange(kk * C, (kk + 1) * C)
            return {"latent.0": pos[pos % world == rank].to(torch.bfloat16)[:, None]}

        cache.store(prompt, held * C, rows_for)
        hit = cache.lookup(prompt + [1])
        out[rank] = (hit.reused_tokens, len(hit.chunks),
                     [r["latent.0"].flatten().tolist() for r in hit.chunks[:1]])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_hit_is_the_minimum_over_real_ranks():
    world = 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dcp_worker, args=(world, _free_port(), out), nprocs=world, join=True)
        res = dict(out)
    assert {r: res[r][0] for r in range(world)} == {0: 4 * C, 1: 4 * C, 2: 4 * C}
    assert all(res[r][1] == 4 for r in range(world))
    # each rank restored its own rows only
    assert res[1][2] == [[float(p) for p in range(C) if p % world == 1]]
