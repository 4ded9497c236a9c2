"""Concurrent decode streams through the batched runtime against one stream alone, side by side.

    python -m bench.bench_batching                       # CPU, tiny checkpoint: 1, 4, 16 streams
    python -m bench.bench_batching --streams 1,4,16 --tokens 32 --repeats 3 --device cuda
    python -m bench.bench_batching --ranks 2             # TP 2 + DCP 2 over gloo (RankBatch, lockstep)

Each round submits N requests at once to glm53.runtime.BatchEngine (distinct prompts of
--prompt tokens, --tokens decoded each, greedy, ignore_eos, "draft": false) and steps until all
finish; rounds of every N alternate within each repeat. Per round: the decode phase's aggregate
tokens a second (tokens after each stream's first, over the time from the first stream's first
token to the last stream's last) and each stream's time a token (its first to last token over
tokens - 1). Ratios against N = 1 of the same repeat: aggregate speedup, per-stream slowdown.
Every reply is checked against the N = 1 round's reply of the same prompt (exactness).
Goals (issue 36, at GLM-5.3 dimensions on a GPU): 4 streams >= 3x aggregate and <= 1.35x per
stream; 16 streams >= 8x. On the CPU the row-invariant ops compute each row as its own product,
so batching shares only the expert reads and the Python of a step: the tiny CPU numbers show the
runtime's overhead, not the GPU's batching gain. With --ranks R the runtime steps on R processes in
lockstep (glm53.dist.rank_batch; this process is rank 0, each follower pinned to its own CPU where
there are enough): a step's collectives then serve every stream in it.

--long-prompt L: a prompt of L tokens arrives while --long-streams streams decode (each has decoded
a few tokens first). Its prefill runs in pieces under the step's token budget (--step-tokens) beside
the streams' decode rows (on a GPU each piece replays a graph of its own: glm53.runtime.cuda_graphs);
the streams decode until it has its first token, so every piece rides beside them. A first long
round, before the timed ones, compiles the pieces' kernels and captures their graphs; its numbers are
kept apart (`first_long_round`): a lane's first long prompt meets them. Per repeat: the streams'
normal gap between tokens (the median before it arrived), their worst gap from its arrival until its
first token, the ratio (goal: <= 3 on a GPU;
on the CPU a step costs about its rows, so the ratio follows the budget), and its time to first
token; the streams' replies equal their replies alone. Each step is logged (`StepLog`): the worst
gap's slowest step (its ms, how long the forward's call took to return, windows, rows, graphs run for
the first time) and the steps carrying the prompt's rows (count, median, 90th percentile, most) say
what the gap is made of.

--gc-freeze (the default): the startup heap is frozen after the warm-up round, as a lane's ranks
freeze theirs once loaded (glm53.runtime.heap); --no-gc-freeze leaves it to the collector, to compare.
The collector's pauses inside each step are logged (StepLog) either way.

--profile: after the timed rounds, one more round per stream count with each step split into its
forward, head and tokens' choice (the device synchronized between them), as ms a step.

--kernels: after the timed rounds, one more round per stream count (and with --long-prompt, one long
round) under torch.profiler: the device kernels a step runs (graph replays included) and the ones
taking the most device time, per step.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

from bench.lib.log import log
from glm53.runtime.heap import collector_pauses
from bench.lib.meta import KIT_ROOT, RESULTS, result_header
from glm53.measurement import summary, write_json


def checkpoint(work: Path) -> Path:
    from bench.lib.checkpoints import tiny_checkpoint

    model = work / "tiny"
    if (model / "config.json").exists():
        return model
    work.mkdir(parents=True, exist_ok=True)
    return tiny_checkpoint(work)


def one_round(batch, prompts: list[list[int]], tokens: int) -> dict:
    """N streams submitted at once; their token times and replies."""
    times: list[list[float]] = [[] for _ in prompts]

    def stamp(i: int):
        def on_tokens(new: list[int]) -> bool:
            now = time.perf_counter()
            times[i].extend([now] * len(new))
            return True
        return on_tokens

    seqs = [batch.submit(p, tokens, {"draft": False, "ignore_eos": True}, on_tokens=stamp(i))
            for i, p in enumerate(prompts)]
    steps0 = batch.steps
    batch.run()
    first, last = min(t[0] for t in times), max(t[-1] for t in times)
    decoded = sum(len(t) - 1 for t in times)
    per_stream = [(t[-1] - t[0]) / (len(t) - 1) for t in times]
    return {"streams": len(prompts), "aggregate_tok_s": decoded / (last - first),
            "per_stream_s_per_token": statistics.mean(per_stream), "steps": batch.steps - steps0,
            "replies": [s.reply for s in seqs]}


def long_prompt_round(batch, prompts: list[list[int]], tokens: int, long_prompt: list[int], warm: int = 3) -> dict:
    """Streams decoding, then a long prompt submitted once each has `warm` tokens: the streams' gaps
    between tokens before and while it is prefilled, and its time to first token. The streams decode
    until the prompt has its first token and they have `tokens` each (then they are cancelled), so
    every piece of the prompt rides beside them; their replies' first `tokens` tokens are returned."""
    times: list[list[float]] = [[] for _ in prompts]

    def stamp(i: int):
        def on_tokens(new: list[int]) -> bool:
            times[i].extend([time.perf_counter()] * len(new))
            return True
        return on_tokens

    # a step takes at least one of the prompt's rows, so its prefill ends within len(long_prompt) steps
    outlast = tokens + len(long_prompt)
    seqs = [batch.submit(p, outlast, {"draft": False, "ignore_eos": True}, on_tokens=stamp(i))
            for i, p in enumerate(prompts)]
    while min(len(t) for t in times) < warm:
        batch.step()
    first_token: list[float] = []
    steps = StepLog(batch)
    arrival = time.perf_counter()
    batch.submit(long_prompt, 2, {"draft": False, "ignore_eos": True},
                 on_tokens=lambda new: first_token.append(time.perf_counter()) or True)
    while not first_token:
        if not steps.step():
            raise SystemExit("the long prompt finished no prefill: is the pool large enough for it?")
    ttft = first_token[0] - arrival
    while min(len(t) for t in times) < tokens:
        steps.step()
    for seq in seqs:
        batch.cancel(seq)
    while steps.step():
        pass
    steps.close()
    before = [b - a for t in times for a, b in zip(t, t[1:]) if b <= arrival]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if b > arrival and a < arrival + ttft]
    if not during:
        raise SystemExit("no stream token fell inside the long prompt's prefill: give a longer --long-prompt "
                         "or a smaller --step-tokens")
    normal, worst = statistics.median(before), max(during)
    gap = next((a, b) for t in times for a, b in zip(t, t[1:]) if b - a == worst and b > arrival)
    return {"streams": len(prompts), "long_prompt": len(long_prompt), "normal_gap_s": normal,
            "worst_gap_s": worst, "worst_vs_normal": worst / normal, "long_ttft_s": ttft,
            "worst_gap_slowest_step": steps.slowest_within(*gap),
            "prompt_steps": steps.prompt_steps(), "steps": len(steps.steps),
            "replies": [s.reply[:tokens] for s in seqs]}


