"""The indexer's top-k selection on CUDA (Triton): one program per query row, no sort, no host sync.

The rule is glm53.model.indexer.select_topk's: each row keeps the `width` largest keys (score,
-position), where width = min(k, N); ties toward the lower position, -0.0 equal to +0.0; the chosen
columns come out ascending, the non-finite ones among them invalid (after the valid ones, index 0).

A row's program finds the width-th largest score by radix select, then writes the chosen columns:
  * scores map to uint32 keys with the same order (`_keys`);
  * up to four passes over the row, one per byte of the key from the top: a histogram of that byte
    among the elements that share the bytes found so far (the others land in bin 0 and are taken
    out of it: a histogram costs by its bins) gives the next byte of the threshold key tau, and how
    many of the still-needed elements lie above it. The passes stop early once every element sharing
    the bytes found is kept (a row that keeps all its keys: one pass); after the fourth, tau is the
    width-th largest key and `need` (>= 1) is how many of the elements equal to tau the row keeps;
  * a last pass walks the row in ascending column order: an element is chosen when its key is
    above tau, or equal to tau and among the first `need` such columns (the lower positions, the
    rule's tie-break; where the row keeps every such column, a plain key >= tau); the finite
    chosen ones are written in that order through a running cumsum, so the indices come out
    ascending without a sort.
The first pass also counts NaN scores per row (the selection is undefined there: the caller raises,
or or-s it into a device flag), so the call needs nothing from the host.

What it replaces: torch.topk over k + 1 columns, a tie test (a host sync), a packed int64 top-k for
tied rows and a sort of the chosen columns, ~15 kernels and two syncs per 'full' layer's prefill
piece. H200, side by side (bench/bench_select_topk.py, bench/results/select_topk_h200_session11.json):
4.8x the torch form at 2048 rows x 2048 keys, 6.4x at 652 x 2700, 2.4x at 2048 x 16205, 1.6x at
2048 x 65536, 1.2x at 2048 x 262144. The ninth session's form (four full passes of 512-bin
histograms, the non-matching elements spread over 256 of them) was 1.3-1.7x slower; 4 or 2 bits a
pass (16 or 4 bins, more passes) were slower than 8.
Short windows (decode steps, verification: at most SMALL_WINDOW_ROWS rows) keep the packed torch
path, which spreads one row over the whole GPU where this kernel would run it on one
multiprocessor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # columns a program handles per step
# rows longer than this keep the torch form (measured up to here: the kernel 1.23x faster than
# torch.topk at 2048 x 262144 on the H200, bench/results/select_topk_h200_session11.json)
MAX_KEYS = 262144
DIGIT_BITS = 8  # bits of the threshold key found per pass: 256 bins


@triton.jit
def _keys(s):
    """fp32 scores -> uint32 keys in the scores' order (the sign flipped for positive scores, every bit
    for negative ones), -0.0 the same key as +0.0 (glm53.model.indexer.orderable_keys' order)."""
    bits = s.to(tl.uint32, bitcast=True)
    sign = tl.full([], 0x80000000, tl.uint32)
    bits = tl.where(bits == sign, 0, bits)  # -0.0 -> +0.0
    return tl.where(bits >= sign, ~bits, bits | sign)


@triton.jit
def _block(base, start, offs, N):
    """The row's columns [start, start + BLOCK): (column numbers, which lie inside the row, scores)."""
    cols = start + offs
    inside = cols < N
    return cols, inside, tl.load(base + cols, mask=inside, other=0.0)


@triton.jit
def _radix_pass(base, N, offs, bins, prefix, need, shift, COUNT_NAN: tl.constexpr, BLOCK: tl.constexpr,
                BITS: tl.constexpr):
    """The BITS bits of the threshold key at `shift`, among the elements whose bits above it equal
    prefix's. Returns (prefix with those bits set, need less the elements above them, how many elements
    share the new prefix, the row's NaN count if COUNT_NAN). Elements that do not share the prefix go to
    bin 0 and are taken out of it after the pass: a histogram's cost grows with its bins, not with
    what it counts."""
    # the bits found so far (shifted in 64 bits: the first pass shifts by 32, undefined in 32)
    high = (tl.full([], 0xFFFFFFFF, tl.uint64) << (shift + BITS).to(tl.uint64)).to(tl.uint32)
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    strangers = tl.full([], 0, tl.int32)
    nans = tl.full([], 0, tl.int32)
    for start in range(0, N, BLOCK):
        cols, inside, s = _block(base, start, offs, N)
        key = _keys(s)
        match = inside & ((key & high) == prefix)
        digit = tl.where(match, ((key >> shift.to(tl.uint32)) & ((1 << BITS) - 1)).to(tl.int32), 0)
        hist += tl.histogram(digit, 1 << BITS)
        strangers += BLOCK - tl.sum(match.to(tl.int32))
        if COUNT_NAN:
            nans += tl.sum((inside & (s != s)).to(tl.int32))
    counts = tl.where(bins == 0, hist - strangers, hist)
    at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # sharing elements in bins >= b
    found = tl.sum((at_or_above >= need).to(tl.int32)) - 1
    need -= tl.sum(tl.where(bins == found, at_or_above - counts, 0))
    sharing = tl.sum(tl.where(bins == found, counts, 0))
    return prefix | (found.to(tl.uint32) << shift.to(tl.uint32)), need, sharing, nans


@triton.jit
def _select_kernel(s_ptr, idx_ptr, valid_ptr, nan_ptr, N, WIDTH, stride_s, stride_i, stride_v,
                   BLOCK: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = s_ptr + row * stride_s
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.full([], 0, tl.uint32)  # the threshold key's bits found so far, in place
    need = tl.full([], 0, tl.int32) + WIDTH  # how many of the elements sharing prefix are still to keep
    shift = tl.full([], 32 - BITS, tl.int32)
    prefix, need, sharing, nans = _radix_pass(base, N, offs, bins, prefix, need, shift, True, BLOCK, BITS)
    tl.store(nan_ptr + row, nans)
    # until every bit is found, or every element sharing the prefix is kept (then the prefix with its
    # lower bits zero is a threshold as good as the width-th key: nothing else lies between)
    while (shift > 0) & (need < sharing):
        shift -= BITS
        prefix, need, sharing, _ = _radix_pass(base, N, offs, bins, prefix, need, shift, False, BLOCK, BITS)

    # `need` of the `sharing` elements at or above prefix that share its bits are kept, the lowest
    # columns first. Most rows keep all of them: then a plain comparison decides
    written = tl.full([], 0, tl.int32)
    if need == sharing:
        for start in range(0, N, BLOCK):
            cols, inside, s = _block(base, start, offs, N)
            kept = inside & (_keys(s) >= prefix) & (tl.abs(s) < float("inf"))  # chosen and finite
            written = _write(idx_ptr + row * stride_i, valid_ptr + row * stride_v, cols, kept, written)
    else:  # every bit found: the elements sharing prefix are ties, equal to it
        ties_seen = tl.full([], 0, tl.int32)
        for start in range(0, N, BLOCK):
            cols, inside, s = _block(base, start, offs, N)
            key = _keys(s)
            tie = (inside & (key == prefix)).to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(tie, 0) - tie  # ties at lower columns, this row so far
            ties_seen += tl.sum(tie)
            chosen = inside & ((key > prefix) | ((tie != 0) & (tie_rank < need)))
            kept = chosen & (tl.abs(s) < float("inf"))
            written = _write(idx_ptr + row * stride_i, valid_ptr + row * stride_v, cols, kept, written)


@triton.jit
def _write(idx_row, valid_row, cols, kept, written):
    """The kept columns of a block at the row's next slots, in column order; returns the slots used."""
    k = kept.to(tl.int32)
    slot = written + tl.cumsum(k, 0) - k
    tl.store(idx_row + slot, cols.to(tl.int64), mask=kept)
    tl.store(valid_row + slot, tl.full(cols.shape, 1, tl.int8), mask=kept)
    return written + tl.sum(k)


def select(scores: torch.Tensor, k: int, bits: int = DIGIT_BITS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores fp32 [T, N] on CUDA -> (indices [T, k] int64, valid [T, k] bool, NaN count [T] int32):
    each row's min(k, N) largest (score, -position) keys, ascending, the non-finite ones invalid.
    `bits` of the threshold key a pass (benches; any divisor of 32 up to 8 gives the same selection)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [T, N], got {scores.dtype} {tuple(scores.shape)}")
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"select: bits={bits}: choose 1, 2, 4 or 8 (a divisor of 32; 256 bins at most)")
    t, n = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    indices = torch.zeros(t, k, dtype=torch.int64, device=scores.device)
    valid = torch.zeros(t, k, dtype=torch.int8, device=scores.device)
    nans = torch.zeros(t, dtype=torch.int32, device=scores.device)
    if t and n and k:
        _select_kernel[(t,)](scores, indices, valid, nans, n, min(k, n), scores.stride(0), indices.stride(0),
                             valid.stride(0), BLOCK=BLOCK, BITS=bits, num_warps=4)
    return indices, valid.view(torch.bool), nans
