"""The selection kernel (glm53/ops/triton_topk.py) compiles for the H200 (sm_90) without a GPU.

Triton's interpreter (tests/test_triton_interpret.py) runs a kernel's logic but not its compiler:
the kernel's first form passed there and then failed to compile on the H200 (a constexpr
reassigned inside static_range). triton.compile with an explicit target runs the whole pipeline
here, ptxas included (Triton's wheel carries it), so such an error fails on the CPU.
"""
from __future__ import annotations

import importlib.util

import pytest


def test_selection_kernel_compiles_for_sm90() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here: the compile check needs it (pip install triton)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from glm53.ops import triton_topk

    signature = {"s_ptr": "*fp32", "idx_ptr": "*i64", "valid_ptr": "*i8", "nan_ptr": "*i32", "N": "i32",
                 "WIDTH": "i32", "stride_s": "i32", "stride_i": "i32", "stride_v": "i32",
                 "BLOCK": "constexpr", "BINS": "constexpr"}
    source = ASTSource(fn=triton_topk._select_kernel, signature=signature,
                       constexprs={"BLOCK": triton_topk.BLOCK, "BINS": triton_topk.BINS})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], "no machine code"
    assert ".target sm_90" in compiled.asm["ptx"]