def engine_of(batch):  # noqa: ANN001, ANN201
    """The BatchEngine that steps (a RankBatch, several ranks' lead, holds one)."""
    return getattr(batch, "batch", batch)


class StepLog:
    """Each step's wall time and what it ran (windows, rows, graphs run for the first time: an eager
    run and a capture), how long the forward's call took to return (its launches: on a GPU the
    host's share of the step, the kernels running behind it) and the garbage collector's pauses inside
    it (their ms and oldest generation), so a gap's cause shows in the results."""

    def __init__(self, batch) -> None:  # noqa: ANN001 (BatchEngine or RankBatch)
        self.batch, self.steps, self._plan, self._launch = batch, [], (0, 0), 0.0
        self.pauses = collector_pauses().pauses  # generation -> Durations, counted by the process's callback
        self.engine = engine_of(batch)
        self.graphs = getattr(self.engine.engine, "graphs", None)
        self._on_plan_before = self.engine.on_plan  # several ranks: their comparison of the plans, kept
        self.engine.on_plan = self._on_plan
        forward = self.engine.runner.forward

        def timed_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = forward(*args, **kwargs)
            self._launch = time.perf_counter() - t0
            return out

        self.engine.runner.forward = timed_forward

    def close(self) -> None:
        """The batch's own forward and planning again."""
        del self.engine.runner.forward
        self.engine.on_plan = self._on_plan_before

    def _collected(self) -> list[tuple[float, int]]:
        return [(d.sum, d.count) for d in self.pauses.values()]

    def _on_plan(self, work) -> None:  # noqa: ANN001
        self._plan = (len(work), sum(len(w.tokens) for w in work))
        if self._on_plan_before is not None:
            self._on_plan_before(work)

    def step(self) -> bool:
        first_runs = self.graphs.stats.first_runs if self.graphs is not None else 0
        collected = self._collected()
        t0 = time.perf_counter()
        ran = self.batch.step()
        t1 = time.perf_counter()
        if ran:
            after = self._collected()
            gc_ms = 1e3 * sum(a[0] - b[0] for a, b in zip(after, collected))
            gc_generation = max((g for g, (a, b) in enumerate(zip(after, collected)) if a[1] > b[1]), default=-1)
            self.steps.append({"start": t0, "end": t1, "windows": self._plan[0], "rows": self._plan[1],
                               "forward_call_ms": 1e3 * self._launch, "gc_ms": gc_ms,
                               "gc_generation": gc_generation,
                               "new_graphs": (self.graphs.stats.first_runs if self.graphs is not None else 0)
                               - first_runs})
        return ran

    def prompt_steps(self) -> dict:
        """The steps carrying a prompt's rows: how many, their ms (median, 90th percentile, most), which
        of them was the slowest (0: the first), and the collector's pauses among them."""
        carrying = [s for s in self.steps if s["rows"] > s["windows"]]
        if not carrying:
            return {"count": 0}
        ms = [1e3 * (s["end"] - s["start"]) for s in carrying]
        ordered = sorted(ms)
        collected = [s for s in carrying if s["gc_generation"] >= 0]
        return {"count": len(ms), "median_ms": statistics.median(ms), "p90_ms": ordered[int(0.9 * (len(ms) - 1))],
                "max_ms": ordered[-1], "slowest_index": ms.index(ordered[-1]),
                "collecting": {"steps": len(collected), "ms": sum(s["gc_ms"] for s in collected),
                               "oldest_generation": max((s["gc_generation"] for s in collected), default=-1)}}

    def slowest_within(self, a: float, b: float) -> dict:
        """The slowest step that ran during (a, b) (a token is handed out inside its step): its ms, the
        forward's call, windows, rows, new graphs and collector pauses (their ms; the oldest generation
        collected, -1: none), and the steps inside the gap."""
        inside = [s for s in self.steps if s["start"] < b and s["end"] > a]
        slowest = max(inside, key=lambda s: s["end"] - s["start"])
        return {"ms": 1e3 * (slowest["end"] - slowest["start"]), "forward_call_ms": slowest["forward_call_ms"],
                "windows": slowest["windows"], "rows": slowest["rows"], "new_graphs": slowest["new_graphs"],
                "gc_ms": slowest["gc_ms"], "gc_generation": slowest["gc_generation"], "steps_in_gap": len(inside)}


