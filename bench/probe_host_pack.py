"""How the restore's readers pack host-tier nodes: per tensor (torch), per tensor (memmove), per stack (memmove).

    python bench/probe_host_pack.py --positions 94000 --out bench/results/host_pack_h200.json   # GPU host

A 94k-position KV cache at GLM-5.3's 78 layers (bench_disk_resume's rows and 256-position nodes)
is stored through a PrefixCache's host tier (on CUDA: the background staging, so each node's rows
are StackedRows). Then, for each way of packing a node into a ring buffer: (1) the packing alone,
8 threads over every node into 16 pinned buffers, GB/s; (2) whole host-tier restores into a fresh
cache on the device with that packing patched into kv_cache.diskfile.pack, at 8 and 16 readers,
with the restorer's split (the copying thread waited / copying, the readers ring_waited / reading).
Ways: `torch` (torch._foreach_copy_ per run: the kit's pack before e0e7331), `memmove` (one
ctypes.memmove per tensor), `stack` (one memmove per stack that is a run of the layout, else
torch: what pack does since e0e7331). Restored rows are not compared here: bench_disk_resume
checks them with the kit's pack.
The fourteenth session's run (bench/results/host_pack_h200.log) was made before the JSON output
was added; the script was otherwise this one.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_disk_resume import host_tier_cache, resume, source_state  # noqa: E402
from bench.benchmeta import result_header, write_json  # noqa: E402
from kv_cache import diskfile  # noqa: E402
from kv_cache.restore import Restorer  # noqa: E402

KIT_PACK = diskfile.pack


def pack_torch(rows, runs, buf) -> None:
    """The kit's pack on plain Rows (no stacks): torch._foreach_copy_ per run, as before e0e7331."""
    KIT_PACK(dict(rows), runs, buf)


def pack_memmove(rows, runs, buf) -> None:
    base = buf.data_ptr()
    for r in runs:
        for i, name in enumerate(r.names):
            ctypes.memmove(base + r.start + i * r.nbytes, rows[name].data_ptr(), r.nbytes)


PACKS = {"torch": pack_torch, "memmove": pack_memmove, "stack": KIT_PACK}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, default=4096)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "host_pack.json")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layers = 78
    ns = argparse.Namespace(device=dev, layers=layers, positions=args.positions, threads=0, host_bytes="8G")
    source, prompt = source_state(args.positions, layers, dev)
    pb = source.position_bytes()
    cache = host_tier_cache(source, prompt, dev)
    pieces = list(cache.lookup(prompt).pieces)
    stacks = getattr(pieces[0].rows, "stacks", ())
    print(f"{len(pieces)} host-tier nodes, {len(stacks)} stacks a node ({'; '.join(n[0] + '..' for n, _ in stacks)})",
          file=sys.stderr)
    plans = [diskfile.plan(piece.rows) for piece in pieces]
    total = sum(size for _, size in plans)
    bufs = [torch.empty(max(size for _, size in plans), dtype=torch.uint8, pin_memory=dev == "cuda") for _ in range(16)]
    for b in bufs:
        b.fill_(0)
    alone, restores = [], []
    for name, fn in list(PACKS.items()) * 2:
        with ThreadPoolExecutor(8) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: fn(pieces[i].rows, plans[i][0], bufs[i % 16]), range(len(pieces))))
            s = time.perf_counter() - t0
        alone.append({"pack": name, "s": s, "gb_per_s": total / s / 1e9})
        print(f"pack alone, 8 threads, {name:8s}: {s:.3f}s {total / s / 1e9:.1f} GB/s", file=sys.stderr)
    try:
        for threads in (8, 16):
            for name, fn in PACKS.items():
                diskfile.pack = fn
                cache._restorer = Restorer(None, pinned=True, threads=threads)
                for _ in range(2):
                    times, state = resume(cache, ns, prompt, pb)
                    del state
                    restores.append({"readers": threads, "pack": name, **times})
                    print(f"restore {threads} readers {name:8s}: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()),
                          file=sys.stderr)
    finally:
        diskfile.pack = KIT_PACK
    print(f"\n{'readers':>7} | {'pack':>8} | restore s (each sample)")
    for threads in (8, 16):
        for name in PACKS:
            each = [r["restore"] for r in restores if (r["readers"], r["pack"]) == (threads, name)]
            print(f"{threads:>7} | {name:>8} | " + " / ".join(f"{x:.3f}" for x in each))
    write_json(args.out, {**result_header("probe_host_pack", {"positions": args.positions, "layers": layers}, device=dev),
                          "gb": total / 1e9, "pack_alone": alone, "restores": restores})
    return 0


if __name__ == "__main__":
    sys.exit(main())
