"""Decode steps with CUDA graphs (glm53.runtime.cuda_graphs) against eager, through the real glm53 engine.

    python -m bench.bench_decode_graphs --real-dims      # H200: GLM-5.3 layer dimensions, 4 dense layers
    python -m bench.bench_decode_graphs --real-dims --depth 78   # the same 4 layers repeated to GLM-5.3's depth
    python -m bench.bench_decode_graphs                  # the tiny checkpoint (MoE layers), CUDA

One engine per arm, the same weights: TF_GLM53_CUDA_GRAPHS=1, the same with short windows' attention on
the prefill kernel (glm53/ops/triton_attention.py's split kernels off: SPLIT_ROWS = 0 during its
calls, its own graphs), and TF_GLM53_CUDA_GRAPHS=0. Per sample: a fresh prompt of
`--context` tokens, then `--tokens` greedy tokens (ignore_eos, no drafting); arms interleaved sample
by sample, the order alternating. Per-token decode time = decode_s / (tokens - 1) (the first token
comes from the prefill). Every pair must give the same tokens and bitwise the same logits at every
position (exit 1 otherwise). Prints a table; JSON with every sample, medians, settings, commit,
device to --out. GPU only (graphs are CUDA graphs). Exit codes: 0 done, 1 mismatch, 2 bad arguments.
"""
from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from bench.lib.decode import decode, graph_bench_args
from bench.lib.checkpoints import deepen, real_dims_checkpoint, tiny_checkpoint
from bench.lib.log import log
from bench.lib.meta import result_header
from glm53.measurement import summary, write_json
from glm53.runtime.engine import Glm53Engine


def main() -> int:
    args = graph_bench_args(__doc__, context=19000, tokens=64, repeats=3, out="decode_graphs.json")
    if args is None:
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_decode_graphs."))
    try:
        model_dir = real_dims_checkpoint(work, args.layers, args.vocab) if args.real_dims else tiny_checkpoint(work)
        arms = {"graphs": Glm53Engine(model_dir, device="cuda", cuda_graphs="1"),
                "graphs_unsplit": Glm53Engine(model_dir, device="cuda", cuda_graphs="1"),
                "eager": Glm53Engine(model_dir, device="cuda", cuda_graphs="0")}
        distinct_layers = len(arms["eager"].model.w.layers)
        try:
            for engine in arms.values():
                deepen(engine, args.depth)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        split = {name: name != "graphs_unsplit" for name in arms}
        rng = random.Random(41)
        vocab = arms["eager"].vocab_size
        for name in arms:  # warm-up (compiles), discarded
            decode(arms[name], [rng.randrange(3, vocab) for _ in range(64)], 8, split[name])
        samples: dict[str, list[dict]] = {name: [] for name in arms}
        mismatches: list[int] = []
        for i in range(args.repeats):
            prompt = [rng.randrange(3, vocab) for _ in range(args.context)]
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            got = {name: decode(arms[name], prompt, args.tokens, split[name]) for name in order}
            a = got["graphs"]
            logits = {name: got[name].pop("_logits").view(torch.int32) for name in arms}
            if any(got[name]["reply"] != a["reply"] or not torch.equal(logits[name], logits["graphs"]) for name in arms):
                mismatches.append(i)
            for name in arms:
                samples[name].append(got[name])
            log(f"sample {i}: per token " + ", ".join(f"{name} {got[name]['per_token_s'] * 1e3:.2f} ms" for name in arms))
        per_token = {name: summary([s["per_token_s"] for s in samples[name]]) for name in arms}
        stats = arms["graphs"].graphs.stats
        settings = {"model_dir": str(model_dir), "real_dims": args.real_dims,
                    "layers": len(arms["eager"].model.w.layers), "distinct_layers": distinct_layers,
                    "compute_dtype": arms["eager"].dtype_name,
                    "kv_dtype": arms["eager"].kv_dtype, "context": args.context, "tokens": args.tokens,
                    "repeats": args.repeats, "timing": "decode_s of generate() / (tokens - 1), interleaved"}
        result = {**result_header("decode_graphs", settings, device=arms["eager"].device),
                  "mismatches": mismatches, "samples": samples, "per_token_s": per_token,
                  "speedup": per_token["eager"]["median"] / per_token["graphs"]["median"],
                  "split_speedup": per_token["graphs_unsplit"]["median"] / per_token["graphs"]["median"],
                  "graph_stats": {"captures": stats.captures, "replays": stats.replays, "eager": stats.eager,
                                  "first_runs": stats.first_runs,
                                  "evictions": stats.evictions, "reasons": stats.reasons}}
        write_json(args.out, result)
        print(f"{'arm':14} {'per token (median)':>20} {'min':>10} {'max':>10}")
        for name in arms:
            s = per_token[name]
            print(f"{name:14} {s['median'] * 1e3:17.2f} ms {s['min'] * 1e3:7.2f} ms {s['max'] * 1e3:7.2f} ms")
        print(f"speedup (eager / graphs): {result['speedup']:.2f}x; split attention (graphs_unsplit / graphs): "
              f"{result['split_speedup']:.2f}x; bitwise equal: {not mismatches}")
        print(f"full results: {args.out}")
        return 1 if mismatches else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
