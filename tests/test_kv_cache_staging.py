"""Background stores (kv_cache/staging.py): rows copied before store() returns, nodes handed to
the tiers later; a lookup waits only when the pending nodes could serve more than the live rows.

On the CPU the copy into the staging buffer is synchronous (nothing orders it after the engine's
next writes otherwise) and the background thread fills the nodes; on a GPU the copy is queued on
the stream (tests/test_kv_cache_engine.py::test_reuse_is_bitwise_on_cuda runs the engine's
patterns with it, an unrelated prompt overwriting the rows while a store may still be copying).
A gate job on the store's one worker thread holds a store "in flight" deterministically.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from glm53.settings import Settings, SettingsError
from kv_cache import CacheKey, PrefixCache, diskfile
from kv_cache.keys import token_array
from kv_cache.node import Node
from kv_cache.staging import Staging, runs_of

B = 8
P = [(i * 7919) % 1000 + 1 for i in range(45)]  # 5 blocks + a 5-token tail


def key() -> CacheKey:
    return CacheKey(model_revision="r", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                    dcp=False, chunk_size=B, device_kind="cpu", kit_version="t")


def source(tokens: list[int]) -> dict[str, torch.Tensor]:
    """What the engine's buffers hold for `tokens`: rows that depend on the whole prefix."""
    t = torch.tensor(tokens, dtype=torch.int64)
    acc = (t * torch.arange(1, len(tokens) + 1)).cumsum(0)
    return {"latent.0": acc[:, None].repeat(1, 3), "scale.0": (acc % 251).to(torch.bfloat16)}


def view_of(buffers: dict[str, torch.Tensor]):
    return lambda a, b: {n: v[a:b] for n, v in buffers.items()}  # views, as KVState.export_rows gives


