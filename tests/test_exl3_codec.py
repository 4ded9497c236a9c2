"""EXL3 decode and encode on the CPU.

The golden data (tests/data/exl3_exllamav3_golden.safetensors) are exllamav3 1.6.5's own outputs
on an H200, written by tests/gpu/test_exl3_vs_exllamav3.py --golden: the trellis decode must equal
exllamav3's `ext.reconstruct` bit for bit (integer work and one table lookup: no float order
involved). The full weight adds fp32 Hadamard products whose summation order belongs to the BLAS
at hand; on the CPU it must agree within one fp16 rounding step (it matched bitwise where this was
written; on the GPU tests/gpu/ asserts bitwise).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm53.exl3.decode import apply_hadamards, codebook_table, decode_rotated, decode_weight, position_bits
from glm53.exl3.encode import encode_weight, encode_weights
from glm53.exl3.format import Exl3Error, read_group

GOLDEN = Path(__file__).parent / "data" / "exl3_exllamav3_golden.safetensors"
CASES = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in (2.0, 3.0, 4.0)] + [("mul1", 2.5), ("mul1", 3.5)]
# relative RMS error bounds of the greedy encoder on Gaussian weights (measured 0.59-0.68 at K=2,
# 0.38-0.48 at K=3, 0.26-0.34 at K=4, 0.50 at 2.5, 0.33 at 3.5); a random trellis gives about 1.4
ERROR_BOUND = {2.0: 0.75, 2.5: 0.6, 3.0: 0.55, 3.5: 0.42, 4.0: 0.4}


def _id(case: tuple[str, float]) -> str:
    return f"{case[0]}-K{case[1]:g}"


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN))


def _parts(golden: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k.split(".", 1)[1]: v for k, v in golden.items() if k.startswith(name + ".") and ".exllamav3_" not in k}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_trellis_decode_equals_exllamav3_bitwise(golden, case) -> None:
    codebook, bits = case
    name = f"{codebook}_K{int(bits * 10)}_random"
    parts = _parts(golden, name)
    ours = decode_rotated(parts["trellis"], bits, codebook)
    ref = golden[f"{name}.exllamav3_rotated"]
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_full_decode_matches_exllamav3(golden, case) -> None:
    codebook, bits = case
    name = f"{codebook}_K{int(bits * 10)}_encoded"
    group = read_group({f"g.{k}": v for k, v in _parts(golden, name).items()}, "g")
    assert (group.codebook, group.bits) == (codebook, bits)
    ours = decode_weight(group).float()
    ref = golden[f"{name}.exllamav3_full"].float()
    assert ours.shape == ref.shape == (128, 128)
    one_ulp = ref.abs().clamp_min(2.0**-14) * 2.0**-10
    assert ((ours - ref).abs() <= one_ulp).all()


def test_codebooks_have_the_format_spread() -> None:
    """3inst and mcg spread as exllamav3's codebook_scale (1.24371088) says; mul1 is unit-variance."""
    assert codebook_table("3inst").float().std().item() == pytest.approx(1.24371088, abs=1e-4)
    assert codebook_table("mcg").float().std().item() == pytest.approx(1.2441, abs=1e-3)
    assert codebook_table("mul1").float().std().item() == pytest.approx(1.0, abs=1e-3)
    for cb in ("3inst", "mcg", "mul1"):
        t = codebook_table(cb)
        assert t.dtype == torch.float16 and t.shape == (65536,) and torch.isfinite(t).all()


