"""The PrefixCache facade (lookup/restore/store, off switch, env, stats, DCP minimum across real gloo processes)."""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm53.settings import Settings, SettingsError, parse_bytes
from kv_cache import CacheKey, DiskTier, Node, PrefixCache, block_hash, chain_hashes
from kv_cache.disk import SUFFIX
from kv_cache.keys import root_hash

C = 8  # the cache block size B
ROW_BYTES = 2 * 8 + 2  # an int64 pair and one bf16 per position


def key(**kw) -> CacheKey:
    base = dict(model_revision="r", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                dcp=False, chunk_size=C, device_kind="cpu", kit_version="t")
    base.update(kw)
    return CacheKey(**base)


def rows_of(tokens: list[int]):
    """rows_for(start, stop): each position's row is a function of the whole prefix up to it
    (stands for what prefill writes)."""
    t = torch.tensor(tokens, dtype=torch.int64)
    acc = (t * torch.arange(1, len(tokens) + 1)).cumsum(0)

    def rows_for(a: int, b: int):
        return {"latent.0": acc[a:b, None].repeat(1, 2), "scale.0": (acc[a:b] % 251).to(torch.bfloat16)}
    return rows_for


def replay(hit, prompt: list[int], live: list[int] | None = None):
    """What the engine holds after the hit: live rows [0, live_tokens), then each piece's leading
    slots; checked against what a cold prefill of `prompt` writes."""
    got = {n: [t[:hit.live_tokens]] for n, t in rows_of(live or prompt)(0, hit.live_tokens).items()}
    at = [hit.live_tokens]

    def write(start: int, n: int, rows):
        assert start == at[0] and 0 < n <= rows["scale.0"].shape[0]
        for name, t in rows.items():
            got[name].append(t[:n].clone())  # valid during the call only
        at[0] += n
    hit.restore(write)
    assert at[0] == hit.reused_tokens
    want = rows_of(prompt)(0, hit.reused_tokens)
    return all(torch.equal(torch.cat(got[n]), want[n]) for n in want)


def nodes_of(k: CacheKey, tokens: list[int], stop: int | None = None) -> list[Node]:
    """The chain of [0, stop) as nodes with rows: full blocks, then the tail."""
    stop = len(tokens) if stop is None else stop
    out, parent, rows_for = [], root_hash(k), rows_of(tokens)
    for a in range(0, stop, C):
        b = min(a + C, stop)
        t = np.array(tokens[a:b], dtype=np.int64)
        h = block_hash(parent, t)
        out.append(Node(h, parent, t, rows_for(a, b)))
        parent = h
    return out


def block_bytes(n: int = C) -> int:
    return n * ROW_BYTES


# ---- PrefixCache ------------------------------------------------------------------------------
def test_store_then_lookup_restores_exact_rows_for_each_extension_pattern():
    cache = PrefixCache(key(), host_bytes=1 << 20)
    prompt = [(i * 7919) % 1000 for i in range(45)]  # 5 whole blocks + a 5-token tail
    assert cache.lookup(prompt).reused_tokens == 0
    assert cache.store(prompt, frontier=45, rows_for=rows_of(prompt)) == 6
    cases = {
        "append": (prompt + list(range(30)), 45),
        "identical resend": (prompt, 44),  # keep a token to prefill
        "one-word extension": (prompt + [5], 45),
        "middle edit at 20": (prompt[:20] + [999] + prompt[21:], 20),
        "edit in block 0": ([1] + prompt[1:], 0),
        "prompt of exactly 5 blocks resent": (prompt[:40], 39),
        "prompt ending inside the tail": (prompt[:43], 42),
    }
    for name, (p, want) in cases.items():
        hit = cache.lookup(p)
        assert hit.reused_tokens == want, name
        assert replay(hit, p), name
        assert sum(x.length for x in hit.pieces) == want and all(x.start % C == 0 for x in hit.pieces), name


def test_frontier_limits_reuse_to_rows_written_by_prefill():
    cache = PrefixCache(key(), host_bytes=1 << 20)
    turn1 = list(range(1, 21))  # prefill frontier 20; decode then wrote 12 more rows
    reply = list(range(500, 512))
    assert cache.store(turn1 + reply, frontier=20, rows_for=rows_of(turn1 + reply)) == 3  # 2 blocks + [16, 20)
    turn2 = turn1 + reply + [7, 8, 9]
    hit = cache.lookup(turn2)
    assert hit.reused_tokens == 20  # not 32: rows 20..31 came from decode
    assert replay(hit, turn2)


