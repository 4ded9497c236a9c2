"""This node's available memory, as the kernel reports it (MemAvailable in /proc/meminfo).

On unified-memory machines (DGX Spark) the GPU allocates from the same pool, so MemAvailable is
the number that matters. Callers pass Settings.meminfo (TF_GLM53_MEMINFO: another file in the
meminfo format, for tests); the default is the kernel's.
"""
from __future__ import annotations

from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
PROC_MEMINFO = "/proc/meminfo"


def read_meminfo(path: str | Path = PROC_MEMINFO) -> dict[str, int]:
    """Fields of a meminfo file in bytes."""
    values: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            values[name.strip()] = int(parts[0]) * scale
    return values


def available_bytes(path: str | Path = PROC_MEMINFO) -> int:
    info = read_meminfo(path)
    if "MemAvailable" not in info:
        raise RuntimeError(f"{path}: no MemAvailable line; cannot watch memory")
    return info["MemAvailable"]


def total_bytes(path: str | Path = PROC_MEMINFO) -> int:
    return read_meminfo(path)["MemTotal"]
