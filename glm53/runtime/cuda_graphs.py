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

Only where it is exact and sync-free: a CUDA device, row-invariant kernels (not
TF_GLM53_KERNELS=torch), one rank with a plain KVState (collectives and DCP's top-k exchange are
not captured), and every feed-forward block window-safe (DecodedExperts is; another expert bank
falls back to eager).
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
from glm53.model.indexer import SMALL_WINDOW_ROWS
from glm53.model.transformer import ForwardOutput, Glm53Model, Span

BOUND_STEP = 4096  # key bounds are multiples of this (or the capacity)
MAX_WINDOW = SMALL_WINDOW_ROWS  # longer windows are prefill pieces: eager, where launches are amortized
GRAPH_CHOICES = ("auto", "1", "0")


def key_bound(stop: int, capacity: int, step: int = BOUND_STEP) -> int:
    """The cache rows a window ending at `stop` scores: stop rounded up to `step`, within capacity."""
    return min(capacity, -(-stop // step) * step)


def cache_addresses(state: KVState) -> tuple[int, ...]:
    """The addresses a captured graph reads and writes (they change when reserve grows the cache)."""
    tensors = list(state.latent) + list(state.latent_scale) + list(state.index_keys.values()) \
        + list(state.index_scale.values())
    return tuple(t.data_ptr() if t is not None else 0 for t in tensors)


Window = tuple[KVState, list[int], int]  # a sequence's state, its window's tokens, their first position


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


def _placement(state: KVState | PagedKVState, stop: int, step: int) -> tuple[int, tuple, int | None]:
    """(the key bound of a window ending at `stop`, where the rows it reads live, the page-table entries
    a graph reads: None for a contiguous cache, whose addresses key it). A paged state's store is the
    lane's, so its key holds no sequence's address and its bound no capacity (the table is padded)."""
    if isinstance(state, PagedKVState):
        bound = key_bound(stop, 1 << 62, step)
        pages = state.pages_for(bound)
        return bound, ("pages", pages, store_addresses(state)), pages
    return key_bound(stop, state.capacity, step), cache_addresses(state), None


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0  # windows that were not eligible
    first_runs: int = 0  # eligible windows run eagerly because their key had no graph yet
    evictions: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # why windows ran eagerly


class WindowGraphs:
    """Runs short windows of one model through captured CUDA graphs (see the module docstring)."""

    def __init__(self, model: Glm53Model, max_graphs: int = 16, bound_step: int = BOUND_STEP) -> None:
        self.model = model
        self.max_graphs = max_graphs
        self.bound_step = bound_step
        self.stats = GraphStats()
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool: Any = None
        self._stream: Any = None  # the capture stream (torch.cuda.Stream), made with the pool
        self._graph_safe = model.graph_safe()  # the layers never change: asked once, not per window

    # ---- eligibility --------------------------------------------------------------------------
    def why_not(self, state: KVState, n: int) -> str | None:
        """None when a window of n tokens over `state` can replay a graph, else the reason."""
        m = self.model
        if m.device.type != "cuda":
            return "not on cuda"
        if not ops.row_invariant(m.device):
            return "kernels not row-invariant (TF_GLM53_KERNELS=torch)"
        if m.plan.world != 1:
            return "several ranks (collectives between them are not captured)"
        if type(state) not in (KVState, PagedKVState):
            return f"{type(state).__name__} (split cache) is not captured"
        if not 1 <= n <= MAX_WINDOW:
            return f"window of {n} tokens (graphs take 1..{MAX_WINDOW})"
        if not self._graph_safe:
            return "a feed-forward block is not window-safe"
        return None

    def why_not_batch(self, windows: list[Window]) -> str | None:
        """None when these windows (one a sequence) can replay one graph together, else the reason."""
        if len({id(state) for state, _, _ in windows}) != len(windows):
            return "a sequence with several windows (prefill pieces)"
        for state, tokens, _ in windows:
            reason = self.why_not(state, len(tokens))
            if reason is not None:
                return reason
        return None

    # ---- the forward ----------------------------------------------------------------------------
    def forward(self, state: KVState, tokens: list[int], start: int, taps: tuple[int, ...] = ()
                ) -> ForwardOutput | None:
        """The window's ForwardOutput (rows written, state.tokens extended), or None when it is not
        eligible (the caller runs the eager forward)."""
        outs = self.forward_batch([(state, tokens, start)], taps)
        return None if outs is None else outs[0]

    def forward_batch(self, windows: list[Window], taps: tuple[int, ...] = ()) -> list[ForwardOutput] | None:
        """Several sequences' windows in one graph (a batched decode step; one window: a sequence's
        step): a ForwardOutput a window (rows written, each state's tokens extended), or None when
        they are not eligible (the caller runs the eager forward). The key is every window's (T, L,
        where its rows live) in order: a batch whose sequences keep their contiguous caches, or any paged
        sequences of the same lengths and bounds, replays one graph."""
        reason = self.why_not_batch(windows)
        if reason is not None:
            self.stats.eager += 1
            self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
            return None
        parts = []
        for state, tokens, start in windows:
            if start != state.length:
                raise ValueError(f"forward at position {start} but the cache holds {state.length} rows; "
                                 "windows must continue it")
            n = len(tokens)
            state.reserve(start + n)  # before keying: growing moves a contiguous cache
            parts.append((n, *_placement(state, start + n, self.bound_step), state.kv_dtype))
        key = (tuple(taps), tuple(parts))
        states = [state for state, _, _ in windows]
        entry = self._graphs.get(key)
        if entry is None or entry.graph is None:
            entry = entry or self._new_entry(parts)
            self._fill(entry, windows)
            outs = self._eager(states, entry, taps)  # the result; compiles what capture needs
            if key not in self._graphs:
                self._capture(entry, states, taps, key)
        else:
            self._graphs.move_to_end(key)
            self._fill(entry, windows)
            entry.graph.replay()
            self.stats.replays += 1
            outs = [_copy(out) for out in entry.out]
        if bool(entry.nan_flag.item()):
            raise ValueError("indexer scores contain NaN; the selection is undefined")
        for state, tokens, _ in windows:
            state.tokens.extend(tokens)
        return outs

    # ---- internals --------------------------------------------------------------------------------
    def _new_entry(self, parts: list[tuple]) -> _Captured:
        dev = self.model.device
        sizes, bounds, pages = zip(*((n, bound, table) for n, bound, _, table, _ in parts))
        length = 2 * sum(sizes) + sum(p or 0 for p in pages)
        return _Captured(inputs=torch.zeros(length, dtype=torch.long, device=dev), sizes=sizes, bounds=bounds,
                         table_pages=pages, nan_flag=torch.zeros((), dtype=torch.bool, device=dev))

    @staticmethod
    def _fill(entry: _Captured, windows: list[Window]) -> None:
        """The windows' tokens, positions and page tables into the entry's inputs: one copy a replay."""
        host = [t for _, tokens, _ in windows for t in tokens]
        host += [p for _, tokens, start in windows for p in range(start, start + len(tokens))]
        for (state, _, _), pages in zip(windows, entry.table_pages):
            if pages is not None:
                host += state.padded_table(pages)
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


def _copy(out: ForwardOutput) -> ForwardOutput:
    return ForwardOutput(hidden=out.hidden.clone(), last_layer=out.last_layer.clone(),
                         taps={k: v.clone() for k, v in out.taps.items()})
