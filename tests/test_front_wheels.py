"""The GPU machine's front wheels on the CPU: tests/gpu/prepare_front_wheels.sh downloads pyproject.toml's
pins, and tests/gpu/install_front_wheels.py installs the carried wheels, adds a floor wheel only where the
machine's copy of a required package is too old or absent, and fails naming a requirement nothing meets."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "tests" / "gpu" / "install_front_wheels.py"


def _pins(lines: list[str]) -> dict[str, str]:
    return {m[1].lower().replace("_", "-"): m[2] for line in lines
            if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)", line.strip()))}


def test_the_front_wheels_are_pyprojects_pins() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = _pins(project["dependencies"] + project["optional-dependencies"]["bench"])
    script = (REPO / "tests" / "gpu" / "prepare_front_wheels.sh").read_text()
    carried = _pins(re.findall(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", script))
    shared = set(carried) & set(pinned)
    assert {"fastapi", "starlette", "pydantic", "uvicorn", "llguidance", "openai", "h11"} <= shared
    assert {name: carried[name] for name in shared} == {name: pinned[name] for name in shared}


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n", f"{info}/METADATA": meta,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def _install(wheels: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(INSTALL), "--wheels", str(wheels), "--target", str(target)],
                          capture_output=True, text=True, timeout=300)


def test_floor_wheels_go_in_only_where_the_machine_falls_short(tmp_path: Path) -> None:
    wheels = tmp_path / "front"
    # alpha needs gamma (carried, pinned), pytest (this machine's meets it), beta (absent here: its floor wheel)
    _wheel(wheels, "alpha", "1.0", ("gamma==2.0", "pytest>=1", "beta>=2", 'delta>=1; extra == "docs"'))
    _wheel(wheels, "gamma", "2.0")
    _wheel(wheels / "floor", "beta", "2.1")
    _wheel(wheels / "floor", "pluggy", "0.0.1")  # this machine's pluggy is newer: never installed
    done = _install(wheels, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert lines["alpha"] == ["1.0", "carried"] and lines["gamma"] == ["2.0", "carried"]
    assert lines["beta"] == ["2.1", "floor", "wheel"] and lines["pytest"][1:] == ["this", "machine's"]
    assert "delta" not in lines and "pluggy" not in lines  # an extra's requirement; nothing requires pluggy
    installed = {p.name for p in (tmp_path / "site").iterdir()}
    assert {"alpha", "gamma", "beta"} <= installed and "pluggy" not in installed


def test_a_requirement_nothing_meets_fails_naming_it(tmp_path: Path) -> None:
    wheels = tmp_path / "front"
    _wheel(wheels, "alpha", "1.0", ("gamma==2.0", "epsilon>=1"))
    _wheel(wheels, "gamma", "1.9")  # the pins disagree
    done = _install(wheels, tmp_path / "site")
    assert done.returncode == 1
    assert "unmet: epsilon absent: wanted epsilon>=1" in done.stderr
    assert "unmet: gamma 1.9: wanted gamma==2.0" in done.stderr
    assert "no wheels in" in _install(tmp_path / "empty", tmp_path / "site2").stderr
