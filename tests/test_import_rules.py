"""Which package may import which, checked over every import statement (function-local ones too) of
the product packages: the direction of the layers, one composition root, no package cycles, and
function-local imports only where a comment says why.

    formats  -> (nothing of the kit but the config)  what a checkpoint's files hold
    exl3     -> formats                              the EXL3 codec
    ops      -> exl3, settings                       the kernels and their dispatch
    model    -> ops, exl3, config, settings          the forward and the KV state it writes
    runtime  -> model, ops, loading, layout, ...     the engine; drafting only as the drafter's loop
                                                     and its Target protocol; no prefix cache, no dist
    dist     -> runtime, model, ...                  one rank of R
    drafter  -> glm53's settings and atomic_json     drafting sees its Target protocol, not the engine
    kv_cache -> glm53's settings (and, in its engine adapter, the ops' kernel choice)
    serving/compose.py: the composition root, the one module of glm53 that imports kv_cache and the
        drafter's draft plan
    nothing in glm53 imports launcher; nothing below glm53.serving imports it

A new import across these lines fails here with the file, the line and the rule.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("glm53", "kv_cache", "drafter", "launcher", "seriestool")
COMPOSITION_ROOT = "glm53/serving/compose.py"
# glm53/__init__.py is TensorFold's family contract: every import of a glm53 module runs it first, so
# it imports only the config at its top, and its functions call down into their homes (check: the
# loader; cuda_engine: the composition root). In the package graph it is a node of its own, above all.
FAMILY_CONTRACT = "glm53/__init__.py"


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute, dotted; `from glm53 import ops` counts as glm53.ops
    local: bool  # inside a function
    typing_only: bool  # under `if TYPE_CHECKING:`


def _absolute(path: Path, node: ast.ImportFrom, root: Path) -> str:
    """A relative `from .x import y`'s module, absolute (the file's package, less level - 1 parts)."""
    package = path.relative_to(root).parent.parts
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_package(module: str, root: Path = ROOT) -> bool:
    return (root / module.replace(".", "/") / "__init__.py").is_file()


def scan(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import of a product package in the file, with where it sits."""
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, True, typing_only)
            elif isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, typing_only)
            elif isinstance(child, ast.Import):
                found.extend(Import(child.lineno, a.name, local, typing_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                module = _absolute(path, child, root) if child.level else child.module or ""
                if module in PRODUCT or _is_package(module, root):  # `from pkg import name`: a submodule where one is
                    for a in child.names:
                        sub = f"{module}.{a.name}"
                        is_sub = _is_package(sub, root) or (root / (sub.replace(".", "/") + ".py")).is_file()
                        found.append(Import(child.lineno, sub if is_sub or module in PRODUCT else module, local,
                                            typing_only))
                else:
                    found.append(Import(child.lineno, module, local, typing_only))
            else:
                visit(child, local, typing_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return [i for i in found if i.module.split(".")[0] in PRODUCT]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a product package in the file."""
    return [(i.line, i.module) for i in scan(path)]


def files(where: str) -> list[Path]:
    path = ROOT / where
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def product_files() -> list[Path]:
    return [p for pkg in PRODUCT for p in files(pkg)]


def _matches(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


# ---- the layers' directions -----------------------------------------------------------------------
GLM53_BASE = ("glm53.config", "glm53.settings", "glm53.atomic_json", "glm53.kv_format")
RULES = [  # (files, the modules they may import from the product packages, why)
    ("glm53/formats", ("glm53.formats", "glm53.config"), "the checkpoint formats sit below everything that reads one"),
    ("glm53/exl3", ("glm53.exl3", "glm53.formats", *GLM53_BASE), "the EXL3 codec sees the formats only"),
    ("glm53/ops", ("glm53.ops", "glm53.exl3", "glm53.settings"), "ops sit below the model"),
    ("glm53/model", ("glm53.model", "glm53.ops", "glm53.exl3", "glm53.config", "glm53.settings", "glm53.kv_format"),
     "the model sees ops, EXL3, its config; its KV state (glm53/model/kv_state.py) is its own"),
    ("glm53/model/kv_state.py", ("glm53.model.token_log", "glm53.kv_format"),
     "the KV state is storage, in the row format the memory plan counts"),
    ("glm53/runtime", ("glm53.runtime", "glm53.model", "glm53.ops", "glm53.loading", "glm53.layout", *GLM53_BASE,
                       "drafter.decode_loop", "drafter.policy", "drafter.target"),
     "the runtime sees the model, the loader, and of drafting only the loop and its Target protocol; its "
     "features (prefix cache, draft plan, draft windows) come in through glm53.runtime.features' protocols"),
    ("drafter", ("drafter", "glm53.settings", "glm53.atomic_json"),
     "drafting sees its Target protocol (drafter/target.py), not the engine"),
    ("kv_cache", ("kv_cache", "glm53.settings", "glm53.ops"),
     "the prefix cache sees the engine only as kv_cache.engine_adapter.CachedEngine (and the ops' kernel choice)"),
]


@pytest.mark.parametrize("where,allowed,why", RULES, ids=[r[0] for r in RULES])
def test_layers_import_only_downwards(where: str, allowed: tuple[str, ...], why: str) -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in files(where) for line, mod in imports(p)
           if not _matches(mod, allowed)]
    assert not bad, f"{why}; allowed: {', '.join(allowed)}:\n" + "\n".join(bad)


def test_the_prefix_cache_meets_the_engine_only_in_its_adapter() -> None:
    adapter = ROOT / "kv_cache" / "engine_adapter.py"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in files("kv_cache") if p != adapter
           for line, mod in imports(p) if mod.startswith("glm53") and mod != "glm53.settings"]
    assert not bad, "kv_cache reaches the engine only through kv_cache/engine_adapter.py:\n" + "\n".join(bad)


def test_only_the_composition_root_wires_the_prefix_cache_and_the_draft_plan_into_an_engine() -> None:
    """In glm53, kv_cache and drafter.glm53_target (the draft plan) are imported by the composition
    root alone; glm53.dist replays drafted windows with the drafter's MTP adapter."""
    allowed = {("glm53/dist/window_channel.py", "drafter.glm53_target")}
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in files("glm53") if p != ROOT / COMPOSITION_ROOT
           for line, mod in imports(p) if _matches(mod, ("kv_cache", "drafter.glm53_target", "drafter.sources"))
           and (p.relative_to(ROOT).as_posix(), mod) not in allowed]
    assert not bad, f"only {COMPOSITION_ROOT} builds an engine's features:\n" + "\n".join(bad)


def test_the_family_contract_reaches_the_engine_only_through_the_composition_root() -> None:
    mods = {mod for _, mod in imports(ROOT / FAMILY_CONTRACT)}
    assert mods <= {"glm53.config", "glm53.loading.loader", "glm53.serving.compose"}, mods


def test_nothing_below_serving_imports_serving_and_nothing_in_the_product_imports_the_launcher() -> None:
    below = [p for pkg in ("glm53", "kv_cache", "drafter") for p in files(pkg)
             if not p.relative_to(ROOT).as_posix().startswith("glm53/serving/") and p != ROOT / FAMILY_CONTRACT]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in below for line, mod in imports(p)
           if _matches(mod, ("glm53.serving", "launcher"))]
    bad += [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in files("glm53/serving") for line, mod in imports(p)
            if _matches(mod, ("launcher",))]
    assert not bad, "\n".join(bad)


INSTALLED = ("glm53", "kv_cache", "drafter", "launcher")  # pyproject's packages; apply.py, seriestool/, bench/ run from the checkout


def test_installed_packages_import_only_installed_packages() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["glm53*", "kv_cache*", "drafter*", "launcher*"]' in pyproject
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for pkg in INSTALLED for p in files(pkg)
           for line, mod in scan_all(p) if mod.split(".")[0] in ("bench", "seriestool", "tests", "apply")]
    assert not bad, "an installed package imports what is not installed:\n" + "\n".join(bad)


