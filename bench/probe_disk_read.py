"""Probe: the ceilings under a disk resume, piece by piece (not a benchmark of the kit's code).

    python bench/probe_disk_read.py [--files 64] [--mib 24] [--device cuda]

For --files files of --mib MiB (a 78-layer node of 256 positions is ~24 MiB), in memory and in a
temp folder (pages cached, then dropped), at 1..--threads threads:

    hash    GB/s of SHA-256 (hashlib), xxh3_128 and blake3 where installed, over buffers in memory
    read    GB/s of readinto from the page cache into a fresh buffer per file / a reused one, and
            from the disk (pages dropped) into a reused one
    h2d     GB/s to the GPU of one node's rows as 117 pageable tensors / one pinned buffer

Prints a table; JSON to --out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


def hashers() -> dict:
    out = {"sha256": lambda b: hashlib.sha256(b).digest()}
    try:
        import xxhash
        out["xxh3_128"] = lambda b: xxhash.xxh3_128_digest(b)
    except ImportError:
        pass
    try:
        import blake3
        out["blake3"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    return out


def rate(nbytes: int, fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def drop(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into(path: Path, buf: np.ndarray) -> int:
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--mib", type=int, default=24)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("probe_disk_read.json"))
    args = p.parse_args()
    size = args.mib << 20
    total = size * args.files
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.files)]
    counts = sorted({1, 2, 4, 8, args.threads} & set(range(1, args.threads + 1)))
    result: dict = {"files": args.files, "mib": args.mib, "cpus": os.cpu_count(), "hash": {}, "read": {}}
    for name, h in hashers().items():
        for t in counts:
            with ThreadPoolExecutor(t) as pool:
                result["hash"][f"{name}@{t}"] = rate(total, lambda: list(pool.map(h, bufs)))
            print(f"hash {name} x{t}: {result['hash'][f'{name}@{t}']:.2f} GB/s", file=sys.stderr, flush=True)
    folder = Path(tempfile.mkdtemp(prefix="probe_disk_"))
    try:
        paths = []
        for i, b in enumerate(bufs):
            path = folder / f"{i}.bin"
            with open(path, "wb") as f:
                f.write(b.tobytes())
                f.flush()
                os.fsync(f.fileno())
            paths.append(path)
        del bufs
        for t in counts:
            with ThreadPoolExecutor(t) as pool:
                read_into(paths[0], np.empty(size, np.uint8))
                result["read"][f"fresh_buffer@{t}"] = rate(
                    total, lambda: list(pool.map(lambda q: read_into(q, np.empty(size, np.uint8)), paths)))
                local = threading.local()

                def into_reused(q: Path) -> int:  # one buffer per thread, touched before timing
                    if not hasattr(local, "buf"):
                        local.buf = np.ones(size, np.uint8)
                    return read_into(q, local.buf)
                list(pool.map(into_reused, paths[:t]))
                result["read"][f"reused_buffer@{t}"] = rate(total, lambda: list(pool.map(into_reused, paths)))

                def cold() -> None:
                    drop(paths)
                    t0 = time.perf_counter()
                    list(pool.map(into_reused, paths))
                    cold.dt = time.perf_counter() - t0
                cold()
                result["read"][f"disk_reused_buffer@{t}"] = total / cold.dt / 1e9
            print(f"read x{t}: " + ", ".join(f"{k.split('@')[0]} {v:.2f}" for k, v in result["read"].items()
                                               if k.endswith(f"@{t}")) + " GB/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.device == "cuda":
        node = torch.empty(size, dtype=torch.uint8)
        parts = list(node.split(size // 117))
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        dparts = list(dev.split(size // 117))
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)

        def pageable() -> None:
            for _ in range(8):
                for a, b in zip(dparts, parts):
                    b_ = a.copy_(b)
            torch.cuda.synchronize()
            return b_

        def pinned_copy() -> None:
            for _ in range(8):
                dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
        result["h2d_pageable_117"] = rate(8 * size, pageable)
        result["h2d_pinned_one"] = rate(8 * size, pinned_copy)
        print(f"h2d: pageable x117 {result['h2d_pageable_117']:.2f} GB/s, pinned one {result['h2d_pinned_one']:.2f} GB/s",
              file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
