"""Row-invariant matrix products on CUDA (Triton): `linear` (x @ w^T) and `head_linear` (per-head x @ w[h]^T).

One kernel serves both: out[m, h, :] = x[m, h, :] @ w[h]^T, a grid of (row tile x column tile, head)
programs. Each output element is the fp32 sum over K in ceil(K / BLOCK_K) blocks, in ascending order,
of the tile's tl.dot (bf16/fp16 on the tensor cores, fp32 with input_precision="ieee": never tf32).
There is no split-K, no atomics, no reduction across programs, and the tile configuration comes
from the fixed dims (N, K, dtype) only, never from the row count M (passed do_not_specialize), so a
row gets the same instructions, and the same bits, whatever M is and wherever the row sits.

CONFIG_BY_ROWS: decode (M = 1) and prefill (M = 2048) want different tiles. True (the default):
the tile config chosen by M; that is row-invariant because the tensor-core paths for different
BLOCK_M (mma.sync at 16, wgmma at >= 64 on Hopper), BLOCK_N and BLOCK_K (64, 128, 256: the same
ascending k16 steps into one fp32 accumulator) give bitwise-equal per-element sums: measured on
the H200 by bench/bench_kernels.py's probe (seven configs, every M and offset tried: identical
bits; bench/results/kernels_h200.json) and by a probe of 36 decode configs over
eleven GLM-5.3 shapes: identical bits; bench/results/decode_tiles_h200.json), and guarded by
tests/gpu/test_triton_cuda.py. Every device checks it again at first use of each shape
(`row_tiles_agree`: random rows against the layer's own weight, each row-count tile against the
prefill tile, torch.equal); where they differ (another GPU, e.g. GB10 whose tensor cores take other
instructions, or another compiler) that shape runs the prefill tile for every M there. False: one
config per (N, K, dtype) for all M, row-invariant by construction on any GPU. First
reading (H200, triton 3.6, torch 2.11): all seven probe configs (BLOCK_M 16/64/128) gave identical
bits at M = 1, 7, 64, 2048 and two offsets, for (N, K) = (2048, 2048), (6144, 2048), (2048, 6144).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.ops.triton_launch import OPTIONS

CONFIG_BY_ROWS = True
PREFILL_ROWS = 2048  # a row count past every row-count tile: the prefill tile's
CHECK_ROWS = (1, 5, 16, 48)  # the row counts a device's agreement check runs (decode, odd, window, mid tile)
_AGREE: dict[tuple, bool] = {}  # (kind, N, K, dtype, out dtype, heads, device) -> the row-count tiles agree


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles per group in the launch order (L2 reuse of w); no effect on the values


def linear_config(m: int, n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """The tile config of x[m, k] @ w[n, k]^T. Depends on m only when CONFIG_BY_ROWS is True."""
    if dtype == torch.float32:
        # router / indexer head weights: small fp32 products, FMA dots (ieee: each output one fma
        # chain over K in order, whatever the tile: all 24 probed configs gave the same bits)
        if CONFIG_BY_ROWS and m <= 16:
            # H200 M=1 (docs/decisions/triton-configs.md, decode_tiles_fp32_h200.json): the
            # indexer's head weights [32, 6144] 118 us against the M=2048 tile's 269, the router
            # [256, 6144] 119 against 350;
            # a chain of 6144 dependent steps bounds a program, so more stages, not more programs
            return LinearConfig(16, 16, 128, 4, 4)
        return LinearConfig(32, 32, 32, 4, 2)
    if CONFIG_BY_ROWS:
        if m <= 16:  # decode / short verify windows: narrow column tiles (many programs stream w), long K steps
            # H200 M=1 (docs/decisions/triton-configs.md, bench/results/decode_tiles_h200.json; all 36
            # candidates bitwise equal to the prefill tiles): q_a 11 us against the prefill tile's 21,
            # o_proj 53 against 68, the eleven GLM-5.3 shapes 315 against 382 (the best per shape: 305)
            return LinearConfig(16, 16, 256, 4, 5) if n <= 2048 else LinearConfig(16, 32, 128, 4, 5)
        if m <= 256:
            return LinearConfig(64, 64, 64, 4, 4)
    # prefill tiles, for every M when CONFIG_BY_ROWS is False. H200, M=2048: 67-72% of cuBLAS;
    # M=1: 1.4-2.5 TB/s of weights where N >= 6144, less at N=2048 (16-32 programs)
    return LinearConfig(128, 128 if n >= 4096 else 64, 64, 8 if n >= 4096 else 4, 4)


def head_linear_config(n: int, k: int, dtype: torch.dtype, t: int) -> LinearConfig:
    """Tile config of the per-head product (N, K small: 512 x 192, 256 x 512 in GLM-5.3); by T only
    when CONFIG_BY_ROWS is True."""
    if dtype == torch.float32:
        return LinearConfig(32, 32, 32, 4, 2)
    if CONFIG_BY_ROWS and t <= 16:
        # H200 T=1 (docs/decisions/triton-configs.md, decode_tiles_head_h200.json; all 24 candidates
        # bitwise equal to T=2048's rows): w_uk 5.5 us against T=2048's tile's 6.8, w_uv 7.1 against 8.2
        return LinearConfig(16, 64, 64, 4, 3)
    return LinearConfig(128, 128, 64, 8, 3)  # H200: 91-102 us at T=2048 (64x64 tiles: 117-128)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xh, stride_wh, stride_wn, stride_om, stride_oh,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    # launch order only (grouped row tiles for L2 reuse of w): which program computes a tile
    # changes with M, how the tile is computed does not
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + head * stride_xh + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + head * stride_wh + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = _tile_product(x_rows, w_rows, m_mask, n_mask, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    out = out_ptr + head * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_product(x_rows, w_rows, m_mask, n_mask, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile of x_rows @ w_rows^T: the one reduction both kernels share."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):  # fixed blocks, ascending: the only reduction order
        kk = kb * BLOCK_K + offs_k
        k_mask = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit(do_not_specialize=["R"])
def _row_expert_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, R, N, K, stride_xm, stride_we, stride_wn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # one row per program (the tile's other rows masked), its own expert's matrix: the tile and the
    # K loop of a small-M `linear`, so the row gets the bits the grouped path gives it
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    row = (pid // num_n).to(tl.int64)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    lane = tl.arange(0, BLOCK_M)
    m_mask = lane == 0
    n_mask = offs_n < N
    expert = tl.load(ids_ptr + row).to(tl.int64)
    x_rows = x_ptr + (row + lane.to(tl.int64))[:, None] * stride_xm
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = _tile_product(x_rows, w_rows, m_mask, n_mask, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    out = out_ptr + (row + lane.to(tl.int64))[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_expert_kernel(x_ptr, w_ptr, tile_expert_ptr, tile_row_ptr, tile_rows_ptr, out_ptr, N, K,
                           stride_xm, stride_we, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # row tile `tile` of one expert's run of rows (tile_rows of them from tile_row; 0: an idle
    # program of the grid's bound) times that expert's matrix: the tile and K loop of `linear`
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0) // num_n  # a row tile's column tiles run side by side: its rows stay in L2
    rows = tl.load(tile_rows_ptr + tile)
    if rows > 0:
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        first = tl.load(tile_row_ptr + tile).to(tl.int64)
        lane = tl.arange(0, BLOCK_M)
        offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = lane < rows
        n_mask = offs_n < N
        x_rows = x_ptr + (first + lane.to(tl.int64))[:, None] * stride_xm
        w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = _tile_product(x_rows, w_rows, m_mask, n_mask, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        out = out_ptr + (first + lane.to(tl.int64))[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, m: int, n: int, k: int, heads: int,
            stride_xm: int, stride_xh: int, stride_wh: int, stride_om: int, stride_oh: int,
            cfg: LinearConfig) -> None:
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), heads)
    _matmul_kernel[grid](x, w, out, m, n, k, stride_xm, stride_xh, stride_wh, w.stride(-2), stride_om, stride_oh,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                         IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         **OPTIONS)


def _check_dtypes(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dtype != w.dtype:
        raise ValueError(f"{what}: x is {x.dtype} but w is {w.dtype} (same dtype required, as in torch)")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: dtype {x.dtype} not supported (bf16, fp16, fp32)")


# ---- the row-count tiles, checked on each device ------------------------------------------------
def _agree_key(kind: str, w: torch.Tensor, out_dtype: torch.dtype) -> tuple:
    return (kind, tuple(w.shape[-2:]), w.dtype, out_dtype, w.shape[0] if kind == "head" else 1, w.device)


def row_tiles_agree(kind: str, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this device gives a row the prefill tile's bits under the row-count tiles (CONFIG_BY_ROWS)
    for w's shape: the H200 measured it (module docstring); any other GPU (GB10's tensor cores take
    other instructions) is checked once per shape key, at first use, on random rows against w itself:
    linear (kind "linear": w [N, K]; also expert_linear's kernel, whose rows must carry linear's bits)
    or head_linear ("head": w [H, N, K]) at CHECK_ROWS rows against the prefill tile's, torch.equal.
    Where they differ, every row count runs the prefill tile there (exact, slower for few rows; said
    on stderr). Inside a graph capture an unchecked key answers False without caching: the prefill
    tile is exact, and an eager call checks later."""
    key = _agree_key(kind, w, out_dtype)
    found = _AGREE.get(key)
    if found is not None:
        return found
    if w.device.type != "cuda":
        return True  # Triton's interpreter (tests): CONFIG_BY_ROWS decides, unless a check was recorded
    if torch.cuda.is_current_stream_capturing():
        return False
    found = _AGREE[key] = _row_tiles_check(kind, w.contiguous(), out_dtype)
    if not found:
        print(f"glm53: linear's row-count tiles differ from its prefill tile in their bits for {kind} "
              f"{tuple(w.shape)} ({w.dtype}) on {torch.cuda.get_device_name(w.device)}; every row count runs the "
              "prefill tile there (exact, slower for few rows)", file=sys.stderr)
    return found


