"""A store's device-to-host copy, off the request's path.

`Staging.copy` queues one asynchronous copy per tensor and contiguous run of positions into a
reusable staging buffer (pinned when the rows are on a GPU) on the caller's current stream, and
returns a future: a background thread waits for the copies, then fills each node's rows with
independent pageable tensors. The facade hands the nodes to its tiers when the future is done
(`PrefixCache._settle`).

Why it is exact: the copies are queued on the engine's stream before anything that could
overwrite those rows (the next request's forward, a truncation followed by new writes), so they
read what prefill wrote. The staging buffer is reused only after the previous copy's future is
done. Rows on the CPU are copied into the buffer before `copy` returns (no stream orders them).

The buffer is pinned at its full capacity when the cache is built for a GPU; rows on the CPU grow
an ordinary buffer by powers of two up to `capacity`. A store that needs more (a long cold prompt,
a long turn of a deep model) goes through the buffer in rounds of whole nodes: the call waits for
all but the last round's fill, which lands in the background like a small store. The default
capacity follows the model (`default_capacity`: 8192 positions of this rank's rows, within 128 MiB
and 2 GiB), so a typical turn is one round. Node rows are pageable on purpose: the host budget
counts their exact bytes (rows.py).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

import torch

from .node import Node
from .rows import Rows, StackedRows

log = logging.getLogger("kv_cache")

ALIGN = 64  # bytes: every group's view into the buffer starts aligned for any dtype
DEFAULT_CUDA_STAGING_BYTES = 128 << 20  # the least a GPU cache pins
MAX_DEFAULT_STAGING_BYTES = 2 << 30
STAGING_POSITIONS = 8192  # positions of rows the default buffer holds (4 prefill chunks at C = 2048)


def default_capacity(position_bytes: int) -> int:
    """The pinned buffer for rows of `position_bytes` a position (all layers, this rank): room for
    STAGING_POSITIONS of them, within [128 MiB, 2 GiB]. At GLM-5.3's 78 layers in bf16 a position
    is ~98 KB: ~800 MB, a turn of up to 8192 new tokens in one round at one rank."""
    return max(DEFAULT_CUDA_STAGING_BYTES, min(MAX_DEFAULT_STAGING_BYTES, position_bytes * STAGING_POSITIONS))


# (node, start, stop) spans of consecutive positions, each block's row counts, the run's rows
_Run = tuple[list[tuple[Node, int, int]], list[dict[str, int]], Rows]
# a run's spans, their row counts, and its tensors staged as (names, stack [len(names), rows, ...])
_Staged = tuple[list[tuple[Node, int, int]], list[dict[str, int]], list[tuple[tuple[str, ...], torch.Tensor]]]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _needed(runs: list[_Run]) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for _, _, rows in runs for t in rows.values())


def _alike(rows: Rows, counts: list[dict[str, int]]) -> list[list[str]]:
    """The names grouped by dtype, shape and how their rows split into the run's blocks (so a
    group's blocks are slices of one stack), in first-seen order."""
    groups: dict[tuple, list[str]] = {}
    for name, t in rows.items():
        groups.setdefault((t.dtype, tuple(t.shape), tuple(c[name] for c in counts)), []).append(name)
    return list(groups.values())


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    if hasattr(torch, "_foreach_copy_"):  # one call for the list (torch >= 2.1)
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=non_blocking)


def _rounds(runs: list[_Run], capacity: int) -> list[list[tuple[list[tuple[Node, int, int]], list[dict[str, int]]]]] | None:
    """The runs' spans in consecutive rounds whose rows fit `capacity` (each span counted with its
    own alignment: a bound on what its round needs), a round as (spans, their row counts) per
    segment of a run; None if one span alone does not fit."""
    rounds: list[list[tuple[list[tuple[Node, int, int]], list[dict[str, int]]]]] = [[]]
    used = 0
    for run, counts, rows in runs:
        row_bytes = {name: t[0].numel() * t.element_size() if t.shape[0] else 0 for name, t in rows.items()}
        segment: tuple[list, list] | None = None
        for item, count in zip(run, counts):
            size = sum(_aligned(count[name] * row_bytes[name]) for name in rows)
            if size > capacity:
                return None
            if rounds[-1] and used + size > capacity:
                rounds.append([])
                used, segment = 0, None
            if segment is None:
                segment = ([], [])
                rounds[-1].append(segment)
            segment[0].append(item)
            segment[1].append(count)
            used += size
    return rounds


def runs_of(todo: list[tuple[Node, int, int]]) -> list[list[tuple[Node, int, int]]]:
    """(node, start, stop) spans grouped into runs of consecutive positions."""
    runs: list[list[tuple[Node, int, int]]] = []
    for item in todo:
        if runs and runs[-1][-1][2] == item[1]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


