"""The kit's EXL3 decoder against exllamav3's own reconstruction, bit for bit, on the GPU.

exllamav3 (1.6.5, the format's owner) comes from exllamav3_ref.import_exllamav3 (beside this file): the
carried wheels (tests/gpu/prepare_wheels.sh fills .whl/) installed once into a fixed folder, the CUDA
extension compiled at first import into a fixed build folder that later processes reuse
(TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16: about 4.5 min on an H200; needs nvcc and ninja).

For every codebook and K in 2, 3, 4 (and 2.5, 3.5 with mul1), on random trellis bits and on
groups the kit's encoder wrote:
- the rotated weight (the trellis decode alone) equals exllamav3's `ext.reconstruct` bitwise;
- the full weight equals `LinearEXL3.get_weight_tensor()` (Hadamards and sign vectors) bitwise;
- the CPU decode's rotated weight equals the GPU's bitwise (integer work and one table lookup).

Run as a script (`python tests/gpu/test_exl3_vs_exllamav3.py --golden FILE`) it writes golden data
(inputs and exllamav3's outputs) that tests/test_exl3_golden.py checks on the CPU.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # as pytest does: one exllamav3_ref module

from exllamav3_ref import import_exllamav3  # noqa: E402

from glm53.exl3.decode import decode_rotated, decode_weight  # noqa: E402
from glm53.exl3.encode import encode_weight  # noqa: E402
from glm53.exl3.format import read_group  # noqa: E402

CASES = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in (2.0, 3.0, 4.0)] + [("mul1", 2.5), ("mul1", 3.5)]


def _case_id(case: tuple[str, float]) -> str:
    return f"{case[0]}-K{case[1]:g}"


@pytest.fixture(scope="module")
def exl():
    if not torch.cuda.is_available():
        pytest.skip("gpu: exllamav3's decoder runs on CUDA only")
    torch.backends.cuda.matmul.allow_tf32 = False  # exllamav3's default too; stated so it cannot drift
    os.environ.setdefault("EXL3_INT8_GEMV", "0")  # read at its first call: fp16 activations, as the kit's
    return import_exllamav3()


def random_group(codebook: str, bits: float, in_f: int, out_f: int, seed: int) -> dict[str, torch.Tensor]:
    """Random trellis bits and random fp16 sign/scale vectors (scales too, so fp16 rounding is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    words = int(16 * bits)
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, words), generator=gen).to(torch.int16)
    suh = ((torch.rand(in_f, generator=gen) * 1.5 + 0.25) * (torch.randint(0, 2, (in_f,), generator=gen) * 2 - 1)).half()
    svh = ((torch.rand(out_f, generator=gen) * 1.5 + 0.25) * (torch.randint(0, 2, (out_f,), generator=gen) * 2 - 1)).half()
    parts = {"trellis": trellis, "suh": suh, "svh": svh}
    if codebook == "mcg":
        parts["mcg"] = torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32)
    if codebook == "mul1":
        parts["mul1"] = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)
    return parts


