"""The graph-capturable window forward (glm53.runtime.cuda_graphs) on the CPU: what a graph replays.

A CUDA graph cannot exist here, so these check the parts that decide its exactness and its
bookkeeping: `forward_window` (positions in a device tensor, rows written by index, keys scored up
to a bound past the window) equals the eager forward bit for bit, and `forward_windows` over several
sequences equals the eager batched forward; NaN scores set the flag instead of syncing; the runner
keys graphs by window, bound and cache addresses, a batch's by every sequence's, and the batched
runtime's decode steps through it give each request its reply alone. The capture itself and
graph replays against eager run on the GPU (tests/gpu/test_graph_replays_cuda.py).
"""
from __future__ import annotations

import random

import pytest
import torch

from glm53.runtime import cuda_graphs
from glm53.runtime.cuda_graphs import WindowGraphs, cache_addresses, key_bound, piece_bound, piece_rows
from glm53.runtime.engine import Glm53Engine
from glm53.runtime.batch import BatchEngine
from glm53.runtime.errors import EngineError
from glm53.model.indexer import SMALL_WINDOW_ROWS, select_topk
from glm53.model.paged_kv import PageStore
from glm53.model.transformer import Span
from tests.fixtures_tiny import tiny_dirs, tiny_engine  # noqa: F401


def test_key_bound_rounds_up_to_the_step_within_capacity() -> None:
    assert key_bound(1, 10_000, 4096) == 4096
    assert key_bound(4096, 10_000, 4096) == 4096
    assert key_bound(4097, 10_000, 4096) == 8192
    assert key_bound(9000, 9001, 4096) == 9001  # never past the capacity


def test_piece_graphs_take_powers_of_two_and_doubling_bounds() -> None:
    assert [piece_rows(n) for n in (17, 32, 33, 252, 256, 257, 1000)] == [32, 32, 64, 256, 256, 512, 1024]
    assert [piece_bound(stop, 1 << 62, 4096) for stop in (1, 4096, 4097, 19_000)] == [4096, 4096, 8192, 32768]
    assert piece_bound(19_000, 20_000, 4096) == 20_000  # never past a contiguous cache's capacity
    # a 200k prompt's 252-row pieces meet 7 bounds (4096 to 262144): 7 graphs, not one a BOUND_STEP
    assert len({piece_bound(stop, 1 << 62, 4096) for stop in range(252, 200_000, 252)}) == 7


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("compute,kv", [("fp32", "fp32"), ("fp32", "fp8"), ("bf16", "bf16")])
def test_padded_piece_equals_the_eager_piece_bitwise(tiny_dirs, compute: str, kv: str, paged: bool) -> None:  # noqa: F811
    """A 23-token prefill piece after a 70-token prefill, as a piece graph runs it: 32 rows, the 9 past
    its end repeating its last token at its last position, keys scored to a bound past it. Its own rows
    get the eager piece's hidden states and taps, the padding rows the last row's, and every cache row
    is the eager one's (the padding rewrote the last row's slot with that row's bits), in a contiguous
    cache and in pages."""
    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype=compute, kv_dtype=kv, prefill_chunk=1 << 20)
    model, rng = engine.model, random.Random(17)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(70)]
    piece = [rng.randrange(3, engine.vocab_size) for _ in range(23)]
    store = PageStore(model.new_state(kv), pages=12, page=32) if paged else None

    def fresh():  # noqa: ANN202
        return model.new_paged_state(store) if paged else model.new_state(kv)

    with torch.inference_mode():
        state, eager = fresh(), fresh()
        for s in (state, eager):
            model.forward(s, prompt, 0)
        start, n = state.length, len(piece)
        want = model.forward(eager, piece, start, taps=(1,))
        state.reserve(start + n + 40)
        rows = cuda_graphs._Rows(state, piece, start, piece_rows(n), piece_bound(start + n, state.capacity, 64))
        assert rows.rows == 32 and rows.bound == 128 and rows.positions()[-10:] == [start + n - 1] * 10
        flag = torch.zeros((), dtype=torch.bool)
        span = Span(torch.tensor(rows.positions()), None, rows.bound, flag)
        table = torch.tensor(state.padded_table(state.pages_for(rows.bound))) if paged else None
        with state.bound_table(table) if paged else torch.inference_mode():
            got = model.forward_windows([state], torch.tensor(rows.ids()), [span], taps=(1,))[0]
        state.tokens.extend(piece)
        assert not flag.item()
        assert torch.equal(got.hidden[:n], want.hidden) and torch.equal(got.taps[1][:n], want.taps[1])
        assert torch.equal(got.hidden[n:], want.hidden[-1:].expand(32 - n, -1))
        mine, theirs = state.export_rows(0, state.length), eager.export_rows(0, eager.length)
        for name in theirs:
            assert torch.equal(mine[name].view(torch.uint8), theirs[name].view(torch.uint8)), name