def restored(hit, live: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    parts = {n: [v[:hit.live_tokens]] for n, v in (live or {}).items()}

    def write(start, n, rows):
        for name, t in rows.items():
            parts.setdefault(name, []).append(t[:n].clone())  # valid during the call only
    hit.restore(write)
    return {n: torch.cat(v) for n, v in parts.items()}


class Gate:
    """Holds the store's worker thread until opened (opens by itself after 20 s, so a wrong wait
    fails the test instead of hanging it)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.event = threading.Event()
        self.timer = threading.Timer(20.0, self.event.set)
        self.timer.start()
        cache._staging._pool.submit(self.event.wait)

    def open(self) -> None:
        self.event.set()
        self.timer.cancel()


def test_runs_group_consecutive_spans():
    n = [Node(bytes([i]), b"", np.zeros(1, np.int64)) for i in range(4)]
    runs = runs_of([(n[0], 0, 8), (n[1], 8, 16), (n[2], 24, 32), (n[3], 32, 37)])
    assert [[(a, b) for _, a, b in run] for run in runs] == [[(0, 8), (8, 16)], [(24, 32), (32, 37)]]


def test_a_store_lands_later_with_the_rows_it_read_before_returning():
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    buffers = source(P)
    want = {n: v.clone() for n, v in buffers.items()}
    gate = Gate(cache)
    assert cache.store(P, len(P), view_of(buffers)) == 0  # queued: nothing kept yet
    assert len(cache.host) == 0 and cache._pending is not None
    for v in buffers.values():  # the engine writes the next request's rows right away
        v.fill_(0)
    gate.open()
    assert cache.stats_dict()["host_chunks"] == 6 and cache.stats.stored_chunks == 6  # 5 blocks + tail
    hit = cache.lookup(P + [1])
    assert hit.reused_tokens == 45 and hit.sources == ["host"] * 6
    got = restored(hit)
    assert all(torch.equal(got[n], want[n]) for n in want)
    for node_rows in (p.rows for p in hit.pieces):  # every node owns its rows (not views of the buffer)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in node_rows.values())
    cache.close()


def test_the_live_conversation_never_waits_and_another_prompt_does():
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    reply = [5, 6]
    live = P + reply
    buffers = source(live)
    gate = Gate(cache)
    cache.store(P, len(P), view_of(buffers))
    # the next turn of the same conversation: its live rows serve at least what the store holds
    hit = cache.lookup(live + [9, 9, 9], live_tokens=live, live_frontier=len(P))
    assert not gate.event.is_set(), "the live conversation's lookup waited for the background store"
    assert (hit.reused_tokens, hit.live_tokens, hit.pieces) == (45, 45, [])
    assert cache._pending is not None
    # a prompt the live rows cannot serve (another conversation's state) needs the pending nodes
    opener = threading.Timer(0.3, gate.open)
    opener.start()
    hit = cache.lookup(P[:30] + [0], live_tokens=[1, 2, 3], live_frontier=3)
    assert gate.event.is_set() and cache._pending is None
    assert hit.reused_tokens == 30 and hit.live_tokens == 0
    got = restored(hit)
    assert all(torch.equal(got[n], source(P)[n][:30]) for n in got)
    cache.close()


def test_a_new_store_settles_the_previous_one_first():
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    turn1 = P[:20]
    cache.store(turn1, 20, view_of(source(turn1)))
    cache.store(P, 45, view_of(source(P)))  # waits for turn 1's nodes, then plans against them
    s = cache.stats_dict()
    # turn 1: blocks 0-1 and the tail [16, 20); turn 2 adds blocks 2-4 and its tail, and its
    # block 2 replaces turn 1's tail (it dominates it)
    assert s["host_chunks"] == 6 and s["stored_chunks"] == 7 and cache.host.replaced == 1
    cache.close()


def test_a_store_larger_than_the_staging_buffer_goes_through_it_in_rounds():
    row_bytes = 3 * 8 + 2
    capacity = 20 * row_bytes  # two aligned 8-row blocks a round; the prompt has 5 blocks and a tail
    cache = PrefixCache(key(), staging_bytes=capacity)
    buffers = source(P)
    want = {n: v.clone() for n, v in buffers.items()}
    assert cache.store(P, len(P), view_of(buffers)) == 0 and cache._pending is not None  # the last round lands later
    assert cache._staging.rounds == 3 and cache._staging._buf.numel() <= capacity
    for v in buffers.values():  # the engine writes again right after the call
        v.fill_(0)
    hit = cache.lookup(P + [1])
    assert hit.reused_tokens == 45 and hit.sources == ["host"] * 6
    got = restored(hit)
    assert all(torch.equal(got[n], want[n]) for n in want)
    cache.close()


def deep_rows(n: int, latent_width: int, index_width: int, seed: int) -> dict[str, torch.Tensor]:
    """Buffers shaped like a deep model's: five bf16 latents, fp32 index keys on every other layer, one scale."""
    g = torch.Generator().manual_seed(seed)
    return {**{f"latent.{i}": torch.randn(n, latent_width, generator=g).to(torch.bfloat16) for i in range(5)},
            **{f"index.{i}": torch.randn(n, index_width, generator=g) for i in (0, 2, 4)},
            "scale.0": torch.rand(n, generator=g)}


def test_layers_of_one_dtype_and_shape_share_a_copy_and_each_node_owns_its_rows():
    """Rows as a deep model's: many tensors of one dtype and shape (one view and one copy call
    for them), others alone; every node gets exactly its rows, in storage of its own: the storages
    its tensors use hold its bytes and nothing more (the host budget counts those), one stack per
    group of alike tensors, shared with no other node."""
    n = len(P)
    buffers = deep_rows(n, latent_width=6, index_width=4, seed=11)
    want = {name: v.clone() for name, v in buffers.items()}
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    assert cache.store(P, n, view_of(buffers)) == 0
    for v in buffers.values():
        v.fill_(0)
    hit = cache.lookup(P + [1])
    assert hit.reused_tokens == n
    got = restored(hit)
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    seen: set[int] = set()
    for node_rows in (piece.rows for piece in hit.pieces):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in node_rows.values()}
        assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in node_rows.values())
        assert not seen & storages.keys(), "a storage shared between nodes"
        seen |= storages.keys()
        assert [names for names, _ in node_rows.stacks] == [tuple(f"latent.{i}" for i in range(5)),
                                                            tuple(f"index.{i}" for i in (0, 2, 4)), ("scale.0",)]
    cache.close()


