"""latent_attention's candidate configs (glm53/ops/triton_attention.py attention_candidates), each
forced, side by side on this GPU: a GPU with less shared memory a block than the H200 (GB10, the
DGX Spark's: 99 KB) runs a later one, so their cost relative to the preferred one is what such a
GPU gives up (on the H200's arithmetic units; GB10's own numbers need a GB10).

    python bench/probe_attention_candidates.py --out bench/results/attention_candidates_h200.json  # GPU

GLM-5.3 attention: 64 heads x (512 + 64), value 512, bf16, 2048 selected slots of a 16384-row
cache. Per candidate: a prefill piece (T = 2048 queries: GPU time from CUDA events over --repeats
calls after a warm-up, median) and a decode window (T = 1, the default dispatch: the split kernels
where they agree with the candidate's prefill kernel; GPU time a call from a CUDA graph of 8 calls); the largest difference of its output from
the preferred config's (the configs differ in bits: BLOCK_N sets the online softmax's steps) and
its compiled shared memory. Arms alternate. Prints a table; JSON (bench/benchmeta.py header).
Exit codes: 0 done, 2 no CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402
from bench.probe_decode_tiles import graph_time_us  # noqa: E402
from glm53.ops import triton_attention as ta  # noqa: E402

HEADS, D, DV, SLOTS, ROWS = 64, 576, 512, 2048, 16384


def forced(candidate: tuple[int, int, int, int]) -> None:
    """Make `candidate` the only config, with nothing remembered from another."""
    ta.attention_candidates = lambda *a: [candidate]  # noqa: E731
    ta._FITTED.clear()
    ta._CHOSEN.clear()


def gpu_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--configs", nargs="*", default=[], metavar="HxNxWxS",
                   help="configs to time instead of attention_candidates' (BLOCK_H x BLOCK_N x warps x stages)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "attention_candidates.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe times Triton kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(5)
    q = (torch.randn(2048, HEADS, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
    rows = torch.randn(ROWS, D, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.rand(2048, ROWS, generator=g, device="cuda").topk(SLOTS, dim=1).indices.sort(dim=1).values
    valid = torch.ones_like(idx, dtype=torch.bool)
    candidates = [tuple(int(v) for v in c.split("x")) for c in args.configs] or \
        ta.attention_candidates(HEADS, D, DV, torch.bfloat16)
    limit = triton.runtime.driver.active.utils.get_device_properties(q.device.index)["max_shared_mem"]
    outputs: dict[tuple, torch.Tensor] = {}
    times: dict[tuple, dict[str, list[float]]] = {c: {"prefill": [], "decode": []} for c in candidates}
    shared: dict[tuple, int] = {}
    splits: dict[tuple, object] = {}
    for rnd in range(3):
        for c in (candidates if rnd % 2 == 0 else list(reversed(candidates))):
            forced(c)
            prefill = lambda: ta.latent_attention(q, rows, idx, valid, D ** -0.5, DV)  # noqa: E731
            decode = lambda: ta.latent_attention(q[:1], rows, idx[:1], valid[:1], D ** -0.5, DV)  # noqa: E731
            outputs[c] = prefill()[0]
            times[c]["prefill"].append(gpu_ms(prefill, args.repeats))
            times[c]["decode"].append(graph_time_us([decode] * 8) * 1e-3)  # GPU time only: a graph of calls
            key = ta._shape_key(HEADS, D, DV, torch.bfloat16, torch.bfloat16, q.device)
            shared[c] = ta._prefill_launch((*ta._prepared(q[:1], rows, idx[:1], valid[:1]),
                                            torch.empty(1, HEADS, DV, dtype=torch.bfloat16, device="cuda"),
                                            torch.empty(1, HEADS, device="cuda")), D ** -0.5, DV, c, True
                                           ).metadata.shared
            assert ta._FITTED[key] == c
            splits[c] = ta.split_choice(HEADS, D, DV, torch.bfloat16, torch.bfloat16, q.device)
    base = outputs[candidates[0]].float()
    rows_out = []
    for c in candidates:
        row = {"config": list(c), "shared_bytes": shared[c], "prefill_ms": statistics.median(times[c]["prefill"]),
               "decode_us": statistics.median(times[c]["decode"]) * 1e3,
               "split_config": list(splits[c]) if splits[c] else None,
               "max_abs_diff_vs_preferred": float((outputs[c].float() - base).abs().max()),
               "samples": times[c]}
        rows_out.append(row)
    settings = {"heads": HEADS, "d": D, "value_dim": DV, "slots": SLOTS, "rows": ROWS, "repeats": args.repeats,
                "device_shared_limit": limit, "timing": "T=2048: CUDA events, median of --repeats calls; T=1: GPU time a call from a CUDA graph of 8 calls; medians of 3 rounds"}
    write_json(args.out, {**result_header("attention_candidates", settings, device="cuda"), "cases": rows_out})
    print(f"{'config (BLOCK_H, BLOCK_N, warps, stages)':>42} {'shared':>8} {'T=2048 ms':>10} {'T=1 us':>8} "
          f"{'vs first':>8} {'max diff':>9} split")
    for r in rows_out:
        print(f"{str(tuple(r['config'])):>42} {r['shared_bytes']:8d} {r['prefill_ms']:10.3f} {r['decode_us']:8.1f} "
              f"{r['prefill_ms'] / rows_out[0]['prefill_ms']:7.2f}x {r['max_abs_diff_vs_preferred']:9.2e} "
              f"{'agrees' if r['split_config'] else 'differs (decode on the prefill kernel)'}")
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
