"""A store's background half against the thread that launches the next request, side by side (CPU).

    python -m bench.bench_store_fill --against ab_old --out bench/results/store_fill_cpu.json

After a reply the prefix cache stores the turn's new rows: the copies into the staging buffer are
queued on the request's path, and a worker thread then gives every node (a block of 256 positions)
rows of its own (kv_cache/staging.py `_fill_nodes`), while the engine's thread is already launching
the next turn's kernels, both under one GIL. Here: a turn's store at GLM-5.3's 78 layers (78 latent
tensors [n, 576] and 39 indexer-key tensors [n, 128], bf16, one rank) of --positions positions, and
on the main thread a fixed piece of Python-heavy torch work (--ops small in-place adds, standing in
for kernel launches). Per arm (this checkout's kv_cache, and with --against DIR another checkout's,
e.g. `git archive <commit> | tar -x -C DIR`), one staging buffer each, reused: the store's own time
(copy() to its future done), and the main thread's work alone and while a fill runs. Arms alternate, medians of --repeats. Prints
a table; JSON (bench/lib/meta.py header) to --out. Exit 0; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json

BLOCK = 256
LATENT, INDEX, LAYERS = 576, 128, 78


def load_kv_cache(root: Path, name: str) -> ModuleType:
    """The kv_cache package of the checkout at root, imported as `name` (its own modules inside)."""
    init = root / "kv_cache" / "__init__.py"
    if not init.is_file():
        print(f"error: {root} holds no kv_cache package (give a kit checkout)", file=sys.stderr)
        raise SystemExit(2)
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    importlib.import_module(f"{name}.staging")
    return module


def turn_rows(positions: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = {f"latent.{i}": torch.randn(positions, LATENT, generator=g).to(torch.bfloat16) for i in range(LAYERS)}
    rows.update({f"index.{i}": torch.randn(positions, INDEX, generator=g).to(torch.bfloat16)
                 for i in range(0, LAYERS, 2)})
    return rows


def start_fill(kv, staging, rows: dict[str, torch.Tensor], positions: int):
    """copy() of the turn's nodes through that kv_cache's Staging: the fill's future."""
    todo = [(kv.Node(b"%d" % a, b"", None), a, min(a + BLOCK, positions)) for a in range(0, positions, BLOCK)]
    return staging.copy(todo, lambda a, b: {k: v[a:b] for k, v in rows.items()})


def one_fill(kv, staging, rows: dict[str, torch.Tensor], positions: int) -> float:
    """Seconds from copy() to its future done: the copies into the buffer and the worker's fill."""
    t0 = time.perf_counter()
    start_fill(kv, staging, rows, positions).result()
    return time.perf_counter() - t0


def main_work(ops: int) -> float:
    x = torch.zeros(8)
    t0 = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    return time.perf_counter() - t0


def with_fill(kv, staging, rows: dict[str, torch.Tensor], positions: int, ops: int) -> float:
    """The main thread's work while a store's fill runs on the worker."""
    done = start_fill(kv, staging, rows, positions)
    dt = main_work(ops)
    done.result()
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, default=2700, help="positions a store holds (a turn's new tokens)")
    p.add_argument("--ops", type=int, default=20000, help="small torch ops on the main thread")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--against", type=Path, help="another kit checkout: its kv_cache as the 'previous' arm")
    p.add_argument("--out", type=Path, default=RESULTS / "store_fill_cpu.json")
    args = p.parse_args()
    if min(args.positions, args.ops, args.repeats) < 1:
        print("error: --positions, --ops and --repeats must be positive", file=sys.stderr)
        return 2
    import kv_cache
    from kv_cache.rows import rows_nbytes

    arms = {"current": kv_cache}
    if args.against is not None:
        arms["previous"] = load_kv_cache(args.against, "kv_cache_previous")
    rows = turn_rows(args.positions)
    size = rows_nbytes(rows) + (64 << 20)
    stagings = {name: kv.staging.Staging(size) for name, kv in arms.items()}  # one buffer each, reused
    samples: dict[str, dict[str, list[float]]] = {a: {"fill": [], "work_alone": [], "work_with_fill": []} for a in arms}
    for i in range(args.repeats + 1):  # the first round warms up
        for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            fill = one_fill(arms[name], stagings[name], rows, args.positions)
            alone = main_work(args.ops)
            during = with_fill(arms[name], stagings[name], rows, args.positions, args.ops)
            if i:
                for key, v in (("fill", fill), ("work_alone", alone), ("work_with_fill", during)):
                    samples[name][key].append(v)
    for staging in stagings.values():
        staging.close()
    result = {**result_header("store_fill", {"positions": args.positions, "ops": args.ops, "repeats": args.repeats,
                                             "layers": LAYERS}),
              "arms": {a: {k: summary(v) for k, v in s.items()} for a, s in samples.items()}}
    write_json(args.out, result)
    print(f"{'arm':>10} {'fill (ms)':>10} {'work alone (ms)':>16} {'work with fill (ms)':>20} {'slowdown':>9}")
    for a, s in result["arms"].items():
        fill, alone, during = (s[k]["median"] * 1e3 for k in ("fill", "work_alone", "work_with_fill"))
        print(f"{a:>10} {fill:10.2f} {alone:16.2f} {during:20.2f} {during / alone:8.2f}x")
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