def prompt_steps_text(p: dict) -> str:
    if not p["count"]:
        return "no step carried its rows"
    c = p["collecting"]
    return (f"{p['count']} steps carried its rows: median {p['median_ms']:.1f} ms, 90th percentile "
            f"{p['p90_ms']:.1f}, most {p['max_ms']:.1f} (step {p['slowest_index']} of them); the collector ran in "
            f"{c['steps']} of them, {c['ms']:.1f} ms in all (oldest generation {c['oldest_generation']})")


class StepPhases:
    """--profile: each step's time split into the forward, the head and the tokens' choice, the device
    synchronized after each (so each phase holds its own GPU work; the steps run slower for it)."""

    def __init__(self, batch, device: str) -> None:  # noqa: ANN001 (BatchEngine)
        import torch

        self.seconds = {"forward": 0.0, "head": 0.0, "choose": 0.0}
        self.steps = 0
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

        def timed(name: str, fn):  # noqa: ANN001, ANN202
            def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                sync()
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                sync()
                self.seconds[name] += time.perf_counter() - t0
                if name == "forward":
                    self.steps += 1
                return out
            return run

        engine = engine_of(batch)
        engine.runner.forward = timed("forward", engine.runner.forward)
        engine.runner.logits = timed("head", engine.runner.logits)
        engine._advance = timed("choose", engine._advance)

    def report(self) -> dict:
        return {"steps": self.steps, **{f"{k}_ms_per_step": 1e3 * v / max(self.steps, 1) for k, v in self.seconds.items()}}


