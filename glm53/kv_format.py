"""The KV cache's row format: the bytes one cached row takes in each storage dtype.

Torch-free, so that the launcher's memory plan (glm53.layout.kv) sizes a lane without importing the
model; glm53.model.kv_state allocates rows of exactly these sizes (tests/test_layout.py checks the two
agree).
"""
from __future__ import annotations

KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp32": 4}  # a value's bytes in each cache dtype
SERVING_KV_DTYPES = ("bf16", "fp8")  # what a lane serves (fp32 caches are the CPU tests')
FP8_SCALE_BYTES = 4  # fp8 rows carry one fp32 scale each


def row_bytes(dim: int, kv_dtype: str) -> int:
    """Bytes one cached row of `dim` values takes: the values in the cache dtype, plus one fp32 scale
    per row for fp8."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPE_BYTES)}")
    return dim * KV_DTYPE_BYTES[kv_dtype] + (FP8_SCALE_BYTES if kv_dtype == "fp8" else 0)
