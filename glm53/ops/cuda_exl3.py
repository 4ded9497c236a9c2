"""The EXL3 decode form's split sums on CUDA (glm53/ops/cuda/exl3_parts.cu), launched on torch's current
stream. triton_exl3.mlp runs them for `Form.cuda` between its Triton launches (the input rotation before,
each projection's finish after); the parts land in the workspace the Triton parallel form uses, in its
layout, so the finish is the parallel form's own code.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from glm53.exl3.bank import Exl3Bank
from glm53.ops import cuda_build

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
# exl3_parts_launch(stream, codebook, variant, groups, n_blocks, n_splits, words, table, xr, ws, mode, rows, ids, stride_ids,
#                   T, K, shared, has_shared, mat_p0, mat_p1, shared_p0, shared_p1, n_proj, in_width, xr_proj,
#                   out_stride, proj_cols, split_stride)
_ARGTYPES = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _L, _I, _I,
             _L]
_LIBRARIES: dict[tuple[int, int], ctypes.CDLL] = {}


def library(device: torch.device) -> ctypes.CDLL:
    """The kernels built for this device's architecture (nvcc, cached; cuda_build)."""
    capability = torch.cuda.get_device_capability(device)
    lib = _LIBRARIES.get(capability)
    if lib is None:
        lib = cuda_build.load("exl3_parts", capability)
        lib.exl3_parts_launch.restype = ctypes.c_int
        lib.exl3_parts_launch.argtypes = _ARGTYPES
        lib.exl3_error_string.restype = ctypes.c_char_p
        lib.exl3_error_string.argtypes = [ctypes.c_int]
        _LIBRARIES[capability] = lib
    return lib


def unavailable(device: torch.device) -> str | None:
    """Why the CUDA split sums cannot run on `device` (None: they can)."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "mma.sync m16n8k16 with fp32 accumulation needs sm_80 or newer"
    try:
        library(device)
    except (cuda_build.CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def split_parts(bank: Exl3Bank, xr: torch.Tensor, ws: torch.Tensor, *, groups: int, n_blocks: int, n_splits: int,
                ids: torch.Tensor, tokens: int, routed: int, shared_id: int, has_shared: bool, mats: Sequence[int],
                shared_mats: Sequence[int], in_width: int, xr_proj: int, out_stride: int, proj_cols: int,
                variant: int = 1) -> None:
    """The fp32 split parts of the MLP slots' products (one launch; exl3_parts.cu's mode 1): for each slot
    group g < groups, output block < n_blocks, split < n_splits and projection p < len(mats), the rows of
    xr [.., in_width] (fp16, projection p's at + p * xr_proj) times the group's expert's matrix of projection
    p (mats[p] + e, or shared_mats[p]) -> ws + split * (groups * out_stride) + slot * out_stride + p * proj_cols."""
    codebooks = bank.codebooks
    if len(codebooks) != 1:
        raise ValueError("the CUDA split sums take a bank of one codebook (this one mixes "
                         f"{sorted(codebooks)}); use the Triton form")
    if xr.dtype != torch.float16 or ids.dtype != torch.int64 or ids.stride(1) != 1:
        raise ValueError(f"split_parts: xr must be fp16 (got {xr.dtype}), ids int64 rows (got {ids.dtype}, "
                         f"strides {ids.stride()})")
    n_proj = len(mats)
    pair = list(mats) + [0] * (2 - n_proj)
    shared_pair = list(shared_mats) + [0] * (2 - n_proj)
    lib = library(xr.device)
    code = lib.exl3_parts_launch(
        torch.cuda.current_stream(xr.device).cuda_stream, next(iter(codebooks)), variant, groups, n_blocks, n_splits,
        bank.words.data_ptr(), bank.table.data_ptr(), xr.data_ptr(), ws.data_ptr(), 1, 0, ids.data_ptr(),
        ids.stride(0), tokens, routed, shared_id, int(has_shared), pair[0], pair[1], shared_pair[0], shared_pair[1],
        n_proj, in_width, xr_proj, out_stride, proj_cols, groups * out_stride)
    if code:
        raise RuntimeError(f"exl3_parts_launch: {lib.exl3_error_string(code).decode()}")