def kernel_profile(batch, run_round: Callable[[], object]) -> dict:  # noqa: ANN001 (BatchEngine)
    """One round under torch.profiler: device kernels a step (their count and the 12 with the most
    device time, microseconds a step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    steps0 = batch.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_round()
        torch.cuda.synchronize()
    steps = max(batch.steps - steps0, 1)
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels.setdefault(e.name, []).append(e.device_time)
    count = sum(len(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"steps": steps, "kernels_per_step": count / steps,
            "device_us_per_step": sum(sum(v) for v in kernels.values()) / steps,
            "top": [{"kernel": name[:120], "per_step": len(v) / steps, "us_per_step": sum(v) / steps}
                    for name, v in top]}


def engine_options(device: str) -> dict:
    cpu = device == "cpu"
    return {"device": device, "dtype": "fp32" if cpu else None, "kv_dtype": "fp32" if cpu else None,
            "prefill_chunk": 256 if cpu else None}


def start_followers(model: Path, ranks: int, device: str, threads: int,
                    gc_freeze: bool) -> tuple[int, list[subprocess.Popen]]:
    """Ranks 1..R-1 as processes running RankEngine.follow(); each on its own CPU when there are enough."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for r in range(1, ranks):
        cmd = [sys.executable, "-m", "bench.bench_batching", "--follower", str(r), "--ranks", str(ranks),
               "--port", str(port), "--model", str(model), "--device", device, "--threads", str(threads),
               "--gc-freeze" if gc_freeze else "--no-gc-freeze"]
        cpu = {cpus[r % len(cpus)]}
        procs.append(subprocess.Popen(cmd, cwd=KIT_ROOT, preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, cpu)))
    if len(cpus) >= ranks:
        os.sched_setaffinity(0, {cpus[0]})
    return port, procs