def encoded_group(codebook: str, bits: float, in_f: int, out_f: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(in_f, out_f, generator=gen) * 0.02
    return encode_weight(w, bits, codebook, seed=seed)


def exllamav3_outputs(exl, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated, full) fp16 [in, out] from exllamav3: ext.reconstruct and LinearEXL3.get_weight_tensor."""
    ext, LinearEXL3 = exl
    dev = torch.device("cuda")
    cuda = {k: v.to(dev) for k, v in parts.items()}
    tiles_in, tiles_out, words = cuda["trellis"].shape
    in_f, out_f = tiles_in * 16, tiles_out * 16
    bits = words / 16
    k_arg = int(bits) if float(bits).is_integer() else bits
    lin = LinearEXL3(
        None, in_f, out_f, suh=cuda["suh"], svh=cuda["svh"], trellis=cuda["trellis"],
        mcg=cuda.get("mcg"), mul1=cuda.get("mul1"), out_dtype=torch.half, key="test",
    )
    rotated = torch.empty((in_f, out_f), dtype=torch.half, device=dev)
    ext.reconstruct(rotated, cuda["trellis"], k_arg, "mcg" in cuda, "mul1" in cuda)
    full = lin.get_weight_tensor()
    torch.cuda.synchronize()
    return rotated, full


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = a.view(torch.int16) != b.view(torch.int16)
    idx = diff.nonzero()[:5].tolist()
    return f"{int(diff.sum())} of {diff.numel()} differ; first at {idx}: ours {[a[i][j].item() for i, j in idx]}, exllamav3 {[b[i][j].item() for i, j in idx]}"


def _check(exl, parts: dict[str, torch.Tensor]) -> None:
    group = read_group({f"g.{k}": v for k, v in parts.items()}, "g")
    ref_rot, ref_full = exllamav3_outputs(exl, parts)
    ours_rot = decode_rotated(group.trellis.cuda(), group.bits, group.codebook)
    assert torch.equal(ours_rot.view(torch.int16), ref_rot.view(torch.int16)), "rotated: " + _mismatch(ours_rot, ref_rot)
    ours_full = decode_weight(group, "cuda")
    assert torch.equal(ours_full.view(torch.int16), ref_full.view(torch.int16)), "full: " + _mismatch(ours_full, ref_full)
    cpu_rot = decode_rotated(group.trellis, group.bits, group.codebook)
    assert torch.equal(cpu_rot.view(torch.int16), ref_rot.cpu().view(torch.int16)), "cpu rotated: " + _mismatch(cpu_rot, ref_rot.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_random_trellis_matches_exllamav3(exl, case):
    codebook, bits = case
    _check(exl, random_group(codebook, bits, 512, 768, seed=int(bits * 10) + len(codebook)))
    _check(exl, random_group(codebook, bits, 2048, 1024, seed=int(bits * 10) + 7))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_encoded_group_matches_exllamav3(exl, case):
    codebook, bits = case
    _check(exl, encoded_group(codebook, bits, 256, 384, seed=3))


@pytest.mark.gpu
def test_large_shape_matches_exllamav3(exl):
    """A GLM-5.3 expert projection's shape (in 6144, out 2048), K = 3, mcg."""
    _check(exl, random_group("mcg", 3.0, 6144, 2048, seed=11))


def _fused(exl, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """exllamav3's fused reconstruct + Hadamards kernel (a different arithmetic order than get_weight_tensor)."""
    ext, _ = exl
    cuda = {k: v.cuda() for k, v in parts.items()}
    tiles_in, tiles_out, words = cuda["trellis"].shape
    bits = words / 16
    w = torch.empty((tiles_in * 16, tiles_out * 16), dtype=torch.half, device="cuda")
    ext.reconstruct_had_slice(w, cuda["trellis"], cuda["suh"], cuda["svh"], int(bits) if bits.is_integer() else bits,
                              "mcg" in cuda, "mul1" in cuda, 0)
    return w.cpu()


def golden_name(codebook: str, bits: float, kind: str) -> str:
    return f"{codebook}_K{int(bits * 10)}_{kind}"  # e.g. mul1_K25_random


def write_golden(path: str) -> None:
    """Inputs and exllamav3's outputs for every case, for the CPU golden test (tests/test_exl3_golden.py)."""
    from safetensors.torch import save_file

    exl = import_exllamav3()
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, torch.Tensor] = {}
    for codebook, bits in CASES:
        for kind, parts in (
            ("random", random_group(codebook, bits, 256, 384, seed=100 + int(bits * 2))),
            ("encoded", encoded_group(codebook, bits, 128, 256, seed=5)),
        ):
            name = golden_name(codebook, bits, kind)
            rot, full = exllamav3_outputs(exl, parts)
            out.update({f"{name}.{k}": v.contiguous() for k, v in parts.items()})
            out[f"{name}.exllamav3_rotated"] = rot.cpu()
            out[f"{name}.exllamav3_full"] = full.cpu()
            try:  # the fused kernel: for information only
                out[f"{name}.exllamav3_fused"] = _fused(exl, parts)
            except Exception as exc:  # noqa: BLE001
                print(f"fused reconstruct failed for {name}: {exc}", file=sys.stderr)
    save_file(out, path, metadata={"source": "exllamav3 1.6.5 on CUDA", "torch": torch.__version__,
                                   "device": torch.cuda.get_device_name()})
    print(f"wrote {len(out)} tensors to {path}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--golden":
        write_golden(sys.argv[2])
    else:
        print("usage: python tests/gpu/test_exl3_vs_exllamav3.py --golden FILE", file=sys.stderr)
        sys.exit(2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("mcg", 3.0), ("3inst", 2.0), ("mul1", 3.5)], ids=_case_id)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_kit_kernels_match_exllamavs_forward(exl, case, rows):
    """The kit's Triton product from the packed trellis (glm53/ops/triton_exl3.py) against exllamav3's own
    LinearEXL3.forward (its GEMV / GEMM kernels) on the same tensors, fp16 activations: within the kit's
    tolerance against the reference (tests/gpu/test_exl3_cuda.py TOL); exllamav3's int8-activation GEMV
    (mul1 at 1-2 rows) is off so both compute from fp16 activations."""
    from exllamav3_ref import linear_forward
    from test_exl3_cuda import TOL, assert_close

    from glm53.exl3.bank import BankBuilder
    from glm53.ops import triton_exl3

    codebook, bits = case
    parts = random_group(codebook, bits, 2048, 1024, seed=rows)
    parts["svh"] = (parts["svh"].float() * 2048 ** -0.5).half()
    group = read_group({f"g.{k}": v for k, v in parts.items()}, "g")
    b = BankBuilder()
    m = b.add_group(group)
    x = torch.randn(rows, 2048, generator=torch.Generator(device="cuda").manual_seed(rows), device="cuda").half()
    theirs = linear_forward({k: v.cuda() for k, v in parts.items()}, x)
    ours = triton_exl3.linear(x, b.build("cuda"), m)
    assert_close(ours, theirs, TOL, f"kit vs exllamav3 {codebook} K{bits} M={rows}")