def scan_all(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, of any package."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
            out.append((n.lineno, n.module))
    return out


# ---- no package cycles ----------------------------------------------------------------------------
def node(module: str) -> str:
    """A module's node in the package graph: kv_cache, drafter, launcher and seriestool whole; in glm53
    each subpackage (a layer: glm53.model, glm53.runtime, glm53.serving, ...), its own top-level modules
    (config, settings, ...) as "glm53", and the family contract apart."""
    parts = module.split(".")
    if module == "glm53":
        return "glm53 (family contract)"
    if parts[0] == "glm53" and len(parts) > 1 and _is_package("glm53." + parts[1]):
        return "glm53." + parts[1]
    return parts[0]


def node_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.as_posix() == FAMILY_CONTRACT:
        return "glm53 (family contract)"
    return node(".".join(rel.with_suffix("").parts))


def package_graph() -> dict[str, dict[str, str]]:
    """package -> {imported package: the first 'file:line' that imports it}, typing-only imports left out."""
    graph: dict[str, dict[str, str]] = {}
    for path in product_files():
        src = node_of_file(path)
        edges = graph.setdefault(src, {})
        for i in scan(path):
            dst = node(i.module)
            if dst != src and not i.typing_only:
                edges.setdefault(dst, f"{path.relative_to(ROOT)}:{i.line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every elementary cycle's packages, found once each (from its smallest member)."""
    found: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> Iterator[list[str]]:
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                yield [*path, start]
            elif nxt > start and nxt not in path:
                yield from walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        found.extend(walk(start, start, [start]))
    return found


def test_no_package_cycles() -> None:
    graph = package_graph()
    named = [" -> ".join(c) + "\n    " + "\n    ".join(f"{a} -> {b}: {graph[a][b]}" for a, b in zip(c, c[1:]))
             for c in cycles(graph)]
    assert not named, "package import cycles:\n" + "\n".join(named)


def test_the_cycle_finder_names_a_cycle() -> None:
    assert cycles({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}, "d": {"a": "w"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": "x"}, "b": {}}) == []


# ---- function-local imports: only with a reason -----------------------------------------------------
# Heavy optional dependencies whose function-local imports need no comment of their own: this table says
# why. (The Triton kernels import triton at their top; triton is absent or unusable on a CPU machine.)
HEAVY = {
    "glm53.ops.triton_": "a Triton kernel module (imports triton)",
}
# glm53/ops/__init__.py dispatches each op to its backend module at call time (its docstring says why).
DISPATCH = ("glm53/ops/__init__.py", "glm53.ops.")


def commented(lines: list[str], line: int) -> bool:
    """A comment on the import's line, or on the line above it or above the run of imports it ends."""
    if "#" in lines[line - 1]:
        return True
    i = line - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def uncommented_local_imports(path: Path) -> list[str]:
    lines = path.read_text().split("\n")
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for i in scan(path):
        if not i.local or commented(lines, i.line):
            continue
        if any(i.module.startswith(prefix) for prefix in HEAVY):
            continue
        if rel == DISPATCH[0] and i.module.startswith(DISPATCH[1]):
            continue
        out.append(f"{rel}:{i.line} imports {i.module} inside a function")
    return out


def test_function_local_imports_say_why() -> None:
    """A function-local import hides a dependency (and, once, hid package cycles): it is kept only where
    a heavy optional dependency justifies it, with a comment saying which."""
    bad = [b for p in product_files() for b in uncommented_local_imports(p)]
    assert not bad, "move these to the module's top, or say in a comment which heavy dependency they defer:\n" \
        + "\n".join(bad)


def test_the_scan_sees_function_local_and_package_imports(tmp_path: Path) -> None:
    (tmp_path / "glm53").mkdir()
    for name in ("__init__.py", "settings.py"):
        (tmp_path / "glm53" / name).write_text("")
    src = tmp_path / "glm53" / "m.py"
    src.write_text("import os\nfrom glm53 import ops\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from drafter.target import Target\n\ndef f():\n    # on use\n    import drafter.policy\n"
                   "    from . import settings\n")
    found = scan(src, tmp_path)
    assert [(i.line, i.module, i.local, i.typing_only) for i in found] == [
        (2, "glm53.ops", False, False), (5, "drafter.target", False, True), (9, "drafter.policy", True, False),
        (10, "glm53.settings", True, False)]
    lines = src.read_text().split("\n")
    assert commented(lines, 9) and not commented(lines, 2)
