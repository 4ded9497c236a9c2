"""The Triton kernels (glm53/ops/triton_*.py) on CUDA: agreement with glm53.ops.torch_ops, bitwise row
invariance, determinism.

Agreement is checked against the torch reference evaluated in fp32 on the same (bf16-rounded) inputs:
fp32 kernels within FP32_TOL of it, bf16 kernels within BF16_TOL (their outputs are rounded to bf16;
latent_attention's probabilities too). Invariance is bitwise: rows (queries, (t, n) scores) of a
big call equal the same rows computed alone or in other-sized calls at other offsets, including
M = 1 and odd M; index_scores also over a key prefix; latent_attention also with invalid slots
appended. Determinism: the same call twice is bitwise equal.

    pytest -m gpu tests/gpu/test_triton_cuda.py
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm53.ops import torch_ops  # noqa: E402

pytestmark = pytest.mark.gpu

FP32_TOL = dict(atol=2e-4, rtol=2e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
DTYPES = [torch.bfloat16, torch.float32]
# (start, count) row slices compared against the big call: single rows at both ends, odd counts, offsets
SLICES = [(0, 1), (1, 1), (150, 1), (299, 1), (0, 7), (3, 7), (11, 13), (64, 64), (37, 131), (0, 299)]


@pytest.fixture(scope="module")
def k():
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    pytest.importorskip("triton")
    from glm53.ops import triton_attention, triton_indexer, triton_linear, triton_norm

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32
    return SimpleNamespace(linear=triton_linear, norm=triton_norm, indexer=triton_indexer, attention=triton_attention)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, std: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device="cuda") * std).to(dtype)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))


def _slices(total: int) -> list[slice]:
    return [slice(s, s + n) for s, n in SLICES if s + n <= total]


# ------------------------------------------------------------------------------------------- linear

@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,kdim", [(200, 330), (2048, 512), (6144, 2048)])
def test_linear_matches_torch_and_is_row_invariant(k, dtype, n, kdim):
    g = _gen(n + kdim)
    x = _randn(g, 300, kdim, std=kdim ** -0.5, dtype=dtype)
    w = _randn(g, n, kdim, dtype=dtype)
    big = k.linear.linear(x, w)
    assert big.dtype == dtype and big.shape == (300, n)
    _close(big, torch_ops.linear(x.float(), w.float()), dtype)
    for rows in _slices(300):
        assert torch.equal(k.linear.linear(x[rows], w), big[rows]), f"rows {rows} differ from the 300-row call"
    assert torch.equal(k.linear.linear(x, w), big), "not deterministic"


def test_linear_leading_dims_and_glm_shape(k):
    g = _gen(7)
    x = _randn(g, 2, 1024, 6144, std=6144 ** -0.5, dtype=torch.bfloat16)
    w = _randn(g, 2048, 6144, dtype=torch.bfloat16)
    big = k.linear.linear(x, w)
    assert big.shape == (2, 1024, 2048)
    _close(big, torch_ops.linear(x.float(), w.float()), torch.bfloat16)
    flat, big_flat = x.reshape(-1, 6144), big.reshape(-1, 2048)
    for start, count in [(0, 1), (2047, 1), (1000, 1), (5, 7), (513, 255), (1024, 1024)]:
        rows = slice(start, start + count)
        assert torch.equal(k.linear.linear(flat[rows], w), big_flat[rows]), f"rows {rows}"


def test_linear_config_by_rows_is_row_invariant(k, monkeypatch):
    """CONFIG_BY_ROWS = True picks BLOCK_M 16 / 64 / 128 by M (mma.sync vs wgmma on Hopper): rows must
    still be bitwise those of the 2048-row call, or the flag must be False on this GPU."""
    monkeypatch.setattr(k.linear, "CONFIG_BY_ROWS", True)
    g = _gen(9)
    x = _randn(g, 2048, 6144, std=6144 ** -0.5, dtype=torch.bfloat16)
    w = _randn(g, 2048, 6144, dtype=torch.bfloat16)
    big = k.linear.linear(x, w)
    picked = {k.linear.linear_config(m, 2048, 6144, torch.bfloat16).block_m for m in (1, 64, 2048)}
    assert len(picked) == 3, f"expected three BLOCK_M choices, got {picked}"
    _close(big, torch_ops.linear(x.float(), w.float()), torch.bfloat16)
    for start, count in [(0, 1), (1000, 1), (3, 7), (0, 16), (5, 17), (64, 64), (100, 257)]:
        rows = slice(start, start + count)
        assert torch.equal(k.linear.linear(x[rows], w), big[rows]), (
            f"CONFIG_BY_ROWS=True: rows {rows} differ from the 2048-row call: set CONFIG_BY_ROWS False on this GPU")


def test_linear_row_tiles_device_check(k, monkeypatch):
    """The device check (triton_linear.row_tiles_agree) finds on the H200 what its probes measured:
    the row-count tiles agree for GLM-5.3's shapes (linear, linear_fp32's bf16 form, head_linear,
    expert_linear). Inside a graph capture an unchecked shape runs the prefill tile and is not
    remembered. Where a device's check fails (forced here), every row count runs the prefill tile:
    rows and expert rows equal the 2048-row call."""
    tl_ = k.linear
    monkeypatch.setattr(tl_, "CONFIG_BY_ROWS", True)
    monkeypatch.setattr(tl_, "_AGREE", {})
    g = _gen(21)
    shapes = [(2048, 6144, torch.bfloat16), (6144, 2048, torch.bfloat16), (32, 6144, torch.float32)]
    for n, kdim, out_dtype in shapes:
        w = _randn(g, n, kdim, std=kdim ** -0.5, dtype=torch.bfloat16)
        assert tl_.row_tiles_agree("linear", w, out_dtype), (n, kdim, out_dtype)
    wh = _randn(g, 16, 512, 192, dtype=torch.bfloat16)
    assert tl_.row_tiles_agree("head", wh, torch.bfloat16)
    assert len(tl_._AGREE) == 4
    w = _randn(g, 1024, 6144, std=6144 ** -0.5, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    x1 = _randn(g, 1, 6144, dtype=torch.bfloat16)
    tl_.linear(x1, w)  # warm-up outside the capture: compiles, and checks the shape
    monkeypatch.setattr(tl_, "_AGREE", {})
    with torch.cuda.graph(graph):
        assert tl_.row_tiles_agree("linear", w, torch.bfloat16) is False
        tl_.linear(x1, w)
    assert tl_._AGREE == {}, "a check answered inside a capture was remembered"
    x = _randn(g, 2048, 6144, dtype=torch.bfloat16)
    big = tl_.linear(x, w)
    monkeypatch.setitem(tl_._AGREE, tl_._agree_key("linear", w, torch.bfloat16), False)
    assert tl_._config("linear", 1, w, torch.bfloat16) == tl_.linear_config(2048, 1024, 6144, torch.bfloat16)
    for start, count in [(0, 1), (7, 5), (0, 16), (100, 64)]:
        rows = slice(start, start + count)
        assert torch.equal(tl_.linear(x[rows], w), big[rows]), rows
    ids = torch.zeros(16, dtype=torch.int64, device="cuda")
    assert torch.equal(tl_.expert_linear(x[:16], w[None], ids), big[:16])


@pytest.mark.parametrize("n", [32, 256])
def test_linear_fp32_of_bf16_operands_is_exact_products_and_row_invariant(k, n, monkeypatch):
    """ops.linear_fp32 on bf16 operands (the indexer's head weights [32, 6144], the router [256, 6144]):
    the bf16 kernel with an fp32 output, its rows bitwise those of the 2048-row call at every row
    count's tiles, and within fp32 rounding of the fp32 product of the same values (exact products)."""
    from glm53 import ops

    monkeypatch.setattr(k.linear, "CONFIG_BY_ROWS", True)
    g = _gen(n)
    x = _randn(g, 2048, 6144, dtype=torch.bfloat16)
    w = _randn(g, n, 6144, std=6144 ** -0.5, dtype=torch.bfloat16)
    big = ops.linear_fp32(x, w)
    assert big.dtype == torch.float32 and big.shape == (2048, n)
    _close(big, torch_ops.linear(x.float(), w.float()), torch.float32)
    for start, count in [(0, 1), (1000, 1), (3, 7), (0, 16), (5, 17), (64, 64), (100, 257)]:
        rows = slice(start, start + count)
        assert torch.equal(ops.linear_fp32(x[rows], w), big[rows]), f"rows {rows}"
    # mixed operands (an fp32 model's activations, a bf16 weight): the fp32 FMA kernel
    assert torch.equal(ops.linear_fp32(x.float()[:5], w), k.linear.linear(x.float()[:5], w.float()))


def test_linear_router_fp32(k):
    # the router: fp32 x [T, 6144] @ fp32 w [256, 6144]; the indexer's head weights: [32, 6144]
    g = _gen(8)
    for n in (256, 32):
        x = _randn(g, 129, 6144)
        w = _randn(g, n, 6144, std=6144 ** -0.5)
        big = k.linear.linear(x, w)
        _close(big, torch_ops.linear(x, w), torch.float32)
        for rows in _slices(129):
            assert torch.equal(k.linear.linear(x[rows], w), big[rows])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,n,kdim,extra", [(64, 512, 192, 64), (64, 256, 512, 0), (5, 40, 24, 16)])
def test_head_linear_strided_matches_torch_and_is_row_invariant(k, dtype, heads, n, kdim, extra):
    g = _gen(heads + n)
    q = _randn(g, 300, heads, kdim + extra, std=kdim ** -0.5, dtype=dtype)
    x = q[..., :kdim]  # the model's view: last dim contiguous, other strides those of q
    w = _randn(g, heads, n, kdim, dtype=dtype)
    big = k.linear.head_linear(x, w)
    assert big.shape == (300, heads, n) and big.dtype == dtype
    _close(big, torch_ops.head_linear(x.float(), w.float()), dtype)
    for rows in _slices(300):
        assert torch.equal(k.linear.head_linear(x[rows], w), big[rows]), f"rows {rows}"
    assert torch.equal(k.linear.head_linear(x, w), big)


# -------------------------------------------------------------------------------------------- norms

@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [6144, 512, 100])
def test_norms_match_torch_and_are_row_invariant(k, dtype, d):
    g = _gen(d)
    x = _randn(g, 300, d, std=3.0, dtype=dtype)
    weight = _randn(g, d, dtype=dtype)
    bias = _randn(g, d, dtype=dtype)
    rms = k.norm.rms_norm(x, weight, 1e-6)
    ln = k.norm.layer_norm(x, weight, bias, 1e-5)
    assert rms.dtype == torch.promote_types(weight.dtype, x.dtype) and ln.dtype == x.dtype
    _close(rms, torch_ops.rms_norm(x, weight, 1e-6), dtype)
    _close(ln, torch_ops.layer_norm(x.float(), weight.float(), bias.float(), 1e-5), dtype)
    for rows in _slices(300):
        assert torch.equal(k.norm.rms_norm(x[rows], weight, 1e-6), rms[rows])
        assert torch.equal(k.norm.layer_norm(x[rows], weight, bias, 1e-5), ln[rows])
    assert torch.equal(k.norm.rms_norm(x, weight, 1e-6), rms)


