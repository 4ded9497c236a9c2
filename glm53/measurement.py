"""What a measurement records about where it ran: the kit's commit, the device, the versions; a
summary of its samples (median, min, max); its JSON written atomically. Shared by the API benchmark
(glm53.apibench) and the repository's benches (bench/lib/meta.py).

On the GPU machine the repo arrives without .git: run there with GLM53_KIT_COMMIT=<the commit the
copy was made from> so the result still names it.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from glm53.atomic_json import write_json_atomic

KIT_ROOT = Path(__file__).resolve().parents[1]
COMMIT_ENV = "GLM53_KIT_COMMIT"


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(repo: Path | str = KIT_ROOT) -> str:
    """$GLM53_KIT_COMMIT when set (the operator names the commit a copy was made from: the GPU
    machine's copy may carry a stale .git), else HEAD of the kit, with "-dirty" when tracked files
    differ from it (untracked files do not count: the shared tree always has some), else "unknown"."""
    named = os.environ.get(COMMIT_ENV, "").strip()
    if named:
        return named
    head = _git(Path(repo), "rev-parse", "HEAD")
    if head:
        changes = _git(Path(repo), "status", "--porcelain", "--untracked-files=no")
        return head + ("-dirty" if changes else "")
    return "unknown"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: Any = "cpu") -> str:
    """GPU name for a CUDA device ("cuda", "cuda:1", torch.device); else "<CPU model> (<N> cores)"."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda":
        import torch  # only for a GPU's name: the API benchmark runs without torch (~3 s to import)

        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cores)"


def installed_version(package: str) -> str | None:
    """The installed distribution's version, None when it is not installed (read from its metadata:
    nothing is imported)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """python, torch and triton versions ("absent" where not installed), plus any `extra` packages."""
    out = {"python": platform.python_version()}
    for package in ("torch", "triton", *extra):
        out[package] = installed_version(package) or "absent"
    return out


def summary(samples: Sequence[float], unit: str = "") -> dict[str, float]:
    """{median, min, max, n}; with unit "s" the keys are median_s, min_s, max_s (n stays n)."""
    if not samples:
        raise ValueError("summary: no samples (a benchmark case that ran zero times)")
    sfx = f"_{unit}" if unit else ""
    return {f"median{sfx}": statistics.median(samples), f"min{sfx}": min(samples), f"max{sfx}": max(samples),
            "n": len(samples)}


def write_json(path: Path | str, obj: Any, indent: int = 1) -> Path:
    """Write obj as JSON atomically (glm53.atomic_json): a reader sees the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, obj, indent=indent)
