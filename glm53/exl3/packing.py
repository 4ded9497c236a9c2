"""Mixed-width packing of one MoE layer's routed experts into one buffer (the layout the loader keeps on
the device: glm53/exl3/bank.py references it as it is), and a reference expert matmul from decoded
weights (tests: each rank's blocks add up to the whole expert).

An expert's intermediate (moe_intermediate_size) is cut into 128-column blocks: for gate_proj and
up_proj these are output columns (trellis tile columns 8b..8b+8, svh[128b:128b+128]); for
down_proj input rows (tile rows 8b..8b+8, suh[128b:...]). EXL3's Hadamard blocks are 128 wide in
both directions, so each block decodes on its own to exactly the matching slice of the whole.

Buffer layout (int16 `trellis`, block-major so a rank's consecutive blocks are one slice):

    block b0 | block b1 | ...           each block: gate | up | down regions,
                                        each region: experts sorted by (K, codebook, expert)

so within a block and projection, experts of one width and codebook sit next to each other (a
grouped kernel takes one K-group as a run of equal-sized slots). Every block has the same layout:
the table gives (expert, projection) -> offset inside a block, K, codebook, words. Sign vectors:
the block side (svh for gate/up, suh for down: 128 each) in `block_scales` with the same
block-major layout; the full side (suh for gate/up, svh for down: hidden each) in `shared_scales`,
which every rank holds whole.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .decode import decode_weight
from .format import Exl3Error, Exl3Group, TensorSource, read_group

BLOCK = 128
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertSlot:
    """Where one expert projection lives: the same offsets in every block."""

    expert: int
    projection: str
    bits: float
    codebook: str
    in_features: int  # of the whole projection
    out_features: int
    offset: int  # int16 elements from the start of a block
    words: int  # int16 elements of this projection in one block
    scale_offset: int  # fp16 elements from the start of a block's scale region (128 each)
    shared_scale_offset: int  # fp16 elements into shared_scales (hidden each)


@dataclass(frozen=True)
class WidthGroup:
    """A run of experts with one projection, K and codebook: equal-sized, adjacent slots in every block."""

    projection: str
    bits: float
    codebook: str
    experts: tuple[int, ...]
    offset: int  # of the first slot, inside a block
    words: int  # per expert


@dataclass
class PackedExperts:
    layer: int
    hidden: int
    intermediate: int
    blocks: tuple[int, ...]  # global block indices held, ascending
    block_words: int  # int16 elements per block
    block_scale_len: int  # fp16 elements per block in block_scales
    trellis: torch.Tensor  # int16 [len(blocks) * block_words]
    block_scales: torch.Tensor  # fp16 [len(blocks) * block_scale_len]
    shared_scales: torch.Tensor  # fp16
    table: dict[tuple[int, str], ExpertSlot]
    groups: tuple[WidthGroup, ...]
    _decoded: dict[tuple[int, str, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def n_blocks_total(self) -> int:
        return self.intermediate // BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.trellis, self.block_scales, self.shared_scales))

    def bytes_by_bits(self) -> dict[float, int]:
        """Trellis bytes held, per width K."""
        out: dict[float, int] = {}
        for g in self.groups:
            out[g.bits] = out.get(g.bits, 0) + g.words * len(g.experts) * 2 * len(self.blocks)
        return dict(sorted(out.items()))

    def experts_by_bits(self, projection: str) -> dict[float, tuple[int, ...]]:
        """Experts of one projection per width K (any codebook), for kernels grouped by K alone."""
        out: dict[float, tuple[int, ...]] = {}
        for g in self.groups:
            if g.projection == projection:
                out[g.bits] = out.get(g.bits, ()) + g.experts
        return out

    # ---- access --------------------------------------------------------------------------------
    def block_group(self, expert: int, projection: str) -> Exl3Group:
        """The held blocks of one expert projection as one EXL3 group (intermediate side = held blocks)."""
        slot = self.table[(expert, projection)]
        h16 = self.hidden // 16
        wpt = int(16 * slot.bits)  # words per tile
        parts, side = [], []
        for i in range(len(self.blocks)):
            base = i * self.block_words + slot.offset
            region = self.trellis[base : base + slot.words]
            sbase = i * self.block_scale_len + slot.scale_offset
            side.append(self.block_scales[sbase : sbase + BLOCK])
            parts.append(region.view(h16, 8, wpt) if projection != "down_proj" else region.view(8, h16, wpt))
        full_side = self.shared_scales[slot.shared_scale_offset : slot.shared_scale_offset + self.hidden]
        n_local = BLOCK * len(self.blocks)
        if projection != "down_proj":
            trellis = torch.cat(parts, dim=1)
            return Exl3Group(f"layer{self.layer}.e{expert}.{projection}", trellis, full_side, torch.cat(side),
                             slot.codebook, slot.bits, self.hidden, n_local)
        trellis = torch.cat(parts, dim=0)
        return Exl3Group(f"layer{self.layer}.e{expert}.{projection}", trellis, torch.cat(side), full_side,
                         slot.codebook, slot.bits, n_local, self.hidden)

    def weight(self, expert: int, projection: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded [in, out] (y = x @ W) of the held blocks, cached per (expert, projection, dtype)."""
        key = (expert, projection, dtype)
        w = self._decoded.get(key)
        if w is None:
            w = decode_weight(self.block_group(expert, projection)).to(dtype)
            self._decoded[key] = w
        return w

    def drop_cache(self) -> None:
        self._decoded.clear()

    def take_blocks(self, blocks: Iterable[int]) -> "PackedExperts":
        """One rank's subset: the given global blocks (consecutive blocks are one slice of the buffer)."""
        want = tuple(sorted(set(blocks)))
        missing = [b for b in want if b not in self.blocks]
        if missing:
            raise ValueError(f"layer {self.layer}: blocks {missing} are not held (held: {list(self.blocks)})")
        index = [self.blocks.index(b) for b in want]
        return PackedExperts(
            layer=self.layer, hidden=self.hidden, intermediate=self.intermediate, blocks=want,
            block_words=self.block_words, block_scale_len=self.block_scale_len,
            trellis=_gather_rows(self.trellis, self.block_words, index),
            block_scales=_gather_rows(self.block_scales, self.block_scale_len, index),
            shared_scales=self.shared_scales, table=self.table, groups=self.groups,
        )


