"""Reading one rank's slices of a checkpoint: only the bytes of the slice ever leave the disk.

A slice [start, stop) along dimension d of a C-contiguous tensor is `outer` runs of
(stop - start) * inner elements, where outer is the product of the dims before d and inner the
product after; each run is read with one positioned read (preadv) straight into the result's
buffer. A dim-0 slice is one run. No mmap, so the bytes read are exactly the slice's bytes, and
`SliceReader.bytes_read` proves it in the tests.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from glm53.formats.safetensors_header import DTYPE_BITS, TensorInfo
from glm53.layout.plan import LayoutPlan, PlanError, SliceSpec, TensorLocation, read_tensor_table

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}


class SliceReader:
    """Positioned reads of tensor slices from safetensors shards, with a count of bytes read."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    def __enter__(self) -> "SliceReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def read(self, info: TensorInfo, where: TensorLocation, spec: SliceSpec | None) -> torch.Tensor:
        """The tensor `info` stored at `where`, restricted to `spec` (None: all of it)."""
        if info.dtype not in TORCH_DTYPES:
            raise PlanError(f"{info.name}: dtype {info.dtype} has no torch equivalent here; cannot load it")
        shape = list(info.shape)
        item = DTYPE_BITS[info.dtype] // 8
        dim, start, stop = (0, 0, shape[0] if shape else 1) if spec is None else (spec.dim, spec.start, spec.stop)
        if shape and not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
            raise PlanError(f"{info.name}: slice dim {dim} [{start}, {stop}) is outside its shape {shape}")
        outer = 1
        for d in shape[:dim]:
            outer *= d
        inner = 1
        for d in shape[dim + 1:]:
            inner *= d
        full_run = (shape[dim] if shape else 1) * inner * item
        run = (stop - start) * inner * item
        out_shape = shape[:dim] + [stop - start] + shape[dim + 1:] if shape else []
        buf = bytearray(outer * run)
        view = memoryview(buf)
        fd = self._fd(where.file)
        base = where.data_offset + info.begin + start * inner * item
        for k in range(outer):
            chunk = view[k * run:(k + 1) * run]
            got = os.preadv(fd, [chunk], base + k * full_run) if run else 0
            if got != run:
                raise PlanError(f"{where.file}: short read of {info.name} ({got} of {run} bytes); the shard is truncated: re-download it")
            self.bytes_read += got
        if not buf:
            return torch.empty(out_shape, dtype=TORCH_DTYPES[info.dtype])
        return torch.frombuffer(buf, dtype=TORCH_DTYPES[info.dtype]).reshape(out_shape)


def read_rank_tensors(
    model_dir: str | Path,
    plan: LayoutPlan,
    rank: int,
    names: Iterable[str] | None = None,
    reader: SliceReader | None = None,
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of each tensor in `names` (default: all), read from the shards in `model_dir`.

    The plan must have been built from a checkpoint folder (it records where each tensor lives).
    Pass a `reader` to keep its `bytes_read` count or to reuse open files across calls."""
    if not plan.locations:
        _, locations = read_tensor_table(model_dir)
        plan.locations.update(locations)
    slices = plan.slices(rank)
    own = reader is None
    reader = reader or SliceReader()
    try:
        result: dict[str, torch.Tensor] = {}
        for name in (names if names is not None else plan.tensors):
            if name not in plan.tensors:
                raise PlanError(f"{name}: not in the checkpoint at {model_dir}")
            result[name] = reader.read(plan.tensors[name], plan.locations[name], slices[name])
        return result
    finally:
        if own:
            reader.close()
