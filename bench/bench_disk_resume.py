"""Where a disk resume's time goes, without the model: the prefix cache's own phases.

    python -m bench.bench_disk_resume                                   # CPU: 4096 positions x 78 layers
    python -m bench.bench_disk_resume --device cuda --positions 94000   # the 94k resume at GLM-5.3's depth

A KV cache of --positions x --layers at GLM-5.3's row sizes (bf16 latents of 576 on every layer,
indexer keys of 128 on every other; ~98 KB a position at 78 layers) is stored through a
PrefixCache with a disk tier, flushed and closed. Each sample then does what a restarted server
does for that prompt plus one new token, timed phase by phase:

    open     the tier's index rebuilt from the files' headers (server start, not the request)
    lookup   the chain found and every file read and verified
    restore  the rows put into a fresh cache on the device (reserved once, as the engine does)
    store    the engine's store after the prefill (nodes the host tier lacks are copied again)

with the files' pages dropped (posix_fadvise) and again with them cached (a process restart);
and, for comparison, the same rows restored from the host tier (a cache without a disk tier and
room for every row: another conversation's rows in the same process).
Every sample's restored rows must equal the source bit for bit (exit 1 otherwise). Prints a table;
JSON (bench/lib/meta.py header) to --out. Exit codes: 0 done, 1 rows differ, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.lib.kvstate import new_kv_state
from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json
from bench.lib.pagecache import drop_page_cache
from glm53.model.kv_state import KVState
from glm53.settings import Settings
from kv_cache import CacheKey, PrefixCache

BLOCK = 256
PHASES = ("open", "lookup", "restore", "store")
# inside the restore: the copying thread blocked on the readers and its own work; the readers (summed)
# blocked on their ring buffer and their own work (restore.Restorer.take_times)
THREAD_SPLIT = ("waited", "copying", "ring_waited", "reading")


def cache_key(device: str) -> CacheKey:
    return CacheKey(model_revision="bench", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                    dcp=False, chunk_size=BLOCK, device_kind=device, kit_version="bench")


def open_cache(folder: Path, args, position_bytes: int) -> PrefixCache:
    env = {"TF_GLM53_DISK_CACHE": str(folder), "TF_GLM53_DISK_CACHE_BYTES": "200G",
           "TF_GLM53_HOST_CACHE_BYTES": args.host_bytes}
    if args.threads:
        env["TF_GLM53_DISK_CACHE_THREADS"] = str(args.threads)
    return PrefixCache.from_settings(cache_key(args.device), Settings.from_env(env), on_gpu=args.device == "cuda",
                                     position_bytes=position_bytes)


def resume(cache_or_folder, args, prompt: list[int], position_bytes: int) -> tuple[dict[str, float], object]:
    """One resume through a cache opened on `folder` (a restart), or through an open cache."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    cache = (open_cache(cache_or_folder, args, position_bytes) if isinstance(cache_or_folder, Path)
             else cache_or_folder)
    times["open"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hit = cache.lookup(prompt)
    times["lookup"] = time.perf_counter() - t0
    if hit.reused_tokens != len(prompt) - 1:
        raise SystemExit(f"error: the resume reused {hit.reused_tokens} of {len(prompt) - 1} tokens")
    state = new_kv_state(args.layers, args.device)
    sync()
    t0 = time.perf_counter()
    state.reserve(len(prompt))
    # `device` where the kit's restore takes it (the same script also runs against the previous kit,
    # whose restore read every file inside the lookup, for side-by-side runs)
    where = {"device": state.device} if "device" in inspect.signature(hit.restore).parameters else {}
    hit.restore(lambda start, n, rows: state.import_rows(start, rows, prompt[start:start + n]), **where)
    sync()
    times["restore"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.store(prompt[:-1], len(prompt) - 1, state.export_rows)
    times["store"] = time.perf_counter() - t0
    times.update(cache.restore_times())
    if isinstance(cache_or_folder, Path):
        cache.close()
    return times, state


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--positions", type=int, default=4096)
    p.add_argument("--layers", type=int, default=78)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="TF_GLM53_DISK_CACHE_THREADS (0: the default)")
    p.add_argument("--host-bytes", default="8G", help="TF_GLM53_HOST_CACHE_BYTES (the server's default: 8G)")
    p.add_argument("--dir", type=Path, default=None, help="where the cache files go (default: a temp folder)")
    p.add_argument("--out", type=Path, default=RESULTS / "disk_resume.json")
    args = p.parse_args()
    if min(args.positions, args.layers, args.repeats) <= 0 or args.threads < 0:
        print("error: --positions, --layers and --repeats must be positive, --threads >= 0", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="disk_resume_", dir=args.dir))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def source_state(positions: int, layers: int, device: str) -> tuple[KVState, list[int]]:
    """A KV cache of random rows at GLM-5.3's row sizes, and the prompt that continues it by one token."""
    g = torch.Generator().manual_seed(5)
    source = new_kv_state(layers, device)
    source.reserve(positions)
    for i in range(layers):
        source.write_latent(i, 0, torch.randn(positions, 576, generator=g).to(device))
    for i in source.index_keys:
        source.write_index(i, 0, torch.randn(positions, 128, generator=g).to(device))
    source.tokens.extend(range(positions))
    return source, list(range(positions)) + [positions]


