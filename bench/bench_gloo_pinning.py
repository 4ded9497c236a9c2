"""gloo collectives between R processes on this machine, each process pinned to one CPU or not.

    python -m bench.bench_gloo_pinning                 # R = 2, 3, 4; 500 calls per sample
    python -m bench.bench_gloo_pinning --ranks 4 --calls 2000

Why: the multi-rank tests (tests/test_dist_processes.py `Ranks`) run up to four ranks on a
two-core CI machine, where a tiny all-reduce costs milliseconds of scheduling, not bytes; they pin
rank r to the r-th CPU modulo the count. This measures what that buys: per R, the two arms
alternate (unpinned, pinned, unpinned, ...), each sample is R fresh processes timing --calls
all-reduces and all-gathers of 64 fp32 values after a warm-up; rank 0's mean time per call is the
sample. Prints a table; JSON (bench/lib/meta.py header, every sample) to --out. Exit codes: 0 done,
1 a rank failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json

ARMS = ("unpinned", "pinned")
OPS = ("all_reduce", "all_gather")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, calls: int, pinned: bool, results) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    if pinned:  # as tests/test_dist_processes.py Ranks does
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.zeros(64)
    parts = [torch.zeros(64) for _ in range(world)]
    run = {"all_reduce": lambda: dist.all_reduce(x), "all_gather": lambda: dist.all_gather(parts, x)}
    times = {}
    for op in OPS:
        for _ in range(50):  # warm-up
            run[op]()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            run[op]()
        times[op] = (time.perf_counter() - t0) / calls
    if rank == 0:
        results.update(times)
    dist.destroy_process_group()


def sample(world: int, calls: int, pinned: bool) -> dict[str, float]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(world, free_port(), calls, pinned, results), nprocs=world)
        return dict(results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 3, 4])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3, help="samples per arm and R")
    p.add_argument("--out", type=Path, default=RESULTS / "gloo_pinning_cpu.json")
    args = p.parse_args()
    if min(args.ranks, default=0) < 2 or args.calls < 1 or args.repeats < 1:
        print("error: --ranks must be >= 2 each, --calls and --repeats positive", file=sys.stderr)
        return 2
    rows = []
    for world in args.ranks:
        samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for i in range(args.repeats):
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                try:
                    samples[arm].append(sample(world, args.calls, arm == "pinned"))
                except Exception as exc:  # noqa: BLE001 - a rank failed: report which run
                    print(f"error: R={world} {arm} sample {i}: {exc}", file=sys.stderr)
                    return 1
                print(f"R={world} {arm} sample {i}: " + ", ".join(
                    f"{op} {samples[arm][-1][op] * 1e6:.0f} us" for op in OPS), file=sys.stderr, flush=True)
        row = {"ranks": world, "samples": samples}
        for arm in ARMS:
            for op in OPS:
                row[f"{arm}_{op}_s"] = summary([s[op] for s in samples[arm]])
        row["speedup"] = {op: row[f"unpinned_{op}_s"]["median"] / row[f"pinned_{op}_s"]["median"] for op in OPS}
        rows.append(row)
    settings = {"calls": args.calls, "repeats": args.repeats, "values_per_call": 64, "backend": "gloo",
                "timing": "rank 0's mean per call after 50 warm-up calls, arms alternating"}
    write_json(args.out, {**result_header("gloo_pinning", settings), "cases": rows})
    print(f"{'R':>3} {'op':>11} {'unpinned (us)':>14} {'pinned (us)':>12} {'speedup':>8}")
    for r in rows:
        for op in OPS:
            print(f"{r['ranks']:3d} {op:>11} {r[f'unpinned_{op}_s']['median'] * 1e6:14.0f} "
                  f"{r[f'pinned_{op}_s']['median'] * 1e6:12.0f} {r['speedup'][op]:7.2f}x")
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