class Staging:
    def __init__(self, capacity_bytes: int, pinned: bool = False) -> None:
        """`pinned`: the rows will be on a GPU; the whole buffer is pinned now, at start-up (a
        pinned allocation costs milliseconds: not on a request)."""
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._buf: torch.Tensor | None = None
        if pinned and torch.cuda.is_available():
            self._buf = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True)
        self._busy: Future | None = None
        self.rounds = 0  # buffer fills queued (a store larger than the buffer takes several)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv_cache-store")

    def copy(self, todo: list[tuple[Node, int, int]], rows_for: Callable[[int, int], Rows]) -> Future | None:
        """Start copying rows_for(start, stop) of every (node, start, stop) into node.rows; None
        (nothing queued) when one node's rows alone exceed the capacity. Rows that together exceed
        it go through the buffer in rounds of whole nodes: each round after the first waits for the
        previous round's fill, the last one lands in the background. The future is the last
        round's (the worker runs rounds in order); a failed round ends the store with its future."""
        runs = self._plan(todo, rows_for)
        need = _needed(runs)
        if need <= self.capacity:
            return self._stage(runs, need)
        rounds = _rounds(runs, self.capacity)
        if rounds is None:
            return None
        done: Future | None = None
        for batch in rounds:
            if done is not None:
                wait([done])
                if done.exception() is not None:
                    return done
            # the counts are the whole store's, checked once; each segment's rows are read again
            runs = [(spans, counts, rows_for(spans[0][1], spans[-1][2])) for spans, counts in batch]
            done = self._stage(runs, _needed(runs))
        return done

    def _plan(self, todo: list[tuple[Node, int, int]], rows_for: Callable[[int, int], Rows]) -> list[_Run]:
        """Each run of consecutive spans with its rows and each block's row counts, checked."""
        runs = []
        for run in runs_of(todo):
            rows = rows_for(run[0][1], run[-1][2])
            # each block's own row count: under DCP a block [a, b) is this rank's slots, not b - a rows
            counts = ([{name: t.shape[0] for name, t in rows.items()}] if len(run) == 1 else
                      [{name: t.shape[0] for name, t in rows_for(a, b).items()} for _, a, b in run])
            for name, t in rows.items():
                if sum(c[name] for c in counts) != t.shape[0]:
                    raise ValueError(f"rows_for: {name} has {t.shape[0]} rows for positions [{run[0][1]}, "
                                     f"{run[-1][2]}), its blocks {sum(c[name] for c in counts)}; a run's rows "
                                     "must be its blocks' rows in order (the state's slots must be "
                                     "contiguous and increasing: KVState.slots)")
            runs.append((run, counts, rows))
        return runs

    def _stage(self, runs: list[_Run], need: int) -> Future:
        """Queue the runs' copies into the buffer and their fill into nodes on the worker."""
        if self._busy is not None:  # the facade settles first (and reports failures); this keeps
            wait([self._busy])     # the buffer safe regardless
        on_gpu = any(t.is_cuda for _, _, rows in runs for t in rows.values())
        buf = self._buffer(need, pinned=on_gpu)
        staged: list[_Staged] = []
        offset = 0
        for run, counts, rows in runs:
            groups: list[tuple[tuple[str, ...], torch.Tensor]] = []
            # tensors of one dtype and shape (a deep model's layers) share one view and one copy
            # call: at 78 layers a per-tensor loop cost ~2.5 ms more host time a store (H200)
            for names in _alike(rows, counts):
                first = rows[names[0]]
                n = first.numel() * first.element_size() * len(names)
                stack = buf[offset:offset + n].view(first.dtype).view(len(names), *first.shape)
                _copy_all(list(stack.unbind(0)), [rows[name] for name in names], non_blocking=on_gpu)
                groups.append((tuple(names), stack))
                offset += _aligned(n)
            staged.append((run, counts, groups))
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        self._busy = self._pool.submit(_fill_nodes, staged, event)
        self.rounds += 1
        return self._busy

    def _buffer(self, need: int, pinned: bool) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < need or buf.is_pinned() != pinned:
            size = min(self.capacity, 1 << max(need - 1, 1).bit_length())
            buf = self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return buf

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._buf = None


def _fill_nodes(staged: list[_Staged], event: "torch.cuda.Event | None") -> None:
    """The background half: wait for the device copies, then give every node its own rows, one
    copy per group of alike tensors (StackedRows: a restore from the host tier copies a whole kind
    at once too). This thread shares the GIL with the one launching the next request's kernels:
    ~3 torch calls a node where a copy per tensor made ~117 (78 layers)."""
    if event is not None:
        event.synchronize()
    for run, counts, groups in staged:
        start = [0] * len(groups)  # each group's next row (its tensors split their rows alike)
        for (node, _, _), count in zip(run, counts):
            rows, stacks = StackedRows(), []
            for g, (names, stack) in enumerate(groups):
                n = count[names[0]]
                own = _pageable(stack[:, start[g]:start[g] + n])
                rows.update(zip(names, own.unbind(0)))
                stacks.append((names, own))
                start[g] += n
            rows.stacks = tuple(stacks)
            node.rows = rows


def _pageable(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in ordinary (pageable) memory, whatever memory t is in."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)
