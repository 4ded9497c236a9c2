"""The indexer's top-k selection (glm53/model/indexer.py select_topk) against its previous tie test,
side by side on one device.

    python bench/bench_select_topk.py            # CUDA when present, else CPU (small sizes)

The previous form counted each row's k-th score over the whole row twice ([T, N] eq and sum) to
find rows whose k-th score ties with an unselected one; the current one reads the top k + 1 scores
instead (the tie shows there), and skips the top-k where a row has no more keys than k. Cases are
prefill chunks of T queries after `history` cached positions, causal (future keys -inf), scores
rounded on a quarter of the rows so that ties occur. Per case: both arms alternate, wall time of
each call with the device synchronized around it (the selection syncs the host itself), median of
--repeats; both arms must return the same selection (exit 1 otherwise). Prints a table; JSON
(bench/benchmeta.py header) to --out. Exit codes: 0 done, 1 a selection differed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, summary, write_json  # noqa: E402
from glm53.model.indexer import Selection, _as_selection, _packed_topk, select_topk  # noqa: E402

K = 2048  # GLM-5.3's index_topk
CUDA_CASES = [(2048, 0), (652, 2048), (2048, 14157), (2048, 63488), (2048, 260096)]  # (T, history)
CPU_CASES = [(64, 0), (64, 4096)]


def previous_select_topk(scores: torch.Tensor, k: int) -> Selection:
    """The tie test as it was before the top-(k+1) form (rows above SMALL_WINDOW_ROWS)."""
    tq, tk = scores.shape
    indices = torch.zeros(tq, k, dtype=torch.long, device=scores.device)
    valid = torch.zeros(tq, k, dtype=torch.bool, device=scores.device)
    if torch.isnan(scores).any():
        raise ValueError("NaN")
    width = min(k, tk)
    top = scores.topk(width, dim=1, sorted=False)
    threshold = top.values.amin(dim=1)
    tied = torch.isfinite(threshold) & ((scores == threshold[:, None]).sum(1) > (top.values == threshold[:, None]).sum(1))
    chosen = top.indices
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        chosen = chosen.clone()
        chosen[rows] = _packed_topk(scores[rows], width)
    return _as_selection(scores, chosen, indices, valid)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "select_topk.json")
    args = p.parse_args()
    if args.repeats < 1:
        print("error: --repeats must be positive", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = CUDA_CASES if device.type == "cuda" else CPU_CASES
    arms = {"previous": previous_select_topk, "now": select_topk}
    rows, mismatches = [], []
    for t, history in cases:
        scores = chunk_scores(t, history, device, seed=t + history)
        for fn in arms.values():  # warm-up
            timed(fn, scores)
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for i in range(args.repeats):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            got = {}
            for name in order:
                dt, got[name] = timed(arms[name], scores)
                samples[name].append(dt)
            a, b = got["previous"], got["now"]
            if not (torch.equal(a.indices, b.indices) and torch.equal(a.valid, b.valid)):
                mismatches.append(f"T={t} history={history} sample {i}")
        row = {"t": t, "history": history, "keys": history + t,
               **{f"{name}_s": summary(samples[name]) for name in arms}}
        row["speedup"] = row["previous_s"]["median"] / row["now_s"]["median"]
        rows.append(row)
        print(f"T={t} keys={history + t}: previous {row['previous_s']['median'] * 1e3:.3f} ms, "
              f"now {row['now_s']['median'] * 1e3:.3f} ms", file=sys.stderr, flush=True)
        del scores
    settings = {"k": K, "repeats": args.repeats, "timing": "wall of each call, device synchronized, arms alternating"}
    result = {**result_header("select_topk", settings, device=device), "cases": rows, "mismatches": mismatches}
    write_json(args.out, result)
    print(f"{'T':>5} {'keys':>7} {'previous (ms)':>14} {'now (ms)':>10} {'speedup':>8}")
    for r in rows:
        print(f"{r['t']:5d} {r['keys']:7d} {r['previous_s']['median'] * 1e3:14.3f} {r['now_s']['median'] * 1e3:10.3f} "
              f"{r['speedup']:7.2f}x")
    print(f"same selection in every sample: {not mismatches}")
    print(f"full results: {args.out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
