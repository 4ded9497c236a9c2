"""KV rows in pages of one store: every running sequence's cache in one set of tensors.

`PageStore` holds the lane's rows, per kind one stacked tensor of `pages * page` slots
(latent [layers, slots, latent_dim], index keys [indexed layers, slots, index_dim], fp8 scales
[layers, slots]), and a reference count per page. A `PagedKVState` is one sequence's view of it:
a page table (position p lives in slot table[p // page] * page + p % page) and the KVState
bookkeeping (tokens, frontier). Pages whose count is above one are shared: sequences that share a
prompt prefix hold the same pages for it, and a page is made private (copied) before a write lands
in it (`reserve`, which every write path calls first for the positions it writes).

Reads give the bits the contiguous KVState gives: the attention reads the store itself through
selections translated to slots, the indexer's kernel reads its keys through their slots (neither
copies), fp8 rows are gathered, then dequantized as KVState dequantizes them. Slot 0's page is
never handed out: it stays zeros and pads page tables past a sequence's pages (a captured graph
reads up to its key bound, glm53.runtime.cuda_graphs).

A cache split by position (DCP: glm53.dist.dcp_state.PagedDcpKVState) pages its local slots the
same way: its hooks (`_local_count`, `_local_room`, `_first_write_slot`, `_window_rows`) say which
slots hold which positions; everything here works on local slots (on one rank a slot is its position).

Decision record: docs/decisions/kv-pool.md.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch

from glm53.model.kv_state import KV_DTYPES, KVState, export_names, name_place, quantize_rows
from glm53.model.token_log import TokenLog

SCALE_OF = {"latent": "latent_scale", "index_keys": "index_scale"}  # fp8 only
NULL_PAGE = 0  # never allocated: zeros, the padding of page tables


class OutOfPages(MemoryError):
    """The store has no free page left (the runtime's pool admits by pages, so this is a bug)."""


class PageStore:
    def __init__(self, probe: KVState, pages: int, page: int) -> None:
        if pages < 2 or page < 1:
            raise ValueError(f"a page store needs at least 2 pages of at least 1 slot (got {pages} x {page})")
        self.page, self.pages = page, pages
        self.n_layers, self.latent_dim, self.index_dim = probe.n_layers, probe.latent_dim, probe.index_dim
        self.indexed_layers, self.kv_dtype, self.device = probe.indexed_layers, probe.kv_dtype, probe.device
        slots = pages * page
        dtype, dev, fp8 = KV_DTYPES[self.kv_dtype], self.device, self.kv_dtype == "fp8"
        n_idx = len(self.indexed_layers)
        self.stacks: dict[str, torch.Tensor | None] = {
            "latent": torch.zeros(self.n_layers, slots, self.latent_dim, dtype=dtype, device=dev),
            "latent_scale": torch.ones(self.n_layers, slots, dtype=torch.float32, device=dev) if fp8 else None,
            "index_keys": torch.zeros(n_idx, slots, self.index_dim, dtype=dtype, device=dev),
            "index_scale": torch.ones(n_idx, slots, dtype=torch.float32, device=dev) if fp8 else None}
        order = sorted(self.indexed_layers)
        layers_of = {"latent": range(self.n_layers), "latent_scale": range(self.n_layers),
                     "index_keys": order, "index_scale": order}  # kind -> the cache layer of each stack row
        # kind -> cache layer -> its slots [slots, ...] (views, made once: every read and write asks)
        self._views = {kind: dict(zip(layers_of[kind], t.unbind(0))) if t is not None else {}
                       for kind, t in self.stacks.items()}
        self.refs = np.zeros(pages, dtype=np.int64)
        self.refs[NULL_PAGE] = 1 << 40  # never free
        self._free = list(range(pages - 1, 0, -1))  # a stack: the lowest pages first
        self._usable = pages - 1
        self.position_bytes = probe.position_bytes()

    # ---- pages --------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def usable_pages(self) -> int:
        return self._usable

    def limit(self, pages: int) -> None:
        """Hand out at most `pages` pages, before any is taken (several ranks' pools hold the smallest
        rank's count, so they take and refuse alike)."""
        if pages >= self._usable:
            return
        if len(self._free) != self._usable:
            raise RuntimeError("a page store is limited before any page is taken")
        self._usable = max(1, pages)
        self._free = list(range(self._usable, 0, -1))

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{n} pages asked, {len(self._free)} free")
        got = [self._free.pop() for _ in range(n)]
        self.refs[got] = 1
        return got

    def share(self, pages: list[int]) -> None:
        self.refs[pages] += 1

    def drop(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)

    def copy_page(self, src: int, dst: int) -> None:
        a, b, n = src * self.page, dst * self.page, self.page
        for t in self.stacks.values():
            if t is not None:
                t[:, b:b + n] = t[:, a:a + n]

    # ---- layer views ----------------------------------------------------------------------------
    def layer(self, kind: str, layer: int) -> torch.Tensor | None:
        """The store's slots of one cache layer for a kind ([slots, ...]), None where the kind is absent."""
        return self._views[kind].get(layer)

    def put(self, kind: str, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows (compute dtype) into slots of one layer of a kind ('latent', 'index_keys'), as KVState
        stores them (fp8: quantized, one scale a row)."""
        if not slots.numel():
            return
        store, scale = self.layer(kind, layer), self.layer(SCALE_OF[kind], layer)
        if scale is None:
            store.index_copy_(0, slots, rows.to(store.dtype))
        else:
            q, s = quantize_rows(rows)
            _put_rows(store, slots, q)
            scale.index_copy_(0, slots, s)

    def reads_in_place(self, dtype: torch.dtype) -> bool:
        """Whether readers in `dtype` read the store's slots themselves (else rows are gathered and
        dequantized, as KVState reads them: fp8, or another dtype)."""
        return self.kv_dtype != "fp8" and KV_DTYPES[self.kv_dtype] == dtype


@dataclass
class SpanSlots:
    """A window's places in a paged store, the same for every layer of its forward (so computed once
    a forward, not once a layer): the slots its kept rows are written to, which of its rows those are
    (None: all; a split cache keeps its own positions), and the slots of the positions [0, key bound)
    held here, in position order (what the indexer scores and a selection's indices point into)."""

    write: torch.Tensor
    kept: torch.Tensor | None
    keys: torch.Tensor
    _last: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def rows_of(self, indices: torch.Tensor) -> torch.Tensor:
        """rows_at over this window's keys; the 'shared' layers after a 'full' one pass its selection's
        very tensor again, whose translation is kept (one translation a selection, not one a layer)."""
        if self._last is None or self._last[0] is not indices:
            self._last = (indices, rows_at(self.keys, indices))
        return self._last[1]

    def remember(self, indices: torch.Tensor, rows: torch.Tensor) -> None:
        """rows_of(indices) is `rows` (translated with other windows' selections in one gather)."""
        self._last = (indices, rows)


def rows_at(keys: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Store slots of a selection's indices into the positions whose slots are `keys` (padding and
    stale entries clamped into range: they are invalid, read but never weighed)."""
    if not keys.numel():
        return torch.zeros_like(indices)
    return keys[indices.clamp(0, keys.shape[0] - 1)]


@dataclass
class BatchSlots:
    """Every window of a batched step over one store (one window a sequence): each one's SpanSlots,
    and their writes side by side, so a layer's rows of all the sequences go in with one copy a kind."""

    store: PageStore
    spans: list[SpanSlots]
    write: torch.Tensor
    kept: torch.Tensor | None  # rows of the step kept here (None: all, in order)
    positions: list[torch.Tensor]  # each window's positions
    _groups: list["WindowGroup"] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, states: list, starts: list[int | None], positions: list[torch.Tensor], bounds: list[int]
           ) -> "BatchSlots | None":
        """None unless every state is paged in one store and each is a different sequence."""
        if not states or not all(isinstance(s, PagedKVState) for s in states):
            return None
        store = states[0].store
        if any(s.store is not store for s in states) or len({id(s) for s in states}) != len(states):
            return None
        spans = [s.span_slots(a, p, b) for s, a, p, b in zip(states, starts, positions, bounds)]
        write = spans[0].write if len(spans) == 1 else torch.cat([x.write for x in spans])
        kept = None
        if any(x.kept is not None for x in spans):
            offsets = np.cumsum([0] + [p.shape[0] for p in positions[:-1]]).tolist()
            kept = torch.cat([(x.kept if x.kept is not None else torch.arange(p.shape[0], device=p.device)) + o
                              for x, p, o in zip(spans, positions, offsets)])
        return cls(store, spans, write, kept, positions)

    def put(self, kind: str, layer: int, rows: torch.Tensor) -> None:
        """A layer's rows of every window (in window order) into their slots."""
        self.store.put(kind, layer, self.write, rows if self.kept is None else rows[self.kept])

    def groups(self) -> list["WindowGroup"]:
        """The step's windows of equal length, two or more to a group (decode steps, verification
        windows), which the indexer scores and selects together; made once a forward."""
        if self._groups is None:
            by_length: dict[int, list[int]] = {}
            for i, p in enumerate(self.positions):
                by_length.setdefault(p.shape[0], []).append(i)
            self._groups = [WindowGroup.of(self, tuple(g)) for g in by_length.values() if len(g) > 1]
        return self._groups