def _row_tiles_check(kind: str, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    g = torch.Generator(device=w.device).manual_seed(20261203)
    rows = max(CHECK_ROWS)
    k, n = w.shape[-1], w.shape[-2]
    heads = w.shape[0] if kind == "head" else 1
    x = torch.randn(rows, heads, k, generator=g, device=w.device).to(w.dtype)

    def run(m: int, cfg: LinearConfig) -> torch.Tensor:
        out = torch.empty(m, heads, n, dtype=out_dtype, device=w.device)
        _launch(x[:m], w, out, m, n, k, heads, x.stride(0), x.stride(1), w.stride(0) if kind == "head" else 0,
                out.stride(0), out.stride(1), cfg)
        return out

    tile = _tiles(kind, w)
    want = run(rows, tile(PREFILL_ROWS))
    same = all(torch.equal(run(m, tile(m)), want[:m]) for m in CHECK_ROWS)
    if kind == "linear" and same:
        ids = torch.zeros(rows, dtype=torch.int64, device=w.device)
        same = torch.equal(_expert_rows(x[:, 0], w[None], ids, out_dtype, linear_config(1, n, k, w.dtype)), want[:, 0])
    return same


def _tiles(kind: str, w: torch.Tensor):
    """rows -> the tile config of linear ("linear", w [N, K]) or head_linear ("head", w [H, N, K])."""
    n, k = w.shape[-2], w.shape[-1]
    if kind == "head":
        return lambda rows: head_linear_config(n, k, w.dtype, rows)
    return lambda rows: linear_config(rows, n, k, w.dtype)


def _config(kind: str, m: int, w: torch.Tensor, out_dtype: torch.dtype) -> LinearConfig:
    """The tile for m rows: by m where CONFIG_BY_ROWS and this device's rows agree (row_tiles_agree;
    nothing to check past the mid tile's rows), else the prefill tile."""
    tile = _tiles(kind, w)
    if m > 256 or (CONFIG_BY_ROWS and row_tiles_agree(kind, w, out_dtype)):
        return tile(m)
    return tile(PREFILL_ROWS)


def linear(x: torch.Tensor, w: torch.Tensor, config: LinearConfig | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in out_dtype (default x's dtype), fp32 accumulation.
    `config` overrides the tile choice (the benchmark's probe); leave it None in the model."""
    _check_dtypes(x, w, "linear")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"linear: w {tuple(w.shape)} does not match x [..., {k}]")
    m = math.prod(lead)
    flat = x.reshape(m, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    w = w.contiguous()
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m and n:
        if k == 0:
            out.zero_()
        else:
            cfg = config or _config("linear", m, w, out.dtype)
            _launch(flat, w, out, m, n, k, 1, flat.stride(0), 0, 0, out.stride(0), 0, cfg)
    return out.reshape(*lead, n)


def head_linear(x: torch.Tensor, w: torch.Tensor, config: LinearConfig | None = None) -> torch.Tensor:
    """out[t, h] = w[h] @ x[t, h]: x [T, H, K] (any strides but a contiguous last dim; e.g. a
    q[..., :nope] slice), w [H, N, K] -> [T, H, N] contiguous in x's dtype. `config` overrides the
    tile choice (the probe's); leave it None in the model."""
    _check_dtypes(x, w, "head_linear")
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"head_linear: x {tuple(x.shape)} must be [T, H, K] and w {tuple(w.shape)} [H, N, K]")
    t, heads, k = x.shape
    n = w.shape[1]
    if x.stride(2) != 1:
        x = x.contiguous()
    w = w.contiguous()
    out = torch.empty(t, heads, n, dtype=x.dtype, device=x.device)
    if t and heads and n:
        if k == 0:
            out.zero_()
        else:
            cfg = config or _config("head", t, w, x.dtype)
            _launch(x, w, out, t, n, k, heads, x.stride(0), x.stride(1), w.stride(0), out.stride(0), out.stride(1),
                    cfg)
    return out


def expert_linear(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[ids[r]]^T: x [R, K], w [E, N, K], ids [R] (device ints, never read on the
    host) -> [R, N] in x's dtype; each row with linear()'s tile for one row, hence its bits."""
    x, w = _expert_operands("expert_linear", x, w, "ids", ids, per_row=True)
    r, k = x.shape
    n = w.shape[1]
    if not (r and n and k):
        return torch.zeros(r, n, dtype=x.dtype, device=x.device)
    by_rows = CONFIG_BY_ROWS and row_tiles_agree("linear", w[0], x.dtype)
    return _expert_rows(x, w, ids, x.dtype, linear_config(1 if by_rows else PREFILL_ROWS, n, k, x.dtype))


def _expert_operands(what: str, x: torch.Tensor, w: torch.Tensor, index_name: str, index: torch.Tensor,
                     per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] and w [E, N, K] of a product of rows by their experts' matrices, checked with
    `index` (one per row of x, or one per expert of w), x with unit column stride and w contiguous."""
    _check_dtypes(x, w, what)
    fits = x.dim() == 2 and w.dim() == 3 and w.shape[2] == x.shape[1]
    if not fits or index.shape != ((x.shape[0],) if per_row else (w.shape[0],)):
        raise ValueError(f"{what}: x {tuple(x.shape)} [R, K], w {tuple(w.shape)} [E, N, K], "
                         f"{index_name} {tuple(index.shape)} {'[R]' if per_row else '[E]'} do not fit")
    return (x if x.stride(1) == 1 else x.contiguous()), w.contiguous()


def _expert_rows(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype,
                 cfg: LinearConfig) -> torch.Tensor:
    """_row_expert_kernel over every row of x (one row a program, `cfg`'s tile)."""
    r, k = x.shape
    n = w.shape[1]
    out = torch.empty(r, n, dtype=out_dtype, device=x.device)
    grid = (r * triton.cdiv(n, cfg.block_n),)
    _row_expert_kernel[grid](x, w, ids.contiguous(), out, r, n, k, x.stride(0), w.stride(0), w.stride(1),
                             out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             **OPTIONS)
    return out


# ---- routed experts over many rows: one launch for every expert ---------------------------------
# the row count whose linear tile the grouped form takes: the prefill tile (128 rows), which reads an
# expert's matrices once for up to 128 rows (bench_moe_prefill, H200: 1.07-1.24x the 64-row tile's speed)
GROUPED_ROWS = PREFILL_ROWS


def grouped_expert_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """out = x @ w[e]^T for each expert's run of rows: x [S, K] holds the rows grouped by expert in
    ascending order, counts [E] (device ints, never read on the host) how many each has; w [E, N, K].
    One launch, no sync; each run's rows get the bits `linear(x[run], w[e])` gives them: linear's
    tile for GROUPED_ROWS rows (by default the prefill tile, whose bits linear gives every row count,
    by its own tile where `row_tiles_agree`, else by that tile), checked per shape on each device by
    `grouped_agrees` before the model uses it."""
    x, w = _expert_operands("grouped_expert_linear", x, w, "counts", counts, per_row=False)
    s, k = x.shape
    n = w.shape[1]
    out = torch.empty(s, n, dtype=x.dtype, device=x.device)
    if not (s and n and k):
        return out.zero_()
    cfg = _config("linear", GROUPED_ROWS, w[0], x.dtype)
    expert, first, rows = _tile_table(counts, cfg.block_m, triton.cdiv(s, cfg.block_m) + w.shape[0])
    grid = (expert.shape[0] * triton.cdiv(n, cfg.block_n),)
    _grouped_expert_kernel[grid](x, w, expert, first, rows, out, n, k, x.stride(0), w.stride(0),
                                 w.stride(1), out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages, **OPTIONS)
    return out


def _tile_table(counts: torch.Tensor, block_m: int, bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row tiles of runs of `counts` rows (expert order), on the device: per tile its expert, its
    first row and its row count, padded with idle tiles (0 rows) to `bound` (a bound the host knows
    without reading counts: ceil(S / block_m) + E)."""
    counts = counts.to(torch.int64)
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    index = torch.arange(bound, device=counts.device)
    expert = torch.searchsorted(ends, index, right=True)
    real = expert < counts.shape[0]
    expert = expert.clamp(max=counts.shape[0] - 1)
    local = index - (ends[expert] - tiles[expert])
    first = torch.cumsum(counts, 0)[expert] - counts[expert] + local * block_m
    rows = torch.where(real, (counts[expert] - local * block_m).clamp(max=block_m), 0)
    return expert.to(torch.int32), first.to(torch.int64), rows.to(torch.int32)


_GROUPED_AGREE: dict[tuple, bool] = {}
GROUPED_CHECK_COUNTS = (1, 70, 0, 150, 64)  # runs: one row, a partial tile, an empty expert, tiles and a part, a whole tile


def grouped_agrees(w: torch.Tensor) -> bool:
    """Whether grouped_expert_linear gives each run the bits of linear over that run, for w's shape
    on this device: once per shape key, random rows through the first experts of w itself against
    `linear(x[run], w[e])`, torch.equal. Inside a graph capture an unchecked key answers False (the
    per-expert loop is exact; an eager call checks later)."""
    key = ("grouped", tuple(w.shape), w.dtype, w.device, GROUPED_ROWS)
    found = _GROUPED_AGREE.get(key)
    if found is not None:
        return found
    if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    from triton.runtime.errors import OutOfResources

    try:
        same = _grouped_check(w)
    except OutOfResources:  # a device whose shared memory the tile does not fit: the loop, as when bits differ
        same = False
    _GROUPED_AGREE[key] = same
    if not same:
        print(f"glm53: the grouped expert product differs from linear's bits for {tuple(w.shape)} ({w.dtype}) "
              f"on this device; MoE prefill runs one product per expert there (exact, slower)", file=sys.stderr)
    return same


def _grouped_check(w: torch.Tensor) -> bool:
    n_experts = min(w.shape[0], len(GROUPED_CHECK_COUNTS))
    counts = torch.tensor(GROUPED_CHECK_COUNTS[:n_experts], device=w.device)
    g = torch.Generator(device=w.device).manual_seed(20261203)
    x = torch.randn(int(sum(GROUPED_CHECK_COUNTS[:n_experts])), w.shape[2], generator=g, device=w.device).to(w.dtype)
    got = grouped_expert_linear(x, w[:n_experts], counts)
    begin, same = 0, True
    for e, c in enumerate(GROUPED_CHECK_COUNTS[:n_experts]):
        if c:
            same = same and torch.equal(got[begin:begin + c], linear(x[begin:begin + c], w[e]))
        begin += c
    return same