def test_a_restore_packs_each_stored_stack_in_one_memcpy(monkeypatch):
    """diskfile.pack copies a stack whole where it is one run of the node's layout (a full 8-row
    block: every tensor's rows 64-byte multiples, so a kind's tensors lie back to back), and tensor
    by tensor where it is not (the 5-row tail's 160-byte tensors each start aligned, apart); the
    restored rows are the stored ones either way."""
    n = len(P)
    buffers = deep_rows(n, latent_width=16, index_width=8, seed=12)
    want = {name: v.clone() for name, v in buffers.items()}
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    cache.store(P, n, view_of(buffers))
    hit = cache.lookup(P + [1])
    assert hit.reused_tokens == n and len(hit.pieces) == 6 and set(hit.sources) == {"host"}
    copies: list[int] = []
    real = diskfile.ctypes.memmove
    monkeypatch.setattr(diskfile.ctypes, "memmove", lambda dst, src, count: copies.append(count) or real(dst, src, count))
    got = restored(hit)
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    # 5 full blocks x (latents, index keys, scales) + the tail's scales; the tail's latents and keys by tensor
    assert sorted(copies) == sorted([5 * 8 * 16 * 2, 3 * 8 * 8 * 4, 8 * 4] * 5 + [5 * 4])
    cache.close()


def test_pack_wants_contiguous_host_memory():
    rows = {"latent.0": torch.zeros(8, 32, dtype=torch.bfloat16)}
    runs, size = diskfile.plan(rows)
    with pytest.raises(ValueError, match="contiguous host memory"):
        diskfile.pack(rows, runs, torch.zeros(size * 2, dtype=torch.uint8)[::2])


def test_a_block_larger_than_the_staging_buffer_is_copied_inside_the_call():
    cache = PrefixCache(key(), staging_bytes=100)  # less than one 8-row block's rows
    assert cache.store(P, len(P), view_of(source(P))) == 6 and cache._pending is None
    assert cache._staging.rounds == 0
    assert cache.lookup(P + [1]).reused_tokens == 45
    cache.close()


def test_a_failed_round_drops_the_whole_store(monkeypatch, caplog):
    import kv_cache.staging as staging_mod

    real, calls = staging_mod._fill_nodes, []

    def first_fails(staged, event):
        calls.append(len(staged))
        if len(calls) == 1:
            raise RuntimeError("device copy failed (stands in for a CUDA error)")
        real(staged, event)
    monkeypatch.setattr(staging_mod, "_fill_nodes", first_fails)
    cache = PrefixCache(key(), staging_bytes=20 * (3 * 8 + 2))
    cache.store(P, len(P), view_of(source(P)))
    assert len(calls) == 1  # the rounds after the failed one were never queued
    with caplog.at_level(logging.ERROR, logger="kv_cache"):
        assert cache.lookup(P + [1]).reused_tokens == 0  # a miss, never half a chain or wrong rows
    assert "copying rows to host memory failed" in caplog.text and len(cache.host) == 0
    cache.close()


def test_the_staging_buffer_grows_by_powers_of_two_up_to_its_capacity():
    staging = Staging(4096)
    nodes = [(Node(b"a", b"", np.zeros(8, np.int64)), 0, 8)]
    rows = {"x": torch.arange(64, dtype=torch.int64).view(8, 8)}  # 512 bytes
    staging.copy(nodes, lambda a, b: {n: v[a:b] for n, v in rows.items()}).result()
    assert staging._buf.numel() == 512 and torch.equal(nodes[0][0].rows["x"], rows["x"])
    big = {"x": torch.arange(400, dtype=torch.int64).view(50, 8)}  # 3200 bytes: up to 4096
    nodes = [(Node(b"b", b"", np.zeros(50, np.int64)), 0, 50)]
    staging.copy(nodes, lambda a, b: {n: v[a:b] for n, v in big.items()}).result()
    assert staging._buf.numel() == 4096 and torch.equal(nodes[0][0].rows["x"], big["x"])
    assert staging.copy(nodes, lambda a, b: {"x": torch.zeros(600, 8)}) is None  # over capacity
    staging.close()