def test_rms_norm_mixed_dtypes(k):
    g = _gen(3)
    x = _randn(g, 33, 512, dtype=torch.bfloat16)
    w32 = _randn(g, 512)
    out = k.norm.rms_norm(x, w32, 1e-6)
    assert out.dtype == torch.float32
    _close(out, torch_ops.rms_norm(x, w32, 1e-6), torch.bfloat16)
    x3 = _randn(g, 4, 9, 128, dtype=torch.bfloat16)  # leading dims flattened
    w = _randn(g, 128, dtype=torch.bfloat16)
    assert torch.equal(k.norm.rms_norm(x3, w, 1e-6)[1:3], k.norm.rms_norm(x3[1:3], w, 1e-6))


# ------------------------------------------------------------------------------------------ indexer

@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,d", [(32, 128), (4, 80)])
def test_index_scores_matches_torch_and_is_invariant(k, dtype, heads, d):
    g = _gen(heads * d)
    t, n = 300, 1000
    q = _randn(g, t, heads, d, dtype=dtype)
    hw = _randn(g, t, heads, std=heads ** -0.5)
    keys = _randn(g, n, d, dtype=dtype)
    scale = d ** -0.5
    big = k.indexer.index_scores(q, hw, keys, scale)
    assert big.dtype == torch.float32 and big.shape == (t, n)
    # bf16 products are exact in fp32: the bf16 kernel is held to the fp32 tolerance
    torch.testing.assert_close(big, torch_ops.index_scores(q.float(), hw, keys.float(), scale), **FP32_TOL)
    for rows in _slices(t):
        assert torch.equal(k.indexer.index_scores(q[rows], hw[rows], keys, scale), big[rows]), f"queries {rows}"
    for prefix in (1, 7, 128, 129, 999):
        assert torch.equal(k.indexer.index_scores(q, hw, keys[:prefix], scale), big[:, :prefix]), f"keys[:{prefix}]"
    assert torch.equal(k.indexer.index_scores(q[5:6], hw[5:6], keys[:77], scale), big[5:6, :77])
    assert torch.equal(k.indexer.index_scores(q, hw, keys, scale), big)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_index_scores_causal_in_the_kernel_equals_the_mask_after_it(k, dtype):
    """GLM-5.3's indexer (32 x 128): the mask in the kernel and the future tiles skipped give the
    unmasked kernel's bits with -inf over the future: a turn after 13504 positions, a first piece,
    a DCP rank's strided positions."""
    g = _gen(77)
    t, n, heads, d = 700, 3000, 32, 128
    q = _randn(g, t, heads, d, dtype=dtype)
    hw = _randn(g, t, heads, std=heads ** -0.5)
    keys = _randn(g, n, d, dtype=dtype)
    plain = k.indexer.index_scores(q, hw, keys, d ** -0.5)
    dev = q.device
    for qpos, kpos in ((torch.arange(2300, 2300 + t, device=dev), None), (torch.arange(t, device=dev), None),
                       (torch.arange(9000, 9000 + t, device=dev), torch.arange(1, 4 * n, 4, device=dev))):
        got = k.indexer.index_scores(q, hw, keys, d ** -0.5, qpos, kpos)
        kp = torch.arange(n, device=dev) if kpos is None else kpos
        assert torch.equal(got, plain.masked_fill(kp[None, :] > qpos[:, None], float("-inf")))
    keys[100, 3] = float("nan")  # NaN kept, as torch.relu keeps it: the selection's check sees it
    got = k.indexer.index_scores(q, hw, keys, d ** -0.5, torch.arange(t, device=dev))
    assert got[100:, 100].isnan().all() and (got[:100, 100] == float("-inf")).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_index_scores_of_many_windows_in_one_launch_equal_each_alone(k, dtype):
    """A batched step's indexer (32 x 128): 16 decode rows and 4 windows of 4 rows over their own keys
    in a store (contexts of 1..19k, the shorter tables padded): each row's scores the bits of its window
    alone over its own keys, -inf past them, and the top-k over the padded rows each row's alone; the
    same over a DCP rank's key positions."""
    from glm53.model.indexer import select_topk

    g = _gen(91)
    heads, d, slots = 32, 128, 40000
    store = _randn(g, slots, d, dtype=dtype)
    for per, contexts in ((1, [1, 5, 300, 2047, 2048, 4097, 19000, 777] * 2), (4, [4, 3000, 19000, 12345])):
        b = len(contexts)
        q = _randn(g, b * per, heads, d, dtype=dtype)
        hw = _randn(g, b * per, heads, std=heads ** -0.5)
        qpos = torch.cat([torch.arange(n - per, n, device="cuda") for n in contexts])
        table = torch.zeros(b, max(contexts), dtype=torch.long, device="cuda")
        for i, n in enumerate(contexts):
            table[i, :n] = torch.randperm(slots, generator=g, device="cuda")[:n]
        got = k.indexer.index_scores_spans(q, hw, store, d ** -0.5, qpos, table)
        chosen = select_topk(got, 2048)
        for i, n in enumerate(contexts):
            rows = slice(i * per, (i + 1) * per)
            alone = k.indexer.index_scores(q[rows], hw[rows], store, d ** -0.5, qpos[rows], None, table[i, :n])
            assert torch.equal(got[rows, :n], alone), f"window {i} ({per} rows, {n} keys)"
            assert (got[rows, n:] == float("-inf")).all(), f"window {i}: keys past its own not -inf"
            mine = select_topk(alone, 2048)
            assert torch.equal(chosen.indices[rows], mine.indices) and torch.equal(chosen.valid[rows], mine.valid), \
                f"window {i}: the selection over padded rows differs from its own"
        # a DCP rank's keys (rank 2 of 4: position 4n + 2), the windows' queries at their own positions
        kpos = torch.arange(max(contexts), device="cuda") * 4 + 2
        qpos4 = torch.cat([torch.arange(4 * n - per, 4 * n, device="cuda") for n in contexts])
        got = k.indexer.index_scores_spans(q, hw, store, d ** -0.5, qpos4, table, kpos)
        for i, n in enumerate(contexts):
            rows = slice(i * per, (i + 1) * per)
            alone = k.indexer.index_scores(q[rows], hw[rows], store, d ** -0.5, qpos4[rows], kpos[:n], table[i, :n])
            assert torch.equal(got[rows, :n], alone) and (got[rows, n:] == float("-inf")).all(), f"DCP window {i}"


