"""Reading one EXL3-quantized linear ("group") from a checkpoint's tensors.

An EXL3 group lives under a prefix such as `model.layers.3.mlp.experts.7.down_proj`:

    trellis  int16 [in/16, out/16, 16*K]   one 16x16 tile of the [in, out] weight per (row, col) pair
    suh      fp16 [in]  (or packed int16 `su`  [in/16]: bit set = -1)   input-side sign/scale vector
    svh      fp16 [out] (or packed int16 `sv`  [out/16])                output-side sign/scale vector
    mcg | mul1   optional scalar marker naming the codebook; neither means the default `3inst`
    bias     optional [out]

The bit width K is read per tensor from the trellis shape (16*K uint16 words per 256-weight tile),
never from the config's average. exllamav3 1.6.5 accepts K = 1..8 and the half-integer rates
1.5 / 2.5 / 3.5 (mul1 codebook only); this kit serves K = 2, 2.5, 3, 3.5, 4.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from glm53.formats.exl3_storage import HADAMARD_BLOCK, KNOWN_PARTS, SERVED_BITS

CODEBOOKS = ("3inst", "mcg", "mul1")
FORMAT_BITS_TEXT = "the format allows integer K 1..8 and half-integer 1.5/2.5/3.5 (mul1 only)"
CODEBOOK_MULTIPLIERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}

TensorSource = Mapping[str, torch.Tensor] | Callable[[str], "torch.Tensor | None"]


class Exl3Error(ValueError):
    """An EXL3 group the kit cannot serve; the message names the tensor and the reason."""


@dataclass
class Exl3Group:
    prefix: str
    trellis: torch.Tensor  # int16 [in/16, out/16, 16*K]
    suh: torch.Tensor  # fp16 [in]
    svh: torch.Tensor  # fp16 [out]
    codebook: str  # "3inst" | "mcg" | "mul1"
    bits: float  # K, per tensor
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None

    @property
    def words_per_tile(self) -> int:
        return int(self.trellis.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes of the stored group (trellis + sign vectors + bias)."""
        n = self.trellis.numel() * 2 + self.suh.numel() * 2 + self.svh.numel() * 2
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


def _getter(tensors: TensorSource) -> Callable[[str], torch.Tensor | None]:
    if callable(tensors) and not isinstance(tensors, Mapping):
        return tensors
    return lambda name: tensors.get(name)  # type: ignore[union-attr]


def is_exl3_prefix(names: Iterable[str], prefix: str) -> bool:
    """True when `prefix.trellis` is among the tensor names (the group is EXL3, not plain weights)."""
    return f"{prefix}.trellis" in set(names)


