"""The indexer's top-k selection on CUDA: the Triton kernel (glm53/ops/triton_topk.py) against the
torch form (glm53/model/indexer.py select_topk_torch, kept for the CPU and the longest rows), side by side.

    python -m bench.bench_select_topk            # per call, prefill-sized cases (CUDA)
    python -m bench.bench_select_topk --engine   # both inside the engine's turns (CUDA, 4 layers)
    python -m bench.bench_select_topk --short    # decode windows: torch, split kernels, row kernel
    python -m bench.bench_select_topk --dcp 4    # one DCP rank's share: the reference merge vs the kernels

The torch form takes a top-(k + 1) per row, tests the k-th score for a tie (a host sync), takes
packed int64 keys for tied rows and sorts the chosen columns; the kernel does a radix select per
row and writes the chosen columns in order. Cases are prefill chunks of T queries after `history`
cached positions, causal (future keys -inf), scores rounded on a quarter of the rows so that ties
occur. Per case: both arms alternate, wall time of each call with the device synchronized around
it, median of --repeats; both arms must return the same selection (exit 1 otherwise). --engine: a
turn of --turn-tokens new tokens after each of --histories cached positions, arms alternating on
one engine, the same replies required; the table also gives each arm's last / first history ratio
(the turn ratio's share that the selection moves). --against DIR adds a third arm, 'previous': the
kernel of another kit checkout (e.g. `git archive <commit> | tar -x -C DIR`), for a change to the
kernel side by side; --digit-bits B adds an arm running this kernel with B bits a pass; --forms an
arm whose passes all run over whole rows (no sampled bracket), --samples N arms sampling brackets
from N keys, --blocks BxW arms of the row form at block B with W warps. Each case also logs the
share of rows whose passes ran over their bracket. The 'triton' arm goes through
indexer.select_topk, whose NaN check is a host sync; the other kernel arms call the kernel. Prints a
table; JSON (bench/lib/meta.py header) to --out. Exit codes: 0 done, 1 a selection or reply
differed, 2 bad arguments or no CUDA.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.lib.checkpoints import real_dims_checkpoint
from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json
from bench.lib.timing import graph_time_us
from glm53.model.indexer import Selection, select_topk, select_topk_torch

K = 2048  # GLM-5.3's index_topk
# (T, history): turn 1's two pieces (2700 new tokens on the 2048 grid), turn 6's two (13504 cached),
# a 19k prompt's last full chunk, and long contexts
CASES = [(2048, 0), (652, 2048), (832, 13504), (1869, 14336), (2048, 14157), (2048, 63488), (2048, 260096)]


def chunk_scores(t: int, history: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    n = history + t
    scores = torch.randn(t, n, generator=g, device=device)
    scores[: t // 4] = (scores[: t // 4] * 8).round()  # ties at the k-th score in some rows
    future = torch.arange(n, device=device)[None, :] > (history + torch.arange(t, device=device))[:, None]
    return scores.masked_fill(future, float("-inf"))


def timed(fn, scores: torch.Tensor) -> tuple[float, Selection]:
    sync = torch.cuda.synchronize if scores.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    sel = fn(scores, K)
    sync()
    return time.perf_counter() - t0, sel


def arm_row(fields: dict, samples: dict[str, list[float]]) -> dict:
    """A case's fields, each arm's summary and torch / triton; logged as it finishes."""
    row = {**fields, **{f"{name}_s": summary(times) for name, times in samples.items()}}
    row["speedup"] = row["torch_s"]["median"] / row["triton_s"]["median"]
    print(", ".join(f"{k} {v}" for k, v in fields.items()) + ": " + ", ".join(
        f"{name} {row[f'{name}_s']['median'] * 1e3:.3f} ms" for name in samples), file=sys.stderr, flush=True)
    return row


def extra_arms(args: argparse.Namespace) -> dict:
    """--against: the kernel of another checkout ('previous'); --digit-bits: this kernel at other widths."""
    import importlib.util

    from glm53.ops import triton_topk

    arms = {}
    if args.against is not None:
        path = args.against / "glm53" / "ops" / "triton_topk.py"
        spec = importlib.util.spec_from_file_location("triton_topk_previous", path)
        if spec is None or not path.is_file():
            print(f"error: --against {args.against}: no {path}; give a kit checkout (e.g. "
                  "`git archive <commit> | tar -x -C DIR`)", file=sys.stderr)
            raise SystemExit(2)
        previous = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(previous)
        arms["previous"] = lambda s, k: Selection(*previous.select(s, k)[:2])

    for bits in args.digit_bits:
        arms[f"bits{bits}"] = lambda s, k, bits=bits: Selection(*triton_topk.select(s, k, bits)[:2])
    if args.forms:
        arms["row_full"] = lambda s, k: Selection(*triton_topk.select(s, k, form="row_full")[:2])
    for sample in args.samples:
        arms[f"sample{sample}"] = lambda s, k, n=sample: Selection(*triton_topk.select_rows(s, k, sample=n)[:2])
    for block, warps in (tuple(map(int, bw.split("x"))) for bw in args.blocks):
        arms[f"b{block}w{warps}"] = lambda s, k, b=block, w=warps: Selection(
            *triton_topk.select_rows(s, k, block=b, warps=w)[:2])
    return arms


def finish(out: Path, result: dict, columns: list[str], what: str) -> int:
    """Write the JSON, print the table; exit code 1 if the arms ever disagreed."""
    write_json(out, result)
    arms = [key[:-2] for key in result["cases"][0] if key.endswith("_s")]
    print(" ".join(f"{c:>8}" for c in columns) + "".join(f" {name + ' (ms)':>14}" for name in arms)
          + f" {'torch/triton':>13}")
    for r in result["cases"]:
        print(" ".join(f"{r[c]:8d}" for c in columns) + "".join(f" {r[name + '_s']['median'] * 1e3:14.3f}"
                                                              for name in arms) + f" {r['speedup']:12.3f}x")
    for name, ratio in result.get("last_over_first", {}).items():
        print(f"{name}: last / first history = {ratio:.3f}")
    print(f"same {what} in every sample: {not result['mismatches']}")
    print(f"full results: {out}")
    return 1 if result["mismatches"] else 0


def engine_turns(args: argparse.Namespace) -> int:
    """Both arms inside the engine: a turn of --turn-tokens new tokens after `history` cached
    positions (4 layers at GLM-5.3 dims, the live rows reused, truncated back to the history
    before each arm), arms alternating on one engine."""
    import random
    import shutil
    import tempfile

    import glm53.model.indexer as indexer
    from glm53.runtime.engine import Glm53Engine

    work = Path(tempfile.mkdtemp(prefix="bench_select_topk."))
    try:
        engine = Glm53Engine(real_dims_checkpoint(work, 4, 32768), device="cuda")  # live rows only, no cache
        rng = random.Random(7)
        current = indexer.select_topk
        arms = {"torch": select_topk_torch, "triton": current}
        rows, mismatches = [], []
        for history in args.histories:
            base = [rng.randrange(3, 32768) for _ in range(history)]
            if base:
                engine.generate(base, 1, {"temperature": 0.0})  # the history's rows, kept live
            samples: dict[str, list[float]] = {name: [] for name in arms}
            for i in range(args.repeats + 1):  # the first round warms up
                new = [rng.randrange(3, 32768) for _ in range(args.turn_tokens)]
                order = list(arms) if i % 2 == 0 else list(reversed(arms))
                replies = {}
                for name in order:
                    if engine.state is not None:
                        engine.state.truncate(history)  # each arm computes the same new tokens
                    indexer.select_topk = arms[name]
                    try:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        replies[name] = engine.generate(base + new, 1, {"temperature": 0.0})
                        torch.cuda.synchronize()
                        dt = time.perf_counter() - t0
                    finally:
                        indexer.select_topk = current
                    if engine.last_stats["cached_tokens"] != history:
                        raise RuntimeError(f"expected {history} reused tokens, got {engine.last_stats['cached_tokens']}")
                    if i:
                        samples[name].append(dt)
                if replies["torch"] != replies["triton"]:
                    mismatches.append(f"history={history} sample {i}")
            rows.append(arm_row({"history": history, "new_tokens": args.turn_tokens}, samples))
        settings = {"k": K, "repeats": args.repeats, "layers": 4, "turn_tokens": args.turn_tokens,
                    "timing": "wall of generate() (1 token), device synchronized, arms alternating"}
        result = {**result_header("select_topk_engine", settings, device=engine.device), "cases": rows,
                  "mismatches": mismatches,
                  "last_over_first": {name: rows[-1][f"{name}_s"]["median"] / rows[0][f"{name}_s"]["median"]
                                      for name in arms}}
        return finish(args.out, result, ["history"], "replies")
    finally:
        shutil.rmtree(work, ignore_errors=True)


SHORT_CASES = [(1, 2700), (1, 19001), (4, 19001), (16, 19001), (1, 94001), (1, 262144)]  # (T, keys)


def short_windows(args: argparse.Namespace) -> int:
    """Decode-sized windows (T <= 16 rows over the whole history): the torch form, the split kernels
    (select_topk's choice there) and the one-program-a-row kernel, each as GPU time per call from a
    CUDA graph of calls replayed (how a decode step runs them), arms alternating."""
    from glm53.ops import triton_topk

    device = torch.device("cuda")
    flag = torch.zeros((), dtype=torch.bool, device=device)  # NaN into a device flag: no sync in a graph
    arms = {"torch": lambda s, k: select_topk_torch(s, k, flag), "triton": lambda s, k: select_topk(s, k, flag),
            "row_kernel": lambda s, k: Selection(*triton_topk.select(s, k, form="row")[:2])}
    rows, mismatches = [], []
    for t, n in SHORT_CASES:
        copies = [chunk_scores(t, n - t, device, seed=n + i) for i in range(4)]
        want = select_topk_torch(copies[0], K)
        for name, fn in arms.items():
            got = fn(copies[0], K)
            if not (torch.equal(want.indices, got.indices) and torch.equal(want.valid, got.valid)):
                mismatches.append(f"T={t} keys={n}: {name}")
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for i in range(args.repeats):
            for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
                us = graph_time_us([lambda s=s, fn=arms[name]: fn(s, K) for s in copies * 2])
                samples[name].append(us * 1e-6)
        rows.append(arm_row({"t": t, "keys": n}, samples))
    settings = {"k": K, "repeats": args.repeats,
                "timing": "GPU time a call: a CUDA graph of 8 calls over 4 score sets, replayed 10 times, "
                          "CUDA events; arms alternating"}
    result = {**result_header("select_topk_short", settings, device=device), "cases": rows, "mismatches": mismatches}
    return finish(args.out, result, ["t", "keys"], "selection")


def dcp_ranks(args: argparse.Namespace) -> int:
    """--dcp R: one DCP rank's share of a 'full' layer's selection, rank 0 of R (every rank does the
    same work on its quarter, at the same time). 'torch': the reference (its owned keys' sorted int64
    top-k, the gathered keys' top-k with a host sync for the pads, owned_selection's sort; the NaN
    check a host sync), 'triton': dcp.PendingSelection (the selection kernels over its keys, a
    threshold from the gathered keys, no sort, no host sync). The other ranks' parts are computed
    outside the timing and stacked as the all-gather would hand them over; wall of rank 0's part."""
    from glm53.dist import dcp

    device, ranks = torch.device("cuda"), args.dcp
    own = dcp.Ownership(0, ranks)
    rows, mismatches = [], []
    for t, history in CASES:
        scores = chunk_scores(t, history, device, seed=t + history)
        n = scores.shape[1]
        positions = torch.arange(n, device=device)
        owned = [dcp.Ownership(r, ranks).owned_positions(0, n, device=device) for r in range(ranks)]
        parts = [scores[:, p].contiguous() for p in owned]
        words = torch.stack([dcp.PendingSelection.of(part, positions[p], dcp.Ownership(r, ranks), K).words
                             for r, (part, p) in enumerate(zip(parts, owned))])
        keys = torch.stack([dcp.local_topk_keys(part, positions[p], K) for part, p in zip(parts, owned)])

        def reference(part: torch.Tensor, k: int) -> Selection:
            dcp.local_topk_keys(part, owned[0], k)  # rank 0's own work; its result is keys[0]
            return dcp.owned_selection(*dcp.merge_topk_keys(keys, k), own, k)

        def pending(part: torch.Tensor, k: int) -> Selection:
            return dcp.PendingSelection.of(part, owned[0], own, k).resolve(words)

        arms = {"torch": reference, "triton": pending}
        for fn in arms.values():
            timed(fn, parts[0])
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for i in range(args.repeats):
            got = {}
            for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
                dt, got[name] = timed(arms[name], parts[0])
                samples[name].append(dt)
            a, b = got["torch"], got["triton"]
            if not (torch.equal(a.indices, b.indices) and torch.equal(a.valid, b.valid)):
                mismatches.append(f"T={t} history={history} sample {i}")
        rows.append(arm_row({"t": t, "keys": n, "rank_keys": parts[0].shape[1]}, samples))
        del scores, parts
    settings = {"k": K, "ranks": ranks, "repeats": args.repeats,
                "timing": "wall of rank 0's part (local selection + merge), device synchronized, arms alternating"}
    result = {**result_header("select_topk_dcp", settings, device=device), "cases": rows, "mismatches": mismatches}
    return finish(args.out, result, ["t", "keys", "rank_keys"], "selection")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--engine", action="store_true", help="both forms inside the engine's turns (CUDA)")
    p.add_argument("--short", action="store_true", help="decode-sized windows, GPU time in CUDA graphs")
    p.add_argument("--histories", type=int, nargs="*", default=[0, 13504], help="--engine: cached positions")
    p.add_argument("--turn-tokens", type=int, default=2701, help="--engine: new tokens a turn")
    p.add_argument("--against", type=Path, help="another kit checkout: its kernel as a third arm")
    p.add_argument("--digit-bits", type=int, nargs="*", default=[], choices=[1, 2, 4, 8],
                   help="arms running this kernel with these bits a pass")
    p.add_argument("--forms", action="store_true", help="an arm whose passes run over whole rows ('row_full')")
    p.add_argument("--samples", type=int, nargs="*", default=[],
                   help="arms sampling each row's bracket from this many keys (powers of two)")
    p.add_argument("--blocks", nargs="*", default=[], help="arms of the row form at BLOCKxWARPS, e.g. 4096x8")
    p.add_argument("--dcp", type=int, metavar="R", help="one DCP rank's share of the selection over R ranks")
    p.add_argument("--out", type=Path, default=RESULTS / "select_topk.json")
    args = p.parse_args()
    if args.repeats < 1:
        print("error: --repeats must be positive", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: this bench compares the Triton kernel with the torch form: it needs a CUDA device",
              file=sys.stderr)
        return 2
    if args.engine:
        return engine_turns(args)
    if args.short:
        return short_windows(args)
    if args.dcp is not None:
        if args.dcp < 2:
            print("error: --dcp R needs R >= 2 ranks", file=sys.stderr)
            return 2
        return dcp_ranks(args)
    from glm53.ops import triton_topk

    device = torch.device("cuda")
    arms = {"torch": select_topk_torch, "triton": select_topk, **extra_arms(args)}
    rows, mismatches = [], []
    for t, history in CASES:
        scores = chunk_scores(t, history, device, seed=t + history)
        for fn in arms.values():  # warm-up (the kernel compiles on its first call)
            timed(fn, scores)
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for i in range(args.repeats):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            got = {}
            for name in order:
                dt, got[name] = timed(arms[name], scores)
                samples[name].append(dt)
            a = got["torch"]
            for name, b in got.items():
                if not (torch.equal(a.indices, b.indices) and torch.equal(a.valid, b.valid)):
                    mismatches.append(f"T={t} history={history} sample {i}: {name}")
        bracketed = float(triton_topk.select_rows(scores, K)[3].float().mean())
        rows.append(arm_row({"t": t, "keys": history + t}, samples))
        rows[-1]["bracketed_rows"] = bracketed
        print(f"  rows whose passes ran over their sampled bracket: {bracketed:.1%}", file=sys.stderr, flush=True)
        del scores
    settings = {"k": K, "repeats": args.repeats, "timing": "wall of each call, device synchronized, arms alternating"}
    result = {**result_header("select_topk", settings, device=device), "cases": rows, "mismatches": mismatches}
    return finish(args.out, result, ["t", "keys"], "selection")


if __name__ == "__main__":
    sys.exit(main())
