"""Every bench script imports cleanly and answers --help on a CPU without running anything: a bench is a
script over bench.lib, run as `python -m bench.<name>`; none imports another bench."""
from __future__ import annotations

import ast
import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("bench_*.py"))


def test_there_are_bench_scripts_and_no_probes() -> None:
    assert len(SCRIPTS) >= 20
    assert not list(BENCH.glob("probe_*.py")), "a probe that answered its question goes into a decision record (docs/decisions/)"


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_imports_only_bench_lib(name: str) -> None:
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    wrong = sorted(m for m in imported if m.split(".")[0] == "bench" and not m.startswith("bench.lib"))
    assert not wrong, f"{name} imports {wrong}: move what benches share into bench/lib"


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_help_runs_on_cpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=False)
    assert done.value.code in (0, None)
    assert "usage:" in out.getvalue()
