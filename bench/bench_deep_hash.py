"""`--deep` throughput (SHA-256 of every shard, threaded) against plain sequential reads of the same files.

    python -m bench.bench_deep_hash [--files 4] [--mib 256] [--workers 1,2,4] [--rounds 3] [--out bench/results/deep_hash.json]

Writes `--files` real shards of random data (`--mib` MiB each) with a manifest of their hashes,
then measures, interleaved in each round (order rotated so no mode always goes first):
  read        sequential read of every file, nothing else (the disk/page-cache floor)
  deep-wN     glm53.checkpoints.verify's deep check with N hashing threads (hashlib releases the GIL)
in two cache states: `warm` (files in the page cache: hashing-bound) and `cold` (each file's pages
dropped first with posix_fadvise(DONTNEED), which evicts only these files' clean pages, not the
machine's cache). Ratios are deep time / read time of the same round. Files are deleted at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.meta import RESULTS, cpu_environment
from bench.lib.meta import result_header
from glm53.measurement import summary, write_json
from glm53.checkpoints.manifest import FileRecord, Manifest
from glm53.checkpoints.verify import VerifyResult, _deep_check

CHUNK = 8 << 20


def make_files(folder: Path, n: int, mib: int) -> Manifest:
    files = {}
    block = os.urandom(1 << 20)
    for k in range(n):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        h = hashlib.sha256()
        with open(folder / name, "wb") as f:
            for i in range(mib):
                chunk = bytes([k, i & 0xFF]) + block[2:]  # distinct content per MiB
                f.write(chunk)
                h.update(chunk)
        files[name] = FileRecord(mib << 20, h.hexdigest())
    return Manifest("bench/local", "main", None, "", files)


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(paths: list[Path]) -> None:
    buf = bytearray(CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def deep(folder: Path, manifest: Manifest, names: list[str], workers: int) -> None:
    result = VerifyResult(str(folder))
    _deep_check(folder, manifest, names, result, workers, None)
    if result.findings:
        raise SystemExit(f"deep check found problems in the bench files: {result.findings[:2]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(RESULTS / "deep_hash.json"))
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="bench_deep_", dir=args.workdir))
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        manifest = make_files(folder, args.files, args.mib)
        names = sorted(manifest.files)
        paths = [folder / n for n in names]
        total = sum(p.stat().st_size for p in paths)
        modes = ["read"] + [f"deep-w{w}" for w in workers]
        for state in ("cold", "warm"):
            samples[state] = {m: [] for m in modes}
            plain_read(paths)  # warm-up (discarded)
            for rnd in range(args.rounds):
                order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
                for mode in order:
                    if state == "cold":
                        drop_cache(paths)
                    t0 = time.perf_counter()
                    if mode == "read":
                        plain_read(paths)
                    else:
                        deep(folder, manifest, names, int(mode.split("-w")[1]))
                    samples[state][mode].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for state, per_mode in samples.items():
        for mode, secs in per_mode.items():
            ratios = [s / r for s, r in zip(secs, per_mode["read"])]
            rates = [total / 2**20 / s for s in secs]
            rows.append({"cache": state, "mode": mode, "seconds": secs, "mib_per_s": rates,
                         **summary(rates, unit="mib_per_s"), "time_vs_read_median": summary(ratios)["median"]})
    settings = {"files": args.files, "mib_per_file": args.mib, "bytes": total, "workers": workers, "rounds": args.rounds,
                "chunk_bytes": CHUNK, "cold": "posix_fadvise(DONTNEED) on these files before each sample"}
    header = result_header("deep_hash", settings, extra_versions=("huggingface_hub",))
    doc = {**header, "environment": cpu_environment(header), "rows": rows}
    out = write_json(args.out, doc, indent=2)
    print(f"\n--deep vs plain reads: {args.files} x {args.mib} MiB, {args.rounds} interleaved rounds, "
          f"{os.cpu_count()} CPU cores; JSON: {out}")
    print(f"{'cache':<6} {'mode':<9} {'MiB/s median [min-max]':>26} {'time / read':>12}")
    for r in rows:
        print(f"{r['cache']:<6} {r['mode']:<9} {r['median_mib_per_s']:>10.0f} [{r['min_mib_per_s']:.0f}-{r['max_mib_per_s']:.0f}]"
              f"{'':>6} {r['time_vs_read_median']:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
