"""The paged KV store (glm53/model/paged_kv.py) and its pool (glm53.runtime.kv_pool.PagedPool):
a PagedKVState holds, reads and exports the bits a contiguous KVState does, whatever pages it gets
(a split cache's, PagedDcpKVState, the bits of DcpKVState on every rank); shared pages are copied
before a write lands in them; the pool counts pages, shared ones once; the ranks of a split cache
take, share and free the same pages."""
from __future__ import annotations

import random

import pytest
import torch

from glm53.dist.dcp import Ownership
from glm53.dist.dcp_state import DcpKVState, PagedDcpKVState
from glm53.model.indexer import Selection
from glm53.model.kv_state import KVState
from glm53.model.paged_kv import NULL_PAGE, OutOfPages, PagedKVState, PageStore
from glm53.runtime.kv_pool import PagedPool
from glm53.runtime.batch import BatchEngine
from glm53.runtime.sequence import Status
from tests.fixtures_tiny import tiny_dirs, tiny_engine  # noqa: F401

LAYERS, LATENT, INDEX = 3, 12, 8


def probe(kv_dtype: str) -> KVState:
    return KVState(n_layers=LAYERS, latent_dim=LATENT, index_dim=INDEX, indexed_layers=frozenset({0, 2}),
                   kv_dtype=kv_dtype)


def split_probe(kv_dtype: str, rank: int, ranks: int) -> DcpKVState:
    return DcpKVState(n_layers=LAYERS, latent_dim=LATENT, index_dim=INDEX, indexed_layers=frozenset({0, 2}),
                      kv_dtype=kv_dtype, own=Ownership(rank, ranks))


def fill(state, rng: torch.Generator, start: int, n: int) -> None:  # noqa: ANN001
    """n rows at [start, start + n) in every layer, as a forward writes them."""
    state.reserve(start + n)
    for layer in range(LAYERS):
        state.write_latent(layer, start, torch.randn(n, LATENT, generator=rng))
        if layer in (0, 2):
            state.write_index(layer, start, torch.randn(n, INDEX, generator=rng))
    state.tokens.extend(range(start, start + n))


