"""Broken copies of a tiny checkpoint, one bad input each, for the verdict tests.

`broken_copy(src, dst, prefix, edit)` copies the folder, lets `edit` change the tensors of the shard
that holds the linear `prefix` (a dict, changed in place: entries added, replaced or removed), writes
that shard back and keeps the index in step. Each edit names the tensor it breaks (`Edit.names`).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glm53.formats.checkpoint_rules import pad_features
from glm53.exl3.encode import codebook_marker

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Edit:
    change: Callable[[Tensors, str], None]
    names: str  # what a refusal must name, given the prefix: "{p}.trellis", "{p}" ...


def broken_copy(src: Path, dst: Path, prefix: str, change: Callable[[Tensors, str], None]) -> Path:
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    shard = next(f for n, f in sorted(weight_map.items()) if n.startswith(prefix + "."))
    tensors = load_file(str(dst / shard))
    before, size_before = set(tensors), _nbytes(tensors)
    change(tensors, prefix)
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    for name in before - set(tensors):
        del weight_map[name]
    weight_map.update({name: shard for name in set(tensors) - before})
    index["metadata"]["total_size"] += _nbytes(tensors) - size_before
    index_path.write_text(json.dumps(index, indent=1))
    return dst


def _nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _trellis(shape: Callable[[tuple[int, int, int]], tuple[int, ...]]) -> Callable[[Tensors, str], None]:
    def change(t: Tensors, p: str) -> None:
        t[f"{p}.trellis"] = torch.zeros(shape(tuple(t[f"{p}.trellis"].shape)), dtype=torch.int16)
    return change


def _drop(*parts: str) -> Callable[[Tensors, str], None]:
    def change(t: Tensors, p: str) -> None:
        for part in parts:
            t.pop(f"{p}.{part}", None)
    return change


def _half_k_without_mul1(t: Tensors, p: str) -> None:
    _drop("mcg", "mul1")(t, p)
    a, b, _ = t[f"{p}.trellis"].shape
    t[f"{p}.trellis"] = torch.zeros((a, b, 40), dtype=torch.int16)  # K = 2.5


def _short_suh(t: Tensors, p: str) -> None:
    t[f"{p}.suh"] = t[f"{p}.suh"][:-16].clone()


def _both_markers(t: Tensors, p: str) -> None:
    t.update({f"{p}.{k}": v for cb in ("mcg", "mul1") for k, v in codebook_marker(cb).items()})


def _unknown_part(t: Tensors, p: str) -> None:
    t[f"{p}.foo"] = torch.ones(1, dtype=torch.int32)


def _plain_beside(t: Tensors, p: str) -> None:
    a, b, _ = t[f"{p}.trellis"].shape
    t[f"{p}.weight"] = torch.zeros((b * 16, a * 16), dtype=torch.bfloat16)


def _bias(t: Tensors, p: str) -> None:
    t[f"{p}.bias"] = torch.zeros(t[f"{p}.svh"].shape[0], dtype=torch.bfloat16)


def _packed_signs(t: Tensors, p: str) -> None:
    """suh/svh -> packed su/sv (bit set = -1): the same signs, the scale dropped; still a valid group."""
    for fp16, packed in (("suh", "su"), ("svh", "sv")):
        neg = (t.pop(f"{p}.{fp16}") < 0).view(-1, 16).to(torch.int32)
        words = (neg << torch.arange(16, dtype=torch.int32)).sum(-1)
        t[f"{p}.{packed}"] = words.to(torch.int16)  # wraps to the same 16 bits


def _exl3_router(t: Tensors, p: str) -> None:
    out_f, in_f = t.pop(f"{p}.weight").shape
    pin, pout = pad_features(in_f), pad_features(out_f)
    t.update({f"{p}.trellis": torch.zeros((pin // 16, pout // 16, 64), dtype=torch.int16),
              f"{p}.suh": torch.ones(pin, dtype=torch.float16), f"{p}.svh": torch.ones(pout, dtype=torch.float16)})


def _wrong_marker_value(t: Tensors, p: str) -> None:
    book = "mcg" if f"{p}.mcg" in t else "mul1"
    t[f"{p}.{book}"] = torch.tensor(12345, dtype=torch.int32)


def _drop_layer(t: Tensors, p: str) -> None:
    for name in [n for n in t if n.startswith(p + ".")]:
        del t[name]


EDITS: dict[str, Edit] = {
    "k_2.5_without_mul1": Edit(_half_k_without_mul1, "{p}.trellis"),
    "k_8": Edit(_trellis(lambda s: (s[0], s[1], 128)), "{p}.trellis"),
    "trellis_in_tiles": Edit(_trellis(lambda s: (s[0] + 8, s[1], s[2])), "{p}.trellis"),
    "trellis_out_tiles": Edit(_trellis(lambda s: (s[0], s[1] + 8, s[2])), "{p}.trellis"),
    "trellis_2d": Edit(_trellis(lambda s: (s[0], s[1] * s[2])), "{p}.trellis"),
    "no_suh_no_su": Edit(_drop("suh", "su"), "{p}"),
    "no_svh": Edit(_drop("svh", "sv"), "{p}"),
    "suh_length": Edit(_short_suh, "{p}.suh"),
    "both_markers": Edit(_both_markers, "{p}"),
    "unknown_part": Edit(_unknown_part, "{p}.foo"),
    "weight_and_trellis": Edit(_plain_beside, "{p}"),
    "bias": Edit(_bias, "{p}.bias"),
    "wrong_marker_value": Edit(_wrong_marker_value, "{p}"),
    "packed_signs": Edit(_packed_signs, "{p}"),
    "exl3_router": Edit(_exl3_router, "{p}"),
    "no_mtp_layer": Edit(_drop_layer, "{p}"),
}