@dataclass
class WindowGroup:
    """Windows of one length of a batched step, read together by the indexer: which they are (in
    step order), their key slots a row each (a shorter row padded with slot 0, the null page, at
    positions past all its window's queries, which score them -inf) and their queries' positions."""

    members: tuple[int, ...]
    length: int  # rows a window
    key_table: torch.Tensor  # [len(members), the most keys a window has]
    longest: int  # which member has that many (its keys' positions are the table's)
    positions: torch.Tensor  # [len(members) * length]
    spans: list[SpanSlots]
    row_ranges: list[tuple[int, int]]  # the members' rows among the step's rows, merged where adjacent

    @classmethod
    def of(cls, batch: BatchSlots, members: tuple[int, ...]) -> "WindowGroup":
        keys = [batch.spans[i].keys for i in members]
        counts = [k.shape[0] for k in keys]
        if len(set(counts)) == 1:
            table = torch.stack(keys)
        else:
            table = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True, padding_value=0)
        starts = np.cumsum([0] + [p.shape[0] for p in batch.positions]).tolist()
        ranges: list[tuple[int, int]] = []
        for i in members:
            if ranges and ranges[-1][1] == starts[i]:
                ranges[-1] = (ranges[-1][0], starts[i + 1])
            else:
                ranges.append((starts[i], starts[i + 1]))
        return cls(members, batch.positions[members[0]].shape[0], table, counts.index(max(counts)),
                   torch.cat([batch.positions[i] for i in members]), [batch.spans[i] for i in members], ranges)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The members' rows of x (the step's rows, its windows in order), in member order (a view
        where they are adjacent)."""
        if len(self.row_ranges) == 1:
            return x[self.row_ranges[0][0]:self.row_ranges[0][1]]
        return torch.cat([x[a:b] for a, b in self.row_ranges])

    def translate(self, indices: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """The group's selection (indices into each window's keys, its windows' rows in order) as store
        slots in one gather; each window's SpanSlots remembers its part (parts: the views of indices
        its selection holds), so its attention reads them without a translation of its own."""
        rows = self.key_table.gather(1, indices.reshape(len(self.members), -1)).reshape(indices.shape)
        for span, part, part_rows in zip(self.spans, parts, rows.split(parts[0].shape[0])):
            span.remember(part, part_rows)


class PagedKVState:
    """One sequence's rows in a PageStore: KVState's interface over a page table."""

    def __init__(self, store: PageStore) -> None:
        self.store = store
        self.n_layers, self.latent_dim, self.index_dim = store.n_layers, store.latent_dim, store.index_dim
        self.indexed_layers, self.kv_dtype, self.device = store.indexed_layers, store.kv_dtype, store.device
        self.tokens = TokenLog([])
        self.frontier = 0
        self.table: list[int] = []
        self._table_device: torch.Tensor | None = None  # the table on the device, made when it changes
        self._bound_table: torch.Tensor | None = None  # a captured graph's table buffer, while it runs

    # ---- KVState's bookkeeping ------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        return len(self.table) * self.store.page

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    def token_ids(self) -> np.ndarray:
        return self.tokens.array()

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate({length}) outside [0, {self.length}]")
        del self.tokens[length:]
        self.frontier = min(self.frontier, length)

    def owned_positions(self, stop: int) -> None:
        return None

    def position_bytes(self) -> int:
        return self.store.position_bytes

    def bytes_per_position(self) -> int:
        return self.store.position_bytes

    def export_names(self) -> list[str]:
        return export_names(self.n_layers, self.indexed_layers, self.fp8)

    # ---- positions and local slots (a cache split by position overrides these) ----------------------
    @property
    def positions_per_page(self) -> int:
        """Positions a page's slots hold (one rank: the page's size)."""
        return self.store.page

    def _local_count(self, n: int) -> int:
        """Local slots that hold positions [0, n) here (one rank: n)."""
        return n

    def _local_room(self, n: int) -> int:
        """Slots reserved for a context of n positions: the same on every rank of a split cache, so
        their stores take and free pages alike and their pools decide alike."""
        return n

    def _first_write_slot(self) -> int:
        """The lowest slot a write past the length can land in, on any rank of a split cache."""
        return self.length

    # ---- pages ---------------------------------------------------------------------------------------
    def pages_for(self, positions: int) -> int:
        """Pages that a context of `positions` positions takes."""
        return -(-self._local_room(positions) // self.store.page)

    def reserve(self, n: int, exact: bool = False) -> None:
        """Room for n positions (pages from the store), and the pages that positions [length, n)
        fall in made private: every write lands at or past the length, after this call."""
        missing = self.pages_for(n) - len(self.table)
        if missing > 0:
            self.table += self.store.take(missing)
            self._table_device = None
        first, last = self._first_write_slot() // self.store.page, self.pages_for(n)
        for i in range(first, min(last, len(self.table))):
            page = self.table[i]
            if self.store.refs[page] > 1:  # shared: copy on write
                [mine] = self.store.take(1)
                self.store.copy_page(page, mine)
                self.store.drop([page])
                self.table[i] = mine
                self._table_device = None

    def pages_wanted(self, n: int) -> int:
        """Free pages reserve(n) takes: the missing ones and the shared ones it makes private."""
        first, last = self._first_write_slot() // self.store.page, min(self.pages_for(n), len(self.table))
        shared = sum(1 for i in range(first, last) if self.store.refs[self.table[i]] > 1)
        return max(0, self.pages_for(n) - len(self.table)) + shared

    def release(self) -> None:
        """Every page back to the store (a finished, cancelled or preempted sequence)."""
        self.store.drop(self.table)
        self.table = []
        self._table_device = None
        self.tokens = TokenLog([])
        self.frontier = 0

    def share_prefix(self, source: "PagedKVState", n: int) -> int:
        """Continue this empty state with the first positions of `source`'s rows that fill whole
        pages, at most n: those pages shared (counts raised), not copied. Returns the positions
        taken (a multiple of positions_per_page: on every rank of a split cache the same)."""
        if self.length or self.table:
            raise ValueError("share_prefix starts an empty state")
        full = min(n, source.frontier, source.length) // self.positions_per_page
        pages = source.table[:full]
        self.store.share(pages)
        self.table = list(pages)
        self._table_device = None
        taken = full * self.positions_per_page
        self.tokens.extend(source.tokens[:taken])
        self.frontier = taken
        return taken

    @property
    def table_device(self) -> torch.Tensor:
        """The page table the device reads (a graph's own buffer while one runs over this state)."""
        if self._bound_table is not None:
            return self._bound_table
        if self._table_device is None:
            self._table_device = torch.tensor(self.table or [NULL_PAGE], dtype=torch.long).to(self.device)
        return self._table_device

    def padded_table(self, entries: int) -> list[int]:
        """The first `entries` of the page table, padded with the null page (a graph's table buffer)."""
        pages = self.table[:entries]
        return pages + [NULL_PAGE] * (entries - len(pages))

    @contextmanager
    def bound_table(self, buffer: torch.Tensor) -> Iterator[None]:
        """Reads and writes go through `buffer` (a captured graph's table) inside the block."""
        self._bound_table = buffer
        try:
            yield
        finally:
            self._bound_table = None

    def slots_of(self, local: torch.Tensor) -> torch.Tensor:
        """Store slots of local slots (a device tensor of any shape; one rank: of positions)."""
        page = self.store.page
        return self.table_device[local // page] * page + local % page

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        """Store slots of the local slots that hold positions [start, stop)."""
        return self.slots_of(torch.arange(self._local_count(start), self._local_count(stop), device=self.device))

    # ---- writes ------------------------------------------------------------------------------------
    def write_latent(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._put_from(start, "latent", layer, rows)

    def write_index(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._put_from(start, "index_keys", layer, rows)

    def _put_from(self, start: int, kind: str, layer: int, rows: torch.Tensor) -> None:
        """Rows of positions [start, start + len(rows)): the ones held here into their slots."""
        local, kept = self._window_rows(start, torch.arange(start, start + rows.shape[0], device=self.device))
        self.store.put(kind, layer, self.slots_of(local), rows if kept is None else rows[kept])

    def write_latent_at(self, layer: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self.store.put("latent", layer, self.slots_of(positions), rows)

    def write_index_at(self, layer: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self.store.put("index_keys", layer, self.slots_of(positions), rows)

    def span_slots(self, start: int | None, positions: torch.Tensor, key_bound: int) -> SpanSlots:
        """A window's places for every layer of its forward: rows at `positions` (device; from the host
        `start` when not None), reads of positions [0, key_bound)."""
        local, kept = self._window_rows(start, positions)
        return SpanSlots(self.slots_of(local), kept, self._slots(0, key_bound))

    def _window_rows(self, start: int | None, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(local slots of a window's rows kept here, which rows those are: None, all)."""
        return positions, None

    # ---- reads -------------------------------------------------------------------------------------
    def read_latent(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._gather("latent", layer, stop, dtype)

    def read_index(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._gather("index_keys", layer, stop, dtype)

    def _gather(self, kind: str, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        slots = self._slots(0, stop)
        rows = _take_rows(self.store.layer(kind, layer), slots)
        scale = self.store.layer(SCALE_OF[kind], layer)
        if scale is None:
            return rows.to(dtype)
        return (rows.to(torch.float32) * scale.index_select(0, slots)[:, None]).to(dtype)

    def index_view(self, layer: int, stop: int, dtype: torch.dtype, slots: SpanSlots | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the store's index keys, the slots of positions [0, stop) held here: `slots.keys` when the
        window's places are given): the indexer reads them in place; fp8 keys gathered and dequantized
        (rows None), as KVState reads them."""
        if not self.store.reads_in_place(dtype):
            return self.read_index(layer, stop, dtype), None
        return self.store.layer("index_keys", layer), slots.keys if slots is not None else self._slots(0, stop)

    def attention_view(self, layer: int, stop: int, dtype: torch.dtype, slots: SpanSlots | None = None
                       ) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor] | None]:
        """(rows when the span attends, what turns a selection's indices into rows of them) for the
        attention over positions [0, stop): the store's slots themselves where they are in the compute
        dtype, nothing copied (indices into the rows held here, [T, k], translated to slots through
        `slots` or the table); else (fp8) the rows gathered and dequantized when read, as KVState reads
        them, the indices unchanged (None)."""
        if not self.store.reads_in_place(dtype):
            return partial(self.read_latent, layer, stop, dtype), None
        store = self.store.layer("latent", layer)
        return (lambda: store), slots.rows_of if slots is not None else partial(rows_at, self._slots(0, stop))

    # ---- the prefix cache's view ------------------------------------------------------------------------
    def slots(self, start: int, stop: int) -> tuple[int, int]:
        """The local slots [a, b) that hold positions [start, stop) (KVState.slots)."""
        return self._local_count(start), self._local_count(stop)

    def export_rows(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows of positions [start, stop) held here (their local slots) per layer, as KVState.export_rows
        names them (gathered: copies)."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"rows [{start}, {stop}) outside written [0, {self.length})")
        slots = self._slots(start, stop)
        out: dict[str, torch.Tensor] = {}
        for name in self.export_names():
            kind, layer = name_place(name)
            out[name] = _take_rows(self.store.layer(kind, layer), slots)
        return out

    def import_rows(self, start: int, rows: dict[str, torch.Tensor], tokens: list[int]) -> None:
        """KVState.import_rows into pages: rows for positions [start, start + len(tokens)) (their local
        slots, leading), start at the length."""
        if start != self.length:
            raise ValueError(f"import at {start} but the state holds {self.length} rows; rows must continue it")
        n = len(tokens)
        a, b = self.slots(start, start + n)
        names = self.export_names()
        if rows.keys() != set(names):
            missing, extra = set(names) - rows.keys(), rows.keys() - set(names)
            raise ValueError(f"restored rows do not match this cache: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}")
        checked = []
        for name in names:  # every tensor checked first: nothing half-written
            kind, layer = name_place(name)
            target, t = self.store.layer(kind, layer), rows[name]
            if t.shape[0] < b - a or t.dtype != target.dtype or t.shape[1:] != target.shape[1:]:
                raise ValueError(f"restored {name}: {tuple(t.shape)} {t.dtype}, expected at least [{b - a}, ...] "
                                 f"{target.dtype}")
            checked.append((target, t[: b - a]))
        self.reserve(start + n)
        slots = self._slots(start, start + n)
        for target, t in checked:
            _put_rows(target, slots, t.to(target.device))
        self.tokens.extend(tokens)
        if self.frontier == start:
            self.frontier = start + n


def _take_rows(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """t[slots] (fp8 as its bytes: index_select does not take every float8 dtype)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).index_select(0, slots).view(t.dtype)
    return t.index_select(0, slots)


def _put_rows(t: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        t.index_copy_(0, slots, rows)