# ---------------------------------------------------------------------------------------- attention

def _selection(g: torch.Generator, t: int, n_rows: int, slots: int,
               p_valid: float) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, n_rows, (t, slots), generator=g, device="cuda")
    valid = torch.rand(t, slots, generator=g, device="cuda") < p_valid
    valid[3] = False  # a query with no valid slot
    valid[4, 1:] = False  # a query with one
    idx = torch.where(valid, idx, torch.full_like(idx, -1))  # invalid slots point nowhere: never read
    return idx, valid


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,d,dv,slots", [(64, 576, 512, 2048), (64, 576, 512, 100), (4, 80, 64, 37)])
def test_latent_attention_matches_torch_and_is_invariant(k, dtype, heads, d, dv, slots):
    g = _gen(heads + d + slots)
    t, n_rows = 40, 5000
    q = _randn(g, t, heads, d, dtype=dtype)
    rows = _randn(g, n_rows, d, dtype=dtype)
    idx, valid = _selection(g, t, n_rows, slots, 0.7)
    scale = d ** -0.5
    out, lse = k.attention.latent_attention(q, rows, idx, valid, scale, dv)
    assert out.shape == (t, heads, dv) and out.dtype == dtype and lse.shape == (t, heads) and lse.dtype == torch.float32
    ref_out, ref_lse = torch_ops.latent_attention(q.float(), rows.float(), idx.clamp(min=0), valid, scale, dv)
    _close(out, ref_out, dtype)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool((lse[3] == float("-inf")).all())
    for qs in [slice(0, 1), slice(3, 4), slice(39, 40), slice(2, 9), slice(5, 40)]:
        o, s = k.attention.latent_attention(q[qs], rows, idx[qs], valid[qs], scale, dv)
        assert torch.equal(o, out[qs]) and torch.equal(s, lse[qs]), f"queries {qs}"
    # a wider selection whose extra slots are invalid changes nothing, bit for bit
    pad = 45
    idx_w = torch.cat([idx, torch.full((t, pad), -1, dtype=idx.dtype, device="cuda")], 1)
    valid_w = torch.cat([valid, torch.zeros(t, pad, dtype=torch.bool, device="cuda")], 1)
    o, s = k.attention.latent_attention(q, rows, idx_w, valid_w, scale, dv)
    assert torch.equal(o, out) and torch.equal(s, lse), "trailing invalid slots changed the result"
    o, s = k.attention.latent_attention(q, rows, idx, valid, scale, dv)
    assert torch.equal(o, out) and torch.equal(s, lse), "not deterministic"


