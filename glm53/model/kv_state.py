"""The per-sequence latent cache: one conversation's KV rows, per layer.

Per layer, per position: the MLA latent ([kv_lora_rank | rope key], 576 values at real size) and,
on layers that run their own indexer, the indexer key (index_head_dim values). Stored in the cache
dtype: bf16 (default), fp32 (reference tests) or fp8 e4m3 with one fp32 scale per row
(TF_GLM53_KV_DTYPE=bf16|fp8|fp32). Tensors stay simple so the prefix cache can copy rows in and out:

    latent[layer]      [capacity, latent_dim]      index_keys[layer]  [capacity, index_head_dim]
    latent_scale[layer][capacity] (fp8 only)       index_scale[layer] [capacity] (fp8 only)

Each kind's per-layer tensors are views of one stacked tensor ([layers, capacity, ...], `stacks`),
so a restored node whose rows arrive stacked in the same layer order (kv_cache.rows.StackedRows)
is one strided copy per kind, not one per layer: at GLM-5.3's depth ~117 per-tensor copies' Python
would bound a resume from the page cache (docs/decisions/cache-tiers.md).

`frontier` is how far rows were written by canonical prefill; rows written by decode or draft
verification lie beyond it and are never offered for reuse.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Callable

import numpy as np
import torch

from glm53.kv_format import row_bytes
from glm53.model.token_log import TokenLog

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one scale per row (amax / 448); an all-zero row gets scale 1."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x32 / scale[:, None]).to(torch.float8_e4m3fn), scale


def export_names(n_layers: int, indexed_layers: frozenset[int], fp8: bool) -> list[str]:
    """The names a cache's rows are exported under (the prefix cache's tensors), in order."""
    indexed = sorted(indexed_layers)
    names = [f"latent.{i}" for i in range(n_layers)]
    if fp8:
        names += [f"latent_scale.{i}" for i in range(n_layers)]
    names += [f"index.{i}" for i in indexed]
    if fp8:
        names += [f"index_scale.{i}" for i in indexed]
    return names


_KIND_OF_NAME = {"latent": "latent", "latent_scale": "latent_scale", "index": "index_keys", "index_scale": "index_scale"}


def name_place(name: str) -> tuple[str, int]:
    """An exported tensor's name -> (the kind it is stored as, its cache layer)."""
    kind, layer = name.rsplit(".", 1)
    return _KIND_OF_NAME[kind], int(layer)


