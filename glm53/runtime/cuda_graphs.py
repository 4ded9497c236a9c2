"""CUDA graphs for short windows: decode steps, draft verification, a one-word extension.

Why: a one-token forward of GLM-5.3's layers is a few ms of GPU work behind several times that in
host work (measured on the H200, 4 layers: 3.3 ms of kernels, ~8 ms of Python and ~250 launches).
A captured graph replays the launches without the Python; on a DGX Spark's slower host, and at 78
layers, that host time would otherwise bound decode.

What is captured: `Glm53Model.forward_windows` for one window length T and one key bound L a
sequence, over the sequences' cache tensors (one sequence: a decode step or a verification window;
several: a batched decode step of glm53.runtime.batch, whose steps keep their sequences for long
stretches). Everything that moves from step to step lives in device buffers the
graph reads: the token ids and the positions. Rows are written by index and the queries score the
cache rows [0, L): rows past the window are future to every query, so they score -inf and are
never selected, and the forward computes exactly what the eager one does (the ops are row- and
key-invariant; tests/gpu/test_graph_replays_cuda.py checks graph against eager bit for bit). L is the
window's end rounded up to BOUND_STEP (capped by the capacity), so one graph serves BOUND_STEP
positions of decoding, and the extra keys cost little.

A graph holds the addresses of the states' cache tensors; `KVState.reserve` replaces them when it
grows, and another conversation may bring another state. Graphs are therefore keyed by taps and
each window's (T, L, the cache tensors' addresses) and at most `max_graphs` are kept (least recently used first
out), in one memory pool. The first window of a key runs eagerly (which also compiles the kernels),
then the graph is captured (capture_begin/end on a side stream, without torch.cuda.graph's
emptying of the allocator's caches: bench/bench_graph_capture.py); later windows replay it. Outputs are copied out of the graph's
buffers, so a later replay never overwrites what a caller holds. NaN indexer scores, which the
eager forward raises on, set a device flag that is checked after the replay, with the same error.

Prefill pieces beside decode windows (glm53.runtime.batch: a long prompt advances a piece a step
while streams decode) replay graphs too, one a piece, after the decode windows' graph: a piece of n
rows runs in a graph of `piece_rows(n)` rows (a power of two), its padding rows copies of its last
row (same token, same position: with row-invariant ops they compute that row's bits and write them
to its slot again, so nothing else changes), its key bound `piece_bound` (BOUND_STEP doubled until it
holds the piece: a prompt of N positions replays log2(N / BOUND_STEP) + 1 graphs a piece size). An
eager piece step costs the eager forward's host work (~8 ms for 4 layers of GLM-5.3's dimensions on
an H100, whatever its rows: docs/decisions/step-budget.md), which is the streams' gap while a prompt
arrives.

Only where it is exact and sync-free: a CUDA device, row-invariant kernels (not
TF_GLM53_KERNELS=torch), one rank with a plain KVState (collectives and DCP's top-k exchange are
not captured), and every feed-forward block capturable at the window's rows (`Glm53Model.graph_safe`: a dense MLP
always, DecodedExperts in its slot form and, for pieces, its grouped form where the device gives it
linear's bits, packed EXL3 experts in either form).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from glm53 import ops
from glm53.model.kv_state import KVState
from glm53.model.paged_kv import PagedKVState
from glm53.model.indexer import SMALL_WINDOW_ROWS, selects_without_sync
from glm53.model.transformer import ForwardOutput, Glm53Model, Span

BOUND_STEP = 4096  # key bounds are multiples of this (or the capacity)
MAX_WINDOW = SMALL_WINDOW_ROWS  # decode steps, verification windows: many to a graph
MIN_PIECE, MAX_PIECE = 2 * MAX_WINDOW, 1024  # the graph sizes of prefill pieces beside decode windows
GRAPH_CHOICES = ("auto", "1", "0")


def key_bound(stop: int, capacity: int, step: int = BOUND_STEP) -> int:
    """The cache rows a window ending at `stop` scores: stop rounded up to `step`, within capacity."""
    return min(capacity, -(-stop // step) * step)


def piece_bound(stop: int, capacity: int, step: int = BOUND_STEP) -> int:
    """The cache rows a prefill piece ending at `stop` scores: `step` doubled until it holds stop,
    within capacity (a prompt's pieces meet few bounds, so few graphs; the extra keys score -inf)."""
    bound = step
    while bound < stop:
        bound *= 2
    return min(capacity, bound)


def piece_rows(n: int) -> int:
    """The rows of the graph an n-row prefill piece replays: n rounded up to a power of two, at least
    MIN_PIECE (the rest are padding rows)."""
    return max(MIN_PIECE, 1 << (n - 1).bit_length())


def cache_addresses(state: KVState) -> tuple[int, ...]:
    """The addresses a captured graph reads and writes (they change when reserve grows the cache)."""
    tensors = list(state.latent) + list(state.latent_scale) + list(state.index_keys.values()) \
        + list(state.index_scale.values())
    return tuple(t.data_ptr() if t is not None else 0 for t in tensors)


Window = tuple[KVState, list[int], int]  # a sequence's state, its window's tokens, their first position


@dataclass(frozen=True)
class _Rows:
    """A window as a graph runs it: `rows` rows (its tokens, then padding rows that repeat its last
    token at its last position), keys [0, bound) scored."""

    state: KVState
    tokens: list[int]
    start: int
    rows: int
    bound: int

    def ids(self) -> list[int]:
        return self.tokens + self.tokens[-1:] * (self.rows - len(self.tokens))

    def positions(self) -> list[int]:
        stop = self.start + len(self.tokens)
        return list(range(self.start, stop)) + [stop - 1] * (self.rows - len(self.tokens))


def store_addresses(state: PagedKVState) -> tuple[int, ...]:
    """The addresses a graph over a paged state reads and writes: its store's (fixed for the lane)."""
    return tuple(t.data_ptr() for t in state.store.stacks.values() if t is not None)


@dataclass
class _Captured:
    inputs: torch.Tensor  # [ids | positions | page tables]: what a replay reads, filled by one copy
    sizes: tuple[int, ...]  # each window's tokens
    bounds: tuple[int, ...]  # each window's key bound
    table_pages: tuple[int | None, ...]  # a paged window's page-table entries (None: a contiguous cache)
    nan_flag: torch.Tensor
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    out: list[ForwardOutput] | None = None  # the graph's output buffers, a window each

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs[: sum(self.sizes)]

    @property
    def positions(self) -> torch.Tensor:
        n = sum(self.sizes)
        return self.inputs[n: 2 * n]

    def outputs(self, real: list[int]) -> list[ForwardOutput]:
        """Copies of the graph's outputs (a later replay overwrites its buffers), each window's first
        `real[i]` rows (a padded piece's own)."""
        return [_copy(out, n) for out, n in zip(self.out, real)]

    def tables(self) -> list[torch.Tensor | None]:
        """Each window's page-table buffer (views of `inputs`), None for a contiguous cache."""
        at, out = 2 * sum(self.sizes), []
        for pages in self.table_pages:
            out.append(None if pages is None else self.inputs[at: at + pages])
            at += pages or 0
        return out

    def spans(self) -> list[Span]:
        return [Span(p, None, bound, self.nan_flag)
                for p, bound in zip(self.positions.split(list(self.sizes)), self.bounds)]


def _capacity(state: KVState | PagedKVState) -> int:
    """What caps a key bound: a contiguous cache's rows; none for a paged state (its table is padded)."""
    return 1 << 62 if isinstance(state, PagedKVState) else state.capacity


def _placement(state: KVState | PagedKVState, bound: int) -> tuple[tuple, int | None]:
    """(where the rows a window with this key bound reads live, the page-table entries a graph reads:
    None for a contiguous cache, whose addresses key it). A paged state's store is the lane's, so its
    key holds no sequence's address."""
    if isinstance(state, PagedKVState):
        pages = state.pages_for(bound)
        return ("pages", pages, store_addresses(state)), pages
    return cache_addresses(state), None


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0  # windows that were not eligible
    first_runs: int = 0  # eligible windows run eagerly because their key had no graph yet
    pieces: int = 0  # prefill pieces that replayed a graph of their own
    evictions: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # why windows ran eagerly


class WindowGraphs:
    """Runs short windows, and prefill pieces beside them, of one model through captured CUDA graphs
    (see the module docstring)."""

    def __init__(self, model: Glm53Model, max_graphs: int = 32, bound_step: int = BOUND_STEP) -> None:
        self.model = model
        self.max_graphs = max_graphs
        self.bound_step = bound_step
        self.stats = GraphStats()
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool: Any = None
        self._stream: Any = None  # the capture stream (torch.cuda.Stream), made with the pool
        self._graph_safe: dict[int, bool] = {}  # rows -> model.graph_safe(rows) (the layers never change)

    # ---- eligibility --------------------------------------------------------------------------
    def why_not(self, state: KVState, n: int) -> str | None:
        """None when a window of n tokens over `state` can replay a graph, else the reason."""
        if not 1 <= n <= MAX_WINDOW:
            return f"window of {n} tokens (graphs take 1..{MAX_WINDOW})"
        return self._why_not_rows(state, MAX_WINDOW)

    def why_not_piece(self, state: KVState, n: int) -> str | None:
        """None when a prefill piece of n tokens over `state` can replay a graph of piece_rows(n) rows."""
        if not MAX_WINDOW < n <= MAX_PIECE:
            return f"piece of {n} tokens (piece graphs take {MAX_WINDOW + 1}..{MAX_PIECE})"
        return self._why_not_rows(state, piece_rows(n), piece_bound(state.length + n, _capacity(state), self.bound_step))

    def _why_not_rows(self, state: KVState, rows: int, keys: int = 0) -> str | None:
        """Whether `rows` rows over `state` can be captured; keys: the key bound of a window of more
        than MAX_WINDOW rows (its top-k reads nothing back only as the Triton kernel)."""
        m = self.model
        if m.device.type != "cuda":
            return "not on cuda"
        if not ops.row_invariant(m.device):
            return "kernels not row-invariant (TF_GLM53_KERNELS=torch)"
        if m.plan.world != 1:
            return "several ranks (collectives between them are not captured)"
        if type(state) not in (KVState, PagedKVState):
            return f"{type(state).__name__} (split cache) is not captured"
        if not self.rows_safe(rows):
            return f"a feed-forward block syncs over {rows} rows"
        if not selects_without_sync(rows, keys, m.device):
            return f"a piece scoring {keys} keys (the top-k over more syncs)"
        return None

    def rows_safe(self, rows: int) -> bool:
        """Whether the model's feed-forward blocks run `rows` rows without a host read (asked once a row
        count: the layers never change)."""
        if rows not in self._graph_safe:
            self._graph_safe[rows] = self.model.graph_safe(rows)
        return self._graph_safe[rows]

    def why_not_batch(self, windows: list[Window]) -> str | None:
        """None when these windows (one a sequence) can replay one graph together, else the reason."""
        if len({id(state) for state, _, _ in windows}) != len(windows):
            return "a sequence with several windows (prefill pieces)"
        for state, tokens, _ in windows:
            reason = self.why_not(state, len(tokens))
            if reason is not None:
                return reason
        return None

    def _plan(self, windows: list[Window]) -> tuple[list[list[_Rows]], list[int]] | str:
        """The graphs a step's windows replay: the short ones together, each prefill piece apart (rows
        padded to its graph's), pieces only beside short windows (decode steps: without them the step
        is a prefill, whose eager wave's launches are amortized over its rows); the order their
        outputs come in, as indices into `windows`. A reason string when some window cannot."""
        short = [i for i, (_, tokens, _) in enumerate(windows) if len(tokens) <= MAX_WINDOW]
        pieces = [i for i, (_, tokens, _) in enumerate(windows) if len(tokens) > MAX_WINDOW]
        reason = self.why_not_batch([windows[i] for i in short]) if short else None
        if reason is None and pieces and not short:
            reason = "prefill pieces alone (an eager wave amortizes its launches)"
        if reason is None and len({id(state) for state, _, _ in windows}) != len(windows):
            reason = "a sequence with several windows (prefill pieces)"
        for i in pieces:
            state, tokens, _ = windows[i]
            reason = reason or self.why_not_piece(state, len(tokens))
        if reason is not None:
            return reason
        calls = [[self._rows(*windows[i], len(windows[i][1]), key_bound) for i in short]] if short else []
        for i in pieces:
            calls.append([self._rows(*windows[i], piece_rows(len(windows[i][1])), piece_bound)])
        return calls, short + pieces

    def _rows(self, state: KVState, tokens: list[int], start: int, rows: int, bound_of) -> _Rows:  # noqa: ANN001
        if start != state.length:
            raise ValueError(f"forward at position {start} but the cache holds {state.length} rows; "
                             "windows must continue it")
        state.reserve(start + len(tokens))  # before keying: growing moves a contiguous cache
        return _Rows(state, tokens, start, rows, bound_of(start + len(tokens), _capacity(state), self.bound_step))

    # ---- the forward ----------------------------------------------------------------------------
    def forward(self, state: KVState, tokens: list[int], start: int, taps: tuple[int, ...] = ()
                ) -> ForwardOutput | None:
        """The window's ForwardOutput (rows written, state.tokens extended), or None when it is not
        eligible (the caller runs the eager forward)."""
        outs = self.forward_batch([(state, tokens, start)], taps)
        return None if outs is None else outs[0]

    def forward_batch(self, windows: list[Window], taps: tuple[int, ...] = ()) -> list[ForwardOutput] | None:
        """Several sequences' windows (one a sequence): the short ones (a batched decode step; one
        window: a sequence's step) in one graph, then each prefill piece beside them in a graph of its
        own. A ForwardOutput a window (rows written, each state's tokens extended), or None when they
        are not eligible (the caller runs the eager forward). A graph's key is every window's (rows, key
        bound, where its rows live) in order: a batch whose sequences keep their contiguous caches, or
        any paged sequences of the same lengths and bounds, replays one graph."""
        planned = self._plan(windows)
        if isinstance(planned, str):
            self.stats.eager += 1
            self.stats.reasons[planned] = self.stats.reasons.get(planned, 0) + 1
            return None
        calls, order = planned
        launched = [self._launch(call, taps) for call in calls]  # every graph queued before any host read
        if any(bool(entry.nan_flag.item()) for entry, _ in launched):
            raise ValueError("indexer scores contain NaN; the selection is undefined")
        self.stats.pieces += sum(call[0].rows > MAX_WINDOW for call in calls)
        outs: list[ForwardOutput | None] = [None] * len(windows)
        for i, out in zip(order, (out for _, got in launched for out in got)):
            outs[i] = out
        for call in calls:
            for w in call:
                w.state.tokens.extend(w.tokens)
        return outs

    # ---- internals --------------------------------------------------------------------------------
    def _launch(self, call: list[_Rows], taps: tuple[int, ...]) -> tuple[_Captured, list[ForwardOutput]]:
        """One graph over `call`'s windows: replayed, or (its key new) run eagerly, then captured. The
        outputs are the windows' own rows; nothing is read back to the host."""
        parts = [(w.rows, w.bound, *_placement(w.state, w.bound), w.state.kv_dtype) for w in call]
        key = (tuple(taps), tuple(parts))
        states, real = [w.state for w in call], [len(w.tokens) for w in call]
        entry = self._graphs.get(key)
        if entry is None or entry.graph is None:
            entry = entry or self._new_entry(parts)
            self._fill(entry, call)
            outs = self._eager(states, entry, taps)  # the result; compiles what capture needs
            outs = [_copy(out, n) if out.hidden.shape[0] != n else out for out, n in zip(outs, real)]
            if key not in self._graphs:
                self._capture(entry, states, taps, key)
            return entry, outs
        self._graphs.move_to_end(key)
        self._fill(entry, call)
        entry.graph.replay()
        self.stats.replays += 1
        return entry, entry.outputs(real)

    def _new_entry(self, parts: list[tuple]) -> _Captured:
        dev = self.model.device
        sizes, bounds, pages = zip(*((n, bound, table) for n, bound, _, table, _ in parts))
        length = 2 * sum(sizes) + sum(p or 0 for p in pages)
        return _Captured(inputs=torch.zeros(length, dtype=torch.long, device=dev), sizes=sizes, bounds=bounds,
                         table_pages=pages, nan_flag=torch.zeros((), dtype=torch.bool, device=dev))

    @staticmethod
    def _fill(entry: _Captured, call: list[_Rows]) -> None:
        """The windows' ids, positions and page tables into the entry's inputs: one copy a replay."""
        host = [t for w in call for t in w.ids()]
        host += [p for w in call for p in w.positions()]
        for w, pages in zip(call, entry.table_pages):
            if pages is not None:
                host += w.state.padded_table(pages)
        values = torch.tensor(host, dtype=torch.long)
        if entry.inputs.is_cuda:
            values = values.pin_memory()  # an asynchronous copy, ordered before the replay on the stream
        entry.inputs.copy_(values, non_blocking=True)

    def _run(self, states: list[KVState], entry: _Captured, taps: tuple[int, ...]) -> list[ForwardOutput]:
        entry.nan_flag.zero_()
        with ExitStack() as tables:  # paged states read and write through the entry's table buffers
            for state, table in zip(states, entry.tables()):
                if table is not None:
                    tables.enter_context(state.bound_table(table))
            return self.model.forward_windows(states, entry.ids, entry.spans(), taps)

    def _eager(self, states: list[KVState], entry: _Captured, taps: tuple[int, ...]) -> list[ForwardOutput]:
        self.stats.first_runs += 1
        return self._run(states, entry, taps)

    def _capture(self, entry: _Captured, states: list[KVState], taps: tuple[int, ...], key: tuple) -> None:
        """Record the windows' launches. Capture executes nothing: the eager run just now wrote the
        rows and gave the output; replays write the same rows again for their own ids."""
        device = self.model.device
        torch.cuda.synchronize(device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end on a side stream, as torch.cuda.graph does, but without its
        # empty_cache() calls: they return the allocator's cached device and pinned blocks (~25 ms
        # a capture on the H200, then the next forward's allocations pay cudaMalloc again), and a
        # capture happens inside a request whenever a window meets a new key
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(self._pool)
                try:
                    entry.out = self._run(states, entry, taps)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(self._stream)
        except RuntimeError as exc:  # something in the forward synced: keep running this key eagerly
            reason = f"capture failed: {str(exc).splitlines()[0][:120]}"
            self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
            torch.cuda.synchronize(self.model.device)
        else:
            entry.graph = graph
            self.stats.captures += 1
        self._keep(key, entry)

    def _keep(self, key: tuple, entry: _Captured) -> None:
        """Remember the key's entry (captured, or eager after a failed capture); least recent out."""
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1


def _copy(out: ForwardOutput, rows: int | None = None) -> ForwardOutput:
    """A copy of out's first `rows` rows (all by default)."""
    return ForwardOutput(hidden=out.hidden[:rows].clone(), last_layer=out.last_layer[:rows].clone(),
                         taps={k: v[:rows].clone() for k, v in out.taps.items()})