@pytest.mark.parametrize("compute,kv", [("fp32", "fp32"), ("fp32", "fp8"), ("bf16", "bf16")])
def test_window_form_equals_the_eager_forward_bitwise(tiny_dirs, compute: str, kv: str) -> None:  # noqa: F811
    """Windows of 1, 3 and 16 tokens after a 70-token prefill (past index_topk, MoE layers by
    slot): forward_window with a key bound well past the window writes the rows and returns the
    hidden states (and taps) of the eager forward."""
    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype=compute, kv_dtype=kv, prefill_chunk=1 << 20)
    model, rng = engine.model, random.Random(7)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(70)]
    with torch.inference_mode():
        state = model.new_state(kv)
        model.forward(state, prompt, 0)
        for n in (1, 3, SMALL_WINDOW_ROWS):
            window = [rng.randrange(3, engine.vocab_size) for _ in range(n)]
            start = state.length
            eager_state = state.clone()
            want = model.forward(eager_state, window, start, taps=(1,))
            state.reserve(start + n + 200)
            bound = key_bound(start + n, state.capacity, 64)
            assert bound > start + n
            flag = torch.zeros((), dtype=torch.bool)
            span = Span(torch.arange(start, start + n), None, bound, flag)
            got = model.forward_window(state, torch.tensor(window), span, taps=(1,))
            state.tokens.extend(window)
            assert not flag.item()
            assert torch.equal(got.hidden, want.hidden) and torch.equal(got.taps[1], want.taps[1]), n
            mine, theirs = state.export_rows(0, state.length), eager_state.export_rows(0, state.length)
            for name in theirs:
                assert torch.equal(mine[name].view(torch.uint8), theirs[name].view(torch.uint8)), (n, name)


def test_small_windows_take_the_packed_keys_with_the_same_set() -> None:
    """Up to SMALL_WINDOW_ROWS rows the selection comes from the packed keys directly (no tie
    test, no sync): with ties everywhere, the lower-position rule's set."""
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(SMALL_WINDOW_ROWS, 300, generator=g).round()  # integers: ties at every k-th score
    scores[:, 250:] = float("-inf")
    sel = select_topk(scores, 40)
    for t in range(SMALL_WINDOW_ROWS):
        finite = sorted((-s, p) for p, s in enumerate(scores[t].tolist()) if s != float("-inf"))
        assert sel.indices[t][sel.valid[t]].tolist() == sorted(p for _, p in finite[:40])


