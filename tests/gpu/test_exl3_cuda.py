"""The EXL3 kernels (glm53/ops/triton_exl3.py) on CUDA, from the packed trellis.

- The decoder inside the kernels (PTX on the GPU) gives glm53.exl3.decode's values bit for bit, every
  codebook and width, lane and element forms.
- Row invariance: every form gives a row the same bits (the parallel split form for <= 16 rows, the full
  form at the prefill tile; the MLP's token-grouped decode form and its expert-sorted prefill form), and
  a CUDA graph replay gives an eager call's bits.
- Against the reference, x @ decode_weight in fp32: within TOL (bf16 activations and outputs); fp32 models
  against the format's exact weight (dequantize_exact) within FP32_TOL; a padded output (kv_a's 576 of 640)
  and a widened input.

    pytest -m gpu tests/gpu/test_exl3_cuda.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm53.exl3.bank import BankBuilder  # noqa: E402
from glm53.exl3.decode import decode_rotated, decode_weight, dequantize_exact  # noqa: E402
from glm53.exl3.format import read_group  # noqa: E402

pytestmark = pytest.mark.gpu

# |got - ref| against x @ W in fp32: max within MAX_REL of the reference's largest value, RMS within
# RMS_REL of its RMS (bf16 outputs round at 2^-9; fp16 activations at 2^-11)
TOL = dict(max_rel=2e-2, rms_rel=6e-3)
FP32_TOL = dict(max_rel=1e-4, rms_rel=2e-5)
CASES = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in (2.0, 3.0, 4.0)] + [("mul1", 2.5), ("mul1", 3.5)]
MARKERS = {"mcg": 0xCBAC1FED - (1 << 32), "mul1": 0x83DCD12D - (1 << 32)}


@pytest.fixture(scope="module")
def tx():
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    from glm53.ops import triton_exl3

    torch.backends.cuda.matmul.allow_tf32 = False
    return triton_exl3


def random_group(in_f: int, out_f: int, bits: float, codebook: str, seed: int, prefix: str = "g"):
    """Random trellis bits, sign vectors scaled so outputs stay near 1 (svh by in^-1/2)."""
    gen = torch.Generator().manual_seed(seed)
    parts = {
        "trellis": torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, int(16 * bits)), generator=gen,
                                 dtype=torch.int32).to(torch.int16),
        "suh": ((torch.rand(in_f, generator=gen) + 0.5) * (torch.randint(0, 2, (in_f,), generator=gen) * 2 - 1)).half(),
        "svh": ((torch.rand(out_f, generator=gen) + 0.5) * in_f ** -0.5
                * (torch.randint(0, 2, (out_f,), generator=gen) * 2 - 1)).half(),
    }
    if codebook in MARKERS:
        parts[codebook] = torch.tensor(MARKERS[codebook], dtype=torch.int32)
    return read_group({f"{prefix}.{k}": v for k, v in parts.items()}, prefix)


def bank_of(*groups):
    b = BankBuilder()
    idx = [b.add_group(g) for g in groups]
    return b.build("cuda"), idx


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: dict, what: str) -> None:
    err = (got.float() - ref.float()).abs()
    scale_max, scale_rms = float(ref.abs().max()), float(ref.float().pow(2).mean().sqrt())
    max_rel, rms_rel = float(err.max()) / scale_max, float(err.pow(2).mean().sqrt()) / scale_rms
    print(f"{what}: max_rel {max_rel:.2e} rms_rel {rms_rel:.2e}")
    assert max_rel <= tol["max_rel"] and rms_rel <= tol["rms_rel"], (
        f"{what}: max_rel {max_rel:.2e} (tol {tol['max_rel']}), rms_rel {rms_rel:.2e} (tol {tol['rms_rel']})")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-K{c[1]:g}")
def test_kernel_decoder_gives_the_reference_values(tx, case):
    codebook, bits = case
    group = random_group(256, 384, bits, codebook, seed=int(bits * 10) + len(codebook))
    bank, (m,) = bank_of(group)
    want = decode_rotated(group.trellis.cuda(), bits, codebook).view(torch.int16)
    for form in (tx.DECODE, tx.Form(16, 4, 1, False, 32), tx.Form(16, 4, 1, True, 32), tx.Form(16, 4, 1, True, 64),
                 tx.Form(16, 4, 1, False, 32, ptx=True)):
        got = tx.dequant(bank, m, form).view(torch.int16)
        assert torch.equal(got, want), f"{form}: {int((got != want).sum())} of {want.numel()} values differ"


def test_kernel_decoder_at_glm53_shape(tx):
    group = random_group(6144, 2048, 3.0, "mcg", seed=11)
    bank, (m,) = bank_of(group)
    assert torch.equal(tx.dequant(bank, m).view(torch.int16),
                       decode_rotated(group.trellis.cuda(), 3.0, "mcg").view(torch.int16))


@pytest.mark.parametrize("shape", [(6144, 2048), (2048, 6144), (512, 640)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_forms_agree_bitwise_and_match_the_reference(tx, shape):
    in_f, out_f = shape
    group = random_group(in_f, out_f, 3.0, "mcg", seed=in_f + out_f)
    bank, (m,) = bank_of(group)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(150, in_f, generator=g, device="cuda").to(torch.bfloat16)
    full = tx.linear(x, bank, m)  # 150 rows: the full form at the prefill tile (or the decode tile, see forms_agree)
    for a, n in ((0, 1), (1, 1), (149, 1), (3, 7), (20, 16), (64, 13)):
        assert torch.equal(tx.linear(x[a:a + n], bank, m), full[a:a + n]), f"rows [{a}, {a + n})"
    for form in (tx.Form(16, 4, 1, False, 32, parallel=True, prefetch=True),
                 tx.Form(16, 4, 1, False, 32, parallel=True, ptx=True, prefetch=True)):
        assert torch.equal(tx.linear(x[:16], bank, m, form=form), full[:16]), f"{form}"
    prefill = tx.prefill_form(bank, x.dtype)
    assert 0 < prefill.stage_rows <= 150, "150 rows: the staged full form"
    for form in (tx.dataclasses.replace(prefill, stage_rows=0), tx.dataclasses.replace(prefill, bm=16, stage_rows=1)):
        assert torch.equal(tx.linear(x, bank, m, form=form), full), f"{form} vs the staged prefill form"
    assert torch.equal(tx.linear(x, bank, m), full), "the same call twice"
    ref = x.float() @ decode_weight(group, "cuda").float()
    assert_close(full, ref, TOL, f"linear {in_f}x{out_f} bf16")


def test_linear_trims_padded_outputs_and_widens_inputs(tx):
    """kv_a's shape in an exllamav3 pack: 576 outputs padded to 640; and an input that is 320 of 512 columns."""
    group = random_group(512, 640, 4.0, "mul1", seed=5)
    bank, (m,) = bank_of(group)
    g = torch.Generator(device="cuda").manual_seed(2)
    w = decode_weight(group, "cuda").float()
    x = torch.randn(9, 512, generator=g, device="cuda").to(torch.bfloat16)
    got = tx.linear(x, bank, m, out_start=0, out_features=576)
    assert got.shape == (9, 576)
    assert_close(got, (x.float() @ w)[:, :576], TOL, "trimmed to 576")
    part = x[:, :320]
    got = tx.linear(part, bank, m, in_start=64)
    assert_close(got, part.float() @ w[64:384], TOL, "input columns [64, 384)")


