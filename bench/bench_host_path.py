"""Host work of one conversation turn against the history's length: prompt check, prefix-cache
lookup and store, at 19k, 128k and 1M tokens (CPU only; no model runs).

    python -m bench.bench_host_path --out bench/results/host_path_cpu.json

Per history length n, a conversation of three turns (n - 200 tokens, then +100 and +100, each turn
+ a one-token reply) through a PrefixCache (block 256) with the live tokens in a TokenLog, as the
engine runs it; timed on the third turn, median of --repeats fresh conversations:
- check: the engine's prompt check and int64 conversion (Glm53Engine._check_prompt's two C loops);
- lookup: lookup() as the engine calls it (live tokens as the TokenLog's array, the last lookup's
  chain hashes reused for the common prefix);
- lookup, full rework: the same lookup with the live tokens as a plain list and no remembered
  chain, i.e. converting and hashing the whole history on every lookup;
- store: store() after the reply (rows are views of a CPU tensor; copying them is not the point).
Prints a table; JSON to --out. Exit 0.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json
from glm53.model.token_log import TokenLog
from kv_cache import CacheKey, PrefixCache

BLOCK = 256


def key() -> CacheKey:
    return CacheKey(model_revision="bench", kv_dtype="bf16", compute_dtype="bf16", ranks=1, rank=0, dcp=False,
                    chunk_size=BLOCK, device_kind="cpu", kit_version="bench")


def check(prompt: list[int]) -> np.ndarray:
    assert set(map(type, prompt)) == {int}
    return np.array(prompt, dtype=np.int64)


def one_conversation(n: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    cache = PrefixCache(key())
    rows = torch.zeros(n + 1000, 2)
    rows_for = lambda a, b: {"latent.0": rows[a:b]}  # noqa: E731
    live, prompt, times = TokenLog(), [], {}
    for new in (n - 200, 100, 100):
        prompt = prompt + rng.integers(3, 150000, new).tolist()
        t0 = time.perf_counter()
        ids = check(prompt)
        t1 = time.perf_counter()
        frontier = len(prompt) - 101 if len(live) else 0
        hit = cache.lookup(ids, live_tokens=live.array(), live_frontier=frontier)
        t2 = time.perf_counter()
        del live[hit.reused_tokens:]
        live.extend(prompt[hit.reused_tokens:])
        t3 = time.perf_counter()
        cache.store(ids, len(prompt), rows_for)
        t4 = time.perf_counter()
        times = {"check": t1 - t0, "lookup": t2 - t1, "store": t4 - t3}
        live.append(5)
        prompt = prompt + [5]
    memo = cache._last_chain
    cache._last_chain = None  # the full rework: nothing remembered, the live tokens as a list
    t0 = time.perf_counter()
    cache.lookup(ids, live_tokens=list(live), live_frontier=len(prompt) - 101)
    times["lookup_full"] = time.perf_counter() - t0
    cache._last_chain = memo
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[19000, 128000, 1000000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "host_path_cpu.json")
    args = p.parse_args()
    rows = []
    for n in args.lengths:
        samples = [one_conversation(n, seed) for seed in range(args.repeats)]
        row = {"history": n, **{k: summary([s[k] for s in samples]) for k in samples[0]}}
        row["lookup_speedup"] = row["lookup_full"]["median"] / row["lookup"]["median"]
        rows.append(row)
        print(f"history {n}: lookup {row['lookup']['median'] * 1e3:.2f} ms vs full rework "
              f"{row['lookup_full']['median'] * 1e3:.2f} ms", file=sys.stderr)
    print(f"{'history':>9} | {'check ms':>8} | {'lookup ms':>9} | {'full rework ms':>14} | {'ratio':>5} | {'store ms':>8}")
    for r in rows:
        print(f"{r['history']:>9} | {r['check']['median'] * 1e3:>8.2f} | {r['lookup']['median'] * 1e3:>9.2f} | "
              f"{r['lookup_full']['median'] * 1e3:>14.2f} | {r['lookup_speedup']:>4.1f}x | {r['store']['median'] * 1e3:>8.2f}")
    settings = {"block": BLOCK, "turns": "n - 200, +100, +100 (third timed)", "repeats": args.repeats,
                "timing": "time.perf_counter, median over fresh conversations"}
    write_json(args.out, {**result_header("host_path", settings), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
