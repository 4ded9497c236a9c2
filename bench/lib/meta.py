"""What every benchmark result carries (bench/results/README.md, "Method"): the kit's commit, the device, the
versions, the settings, and median/min/max over the samples; written atomically as JSON.

    from bench.lib.meta import result_header, summary, write_json
    result = {**result_header("my_bench", {"dtype": "bf16", "ranks": 1}, device="cuda"), "results": rows}
    write_json(out, result)

On the GPU machine the repo arrives without .git: run the bench there with
GLM53_KIT_COMMIT=<the commit the copy was made from> so the result still names it.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from glm53.atomic_json import write_json_atomic

KIT_ROOT = Path(__file__).resolve().parents[2]
RESULTS = KIT_ROOT / "bench" / "results"
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
        import torch

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


def result_header(bench_name: str, settings: dict[str, Any], device: Any = "cpu",
                  extra_versions: Iterable[str] = ()) -> dict[str, Any]:
    """The fields every result starts with: bench, git_commit, device, cpu_cores, torch_threads (None
    when the bench does not use torch), versions, settings."""
    torch = sys.modules.get("torch")  # only a bench that uses torch has threads worth recording
    threads = torch.get_num_threads() if torch is not None else None
    return {"bench": bench_name, "git_commit": git_commit(), "device": device_description(device),
            "cpu_cores": os.cpu_count(), "torch_threads": threads, "versions": versions(extra_versions),
            "settings": settings}


def cpu_environment(header: dict[str, Any]) -> dict[str, object]:
    """The `environment` block the header-verification and deep-hash results carry beside the header
    (their readers look for it there); header is result_header(..., extra_versions=("huggingface_hub",))."""
    return {"git_commit": header["git_commit"], "device": f"CPU: {cpu_model()}", "cpu_cores": header["cpu_cores"],
            "python": header["versions"]["python"], "huggingface_hub": header["versions"]["huggingface_hub"],
            "platform": platform.platform()}