def test_stream_positions_cover_the_tile() -> None:
    for k in (2.0, 3.0, 4.0):
        assert position_bits(k) == [int(k)] * 256
    for k in (2.5, 3.5):
        steps = position_bits(k)
        assert steps[0::2] == [int(k)] * 128 and steps[1::2] == [int(k) + 1] * 128
        assert sum(steps) == 256 * k


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_round_trip_error_is_bounded(case) -> None:
    codebook, bits = case
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(7)) * 0.02  # non-square: orientation counts
    parts = encode_weight(w, bits, codebook, seed=1)
    assert parts["trellis"].shape == (8, 16, int(16 * bits)) and parts["trellis"].dtype == torch.int16
    group = read_group({f"g.{k}": v for k, v in parts.items()}, "g")
    assert (group.bits, group.codebook) == (bits, codebook)
    decoded = decode_weight(group)
    assert decoded.dtype == torch.float16 and decoded.shape == (128, 256)
    rel = ((decoded.float() - w).norm() / w.norm()).item()
    assert rel < ERROR_BOUND[bits], rel
    # y = x @ W: the decoded weight acts like the target on inputs
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8))
    y_rel = ((x @ decoded.float() - x @ w).norm() / (x @ w).norm()).item()
    assert y_rel < ERROR_BOUND[bits] * 1.2


def test_more_bits_means_less_error() -> None:
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    for codebook in ("3inst", "mcg", "mul1"):
        bits = (2.0, 2.5, 3.0, 3.5, 4.0) if codebook == "mul1" else (2.0, 3.0, 4.0)
        errs = []
        for k in bits:
            g = read_group({f"g.{n}": v for n, v in encode_weight(w, k, codebook).items()}, "g")
            errs.append(((decode_weight(g).float() - w).norm() / w.norm()).item())
        assert errs == sorted(errs, reverse=True), (codebook, errs)


def test_encode_and_decode_are_deterministic() -> None:
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(4))
    a, b = encode_weight(w, 3.0, "mcg", seed=5), encode_weight(w, 3.0, "mcg", seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = encode_weight(w, 3.0, "mcg", seed=6)
    assert not torch.equal(a["trellis"], c["trellis"])
    g = read_group({f"g.{k}": v for k, v in a.items()}, "g")
    assert torch.equal(decode_weight(g).view(torch.int16), decode_weight(g).view(torch.int16))


def test_hadamard_step_does_not_depend_on_thread_count() -> None:
    """decode_weight runs small weights single-threaded and big ones multi-threaded: same bits either way."""
    gen = torch.Generator().manual_seed(9)
    w_hat = torch.randn(1024, 512, generator=gen).half()
    suh, svh = torch.randn(1024, generator=gen).half(), torch.randn(512, generator=gen).half()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = apply_hadamards(w_hat, suh, svh)
        torch.set_num_threads(max(2, threads))
        many = apply_hadamards(w_hat, suh, svh)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16), many.view(torch.int16))


def test_batch_encoding_equals_one_by_one() -> None:
    ws = [torch.randn(128, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    together = encode_weights(ws, 2.5, "mul1", seed=10)
    for i, w in enumerate(ws):
        alone = encode_weight(w, 2.5, "mul1", seed=10 + i)
        assert all(torch.equal(together[i][k], alone[k]) for k in alone)


def test_encoder_markers() -> None:
    w = torch.zeros(128, 128)
    assert "mcg" not in encode_weight(w, 2.0, "3inst") and "mul1" not in encode_weight(w, 2.0, "3inst")
    assert encode_weight(w, 2.0, "mcg")["mcg"].view(torch.uint32).item() == 0xCBAC1FED
    assert encode_weight(w, 2.0, "mul1")["mul1"].view(torch.uint32).item() == 0x83DCD12D


@pytest.mark.parametrize(
    "bits,codebook,shape,needle",
    [(2.5, "mcg", (128, 128), "mul1"), (5.0, "3inst", (128, 128), "not served"),
     (3.0, "mad2", (128, 128), "unknown codebook"), (3.0, "mcg", (128, 96), "multiples of 128")],
)
def test_encoder_refuses(bits, codebook, shape, needle) -> None:
    with pytest.raises(Exl3Error, match=needle):
        encode_weight(torch.zeros(shape), bits, codebook)