@dataclass
class KVState:
    """Rows for positions [0, length) of one sequence, on one rank."""

    n_layers: int
    latent_dim: int
    index_dim: int
    indexed_layers: frozenset[int]  # layers that store indexer keys (their own top-k)
    kv_dtype: str = "bf16"
    device: torch.device | str = "cpu"
    capacity: int = 0
    tokens: list[int] = field(default_factory=TokenLog)  # tokens whose rows are written (len == length)
    frontier: int = 0
    latent: list[torch.Tensor] = field(default_factory=list)
    latent_scale: list[torch.Tensor | None] = field(default_factory=list)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    index_scale: dict[int, torch.Tensor | None] = field(default_factory=dict)
    # kind -> [layers of that kind, capacity, ...]: the per-layer tensors above are its views
    stacks: dict[str, torch.Tensor | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, TokenLog):
            self.tokens = TokenLog(self.tokens)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        self._set_stacks(self._new_stacks(0))

    # ---- storage -------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.tokens)

    def token_ids(self) -> np.ndarray:
        """The held tokens as a read-only int64 array, converted incrementally (glm53/model/token_log.py)."""
        toks = self.tokens
        return toks.array() if isinstance(toks, TokenLog) else np.asarray(toks, dtype=np.int64)

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    def _new_stacks(self, capacity: int) -> dict[str, torch.Tensor | None]:
        """Fresh stacks for `capacity` positions: zeros, never garbage (masked positions must
        contribute exact zeros: 0 * NaN would not); scales (fp8 only) ones."""
        dtype, dev, n_idx = KV_DTYPES[self.kv_dtype], self.device, len(self.indexed_layers)

        def scales(layers: int) -> torch.Tensor | None:
            return torch.ones(layers, capacity, dtype=torch.float32, device=dev) if self.fp8 else None

        return {"latent": torch.zeros(self.n_layers, capacity, self.latent_dim, dtype=dtype, device=dev),
                "latent_scale": scales(self.n_layers),
                "index_keys": torch.zeros(n_idx, capacity, self.index_dim, dtype=dtype, device=dev),
                "index_scale": scales(n_idx)}

    def _set_stacks(self, stacks: dict[str, torch.Tensor | None]) -> None:
        self.stacks = stacks
        order = sorted(self.indexed_layers)

        def layers(kind: str, count: int) -> list[torch.Tensor | None]:
            t = stacks[kind]
            return list(t.unbind(0)) if t is not None else [None] * count

        self.latent = layers("latent", self.n_layers)
        self.latent_scale = layers("latent_scale", self.n_layers)
        self.index_keys = dict(zip(order, layers("index_keys", len(order))))
        self.index_scale = dict(zip(order, layers("index_scale", len(order))))
        self.capacity = stacks["latent"].shape[1]

    def reserve(self, n: int, exact: bool = False) -> None:
        """Room for n positions (grows geometrically; exact: to n positions, what a KV pool that
        accounts every position asks for; existing rows are kept)."""
        if n <= self.capacity:
            return
        new = self._new_stacks(n if exact else max(n, 2 * self.capacity, 256))
        for kind, old in self.stacks.items():
            if old is not None:
                new[kind][:, : old.shape[1]] = old
        self._set_stacks(new)

    def clone(self) -> "KVState":
        """An independent copy: rows (its own stacks), tokens and frontier."""
        other = copy.copy(self)
        other.tokens = TokenLog(self.tokens)
        other._set_stacks({k: t.clone() if t is not None else None for k, t in self.stacks.items()})
        return other

    # ---- writes and reads (compute dtype in, compute dtype out) -----------------------------
    def write_latent(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._write(self.latent[layer], self.latent_scale[layer], start, rows)

    def write_index(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._write(self.index_keys[layer], self.index_scale[layer], start, rows)

    def _write(self, store: torch.Tensor, scale: torch.Tensor | None, start: int, rows: torch.Tensor) -> None:
        stop = start + rows.shape[0]
        if stop > self.capacity:
            raise IndexError(f"rows up to {stop} exceed reserved capacity {self.capacity}; call reserve first")
        if scale is None:
            store[start:stop] = rows.to(store.dtype)
        else:
            q, s = quantize_rows(rows)
            store[start:stop] = q
            scale[start:stop] = s

    def write_latent_at(self, layer: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """As write_latent, for the positions in a device tensor (a graph-captured window: no host
        int, no sync); the caller has reserved room for them."""
        self._write_at(self.latent[layer], self.latent_scale[layer], positions, rows)

    def write_index_at(self, layer: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self._write_at(self.index_keys[layer], self.index_scale[layer], positions, rows)

    @staticmethod
    def _write_at(store: torch.Tensor, scale: torch.Tensor | None, positions: torch.Tensor, rows: torch.Tensor) -> None:
        if scale is None:
            store.index_copy_(0, positions, rows.to(store.dtype))
        else:
            q, s = quantize_rows(rows)
            store.view(torch.uint8).index_copy_(0, positions, q.view(torch.uint8))  # fp8 as its bytes
            scale.index_copy_(0, positions, s)

    def owned_positions(self, stop: int) -> torch.Tensor | None:
        """Positions in [0, stop) whose rows reads return, ascending; None: all of them (this class).
        A cache split by position (glm53.dist.dcp_state.DcpKVState) returns its own."""
        return None

    def read_latent(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.latent[layer], self.latent_scale[layer], stop, dtype)

    def read_index(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.index_keys[layer], self.index_scale[layer], stop, dtype)

    def index_view(self, layer: int, stop: int, dtype: torch.dtype, slots: object = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys, rows): the indexer's keys of positions [0, stop) as rows `rows` of `keys` (None: keys
        [stop, index_dim] in position order, this class; a paged cache gives its store and slots, from
        its window's precomputed `slots` when given)."""
        return self.read_index(layer, stop, dtype), None

    def attention_view(self, layer: int, stop: int, dtype: torch.dtype, slots: object = None
                       ) -> tuple[Callable[[], torch.Tensor], None]:
        """(rows when the span attends, None: a selection's indices are rows of them): the rows of
        positions [0, stop) held here, read (an fp8 cache dequantized) when the span attends; a paged
        cache gives its store and what turns indices into its slots."""
        return partial(self.read_latent, layer, stop, dtype), None

    @staticmethod
    def _read(store: torch.Tensor, scale: torch.Tensor | None, stop: int, dtype: torch.dtype) -> torch.Tensor:
        if scale is None:
            return store[:stop].to(dtype)
        return (store[:stop].to(torch.float32) * scale[:stop, None]).to(dtype)

    # ---- sequence bookkeeping ------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Forget rows at positions >= length (rejected drafts, a diverging prompt)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate({length}) outside [0, {self.length}]")
        del self.tokens[length:]
        self.frontier = min(self.frontier, length)

    # ---- the prefix cache's view -----------------------------------------------------------
    def export_rows(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Raw cached rows of positions [start, stop) per layer, as stored (names: latent.L,
        latent_scale.L, index.L, index_scale.L): the local slots `slots(start, stop)` (under DCP only
        this rank's positions). Views into the cache: copy them before the engine writes again."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"rows [{start}, {stop}) outside written [0, {self.length})")
        a, b = self.slots(start, stop)
        out: dict[str, torch.Tensor] = {}
        for i in range(self.n_layers):
            out[f"latent.{i}"] = self.latent[i][a:b]
            if self.latent_scale[i] is not None:
                out[f"latent_scale.{i}"] = self.latent_scale[i][a:b]
        for i in self.index_keys:
            out[f"index.{i}"] = self.index_keys[i][a:b]
            if self.index_scale[i] is not None:
                out[f"index_scale.{i}"] = self.index_scale[i][a:b]
        return out

    def position_bytes(self) -> int:
        """Bytes of one local slot's rows over every layer, as export_rows gives them (what a
        store copies per position this rank holds): rows of glm53.kv_format's sizes."""
        return (self.n_layers * row_bytes(self.latent_dim, self.kv_dtype)
                + len(self.indexed_layers) * row_bytes(self.index_dim, self.kv_dtype))

    def slots(self, start: int, stop: int) -> tuple[int, int]:
        """The local slots [a, b) that hold positions [start, stop) (here: the positions
        themselves; a cache split by position holds only its own, consecutively)."""
        return start, stop

    def import_rows(self, start: int, rows: dict[str, torch.Tensor], tokens: list[int]) -> None:
        """Place restored rows for positions [start, start + len(tokens)); start must equal length.
        `rows` holds at least the local slots of those positions, leading (a stored block may be
        longer than the part reused: only its first slots are taken). Restored rows count as
        canonical prefill (they came from one): the frontier moves with them."""
        if start != self.length:
            raise ValueError(f"import at {start} but the state holds {self.length} rows; rows must continue it")
        n = len(tokens)
        self.reserve(start + n)
        a, b = self.slots(start, start + n)
        places = self._places
        if rows.keys() != places.keys():
            missing, extra = places.keys() - rows.keys(), rows.keys() - places.keys()
            raise ValueError(f"restored rows do not match this cache: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}")
        dsts, srcs, stacked = [], [], set()
        for names, stack in getattr(rows, "stacks", ()):  # a whole kind in layer order: one copy
            kind = self._stack_kinds.get(names)
            if kind is None:
                continue
            target = self.stacks[kind]
            if stack.shape[1] < b - a or stack.dtype != target.dtype or stack.shape[2:] != target.shape[2:]:
                raise ValueError(f"restored {names[0]}..{names[-1]}: {tuple(stack.shape)} {stack.dtype}, expected "
                                 f"at least [{len(names)}, {b - a}, ...] {target.dtype}")
            dsts.append(target[:, a:b])
            srcs.append(stack[:, : b - a])
            stacked.update(names)
        for name, t in rows.items():  # every tensor checked first: nothing half-written
            if name in stacked:
                continue
            kind, layer = places[name]
            target = getattr(self, kind)[layer]
            if t.shape[0] < b - a or t.dtype != target.dtype or t.shape[1:] != target.shape[1:]:
                raise ValueError(f"restored {name}: {tuple(t.shape)} {t.dtype}, expected at least [{b - a}, ...] {target.dtype}")
            dsts.append(target[a:b])
            srcs.append(t if t.shape[0] == b - a else t[: b - a])
        # straight into the cache: a few stacks, or one grouped copy of ~117 tensors
        torch._foreach_copy_(dsts, srcs)
        self.tokens.extend(tokens)
        if self.frontier == start:
            self.frontier = start + n

    @cached_property
    def _places(self) -> dict[str, tuple[str, int]]:
        """export_names' tensors: name -> (attribute, layer); the names are fixed for a state."""
        return {name: name_place(name) for name in self.export_names()}

    @cached_property
    def _stack_kinds(self) -> dict[tuple[str, ...], str]:
        """The names of each stack's layers in order -> the stack (for import_rows)."""
        kinds = {}
        for kind, prefix, layers in (("latent", "latent", range(self.n_layers)),
                                     ("latent_scale", "latent_scale", range(self.n_layers) if self.fp8 else ()),
                                     ("index_keys", "index", sorted(self.index_keys)),
                                     ("index_scale", "index_scale", sorted(self.index_keys) if self.fp8 else ())):
            if layers:
                kinds[tuple(f"{prefix}.{i}" for i in layers)] = kind
        return kinds

    def export_names(self) -> list[str]:
        return export_names(self.n_layers, self.indexed_layers, self.fp8)

    @property
    def positions_per_slot(self) -> int:
        """Positions whose rows one local slot stands for: 1, R where a cache is split by position over R ranks."""
        return 1

    def bytes_per_position(self) -> int:
        """Bytes the sequence's cache takes per position of its context (what a KV pool grants):
        here a slot's; a cache split by position averages its slots over the ranks."""
        return self.position_bytes()
