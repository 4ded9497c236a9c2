"""What the CUDA-graph benches share (bench_decode_graphs, bench_graph_capture): one timed greedy
decode through the engine, and their common options."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.meta import RESULTS
from glm53.runtime.engine import Glm53Engine


def decode(engine: Glm53Engine, prompt: list[int], tokens: int, split: bool = True) -> dict[str, Any]:
    from glm53.ops import triton_attention

    engine.state, engine.trace = None, []
    split_rows = triton_attention.SPLIT_ROWS
    triton_attention.SPLIT_ROWS = split_rows if split else 0
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reply = engine.generate(prompt, tokens, {"temperature": 0.0, "ignore_eos": True, "draft": False})
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        triton_attention.SPLIT_ROWS = split_rows
    trace, engine.trace = engine.trace, None
    s = engine.last_stats
    return {"wall_s": wall, "ttft_s": s["ttft_s"], "decode_s": s["decode_s"],
            "per_token_s": s["decode_s"] / max(1, len(reply) - 1), "reply": reply,
            "_logits": torch.stack([row for _, row in trace]).cpu()}


def graph_bench_args(doc: str, context: int, tokens: int, repeats: int, out: str) -> argparse.Namespace | None:
    """The options of the CUDA-graph benches (bench_decode_graphs, bench_graph_capture), checked; None after
    an error on stderr when they cannot run (no CUDA device, a bad value)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real-dims", action="store_true", help="GLM-5.3 layer dimensions (dense layers)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--depth", type=int, default=None, help="run this many layers, the checkpoint's repeated "
                   "with shared weights (GLM-5.3 has 78; bench.lib.checkpoints.deepen)")
    p.add_argument("--context", type=int, default=context, help=f"prompt tokens per sample (default {context})")
    p.add_argument("--tokens", type=int, default=tokens, help=f"tokens decoded per sample (default {tokens})")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--out", type=Path, default=RESULTS / out)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: CUDA graphs need a CUDA device; run on the GPU machine", file=sys.stderr)
        return None
    if min(args.context, args.tokens - 1, args.repeats, args.layers) <= 0:
        print("error: --context, --repeats, --layers must be positive and --tokens at least 2", file=sys.stderr)
        return None
    if args.depth is not None and args.depth <= 0:
        print("error: --depth must be positive (GLM-5.3 has 78 layers)", file=sys.stderr)
        return None
    return args