def rank_engine(model: Path, rank: int, ranks: int, port: int, device: str):
    from glm53.dist.rank_engine import RankEngine

    return RankEngine(str(model), tp=ranks, rank=rank, master="127.0.0.1", master_port=port,
                      rendezvous_timeout_s=120, **{k: v for k, v in engine_options(device).items() if v is not None})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the tiny one, written under --work)")
    p.add_argument("--work", type=Path, default=KIT_ROOT / ".work" / "bench_batching")
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--prompt", type=int, default=48, help="prompt tokens a stream")
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens a stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--long-prompt", type=int, default=0, help="tokens of a prompt arriving while streams decode")
    p.add_argument("--long-streams", type=int, default=4)
    p.add_argument("--step-tokens", type=int, default=0,
                   help="the scheduler's token budget a step (default: streams x --prompt)")
    p.add_argument("--ranks", type=int, default=1, help="TP + DCP ranks (gloo processes on this machine)")
    p.add_argument("--out", type=Path, help="default bench/results/batching_cpu_tiny[_R<ranks>].json")
    p.add_argument("--profile", action="store_true",
                   help="a last round per stream count with each step's phases timed (device synchronized)")
    p.add_argument("--kernels", action="store_true",
                   help="a last round per stream count under torch.profiler: device kernels a step (CUDA)")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="freeze the startup heap after the warm-up, as a lane does (glm53.runtime.heap)")
    p.add_argument("--follower", type=int, default=0, help=argparse.SUPPRESS)  # rank r of --ranks (internal)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch

    from glm53.runtime.engine import Glm53Engine
    from glm53.runtime.heap import freeze_startup_heap

    torch.set_num_threads(args.threads)
    if args.follower:
        follower = rank_engine(args.model, args.follower, args.ranks, args.port, args.device)
        if args.gc_freeze:
            freeze_startup_heap()
        follower.follow()
        return 0
    if args.kernels and not args.device.startswith("cuda"):
        p.error("--kernels profiles device kernels: give --device cuda (on the CPU, --profile splits each step)")
    counts = [int(n) for n in args.streams.split(",")]
    if args.long_prompt and args.long_streams > max(counts):
        p.error(f"--long-streams {args.long_streams}: each stream's reply is checked against its reply in a "
                f"--streams round; give a round of at least {args.long_streams} streams")
    model = args.model or checkpoint(args.work)
    out = args.out or RESULTS / f"batching_cpu_tiny{'' if args.ranks == 1 else f'_R{args.ranks}'}.json"
    followers: list[subprocess.Popen] = []
    budget = args.step_tokens or max(counts) * args.prompt
    seats = max(counts) + (1 if args.long_prompt else 0)
    if args.ranks > 1:
        port, followers = start_followers(model, args.ranks, args.device, args.threads, args.gc_freeze)
        lead = rank_engine(model, 0, args.ranks, port, args.device)
        engine = lead.engine
        batch = lead.batch_engine(max_seqs=seats, step_tokens=budget)
    else:
        engine = Glm53Engine(model, **{k: v for k, v in engine_options(args.device).items() if v is not None})
        batch = engine.batch_engine(max_seqs=seats, step_tokens=budget)
    vocab = engine.vocab_size
    prompts = [[(7 + 31 * i + 17 * j) % vocab for j in range(args.prompt)] for i in range(max(counts))]
    one_round(batch, prompts[:2], 4)  # warm-up, discarded
    if args.gc_freeze:  # the followers freeze theirs once loaded (start_followers)
        freeze_startup_heap()
    long = [(3 + 11 * j) % vocab for j in range(args.long_prompt)]
    cold_long = None
    if args.long_prompt:  # its pieces' shapes compile and their graphs are captured here, not in a timed gap
        cold_long = long_prompt_round(batch, prompts[:args.long_streams], args.tokens, long)
        cold_long.pop("replies")
        log(f"first long prompt (compiles, captures): streams' worst gap {1e3 * cold_long['worst_gap_s']:.1f} ms "
            f"against {1e3 * cold_long['normal_gap_s']:.1f} ms ({cold_long['worst_vs_normal']:.2f}x), "
            f"its first token after {cold_long['long_ttft_s']:.2f} s")
    rows, alone_replies, long_rows = [], {}, []
    for r in range(args.repeats):
        for n in counts:
            row = one_round(batch, prompts[:n], args.tokens)
            replies = row.pop("replies")
            for i, reply in enumerate(replies):
                if i in alone_replies and alone_replies[i] != reply:
                    raise SystemExit(f"stream {i} of {n}: reply differs from the same prompt's earlier reply")
                alone_replies.setdefault(i, reply)
            rows.append({"repeat": r, **row})
            log(f"repeat {r} streams {n}: {row['aggregate_tok_s']:.1f} tok/s, "
                f"{1e3 * row['per_stream_s_per_token']:.1f} ms/token a stream")
        if args.long_prompt:
            row = long_prompt_round(batch, prompts[:args.long_streams], args.tokens, long)
            if any(alone_replies[i] != reply for i, reply in enumerate(row.pop("replies"))):
                raise SystemExit("a stream's reply beside the long prompt differs from its reply alone")
            long_rows.append({"repeat": r, **row})
            slow = row["worst_gap_slowest_step"]
            log(f"repeat {r} long prompt {args.long_prompt}: streams' worst gap {1e3 * row['worst_gap_s']:.1f} ms "
                f"against {1e3 * row['normal_gap_s']:.1f} ms ({row['worst_vs_normal']:.2f}x), "
                f"its first token after {row['long_ttft_s']:.2f} s; the gap's slowest step {slow['ms']:.1f} ms "
                f"(the forward's call {slow['forward_call_ms']:.1f} ms), "
                f"{slow['windows']} windows, {slow['rows']} rows, {slow['new_graphs']} new graphs, "
                f"{slow['gc_ms']:.1f} ms collecting (generation {slow['gc_generation']}), {slow['steps_in_gap']} steps in the gap; " + prompt_steps_text(row["prompt_steps"]))
    phases = {}
    if args.profile:  # after the timed rounds: the synchronization slows the steps it splits
        for n in counts:
            profiler = StepPhases(batch, args.device)
            one_round(batch, prompts[:n], args.tokens)
            phases[n] = profiler.report()
            stepping = engine_of(batch)
            del stepping.runner.forward, stepping.runner.logits, stepping._advance  # the class's methods again
            log(f"profile streams {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases[n].items()))
    kernels = {}
    if args.kernels:
        rounds = {n: partial(one_round, batch, prompts[:n], args.tokens) for n in counts}
        if args.long_prompt:  # its steps: the pieces' and, once it is prefilled, 5 streams' (most of the time: pieces)
            rounds["long"] = partial(long_prompt_round, batch, prompts[:args.long_streams], args.tokens, long)
        for n, run_round in rounds.items():
            kernels[n] = k = kernel_profile(batch, run_round)
            log(f"kernels {'streams ' if n != 'long' else ''}{n}: {k['kernels_per_step']:.0f} a step, "
                f"{k['device_us_per_step']:.0f} us of device time a step; most: "
                + "; ".join(f"{t['kernel'][:60]} x{t['per_step']:.0f} {t['us_per_step']:.0f} us" for t in k["top"][:6]))
    table = []
    for n in counts:
        agg = [x["aggregate_tok_s"] for x in rows if x["streams"] == n]
        per = [x["per_stream_s_per_token"] for x in rows if x["streams"] == n]
        base_agg = [x["aggregate_tok_s"] for x in rows if x["streams"] == counts[0]]
        base_per = [x["per_stream_s_per_token"] for x in rows if x["streams"] == counts[0]]
        table.append({"streams": n, "aggregate_tok_s": summary(agg), "per_stream_s_per_token": summary(per),
                      "aggregate_vs_one": statistics.median(a / b for a, b in zip(agg, base_agg)),
                      "per_token_vs_one": statistics.median(a / b for a, b in zip(per, base_per))})
    if args.ranks > 1:
        lead.close()
        for proc in followers:
            proc.wait(timeout=120)
    settings = {"device": args.device, "streams": counts, "prompt": args.prompt, "tokens": args.tokens,
                "repeats": args.repeats, "threads": args.threads, "model": str(model),
                "layers": engine.cfg.num_hidden_layers, "ranks": args.ranks, "step_tokens": budget,
                "long_prompt": args.long_prompt, "long_streams": args.long_streams, "gc_freeze": args.gc_freeze}
    long_summary = {k: summary([x[k] for x in long_rows]) for k in ("normal_gap_s", "worst_gap_s", "worst_vs_normal",
                                                                     "long_ttft_s")} if long_rows else None
    graphs = getattr(engine, "graphs", None)  # the steps' CUDA graphs (None: every step eager)
    graph_stats = dataclasses.asdict(graphs.stats) if graphs is not None else None
    write_json(out, {**result_header("bench_batching", settings, device=args.device), "table": table,
                     "rounds": rows, "long_prompt": long_summary, "long_rounds": long_rows, "first_long_round": cold_long,
                     "graphs": graph_stats,
                     "step_phases": phases, "kernels": kernels})
    print(f"{'streams':>8} {'agg tok/s':>10} {'x one':>7} {'ms/token/stream':>16} {'x alone':>8}")
    for t in table:
        print(f"{t['streams']:>8} {t['aggregate_tok_s']['median']:>10.1f} {t['aggregate_vs_one']:>7.2f} "
              f"{1e3 * t['per_stream_s_per_token']['median']:>16.2f} {t['per_token_vs_one']:>8.2f}")
    if long_summary:
        med = {k: v["median"] for k, v in long_summary.items()}
        print(f"long prompt {args.long_prompt} beside {args.long_streams} streams: worst gap "
              f"{1e3 * med['worst_gap_s']:.1f} ms against a normal {1e3 * med['normal_gap_s']:.1f} ms "
              f"({med['worst_vs_normal']:.2f}x), its first token {med['long_ttft_s']:.2f} s")
    if graph_stats is not None:
        print(f"CUDA graphs: {graph_stats['captures']} captured, {graph_stats['replays']} replays "
              f"({graph_stats['pieces']} of them prefill pieces'), {graph_stats['first_runs']} first runs, "
              f"{graph_stats['eager']} eager steps {graph_stats['reasons']}")
    print(f"full results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
