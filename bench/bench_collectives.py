"""Collectives per forward over R ranks (TP R + DCP R): how many, of which kind, how many bytes.

    python -m bench.bench_collectives                                 # tiny checkpoint, R = 2 and 4
    python -m bench.bench_collectives --real-dims --layers 2 --ranks 4  # GLM-5.3 layer dimensions
    python -m bench.bench_collectives --streams 1 4 16               # batched decode steps of S streams

On the Sparks every collective of a decode step is a round trip over the network, so their number
and bytes per step are the layout's network budget. Both are exact properties of the code, not of
the backend: R real processes (gloo, CPU) serve one greedy request, rank 0 leading (RankEngine),
and every rank's Comm is wrapped to record each collective's name and bytes, attributed to the
forward it belongs to (the decided token's `continue` broadcast counts with the step before it).
With --streams, S greedy requests decode together through the batched runtime (RankEngine's
batch_engine, every rank stepping in lockstep) and each step is one entry: the step's collectives
whatever the number of sequences in it (the attention's exchanges carry every sequence's rows).
Bytes: `in` is what this rank contributes, `out` what it holds afterwards (an all-gather's R
pieces). The wall time per step is gloo on loopback on this machine: recorded, not a Spark's.
JSON (every forward of rank 0, per rank totals) to --out; a table per R. Exit codes: 0 done, 1 a
rank failed or the ranks disagree on the collectives, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.lib.checkpoints import real_dims_checkpoint, tiny_checkpoint
from bench.lib.log import log
from bench.lib.meta import KIT_ROOT, RESULTS, result_header
from glm53.measurement import write_json

WRAPPED = ("all_gather", "all_to_all", "broadcast")  # every other collective goes through these


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def record_collectives(comm: Any, log_to: list[dict]) -> None:
    """Wrap comm's collectives: each call appends {name, kind, in, out} (bytes) to the collectives of
    the forward in progress, log_to[-1]["collectives"]."""
    for kind in WRAPPED:
        real = getattr(comm, kind)

        def wrapped(tensor: torch.Tensor, *args: Any, _real=real, _kind=kind, **kwargs: Any) -> torch.Tensor:
            out = _real(tensor, *args, **kwargs)
            name = kwargs.get("name") or next((a for a in args if isinstance(a, str)), _kind)
            log_to[-1]["collectives"].append({"name": name, "kind": _kind, "in": _nbytes(tensor),
                                              "out": _nbytes(out)})
            return out
        setattr(comm, kind, wrapped)


def prompt_of(length: int, vocab: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7919 + salt * 104729) % (vocab - 3) for i in range(length)]


def worker(rank: int, world: int, port: int, model: str, prompt_len: int, tokens: int, dtype: str, out: Path,
           streams: int = 0) -> None:
    from glm53.dist.rank_engine import RankEngine

    torch.set_num_threads(1)
    eng = RankEngine(model, tp=world, rank=rank, master="127.0.0.1", master_port=port, device="cpu",
                     rendezvous_timeout_s=120, dtype=dtype, kv_dtype=dtype)
    forwards: list[dict] = [{"tokens": 0, "collectives": [], "wall_s": 0.0}]  # before the first forward
    record_collectives(eng.comm, forwards)
    if streams:
        batched_worker(eng, streams, prompt_len, tokens, forwards)
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "forwards": forwards}))
        return
    inner = eng.engine
    real_forward = inner.forward

    def forward(state, toks, start, taps=()):  # noqa: ANN001
        forwards.append({"tokens": len(toks), "start": start, "collectives": []})
        t0 = time.perf_counter()
        result = real_forward(state, toks, start, taps)
        forwards[-1]["wall_s"] = time.perf_counter() - t0
        return result
    inner.forward = forward
    if rank == 0:
        eng.generate(prompt_of(prompt_len, inner.vocab_size), tokens, {"temperature": 0.0, "ignore_eos": True,
                                                                        "draft": False})
        eng.close()
    else:
        assert eng.follow_one()
        assert not eng.follow_one()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "forwards": forwards}))


def batched_worker(eng: Any, streams: int, prompt_len: int, tokens: int, forwards: list[dict]) -> None:
    """`streams` greedy requests submitted together on rank 0, stepped until done; every rank's
    BatchEngine.step is one entry of `forwards` (tokens: the sequences it advanced)."""
    from glm53.runtime.batch import BatchEngine

    real_step = BatchEngine.step

    def step(batch: BatchEngine) -> bool:
        forwards.append({"tokens": batch.running, "collectives": []})
        t0 = time.perf_counter()
        stepped = real_step(batch)
        forwards[-1]["wall_s"] = time.perf_counter() - t0
        return stepped
    BatchEngine.step = step  # this worker process's own class: every rank records its steps
    if eng.rank == 0:
        batch = eng.batch_engine(max_seqs=streams, step_tokens=streams * prompt_len)
        vocab = eng.engine.vocab_size
        for k in range(streams):  # distinct prompts: nothing shared, every sequence prefills
            batch.submit(prompt_of(prompt_len, vocab, salt=k), tokens, {"temperature": 0.0, "ignore_eos": True,
                                                                         "draft": False})
        batch.run()
        eng.close()
    else:
        while eng.follow_one():
            pass


def per_forward(f: dict) -> dict[str, Any]:
    names = Counter(c["name"] for c in f["collectives"])
    bytes_in, bytes_out = Counter(), Counter()
    for c in f["collectives"]:
        bytes_in[c["name"]] += c["in"]
        bytes_out[c["name"]] += c["out"]
    return {"tokens": f["tokens"], "collectives": len(f["collectives"]), "by_name": dict(names),
            "in_by_name": dict(bytes_in), "out_by_name": dict(bytes_out),
            "in_bytes": sum(c["in"] for c in f["collectives"]), "out_bytes": sum(c["out"] for c in f["collectives"]),
            "wall_s": f.get("wall_s", 0.0)}


def run_world(model: Path, world: int, prompt_len: int, tokens: int, dtype: str, work: Path,
              streams: int = 0) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / f"r{world}s{streams}"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_GLM53_PREFIX_CACHE="0", TF_GLM53_DCP="1")
    procs = []
    for r in range(world):
        with open(out / f"stderr{r}.txt", "w") as err:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.bench_collectives", "--worker", "--rank", str(r), "--world", str(world),
                                           "--port", str(port), "--model", str(model), "--prompt", str(prompt_len),
                                           "--tokens", str(tokens), "--dtype", dtype, "--work", str(out),
                                           "--streams", str(streams)],
                                          env=env, cwd=KIT_ROOT, stdout=subprocess.DEVNULL, stderr=err))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        tails = "\n".join((out / f"stderr{r}.txt").read_text()[-1500:] for r in range(world))
        raise RuntimeError(f"R={world}: ranks exited {codes}\n{tails}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    lead = [per_forward(f) for f in ranks[0]["forwards"]]
    for other in ranks[1:]:  # every rank meets in the same collectives, in the same order
        if [[c["name"] for c in f["collectives"]] for f in other["forwards"]] != \
           [[c["name"] for c in f["collectives"]] for f in ranks[0]["forwards"]]:
            raise RuntimeError(f"R={world}: rank {other['rank']} ran other collectives than rank 0")
    if streams:  # a decode step: every stream running and past its prefill (a step of S tokens)
        decode = [f for f in lead[1:] if f["tokens"] == streams][1:-1]
        return {"world": world, "streams": streams, "forwards": lead, "prefill": [],
                "decode_step": decode[len(decode) // 2] if decode else None, "decode_steps": len(decode)}
    decode = [f for f in lead[1:] if f["tokens"] == 1]
    return {"world": world, "forwards": lead, "prefill": [f for f in lead[1:] if f["tokens"] > 1],
            "decode_step": decode[len(decode) // 2] if decode else None, "decode_steps": len(decode)}


def table(res: dict[str, Any], layers: int) -> str:
    step = res["decode_step"]
    streams = f", {res['streams']} streams batched" if res.get("streams") else ""
    lines = [f"R = {res['world']}{streams}: one decode step ({layers} layers): {step['collectives']} collectives, "
             f"{step['in_bytes']} B in / {step['out_bytes']} B out per rank (gloo here: {step['wall_s'] * 1e3:.1f} ms)",
             f"{'collective':24} {'per step':>8} {'in B':>10} {'out B':>10}"]
    lines += [f"{name:24} {n:8d} {step['in_by_name'][name]:10d} {step['out_by_name'][name]:10d}"
              for name, n in sorted(step["by_name"].items(), key=lambda kv: -kv[1])]
    for f in res["prefill"]:
        lines.append(f"prefill of {f['tokens']} tokens: {f['collectives']} collectives, {f['in_bytes']} B in / "
                     f"{f['out_bytes']} B out")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real-dims", action="store_true", help="GLM-5.3 layer dimensions (dense layers)")
    p.add_argument("--layers", type=int, default=2, help="layers of the --real-dims checkpoint (default 2)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens (default 40)")
    p.add_argument("--tokens", type=int, default=6, help="tokens decoded (default 6)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="compute and cache dtype (bf16: the GPUs' activations, hence their bytes)")
    p.add_argument("--streams", type=int, nargs="+", default=[],
                   help="batched runs of S concurrent streams each (default: one request, unbatched)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default results/collectives_cpu.json; with --streams collectives_batched_cpu.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.rank, args.world, args.port, args.model, args.prompt, args.tokens, args.dtype, args.work,
               args.streams[0] if args.streams else 0)
        return 0
    if min(args.ranks) < 2 or args.prompt < 1 or args.tokens < 2 or args.layers < 1:
        print("error: --ranks >= 2, --prompt >= 1, --tokens >= 2, --layers >= 1", file=sys.stderr)
        return 2
    if args.streams and (min(args.streams) < 1 or args.tokens < 4):
        print("error: --streams >= 1 with --tokens >= 4 (the steps where every stream decodes)", file=sys.stderr)
        return 2
    out = args.out or RESULTS / ("collectives_batched_cpu.json" if args.streams else "collectives_cpu.json")
    with tempfile.TemporaryDirectory(prefix="bench_collectives.") as tmp:
        work = Path(tmp)
        model = real_dims_checkpoint(work, args.layers, args.vocab) if args.real_dims else tiny_checkpoint(work)
        from glm53.config import Glm53Config

        cfg = Glm53Config.from_dir(model)
        results = []
        for world in args.ranks:
            for streams in args.streams or [0]:
                what = f"{streams} requests batched" if streams else "one request"
                log(f"R = {world}: {world} ranks serve {what} ({args.prompt} prompt tokens, {args.tokens} decoded) ...")
                try:
                    results.append(run_world(model, world, args.prompt, args.tokens, args.dtype, work, streams))
                except RuntimeError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
        settings = {"model": "real_dims" if args.real_dims else "tiny", "layers": cfg.num_hidden_layers,
                    "indexer_types": list(cfg.indexer_types), "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                    "prompt": args.prompt, "tokens": args.tokens, "backend": "gloo (CPU)", "dtype": args.dtype,
                    "dcp": True, "prefix_cache": False, "streams": args.streams}
        write_json(out, {**result_header("collectives", settings, device=torch.device("cpu")),
                              "results": results})
        for res in results:
            print(table(res, cfg.num_hidden_layers))
        print(f"full results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
