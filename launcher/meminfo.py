"""This node's available memory, as the kernel reports it (MemAvailable in /proc/meminfo).

On unified-memory machines (DGX Spark) the GPU allocates from the same pool, so MemAvailable is
the number that matters. TF_GLM53_MEMINFO points at another file in the meminfo format (tests).
"""
from __future__ import annotations

import os
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


def meminfo_path() -> Path:
    return Path(os.environ.get("TF_GLM53_MEMINFO", "/proc/meminfo"))


def read_meminfo(path: Path | None = None) -> dict[str, int]:
    """Fields of a meminfo file in bytes."""
    values: dict[str, int] = {}
    for line in (path or meminfo_path()).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            values[name.strip()] = int(parts[0]) * scale
    return values


def available_bytes(path: Path | None = None) -> int:
    info = read_meminfo(path)
    if "MemAvailable" not in info:
        raise RuntimeError(f"{path or meminfo_path()}: no MemAvailable line; cannot watch memory")
    return info["MemAvailable"]


def total_bytes(path: Path | None = None) -> int:
    return read_meminfo(path)["MemTotal"]