@pytest.mark.parametrize("heads,d,dv,dtype", [(64, 576, 512, torch.bfloat16), (64, 576, 512, torch.float32),
                                              (4, 80, 64, torch.bfloat16), (16, 576, 512, torch.bfloat16)],
                         ids=["glm53-bf16", "glm53-fp32", "tiny-bf16", "dcp4-heads-bf16"])
def test_latent_attention_split_gives_the_prefill_bits(k, heads, d, dv, dtype, monkeypatch):
    """Short windows (decode, verification) run the split kernels: on this device they must agree with
    the prefill kernel bit for bit (else the engine falls back to the slower prefill kernel: this
    test says so), for T = 1..16 queries, dense and sparse selections, at any offset."""
    ta = k.attention
    assert ta.split_choice(heads, d, dv, dtype, dtype, torch.device("cuda")) is not None, "no split config agrees here"
    split_calls = []
    run_split = ta._run_split
    monkeypatch.setattr(ta, "_run_split", lambda *a, **kw: (split_calls.append(a[0].shape[0]), run_split(*a, **kw)))
    g = _gen(heads + d)
    t, n_rows, slots = 40, 6000, 2048
    q = _randn(g, t, heads, d, std=d ** -0.5, dtype=dtype)
    rows = _randn(g, n_rows, d, dtype=dtype)
    for every in (1, 4):  # every 4th slot valid: a DCP rank's share of the selection
        idx, valid = _selection(g, t, n_rows, slots, 1.0)
        keep = torch.zeros(slots, dtype=torch.bool, device="cuda")
        keep[::every] = True
        valid &= keep
        valid[7, 1000:] = False  # a short context: its loop stops early
        idx = idx.clamp(min=0)
        whole = ta.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=False)
        for n in (1, 2, 5, 16):
            for o in (0, 3, 7, t - n):
                part = ta.latent_attention(q[o:o + n], rows, idx[o:o + n], valid[o:o + n], d ** -0.5, dv, split=True)
                assert torch.equal(part[0], whole[0][o:o + n]) and torch.equal(part[1], whole[1][o:o + n]), \
                    f"split != prefill kernel: T={n} at {o}, every {every}"
                split_calls.clear()
                auto = ta.latent_attention(q[o:o + n], rows, idx[o:o + n], valid[o:o + n], d ** -0.5, dv)
                assert torch.equal(auto[0], part[0]) and torch.equal(auto[1], part[1])
                assert split_calls == [n], f"T={n}: the default dispatch did not take the split kernels"
        split_calls.clear()
        ta.latent_attention(q[:ta.SPLIT_ROWS + 1], rows, idx[:ta.SPLIT_ROWS + 1], valid[:ta.SPLIT_ROWS + 1],
                            d ** -0.5, dv)
        assert split_calls == [], "a prefill-sized call took the split kernels"


