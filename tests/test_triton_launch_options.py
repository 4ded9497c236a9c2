"""Every kernel launch in glm53/ops passes the kit's launch options (glm53/ops/triton_launch.py), so a
Triton whose defaults change (3.10 turns FP fusion off by default) runs the arithmetic the kit's
bitwise checks and timings were made with."""
from __future__ import annotations

import ast
from pathlib import Path

OPS = Path(__file__).resolve().parents[1] / "glm53" / "ops"


def _launches(tree: ast.AST) -> list[ast.Call]:
    """kernel[grid](...) calls and JITFunction.warmup(...) calls (fit_prefill's compile-only launch)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id.endswith("_kernel"):
                found.append(node)
            elif isinstance(node.func, ast.Name) and node.func.id == "kernel":  # `kernel = k.warmup or k[grid]`
                found.append(node)
    return found


def test_every_launch_passes_the_kit_options() -> None:
    missing, count = [], 0
    for path in sorted(OPS.glob("triton_*.py")):
        for call in _launches(ast.parse(path.read_text())):
            count += 1
            passed = {kw.value.id for kw in call.keywords if kw.arg is None and isinstance(kw.value, ast.Name)}
            if "OPTIONS" not in passed:
                missing.append(f"{path.name}:{call.lineno}")
    assert count >= 13, f"found only {count} launches: the scan no longer sees them"
    assert not missing, f"launches without **OPTIONS: {missing}"


def test_options_keep_fp_fusion_on() -> None:
    from glm53.ops.triton_launch import OPTIONS

    assert OPTIONS == {"enable_fp_fusion": True}