def host_tier_cache(source: KVState, prompt: list[int], device: str) -> PrefixCache:
    """A cache without a disk tier holding every row of `source` in its host tier (another
    conversation's rows in the same process), the store landed."""
    positions, position_bytes = len(prompt) - 1, source.position_bytes()
    room = str(2 * positions * position_bytes + (64 << 20))
    cache = PrefixCache.from_settings(cache_key(device), Settings(host_cache_bytes=int(room)),
                                      on_gpu=device == "cuda", position_bytes=position_bytes)
    cache.store(prompt[:-1], positions, source.export_rows)
    cache.flush()
    return cache


def run(args, work: Path) -> int:
    source, prompt = source_state(args.positions, args.layers, args.device)
    position_bytes = source.position_bytes()
    gib = args.positions * position_bytes / 2**30
    t0 = time.perf_counter()
    cache = open_cache(work, args, position_bytes)
    cache.store(prompt[:-1], args.positions, source.export_rows)
    cache.close()  # lands the store and finishes the disk writes
    fill_s = time.perf_counter() - t0
    print(f"stored {args.positions} positions x {args.layers} layers ({gib:.2f} GiB) in {fill_s:.1f} s",
          file=sys.stderr, flush=True)
    host_cache = host_tier_cache(source, prompt, args.device)  # the comparison arm holds every row
    host_held = host_cache.stats_dict()["host_bytes"] / 2**30
    arms = {"disk": [], "page_cache": [], "host": []}
    same = True
    want = source.export_rows(0, args.positions)
    for i in range(args.repeats):
        for arm in arms:
            if arm == "disk":
                drop_page_cache(work)
            times, state = resume(host_cache if arm == "host" else work, args, prompt, position_bytes)
            got = state.export_rows(0, args.positions)
            same &= all(torch.equal(want[k], got[k]) for k in want)
            del state, got
            times["request"] = times["lookup"] + times["restore"] + times["store"]
            arms[arm].append(times)
            print(f"sample {i} {arm}: " + ", ".join(f"{k} {v:.3f}s" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    settings = {"positions": args.positions, "layers": args.layers, "block": BLOCK, "repeats": args.repeats,
                "gib": gib, "host_tier_gib": host_held, "host_bytes": args.host_bytes, "threads": args.threads or "default",
                "timing": "perf_counter per phase, device synchronized after the restore"}
    result = {**result_header("disk_resume", settings, device=args.device), "fill_s": fill_s, "same_rows": same}
    print(f"\nresume of {args.positions} positions x {args.layers} layers ({gib:.2f} GiB; the host tier held "
          f"{host_held:.2f} GiB of it), medians of {args.repeats}")
    print(f"{'phase':>8} | " + " | ".join(f"{arm + ' s':>12} | {'GB/s':>6}" for arm in arms))
    for phase in PHASES + ("request",) + THREAD_SPLIT:
        row = {arm: summary([s[phase] for s in samples]) for arm, samples in arms.items()}
        result[phase] = row
        print(f"{phase:>8} | " + " | ".join(
            f"{row[a]['median']:12.3f} | " + (f"{gib * 2**30 / 1e9 / row[a]['median']:6.2f}"
                                              if row[a]['median'] > 0 and phase not in THREAD_SPLIT else f"{'':6}")
            for a in arms))
    write_json(args.out, result)
    print(f"same rows: {same}\nfull results: {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
