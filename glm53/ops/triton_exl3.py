"""EXL3 products on CUDA (Triton), straight from the packed trellis: tiles decoded in registers inside
the product, nothing expanded to a dense matrix. The arithmetic is glm53/ops/exl3_torch.py's.

Three kernels share one main loop:

    _linear_kernel    one EXL3 linear (attention projections)
    _gate_up_kernel   gate and up of an MLP for one 128-column block of its width: SiLU(g) * u, then
                      down's input rotation (its 128-block of suh), written as fp16 [rows, width]
    _down_kernel      down from those rotated rows; each routed row weighted; with few tokens each
                      token's experts summed in ascending order inside the kernel

A program owns BM rows and one 128-column output block (the Hadamard block, so the output rotation
happens in the program). Its K loop takes 128 input rows a step: the 128x128 block of the trellis is
decoded (glm53/exl3/decode.py's definition: a 16-bit window of the tile's cyclic bit stream per
value, mapped by the codebook; TENSOR_CORE_PERM places it) and multiplied with the step's rotated
input on the tensor cores (fp32 accumulation). Steps are grouped in splits of SPLIT_STEPS; a split's
steps accumulate from zero, and the splits' sums are added in order from zero. The split boundaries
depend on the input width only, so every form does one row's arithmetic in the same order:

    full      (many rows) one program runs every split, adding each split's sum as it ends
    parallel  (decode: few rows) each split is its own program writing its sum (fp32) to a
              workspace; the last of a block's programs to finish (an atomic counter) adds them in
              split order and finishes the block, then resets the counter (graph replays find zeros)

The rotations use tensor-core dots with the +-1 Hadamard matrix (inputs: fp16 in, fp32 sums); the
output rotation an fp32 FMA dot (input_precision "ieee"). Rows never interact: a row's bits depend
on its own values and the fixed shapes only, whatever BM, the form or the other rows - so far as
the tensor cores give a row the same bits under mma.sync (BM 16) and wgmma (BM 64, 128): measured
for linear's tiles (glm53/ops/triton_linear.py) and checked again per device here at first use
(`forms_agree`), with the decode form's tile for every row count where they differ.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.exl3.bank import Exl3Bank, MlpMatrices
from glm53.ops import cuda_exl3, expert_counts
from glm53.ops.triton_launch import OPTIONS

HAD = 128
SPLIT_STEPS = 8  # 128-row steps a split: 1024 inputs (6144: 6 splits, 2048: 2, 512: 1)
SCALE = 1 / math.sqrt(HAD)
# mul1: 1024 + byte sum, times 1/147.7, plus -10.39 (fp16 constants 0x1EEE and 0xC931, exact in fp32)
MUL1_INV = 0.00676727294921875
MUL1_BIAS = -10.3828125


_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# the same values for the kernels (a jit function reads module globals only as constexpr)
_HAD = tl.constexpr(HAD)
_SPLIT = tl.constexpr(SPLIT_STEPS)
_SCALE = tl.constexpr(SCALE)
_MUL1_INV = tl.constexpr(MUL1_INV)
_MUL1_BIAS = tl.constexpr(MUL1_BIAS)
_NF = tl.constexpr(12)  # glm53.exl3.bank.TABLE_FIELDS


def n_splits(in_read: int) -> int:
    steps = in_read // HAD
    return (steps + SPLIT_STEPS - 1) // SPLIT_STEPS


# ---- decoding a SUBK x BN block of the trellis --------------------------------------------------------
@triton.jit
def _codebook(state, cb, CB: tl.constexpr):
    """fp16 values of 16-bit states (uint32). CB: 0 3inst, 1 mcg, 2 mul1, -1 per matrix (runtime cb)."""
    if CB == 2:
        x = state * 0x83DCD12D
        total = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        h = (total + 1024).to(tl.float32)
        return (h * _MUL1_INV + _MUL1_BIAS).to(tl.float16)
    elif CB == 1:
        x = state * 0xCBAC1FED
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        return lo + hi
    elif CB == 0:
        x = state * 89226354 + 64248484
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        return lo + hi
    else:
        v3 = _codebook(state, cb, 0)
        vm = _codebook(state, cb, 1)
        v1 = _codebook(state, cb, 2)
        return tl.where(cb == 0, v3, tl.where(cb == 1, vm, v1))


@triton.jit
def _window(hi, mid, dist):
    """Bits [dist, dist + 16) of the 64-bit stream hi:mid (first bit most significant), dist in [0, 32)."""
    return (((hi << dist) | ((mid >> 1) >> (31 - dist))) >> 16) & 0xFFFF


@triton.jit
def _element_layout(bits2, stride_r, SUBK: tl.constexpr, BN: tl.constexpr):
    """Per value of a SUBK x BN block (k rows, n columns): the int32 word offsets (from the block's first
    tile) of the two words holding its 16-bit window, and the window's first bit in the first word."""
    k = tl.arange(0, SUBK)[:, None]
    n = tl.arange(0, BN)[None, :]
    r = k % 16
    c = n % 16
    # the stream position of tile element (r, c): TENSOR_CORE_PERM inverted (lane 4f + b, value c' + 2a + 4d)
    p = 32 * (c % 8) + 8 * ((r % 8) // 2) + 4 * (c // 8) + 2 * (r // 8) + (r % 2)
    end = ((p + 1) * bits2 - ((p + 1) & 1) * (bits2 & 1)) // 2
    start = end - 16 + 128 * bits2  # one stream ahead: never negative
    words = 4 * bits2  # int32 words a tile
    w0 = (start // 32) % words
    tile = (k // 16) * (stride_r // 2) + (n // 16) * words
    return tile + w0, tile + (w0 + 1) % words, (start % 32).to(tl.uint32)


@triton.jit
def _decode_elements(words_ptr, block, off0, off1, offset, cb, CB: tl.constexpr, PTX: tl.constexpr):
    """The SUBK x BN fp16 block whose first tile starts at int32 word `block`: each value from its two words."""
    return _decode_words(tl.load(words_ptr + block + off0), tl.load(words_ptr + block + off1), offset, cb, CB, PTX)


@triton.jit
def _decode_words(w0, w1, offset, cb, CB: tl.constexpr, PTX: tl.constexpr):
    """Values from their two int32 words (_element_layout) and the window's first bit in the first.
    PTX: the window and codebook two values at a time (_decode_asm, as the lane form), from w0:w1 >> 16
    (the window lies in its low 48 bits, `32 - offset` up from the bottom); else in Triton's own ops."""
    w0 = w0.to(tl.uint32, bitcast=True)
    w1 = w1.to(tl.uint32, bitcast=True)
    if PTX and not _INTERPRETED and CB >= 0:
        return _decode_asm((w0 << 16) | (w1 >> 16), w0 >> 16, 32 - offset, CB)
    return _codebook(_window(w0, w1, offset), cb, CB)


@triton.jit
def _lane_layout(bits2, stride_r, SUBK: tl.constexpr, BN: tl.constexpr):
    """Per (tile, lane) of a SUBK x BN block (SUBK/16 x BN/16 tiles, 32 lanes of 8 values each), shaped
    [tiles, 32, 1]: the int32 word offsets of the three words spanning the lane's windows and the
    first window's first bit; per value j ([1, 1, 8]) the window's distance from the first (the same
    for every lane). Shaped as the values are, so that a lane's words reach its 8 values in place."""
    tc: tl.constexpr = BN // 16
    t = tl.arange(0, (SUBK // 16) * tc)[:, None, None]
    lane = tl.arange(0, 32)[None, :, None]
    words = 4 * bits2
    first = 4 * lane * bits2 + bits2 // 2 - 16 + 128 * bits2  # E(8 lane) - 16, one stream ahead
    w0 = (first // 32) % words
    tile = (t // tc) * (stride_r // 2) + (t % tc) * words
    j = tl.arange(0, 8)[None, None, :] + 1
    dist = (j * bits2 - (j & 1) * (bits2 & 1)) // 2 - bits2 // 2  # E(8 lane + j) - E(8 lane)
    return (tile + w0, tile + (w0 + 1) % words, tile + (w0 + 2) % words, (first % 32).to(tl.uint32),
            dist.to(tl.uint32))


@triton.jit
def _decode_lanes(words_ptr, block, off0, off1, off2, offset, dist, cb, CB: tl.constexpr, SUBK: tl.constexpr,
                  BN: tl.constexpr):
    """The same block from each lane's three words: 8 windows a lane, then the values moved to their
    tile places (lane 4f + b, value c' + 2a + 4d -> row 8a + 2b + c', column 8d + f)."""
    tc: tl.constexpr = BN // 16
    w0 = tl.load(words_ptr + block + off0).to(tl.uint32, bitcast=True)
    w1 = tl.load(words_ptr + block + off1).to(tl.uint32, bitcast=True)
    w2 = tl.load(words_ptr + block + off2).to(tl.uint32, bitcast=True)
    if _INTERPRETED or CB < 0:
        # the lane's 64 stream bits from its first window on: (w0:w1:w2 << offset)[95:32]
        hi = _window32(w0, w1, offset)
        mid = _window32(w1, w2, offset)
        v = _codebook(_window(hi, mid, dist), cb, CB)  # [tiles, 32, 8]
    else:  # the same values: the stream's bits [16, 80) and [0, 16) past the offset as funnel shifts,
        # then two values at a time in PTX (funnel shift, codebook hash, one f16x2 op)
        shape: tl.constexpr = ((SUBK // 16) * tc, 32, 8)
        low = tl.inline_asm_elementwise(_LOW_BITS, "=r,r,r,r,r", [w0, w1, w2, offset], dtype=tl.uint32, is_pure=True,
                                        pack=1)
        high = tl.inline_asm_elementwise(_HIGH_BITS, "=r,r,r,r", [w0, w1, offset], dtype=tl.uint32, is_pure=True,
                                         pack=1)
        v = _decode_asm(tl.broadcast_to(low, shape), tl.broadcast_to(high, shape), tl.broadcast_to(32 - dist, shape),
                        CB)
    v = tl.reshape(v, (SUBK // 16, tc, 8, 4, 2, 2, 2))  # (tile row, tile col, f, b, d, a, c')
    v = tl.permute(v, (0, 5, 3, 6, 1, 4, 2))  # (tile row, a, b, c', tile col, d, f)
    return tl.reshape(v, (SUBK, BN))


@triton.jit
def _window32(a, b, offset):
    """Bits [offset, offset + 32) of a:b (first bit most significant), offset in [0, 32)."""
    return (a << offset) | ((b >> 1) >> (31 - offset))


# PTX for two values at a time (pack=2: $1 $2 low words, $3 $4 high words, $5 $6 shifts; $0 their fp16
# pair): the state is bits [n, n + 16) up from the bottom of high:low (shf.r.clamp: n = 32 gives high),
# then the codebook (decode.py), the two halves added as one f16x2 (3inst, mcg) or the byte sum's fp16
# times 1/147.7 plus -10.39 as one f16x2 fma (mul1): each value rounded once, as the reference rounds it.
_STATES = ("shf.r.clamp.b32 s0, $1, $3, $5; shf.r.clamp.b32 s1, $2, $4, $6; "
           "and.b32 s0, s0, 0xFFFF; and.b32 s1, s1, 0xFFFF; ")
_HALVES = ("and.b32 x0, x0, 0x8FFF8FFF; xor.b32 x0, x0, 0x3B603B60; and.b32 x1, x1, 0x8FFF8FFF; "
           "xor.b32 x1, x1, 0x3B603B60; prmt.b32 lo, x0, x1, 0x5410; prmt.b32 hi, x0, x1, 0x7632; "
           "add.rn.f16x2 $0, lo, hi; ")
_ASM = {
    0: "{ .reg .b32 s0, s1, x0, x1, lo, hi; " + _STATES + "mad.lo.u32 x0, s0, 89226354, 64248484; "
       "mad.lo.u32 x1, s1, 89226354, 64248484; " + _HALVES + "}",
    1: "{ .reg .b32 s0, s1, x0, x1, lo, hi; " + _STATES + "mul.lo.u32 x0, s0, 0xCBAC1FED; "
       "mul.lo.u32 x1, s1, 0xCBAC1FED; " + _HALVES + "}",
    2: "{ .reg .b32 s0, s1, x0, x1, h, k, b; " + _STATES + "mul.lo.u32 x0, s0, 0x83DCD12D; "
       "mul.lo.u32 x1, s1, 0x83DCD12D; dp4a.u32.u32 x0, x0, 0x01010101, 0x6400; "
       "dp4a.u32.u32 x1, x1, 0x01010101, 0x6400; prmt.b32 h, x0, x1, 0x5410; mov.b32 k, 0x1EEE1EEE; "
       "mov.b32 b, 0xC931C931; fma.rn.f16x2 $0, h, k, b; }",
}
# bits [16, 48) and [0, 16) of (w0:w1:w2 << offset) from the top: $1 $2 $3 the words, $4 the offset
_LOW_BITS = tl.constexpr("{ .reg .b32 h, m; shf.l.clamp.b32 h, $2, $1, $4; shf.l.clamp.b32 m, $3, $2, $4; "
                         "shf.l.clamp.b32 $0, m, h, 16; }")
_HIGH_BITS = tl.constexpr("{ .reg .b32 h; shf.l.clamp.b32 h, $2, $1, $3; shr.b32 $0, h, 16; }")
_ASM_0 = tl.constexpr(_ASM[0])
_ASM_1 = tl.constexpr(_ASM[1])
_ASM_2 = tl.constexpr(_ASM[2])


@triton.jit
def _decode_asm(low, high, shift, CB: tl.constexpr):
    """fp16 codebook values of the 16-bit windows at `shift` bits up from the bottom of high:low."""
    if CB == 0:
        asm: tl.constexpr = _ASM_0
    elif CB == 1:
        asm: tl.constexpr = _ASM_1
    else:
        asm: tl.constexpr = _ASM_2
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", [low, high, shift], dtype=tl.float16, is_pure=True,
                                     pack=2)


# ---- rotations ------------------------------------------------------------------------------------
@triton.jit
def _hadamard_cols(c0, NCOL: tl.constexpr, DT: tl.constexpr):
    """Columns [c0, c0 + NCOL) of the 128 x 128 +-1 Sylvester Hadamard, (-1)^popcount(i & j), in DT."""
    i = tl.arange(0, _HAD)[:, None]
    j = c0 + tl.arange(0, NCOL)[None, :]
    v = i & j
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1 - 2 * (v & 1)).to(DT)


@triton.jit
def _rotate_cols(xs, had_cols, ACT: tl.constexpr):
    """Columns of A(H(xs) * 2^-3.5) for xs [BM, 128] in ACT, had_cols [128, n] +-1 in ACT."""
    if ACT == tl.float32:
        r = tl.dot(xs, had_cols, input_precision="ieee")
    else:
        r = tl.dot(xs, had_cols)
    return (r * _SCALE).to(ACT)


@triton.jit
def _unrotate(acc, svh32, ACT: tl.constexpr):
    """fp32 H(acc) * 2^-3.5 * svh for acc fp32 [BM, 128]. fp32 models: one FMA chain a value (ieee);
    else on the tensor cores, acc split exactly into three bf16 parts (8 bits each, fp32's range)
    summed by the dots into one fp32 accumulator: the +-1 products are exact. (Triton's interpreter
    rounds bf16 by truncation and multiplies it wrongly: there, the FMA chain for every dtype.)"""
    if ACT == tl.float32 or _INTERPRETED:
        r = tl.dot(acc, _hadamard_cols(0, _HAD, tl.float32), input_precision="ieee")
    else:
        had = _hadamard_cols(0, _HAD, tl.bfloat16)
        a0 = acc.to(tl.bfloat16)
        rest = acc - a0.to(tl.float32)
        a1 = rest.to(tl.bfloat16)
        a2 = (rest - a1.to(tl.float32)).to(tl.bfloat16)
        r = tl.dot(a0, had)
        r = tl.dot(a1, had, r)
        r = tl.dot(a2, had, r)
    return r * _SCALE * svh32[None, :]


# ---- one matrix of the bank: its table row, its main loop ------------------------------------------
@triton.jit
def _layout(bits2, stride_r, LANES: tl.constexpr, SUBK: tl.constexpr, BN: tl.constexpr):
    """LANES (the decoder, Form.decoder): 1 the lane form, else an element form."""
    if LANES == 1:
        a, b, c, d, e = _lane_layout(bits2, stride_r, SUBK, BN)
    else:
        a, b, c = _element_layout(bits2, stride_r, SUBK, BN)
        d = c
        e = c
    return a, b, c, d, e


@triton.jit
def _chunk(acc, xrow, row_ok, c, words_ptr, block, lay0, lay1, lay2, lay3, lay4, cb, stage, out_read,
           STAGED: tl.constexpr, CB: tl.constexpr, LANES: tl.constexpr, ACT: tl.constexpr, SUBK: tl.constexpr,
           BN: tl.constexpr):
    """acc += (rotated input columns c) @ (the SUBK x BN trellis block at int32 word `block`, decoded; STAGED:
    the same block's values read from the stage at `stage`, rows out_read apart)."""
    xr = tl.load(xrow[:, None] + c[None, :], mask=row_ok[:, None], other=0.0)
    if STAGED:
        w = tl.load(stage + tl.arange(0, SUBK)[:, None].to(tl.int64) * out_read + tl.arange(0, BN)[None, :])
    elif LANES == 1:
        w = _decode_lanes(words_ptr, block, lay0, lay1, lay2, lay3, lay4, cb, CB, SUBK, BN)
    else:
        w = _decode_elements(words_ptr, block, lay0, lay1, lay2, cb, CB, (LANES == 2) or (LANES == 4))
    return _dot(acc, xr, w, ACT)


@triton.jit
def _dot(acc, xr, w, ACT: tl.constexpr):
    # one return after the branches: the compiler builds a statement after a constexpr branch's return too
    if ACT == tl.float32:
        acc = tl.dot(xr, w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(xr, w, acc)
    return acc


@triton.jit
def _prefetched_sum(acc, first, last, block0, step_kb, sub, xrow, row_ok, words_ptr, lay0, lay1, lay2, cb,
                    CB: tl.constexpr, LANES: tl.constexpr, ACT: tl.constexpr, SUBK: tl.constexpr):
    """_split_sum's loop for the element decoder with the next chunk's words loaded before this chunk is
    decoded (registers carried across the loop), so their latency overlaps the decode and the dot; the
    same chunks, values and dots in the same order."""
    n_ch: tl.constexpr = _HAD // SUBK
    sc = tl.arange(0, SUBK)
    start = block0 + first * (step_kb // 2)
    nw0 = tl.load(words_ptr + start + lay0)
    nw1 = tl.load(words_ptr + start + lay1)
    for step in range(first, last):
        block = block0 + step * (step_kb // 2)
        for j in tl.static_range(n_ch):
            w0 = nw0
            w1 = nw1
            if j + 1 < n_ch:
                nxt = block + (j + 1) * sub
            else:  # the next step's first chunk; after the last step this chunk again (read, unused)
                nxt = tl.where(step + 1 < last, block + step_kb // 2, block + j * sub)
            nw0 = tl.load(words_ptr + nxt + lay0)
            nw1 = tl.load(words_ptr + nxt + lay1)
            xr = tl.load(xrow[:, None] + (sc + (step * _HAD + j * SUBK))[None, :], mask=row_ok[:, None], other=0.0)
            acc = _dot(acc, xr, _decode_words(w0, w1, lay2, cb, CB, (LANES == 2) or (LANES == 4)), ACT)
    return acc


@triton.jit
def _split_sum(table_ptr, m, nb, first, last, xrow, row_ok, words_ptr, stage_ptr, stage_off_ptr, STAGED: tl.constexpr,
               CB: tl.constexpr, LANES: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               SUBK: tl.constexpr):
    """fp32 [BM, BN]: matrix m's output block nb over the steps [first, last): the sum, from zero, of
    (rotated input block) @ (decoded trellis block) a step, SUBK rows of the block a dot (the same k16
    steps in the same order whatever SUBK). xrow: [BM] pointers to the rows' rotated inputs. STAGED: the
    decoded values come from the stage (matrix m's W_hat at stage_ptr + stage_off_ptr[m], [in_read, out_read])."""
    row = table_ptr + m * _NF
    base = tl.load(row + 0)
    stride_r = tl.load(row + 1).to(tl.int32)
    step_kb = tl.load(row + 2)
    step_nb = tl.load(row + 3)
    bits2 = tl.load(row + 4).to(tl.int32)
    cb = tl.load(row + 5).to(tl.int32)
    out_read = tl.load(row + 11)
    lay0, lay1, lay2, lay3, lay4 = _layout(bits2, stride_r, LANES, SUBK, BN)
    sub = (SUBK // 16) * (stride_r // 2)  # int32 words between SUBK-row chunks of a block
    block0 = base // 2 + nb * (step_nb // 2)
    stage0 = stage_ptr + nb * BN
    if STAGED:
        stage0 += tl.load(stage_off_ptr + m)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if LANES >= 3 and not STAGED:
        return _prefetched_sum(acc, first, last, block0, step_kb, sub, xrow, row_ok, words_ptr, lay0, lay1, lay2, cb,
                               CB, LANES, ACT, SUBK)
    sc = tl.arange(0, SUBK)
    for step in range(first, last):
        block = block0 + step * (step_kb // 2)
        for j in tl.static_range(_HAD // SUBK):
            acc = _chunk(acc, xrow, row_ok, sc + (step * _HAD + j * SUBK), words_ptr, block + j * sub, lay0, lay1,
                         lay2, lay3, lay4, cb, stage0 + (step * _HAD + j * SUBK) * out_read, out_read, STAGED, CB,
                         LANES, ACT, SUBK, BN)
    return acc


@triton.jit
def _steps(table_ptr, m):
    """128-row steps of matrix m (its in_read / 128) and its splits."""
    n = (tl.load(table_ptr + m * _NF + 10) // _HAD).to(tl.int32)
    return n, (n + _SPLIT - 1) // _SPLIT


@triton.jit
def _full_sum(table_ptr, m, nb, n_steps, n_sp, xrow, row_ok, words_ptr, stage_ptr, stage_off_ptr,
              STAGED: tl.constexpr, CB: tl.constexpr, LANES: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, SUBK: tl.constexpr):
    """The full form's sum of matrix m's block nb: each split's sum from zero, added in split order from zero."""
    total = 0.0 + _split_sum(table_ptr, m, nb, 0, tl.minimum(n_steps, _SPLIT), xrow, row_ok, words_ptr, stage_ptr,
                             stage_off_ptr, STAGED, CB, LANES, ACT, BM, BN, SUBK)
    for s in range(1, n_sp):
        total = total + _split_sum(table_ptr, m, nb, s * _SPLIT, tl.minimum(n_steps, (s + 1) * _SPLIT), xrow, row_ok,
                                   words_ptr, stage_ptr, stage_off_ptr, STAGED, CB, LANES, ACT, BM, BN, SUBK)
    return total


@triton.jit
def _one_split(table_ptr, m, nb, split, n_steps, xrow, row_ok, words_ptr, CB: tl.constexpr, LANES: tl.constexpr,
               ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SUBK: tl.constexpr):
    """The parallel form's part: split `split` of matrix m's block nb."""
    return _split_sum(table_ptr, m, nb, split * _SPLIT, tl.minimum(n_steps, (split + 1) * _SPLIT), xrow, row_ok,
                      words_ptr, words_ptr, words_ptr, False, CB, LANES, ACT, BM, BN, SUBK)


@triton.jit
def _store_part(part, ws_rows, row_ok, BN: tl.constexpr):
    tl.store(ws_rows[:, None] + tl.arange(0, BN)[None, :], part, mask=row_ok[:, None])


@triton.jit
def _arrive(cnt_ptr, n_sp):
    """True in the last of n_sp programs to arrive at the counter (each stored its part first)."""
    tl.debug_barrier()  # every thread's part stored before the count says so
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == n_sp - 1


@triton.jit
def _parts(ws_rows, split_stride, row_ok, n_sp, BN: tl.constexpr):
    """The ordered sum, from zero, of the n_sp split parts at ws_rows[:, None] + s * split_stride (read past
    L1: other programs wrote them)."""
    cols = tl.arange(0, BN)
    total = 0.0 + tl.load(ws_rows[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    for s in range(1, n_sp):
        total = total + tl.load(ws_rows[:, None] + s * split_stride + cols[None, :], mask=row_ok[:, None], other=0.0,
                                cache_modifier=".cg")
    return total


@triton.jit
def _block_sum(table_ptr, m, nb, n_steps, n_sp, xrow, row_ok, words_ptr, ws_rows, split_stride, cnt, stage_ptr,
               stage_off_ptr, PARALLEL: tl.constexpr, STAGED: tl.constexpr, CB: tl.constexpr, LANES: tl.constexpr,
               ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SUBK: tl.constexpr):
    """(done, sum) of matrix m's output block nb. Full form: every split here, done. Parallel form: this
    program's split (program_id 2) stored at ws_rows + split * split_stride; done in the last of the
    block's programs to arrive at `cnt`, which then holds the splits' ordered sum and resets the counter."""
    if PARALLEL:
        split = tl.program_id(2)
        _store_part(_one_split(table_ptr, m, nb, split, n_steps, xrow, row_ok, words_ptr, CB, LANES, ACT, BM, BN,
                               SUBK), ws_rows + split * split_stride, row_ok, BN)
        done = _arrive(cnt, n_sp)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if done:
            tl.debug_barrier()
            acc = _parts(ws_rows, split_stride, row_ok, n_sp, BN)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
    else:
        done = True
        acc = _full_sum(table_ptr, m, nb, n_steps, n_sp, xrow, row_ok, words_ptr, stage_ptr, stage_off_ptr, STAGED,
                        CB, LANES, ACT, BM, BN, SUBK)
    return done, acc


@triton.jit
def _out_block(acc, table_ptr, m, nb, scales_ptr, ACT: tl.constexpr, BN: tl.constexpr):
    """fp32 output block nb of matrix m from its sum: H(acc) * 2^-3.5 * svh."""
    row = table_ptr + m * _NF
    svh32 = tl.load(scales_ptr + tl.load(row + 8) + nb * tl.load(row + 9) + tl.arange(0, BN)).to(tl.float32)
    return _unrotate(acc, svh32, ACT)


@triton.jit
def _rotate_block(x32, suh_rows, had, ACT: tl.constexpr):
    """A(H(A(x * suh)) * 2^-3.5) for one 128-column block: x fp32 [BM, 128], suh_rows fp32 [BM, 128]."""
    return _rotate_cols((x32 * suh_rows).to(ACT), had, ACT)


# ---- input rotation ----------------------------------------------------------------------------------
@triton.jit
def _rotate_kernel(x_ptr, stride_xm, xr_ptr, table_ptr, scales_ptr, R, width, in_start, in_width,
                   ids_ptr, stride_ids, T, K, shared, token_ptr, expert_ptr, m_gate, m_up, shared_gate, shared_up,
                   ROWS: tl.constexpr, HAS_SHARED: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr):
    """Program (row tile, input block kb, projection p): xr[p, r, block kb] = the rotated input of row r
    for its matrix (suh). ROWS 0: row r is x row r, matrix m_gate (one linear; x column c - in_start of
    the matrix's input, zeros outside [0, in_width)); 1: r is slot r of token r // KP (its place r % KP:
    a routed expert from ids, or the shared one); 2: r is an expert-sorted slot (token_ptr, expert_ptr).
    For p = 0 the matrix is the expert's gate (m_gate + e, or shared_gate), for p = 1 its up."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    proj = tl.program_id(2)
    ok = rows < R
    if ROWS == 0:
        src = rows
        mat = tl.zeros((BM,), dtype=tl.int32) + m_gate
    else:
        if ROWS == 1:
            kp = K + HAS_SHARED
            src = rows // kp
            place = rows % kp
            e = tl.load(ids_ptr + src * stride_ids + place, mask=ok & (place < K), other=shared).to(tl.int32)
        else:
            src = tl.load(token_ptr + rows, mask=ok, other=0)
            e = tl.load(expert_ptr + rows, mask=ok, other=shared).to(tl.int32)
        first = tl.where(proj == 0, m_gate, m_up)
        mat = tl.where(e == shared, tl.where(proj == 0, shared_gate, shared_up), first + e)
    cols = tl.arange(0, _HAD)
    xc = kb * _HAD + cols - in_start
    x_ok = ok[:, None] & ((xc >= 0) & (xc < in_width))[None, :]
    x32 = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xm + xc[None, :], mask=x_ok, other=0.0).to(tl.float32)
    mrow = table_ptr + mat.to(tl.int64) * _NF
    suh = tl.load(mrow + 6, mask=ok, other=0) + kb * tl.load(mrow + 7, mask=ok, other=0)
    suh32 = tl.load(scales_ptr + suh[:, None] + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    xr = _rotate_block(x32, suh32, _hadamard_cols(0, _HAD, ACT), ACT)
    out = xr_ptr + (proj * R + rows).to(tl.int64)[:, None] * width + (kb * _HAD + cols)[None, :]
    tl.store(out, xr, mask=ok[:, None])


# ---- one EXL3 linear ------------------------------------------------------------------------------
@triton.jit
def _linear_kernel(xr_ptr, out_ptr, table_ptr, m, words_ptr, scales_ptr, ws_ptr, cnt_ptr, stage_ptr, stage_off_ptr, M,
                   stride_om, out_start, out_width, PARALLEL: tl.constexpr, STAGED: tl.constexpr, ACT: tl.constexpr,
                   CB: tl.constexpr, LANES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SUBK: tl.constexpr):
    """Program (row tile, output block nb[, split]): rows [tile * BM, +BM) of x @ W from their rotated
    inputs xr [M, in_read]; the matrix's output columns of block nb that fall inside
    [out_start, out_start + out_width), stored from column 0. STAGED: the matrix's values from the stage."""
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    rows = tile * BM + tl.arange(0, BM)
    row_ok = rows < M
    n_steps, n_sp = _steps(table_ptr, m)
    xrow = xr_ptr + rows.to(tl.int64) * (n_steps * _HAD)
    n_blocks = tl.num_programs(1)
    ws_rows = ws_ptr + ((tile * n_blocks + nb) * BM + tl.arange(0, BM)).to(tl.int64) * BN
    done, acc = _block_sum(table_ptr, m, nb, n_steps, n_sp, xrow, row_ok, words_ptr, ws_rows,
                           tl.num_programs(0) * n_blocks * BM * BN, cnt_ptr + tile * n_blocks + nb, stage_ptr,
                           stage_off_ptr, PARALLEL, STAGED, CB, LANES, ACT, BM, BN, SUBK)
    if done:
        _store_linear_out(acc, out_ptr, table_ptr, m, nb, scales_ptr, rows, row_ok, stride_om, out_start, out_width,
                          ACT, BN)


@triton.jit
def _store_linear_out(acc, out_ptr, table_ptr, m, nb, scales_ptr, rows, row_ok, stride_om, out_start, out_width,
                      ACT: tl.constexpr, BN: tl.constexpr):
    """Output block nb of matrix m from its sum; the columns inside [out_start, out_start + out_width)."""
    y = _out_block(acc, table_ptr, m, nb, scales_ptr, ACT, BN)
    oc = nb * _HAD + tl.arange(0, BN) - out_start
    ok = row_ok[:, None] & ((oc >= 0) & (oc < out_width))[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + oc[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _linear_finish_kernel(ws_ptr, out_ptr, table_ptr, m, scales_ptr, M, out_read, n_sp, stride_om, out_start,
                          out_width, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Program (row tile, output block nb) after the CUDA split sums of one linear (parts [split, M, out_read]):
    the splits' ordered sum, then the parallel form's output."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    nb = tl.program_id(1)
    row_ok = rows < M
    acc = _parts(ws_ptr + rows.to(tl.int64) * out_read + nb * BN, M * out_read, row_ok, n_sp, BN)
    _store_linear_out(acc, out_ptr, table_ptr, m, nb, scales_ptr, rows, row_ok, stride_om, out_start, out_width, ACT,
                      BN)


# ---- MLPs: routed experts, the shared expert, the dense MLP ------------------------------------------
@triton.jit
def _token_ids(ids_ptr, stride_ids, T, K, shared, HAS_SHARED: tl.constexpr, BM: tl.constexpr, KPB: tl.constexpr):
    """ids [BM, KPB] int32 of tokens 0..T-1: their K routed experts, then `shared` when HAS_SHARED; -1 elsewhere."""
    r = tl.arange(0, BM)[:, None]
    c = tl.arange(0, KPB)[None, :]
    ids = tl.load(ids_ptr + r * stride_ids + c, mask=(r < T) & (c < K), other=-1).to(tl.int32)
    if HAS_SHARED:
        ids = tl.where((r < T) & (c == K), shared, ids)
    return ids


@triton.jit
def _group_rows(ids_ptr, stride_ids, g, T, K, shared, tile_mat_ptr, tile_first_ptr, tile_rows_ptr,
                TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr, KPB: tl.constexpr):
    """Program g's rows: (expert, active, row_ok [BM], slot rows [BM], tokens [BM]).
    TOKENS (few tokens, decode): g is a flat slot (token g // KP, place g % KP); the program is active
    when g is its expert's first slot and then takes every token routed to that expert (one row each,
    BM >= T), whose slot rows are token * KP + place. Else g is a tile of the expert-sorted slots
    (tile_mat/first/rows), whose slot rows are first..first+rows-1 (tokens: not needed there)."""
    lanes = tl.arange(0, BM)
    if TOKENS:
        kp = K + HAS_SHARED
        ids = _token_ids(ids_ptr, stride_ids, T, K, shared, HAS_SHARED, BM, KPB)
        r = lanes[:, None]
        c = tl.arange(0, KPB)[None, :]
        e = tl.sum(tl.where((r == g // kp) & (c == g % kp), ids, 0))
        match = ids == e
        earlier = tl.sum((match & (r * kp + c < g)).to(tl.int32))
        row_ok = tl.sum(match.to(tl.int32), axis=1) > 0
        place = tl.sum(tl.where(match, c, 0), axis=1)
        return e, earlier == 0, row_ok, lanes * kp + place, lanes
    else:
        e = tl.load(tile_mat_ptr + g)
        first = tl.load(tile_first_ptr + g)
        n = tl.load(tile_rows_ptr + g)
        return e, n > 0, lanes < n, first + lanes, lanes


@triton.jit
def _staged(active, stage_off_ptr, m, STAGE: tl.constexpr):
    """Whether an active group runs in this launch: STAGE 0 always, 1 when matrix m is in the stage (its
    offset >= 0), 2 when it is not."""
    if STAGE == 0:
        return active
    elif STAGE == 1:
        return active & (tl.load(stage_off_ptr + m, mask=active, other=-1) >= 0)
    else:
        return active & (tl.load(stage_off_ptr + m, mask=active, other=0) < 0)


@triton.jit
def _gate_up_kernel(xr_ptr, xd_ptr, table_ptr, words_ptr, scales_ptr, ws_ptr, cnt_ptr, stage_ptr, stage_off_ptr,
                    ids_ptr, stride_ids, T, K, shared, tile_mat_ptr, tile_first_ptr, tile_rows_ptr,
                    gate0, up0, down0, shared_gate, shared_up, shared_down, S, hidden, width,
                    TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, PARALLEL: tl.constexpr, STAGE: tl.constexpr,
                    C_TY: tl.constexpr,
                    ACT: tl.constexpr, CB: tl.constexpr, LANES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    KPB: tl.constexpr, SUBK: tl.constexpr):
    """Program (group, width block nb[, split]): gate and up of the group's expert over its slot rows
    (rotated inputs xr [2, S, hidden]), then act = C(silu(g) * u) and down's input rotation of block nb
    -> xd [S, width] (ACT). STAGE: 0 every group; 1 only groups whose matrices are in the stage (read
    from there), 2 only the others (see _staged)."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    e, active, row_ok, slots, _ = _group_rows(ids_ptr, stride_ids, g, T, K, shared, tile_mat_ptr, tile_first_ptr,
                                              tile_rows_ptr, TOKENS, HAS_SHARED, BM, KPB)
    is_shared = e == shared
    mg = tl.where(is_shared, shared_gate, gate0 + e)
    mu = tl.where(is_shared, shared_up, up0 + e)
    md = tl.where(is_shared, shared_down, down0 + e)
    if _staged(active, stage_off_ptr, mg, STAGE):
        xg = xr_ptr + slots.to(tl.int64) * hidden
        xu = xg + S * hidden
        n_steps, n_sp = _steps(table_ptr, mg)
        if PARALLEL:
            split = tl.program_id(2)
            # workspace [split, slot row, gate | up, width]
            ws_rows = ws_ptr + slots.to(tl.int64) * (2 * width) + nb * BN
            split_stride = tl.num_programs(0) * 2 * width
            _store_part(_one_split(table_ptr, mg, nb, split, n_steps, xg, row_ok, words_ptr, CB, LANES, ACT, BM, BN,
                                   SUBK), ws_rows + split * split_stride, row_ok, BN)
            _store_part(_one_split(table_ptr, mu, nb, split, n_steps, xu, row_ok, words_ptr, CB, LANES, ACT, BM, BN,
                                   SUBK), ws_rows + split * split_stride + width, row_ok, BN)
            cnt = cnt_ptr + g * tl.num_programs(1) + nb
            done = _arrive(cnt, n_sp)
            gv = tl.zeros((BM, BN), dtype=C_TY)
            uv = tl.zeros((BM, BN), dtype=C_TY)
            if done:
                tl.debug_barrier()
                gv = _out_block(_parts(ws_rows, split_stride, row_ok, n_sp, BN), table_ptr, mg, nb, scales_ptr, ACT,
                                BN).to(C_TY)
                uv = _out_block(_parts(ws_rows + width, split_stride, row_ok, n_sp, BN), table_ptr, mu, nb, scales_ptr,
                                ACT, BN).to(C_TY)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
        else:
            done = True
            gv = _out_block(_full_sum(table_ptr, mg, nb, n_steps, n_sp, xg, row_ok, words_ptr, stage_ptr, stage_off_ptr,
                                      STAGE == 1, CB, LANES, ACT, BM, BN, SUBK), table_ptr, mg, nb, scales_ptr, ACT,
                            BN).to(C_TY)
            uv = _out_block(_full_sum(table_ptr, mu, nb, n_steps, n_sp, xu, row_ok, words_ptr, stage_ptr, stage_off_ptr,
                                      STAGE == 1, CB, LANES, ACT, BM, BN, SUBK), table_ptr, mu, nb, scales_ptr, ACT,
                            BN).to(C_TY)
        if done:
            _store_down_input(gv, uv, table_ptr, md, scales_ptr, nb, xd_ptr, slots, row_ok, width, C_TY, ACT, BN)


@triton.jit
def _store_down_input(gv, uv, table_ptr, md, scales_ptr, nb, xd_ptr, slots, row_ok, width, C_TY: tl.constexpr,
                      ACT: tl.constexpr, BN: tl.constexpr):
    """act = C(silu(g) * u) of width block nb, then down's input rotation of it -> xd [slot rows, width]."""
    g32 = gv.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32)) * uv.to(tl.float32)).to(C_TY).to(tl.float32)
    drow = table_ptr + md * _NF
    suh_d = tl.load(scales_ptr + tl.load(drow + 6) + nb * tl.load(drow + 7) + tl.arange(0, _HAD))
    xd = _rotate_block(act, suh_d.to(tl.float32)[None, :], _hadamard_cols(0, _HAD, ACT), ACT)
    cols = nb * BN + tl.arange(0, BN)
    tl.store(xd_ptr + slots.to(tl.int64)[:, None] * width + cols[None, :], xd, mask=row_ok[:, None])


@triton.jit
def _gate_up_finish_kernel(ws_ptr, xd_ptr, table_ptr, scales_ptr, ids_ptr, stride_ids, T, K, shared, gate0, up0,
                           down0, shared_gate, shared_up, shared_down, S, width, n_sp, HAS_SHARED: tl.constexpr,
                           C_TY: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           KPB: tl.constexpr):
    """Program (slot g, width block nb) after the CUDA split sums (glm53/ops/cuda_exl3.py) of gate and up:
    the parallel form's finish, as _gate_up_kernel's last program does it (the splits' ordered sum)."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    e, active, row_ok, slots, _ = _group_rows(ids_ptr, stride_ids, g, T, K, shared, ids_ptr, ids_ptr, ids_ptr, True,
                                              HAS_SHARED, BM, KPB)
    if active:
        is_shared = e == shared
        mg = tl.where(is_shared, shared_gate, gate0 + e)
        mu = tl.where(is_shared, shared_up, up0 + e)
        md = tl.where(is_shared, shared_down, down0 + e)
        ws_rows = ws_ptr + slots.to(tl.int64) * (2 * width) + nb * BN
        split_stride = S * 2 * width
        gv = _out_block(_parts(ws_rows, split_stride, row_ok, n_sp, BN), table_ptr, mg, nb, scales_ptr, ACT,
                        BN).to(C_TY)
        uv = _out_block(_parts(ws_rows + width, split_stride, row_ok, n_sp, BN), table_ptr, mu, nb, scales_ptr, ACT,
                        BN).to(C_TY)
        _store_down_input(gv, uv, table_ptr, md, scales_ptr, nb, xd_ptr, slots, row_ok, width, C_TY, ACT, BN)


@triton.jit
def _down_kernel(xd_ptr, parts_ptr, out_ptr, table_ptr, words_ptr, scales_ptr, ws_ptr, cnt_ptr, tok_cnt_ptr,
                 stage_ptr, stage_off_ptr, ids_ptr, stride_ids, weights_ptr, stride_w, T, K, shared, tile_mat_ptr,
                 tile_first_ptr, tile_rows_ptr, slot_weight_ptr, down0, shared_down, width, hidden,
                 TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, WEIGHTED: tl.constexpr, PARALLEL: tl.constexpr,
                 STAGE: tl.constexpr,
                 ACT: tl.constexpr, CB: tl.constexpr, LANES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 KPB: tl.constexpr, SUBK: tl.constexpr):
    """Program (group, output block nb[, split]): down of the group's expert over its rotated rows, each
    output C(y * w) (w: the routing weight; 1 for the shared expert, or when not WEIGHTED) -> parts
    [slot rows, hidden]. TOKENS: the last of a token's experts to finish block nb sums that token's
    parts in ascending expert order into out[token] (a counter per token and block). STAGE: as gate/up's."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    e, active, row_ok, slots, tokens = _group_rows(ids_ptr, stride_ids, g, T, K, shared, tile_mat_ptr, tile_first_ptr,
                                                   tile_rows_ptr, TOKENS, HAS_SHARED, BM, KPB)
    md = tl.where(e == shared, shared_down, down0 + e)
    if _staged(active, stage_off_ptr, md, STAGE):
        xrow = xd_ptr + slots.to(tl.int64) * width
        n_steps, n_sp = _steps(table_ptr, md)
        done, acc = _block_sum(table_ptr, md, nb, n_steps, n_sp, xrow, row_ok, words_ptr,
                               ws_ptr + slots.to(tl.int64) * hidden + nb * BN, tl.num_programs(0) * hidden,
                               cnt_ptr + g * tl.num_programs(1) + nb, stage_ptr, stage_off_ptr, PARALLEL, STAGE == 1,
                               CB, LANES, ACT, BM, BN, SUBK)
        if done:
            _store_down_output(acc, parts_ptr, out_ptr, table_ptr, md, scales_ptr, tok_cnt_ptr, ids_ptr, stride_ids,
                               weights_ptr, stride_w, slot_weight_ptr, T, K, shared, nb, hidden, row_ok, slots, tokens,
                               TOKENS, HAS_SHARED, WEIGHTED, ACT, BM, BN, KPB)


@triton.jit
def _store_down_output(acc, parts_ptr, out_ptr, table_ptr, md, scales_ptr, tok_cnt_ptr, ids_ptr, stride_ids,
                       weights_ptr, stride_w, slot_weight_ptr, T, K, shared, nb, hidden, row_ok, slots, tokens,
                       TOKENS: tl.constexpr, HAS_SHARED: tl.constexpr, WEIGHTED: tl.constexpr, ACT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, KPB: tl.constexpr):
    """Down's block nb from its sum: C(y * w) -> parts; TOKENS: each token's sum once its experts are in."""
    c_ty = out_ptr.dtype.element_ty
    y = _out_block(acc, table_ptr, md, nb, scales_ptr, ACT, BN).to(c_ty).to(tl.float32)
    if WEIGHTED:
        if TOKENS:
            place = slots - tokens * (K + HAS_SHARED)
            w = tl.load(weights_ptr + tokens * stride_w + place, mask=row_ok & (place < K), other=1.0)
        else:
            w = tl.load(slot_weight_ptr + slots, mask=row_ok, other=1.0)
        y = y * w[:, None]
    cols = nb * BN + tl.arange(0, BN)
    tl.store(parts_ptr + slots.to(tl.int64)[:, None] * hidden + cols[None, :], y.to(c_ty), mask=row_ok[:, None])
    if TOKENS:
        _combine_tokens(parts_ptr, out_ptr, tok_cnt_ptr, ids_ptr, stride_ids, T, K, shared, nb, hidden, row_ok, tokens,
                        HAS_SHARED, BM, BN, KPB)


@triton.jit
def _down_finish_kernel(ws_ptr, parts_ptr, out_ptr, table_ptr, scales_ptr, tok_cnt_ptr, ids_ptr, stride_ids,
                        weights_ptr, stride_w, T, K, shared, down0, shared_down, S, hidden, n_sp,
                        HAS_SHARED: tl.constexpr, WEIGHTED: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, KPB: tl.constexpr):
    """Program (slot g, output block nb) after the CUDA split sums of down: the parallel form's finish."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    e, active, row_ok, slots, tokens = _group_rows(ids_ptr, stride_ids, g, T, K, shared, ids_ptr, ids_ptr, ids_ptr,
                                                   True, HAS_SHARED, BM, KPB)
    if active:
        md = tl.where(e == shared, shared_down, down0 + e)
        acc = _parts(ws_ptr + slots.to(tl.int64) * hidden + nb * BN, S * hidden, row_ok, n_sp, BN)
        _store_down_output(acc, parts_ptr, out_ptr, table_ptr, md, scales_ptr, tok_cnt_ptr, ids_ptr, stride_ids,
                           weights_ptr, stride_w, ids_ptr, T, K, shared, nb, hidden, row_ok, slots, tokens, True,
                           HAS_SHARED, WEIGHTED, ACT, BM, BN, KPB)


@triton.jit
def _combine_tokens(parts_ptr, out_ptr, tok_cnt_ptr, ids_ptr, stride_ids, T, K, shared, nb, hidden, row_ok, tokens,
                    HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KPB: tl.constexpr):
    """After storing this expert's parts of block nb: for each of its tokens whose every expert has now
    stored block nb, sum the token's parts in ascending expert order from zero into out[token]."""
    kp = K + HAS_SHARED
    tl.debug_barrier()
    cnt = tok_cnt_ptr + tokens * tl.num_programs(1) + nb
    arrived = tl.atomic_add(cnt, 1, mask=row_ok, sem="acq_rel", scope="gpu")
    last = row_ok & (arrived == kp - 1)
    if tl.sum(last.to(tl.int32)) > 0:
        tl.debug_barrier()
        ids = _token_ids(ids_ptr, stride_ids, T, K, shared, HAS_SHARED, BM, KPB)
        c = tl.arange(0, KPB)
        valid = ids >= 0
        # a slot's rank among its token's experts (distinct ids): how many of them are smaller
        smaller = (ids[:, None, :] < ids[:, :, None]) & valid[:, None, :]
        rank = tl.where(valid, tl.sum(smaller.to(tl.int32), axis=2), KPB)
        cols = nb * BN + tl.arange(0, BN)
        total = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
        for q in range(0, kp):
            place = tl.sum(tl.where(rank == q, c[None, :], 0), axis=1)
            src = parts_ptr + (tokens * kp + place).to(tl.int64)[:, None] * hidden + cols[None, :]
            p = tl.load(src, mask=last[:, None], other=0.0, cache_modifier=".cg")
            total = (total.to(tl.float32) + p.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :], total, mask=last[:, None])
        tl.atomic_xchg(cnt, 0, mask=last, sem="relaxed", scope="gpu")


# ---- the stage: matrices decoded once (prefill); the decoder alone (tests) -------------------------------
@triton.jit
def _stage_kernel(words_ptr, table_ptr, mats_ptr, stage_ptr, stage_off_ptr, CB: tl.constexpr, LANES: tl.constexpr,
                  SUBK: tl.constexpr, BN: tl.constexpr):
    """Program (input block kb, output block nb, i): the 128 x 128 block (kb, nb) of matrix m = mats[i], decoded
    -> its W_hat at stage_ptr + stage_off_ptr[m] (fp16 [in_read, out_read]); blocks past m's shape idle."""
    kb = tl.program_id(0)
    nb = tl.program_id(1)
    m = tl.load(mats_ptr + tl.program_id(2))
    row = table_ptr + m * _NF
    out_read = tl.load(row + 11)
    if (kb * _HAD < tl.load(row + 10)) & (nb * _HAD < out_read):
        stride_r = tl.load(row + 1).to(tl.int32)
        bits2 = tl.load(row + 4).to(tl.int32)
        cb = tl.load(row + 5).to(tl.int32)
        lay0, lay1, lay2, lay3, lay4 = _layout(bits2, stride_r, LANES, SUBK, BN)
        block = tl.load(row + 0) // 2 + nb * (tl.load(row + 3) // 2) + kb * (tl.load(row + 2) // 2)
        r = tl.arange(0, SUBK)[:, None]
        c = nb * BN + tl.arange(0, BN)[None, :]
        out = stage_ptr + tl.load(stage_off_ptr + m)
        for j in tl.static_range(_HAD // SUBK):
            if LANES == 1:
                w = _decode_lanes(words_ptr, block + j * (SUBK // 16) * (stride_r // 2), lay0, lay1, lay2, lay3, lay4,
                                  cb, CB, SUBK, BN)
            else:
                w = _decode_elements(words_ptr, block + j * (SUBK // 16) * (stride_r // 2), lay0, lay1, lay2, cb, CB,
                                     (LANES == 2) or (LANES == 4))
            tl.store(out + (kb * _HAD + j * SUBK + r).to(tl.int64) * out_read + c, w)


def dequant(bank: Exl3Bank, m: int, form: Form | None = None) -> torch.Tensor:
    """Matrix m's W_hat, fp16 [in_read, out_read], through the kernels' own decoder (tests)."""
    lay = bank.layouts[m]
    out = torch.empty(lay.in_read, lay.out_read, dtype=torch.float16, device=bank.device)
    _stage_into(bank, [m], out, form or DECODE)
    return out


def _stage_into(bank: Exl3Bank, mats: list[int], stage: torch.Tensor, form: Form) -> torch.Tensor:
    """Decode matrices `mats` one after another into `stage` (fp16, flat); returns the offsets table the
    kernels read (int64 per matrix of the bank: its W_hat's first element in the stage, -1 if absent)."""
    key = ("stage", tuple(mats))
    if key not in bank.derived:
        offsets, at = [], 0
        for m in mats:
            offsets.append(at)
            at += bank.layouts[m].in_read * bank.layouts[m].out_read
        table = torch.full((len(bank.layouts),), -1, dtype=torch.int64)
        table[mats] = torch.tensor(offsets, dtype=torch.int64)
        bank.derived[key] = (table.to(bank.device), torch.tensor(mats, dtype=torch.int32).to(bank.device), at)
    table, mats_dev, needed = bank.derived[key]
    if needed > stage.numel():
        raise ValueError(f"EXL3 stage holds {stage.numel()} values, matrices {mats} need {needed}: size it with "
                         "SCRATCH.get('stage', ...) or reserve() from mlp_scratch / linear_scratch first")
    blocks = max(bank.layouts[m].in_read for m in mats) // HAD, max(bank.layouts[m].out_read for m in mats) // HAD
    _stage_kernel[(*blocks, len(mats))](
        bank.words.view(torch.int32), bank.table, mats_dev, stage, table, CB=_codebook_arg(bank), LANES=form.decoder,
        SUBK=form.subk, BN=HAD, num_warps=4, **OPTIONS)
    return table


def _unstaged_table(bank: Exl3Bank, staged: list[int]) -> torch.Tensor:
    """The table of a launch that runs the matrices not in `staged` (>= 0 marks the staged ones)."""
    key = ("unstaged", tuple(staged))
    if key not in bank.derived:
        table = torch.full((len(bank.layouts),), -1, dtype=torch.int64)
        table[staged] = 0
        bank.derived[key] = (table.to(bank.device),)
    return bank.derived[key][0]


# ---- launches ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Form:
    """How a product is tiled: BM rows a program, warps, pipeline stages, lane or element decode, SUBK
    trellis rows decoded for one dot (32, 64 or 128: the same k16 steps in the same order), whether
    the splits run as programs of their own (the parallel form; rows <= BM) or in one program (full),
    and from how many rows of one matrix (stage_rows; 0 never) the full form decodes that matrix once
    into the stage and its row tiles read it from there instead of each decoding it (the same values
    into the same dots: the same bits), tiled as `staged` (None: as this form)."""

    bm: int
    warps: int
    stages: int
    lanes: bool
    subk: int = 32
    parallel: bool = False
    ptx: bool = False  # the element form's windows and codebook in PTX (the lane form's always are)
    stage_rows: int = 0
    staged: Form | None = None
    prefetch: bool = False  # the element form loads the next chunk's words before decoding this one
    cuda: bool = False  # the parallel form's split sums by the CUDA kernel (glm53/ops/cuda_exl3.py)

    def __post_init__(self) -> None:
        if self.prefetch and self.lanes:
            raise ValueError("prefetch is a form of the element decoder (lanes=False)")
        if self.cuda and not (self.parallel and self.bm == 16):
            raise ValueError("the CUDA split sums are the parallel form's, 16 rows a program")

    @property
    def stage_tiling(self) -> Form:
        return self.staged or self

    @property
    def decoder(self) -> int:
        """The kernels' LANES constant: 1 the lane form; the element form 0 in Triton's ops, 2 in PTX, and
        3 / 4 the same with the next chunk's words prefetched."""
        if self.lanes:
            return 1
        if self.prefetch:
            return 4 if self.ptx else 3
        return 2 if self.ptx else 0


DECODE_ROWS = 16  # up to this many rows (tokens): the parallel form (decode steps, verification windows)
# the fastest tilings measured on the H200 by bench/bench_exl3_moe.py (the element decode 567 us against
# the lane decode's 851 us for one token's experts; 4 warps 35 ms against 8 warps' 59 ms for a 2048-token
# prefill; docs/decisions/exl3-decode-form.md); every tiling gives a row the same bits
DECODE = Form(16, 4, 1, False, 32, parallel=True)
# staged tiles decode nothing: a GEMM's tiling (128 rows, 8 warps, 3 pipeline stages, 64-row chunks: 51 ms
# against 71 ms at PREFILL's own tiling for 8192 tokens through 64 experts, all staged; H100,
# bench/results/exl3_moe_stage_tilings_h100.json; docs/decisions/exl3-prefill-stage.md)
PREFILL = Form(64, 4, 1, True, 32, stage_rows=128, staged=Form(128, 8, 3, True, 64))
# the stage's bound for a prefill's experts (fp16 W_hat of as many whole experts as fit, one pass each;
# one GLM-5.3 expert is 75 MB): more passes cost launches, a larger stage costs memory
STAGE_BYTES = 512 << 20
# the decode form with its split sums in CUDA (exl3_parts.cu: each lane decodes its mma.sync fragments from
# the trellis words it loads itself): a token's 256 experts 201 us against DECODE's 566 us on the H100
# (docs/decisions/exl3-decode-form.md); the default wherever decode_form finds it gives DECODE's bits
DECODE_CUDA = dataclasses.replace(DECODE, cuda=True)
ROTATE_ROWS = 16  # rows a program of the input rotation (one tile for every form: the same bits)
_AGREE: dict[tuple, bool] = {}
_CUDA_AGREE: dict[tuple, bool] = {}


def _act(dtype: torch.dtype):
    return tl.float32 if dtype == torch.float32 else tl.float16


def _torch_act(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.float16


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _codebook_arg(bank: Exl3Bank) -> int:
    """The codebook as a compile-time constant when the bank has one, else -1 (chosen per matrix)."""
    books = bank.codebooks
    return next(iter(books)) if len(books) == 1 else -1


class _Scratch:
    """Per-device buffers the parallel form needs: fp32 split parts and zeroed arrival counters (each
    launch leaves its counters at zero, so one set serves every layer and every graph replay)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"EXL3 scratch '{name}' needs {numel} elements inside a CUDA graph capture; "
                                   "reserve it before capturing (triton_exl3.reserve)")
            buf = torch.zeros(max(numel, 1), dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


SCRATCH = _Scratch()
SCRATCH_DTYPES = {"parts": torch.float32, "parts_down": torch.float32, "count": torch.int32,
                  "count_tokens": torch.int32, "stage": torch.float16}


def linear_scratch(in_read: int, out_read: int, rows: int) -> dict[str, int]:
    """Elements of each scratch buffer one linear needs: the parallel form's for `rows` rows (0: none),
    and the stage for a prefill."""
    tiles = triton.cdiv(rows, DECODE.bm)
    n_blocks = out_read // HAD
    return {"parts": n_splits(in_read) * tiles * n_blocks * DECODE.bm * HAD, "count": tiles * n_blocks,
            "stage": in_read * out_read if PREFILL.stage_rows else 0}


def mlp_scratch(mats: MlpMatrices, tokens: int, slots_per_token: int) -> dict[str, int]:
    """Elements of each scratch buffer an MLP needs: the parallel form's for `tokens` tokens, and the
    stage of a prefill's largest pass (stage_passes)."""
    s = tokens * slots_per_token
    nb_w, nb_h = mats.width // HAD, mats.hidden // HAD
    expert = 3 * mats.hidden * mats.width
    per_pass = min(STAGE_BYTES // (2 * expert), mats.n_experts + int(mats.shared is not None))
    return {"parts": n_splits(mats.hidden) * s * 2 * mats.width, "parts_down": n_splits(mats.width) * s * mats.hidden,
            "count": s * max(nb_w, nb_h), "count_tokens": tokens * nb_h,
            "stage": per_pass * expert if PREFILL.stage_rows else 0}


def reserve(needs: list[dict[str, int]], device: torch.device) -> int:
    """Allocate the scratch every listed need fits, before any CUDA graph is captured (a graph keeps the
    buffers it was captured with: they must never be replaced after), and the prefill stage, so that the
    load reports every byte the kernels take; returns the scratch bytes."""
    for name, dtype in SCRATCH_DTYPES.items():
        SCRATCH.get(name, max((n.get(name, 0) for n in needs), default=0), dtype, device)
    return SCRATCH.nbytes


def _check_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be [rows, features], got {tuple(x.shape)}")
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} not supported (bf16, fp16, fp32)")
    return x if x.stride(1) == 1 else x.contiguous()


def _parallel(rows: int, form: Form | None) -> bool:
    if form is None:
        return rows <= DECODE_ROWS
    if form.parallel and rows > form.bm:
        raise ValueError(f"the parallel form takes at most BM = {form.bm} rows, got {rows}")
    return form.parallel


def _tiling(form: Form) -> dict:
    return dict(LANES=form.decoder, BM=form.bm, BN=HAD, SUBK=form.subk, num_warps=form.warps, num_stages=form.stages)


def linear(x: torch.Tensor, bank: Exl3Bank, m: int, in_start: int = 0, out_start: int = 0,
           out_features: int | None = None, form: Form | None = None) -> torch.Tensor:
    """x [M, n] (input columns [in_start, in_start + n) of matrix m, zeros elsewhere) -> [M, out_features]
    in x's dtype: the matrix's output columns [out_start, out_start + out_features). `form` overrides the
    tiling (tests, benchmarks); by default the parallel form for M <= DECODE_ROWS, else the full form."""
    x = _check_rows(x, "exl3 linear")
    lay = bank.layouts[m]
    n_out = lay.out_read - out_start if out_features is None else out_features
    rows = x.shape[0]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return out
    parallel = _parallel(rows, form)
    form = form or (decode_form(bank, x.dtype, m=m) if parallel else prefill_form(bank, x.dtype))
    xr = torch.empty(rows, lay.in_read, dtype=_torch_act(x.dtype), device=x.device)
    _rotate_kernel[(triton.cdiv(rows, ROTATE_ROWS), lay.in_read // HAD, 1)](
        x, x.stride(0), xr, bank.table, bank.scales, rows, lay.in_read, in_start, x.shape[1], x, 0, 0, 0, 0, x, x,
        m, m, m, m, ROWS=0, HAS_SHARED=False, ACT=_act(x.dtype), BM=ROTATE_ROWS, num_warps=4, **OPTIONS)
    n_blocks = lay.out_read // HAD
    splits = n_splits(lay.in_read) if parallel else 1
    need = linear_scratch(lay.in_read, lay.out_read, rows if parallel else 0)
    ws = SCRATCH.get("parts", need["parts"], torch.float32, x.device)
    cnt = SCRATCH.get("count", need["count"], torch.int32, x.device)
    if parallel and form.cuda:
        cuda_exl3.split_parts(bank, xr, ws, groups=triton.cdiv(rows, form.bm), n_blocks=n_blocks, n_splits=splits,
                              mats=(m,), in_width=lay.in_read, out_stride=lay.out_read, rows=rows)
        _linear_finish_kernel[(triton.cdiv(rows, form.bm), n_blocks)](
            ws, out, bank.table, m, bank.scales, rows, lay.out_read, splits, out.stride(0), out_start, n_out,
            ACT=_act(x.dtype), BM=form.bm, BN=HAD, num_warps=form.warps, **OPTIONS)
        return out
    staged = not parallel and 0 < form.stage_rows <= rows
    stage, stage_off, tiling = ws, cnt, form
    if staged:
        stage = SCRATCH.get("stage", lay.in_read * lay.out_read, torch.float16, x.device)
        stage_off, tiling = _stage_into(bank, [m], stage, form), form.stage_tiling
    _linear_kernel[(triton.cdiv(rows, tiling.bm), n_blocks, splits)](
        xr, out, bank.table, m, bank.words.view(torch.int32), bank.scales, ws, cnt, stage, stage_off, rows,
        out.stride(0), out_start, n_out, PARALLEL=parallel, STAGED=staged, ACT=_act(x.dtype), CB=_codebook_arg(bank),
        **_tiling(tiling), **OPTIONS)
    return out


def mlp(x: torch.Tensor, bank: Exl3Bank, mats: MlpMatrices, ids: torch.Tensor, weights: torch.Tensor | None,
        form: Form | None = None, stage_bytes: int | None = None) -> torch.Tensor:
    """Routed experts (ids [T, K] into 0..n_experts-1, each token's distinct; weights fp32 [T, K]) plus
    the shared expert, or the dense MLP (K = 0, mats.shared its matrices): [T, hidden] in x's dtype,
    exl3_torch.experts' arithmetic. T <= DECODE_ROWS: three launches (input rotation, gate/up, down with
    each token's sum), no host sync, graph-capturable. More: the slots sorted by expert, form.bm-row tiles."""
    x = _check_rows(x, "exl3 mlp")
    t, k = ids.shape
    has_shared = mats.shared is not None
    kp = k + int(has_shared)
    out = torch.empty(t, mats.hidden, dtype=x.dtype, device=x.device)
    if t == 0 or kp == 0:
        return out.zero_()
    shared = mats.shared or (0, 0, 0)
    parallel = _parallel(t, form)
    form = form or (decode_form(bank, x.dtype, mats=mats) if parallel else prefill_form(bank, x.dtype))
    s = t * kp
    act = _torch_act(x.dtype)
    common = dict(ACT=_act(x.dtype), CB=_codebook_arg(bank), KPB=triton.next_power_of_2(kp), HAS_SHARED=has_shared)
    xr = torch.empty(2, s, mats.hidden, dtype=act, device=x.device)
    xd = torch.empty(s, mats.width, dtype=act, device=x.device)
    parts = torch.empty(s, mats.hidden, dtype=x.dtype, device=x.device)
    ids = ids if ids.numel() else torch.zeros(t, 1, dtype=torch.int64, device=x.device)
    wts = weights if weights is not None else torch.ones(1, 1, dtype=torch.float32, device=x.device)
    nb_w, nb_h = mats.width // HAD, mats.hidden // HAD
    words = bank.words.view(torch.int32)
    mat_args = dict(gate0=mats.gate0, up0=mats.up0, down0=mats.down0, shared_gate=shared[0], shared_up=shared[1],
                    shared_down=shared[2])
    if parallel:
        dummy = torch.zeros(1, dtype=torch.int32, device=x.device)
        sp_gu, sp_d = n_splits(mats.hidden), n_splits(mats.width)
        need = mlp_scratch(mats, t, kp)
        ws_gu = SCRATCH.get("parts", need["parts"], torch.float32, x.device)
        ws_d = SCRATCH.get("parts_down", need["parts_down"], torch.float32, x.device)
        cnt = SCRATCH.get("count", need["count"], torch.int32, x.device)
        tok_cnt = SCRATCH.get("count_tokens", need["count_tokens"], torch.int32, x.device)
        _rotate_kernel[(triton.cdiv(s, ROTATE_ROWS), nb_h, 2)](
            x, x.stride(0), xr, bank.table, bank.scales, s, mats.hidden, 0, mats.hidden, ids, ids.stride(0), t, k,
            mats.n_experts, dummy, dummy, mats.gate0, mats.up0, shared[0], shared[1], ROWS=1, HAS_SHARED=has_shared,
            ACT=_act(x.dtype), BM=ROTATE_ROWS, num_warps=4, **OPTIONS)
        tiles = dict(tile_mat_ptr=dummy, tile_first_ptr=dummy, tile_rows_ptr=dummy)
        if form.cuda:
            _mlp_cuda_parts(x, xr, xd, parts, out, ws_gu, ws_d, tok_cnt, bank, mats, ids, k, wts,
                            weights is not None, form, common)
            return out
        _gate_up_kernel[(s, nb_w, sp_gu)](
            xr, xd, bank.table, words, bank.scales, ws_gu, cnt, dummy, dummy, ids, ids.stride(0), t, k, mats.n_experts,
            **tiles, **mat_args, S=s, hidden=mats.hidden, width=mats.width, TOKENS=True, PARALLEL=True, STAGE=0,
            C_TY=_TL_DTYPES[x.dtype], **common, **_tiling(form), **OPTIONS)
        _down_kernel[(s, nb_h, sp_d)](
            xd, parts, out, bank.table, words, bank.scales, ws_d, cnt, tok_cnt, dummy, dummy, ids, ids.stride(0), wts,
            wts.stride(0), t, k, mats.n_experts, **tiles, slot_weight_ptr=dummy, down0=mats.down0,
            shared_down=shared[2], width=mats.width, hidden=mats.hidden, TOKENS=True, WEIGHTED=weights is not None,
            PARALLEL=True, STAGE=0, **common, **_tiling(form), **OPTIONS)
        return out
    # many tokens: the slots sorted by expert (the shared expert as id n_experts, last), tiles of bm rows
    cols = [ids[:, :k]] if k else []
    if has_shared:
        cols.append(torch.full((t, 1), mats.n_experts, dtype=torch.int64, device=x.device))
    all_ids = torch.cat(cols, dim=1)
    order = torch.argsort(all_ids.reshape(-1), stable=True)
    token = (order // kp).to(torch.int32)
    expert = all_ids.reshape(-1)[order].to(torch.int32)
    counts = expert_counts(all_ids, mats.n_experts + int(has_shared))  # no host read: graph-capturable
    from glm53.ops.triton_linear import _tile_table

    slot_w = wts
    if weights is not None:
        w_cols = [weights[:, :k].to(torch.float32)] + ([torch.ones(t, 1, device=x.device)] if has_shared else [])
        slot_w = torch.cat(w_cols, dim=1).reshape(-1)[order].contiguous()
    _rotate_kernel[(triton.cdiv(s, ROTATE_ROWS), nb_h, 2)](
        x, x.stride(0), xr, bank.table, bank.scales, s, mats.hidden, 0, mats.hidden, ids, ids.stride(0), t, k,
        mats.n_experts, token, expert, mats.gate0, mats.up0, shared[0], shared[1], ROWS=2, HAS_SHARED=has_shared,
        ACT=_act(x.dtype), BM=ROTATE_ROWS, num_warps=4, **OPTIONS)

    def launch(stage: torch.Tensor, stage_off: torch.Tensor, mode: int) -> None:
        tiling = form.stage_tiling if mode == 1 else form
        tile_mat, tile_first, tile_rows = _tile_table(counts, tiling.bm, triton.cdiv(s, tiling.bm) + counts.shape[0])
        n_tiles = tile_mat.shape[0]
        tiles = dict(tile_mat_ptr=tile_mat, tile_first_ptr=tile_first, tile_rows_ptr=tile_rows)
        _gate_up_kernel[(n_tiles, nb_w, 1)](
            xr, xd, bank.table, words, bank.scales, x, x, stage, stage_off, ids, ids.stride(0), t, k, mats.n_experts,
            **tiles, **mat_args, S=s, hidden=mats.hidden, width=mats.width, TOKENS=False, PARALLEL=False,
            STAGE=mode, C_TY=_TL_DTYPES[x.dtype], **common, **_tiling(tiling), **OPTIONS)
        _down_kernel[(n_tiles, nb_h, 1)](
            xd, parts, out, bank.table, words, bank.scales, x, x, x, stage, stage_off, ids, ids.stride(0), wts,
            wts.stride(0), t, k, mats.n_experts, **tiles, slot_weight_ptr=slot_w, down0=mats.down0,
            shared_down=shared[2], width=mats.width, hidden=mats.hidden, TOKENS=False, WEIGHTED=weights is not None,
            PARALLEL=False, STAGE=mode, **common, **_tiling(tiling), **OPTIONS)

    passes = stage_passes(bank, mats, t, k, form.stage_rows, STAGE_BYTES if stage_bytes is None else stage_bytes)
    if not passes:
        launch(x, x, 0)
    else:
        stage = SCRATCH.get("stage", max(sum(_values(bank, m) for m in p) for p in passes), torch.float16, x.device)
        for p in passes:  # each pass: its experts decoded into the stage, then their tiles from there
            launch(stage, _stage_into(bank, p, stage, form), 1)
        every = [m for p in passes for m in p]
        if len(every) < 3 * (mats.n_experts * int(k > 0) + int(has_shared)):  # the tiles of experts never staged
            launch(stage, _unstaged_table(bank, every), 2)
    # each token's parts in ascending expert order (a stable sort keeps a token's slots in that order)
    rank = all_ids.argsort(dim=1, stable=True).argsort(dim=1)
    place = order // kp * kp + rank.reshape(-1)[order]
    ordered = torch.empty_like(parts).index_copy_(0, place, parts).view(t, kp, mats.hidden)
    total = torch.zeros_like(out)
    for j in range(kp):
        total = total + ordered[:, j]
    return total


def _mlp_cuda_parts(x: torch.Tensor, xr: torch.Tensor, xd: torch.Tensor, parts: torch.Tensor, out: torch.Tensor,
                    ws_gu: torch.Tensor, ws_d: torch.Tensor, tok_cnt: torch.Tensor, bank: Exl3Bank, mats: MlpMatrices,
                    ids: torch.Tensor, k: int, wts: torch.Tensor, weighted: bool, form: Form, common: dict) -> None:
    """mlp's parallel form after the input rotation, its split sums on CUDA: gate and up's splits (one launch),
    their finish (Triton: the splits' ordered sum, SiLU, down's input rotation), down's splits, its finish
    (each token's weighted sum). The same arithmetic in the same order as _gate_up_kernel / _down_kernel.
    k: routed experts a token (ids holds one column of zeros for a dense MLP, k = 0)."""
    t = ids.shape[0]
    has_shared = mats.shared is not None
    shared = mats.shared or (0, 0, 0)
    s = t * (k + int(has_shared))
    nb_w, nb_h = mats.width // HAD, mats.hidden // HAD
    sp_gu, sp_d = n_splits(mats.hidden), n_splits(mats.width)
    ids64 = ids.to(torch.int64).contiguous()  # the router's ids as they are (int64 rows): no copy
    consts = {name: common[name] for name in ("ACT", "KPB", "HAS_SHARED")}
    rows = dict(ids=ids64, tokens=t, routed=k, shared_id=mats.n_experts, has_shared=has_shared)
    cuda_exl3.split_parts(bank, xr, ws_gu, groups=s, n_blocks=nb_w, n_splits=sp_gu, **rows,
                          mats=(mats.gate0, mats.up0), shared_mats=(shared[0], shared[1]), in_width=mats.hidden,
                          xr_proj=s * mats.hidden, out_stride=2 * mats.width, proj_cols=mats.width)
    _gate_up_finish_kernel[(s, nb_w)](
        ws_gu, xd, bank.table, bank.scales, ids, ids.stride(0), t, k, mats.n_experts, mats.gate0, mats.up0, mats.down0,
        shared[0], shared[1], shared[2], s, mats.width, sp_gu, C_TY=_TL_DTYPES[x.dtype], BM=form.bm, BN=HAD,
        num_warps=form.warps, **consts, **OPTIONS)
    cuda_exl3.split_parts(bank, xd, ws_d, groups=s, n_blocks=nb_h, n_splits=sp_d, **rows, mats=(mats.down0,),
                          shared_mats=(shared[2],), in_width=mats.width, xr_proj=0, out_stride=mats.hidden, proj_cols=0)
    _down_finish_kernel[(s, nb_h)](
        ws_d, parts, out, bank.table, bank.scales, tok_cnt, ids, ids.stride(0), wts, wts.stride(0), t, k,
        mats.n_experts, mats.down0, shared[2], s, mats.hidden, sp_d, WEIGHTED=weighted, BM=form.bm, BN=HAD,
        num_warps=form.warps, **consts, **OPTIONS)


def _values(bank: Exl3Bank, m: int) -> int:
    return bank.layouts[m].in_read * bank.layouts[m].out_read


def stage_passes(bank: Exl3Bank, mats: MlpMatrices, tokens: int, k: int, stage_rows: int,
                 stage_bytes: int) -> list[list[int]]:
    """The matrices a prefill of `tokens` tokens decodes once, grouped in passes of whole experts that fit
    `stage_bytes` (fp16): the shared expert (every token's) from stage_rows tokens on; the routed experts
    when a routed expert's expected rows (tokens * k / n_experts: the host has no counts without a sync)
    reach stage_rows. An expert larger than the stage is not staged."""
    if stage_rows <= 0:
        return []
    experts = []
    if mats.shared is not None and tokens >= stage_rows:
        experts.append(list(mats.shared))
    if k and tokens * k >= stage_rows * mats.n_experts:
        experts += [[mats.gate0 + e, mats.up0 + e, mats.down0 + e] for e in range(mats.n_experts)]
    passes: list[list[int]] = []
    used = stage_bytes
    for group in experts:
        size = 2 * sum(_values(bank, m) for m in group)
        if size > stage_bytes:
            continue
        if used + size > stage_bytes:
            passes.append([])
            used = 0
        passes[-1] += group
        used += size
    return passes


def prefill_form(bank: Exl3Bank, dtype: torch.dtype) -> Form:
    """PREFILL where this device gives a row the decode form's bits under its tilings, else its tilings
    at the decode tile's rows."""
    if forms_agree(bank, dtype):
        return PREFILL
    return dataclasses.replace(PREFILL, bm=DECODE.bm, staged=dataclasses.replace(PREFILL.stage_tiling, bm=DECODE.bm))


def forms_agree(bank: Exl3Bank, dtype: torch.dtype) -> bool:
    """Whether the full form at PREFILL's tilings (unstaged and staged) gives rows the parallel form's bits
    on this device, for matrix 0 of this bank's shape: checked once per (shape, dtype, codebook set, device)
    on random rows; inside a graph capture an unchecked key answers False (the decode tile is exact)."""
    lay = bank.layouts[0]
    key = (lay.in_read, lay.out_read, dtype, bank.codebooks, bank.device, PREFILL, DECODE)
    found = _AGREE.get(key)
    if found is not None:
        return found
    if bank.device.type != "cuda":
        return True  # the interpreter (tests): the forms' agreement is what the tests assert
    if torch.cuda.is_current_stream_capturing():
        return False
    g = torch.Generator(device=bank.device).manual_seed(20261205)
    bm = max(PREFILL.bm, PREFILL.stage_tiling.bm)
    x = torch.randn(2 * bm + 3, lay.in_read, generator=g, device=bank.device).to(dtype)
    full = linear(x, bank, 0, form=dataclasses.replace(PREFILL, stage_rows=0))
    staged = linear(x, bank, 0, form=dataclasses.replace(PREFILL, stage_rows=1))
    same = torch.equal(staged, full) and all(torch.equal(linear(x[a:a + n], bank, 0, form=DECODE), full[a:a + n])
                                             for a, n in ((0, 1), (5, 16), (bm + 1, 7)))
    _AGREE[key] = same
    if not same:
        print(f"glm53: EXL3 full form at {PREFILL.bm} / {PREFILL.stage_tiling.bm} rows differs from the decode "
              f"form's bits on {torch.cuda.get_device_name(bank.device)}; every row count runs the decode tile "
              "(exact, slower)",
              file=sys.stderr)
    return same


def decode_form(bank: Exl3Bank, dtype: torch.dtype, m: int = 0, mats: MlpMatrices | None = None) -> Form:
    """DECODE_CUDA where its split sums run on this device and give matrix m's (or the MLP's) rows DECODE's
    bits, else DECODE."""
    return DECODE_CUDA if cuda_agrees(bank, dtype, m, mats) else DECODE


def cuda_agrees(bank: Exl3Bank, dtype: torch.dtype, m: int = 0, mats: MlpMatrices | None = None) -> bool:
    """Whether DECODE_CUDA gives rows DECODE's bits for this shape: checked once per (shape, dtype, codebook,
    device) on random rows (an MLP: 3 tokens on random experts, weighted). False without asking where it
    cannot run (fp32 models, a bank of mixed codebooks, no nvcc: the reason printed once) and, for an
    unchecked shape, inside a graph capture (DECODE is exact)."""
    if bank.device.type != "cuda" or dtype == torch.float32 or len(bank.codebooks) != 1:
        return False
    lay = bank.layouts[m]
    shape = (mats.hidden, mats.width, mats.n_experts, mats.shared is not None) if mats else (lay.in_read, lay.out_read)
    key = (shape, dtype, bank.codebooks, bank.device)
    found = _CUDA_AGREE.get(key)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        return False
    why = cuda_exl3.unavailable(bank.device)
    if why is not None:
        same = False
        if not any(k[3] == bank.device for k in _CUDA_AGREE):  # said once a device
            print(f"glm53: EXL3 decode form in Triton (the CUDA split sums cannot run: {why})", file=sys.stderr)
    else:
        g = torch.Generator(device=bank.device).manual_seed(20261205)
        if mats is None:
            x = torch.randn(5, lay.in_read, generator=g, device=bank.device).to(dtype)
            same = torch.equal(linear(x, bank, m, form=DECODE_CUDA), linear(x, bank, m, form=DECODE))
        else:
            k = min(mats.n_experts, 8)
            x = torch.randn(3, mats.hidden, generator=g, device=bank.device).to(dtype)
            ids = torch.stack([torch.randperm(mats.n_experts, generator=g, device=bank.device)[:k] for _ in range(3)]) \
                if k else torch.zeros(3, 0, dtype=torch.int64, device=bank.device)
            w = torch.rand(3, k, generator=g, device=bank.device) if k else None
            same = torch.equal(mlp(x, bank, mats, ids, w, form=DECODE_CUDA), mlp(x, bank, mats, ids, w, form=DECODE))
        if not same:
            print(f"glm53: EXL3 CUDA split sums differ from the Triton decode form's bits for {shape} on "
                  f"{torch.cuda.get_device_name(bank.device)}; the Triton form runs (exact, slower)", file=sys.stderr)
    _CUDA_AGREE[key] = same
    return same
