"""What preflight asks each node, run there with the lane's runtime: prints one JSON object.

`python -m launcher.probe --model DIR --kit-dir DIR [--workdir DIR] [--runtime-stamp FILE]`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from glm53.settings import Settings, SettingsError
from glm53.serving.meminfo import PROC_MEMINFO, read_meminfo


def gpus() -> list[dict[str, Any]]:
    """Visible NVIDIA GPUs via nvidia-smi; [] when there is none. Unified memory shows as N/A totals."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.stdout.strip().splitlines() if out.returncode == 0 else []:
        name, total, free = (x.strip() for x in line.split(",")[:3])
        found.append({"name": name, "total_mib": int(total) if total.isdigit() else None,
                      "free_mib": int(free) if free.isdigit() else None})
    return found


def _git(path: str, *args: str) -> str | None:
    """git's output in `path`; None where it fails or the node has no git at all (a copy without .git
    on a bare machine runs the local lane all the same)."""
    try:
        out = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(path: str | None) -> str | None:
    if not path or not Path(path).is_dir():
        return None
    return _git(path, "rev-parse", "HEAD") or None


def git_dirty(path: str) -> bool:
    return bool(_git(path, "status", "--porcelain", "--untracked-files=no"))


def probe(model: str, kit_dir: str, workdir: str | None, runtime_stamp: str | None,
          meminfo: str = PROC_MEMINFO) -> dict[str, Any]:
    mem = read_meminfo(meminfo)
    found = gpus()
    disk_path = Path(kit_dir)
    try:
        kit_version = metadata.version("glm53-kit")
    except metadata.PackageNotFoundError:
        kit_version = None
    stamp = Path(runtime_stamp) if runtime_stamp else None
    return {
        "hostname": socket.gethostname(),
        "python": sys.executable,
        "gpus": found,
        "unified": bool(found) and all(g["total_mib"] is None for g in found),
        "mem_available": mem.get("MemAvailable", 0),
        "mem_total": mem.get("MemTotal", 0),
        "disk_free": shutil.disk_usage(disk_path if disk_path.exists() else "/").free,
        "model_present": (Path(model) / "config.json").is_file(),
        "kit_commit": git_commit(kit_dir),
        "kit_dirty": git_dirty(kit_dir) if git_commit(kit_dir) else False,
        "kit_version": kit_version,
        "workdir_commit": git_commit(workdir),
        "runtime_key": stamp.read_text().strip() if stamp and stamp.is_file() else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m launcher.probe")
    p.add_argument("--model", required=True)
    p.add_argument("--kit-dir", required=True)
    p.add_argument("--workdir")
    p.add_argument("--runtime-stamp")
    a = p.parse_args()
    try:  # the node's TF_GLM53_* variables, as its rank will parse them
        settings = Settings.from_env()
    except SettingsError as exc:
        sys.exit(f"launcher.probe: {exc}")
    print(json.dumps(probe(a.model, a.kit_dir, a.workdir, a.runtime_stamp, settings.meminfo)))


if __name__ == "__main__":
    main()