def test_linear_in_fp32(tx):
    group = random_group(2048, 1024, 2.5, "mul1", seed=9)
    bank, (m,) = bank_of(group)
    x = torch.randn(5, 2048, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda")
    # the format's weight in fp64, not decode_weight: exllamav3's reconstruction rounds W to fp16 (~2^-11)
    ref = (x.double() @ dequantize_exact(group).cuda()).float()
    assert_close(tx.linear(x, bank, m), ref, FP32_TOL, "linear fp32")


@pytest.fixture(scope="module")
def layer(tx):
    """A MoE layer of GLM-5.3's widths with 16 experts of mixed K (2, 3, 4 per projection) and a shared expert."""
    b = BankBuilder()
    hidden, width, experts = 6144, 2048, 16
    groups = {}
    for p, (i, o) in (("gate", (hidden, width)), ("up", (hidden, width)), ("down", (width, hidden))):
        groups[p] = [random_group(i, o, (2.0, 3.0, 4.0)[(e + len(p)) % 3], "mcg", seed=100 * e + len(p))
                     for e in range(experts)]
    first = {p: b.add_group(groups[p][0]) for p in ("gate",)}
    for g in groups["gate"][1:]:
        b.add_group(g)
    first["up"] = b.add_group(groups["up"][0])
    for g in groups["up"][1:]:
        b.add_group(g)
    first["down"] = b.add_group(groups["down"][0])
    for g in groups["down"][1:]:
        b.add_group(g)
    shared = (b.add_group(random_group(hidden, width, 4.0, "mcg", seed=7)),
              b.add_group(random_group(hidden, width, 4.0, "mcg", seed=8)),
              b.add_group(random_group(width, hidden, 3.0, "mcg", seed=9)))
    bank = b.build("cuda")
    mats = tx.MlpMatrices(first["gate"], first["up"], first["down"], experts, shared, width, hidden)
    return bank, mats


def _routing(t: int, experts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:8] for _ in range(t)])
    return ids, torch.rand(t, 8, generator=g, device="cuda") * 0.3