def _gather_rows(flat: torch.Tensor, row: int, index: list[int]) -> torch.Tensor:
    """Rows `index` of a flat buffer of `row`-element rows: a view when they are consecutive."""
    rows = flat.view(-1, row)
    if not index:
        return flat[:0]
    if index == list(range(index[0], index[0] + len(index))):
        return rows[index[0] : index[0] + len(index)].reshape(-1)
    return rows[torch.tensor(index, device=flat.device)].reshape(-1)


def expert_prefix(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}"


def pack_layer_experts(
    tensors: TensorSource,
    layer: int,
    n_experts: int,
    *,
    blocks: Iterable[int] | None = None,
    device: torch.device | str | None = None,
) -> PackedExperts:
    """Read every routed expert of `layer` (EXL3 groups) and pack the given 128-column blocks (all by default)."""
    groups = {(e, p): read_group(tensors, expert_prefix(layer, e, p)) for e in range(n_experts) for p in PROJECTIONS}
    hidden, intermediate = groups[(0, "gate_proj")].in_features, groups[(0, "gate_proj")].out_features
    for (e, p), g in groups.items():
        want = (hidden, intermediate) if p != "down_proj" else (intermediate, hidden)
        if (g.in_features, g.out_features) != want:
            raise Exl3Error(f"{g.prefix}: shape [{g.in_features}, {g.out_features}] differs from the layer's {list(want)}")
        if g.bias is not None:
            raise Exl3Error(f"{g.prefix}.bias: routed experts carry no bias here")
    if intermediate % BLOCK:
        raise Exl3Error(f"layer {layer}: expert width {intermediate} is not a multiple of {BLOCK}")
    held = tuple(sorted(set(blocks))) if blocks is not None else tuple(range(intermediate // BLOCK))
    if any(b < 0 or b >= intermediate // BLOCK for b in held):
        raise ValueError(f"layer {layer}: blocks {list(held)} outside 0..{intermediate // BLOCK - 1}")

    h16 = hidden // 16
    table: dict[tuple[int, str], ExpertSlot] = {}
    width_groups: list[WidthGroup] = []
    offset = scale_offset = shared_offset = 0
    for p in PROJECTIONS:
        order = sorted(range(n_experts), key=lambda e: (groups[(e, p)].bits, groups[(e, p)].codebook, e))
        for e in order:
            g = groups[(e, p)]
            words = h16 * 8 * g.words_per_tile
            table[(e, p)] = ExpertSlot(e, p, g.bits, g.codebook, g.in_features, g.out_features,
                                       offset, words, scale_offset, shared_offset)
            last = width_groups[-1] if width_groups else None
            if last and (last.projection, last.bits, last.codebook) == (p, g.bits, g.codebook):
                width_groups[-1] = WidthGroup(p, g.bits, g.codebook, last.experts + (e,), last.offset, words)
            else:
                width_groups.append(WidthGroup(p, g.bits, g.codebook, (e,), offset, words))
            offset += words
            scale_offset += BLOCK
            shared_offset += hidden
    block_words, block_scale_len = offset, scale_offset

    # packed where the sources are (a loader's CPU tensors: one copy to the device after; a bench's
    # device tensors: no host round trip), then moved to `device`
    src = groups[(0, "gate_proj")].trellis.device
    trellis = torch.empty(len(held) * block_words, dtype=torch.int16, device=src)
    block_scales = torch.empty(len(held) * block_scale_len, dtype=torch.float16, device=src)
    shared = torch.empty(shared_offset, dtype=torch.float16, device=src)
    for (e, p), slot in table.items():
        g = groups[(e, p)]
        full_side = g.suh if p != "down_proj" else g.svh
        shared[slot.shared_scale_offset : slot.shared_scale_offset + hidden] = full_side
        for i, b in enumerate(held):
            if p != "down_proj":
                part, side = g.trellis[:, 8 * b : 8 * b + 8, :], g.svh[BLOCK * b : BLOCK * (b + 1)]
            else:
                part, side = g.trellis[8 * b : 8 * b + 8, :, :], g.suh[BLOCK * b : BLOCK * (b + 1)]
            base = i * block_words + slot.offset
            trellis[base : base + slot.words] = part.reshape(-1)
            sbase = i * block_scale_len + slot.scale_offset
            block_scales[sbase : sbase + BLOCK] = side
    dev = torch.device(device) if device is not None else src
    return PackedExperts(
        layer=layer, hidden=hidden, intermediate=intermediate, blocks=held, block_words=block_words,
        block_scale_len=block_scale_len, trellis=trellis.to(dev), block_scales=block_scales.to(dev),
        shared_scales=shared.to(dev), table=table, groups=tuple(width_groups),
    )


# ---- reference expert matmul ----------------------------------------------------------------------

def expert_forward(packed: PackedExperts, expert: int, x: torch.Tensor) -> torch.Tensor:
    """down(silu(x @ gate) * (x @ up)) over the held blocks: [T, hidden] -> [T, hidden].

    With a rank's subset of blocks this is that rank's partial sum (the ranks' outputs add up to
    the whole expert). Decoded weights are cached in `packed` in x's dtype.
    """
    gate = packed.weight(expert, "gate_proj", x.dtype)
    up = packed.weight(expert, "up_proj", x.dtype)
    down = packed.weight(expert, "down_proj", x.dtype)
    return (F.silu(x @ gate) * (x @ up)) @ down


def experts_forward(
    packed: PackedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Routed experts for a batch: sum_k w[t,k] * expert_{id[t,k]}(x[t]); experts visited in ascending order."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        y = expert_forward(packed, e, x[token]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out