@pytest.mark.parametrize("heads,d,dv", [(64, 576, 512), (16, 576, 512), (4, 80, 64)],
                         ids=["glm53", "dcp4-heads", "tiny"])
def test_latent_attention_prefix_form_keeps_bits(k, heads, d, dv):
    """The engine's calls give validity as a prefix (Selection's form): where prefix_choice allows it
    (checked on the device) the kernels compare with each row's end instead of loading the mask.
    Either way a call gives the bits of the loaded form, in prefill and in short windows; GLM-5.3's
    shape takes the faster form on the H200."""
    ta = k.attention
    dtype, dev = torch.bfloat16, torch.device("cuda")
    chosen = ta.prefix_choice(heads, d, dv, dtype, dtype, dev)
    if heads == 64:
        assert chosen, "GLM-5.3's shape does not take the prefix form here"
    g = _gen(heads * 7 + d)
    t, n_rows, slots = 40, 6000, 2048
    q = _randn(g, t, heads, d, std=d ** -0.5, dtype=dtype)
    rows = _randn(g, n_rows, d, dtype=dtype)
    counts = torch.randint(0, slots + 1, (t, 1), generator=g, device="cuda")
    counts[:10] = slots
    valid = torch.arange(slots, device="cuda")[None, :] < counts
    idx = torch.where(valid, torch.randint(0, n_rows, (t, slots), generator=g, device="cuda"), 0)
    for a, b in ((0, t), (3, 4), (9, 10)):  # the prefill kernel, then short windows (split where it agrees)
        want = ta.latent_attention(q[a:b], rows, idx[a:b], valid[a:b], d ** -0.5, dv)
        got = ta.latent_attention(q[a:b], rows, idx[a:b], valid[a:b], d ** -0.5, dv, valid_prefix=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (a, b, chosen)


@pytest.mark.parametrize("index", range(5), ids=["preferred", "16-slots", "16-slots-unpipelined", "32-heads",
                                                  "smallest"])
def test_latent_attention_each_candidate_config_is_exact(k, index, monkeypatch, capsys):
    """A GPU with less shared memory a block than the H200 runs a later candidate config (GB10: not
    the first; tests/test_triton_compile.py says which fits there). Each, forced here, is close to
    torch, row-invariant bit for bit across query slices and trailing invalid slots, and a short
    window's default path gives the prefill kernel's bits (the split where it agrees on this device,
    else the prefill kernel itself: said on stderr)."""
    ta = k.attention
    candidate = ta.attention_candidates(64, 576, 512, torch.bfloat16)[index]
    monkeypatch.setattr(ta, "attention_candidates", lambda *a: [candidate])
    monkeypatch.setattr(ta, "_FITTED", {})
    monkeypatch.setattr(ta, "_CHOSEN", {})
    test_latent_attention_matches_torch_and_is_invariant(k, torch.bfloat16, 64, 576, 512, 2048)
    assert list(ta._FITTED.values()) == [candidate]
    g = _gen(77 + index)
    t, n_rows, slots, d, dv = 24, 6000, 2048, 576, 512
    q = _randn(g, t, 64, d, std=d ** -0.5, dtype=torch.bfloat16)
    rows = _randn(g, n_rows, d, dtype=torch.bfloat16)
    idx, valid = _selection(g, t, n_rows, slots, 0.9)
    idx = idx.clamp(min=0)
    whole = ta.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=False)
    for n in (1, 5, 16):
        for o in (0, 3, t - n):
            part = ta.latent_attention(q[o:o + n], rows, idx[o:o + n], valid[o:o + n], d ** -0.5, dv)
            assert torch.equal(part[0], whole[0][o:o + n]) and torch.equal(part[1], whole[1][o:o + n]), (n, o)
    chosen = ta.split_choice(64, d, dv, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
    with capsys.disabled():
        print(f"\ncandidate {candidate}: split config {chosen} (None: short windows run the prefill kernel)")


@pytest.mark.parametrize("config", [(64, 64, 8), (64, 16, 8)], ids=["preferred", "16-slots"])
def test_latent_attention_pipelining_keeps_bits(k, config, monkeypatch):
    """A config and its unpipelined twin (1 stage: a later candidate, for a GPU whose compiler needs
    more shared memory for the pipelined one) give the same bits: the stages only decide when the
    gathered rows are copied, not the arithmetic."""
    ta = k.attention
    g = _gen(91)
    t, n_rows, slots, d, dv = 40, 6000, 2048, 576, 512
    q = _randn(g, t, 64, d, std=d ** -0.5, dtype=torch.bfloat16)
    rows = _randn(g, n_rows, d, dtype=torch.bfloat16)
    idx, valid = _selection(g, t, n_rows, slots, 0.9)
    idx = idx.clamp(min=0)
    outs = []
    for stages in (2, 1):
        monkeypatch.setattr(ta, "attention_candidates", lambda *a, s=stages: [(*config, s)])
        monkeypatch.setattr(ta, "_FITTED", {})
        outs.append(ta.latent_attention(q, rows, idx, valid, d ** -0.5, dv, split=False))
        assert list(ta._FITTED.values()) == [(*config, stages)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_latent_attention_all_invalid_and_empty(k):
    g = _gen(11)
    q = _randn(g, 3, 64, 576, dtype=torch.bfloat16)
    rows = _randn(g, 10, 576, dtype=torch.bfloat16)
    idx = torch.zeros(3, 50, dtype=torch.int64, device="cuda")
    out, lse = k.attention.latent_attention(q, rows, idx, torch.zeros(3, 50, dtype=torch.bool, device="cuda"),
                                            0.04, 512)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    out, lse = k.attention.latent_attention(q, rows, idx[:, :0], torch.zeros(3, 0, dtype=torch.bool, device="cuda"),
                                            0.04, 512)
    assert out.shape == (3, 64, 512) and not out.any() and bool((lse == float("-inf")).all())
    out, lse = k.attention.latent_attention(q[:0], rows, idx[:0], torch.zeros(0, 50, dtype=torch.bool,
                                                                                device="cuda"), 0.04, 512)
    assert out.shape == (0, 64, 512) and lse.shape == (0, 64)


def test_empty_rows(k):
    w = torch.ones(64, 32, device="cuda", dtype=torch.bfloat16)
    assert k.linear.linear(torch.ones(0, 32, device="cuda", dtype=torch.bfloat16), w).shape == (0, 64)
    assert k.linear.head_linear(torch.ones(0, 2, 32, device="cuda", dtype=torch.bfloat16),
                                torch.ones(2, 8, 32, device="cuda", dtype=torch.bfloat16)).shape == (0, 2, 8)
    assert k.norm.rms_norm(torch.ones(0, 32, device="cuda"), torch.ones(32, device="cuda"), 1e-6).shape == (0, 32)
    s = k.indexer.index_scores(torch.ones(2, 4, 16, device="cuda"), torch.ones(2, 4, device="cuda"),
                               torch.ones(0, 16, device="cuda"), 1.0)
    assert s.shape == (2, 0)
    assert math.isfinite(float(k.linear.linear(torch.ones(1, 32, device="cuda", dtype=torch.bfloat16), w)[0, 0]))