def test_a_failed_background_copy_is_logged_and_dropped(monkeypatch, caplog):
    import kv_cache.staging as staging_mod

    def fail(staged, event):
        raise RuntimeError("device copy failed (stands in for a CUDA error)")
    monkeypatch.setattr(staging_mod, "_fill_nodes", fail)
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    cache.store(P, len(P), view_of(source(P)))
    with caplog.at_level(logging.ERROR, logger="kv_cache"):
        assert cache.lookup(P + [1]).reused_tokens == 0  # a miss, never an error or wrong rows
    assert "copying rows to host memory failed" in caplog.text and len(cache.host) == 0
    monkeypatch.undo()
    assert cache.store(P, len(P), view_of(source(P))) == 0
    assert cache.lookup(P + [1]).reused_tokens == 45  # the next store works
    cache.close()


def test_staging_size_from_the_environment():
    on_gpu = PrefixCache.from_settings(key(), Settings(), on_gpu=True)
    assert on_gpu._staging is not None and on_gpu._staging.capacity == 128 << 20
    # the default follows the model: 8192 positions of its rows, within 128 MiB and 2 GiB
    deep = PrefixCache.from_settings(key(), Settings(), on_gpu=True, position_bytes=99840)  # 78 GLM-5.3 layers
    assert deep._staging.capacity == 99840 * 8192
    huge = PrefixCache.from_settings(key(), Settings(), on_gpu=True, position_bytes=1 << 20)
    assert huge._staging.capacity == 2 << 30
    deep.close()
    huge.close()
    eight = Settings.from_env({"TF_GLM53_STORE_STAGING_BYTES": "8M"})
    assert PrefixCache.from_settings(key(), eight, on_gpu=True,
                                     position_bytes=99840)._staging.capacity == 8 << 20  # the variable wins
    assert PrefixCache.from_settings(key(), Settings())._staging is None  # CPU rows: copied in the call
    env = {"TF_GLM53_STORE_STAGING_BYTES": "0"}
    assert PrefixCache.from_settings(key(), Settings.from_env(env), on_gpu=True)._staging is None
    assert PrefixCache.from_settings(key(), eight)._staging.capacity == 8 << 20
    with pytest.raises(SettingsError, match="TF_GLM53_STORE_STAGING_BYTES='lots': expected a byte count"):
        Settings.from_env({"TF_GLM53_STORE_STAGING_BYTES": "lots"})
    on_gpu.close()


def test_token_array_of_the_pending_prefix_is_a_copy():
    cache = PrefixCache(key(), staging_bytes=1 << 20)
    prompt = np.array(P, dtype=np.int64)
    gate = Gate(cache)
    cache.store(prompt, len(P), view_of(source(P)))
    prompt[:] = 0  # the caller reuses its array
    assert np.array_equal(cache._pending.tokens, token_array(P))
    gate.open()
    cache.close()


@pytest.mark.parametrize("staging_bytes", [1 << 20, 400])  # 400: two blocks' rows a round
def test_blocks_under_dcp_take_their_own_slots_from_a_run(staging_bytes: int):
    """A DCP rank's rows of [a, b) are its own positions (p % world == rank): a run's rows are split
    by each block's slot count, not by position offsets, in one round or in several."""
    world = 3
    buffers = source(P)
    for rank in range(world):
        def rows_for(a, b, rank=rank):
            pos = torch.arange(a, b)
            return {n: v[a:b][pos % world == rank] for n, v in buffers.items()}
        staged = PrefixCache(key(), staging_bytes=staging_bytes)
        inline = PrefixCache(key())
        staged.store(P, len(P), rows_for)
        inline.store(P, len(P), rows_for)
        staged.flush()
        got, want = staged.lookup(P + [1]), inline.lookup(P + [1])
        assert got.reused_tokens == want.reused_tokens == 45 and len(got.pieces) == 6
        for a, b in zip(got.pieces, want.pieces):
            assert a.rows.keys() == b.rows.keys()
            assert all(torch.equal(a.rows[n], b.rows[n]) for n in a.rows), f"rank {rank}, piece at {a.start}"
        assert staged._staging.rounds == (1 if staging_bytes == 1 << 20 else 3)
        staged.close()


