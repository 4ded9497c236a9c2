"""Host memcpy from worker threads: torch's copy against a plain memmove, alone and beside a main thread.

    python bench/probe_host_copy.py --out bench/results/host_copy_h200.json     # the GPU host (pinned)

Why: the restore's readers pack host-tier nodes into pinned ring buffers and the store's worker
copies staged rows into pageable ones, each with torch copies from a non-main thread. A CPU
`copy_` of a big tensor runs as an intra-op parallel loop, and a thread that is not the main one
gets its own OpenMP team of torch.get_num_threads() threads: 8 readers on a 16-core host can start
~128. This probe copies nodes of 117 tensors (~2.36 MB each, a 2048-position node of GLM-5.3's 78
layers at one rank) from pageable memory into one pinned (where CUDA is here) buffer per thread,
for 1, 4 and 8 threads, by three methods: `torch` (torch._foreach_copy_, as kv_cache.diskfile.pack
does), `memmove` (ctypes.memmove per tensor: one libc memcpy, the GIL released, no threads of its
own) and `torch_1t` (torch with intra-op threads set to 1 inside each worker). It reports GB/s,
and how much slower a main thread's loop of small torch calls (a stand-in for launching the next
request's kernels) runs while the workers copy. Medians of --repeats; JSON with every sample.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_store_fill import main_work  # noqa: E402
from bench.benchmeta import result_header, write_json  # noqa: E402

TENSORS, TENSOR_BYTES = 117, 2048 * 1152  # one node's tensors at 78 layers; one latent tensor's bytes
METHODS = ("torch", "memmove", "torch_1t")


def copy_node(method: str, dst: torch.Tensor, srcs: list[torch.Tensor]) -> None:
    views = [dst[i * TENSOR_BYTES:(i + 1) * TENSOR_BYTES] for i in range(len(srcs))]
    if method == "memmove":
        for d, s in zip(views, srcs):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), TENSOR_BYTES)
    else:
        torch._foreach_copy_(views, srcs)


def run_copies(method: str, threads: int, nodes: list[list[torch.Tensor]], dsts: list[torch.Tensor],
               copies: int) -> float:
    """Seconds for `copies` node copies spread over `threads` workers (node i % len(nodes))."""
    slot = threading.local()
    ids = iter(range(threads))
    lock = threading.Lock()

    def init() -> None:
        with lock:
            slot.i = next(ids)
        if method == "torch_1t":
            torch.set_num_threads(1)  # this worker's intra-op threads (OpenMP's setting is per thread)

    with ThreadPoolExecutor(threads, initializer=init) as pool:
        pool.map(lambda _: None, range(threads))  # start every worker before timing
        t0 = time.perf_counter()
        list(pool.map(lambda i: copy_node(method, dsts[slot.i], nodes[i % len(nodes)]), range(copies)))
        return time.perf_counter() - t0


def main_loop(stop: threading.Event, laps: list[float]) -> None:
    """Small torch calls, as a thread launching kernels makes them (bench_store_fill's); a lap = 200."""
    while not stop.is_set():
        laps.append(main_work(200))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8, help="distinct source nodes (~276 MB each)")
    p.add_argument("--copies", type=int, default=32, help="node copies a sample (32: ~8.8 GB, a 94k resume)")
    p.add_argument("--threads", default="1,4,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "host_copy.json")
    args = p.parse_args()
    thread_counts = [int(x) for x in args.threads.split(",")]
    pinned = torch.cuda.is_available()
    node_bytes = TENSORS * TENSOR_BYTES
    print(f"{args.nodes} pageable nodes of {node_bytes / 1e6:.0f} MB, destinations "
          f"{'pinned' if pinned else 'pageable (no CUDA here)'}, torch threads {torch.get_num_threads()}",
          file=sys.stderr)
    nodes = [[torch.full((TENSOR_BYTES,), (n + i) % 251, dtype=torch.uint8) for i in range(TENSORS)]
             for n in range(args.nodes)]
    dsts = [torch.empty(node_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(max(thread_counts))]
    for d in dsts:
        d.fill_(0)  # fault every page before timing
    stop = threading.Event()
    alone: list[float] = []
    th = threading.Thread(target=main_loop, args=(stop, alone))
    th.start()
    time.sleep(0.5)
    stop.set()
    th.join()
    lap_alone = statistics.median(alone)
    rows, samples = [], []
    for threads in thread_counts:
        for method in METHODS:
            secs, slowdowns = [], []
            for r in range(args.repeats):
                laps: list[float] = []
                stop.clear()
                th = threading.Thread(target=main_loop, args=(stop, laps))
                th.start()
                s = run_copies(method, threads, nodes, dsts, args.copies)
                stop.set()
                th.join()
                # the copies landed: check one destination against its source
                d = dsts[0][:TENSOR_BYTES]
                if not any(torch.equal(d, nd[0]) for nd in nodes):
                    print(f"error: {method} copied wrong bytes", file=sys.stderr)
                    return 1
                secs.append(s)
                slowdowns.append(statistics.median(laps) / lap_alone if laps else float("nan"))
                samples.append({"threads": threads, "method": method, "repeat": r, "s": s,
                                "main_slowdown": slowdowns[-1]})
                print(f"  {threads} threads {method:9s} {args.copies * node_bytes / s / 1e9:6.2f} GB/s, "
                      f"main loop x{slowdowns[-1]:.2f}", file=sys.stderr)
            med = statistics.median(secs)
            rows.append({"threads": threads, "method": method, "s": med,
                         "gb_per_s": args.copies * node_bytes / med / 1e9,
                         "main_slowdown": statistics.median(slowdowns)})
    print(f"\n{args.copies} node copies ({args.copies * node_bytes / 1e9:.1f} GB), medians of {args.repeats}")
    print(f"{'threads':>7} | {'method':>9} | {'s':>7} | {'GB/s':>6} | main loop slowdown")
    for r in rows:
        print(f"{r['threads']:>7} | {r['method']:>9} | {r['s']:7.3f} | {r['gb_per_s']:6.2f} | x{r['main_slowdown']:.2f}")
    write_json(args.out, {**result_header("probe_host_copy", {**vars(args), "out": str(args.out)}), "pinned": pinned,
                          "main_lap_alone_s": lap_alone, "rows": rows, "samples": samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