def test_live_rows_are_reused_in_place():
    cache = PrefixCache(key(), host_bytes=1 << 20)
    live = list(range(30))
    hit = cache.lookup(live + [1, 2], live_tokens=live, live_frontier=30)
    assert (hit.reused_tokens, hit.live_tokens, hit.pieces) == (30, 30, [])
    # stored beyond live is restored from the host tier, from live's block start on
    longer = list(range(60))
    cache.store(longer, 60, rows_of(longer))
    hit = cache.lookup(longer + [3], live_tokens=live, live_frontier=30)
    assert (hit.reused_tokens, hit.live_tokens) == (60, 24)
    assert [(p.start, p.length) for p in hit.pieces] == [(24, 8), (32, 8), (40, 8), (48, 8), (56, 4)]
    assert replay(hit, longer + [3], live)


def test_prefix_cache_off_reuses_nothing():
    cache = PrefixCache.from_settings(key(), Settings.from_env({"TF_GLM53_PREFIX_CACHE": "0"}))
    p = list(range(50))
    assert cache.store(p, 50, rows_of(p)) == 0
    assert cache.lookup(p + [1]).reused_tokens == 0
    assert cache.stats.lookups == 0


def test_env_errors_name_the_variable_and_the_boundary_is_not_read_here(tmp_path):
    with pytest.raises(SettingsError, match="TF_GLM53_PREFIX_CACHE"):
        Settings.from_env({"TF_GLM53_PREFIX_CACHE": "maybe"})
    assert parse_bytes("2M") == 2 << 20 and parse_bytes("512") == 512
    with pytest.raises(SettingsError, match="TF_GLM53_HOST_CACHE_BYTES"):
        Settings.from_env({"TF_GLM53_HOST_CACHE_BYTES": "lots"})
    env = {"TF_GLM53_DISK_CACHE": str(tmp_path), "TF_GLM53_DISK_CACHE_THREADS": "zero"}
    with pytest.raises(SettingsError, match="TF_GLM53_DISK_CACHE_THREADS"):
        Settings.from_env(env)
    env["TF_GLM53_DISK_CACHE_THREADS"] = "3"
    cache = PrefixCache.from_settings(key(), Settings.from_env(env))
    assert cache.disk.threads == 3
    cache.close()
    # the engine decides the boundary; the variable has no effect on kv_cache
    cache = PrefixCache.from_settings(key(), Settings.from_env({"TF_GLM53_PREFIX_REUSE_BOUNDARY": "1"}))
    assert cache.boundary is None
    assert PrefixCache.from_settings(key(), Settings(), boundary=16).boundary == 16
    with pytest.raises(ValueError, match="boundary"):
        PrefixCache(key(), boundary=0)


def test_stats_and_logging(caplog):
    cache = PrefixCache(key(), host_bytes=3 * block_bytes())
    with caplog.at_level(logging.INFO, logger="kv_cache"):
        a = list(range(24))
        cache.lookup(a)
        cache.store(a, 24, rows_of(a))
        cache.lookup(a + [1])
        b = list(range(1000, 1024))
        cache.store(b, 24, rows_of(b))
    s = cache.stats_dict()
    assert (s["lookups"], s["hits"], s["misses"], s["cached_tokens"]) == (2, 1, 1, 24)
    assert (s["host_tokens"], s["disk_tokens"], s["live_tokens"], s["stored_chunks"]) == (24, 0, 0, 6)
    assert s["host_evictions"] == 3 and s["evictions"] == 3  # a's 3 blocks were trimmed for b's 3
    assert s["host_chunks"] == 3 and s["host_bytes"] == 3 * block_bytes()
    assert set(s) >= {"disk_written_chunks", "disk_bytes", "disk_chunks", "disk_evictions", "disk_quarantined"}
    assert any("kv_cache hit: 24 of 25" in r.message for r in caplog.records)
    assert any("kv_cache miss" in r.message for r in caplog.records)
    assert any("kv_cache host evict: 3 chunks" in r.message for r in caplog.records)


