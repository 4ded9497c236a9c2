"""The resident form of EXL3 linears: trellis words and sign vectors in one device buffer each,
with a table saying where each matrix lives. Nothing is decoded: kernels decode tiles in registers
(glm53/ops/triton_exl3.py), the CPU path decodes what it touches (glm53/ops/exl3_torch.py).

A matrix is the part of one EXL3 linear a rank holds: `in_read` input rows and `out_read` output
columns of its [in, out] weight (y = x @ W), both multiples of 128 (the Hadamard block). Its 16x16
tiles sit in 128x128 blocks: tile (i, j) of block (kb, nb) starts at

    base + kb * step_kb + nb * step_nb + i * stride_r + j * words_per_tile      (int16 elements)

which covers a plain trellis [in/16, out/16, 16K] (row-major tiles) and the block-major layout
glm53/exl3/packing.py gives a layer's experts (gate/up blocks by output, down blocks by input)
without copying either. Sign vectors: suh[c] at suh + (c // 128) * suh_step + c % 128, svh
likewise by output column.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .decode import decode_rotated
from .format import CODEBOOKS, Exl3Error, Exl3Group
from .packing import BLOCK, PROJECTIONS, PackedExperts

TABLE_FIELDS = ("base", "stride_r", "step_kb", "step_nb", "bits2", "codebook", "suh", "suh_step", "svh",
                "svh_step", "in_read", "out_read")


@dataclass(frozen=True)
class MatrixLayout:
    """Where one EXL3 matrix lives in a bank (int16 element offsets into `words`, fp16 into `scales`)."""

    base: int
    stride_r: int
    step_kb: int
    step_nb: int
    bits2: int  # 2K: 4, 5, 6, 7, 8 for K = 2, 2.5, 3, 3.5, 4
    codebook: int  # index into CODEBOOKS
    suh: int
    suh_step: int
    svh: int
    svh_step: int
    in_read: int
    out_read: int

    @property
    def bits(self) -> float:
        return self.bits2 / 2

    @property
    def words_per_tile(self) -> int:
        return 8 * self.bits2

    @property
    def trellis_bytes(self) -> int:
        return (self.in_read // 16) * (self.out_read // 16) * self.words_per_tile * 2

    def row(self) -> list[int]:
        return [getattr(self, name) for name in TABLE_FIELDS]


@dataclass
class Exl3Bank:
    """EXL3 matrices resident on one device: `words` int16, `scales` fp16, `table` int64 [n, fields]."""

    words: torch.Tensor
    scales: torch.Tensor
    layouts: tuple[MatrixLayout, ...]
    table: torch.Tensor
    _rotated: "OrderedDict[tuple[int, torch.dtype], torch.Tensor]" = field(default_factory=OrderedDict, repr=False)
    _rotated_bytes: int = 0
    _signs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    # small device tables the CUDA kernels derive from the layouts (the stage's offsets), built once: a
    # host-to-device copy in every prefill call would wait for the stream
    derived: dict[tuple, tuple] = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return self.words.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.table))

    @cached_property
    def codebooks(self) -> frozenset[int]:
        """The codebooks of the bank's matrices (read on every kernel launch: computed once; the layouts
        are fixed when the bank is built)."""
        return frozenset(layout.codebook for layout in self.layouts)

    def trellis(self, m: int) -> torch.Tensor:
        """Matrix m's tiles as a trellis int16 [in_read/16, out_read/16, 16K] (a copy, for the CPU path and tests)."""
        lay = self.layouts[m]
        wpt = lay.words_per_tile
        tiles_in, tiles_out = lay.in_read // 16, lay.out_read // 16
        i = torch.arange(tiles_in, device=self.device)
        j = torch.arange(tiles_out, device=self.device)
        start = (lay.base + (i // 8)[:, None] * lay.step_kb + (i % 8)[:, None] * lay.stride_r
                 + (j // 8)[None, :] * lay.step_nb + (j % 8)[None, :] * wpt)
        idx = start[..., None] + torch.arange(wpt, device=self.device)
        return self.words[idx]

    def sign_vectors(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(suh [in_read], svh [out_read]) fp16 of matrix m (gathered once, kept: a few KB a matrix)."""
        found = self._signs.get(m)
        if found is not None:
            return found
        lay = self.layouts[m]

        def gather(start: int, step: int, n: int) -> torch.Tensor:
            c = torch.arange(n, device=self.device)
            return self.scales[start + (c // BLOCK) * step + c % BLOCK]

        found = self._signs[m] = (gather(lay.suh, lay.suh_step, lay.in_read), gather(lay.svh, lay.svh_step, lay.out_read))
        return found

    def rotated(self, m: int, cache_bytes: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """W_hat of matrix m, [in_read, out_read] in the rotated basis as `dtype` (its fp16 values, exact in
        fp32), from a cache of at most `cache_bytes` (least recently used first out; 0: no cache). The CPU
        path's weights: decoded as used, never the whole model at load."""
        key = (m, dtype)
        w = self._rotated.get(key)
        if w is not None:
            self._rotated.move_to_end(key)
            return w
        lay = self.layouts[m]
        w = decode_rotated(self.trellis(m), lay.bits, CODEBOOKS[lay.codebook]).to(dtype)
        size = w.numel() * w.element_size()
        if size <= cache_bytes:
            while self._rotated and self._rotated_bytes + size > cache_bytes:
                _, old = self._rotated.popitem(last=False)
                self._rotated_bytes -= old.numel() * old.element_size()
            self._rotated[key] = w
            self._rotated_bytes += size
        return w

    def drop_cache(self) -> None:
        self._rotated.clear()
        self._rotated_bytes = 0


@dataclass(frozen=True)
class MlpMatrices:
    """Where an MLP's matrices sit in its bank: routed expert e's gate is gate0 + e (up, down alike);
    the shared expert (or a dense MLP, as the only expert) has its own three, or None."""

    gate0: int
    up0: int
    down0: int
    n_experts: int
    shared: tuple[int, int, int] | None
    width: int  # the expert's intermediate held here
    hidden: int

    @property
    def matrices(self) -> tuple[list[int], list[int], list[int]]:
        """Per projection, the matrix of expert e at [e]; the shared expert's (if any) last."""
        extra = [self.shared] if self.shared is not None else []
        return tuple([m0 + e for e in range(self.n_experts)] + [s[i] for s in extra]
                     for i, m0 in enumerate((self.gate0, self.up0, self.down0)))  # type: ignore[return-value]


class BankBuilder:
    """Collects EXL3 matrices on the host, then moves them to the device as one bank."""

    def __init__(self) -> None:
        self._words: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        self._layouts: list[MatrixLayout] = []
        self._n_words = 0
        self._n_scales = 0

    def _add_words(self, t: torch.Tensor) -> int:
        start = self._n_words
        self._words.append(t.reshape(-1).to(torch.int16))
        self._n_words += t.numel()
        return start

    def _add_scales(self, t: torch.Tensor) -> int:
        start = self._n_scales
        self._scales.append(t.reshape(-1).to(torch.float16))
        self._n_scales += t.numel()
        return start

    def add_group(self, group: Exl3Group) -> int:
        """One plain trellis [in/16, out/16, 16K] (a whole linear or a rank's slice of one); its index."""
        _check_served(group)
        tiles_in, tiles_out, wpt = (int(s) for s in group.trellis.shape)
        base = self._add_words(group.trellis.contiguous())
        suh = self._add_scales(group.suh)
        svh = self._add_scales(group.svh)
        stride_r = tiles_out * wpt
        self._layouts.append(MatrixLayout(
            base=base, stride_r=stride_r, step_kb=8 * stride_r, step_nb=8 * wpt, bits2=int(2 * group.bits),
            codebook=CODEBOOKS.index(group.codebook), suh=suh, suh_step=BLOCK, svh=svh, svh_step=BLOCK,
            in_read=tiles_in * 16, out_read=tiles_out * 16))
        return len(self._layouts) - 1

    def add_experts(self, packed: PackedExperts) -> dict[str, list[int]]:
        """A layer's (or a rank's blocks of a layer's) routed experts in packing.py's block-major
        layout, referenced as they are: {projection: [matrix index of expert 0, 1, ...]}."""
        base = self._add_words(packed.trellis)
        block_scales = self._add_scales(packed.block_scales)
        shared_scales = self._add_scales(packed.shared_scales)
        n_experts = max(e for e, _ in packed.table) + 1
        h16, held = packed.hidden // 16, len(packed.blocks)
        out: dict[str, list[int]] = {p: [] for p in PROJECTIONS}
        for p in PROJECTIONS:
            for e in range(n_experts):
                slot = packed.table[(e, p)]
                wpt = int(16 * slot.bits)
                full = shared_scales + slot.shared_scale_offset
                side = block_scales + slot.scale_offset
                if p != "down_proj":  # region [h16, 8, wpt] per block; blocks are the output side
                    lay = MatrixLayout(base + slot.offset, 8 * wpt, 64 * wpt, packed.block_words, int(2 * slot.bits),
                                       CODEBOOKS.index(slot.codebook), full, BLOCK, side, packed.block_scale_len,
                                       packed.hidden, BLOCK * held)
                else:  # region [8, h16, wpt] per block; blocks are the input side
                    lay = MatrixLayout(base + slot.offset, h16 * wpt, packed.block_words, 8 * wpt, int(2 * slot.bits),
                                       CODEBOOKS.index(slot.codebook), side, packed.block_scale_len, full, BLOCK,
                                       BLOCK * held, packed.hidden)
                self._layouts.append(lay)
                out[p].append(len(self._layouts) - 1)
        return out

    def build(self, device: torch.device | str) -> Exl3Bank:
        words = torch.cat(self._words) if self._words else torch.zeros(0, dtype=torch.int16)
        scales = torch.cat(self._scales) if self._scales else torch.zeros(0, dtype=torch.float16)
        table = torch.tensor([lay.row() for lay in self._layouts], dtype=torch.int64).reshape(-1, len(TABLE_FIELDS))
        dev = torch.device(device)
        return Exl3Bank(words.to(dev), scales.to(dev), tuple(self._layouts), table.to(dev))


def _check_served(group: Exl3Group) -> None:
    if group.bias is not None:
        raise Exl3Error(f"{group.prefix}.bias: GLM-5.3's linears carry no bias; this is not a GLM-5.3 pack")
    if group.in_features % BLOCK or group.out_features % BLOCK:
        raise Exl3Error(f"{group.prefix}: [{group.in_features}, {group.out_features}] is not a multiple of {BLOCK}")