def test_nan_scores_set_the_flag_instead_of_raising() -> None:
    scores = torch.zeros(2, 50)
    scores[1, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        select_topk(scores, 8)
    flag = torch.zeros((), dtype=torch.bool)
    select_topk(scores, 8, nan_flag=flag)
    assert flag.item()


class EagerReplays(WindowGraphs):
    """The runner with its capture replaced by re-running the window form (no CUDA graph here)."""

    class _Replay:
        def __init__(self, rerun) -> None:  # noqa: ANN001
            self.rerun = rerun

        def replay(self) -> None:
            self.rerun()

    def _why_not_rows(self, state, rows, keys=0):  # noqa: ANN001, ANN201
        return None  # every window is eligible here (no CUDA device to ask)

    def _capture(self, entry, states, taps, key) -> None:  # noqa: ANN001
        def rerun() -> None:
            for buf, out in zip(entry.out, self._run(states, entry, taps)):
                buf.hidden.copy_(out.hidden)
                buf.last_layer.copy_(out.last_layer)
        entry.out = [cuda_graphs._copy(out) for out in self._run(states, entry, taps)]
        entry.graph = self._Replay(rerun)
        self.stats.captures += 1
        self._keep(key, entry)


def test_runner_keys_by_window_bound_and_cache_addresses(tiny_engine) -> None:  # noqa: F811
    """Decoding 60 tokens one at a time through the runner: the same tokens and rows as eager;
    one key per bound step while the cache stays put, a new key when reserve moves it."""
    model, rng = tiny_engine.model, random.Random(3)
    prompt = [rng.randrange(3, tiny_engine.vocab_size) for _ in range(230)]  # capacity 256: grows while decoding
    runner = EagerReplays(model, max_graphs=3, bound_step=16)
    with torch.inference_mode():
        state, eager = model.new_state("fp32"), model.new_state("fp32")
        model.forward(state, prompt, 0)
        model.forward(eager, prompt, 0)
        addresses = {cache_addresses(state)}
        for i in range(60):
            token = rng.randrange(3, tiny_engine.vocab_size)
            got = runner.forward(state, [token], state.length)
            want = model.forward(eager, [token], eager.length)
            assert torch.equal(got.hidden, want.hidden), i
            addresses.add(cache_addresses(state))
        assert state.tokens == eager.tokens
    assert len(addresses) >= 2  # the cache grew past its capacity at least once
    assert runner.stats.captures >= 60 // 16 and runner.stats.replays > 40
    assert runner.stats.first_runs == runner.stats.captures  # each key ran eagerly once, then replayed
    assert runner.stats.evictions == runner.stats.captures - len(runner._graphs) and len(runner._graphs) <= 3
    assert runner.forward(state, [1] * (cuda_graphs.MAX_WINDOW + 1), state.length) is None


def test_cuda_graphs_option_is_checked(tiny_dirs) -> None:  # noqa: F811
    with pytest.raises(EngineError, match="TF_GLM53_CUDA_GRAPHS=1 but .*not on cuda"):
        Glm53Engine(tiny_dirs.model, device="cpu", cuda_graphs="1")
    with pytest.raises(EngineError, match="TF_GLM53_CUDA_GRAPHS='sometimes'"):
        Glm53Engine(tiny_dirs.model, device="cpu", cuda_graphs="sometimes")
    assert Glm53Engine(tiny_dirs.model, device="cpu").graphs is None  # auto: eager on the CPU


def test_runner_raises_the_eager_error_on_nan_scores(tiny_engine) -> None:  # noqa: F811
    """A NaN in a cached indexer key makes the scores NaN: the eager forward raises at once, the
    window form sets its flag and the runner raises the same error after the window (first run
    and replay alike)."""
    model, rng = tiny_engine.model, random.Random(9)
    prompt = [rng.randrange(3, tiny_engine.vocab_size) for _ in range(50)]
    runner = EagerReplays(model, bound_step=16)
    with torch.inference_mode():
        state = model.new_state("fp32")
        model.forward(state, prompt, 0)
        runner.forward(state, [5], state.length)  # captured, clean
        layer = min(state.index_keys)
        state.index_keys[layer][7] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            model.forward(state.clone(), [6], state.length)
        with pytest.raises(ValueError, match="NaN"):
            runner.forward(state, [6], state.length)  # a replay of the captured key


def test_batched_window_form_equals_the_eager_batched_forward_bitwise(tiny_dirs) -> None:  # noqa: F811
    """Three sequences after prefills of 70, 9 and 33 tokens, windows of 1, 4 and 1 tokens:
    forward_windows (positions on the device, rows written by index, each sequence's keys scored to
    its own bound past its window) gives forward_batch's hidden rows, taps and cache rows."""
    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=1 << 20)
    model, rng = engine.model, random.Random(8)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (70, 9, 33)]
    windows = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (1, 4, 1)]
    with torch.inference_mode():
        states = [model.new_state("fp32") for _ in prompts]
        for state, prompt in zip(states, prompts):
            model.forward(state, prompt, 0)
        eager_states = [state.clone() for state in states]
        want = model.forward_batch(list(zip(eager_states, windows)), taps=(1,))
        spans = []
        for state, window in zip(states, windows):
            start, n = state.length, len(window)
            state.reserve(start + n + 100)
            spans.append(Span(torch.arange(start, start + n), None, key_bound(start + n, state.capacity, 64),
                              torch.zeros((), dtype=torch.bool)))
        got = model.forward_windows(states, torch.tensor([t for w in windows for t in w]), spans, taps=(1,))
    for g, w in zip(got, want):
        assert torch.equal(g.hidden, w.hidden) and torch.equal(g.taps[1], w.taps[1])
    for state, eager, window in zip(states, eager_states, windows):
        state.tokens.extend(window)
        mine, theirs = state.export_rows(0, state.length), eager.export_rows(0, state.length)
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_batched_decode_steps_replay_one_graph_and_equal_each_request_alone(tiny_dirs) -> None:  # noqa: F811
    """Four greedy requests decoding together through the runner (capture replaced by re-running
    the window form) over the paged pool: each reply is the one the request gets alone; a step
    with prefill pieces runs eagerly, the decode steps replay; keys carry no cache address, so four
    other requests of the same lengths replay the graphs the first four captured."""
    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=32)
    rng = random.Random(12)
    greedy = {"temperature": 0.0, "ignore_eos": True}  # every step holds all four
    rounds = [[[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (20, 45, 7, 30)] for _ in range(2)]
    alone = [[engine.generate(p, 24, dict(greedy)) for p in prompts] for prompts in rounds]
    engine.state = None
    engine.graphs = EagerReplays(engine.model, max_graphs=8, bound_step=64)
    batch = BatchEngine(engine, max_seqs=4, pool_block=32)
    stats = engine.graphs.stats
    for i, prompts in enumerate(rounds):
        seqs = [batch.submit(p, 24, dict(greedy)) for p in prompts]
        batch.run()
        assert [s.reply for s in seqs] == alone[i], i
        if i == 0:
            captured = stats.captures
            assert stats.first_runs + stats.replays + stats.eager == batch.steps, stats  # every step went through it
            assert stats.eager >= 1, stats  # the first step's prefill pieces
            assert 1 <= captured <= 3 and stats.replays >= 15, stats  # keys: bounds 64 and 128, one a window count
    assert stats.captures == captured, stats


def test_prefill_pieces_beside_decode_windows_replay_piece_graphs_and_equal_alone(tiny_dirs) -> None:  # noqa: F811
    """Three greedy streams decoding while a 300-token prompt arrives, under a 40-row step budget
    (capture replaced by re-running the window form): each step holds the streams' decode windows
    (one graph) and a 37-row piece of the prompt (a graph of its own, 64 rows, padded), keyed by its
    doubling bound; every reply, the long one's too, is the one its request gets alone; a second
    long prompt replays the piece graphs the first captured."""
    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=64)
    engine.graphs = EagerReplays(engine.model, max_graphs=16, bound_step=64)
    got, want, piece_keys = streams_beside_long_prompts(engine, engine, step_tokens=40, long_prompt=300)
    assert got == want
    # the first prompt's: one a bound it met, one size (its last 4 rows ride with the decode windows);
    # and the streams' first step's 20-token prompt beside their two short ones
    assert piece_keys == {(64, 64), (64, 128), (64, 256), (64, 512), (32, 64)}
    stats = engine.graphs.stats
    assert stats.pieces >= 2 * (300 // 37) - 1, stats  # both prompts' pieces replayed graphs of their own
    assert _piece_keys(engine.graphs) == piece_keys  # the second prompt captured none
    assert not any("piece" in reason for reason in stats.reasons), stats.reasons


def streams_beside_long_prompts(engine, alone_engine, step_tokens: int, long_prompt: int  # noqa: ANN001
                                ) -> tuple[list[list[int]], list[list[int]], set[tuple[int, int]]]:
    """Three greedy streams (prompts of 10, 20 and 15 tokens, 60 tokens each) through engine's
    batched runtime; once they decode, two prompts of `long_prompt` tokens arrive one after the
    other (4 tokens each). Returns (every reply batched, every reply alone from alone_engine, the
    piece graphs kept after the first long prompt)."""
    rng = random.Random(21)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    streams = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (10, 20, 15)]
    longs = [[rng.randrange(3, engine.vocab_size) for _ in range(long_prompt)] for _ in range(2)]
    graphs, alone_engine.graphs = alone_engine.graphs, None
    alone = [alone_engine.generate(p, 60, dict(greedy)) for p in streams]
    alone += [alone_engine.generate(p, 4, dict(greedy)) for p in longs]
    alone_engine.state, alone_engine.graphs = None, graphs
    batch = BatchEngine(engine, max_seqs=4, pool_block=32, step_tokens=step_tokens)
    seqs = [batch.submit(p, 60, dict(greedy)) for p in streams]
    while any(s.status.name != "DECODE" for s in seqs):
        batch.step()
    replies, piece_keys = [], set()
    for prompt in longs:
        long = batch.submit(prompt, 4, dict(greedy))
        while not long.finished:
            batch.step()
        replies.append(long.reply)
        piece_keys = piece_keys or _piece_keys(engine.graphs)
    batch.run()
    return [s.reply for s in seqs] + replies, alone, piece_keys


def _piece_keys(graphs: WindowGraphs) -> set[tuple[int, int]]:
    """(rows, key bound) of the piece graphs kept: keys of one window of more than MAX_WINDOW rows."""
    return {parts[0][:2] for _, parts in graphs._graphs if len(parts) == 1 and parts[0][0] > cuda_graphs.MAX_WINDOW}


def test_step_budget_defaults_to_fewer_rows_where_pieces_replay_graphs(tiny_dirs) -> None:  # noqa: F811
    """TF_GLM53_STEP_TOKENS unset: 256 rows a step where steps run eager (a piece step costs its host
    work up to there), 128 where pieces replay graphs (a piece step costs its rows); set, it wins."""
    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32")
    assert BatchEngine(engine, pool_bytes=1 << 20).scheduler.step_tokens == 256
    engine.graphs = EagerReplays(engine.model)
    assert BatchEngine(engine, pool_bytes=1 << 20).scheduler.step_tokens == 128
    assert BatchEngine(engine, pool_bytes=1 << 20, step_tokens=300).scheduler.step_tokens == 300
