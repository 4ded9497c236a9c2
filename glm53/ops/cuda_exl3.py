"""The EXL3 decode form's split sums on CUDA (glm53/ops/cuda/exl3_parts.cu), launched on torch's current
stream. triton_exl3.mlp runs them for `Form.cuda` between its Triton launches (the input rotation before,
each projection's finish after); the parts land in the workspace the Triton parallel form uses, in its
layout, so the finish is the parallel form's own code.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from glm53.exl3.bank import Exl3Bank
from glm53.ops import cuda_build

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
# exl3_parts_launch(stream, codebook, groups, n_blocks, n_splits, words, table, xr, ws, mode, rows, ids, stride_ids,
#                   T, K, shared, has_shared, mat_p0, mat_p1, shared_p0, shared_p1, n_proj, in_width, xr_proj,
#                   out_stride, proj_cols, split_stride)
_ARGTYPES = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _L, _I, _I,
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


@functools.cache
def unavailable(device: torch.device) -> str | None:
    """Why the CUDA split sums cannot run on `device` (None: they can); asked once a device."""
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
                mats: Sequence[int], in_width: int, out_stride: int, rows: int = 0, ids: torch.Tensor | None = None,
                tokens: int = 0, routed: int = 0, shared_id: int = 0, has_shared: bool = False,
                shared_mats: Sequence[int] = (), xr_proj: int = 0, proj_cols: int = 0) -> None:
    """The fp32 split parts of y = xr @ W_hat (one launch), for each group g < groups, output block < n_blocks,
    split < n_splits and projection p < len(mats), into ws + split * (groups * out_stride) + row * out_stride
    + p * proj_cols (+ the block's columns). Without ids: one matrix mats[0], the rows g * 16 + r < rows of xr
    [rows, in_width] (a linear; row = its index). With ids [tokens, routed] (int64): MLP slots (exl3_parts.cu's
    mode 1), group g the slot g of token g // KP; projection p's matrix mats[p] + e (e the slot's expert) or
    shared_mats[p] (the shared expert, id shared_id), its inputs at xr + p * xr_proj + slot * in_width; row =
    slot. xr is fp16 (the rotated inputs)."""
    codebooks = bank.codebooks
    if len(codebooks) != 1:
        raise ValueError("the CUDA split sums take a bank of one codebook (this one mixes "
                         f"{sorted(codebooks)}); use the Triton form")
    if xr.dtype != torch.float16:
        raise ValueError(f"split_parts: xr must be the fp16 rotated inputs, got {xr.dtype}")
    if ids is not None and (ids.dtype != torch.int64 or ids.stride(1) != 1):
        raise ValueError(f"split_parts: ids must be int64 rows, got {ids.dtype} with strides {ids.stride()}")
    n_proj = len(mats)
    pair = list(mats) + [0] * (2 - n_proj)
    shared_pair = list(shared_mats) + [0] * (2 - len(shared_mats))
    lib = library(xr.device)
    code = lib.exl3_parts_launch(
        torch.cuda.current_stream(xr.device).cuda_stream, next(iter(codebooks)), groups, n_blocks, n_splits,
        bank.words.data_ptr(), bank.table.data_ptr(), xr.data_ptr(), ws.data_ptr(), int(ids is not None), rows,
        None if ids is None else ids.data_ptr(), 0 if ids is None else ids.stride(0), tokens, routed, shared_id,
        int(has_shared), pair[0], pair[1], shared_pair[0], shared_pair[1], n_proj, in_width, xr_proj, out_stride,
        proj_cols, (groups if ids is not None else rows) * out_stride)
    if code:
        raise RuntimeError(f"exl3_parts_launch: {lib.exl3_error_string(code).decode()} (grid {groups} x {n_blocks} x "
                           f"{n_splits * n_proj}): a device fault or a bad bank table; TF_GLM53_KERNELS=torch serves "
                           "without the kit's GPU kernels meanwhile")