def test_a_run_whose_rows_are_not_its_blocks_in_order_is_refused():
    staging = Staging(1 << 20)
    nodes = [(Node(b"a", b"", np.zeros(8, np.int64)), 0, 8), (Node(b"b", b"", np.zeros(8, np.int64)), 8, 16)]
    rows = torch.arange(32, dtype=torch.int64).view(16, 2)

    def inconsistent(a, b):  # the whole run has one row more than its blocks
        return {"x": torch.cat([rows[a:b], rows[:1]]) if (a, b) == (0, 16) else rows[a:b]}
    with pytest.raises(ValueError, match="must be its blocks' rows in order"):
        staging.copy(nodes, inconsistent)
    staging.close()



def _held_agree() -> tuple:
    """An agree() (the lookup's agreement over ranks, a collective) held open until released:
    (agree, entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def agree(n: int) -> int:
        entered.set()
        assert release.wait(20)
        return n
    return agree, entered, release


def _stats_in_thread(cache: PrefixCache) -> tuple[threading.Thread, list]:
    stats: list = []
    reader = threading.Thread(target=lambda: stats.append(cache.stats_dict()))
    reader.start()
    return reader, stats


def test_stats_from_another_thread_wait_for_a_lookup_in_progress():
    """A server's metrics thread reads stats (which lands background stores: it changes the tiers)
    while the engine's thread is inside a lookup: it waits until the lookup is done."""
    agree, entered, release = _held_agree()
    cache = PrefixCache(key(), staging_bytes=1 << 20, agree=agree)
    cache.store(P, len(P), view_of(source(P)))  # pending: the stats read below would land it
    hits = []
    lookup = threading.Thread(target=lambda: hits.append(cache.lookup(P[:20] + [1])))
    lookup.start()
    assert entered.wait(20)
    reader, stats = _stats_in_thread(cache)
    reader.join(0.3)
    assert reader.is_alive() and not stats, "stats were read while a lookup was in progress"
    release.set()
    lookup.join(20)
    reader.join(20)
    assert hits[0].reused_tokens == 20 and stats[0]["host_chunks"] == 6
    cache.close()


def held_store_fills(monkeypatch) -> threading.Event:
    """Background stores' fills (staging._fill_nodes) wait until the returned event is set."""
    from kv_cache import staging

    go = threading.Event()
    fill = staging._fill_nodes

    def held_fill(*args):
        assert go.wait(60)
        return fill(*args)

    monkeypatch.setattr(staging, "_fill_nodes", held_fill)
    return go


def test_stats_do_not_land_a_store_under_an_unrelated_lookup(monkeypatch):
    """Another conversation's lookup does not wait for a pending store, so it leaves the store
    pending; a metrics thread's stats read must not land it while the lookup walks the host tier
    (it did, outside the lock: 'Set changed size during iteration' in lookups under load). The
    store's background fill is held until the lookup is inside its agreement."""
    go = held_store_fills(monkeypatch)
    agree, entered, release = _held_agree()
    cache = PrefixCache(key(), staging_bytes=1 << 20, agree=agree)
    cache.store(P, len(P), view_of(source(P)))
    lookup = threading.Thread(target=lambda: cache.lookup([t + 1000 for t in P]))
    lookup.start()
    assert entered.wait(20)
    reader, stats = _stats_in_thread(cache)
    go.set()  # the fill finishes now: only the stats read could land it meanwhile
    reader.join(0.5)
    assert reader.is_alive() and not stats and cache._pending is not None and len(cache.host) == 0, \
        "the store landed while the lookup held the cache"
    release.set()
    lookup.join(20)
    reader.join(20)
    assert stats[0]["host_chunks"] == len(cache.host) == 6
    cache.close()


def test_a_cache_dropped_without_close_is_freed():
    """The exit hook holds the cache weakly: a dropped cache (a re-attached engine, a test) frees
    its staging buffer and thread instead of living until the process exits."""
    import gc
    import weakref

    cache = PrefixCache(key(), staging_bytes=1 << 20)
    cache.store(P, len(P), view_of(source(P)))
    cache.flush()
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
