"""What a CUDA graph capture costs inside a request: the kit's capture against torch.cuda.graph's.

    python -m bench.bench_graph_capture --real-dims      # H200: GLM-5.3 layer dimensions, 4 dense layers

A window meets a new graph key (a new conversation's cache, a decode crossing a key bound) inside
a request, and that request pays the capture. glm53.runtime.cuda_graphs captures with capture_begin/end on
a side stream; torch.cuda.graph does the same after emptying the allocator's device and pinned
caches, which the next allocations then pay again. Arms, interleaved sample by sample with the
order alternating, on one engine (the same weights): "kit" (WindowGraphs as shipped) and
"torch_graph" (the same class capturing through torch.cuda.graph). Per sample: a fresh
conversation (a new cache, so a new key) of --context tokens and --tokens greedy tokens; the
capture's own time (synchronized) and the request's decode time. Both arms must give the same
tokens and bitwise the same logits (exit 1 otherwise). JSON to --out, a table printed. GPU only.
"""
from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.decode import decode, graph_bench_args
from bench.lib.checkpoints import deepen, real_dims_checkpoint, tiny_checkpoint
from bench.lib.log import log
from bench.lib.meta import result_header
from glm53.measurement import summary, write_json
from glm53.runtime.cuda_graphs import WindowGraphs
from glm53.runtime.engine import Glm53Engine


class TimedCaptures(WindowGraphs):
    """WindowGraphs recording each capture's time (the device finished before and after)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_s: list[float] = []

    def _capture(self, *args: Any) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        super()._capture(*args)
        torch.cuda.synchronize()
        self.capture_s.append(time.perf_counter() - t0)


class TorchGraphCaptures(TimedCaptures):
    """The same, capturing through torch.cuda.graph (its empty_cache calls included)."""

    def _capture(self, entry: Any, state: Any, bound: int, taps: tuple[int, ...], key: tuple) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.out = self._run(state, entry, bound, taps)
        entry.graph = graph
        self.stats.captures += 1
        self._keep(key, entry)
        torch.cuda.synchronize()
        self.capture_s.append(time.perf_counter() - t0)


def main() -> int:
    args = graph_bench_args(__doc__, context=2048, tokens=8, repeats=5, out="graph_capture.json")
    if args is None:
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_graph_capture."))
    try:
        model_dir = real_dims_checkpoint(work, args.layers, args.vocab) if args.real_dims else tiny_checkpoint(work)
        engine = Glm53Engine(model_dir, device="cuda", cuda_graphs="1")
        distinct_layers = len(engine.model.w.layers)
        try:
            deepen(engine, args.depth)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        arms = {"kit": TimedCaptures(engine.model), "torch_graph": TorchGraphCaptures(engine.model)}
        rng = random.Random(43)
        vocab = engine.vocab_size
        for graphs in arms.values():  # warm-up (compiles, first pool), discarded
            engine.graphs = graphs
            decode(engine, [rng.randrange(3, vocab) for _ in range(64)], 4)
            graphs.capture_s.clear()
        samples: dict[str, list[dict]] = {name: [] for name in arms}
        held: list[Any] = []
        mismatches: list[int] = []
        for i in range(args.repeats):
            prompt = [rng.randrange(3, vocab) for _ in range(args.context)]
            got = {}
            for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
                engine.graphs = arms[name]
                before = len(arms[name].capture_s)
                got[name] = decode(engine, prompt, args.tokens)  # engine.state = None: a new cache, a new key
                held.append(engine.state)  # alive, so no later cache reuses its addresses (and keys)
                got[name]["capture_s"] = sum(arms[name].capture_s[before:])
                got[name]["captures"] = len(arms[name].capture_s) - before
            a, b = got["kit"], got["torch_graph"]
            if a["reply"] != b["reply"] or not torch.equal(a.pop("_logits").view(torch.int32),
                                                         b.pop("_logits").view(torch.int32)):
                mismatches.append(i)
            for name in arms:
                got[name].pop("_logits", None)
                samples[name].append(got[name])
            log(f"sample {i}: capture kit {a['capture_s'] * 1e3:.1f} ms ({a['captures']}), torch.cuda.graph "
                f"{b['capture_s'] * 1e3:.1f} ms ({b['captures']}); decode {a['decode_s'] * 1e3:.1f} / "
                f"{b['decode_s'] * 1e3:.1f} ms")
        capture = {name: summary([s["capture_s"] for s in samples[name]]) for name in arms}
        decode_s = {name: summary([s["decode_s"] for s in samples[name]]) for name in arms}
        settings = {"model_dir": str(model_dir), "real_dims": args.real_dims, "layers": len(engine.model.w.layers),
                    "distinct_layers": distinct_layers,
                    "compute_dtype": engine.dtype_name, "kv_dtype": engine.kv_dtype, "context": args.context,
                    "tokens": args.tokens, "repeats": args.repeats,
                    "timing": "capture: synchronized around _capture; decode: decode_s of generate(); interleaved"}
        result = {**result_header("graph_capture", settings, device=engine.device), "mismatches": mismatches,
                  "samples": samples, "capture_s": capture, "decode_s": decode_s,
                  "capture_ratio": capture["torch_graph"]["median"] / capture["kit"]["median"]}
        write_json(args.out, result)
        print(f"{'arm':12} {'capture (median)':>18} {'decode (median)':>18}")
        for name in arms:
            print(f"{name:12} {capture[name]['median'] * 1e3:15.1f} ms {decode_s[name]['median'] * 1e3:15.1f} ms")
        print(f"capture: torch.cuda.graph / kit = {result['capture_ratio']:.2f}x; bitwise equal: {not mismatches}")
        print(f"full results: {args.out}")
        return 1 if mismatches else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