def test_mlp_decode_form_equals_prefill_form_bitwise(tx, layer):
    bank, mats = layer
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(40, mats.hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids, w = _routing(40, mats.n_experts, 5)
    full = tx.mlp(x, bank, mats, ids, w)  # 40 tokens: the expert-sorted form
    for a, n in ((0, 1), (7, 1), (3, 4), (20, 16), (39, 1)):
        assert torch.equal(tx.mlp(x[a:a + n], bank, mats, ids[a:a + n], w[a:a + n]), full[a:a + n]), f"tokens [{a}, {a + n})"
    from glm53.ops import exl3_torch

    ref = exl3_torch.mlp(x[:8].float(), bank, mats, ids[:8], w[:8])
    assert_close(full[:8], ref, dict(max_rel=4e-2, rms_rel=1.5e-2), "mlp bf16 vs the fp32 torch path")
    for name in ("count", "count_tokens"):
        assert int(tx.SCRATCH.buffers[(name, x.device)].abs().sum()) == 0, f"{name} counters left non-zero"


def test_mlp_staged_prefill_equals_unstaged_bitwise(tx, layer):
    """300 tokens (300 * 8 / 16 = 150 rows an expert): every expert decoded once into the stage, over
    several passes of a two-expert stage; and the shared expert alone staged: the unstaged form's bits."""
    bank, mats = layer
    t = 300
    x = torch.randn(t, mats.hidden, generator=torch.Generator(device="cuda").manual_seed(12), device="cuda")
    x = x.to(torch.bfloat16)
    ids, w = _routing(t, mats.n_experts, 13)
    prefill = tx.prefill_form(bank, x.dtype)
    plain = tx.mlp(x, bank, mats, ids, w, form=tx.dataclasses.replace(prefill, stage_rows=0))
    expert_bytes = 2 * 3 * mats.hidden * mats.width
    for stage_rows, passes in ((128, 9), (200, 1)):
        form = tx.dataclasses.replace(prefill, stage_rows=stage_rows)
        assert len(tx.stage_passes(bank, mats, t, 8, stage_rows, 2 * expert_bytes)) == passes
        got = tx.mlp(x, bank, mats, ids, w, form=form, stage_bytes=2 * expert_bytes)
        assert torch.equal(got, plain), f"staged from {stage_rows} rows in {passes} passes"


def test_dense_mlp_is_the_shared_expert_alone(tx, layer):
    bank, mats = layer
    dense = tx.MlpMatrices(0, 0, 0, 0, mats.shared, mats.width, mats.hidden)
    x = torch.randn(20, mats.hidden, generator=torch.Generator(device="cuda").manual_seed(6), device="cuda")
    x = x.to(torch.bfloat16)
    none = torch.zeros(20, 0, dtype=torch.int64, device="cuda")
    full = tx.mlp(x, bank, dense, none, None)
    assert torch.equal(tx.mlp(x[:5], bank, dense, none[:5], None), full[:5])


def test_mlp_graph_replay_equals_eager(tx, layer):
    bank, mats = layer
    t = 4
    x = torch.randn(t, mats.hidden, generator=torch.Generator(device="cuda").manual_seed(8), device="cuda")
    x = x.to(torch.bfloat16)
    ids, w = _routing(t, mats.n_experts, 9)
    eager = tx.mlp(x, bank, mats, ids, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = tx.mlp(x, bank, mats, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (10, 11):
        new_ids, new_w = _routing(t, mats.n_experts, seed)
        x2 = torch.randn(t, mats.hidden, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
        x.copy_(x2.to(torch.bfloat16))
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, tx.mlp(x, bank, mats, ids, w)), f"replay {seed}"
    assert torch.equal(tx.mlp(x, bank, mats, ids, w), tx.mlp(x, bank, mats, ids, w))
    del eager


def _cuda_form(tx):
    from glm53.ops import cuda_exl3

    why = cuda_exl3.unavailable(torch.device("cuda"))
    assert why is None, f"the CUDA split sums cannot run here: {why}"
    return tx.DECODE_CUDA


def _counters_are_zero(tx) -> None:
    for name in ("count", "count_tokens"):
        buf = tx.SCRATCH.buffers[(name, torch.device("cuda", torch.cuda.current_device()))]
        assert int(buf.abs().sum()) == 0, f"{name} counters left non-zero"


def _small_moe(tx, codebook: str, widths: tuple[float, ...], hidden: int = 1152, width: int = 384, experts: int = 6):
    """A MoE bank of one codebook: hidden 1152 = 9 steps (splits of 8 and 1), experts' K cycling `widths`."""
    b = BankBuilder()
    first = {}
    for p, (i, o) in (("gate", (hidden, width)), ("up", (hidden, width)), ("down", (width, hidden))):
        for e in range(experts):
            m = b.add_group(random_group(i, o, widths[(e + len(p)) % len(widths)], codebook, seed=31 * e + len(p)))
            first.setdefault(p, m)
    shared = tuple(b.add_group(random_group(i, o, widths[0], codebook, seed=90 + n))
                   for n, (i, o) in enumerate(((hidden, width), (hidden, width), (width, hidden))))
    return b.build("cuda"), tx.MlpMatrices(first["gate"], first["up"], first["down"], experts, shared, width, hidden)


@pytest.mark.parametrize("codebook,widths", [("3inst", (2.0, 3.0, 4.0)), ("mcg", (4.0, 2.0)),
                                             ("mul1", (2.5, 3.5, 3.0))], ids=lambda v: str(v))
def test_cuda_split_sums_give_the_triton_decode_form_bits(tx, codebook, widths):
    """Form.cuda (the split sums by exl3_parts.cu) against the Triton parallel form, bit for bit: every
    codebook and width (half-integer K included), a short last split, 1 to 16 tokens, shared experts
    between tokens, unweighted, and the dense MLP."""
    bank, mats = _small_moe(tx, codebook, widths)
    g = torch.Generator(device="cuda").manual_seed(21)
    dense = tx.MlpMatrices(0, 0, 0, 0, mats.shared, mats.width, mats.hidden)
    form = _cuda_form(tx)
    for t, k in ((1, 4), (3, 4), (16, 4), (5, 6)):
        x = torch.randn(t, mats.hidden, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(mats.n_experts, generator=g, device="cuda")[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g, device="cuda")
        for weights in (w, None):
            want = tx.mlp(x, bank, mats, ids, weights, form=tx.DECODE)
            got = tx.mlp(x, bank, mats, ids, weights, form=form)
            assert torch.equal(got, want), f"T={t} K={k} weighted={weights is not None}: " \
                f"{int((got != want).sum())} of {want.numel()} values differ"
    x = torch.randn(7, mats.hidden, generator=g, device="cuda").to(torch.bfloat16)
    none = torch.zeros(7, 0, dtype=torch.int64, device="cuda")
    assert torch.equal(tx.mlp(x, bank, dense, none, None, form=form),
                       tx.mlp(x, bank, dense, none, None, form=tx.DECODE)), "the dense MLP"
    _counters_are_zero(tx)
    for m in (mats.gate0 + 1, mats.down0 + 2, mats.shared[2]):  # single linears: 1, 5 and 16 rows
        lay = bank.layouts[m]
        x = torch.randn(16, lay.in_read, generator=g, device="cuda").to(torch.bfloat16)
        for n in (1, 5, 16):
            assert torch.equal(tx.linear(x[:n], bank, m, form=form), tx.linear(x[:n], bank, m, form=tx.DECODE)), \
                f"linear {lay.in_read}x{lay.out_read}, {n} rows"
        out = tx.linear(x[:3, :200], bank, m, in_start=64, out_start=128, out_features=100, form=form)
        assert torch.equal(out, tx.linear(x[:3, :200], bank, m, in_start=64, out_start=128, out_features=100,
                                          form=tx.DECODE)), "a widened input and trimmed output"
    assert tx.decode_form(bank, torch.bfloat16, mats=mats) == tx.DECODE_CUDA, "the CUDA form is not the default"


def test_cuda_split_sums_at_glm53_widths_and_in_a_graph(tx, layer):
    """The 16-expert layer of GLM-5.3's widths (mixed K): the CUDA form's bits equal the Triton decode form's
    and the expert-sorted prefill form's rows; a captured graph's replays give the eager call's bits."""
    bank, mats = layer
    g = torch.Generator(device="cuda").manual_seed(14)
    x = torch.randn(40, mats.hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids, w = _routing(40, mats.n_experts, 15)
    full = tx.mlp(x, bank, mats, ids, w)
    form = _cuda_form(tx)
    for a, n in ((0, 1), (9, 4), (20, 16)):
        got = tx.mlp(x[a:a + n], bank, mats, ids[a:a + n], w[a:a + n], form=form)
        assert torch.equal(got, full[a:a + n]), f"tokens [{a}, {a + n})"
    _counters_are_zero(tx)
    t = 4
    xs, ids_s, w_s = x[:t].clone(), ids[:t].clone(), w[:t].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        tx.mlp(xs, bank, mats, ids_s, w_s, form=form)  # the library loaded, the finish kernels compiled
        with torch.cuda.graph(graph, stream=stream):
            out = tx.mlp(xs, bank, mats, ids_s, w_s, form=form)
    torch.cuda.current_stream().wait_stream(stream)
    for a in (10, 30):
        xs.copy_(x[a:a + t])
        ids_s.copy_(ids[a:a + t])
        w_s.copy_(w[a:a + t])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, full[a:a + t]), f"replay of tokens [{a}, {a + t})"
