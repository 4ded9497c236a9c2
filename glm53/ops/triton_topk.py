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

Rows of at least 4 x sample_keys(N) keys (512 up to 65536 keys, 1024 beyond) that keep fewer than
all of them first try a bracket (`_sample_bracket`, `_bracket_pass`): the keys at `sample` evenly
spread columns, sorted, give lo and hi around the width-th key's expected rank in the sample, four
standard deviations of a sampled rank either side (plus 8). One pass over the row counts the keys
above hi and gathers the scores in [lo, hi] into a scratch row in column order (a cumsum; at most
min(N / 4, CANDIDATES_MAX) of them), and in the same scan the columns of every key >= lo into a
second list (fewer than width + that many). Where exact counts show the width-th key inside (above <
width <= above + inside) and the scratch held them all, the radix passes run over the scratch
(~10% of a row of 16k keys at k = 2048) with need = width - above, and the write pass walks the
list of keys >= lo instead of the row: every chosen key is among them, in column order, so the
same blocks' arithmetic writes the same columns (a few thousand elements where the row has 16k or
262k). Else the passes and the write run over the row, as above. Either way the same threshold and
tie count come out, except that a threshold found early (its lower bits zero) is raised to lo: keys
below lo share its high bits but are not chosen. The sample only decides how fast, never what: a
bad one (a row whose sampled columns all hold its lowest keys, a row of one value) costs one pass
and falls back.
Why this shape (measured on the H200; the figures and their JSON: docs/decisions/topk-selection.md):
a 256-bin histogram is ~80 instructions a key (Triton lowers it to 8 ballots and 8 masked popcounts
a lane), so the passes over every key are the cost, not the reads: holding the row in registers
instead of re-reading it is slower, 4 or 2 bits a pass (more passes over fewer bins) are slower than
8, and the bracket's passes over a few thousand candidates are 1.5x (16k keys) to 2.5x (262k keys)
faster than passes over the whole row. In torch the same selection is torch.topk over k + 1
columns, a tie test (a host sync), a packed int64 top-k for tied rows and a sort of the chosen
columns: ~15 kernels and two syncs per 'full' layer's prefill piece, against one launch and none.
Short windows (decode steps, verification: at most SPLIT_ROWS rows) split each row over programs
of BLOCK columns (`_select_split`): the same passes and the same arithmetic, each pass's
histograms summed by one program per row, then a count per block so that every block knows where
its chosen columns go. A row on one program would run on one multiprocessor. H200, GPU time a call
in CUDA graphs (bench/bench_select_topk.py --short): one row of 19001 keys 0.031 ms against 0.153
for the torch form (a packed int64 top-k of 8 radix passes, then a sort of the chosen columns) and
0.097 for the row kernel (docs/decisions/topk-selection.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.ops.triton_launch import OPTIONS

BLOCK = 2048  # columns a program of the split form handles
# columns the row form's program handles per step (H200, bench_select_topk --blocks: 1024 x 4 warps
# 0.539 ms at 1869 x 16205 keys against 0.703 for 2048 x 4 and 0.661 for 4096 x 8)
ROW_BLOCK = 1024
# rows longer than this keep the torch form (measured up to here: the kernel 1.23x faster than
# torch.topk at 2048 x 262144 on the H200, bench/results/select_topk_h200_digit_bits.json)
MAX_KEYS = 262144
DIGIT_BITS = 8  # bits of the threshold key found per pass: 256 bins
SPLIT_ROWS = 16  # windows of up to this many rows (decode, verification) split each row over programs
RESOLVE_BLOCKS = 16  # blocks' histograms a resolve program sums at a time
# keys a row's bracket is sampled from: 512 up to 65536 keys, 1024 beyond (H200, 2048 rows: 512 the
# fastest of 512 / 1024 / 2048 at 16205 and 65536 keys; at 262144, 1024 and 2048 alike, 512 slower)
SAMPLE_KEYS = ((65536, 512), (1 << 62, 1024))
MARGIN = tl.constexpr(4.0)  # the bracket's half-width in standard deviations of the sampled rank
CANDIDATES_MAX = 16384  # scores a bracket may hold (a row's scratch: min(N / 4, this))


@triton.jit
def _keys(s):
    """fp32 scores -> uint32 keys in the scores' order (the sign flipped for positive scores, every bit
    for negative ones), -0.0 the same key as +0.0 (glm53.model.indexer.orderable_keys' order)."""
    bits = s.to(tl.uint32, bitcast=True)
    sign = tl.full([], 0x80000000, tl.uint32)
    bits = tl.where(bits == sign, 0, bits)  # -0.0 -> +0.0
    return tl.where(bits >= sign, ~bits, bits | sign)


@triton.jit
def _finite(key):
    """Whether a key is a finite score's: +-inf map to 0xFF800000 and 0x007FFFFF, NaNs beyond them."""
    return (key > 0x007FFFFF) & (key < 0xFF800000)


@triton.jit
def _block(base, start, offs, N):
    """The row's columns [start, start + BLOCK): (column numbers, which lie inside the row, scores)."""
    cols = start + offs
    inside = cols < N
    return cols, inside, tl.load(base + cols, mask=inside, other=0.0)


@triton.jit
def _radix_pass(base, N, offs, bins, prefix, need, sharing, shift, COUNT_NAN: tl.constexpr, BLOCK: tl.constexpr,
                BITS: tl.constexpr):
    """The BITS bits of the threshold key at `shift`, among the `sharing` elements whose bits above it
    equal prefix's (all N in the first pass). Returns (prefix with those bits set, need less the
    elements above them, how many elements share the new prefix, the row's NaN count if COUNT_NAN)."""
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    nans = tl.full([], 0, tl.int32)
    for start in range(0, N, BLOCK):
        cols, inside, s = _block(base, start, offs, N)
        hist += _key_hist(_keys(s), inside, prefix, shift, BITS)
        if COUNT_NAN:
            nans += tl.sum((inside & (s != s)).to(tl.int32))
    prefix, need, sharing = _resolve(_sharing_only(hist, bins, tl.cdiv(N, BLOCK) * BLOCK, sharing), bins, prefix,
                                     need, shift)
    return prefix, need, sharing, nans


@triton.jit
def _sharing_only(hist, bins, lanes, sharing):
    """A pass's summed _key_hist over `lanes` lanes, less the lanes that landed in bin 0 without sharing
    the prefix: all but the `sharing` elements (known from the previous pass; N in the first)."""
    return tl.where(bins == 0, hist - (lanes - sharing), hist)


@triton.jit
def _key_hist(key, inside, prefix, shift, BITS: tl.constexpr):
    """The histogram of the BITS bits at `shift` among the keys whose higher bits equal prefix's, the
    others (and the lanes past the row's end) in bin 0 (a histogram's cost grows with its bins, not
    with what it counts): the caller takes them out."""
    # the bits found so far (shifted in 64 bits: the first pass shifts by 32, undefined in 32)
    high = (tl.full([], 0xFFFFFFFF, tl.uint64) << (shift + BITS).to(tl.uint64)).to(tl.uint32)
    match = inside & ((key & high) == prefix)
    return tl.histogram(tl.where(match, ((key >> shift.to(tl.uint32)) & ((1 << BITS) - 1)).to(tl.int32), 0),
                        1 << BITS)


@triton.jit
def _resolve(counts, bins, prefix, need, shift):
    """From a pass's histogram of the elements sharing prefix: (prefix with the bits at `shift` set, need
    less the elements above them, how many elements share the new prefix)."""
    at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # sharing elements in bins >= b
    found = tl.sum((at_or_above >= need).to(tl.int32)) - 1
    need -= tl.sum(tl.where(bins == found, at_or_above - counts, 0))
    sharing = tl.sum(tl.where(bins == found, counts, 0))
    return prefix | (found.to(tl.uint32) << shift.to(tl.uint32)), need, sharing


@triton.jit
def _threshold(base, N, offs, bins, need, COUNT_NAN: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Radix passes over the N scores at base: (the threshold key, need less the keys above it, how
    many keys share it, the NaN count if COUNT_NAN). Passes run until every bit is found, or until
    every key sharing the prefix is kept (then the prefix with its lower bits zero is a threshold as
    good as the need-th key: nothing else lies between)."""
    prefix = tl.full([], 0, tl.uint32)  # the threshold key's bits found so far, in place
    shift = tl.full([], 32 - BITS, tl.int32)
    prefix, need, sharing, nans = _radix_pass(base, N, offs, bins, prefix, need, N, shift, COUNT_NAN, BLOCK, BITS)
    while (shift > 0) & (need < sharing):
        shift -= BITS
        prefix, need, sharing, _ = _radix_pass(base, N, offs, bins, prefix, need, sharing, shift, False, BLOCK, BITS)
    return prefix, need, sharing, nans


@triton.jit
def _sample_bracket(base, N, WIDTH, SAMPLE: tl.constexpr):
    """(lo, hi) keys that likely bracket the row's WIDTH-th largest key: order statistics of SAMPLE
    keys spread over the row, MARGIN standard deviations of a sampled rank either side of the
    expected one (binomial: sqrt(SAMPLE p (1 - p)), p = WIDTH / N). Only a hint: the caller counts."""
    i = tl.arange(0, SAMPLE)
    key = _keys(tl.load(base + (i.to(tl.int64) * N) // SAMPLE))
    ordered = tl.sort((key ^ 0x80000000).to(tl.int32, bitcast=True), descending=True)  # signed = key order
    width = tl.full([], 0, tl.int64) + WIDTH  # tensors whatever the launcher made of the ints
    p = width.to(tl.float32) / (tl.full([], 0, tl.float32) + N)
    rank = (width * SAMPLE // N).to(tl.int32)
    margin = (tl.sqrt(SAMPLE * p * (1.0 - p)) * MARGIN).to(tl.int32) + 8
    hi_rank = tl.maximum(rank - margin, 0)
    lo_rank = tl.minimum(rank + margin, SAMPLE - 1)
    hi = tl.sum(tl.where(i == hi_rank, ordered, 0)).to(tl.uint32, bitcast=True) ^ 0x80000000
    lo = tl.sum(tl.where(i == lo_rank, ordered, 0)).to(tl.uint32, bitcast=True) ^ 0x80000000
    return lo, hi


@triton.jit
def _bracket_pass(base, N, offs, lo, hi, cand_row, CAP, kept_row, KEPT_CAP, BLOCK: tl.constexpr):
    """One pass over the row: (keys above hi, keys in [lo, hi], NaN scores); the scores in [lo, hi]
    go to cand_row and the columns of every key >= lo to kept_row, both in column order (the first
    CAP and KEPT_CAP of them)."""
    above = tl.full([], 0, tl.int32)
    count = tl.full([], 0, tl.int32)
    nans = tl.full([], 0, tl.int32)
    for start in range(0, N, BLOCK):
        cols, inside, s = _block(base, start, offs, N)
        key = _keys(s)
        cand = (inside & (key >= lo) & (key <= hi)).to(tl.int32)
        high = (inside & (key > hi)).to(tl.int32)
        # one scan for both lists: the candidates in the low 16 bits, the keys above hi in the high
        # (BLOCK < 65536); a key >= lo is one or the other
        scan = tl.cumsum(cand | (high << 16), 0)
        slot = count + (scan & 0xFFFF) - cand
        tl.store(cand_row + slot, s, mask=(cand != 0) & (slot < CAP))
        kept_slot = slot + above + (scan >> 16) - high
        tl.store(kept_row + kept_slot, cols, mask=((cand | high) != 0) & (kept_slot < KEPT_CAP))
        # the three counts in one reduction: 16 bits each
        packed = tl.sum(cand.to(tl.int64) | (high.to(tl.int64) << 16) | ((inside & (s != s)).to(tl.int64) << 32))
        count += (packed & 0xFFFF).to(tl.int32)
        above += ((packed >> 16) & 0xFFFF).to(tl.int32)
        nans += (packed >> 32).to(tl.int32)
    return above, count, nans


@triton.jit
def _select_kernel(s_ptr, idx_ptr, valid_ptr, nan_ptr, cand_ptr, kept_ptr, bracketed_ptr, N, WIDTH, CAP, KEPT_CAP,
                   stride_s, stride_i, stride_v, stride_c, stride_k, BLOCK: tl.constexpr, BITS: tl.constexpr,
                   SAMPLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = s_ptr + row * stride_s
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.full([], 0, tl.uint32)  # the threshold key (set by _threshold below)
    need = tl.full([], 0, tl.int32) + WIDTH  # how many of the row's keys at the threshold or above to keep
    sharing = tl.full([], 0, tl.int32)
    floor = tl.full([], 0, tl.uint32)  # no key below it is chosen
    bracketed = tl.full([], 0, tl.int32)
    kept_n = tl.full([], 0, tl.int32)  # columns at kept_row: every key >= lo, where bracketed
    kept_row = kept_ptr + row * stride_k
    if SAMPLE > 0:
        if (N >= 4 * SAMPLE) & (WIDTH < N):
            # a bracket from a sample, checked by exact counts: where it holds the WIDTH-th key, the
            # passes run over the scores inside it (a few % of the row), not over the row
            lo, hi = _sample_bracket(base, N, WIDTH, SAMPLE)
            cand_row = cand_ptr + row * stride_c
            above, count, nans = _bracket_pass(base, N, offs, lo, hi, cand_row, CAP, kept_row, KEPT_CAP, BLOCK)
            tl.store(nan_ptr + row, nans)
            if (above < WIDTH) & (above + count >= WIDTH) & (count <= CAP):
                tl.debug_barrier()  # the lists written by every thread, before any reads them
                bracketed = 1
                kept_n = above + count  # < WIDTH + CAP <= KEPT_CAP: all held
                floor = lo
                need -= above
                prefix, need, sharing, _ = _threshold(cand_row, count, offs, bins, need, False, BLOCK, BITS)
    tl.store(bracketed_ptr + row, bracketed.to(tl.int8))
    if bracketed == 0:
        prefix, need, sharing, nans = _threshold(base, N, offs, bins, need, True, BLOCK, BITS)
        tl.store(nan_ptr + row, nans)

    # `need` of the `sharing` elements at or above prefix that share its bits are kept, the lowest
    # columns first. From a bracket, the kept keys sharing a prefix found early all lie at or above
    # lo (floor), others sharing it below lo do not: the threshold is the larger of the two
    plain = need == sharing
    prefix = tl.maximum(prefix, floor)
    written = tl.full([], 0, tl.int32)
    ties_seen = tl.full([], 0, tl.int32)
    idx_row = idx_ptr + row * stride_i
    valid_row = valid_ptr + row * stride_v
    if bracketed != 0:
        # every chosen key is >= lo and the list holds them all, in column order: the write walks it
        # (a few thousand columns) instead of the row, with the same blocks' arithmetic
        for start in range(0, kept_n, BLOCK):
            inside = start + offs < kept_n
            cols = tl.load(kept_row + start + offs, mask=inside, other=0)
            s = tl.load(base + cols, mask=inside, other=0.0)
            written, ties_seen = _write_block(idx_row, valid_row, cols, inside, _keys(s), prefix, need, plain,
                                              written, ties_seen)
    else:
        for start in range(0, N, BLOCK):
            cols, inside, s = _block(base, start, offs, N)
            written, ties_seen = _write_block(idx_row, valid_row, cols, inside, _keys(s), prefix, need, plain,
                                              written, ties_seen)


@triton.jit
def _write_block(idx_row, valid_row, cols, inside, key, prefix, need, plain, written, ties_seen):
    """A block's chosen finite columns (by their keys) at the row's next slots, in column order; returns
    (slots used, ties seen) so far. plain (every element sharing prefix is kept, most rows): a key >=
    prefix is chosen. Else every bit is found and the elements equal to prefix are ties: the first
    `need` of them in column order are chosen (ties_seen: the row's ties in earlier blocks)."""
    if plain:
        chosen = inside & (key >= prefix)
    else:
        tie = (inside & (key == prefix)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie  # ties at lower columns, this row so far
        ties_seen += tl.sum(tie)
        chosen = inside & ((key > prefix) | ((tie != 0) & (tie_rank < need)))
    kept = (chosen & _finite(key)).to(tl.int32)
    slot = written + tl.cumsum(kept, 0) - kept
    tl.store(idx_row + slot, cols.to(tl.int64), mask=kept != 0)
    tl.store(valid_row + slot, tl.full(cols.shape, 1, tl.int8), mask=kept != 0)
    return written + tl.sum(kept), ties_seen


# ---- short windows: each row split over programs of BLOCK columns ------------------------------------
# A decode step's row (one query over the whole history) on one program would run on one
# multiprocessor; here every pass is two launches, the histograms of all the row's blocks at once
# and then one program per row summing them (_resolve, the row kernel's arithmetic), and the write
# is a count per block and then the writes, each block starting at the slots and ties its earlier
# blocks account for. The same selection by construction: integer counts, the same threshold.
# Row state between launches, int32 [T, 4]: prefix (uint32 bits), need, sharing, shift.


@triton.jit
def _row_state(state_ptr, row, FIRST: tl.constexpr, WIDTH, BITS: tl.constexpr):
    """(prefix, need, sharing, shift of this pass, whether the pass runs) of a row."""
    if FIRST:
        prefix = tl.full([], 0, tl.uint32)
        need = tl.full([], 0, tl.int32) + WIDTH
        sharing = tl.full([], 0, tl.int32)
        shift = tl.full([], 32 - BITS, tl.int32)
        active = shift >= 0
    else:
        state = state_ptr + row * 4
        prefix = tl.load(state).to(tl.uint32, bitcast=True)
        need = tl.load(state + 1)
        sharing = tl.load(state + 2)
        shift = tl.load(state + 3)
        active = (shift > 0) & (need < sharing)  # the row kernel's loop condition
        shift -= BITS
    return prefix, need, sharing, shift, active


@triton.jit
def _split_hist_kernel(s_ptr, state_ptr, hist_ptr, nan_ptr, N, P, stride_s, FIRST: tl.constexpr,
                       BLOCK: tl.constexpr, BITS: tl.constexpr):
    """One pass's histogram of block p of a row (_key_hist, bin 0 as it lands) -> hist[row, p]."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    prefix, need, sharing, shift, active = _row_state(state_ptr, row, FIRST, 0, BITS)
    if active:
        bins = tl.arange(0, 1 << BITS)
        cols, inside, s = _block(s_ptr + row * stride_s, p * BLOCK, tl.arange(0, BLOCK), N)
        tl.store(hist_ptr + (row * P + p) * (1 << BITS) + bins, _key_hist(_keys(s), inside, prefix, shift, BITS))
        if FIRST:
            tl.store(nan_ptr + row * P + p, tl.sum((inside & (s != s)).to(tl.int32)))


@triton.jit
def _split_resolve_kernel(state_ptr, hist_ptr, nan_part_ptr, nan_ptr, N, P, WIDTH, FIRST: tl.constexpr,
                          BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program per row: the pass's histograms summed over the row's blocks -> the row's next state."""
    row = tl.program_id(0).to(tl.int64)
    prefix, need, sharing, shift, active = _row_state(state_ptr, row, FIRST, WIDTH, BITS)
    bins = tl.arange(0, 1 << BITS)
    if active:
        counts = tl.zeros([1 << BITS], dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            part = tl.load(hist_ptr + (row * P + ps)[:, None] * (1 << BITS) + bins[None, :],
                           mask=(ps < P)[:, None], other=0)
            counts += tl.sum(part, axis=0)
        counts = _sharing_only(counts, bins, P * BLOCK, N if FIRST else sharing)
        prefix, need, sharing = _resolve(counts, bins, prefix, need, shift)
        state = state_ptr + row * 4
        tl.store(state, prefix.to(tl.int32, bitcast=True))
        tl.store(state + 1, need)
        tl.store(state + 2, sharing)
        tl.store(state + 3, shift)
    if FIRST:
        nans = tl.full([], 0, tl.int32)
        for p0 in range(0, P, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            nans += tl.sum(tl.load(nan_part_ptr + row * P + ps, mask=ps < P, other=0))
        tl.store(nan_ptr + row, nans)


@triton.jit
def _split_count_kernel(s_ptr, state_ptr, count_ptr, N, P, stride_s, BLOCK: tl.constexpr):
    """Block p's chosen finite elements less the ties (count[row, p, 0]) and its ties (count[row, p, 1])."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    state = state_ptr + row * 4
    prefix = tl.load(state).to(tl.uint32, bitcast=True)
    plain = tl.load(state + 1) == tl.load(state + 2)
    cols, inside, s = _block(s_ptr + row * stride_s, p * BLOCK, tl.arange(0, BLOCK), N)
    key = _keys(s)
    above = tl.where(plain, key >= prefix, key > prefix)
    tl.store(count_ptr + (row * P + p) * 2, tl.sum((inside & above & _finite(key)).to(tl.int32)))
    tl.store(count_ptr + (row * P + p) * 2 + 1, tl.sum((inside & (key == prefix)).to(tl.int32)))


@triton.jit
def _split_write_kernel(s_ptr, state_ptr, count_ptr, idx_ptr, valid_ptr, N, P, stride_s, stride_i, stride_v,
                        BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """Block p's chosen finite columns, from the slots and ties of the row's earlier blocks (BLOCK_P: at
    least the row's blocks; one value for every row length, so one compile)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    state = state_ptr + row * 4
    prefix = tl.load(state).to(tl.uint32, bitcast=True)
    need = tl.load(state + 1)
    plain = need == tl.load(state + 2)
    qs = tl.arange(0, BLOCK_P)
    above = tl.load(count_ptr + (row * P + qs) * 2, mask=qs < P, other=0)
    ties = tl.load(count_ptr + (row * P + qs) * 2 + 1, mask=qs < P, other=0)
    ties_before = tl.cumsum(ties, 0) - ties
    # ties share one key, hence one score: all finite or none (+-inf, whose keys bound the finite ones)
    ties_finite = _finite(prefix)
    kept_ties = tl.minimum(tl.maximum(need - ties_before, 0), ties)  # ranks [ties_before, +ties) below need
    kept = above + tl.where(plain, 0, tl.where(ties_finite, kept_ties, 0))
    earlier = qs < p
    cols, inside, s = _block(s_ptr + row * stride_s, p * BLOCK, tl.arange(0, BLOCK), N)
    _write_block(idx_ptr + row * stride_i, valid_ptr + row * stride_v, cols, inside, _keys(s), prefix, need, plain,
                 tl.sum(tl.where(earlier, kept, 0)), tl.sum(tl.where(earlier, ties, 0)))


def select(scores: torch.Tensor, k: int, bits: int = DIGIT_BITS, form: str | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores fp32 [T, N] on CUDA -> (indices [T, k] int64, valid [T, k] bool, NaN count [T] int32):
    each row's min(k, N) largest (score, -position) keys, ascending, the non-finite ones invalid.
    `bits` of the threshold key a pass (benches; any divisor of 32 up to 8 gives the same selection).
    `form` (benches and tests; every form gives the same selection): 'split' (each row over programs of
    BLOCK columns), 'row' (a program a row, its passes over a sampled bracket where it holds) or
    'row_full' (a program a row, every pass over the whole row). None: split for windows of up to
    SPLIT_ROWS rows, else row."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [T, N], got {scores.dtype} {tuple(scores.shape)}")
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"select: bits={bits}: choose 1, 2, 4 or 8 (a divisor of 32; 256 bins at most)")
    t, n = scores.shape
    if form is None:
        form = "split" if t <= SPLIT_ROWS else "row"
    if form not in ("split", "row", "row_full"):
        raise ValueError(f"select: form={form!r}: choose 'split', 'row' or 'row_full'")
    if form == "split":
        if scores.stride(1) != 1:
            scores = scores.contiguous()
        indices, valid, nans = _outputs(t, k, scores.device)
        if t and n and k:
            _select_split(scores, indices, valid, nans, min(k, n), bits)
        return indices, valid.view(torch.bool), nans
    return select_rows(scores, k, bits, None if form == "row" else 0)[:3]


def sample_keys(n: int) -> int:
    """Keys a row of n keys samples its bracket from (SAMPLE_KEYS)."""
    return next(keys for most, keys in SAMPLE_KEYS if n <= most)


Selected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def select_rows(scores: torch.Tensor, k: int, bits: int = DIGIT_BITS, sample: int | None = None, *,
                block: int = ROW_BLOCK, warps: int = 4) -> Selected:
    """select()'s row form: (indices, valid, NaN count, whether each row's passes ran over its sampled
    bracket [T] bool). sample: keys a bracket is sampled from (a power of two; 0: none; None:
    sample_keys(N)), taken for rows of at least 4 x sample keys. block, warps: benches."""
    t, n = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    indices, valid, nans = _outputs(t, k, scores.device)
    bracketed = torch.zeros(t, dtype=torch.int8, device=scores.device)
    if t and n and k:
        sample = sample_keys(n) if sample is None else sample
        sample = sample if sample and n >= 4 * sample else 0
        cap = min(triton.cdiv(n, 4), CANDIDATES_MAX) if sample else 0
        candidates = torch.empty(t if sample else 1, max(cap, 1), dtype=torch.float32, device=scores.device)
        kept_cap = min(k, n) + cap if sample else 0
        kept = torch.empty(t if sample else 1, max(kept_cap, 1), dtype=torch.int32, device=scores.device)
        _select_kernel[(t,)](scores, indices, valid, nans, candidates, kept, bracketed, n, min(k, n), cap, kept_cap,
                             scores.stride(0), indices.stride(0), valid.stride(0), candidates.stride(0), kept.stride(0),
                             BLOCK=block, BITS=bits, SAMPLE=sample, num_warps=warps, **OPTIONS)
    return indices, valid.view(torch.bool), nans, bracketed.view(torch.bool)


def _outputs(t: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed (indices [t, k] int64, valid [t, k] int8, NaN count [t] int32): slots past a row's
    chosen finite columns stay index 0, invalid."""
    return (torch.zeros(t, k, dtype=torch.int64, device=device), torch.zeros(t, k, dtype=torch.int8, device=device),
            torch.zeros(t, dtype=torch.int32, device=device))


def _select_split(scores: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, nans: torch.Tensor,
                  width: int, bits: int) -> None:
    """The row kernel's selection with each row over cdiv(N, BLOCK) programs: 32 / bits passes of two
    launches (a row whose threshold is found early skips the rest inside the kernels: the launches
    are fixed, nothing is read on the host, so a CUDA graph can hold the call), then a count and a write."""
    t, n = scores.shape
    blocks = triton.cdiv(n, BLOCK)
    if blocks > MAX_KEYS // BLOCK:
        raise ValueError(f"select: rows of {n} keys exceed MAX_KEYS ({MAX_KEYS}): the torch form takes those")
    dev = scores.device
    state = torch.empty(t, 4, dtype=torch.int32, device=dev)
    hist = torch.empty(t, blocks, 1 << bits, dtype=torch.int32, device=dev)
    nan_part = torch.empty(t, blocks, dtype=torch.int32, device=dev)
    counts = torch.empty(t, blocks, 2, dtype=torch.int32, device=dev)
    for first in [True] + [False] * (32 // bits - 1):
        _split_hist_kernel[(t, blocks)](scores, state, hist, nan_part, n, blocks, scores.stride(0), FIRST=first,
                                        BLOCK=BLOCK, BITS=bits, num_warps=4, **OPTIONS)
        _split_resolve_kernel[(t,)](state, hist, nan_part, nans, n, blocks, width, FIRST=first, BITS=bits,
                                    BLOCK=BLOCK, BLOCK_P=RESOLVE_BLOCKS, num_warps=4, **OPTIONS)
    _split_count_kernel[(t, blocks)](scores, state, counts, n, blocks, scores.stride(0), BLOCK=BLOCK, num_warps=4,
                                     **OPTIONS)
    _split_write_kernel[(t, blocks)](scores, state, counts, indices, valid, n, blocks, scores.stride(0),
                                     indices.stride(0), valid.stride(0), BLOCK=BLOCK, BLOCK_P=MAX_KEYS // BLOCK,
                                     num_warps=4, **OPTIONS)