def test_a_hit_whose_restore_raises_is_not_counted(caplog):
    """The engine's write fails mid-restore (e.g. out of device memory): the request fails and nothing
    was reused, so the stats keep the lookup but not the hit or its tokens; the next restore counts."""
    cache = PrefixCache(key(), host_bytes=8 * block_bytes())
    a = list(range(24))
    cache.store(a, 24, rows_of(a))
    before = cache.stats_dict()
    hit = cache.lookup(a + [1])
    assert hit.reused_tokens == 24 and cache.stats_dict()["hits"] == before["hits"] + 1

    def failing(start: int, n: int, rows) -> None:
        raise MemoryError("no room on the device")
    with caplog.at_level(logging.WARNING, logger="kv_cache"), pytest.raises(MemoryError):
        hit.restore(failing)
    after = cache.stats_dict()
    for name in ("hits", "cached_tokens", "host_tokens", "live_tokens", "disk_tokens", "misses"):
        assert after[name] == before[name], name
    assert after["lookups"] == before["lookups"] + 1
    assert any("not counted as a hit" in r.message for r in caplog.records)
    hit = cache.lookup(a + [2])
    assert replay(hit, a + [2])
    s = cache.stats_dict()
    assert (s["hits"], s["cached_tokens"], s["host_tokens"]) == (before["hits"] + 1, 24, 24)


# ---- DCP: each rank holds its own rows; a hit counts only where every rank holds it ----------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _min_over_ranks(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _own_rows(world: int, rank: int):
    """rows_for(a, b): this rank's positions of [a, b) (p % world == rank), each its own value."""
    def rows_for(a: int, b: int):
        pos = torch.arange(a, b)
        return {"latent.0": pos[pos % world == rank].to(torch.bfloat16)[:, None]}
    return rows_for


def _dcp_worker(rank: int, world: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        k = key(ranks=world, rank=rank, dcp=True)
        cache = PrefixCache(k, host_bytes=1 << 20, agree=_min_over_ranks)
        prompt = list(range(3, 3 + 8 * C))
        # rank r holds its rows of the first 8 - 2r blocks + 3 tokens (as if the rest were evicted)
        held = (8 - 2 * rank) * C + 3
        cache.store(prompt, held, _own_rows(world, rank))
        hit = cache.lookup(prompt + [1])
        out[rank] = (hit.reused_tokens, len(hit.pieces),
                     [p.rows["latent.0"].flatten().tolist() for p in hit.pieces[:1]])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_hit_is_the_minimum_over_real_ranks():
    world = 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dcp_worker, args=(world, _free_port(), out), nprocs=world, join=True)
        res = dict(out)
    want = 4 * C + 3  # rank 2's extent
    assert {r: res[r][0] for r in range(world)} == {0: want, 1: want, 2: want}
    assert all(res[r][1] == 5 for r in range(world))
    # each rank restored its own rows only
    assert res[1][2] == [[float(p) for p in range(C) if p % world == 1]]


def _dcp_disk_worker(rank: int, world: int, port: int, folder: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        k = key(ranks=world, rank=rank, dcp=True)
        prompt = list(range(3, 3 + 8 * C))
        writer = PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(folder, k, 1 << 30))
        writer.store(prompt, len(prompt), _own_rows(world, rank))
        if rank == 1:  # one bit of rank 1's block 5 rots while the server is down
            victim = Path(folder) / k.digest().hex() / (chain_hashes(k, prompt)[5].hex() + SUFFIX)
            data = bytearray(victim.read_bytes())
            data[-1] ^= 1
            victim.write_bytes(bytes(data))
        cache = PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(folder, k, 1 << 30), agree=_min_over_ranks)  # a restart
        hit = cache.lookup(prompt + [1])
        got: list[float] = []
        end = hit.restore(lambda a, n, rows: got.extend(rows["latent.0"].flatten().tolist()))
        out[rank] = (hit.reused_tokens, end, got[:3], cache.stats.cached_tokens)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_restore_agrees_on_what_every_rank_restored(tmp_path):
    """Disk files are verified while they are restored: a rank whose file fails restores less, and
    every rank then keeps only what all of them restored (a second MIN over the ranks)."""
    world = 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dcp_disk_worker, args=(world, _free_port(), str(tmp_path), out), nprocs=world, join=True)
        res = dict(out)
    assert {r: res[r][0] for r in range(world)} == {r: 8 * C for r in range(world)}  # the index's view
    assert {r: res[r][1] for r in range(world)} == {r: 5 * C for r in range(world)}  # rank 1's block 5 failed
    assert {r: res[r][3] for r in range(world)} == {r: 5 * C for r in range(world)}  # stats say so too
    assert res[2][2] == [float(p) for p in range(2, 9, world)]  # rank 2's own positions