def selected(state, layer: int, stop: int, dtype: torch.dtype, indices: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The rows the attention reads for a selection, through the state's attention view."""
    read, rows_of = state.attention_view(layer, stop, dtype)
    return read()[rows_of(indices) if rows_of is not None else indices]


def same_rows(a, b, stop: int) -> bool:  # noqa: ANN001
    ra, rb = a.export_rows(0, stop), b.export_rows(0, stop)
    return ra.keys() == rb.keys() and all(torch.equal(ra[k].view(torch.uint8), rb[k].view(torch.uint8)) for k in ra)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8"])
def test_paged_state_holds_the_bits_of_a_contiguous_one(kv_dtype: str) -> None:
    """Rows written in pieces over pages taken out of order (another state holds every other page):
    reads, exports and a re-import give the contiguous cache's bits; the attention's view reads
    the same rows through translated indices."""
    store = PageStore(probe(kv_dtype), pages=40, page=4)
    paged, other, flat = PagedKVState(store), PagedKVState(store), probe(kv_dtype)
    for start, n in ((0, 3), (3, 6), (9, 1), (10, 13)):
        for state in (paged, flat):
            fill(state, torch.Generator().manual_seed(start), start, n)
        fill(other, torch.Generator().manual_seed(99), other.length, 4)
    assert paged.table != list(range(1, len(paged.table) + 1))  # interleaved with the other state's
    assert same_rows(paged, flat, 23)
    for layer in range(LAYERS):
        assert torch.equal(paged.read_latent(layer, 23, torch.float32), flat.read_latent(layer, 23, torch.float32))
    assert torch.equal(paged.read_index(2, 23, torch.float32), flat.read_index(2, 23, torch.float32))
    indices = torch.tensor([[0, 5, 22, 0], [7, 9, 11, 0]])
    assert torch.equal(selected(paged, 1, 23, torch.float32, indices), flat.read_latent(1, 23, torch.float32)[indices])
    copy = PagedKVState(store)
    copy.import_rows(0, paged.export_rows(0, 23), list(range(23)))
    assert same_rows(copy, flat, 23) and copy.frontier == 23


def test_shared_pages_are_copied_before_a_write_lands_in_them() -> None:
    """B shares A's two full pages (of a 10-row prefix, page 4): counts 2, nothing copied. B cut
    back into the second page and written there gets a private copy of it; A's rows stay, and
    releasing both frees every page."""
    store = PageStore(probe("fp32"), pages=10, page=4)
    a, b = PagedKVState(store), PagedKVState(store)
    fill(a, torch.Generator().manual_seed(1), 0, 10)
    a.frontier = 10
    before = a.export_rows(0, 10)
    assert b.share_prefix(a, 10) == 8
    assert b.table == a.table[:2] and all(store.refs[p] == 2 for p in a.table[:2])
    assert store.free_pages == 9 - 3
    b.truncate(6)
    assert b.pages_wanted(7) == 1  # the shared second page, made private
    fill(b, torch.Generator().manual_seed(2), 6, 1)
    assert b.table[0] == a.table[0] and b.table[1] != a.table[1]
    assert store.refs[a.table[1]] == 1 and store.refs[b.table[1]] == 1
    assert all(torch.equal(before[k], a.export_rows(0, 10)[k]) for k in before)  # A untouched
    assert torch.equal(b.export_rows(0, 6)["latent.1"], before["latent.1"][:6])  # B kept the copied rows
    a.release()
    b.release()
    assert store.free_pages == 9 and store.refs[NULL_PAGE] > 0


def test_pool_counts_pages_and_refuses_past_them() -> None:
    pool = PagedPool(probe("fp32"), budget_bytes=probe("fp32").bytes_per_position() * 20, page=4)
    assert pool.capacity == 20 and pool.blocks(5) == 8 and pool.fits(20) and not pool.fits(21)
    s = pool.allocate(9)
    assert s is not None and s.table == [] and pool.used == 0  # pages come with ensure
    assert pool.ensure(s, 9) and pool.used == 12
    t = pool.allocate(8)
    assert pool.ensure(t, 8) and pool.free == 0
    assert not pool.ensure(t, 9) and pool.allocate(1) is None
    with pytest.raises(OutOfPages):
        t.reserve(9)  # past the pool: the store refuses rather than overrun
    pool.release(s)
    assert pool.free == 12 and pool.ensure(t, 20)


def test_selection_translation_clamps_padding() -> None:
    """Padded or stale selection slots (index 0, or past the bound) still translate into the store."""
    store = PageStore(probe("bf16"), pages=6, page=4)
    s = PagedKVState(store)
    fill(s, torch.Generator().manual_seed(3), 0, 6)
    sel = Selection(torch.tensor([[5, 0, 0], [2, 1, 40]]), torch.tensor([[True, False, False], [True, True, False]]))
    read, rows_of = s.attention_view(0, 6, torch.bfloat16)
    translated = rows_of(sel.indices)
    assert int(translated.max()) < store.stacks["latent"].shape[1] and int(translated.min()) >= 0
    assert torch.equal(read()[translated[0, 0]], s.read_latent(0, 6, torch.bfloat16)[5])


def test_preempted_and_cancelled_sequences_return_their_pages(tiny_engine) -> None:  # noqa: F811
    """A pool of 6 pages of 16: three sequences sharing a 32-token prefix; the youngest is preempted
    when the others grow, one is cancelled mid-way; at the end every page is free again."""
    rng = random.Random(4)
    prefix = [rng.randrange(3, tiny_engine.vocab_size) for _ in range(32)]
    batch = BatchEngine(tiny_engine, max_seqs=3, pool_block=16,
                        pool_bytes=6 * 16 * tiny_engine.model.new_state("fp32").bytes_per_position())
    seqs = []
    for _ in range(3):  # each arrives once the one before has prefilled: it shares that one's prefix
        seqs.append(batch.submit(prefix + [rng.randrange(3, 90) for _ in range(3)], 40,
                                 {"ignore_eos": True, "draft": False}))
        batch.step()
    batch.step()
    store = batch.pool.store
    running = [s for s in seqs if s.state is not None and s.status is Status.DECODE]
    assert len(running) >= 2 and running[1].state.table[:2] == running[0].state.table[:2]
    batch.cancel(running[0])
    batch.run()
    assert batch.scheduler.preempted_total >= 1
    assert store.free_pages == store.usable_pages and batch.pool.used == 0


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_paged_split_cache_holds_each_ranks_bits(kv_dtype: str, ranks: int) -> None:
    """On every rank of a cache split by position, a PagedDcpKVState written in pieces (pages taken
    out of order) reads, exports and re-imports the bits of DcpKVState: the same owned positions,
    the same rows; the attention's view reads the selected local rows through the store."""
    for rank in range(ranks):
        store = PageStore(split_probe(kv_dtype, rank, ranks), pages=40, page=2)
        paged, other = PagedDcpKVState(store, Ownership(rank, ranks)), PagedDcpKVState(store, Ownership(rank, ranks))
        flat = split_probe(kv_dtype, rank, ranks)
        for start, n in ((0, 3), (3, 6), (9, 1), (10, 13)):
            for state in (paged, flat):
                fill(state, torch.Generator().manual_seed(start), start, n)
            fill(other, torch.Generator().manual_seed(99), other.length, 5)
        assert paged.table != list(range(1, len(paged.table) + 1))
        assert torch.equal(paged.owned_positions(23), flat.owned_positions(23))
        assert paged.slots(5, 23) == flat.slots(5, 23)
        assert same_rows(paged, flat, 23)
        mine = flat.own.count(23)
        for layer in range(LAYERS):
            assert torch.equal(paged.read_latent(layer, 23, torch.float32), flat.read_latent(layer, 23, torch.float32))
        assert torch.equal(paged.read_index(2, 23, torch.float32), flat.read_index(2, 23, torch.float32))
        keys, rows = paged.index_view(2, 23, torch.bfloat16)
        assert torch.equal(keys[rows] if rows is not None else keys, flat.read_index(2, 23, torch.bfloat16))
        indices = torch.tensor([[0, mine - 1, 1], [2, 0, 0]])
        assert torch.equal(selected(paged, 1, 23, torch.bfloat16, indices), flat.read_latent(1, 23, torch.bfloat16)[indices])
        copy = PagedDcpKVState(store, Ownership(rank, ranks))
        copy.import_rows(0, paged.export_rows(0, 23), list(range(23)))
        assert same_rows(copy, flat, 23)


def test_the_ranks_of_a_split_cache_take_share_and_free_the_same_pages() -> None:
    """Four ranks run the same operations on their own stores (prefill, a second sequence sharing
    the first's prompt, decode, a cut back into the shared pages, release): after each one every
    rank holds the same page tables and the same free count, whatever positions it owns; a shared
    prefix is whole pages of every rank (page x R positions)."""
    ranks, page = 4, 2
    stores = [PageStore(split_probe("bf16", r, ranks), pages=30, page=page) for r in range(ranks)]
    a = [PagedDcpKVState(stores[r], Ownership(r, ranks)) for r in range(ranks)]
    b = [PagedDcpKVState(stores[r], Ownership(r, ranks)) for r in range(ranks)]

    def alike() -> None:
        for r in range(1, ranks):
            assert a[r].table == a[0].table and b[r].table == b[0].table
            assert stores[r].free_pages == stores[0].free_pages and (stores[r].refs == stores[0].refs).all()

    for r in range(ranks):
        fill(a[r], torch.Generator().manual_seed(1), 0, 21)
        a[r].frontier = 21
    alike()
    taken = [b[r].share_prefix(a[r], 21) for r in range(ranks)]
    assert taken == [16] * ranks and all(stores[r].refs[a[r].table[0]] == 2 for r in range(ranks))
    alike()
    assert len({b[r].pages_wanted(22) for r in range(ranks)}) == 1
    for r in range(ranks):
        fill(b[r], torch.Generator().manual_seed(2), 16, 6)
        fill(a[r], torch.Generator().manual_seed(3), 21, 4)
    alike()
    for r in range(ranks):
        b[r].truncate(9)  # into the second shared page: it is made private before the write
        fill(b[r], torch.Generator().manual_seed(4), 9, 1)
        assert b[r].table[0] == a[r].table[0] and b[r].table[1] != a[r].table[1]
    alike()
    for r in range(ranks):
        a[r].release()
        b[r].release()
    alike()
    assert stores[0].free_pages == stores[0].usable_pages


def test_a_split_caches_pool_counts_positions_of_every_rank() -> None:
    """PagedPool over a split cache: a page of block // R slots holds `block` positions; the bytes a
    position takes on a rank are 1/R of a slot's; a capacity set lower (the smallest rank's) is what
    the store hands out."""
    flat = probe("bf16")
    pool = PagedPool(split_probe("bf16", 1, 4), budget_bytes=flat.position_bytes() * 40, page=8,
                     new_state=lambda store: PagedDcpKVState(store, Ownership(1, 4)))
    assert pool.block == 8 and pool.store.page == 2 and pool.capacity == 160
    assert pool.position_bytes == -(-flat.position_bytes() // 4)
    pool.limit(100)
    assert pool.capacity == 96 and pool.store.free_pages == 12
    s = pool.allocate(20)
    assert isinstance(s, PagedDcpKVState) and pool.ensure(s, 20) and pool.used == 24 and len(s.table) == 3


def test_a_batched_steps_indexer_selects_for_each_window_what_it_selects_alone(tiny_engine, monkeypatch
                                                                                ) -> None:  # noqa: F811
    """Windows of equal length in one step are scored in one call over a table of their keys (shorter
    contexts padded) and selected together: every window's rows keep the bits of its sequence run alone,
    for decode rows and verification-sized windows, consecutive or not, beside a prefill piece."""
    from glm53 import ops

    model = tiny_engine.model
    contexts = [45, 70, 33, 90, 52, 61]  # above index_topk (32): the top-k chooses
    windows = [1, 5, 1, 3, 3, 1]  # groups {0, 2, 5} (apart) and {3, 4}; window 1 a piece of its own
    rng = random.Random(11)
    prompts = [[rng.randrange(tiny_engine.vocab_size) for _ in range(n)] for n in contexts]
    steps = [[rng.randrange(tiny_engine.vocab_size) for _ in range(n)] for n in windows]
    store = PageStore(model.new_state(tiny_engine.kv_dtype), pages=120, page=4)
    tables: list[tuple[int, ...]] = []
    scores_spans = ops.index_scores_spans

    def spy(q, head_weights, keys, scale, q_positions, key_table, key_positions=None):  # noqa: ANN001, ANN202
        tables.append(tuple(key_table.shape))
        return scores_spans(q, head_weights, keys, scale, q_positions, key_table, key_positions)

    monkeypatch.setattr(ops, "index_scores_spans", spy)
    with torch.inference_mode():
        states = [model.plan.new_paged_state(store) for _ in prompts]
        for s, p in zip(states, prompts):
            model.forward_batch([(s, p)])
        assert not tables, "a sequence alone selects on its own"
        got = model.forward_batch(list(zip(states, steps)))
        want = [model.forward(model.new_state(tiny_engine.kv_dtype), p + w, 0).hidden[len(p):]
                for p, w in zip(prompts, steps)]
    full_layers = sum(1 for layer in model.w.layers if layer.indexer is not None)
    assert sorted(set(tables)) == [(2, 90 + 3), (3, 61 + 1)] and len(tables) == 2 * full_layers, tables
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g.hidden), f"window {i}: rows differ from its sequence alone"


def test_the_default_pool_leaves_a_unified_memory_node_its_host_tier_and_floor() -> None:
    """Unset TF_GLM53_KV_POOL_BYTES: 90% of a discrete GPU's free memory; on unified memory (a DGX Spark)
    the prefix cache's host tier and the memory guard's floor first; none left: a clear error naming
    the knobs."""
    from glm53.runtime.batch import pool_bytes_of_free
    from glm53.settings import Settings

    gib, s = 1 << 30, Settings(host_cache_bytes=8 << 30, mem_floor_mb=4096)
    assert pool_bytes_of_free(100 * gib, False, s) == int(100 * gib * 0.9)
    assert pool_bytes_of_free(100 * gib, True, s) == int(88 * gib * 0.9)
    assert pool_bytes_of_free(100 * gib, True, Settings(prefix_cache=False, mem_floor_mb=4096)) == int(96 * gib * 0.9)
    with pytest.raises(ValueError, match="TF_GLM53_KV_POOL_BYTES") as refused:
        pool_bytes_of_free(10 * gib, True, s)
    assert "TF_GLM53_HOST_CACHE_BYTES" in str(refused.value) and "TF_GLM53_MEM_FLOOR_MB" in str(refused.value)
