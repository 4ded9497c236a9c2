"""Which package may import which: the direction of the layers, checked over every import statement
(function-local ones too) of the product packages.

    ops      -> exl3, settings                       (the kernels and their dispatch)
    model    -> ops, exl3, kv_state, config, settings (the forward)
    kv_state -> token_log                             (the KV cache of one sequence)
    drafter  -> glm53's settings and atomic_json only (drafting sees its Target protocol, not the engine)
    kv_cache -> glm53 only through kv_cache/engine_adapter.py (the prefix cache sees its engine adapter)
    nothing below the front imports glm53/serving/front/ or launcher/

A new import across these lines fails here with the file, the line and the rule.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("glm53", "kv_cache", "drafter", "front", "launcher", "seriestool", "apibench")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a product package in the file; `from glm53 import
    ops` counts as glm53.ops."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in PRODUCT:
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, mod) for line, mod in found if mod.split(".")[0] in PRODUCT]


RULES = [  # (files, the modules they may import from the product packages, why)
    ("glm53/ops", ("glm53.ops", "glm53.exl3", "glm53.settings"), "ops sit below the model"),
    ("glm53/model", ("glm53.model", "glm53.ops", "glm53.exl3", "glm53.model.kv_state", "glm53.config", "glm53.settings"),
     "the model sees ops, EXL3, its config and the KV state"),
    ("glm53/model/kv_state.py", ("glm53.model.token_log",), "the KV state is storage"),
    ("drafter", ("drafter", "glm53.settings", "glm53.atomic_json"),
     "drafting sees its Target protocol (drafter/target.py), not the engine"),
]


def files(where: str) -> list[Path]:
    path = ROOT / where
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def violations(where: str, allowed: tuple[str, ...]) -> list[str]:
    out = []
    for path in files(where):
        for line, mod in imports(path):
            if not any(mod == a or mod.startswith(a + ".") for a in allowed):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return out


@pytest.mark.parametrize("where,allowed,why", RULES, ids=[r[0] for r in RULES])
def test_layers_import_only_downwards(where: str, allowed: tuple[str, ...], why: str) -> None:
    bad = violations(where, allowed)
    assert not bad, f"{why}; allowed: {', '.join(allowed)}:\n" + "\n".join(bad)


def test_the_prefix_cache_meets_the_engine_only_in_its_adapter() -> None:
    adapter = ROOT / "kv_cache" / "engine_adapter.py"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in files("kv_cache") if p != adapter
           for line, mod in imports(p) if mod.startswith("glm53") and mod != "glm53.settings"]
    assert not bad, "kv_cache reaches the engine only through kv_cache/engine_adapter.py:\n" + "\n".join(bad)


def test_nothing_below_the_front_imports_the_front_or_the_launcher() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for where in ("glm53", "kv_cache", "drafter")
           for p in files(where) for line, mod in imports(p) if mod.split(".")[0] in ("front", "launcher")]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_function_local_and_package_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom glm53 import ops\n\ndef f():\n    from glm53.serving.front.app import build\n    import drafter.policy\n")
    assert imports(src) == [(2, "glm53.ops"), (5, "glm53.serving.front.app"), (6, "drafter.policy")]
