"""EXL3 group reading: what is accepted, and each refusal with a message naming tensor and reason."""
from __future__ import annotations

import pytest
import torch

from glm53.exl3.decode import decode_weight
from glm53.exl3.encode import encode_weight
from glm53.exl3.format import Exl3Error, is_exl3_prefix, read_group, unpack_signs

P = "model.layers.1.mlp.experts.3.down_proj"


def group(bits: float = 3.0, codebook: str = "mcg", in_f: int = 256, out_f: int = 128) -> dict[str, torch.Tensor]:
    w = torch.randn(in_f, out_f, generator=torch.Generator().manual_seed(1)) * 0.02
    return {f"{P}.{k}": v for k, v in encode_weight(w, bits, codebook, seed=2).items()}


def refuse(tensors: dict[str, torch.Tensor], *needles: str) -> str:
    with pytest.raises(Exl3Error) as info:
        read_group(tensors, P)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def test_reads_shape_width_and_codebook_from_the_tensors() -> None:
    g = read_group(group(3.5, "mul1", 256, 384), P)
    assert (g.in_features, g.out_features, g.bits, g.codebook) == (256, 384, 3.5, "mul1")
    assert g.trellis.shape == (16, 24, 56)
    assert g.bias is None and g.suh.dtype == torch.float16 and g.svh.shape == (384,)
    assert read_group(group(2.0, "3inst"), P).codebook == "3inst"
    assert read_group(group(4.0, "mcg"), P).bits == 4.0


def test_callable_source_and_prefix_probe() -> None:
    t = group()
    assert read_group(t.get, P).bits == 3.0
    assert is_exl3_prefix(t.keys(), P)
    assert not is_exl3_prefix(t.keys(), "model.layers.1.mlp.experts.3.up_proj")


def test_bias_is_read_and_checked() -> None:
    t = group()
    t[f"{P}.bias"] = torch.zeros(128, dtype=torch.float16)
    assert read_group(t, P).bias is not None
    t[f"{P}.bias"] = torch.zeros(127, dtype=torch.float16)
    refuse(t, f"{P}.bias", "[127]", "[128]")


def test_packed_sign_vectors_decode_like_the_unpacked_ones() -> None:
    t = group()
    suh, svh = t.pop(f"{P}.suh"), t.pop(f"{P}.svh")
    signs_u, signs_v = torch.sign(suh.float()), torch.sign(svh.float())

    def pack(signs: torch.Tensor) -> torch.Tensor:
        bits = (signs < 0).to(torch.int64).view(-1, 16)
        return (bits << torch.arange(16)).sum(-1).to(torch.int32).to(torch.int16)

    t[f"{P}.su"], t[f"{P}.sv"] = pack(signs_u), pack(signs_v)
    g = read_group(t, P)
    assert torch.equal(g.suh, signs_u.half()) and torch.equal(g.svh, signs_v.half())
    # same as a group whose fp16 vectors are those signs
    plain = {k: v for k, v in t.items() if not k.endswith((".su", ".sv"))}
    plain[f"{P}.suh"], plain[f"{P}.svh"] = signs_u.half(), signs_v.half()
    assert torch.equal(decode_weight(g), decode_weight(read_group(plain, P)))


def test_unpack_signs_bit_order() -> None:
    packed = torch.tensor([0b101, -32768], dtype=torch.int16)  # bits 0 and 2 of word 0; bit 15 of word 1
    s = unpack_signs(packed)
    assert s.dtype == torch.float16 and s.shape == (32,)
    assert [i for i in range(32) if s[i] < 0] == [0, 2, 31]


def test_refuses_missing_trellis() -> None:
    t = group()
    del t[f"{P}.trellis"]
    refuse(t, f"{P}.trellis", "missing")


def test_refuses_wrong_trellis_dtype_and_rank() -> None:
    t = group()
    t[f"{P}.trellis"] = t[f"{P}.trellis"].to(torch.int32)
    refuse(t, f"{P}.trellis", "int16")
    t = group()
    t[f"{P}.trellis"] = t[f"{P}.trellis"].flatten(0, 1)
    refuse(t, f"{P}.trellis", "dims")


@pytest.mark.parametrize("words,why", [(16, "not served"), (80, "not served"), (128, "not served"), (72, "not a valid EXL3 width")])
def test_refuses_width_out_of_range(words: int, why: str) -> None:
    t = group()
    t[f"{P}.trellis"] = torch.zeros((16, 8, words), dtype=torch.int16)
    t.pop(f"{P}.mcg")
    t[f"{P}.mul1"] = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)
    msg = refuse(t, f"{P}.trellis", "out of range", why, "served K = 2, 2.5, 3, 3.5, 4")
    assert "1..8" in msg  # says what the format itself allows


def test_refuses_width_that_is_no_whole_number_of_words() -> None:
    t = group()
    t[f"{P}.trellis"] = torch.zeros((16, 8, 20), dtype=torch.int16)  # K = 1.25
    refuse(t, f"{P}.trellis", "K = 1.25", "half-integer")


@pytest.mark.parametrize("codebook", ["3inst", "mcg"])
def test_refuses_half_integer_width_without_mul1(codebook: str) -> None:
    t = group(3.0, codebook)
    t[f"{P}.trellis"] = torch.zeros((16, 8, 40), dtype=torch.int16)  # K = 2.5
    refuse(t, f"{P}.trellis", "half-integer K = 2.5", "mul1", codebook)


def test_refuses_missing_sign_vectors() -> None:
    t = group()
    del t[f"{P}.suh"]
    refuse(t, P, "sign vector missing", f"{P}.suh", f"{P}.su")
    t = group()
    del t[f"{P}.svh"]
    refuse(t, "sign vector missing", f"{P}.svh", f"{P}.sv")


def test_refuses_inconsistent_sign_vectors() -> None:
    t = group()
    t[f"{P}.suh"] = t[f"{P}.suh"][:128]
    refuse(t, f"{P}.suh", "inconsistent", "[256]")
    t = group()
    t[f"{P}.svh"] = t[f"{P}.svh"].float()
    refuse(t, f"{P}.svh", "float16")
    t = group()
    del t[f"{P}.svh"]
    t[f"{P}.sv"] = torch.zeros(4, dtype=torch.int16)
    refuse(t, f"{P}.sv", "inconsistent", "[8]")


def test_refuses_shape_not_a_multiple_of_the_hadamard_block() -> None:
    t = group()
    t[f"{P}.trellis"] = torch.zeros((4, 8, 48), dtype=torch.int16)  # in = 64
    t[f"{P}.suh"] = torch.ones(64, dtype=torch.float16)
    refuse(t, f"{P}.trellis", "Hadamard block 128")


def test_refuses_unknown_codebook() -> None:
    t = group()
    t[f"{P}.mcg"] = torch.tensor(12345, dtype=torch.int32)
    refuse(t, f"{P}.mcg", "unknown codebook", "0x00003039", "0xcbac1fed")
    t = group()
    t[f"{P}.mad2"] = torch.tensor(1, dtype=torch.int32)
    refuse(t, f"{P}.mad2", "unknown EXL3 part", "codebook")
    t = group()
    t[f"{P}.mul1"] = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)
    refuse(t, P, "both mcg and mul1")