def bits_from_words(words: int) -> float:
    """K from the trellis' last dimension (16*K uint16 words per tile)."""
    return words / 16


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Packed int16 sign bits (bit i of word w is element 16*w + i; set = -1) -> fp16 +-1."""
    bits = packed.to(torch.int32) & 0xFFFF
    shifts = torch.arange(16, dtype=torch.int32, device=packed.device)
    set_ = ((bits.unsqueeze(-1) >> shifts) & 1).flatten()
    return (1 - 2 * set_).to(torch.float16)


def read_group(tensors: TensorSource, prefix: str) -> Exl3Group:
    """Read and validate the EXL3 group under `prefix`; raises Exl3Error naming tensor and reason."""
    get = _getter(tensors)
    trellis = get(f"{prefix}.trellis")
    if trellis is None:
        raise Exl3Error(f"{prefix}.trellis: missing; {prefix} is not an EXL3 group")
    name = f"{prefix}.trellis"
    if trellis.dtype != torch.int16:
        raise Exl3Error(f"{name}: dtype {trellis.dtype}, expected int16")
    if trellis.dim() != 3:
        raise Exl3Error(f"{name}: shape {list(trellis.shape)} has {trellis.dim()} dims; expected [in/16, out/16, 16*K]")
    tiles_in, tiles_out, words = (int(s) for s in trellis.shape)
    if tiles_in == 0 or tiles_out == 0:
        raise Exl3Error(f"{name}: shape {list(trellis.shape)} is empty")
    in_features, out_features = tiles_in * 16, tiles_out * 16
    bits = bits_from_words(words)

    mcg, mul1 = get(f"{prefix}.mcg"), get(f"{prefix}.mul1")
    if mcg is not None and mul1 is not None:
        raise Exl3Error(f"{prefix}: both mcg and mul1 codebook markers are present; a group has one codebook")
    codebook = "mcg" if mcg is not None else "mul1" if mul1 is not None else "3inst"
    if codebook != "3inst":
        _check_marker(prefix, codebook, mcg if mcg is not None else mul1)
    if isinstance(tensors, Mapping):
        _check_no_unknown_parts(tensors.keys(), prefix)

    half = bits * 2 == int(bits * 2) and not float(bits).is_integer()
    if not (words % 8 == 0 and (float(bits).is_integer() or half)):
        raise Exl3Error(f"{name}: last dimension {words} gives K = {bits}; {FORMAT_BITS_TEXT}")
    if bits not in SERVED_BITS:
        in_format = (float(bits).is_integer() and 1 <= bits <= 8) or bits in (1.5, 2.5, 3.5)
        why = "valid EXL3 but not served by this kit" if in_format else "not a valid EXL3 width"
        raise Exl3Error(
            f"{name}: K = {bits} is out of range ({why}); served K = 2, 2.5, 3, 3.5, 4; {FORMAT_BITS_TEXT}"
        )
    if half and codebook != "mul1":
        raise Exl3Error(f"{name}: half-integer K = {bits} requires the mul1 codebook, found {codebook}")

    suh = _sign_vector(get, prefix, "suh", "su", in_features)
    svh = _sign_vector(get, prefix, "svh", "sv", out_features)
    if in_features % HADAMARD_BLOCK or out_features % HADAMARD_BLOCK:
        raise Exl3Error(
            f"{name}: [{in_features}, {out_features}] is not a multiple of the Hadamard block {HADAMARD_BLOCK}"
        )
    bias = get(f"{prefix}.bias")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise Exl3Error(f"{prefix}.bias: shape {list(bias.shape)}, expected [{out_features}] (out_features)")
    return Exl3Group(prefix, trellis, suh, svh, codebook, bits, in_features, out_features, bias)


def _check_marker(prefix: str, codebook: str, marker: torch.Tensor) -> None:
    """The marker's value is the codebook's multiplier; another value is a codebook this kit does not know."""
    if marker.numel() != 1 or marker.dtype not in (torch.int32, torch.int64, torch.uint32):
        raise Exl3Error(f"{prefix}.{codebook}: marker must be one integer, got {marker.dtype} {list(marker.shape)}")
    value = int(marker.reshape(()).item()) & 0xFFFFFFFF
    if value != CODEBOOK_MULTIPLIERS[codebook]:
        raise Exl3Error(
            f"{prefix}.{codebook}: unknown codebook (multiplier {value:#010x}, expected "
            f"{CODEBOOK_MULTIPLIERS[codebook]:#010x}); known codebooks are 3inst, mcg, mul1"
        )


def _check_no_unknown_parts(names: Iterable[str], prefix: str) -> None:
    """A part this reader does not know (say a new codebook's marker) must not be silently ignored."""
    head = prefix + "."
    for name in names:
        if name.startswith(head) and "." not in name[len(head):] and name[len(head):] not in KNOWN_PARTS:
            raise Exl3Error(
                f"{name}: unknown EXL3 part '{name[len(head):]}' (an unknown codebook marker?); "
                f"known parts are {', '.join(KNOWN_PARTS)}"
            )


def _sign_vector(get: Callable[[str], torch.Tensor | None], prefix: str, plain: str, packed: str, n: int) -> torch.Tensor:
    vec = get(f"{prefix}.{plain}")
    if vec is not None:
        if vec.dtype != torch.float16:
            raise Exl3Error(f"{prefix}.{plain}: dtype {vec.dtype}, expected float16")
        if tuple(vec.shape) != (n,):
            raise Exl3Error(f"{prefix}.{plain}: shape {list(vec.shape)} inconsistent with the trellis; expected [{n}]")
        return vec
    bits = get(f"{prefix}.{packed}")
    if bits is None:
        raise Exl3Error(
            f"{prefix}: sign vector missing: neither {prefix}.{plain} (fp16) nor {prefix}.{packed} (packed int16) is present"
        )
    if bits.dtype != torch.int16:
        raise Exl3Error(f"{prefix}.{packed}: dtype {bits.dtype}, expected int16 (packed sign bits)")
    if tuple(bits.shape) != (n // 16,):
        raise Exl3Error(f"{prefix}.{packed}: shape {list(bits.shape)} inconsistent with the trellis; expected [{n // 16}]")
    return unpack_signs(bits)
