"""Prefix cache on against off, through the real glm53 engine (cache = kv_cache.PrefixCache).

    python -m bench.bench_prefix_cache                    # CPU, tiny checkpoint, issue-7 sizes
    python -m bench.bench_prefix_cache --small            # CPU smoke: shorter turns and prompts
    python -m bench.bench_prefix_cache --real-dims        # GPU: GLM-5.3 layer dimensions (see below)

Four scenarios, cache on and cache off interleaved sample by sample in one process:
  turns     a six-turn agent conversation, each turn = previous prompt + reply + ~2.7k new tokens;
            per-turn wall time of generate() (prefill + `--reply` tokens), prompt and cached
            tokens, speedup; goal: on, turn 6 / turn 1 <= 1.2. --off-repeats M: cache off in the
            first M repeats only (later cache-on samples checked against the first repeat's
            cache-off replies); --turn-gap S: S seconds idle after each turn, untimed;
            --warmup-repeats W (default 1): W conversations first, discarded. Also each repeat's
            own turn 6 / turn 1, for the ratio's spread
  one-word  a ~19k-token prompt, then the same prompt + one word: cold (cache off) against
            reused (live rows); goal >= 100x. On CUDA the reused request also runs without CUDA
            graphs and with short windows on the prefill attention kernel (its own graphs), side by side
  disk      a long prompt stored to the disk tier (TF_GLM53_DISK_CACHE), then a restart of the
            cache (new index from the files, empty host tier, no live rows, the files' pages
            dropped from the OS page cache with posix_fadvise) and the prompt + one word: disk
            resume against cold; goal >= 50x. Each sample also resumes once more after another
            restart with the files' pages left in the page cache (a process restart, not a reboot)
  switch    (not run by default) two ~19k-token conversations taking turns, each request one word
            more than its conversation's last prompt: the prefix restored from the host tier (the
            live rows are the other conversation's) against cold
Every on/off pair also checks that the replies and the prompt's last logits are bitwise identical.
  profile   (--profile) one cold prefill of the one-word prompt, one reused one-word extension, and
            turns 1 and 6 of a fresh conversation under torch.profiler: the top ops by device and by
            host time; the reused one-word request's host timeline (perf_counter around its steps, no
            profiler); a disk resume under cProfile; written next to --out (.profile.txt)

--real-dims writes (to a temp folder, once) a checkpoint with GLM-5.3's layer dimensions (hidden
6144, 64 heads, q/kv LoRA 2048/512, qk 192+64, v 256, indexer 32x128 top-k 2048, dense MLP 12288),
`--layers` dense layers, random bf16 weights, vocab `--vocab`; the engine runs it with its GPU
defaults (bf16, grid 2048) unless overridden. The weights are noise: this measures time, not text.
--depth N runs N layers, the checkpoint's repeated in order with their weights shared (each its own
KV cache layer): GLM-5.3's depth (78) at its layer dimensions without a 67 GB checkpoint. What a
request pays once (its Python, the prompt check, lookup, store, launches) then has its real share.

Wall times are end-to-end generate() calls (perf_counter; the engine syncs when it reads a token).
Prints a table last; writes every sample, medians, min/max, settings, commit, device and versions
as JSON (--out). Exit codes: 0 done; 1 a reply or logits row differed between cache on and off; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.checkpoints import deepen, real_dims_checkpoint, tiny_checkpoint
from bench.lib.log import log
from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json
from bench.lib.pagecache import drop_page_cache
from glm53.runtime.cuda_graphs import WindowGraphs
from glm53.runtime.engine import Glm53Engine
from glm53.settings import Settings
from kv_cache.engine_adapter import attach_prefix_cache


# ---- measurement -------------------------------------------------------------------------------
class Side:
    """One arm (cache on or off): its cache and its own retained conversation on the shared engine."""

    def __init__(self, engine: Glm53Engine, name: str, environ: dict[str, str]) -> None:
        self.engine, self.name, self.environ = engine, name, environ
        self.cache = attach_prefix_cache(engine, revision="bench", settings=Settings.from_env(environ))
        self.state = None

    def restart(self) -> None:
        self.cache.close()  # as at process exit: pending disk writes finish
        self.cache = attach_prefix_cache(self.engine, revision="bench", settings=Settings.from_env(self.environ))
        self.state = None

    def generate(self, prompt: list[int], reply_tokens: int) -> dict[str, Any]:
        e = self.engine
        e.prefix_cache, e.state = self.cache, self.state
        first_logits: list[torch.Tensor] = []
        real_logits = e.model.logits

        def logits(hidden):  # keep the prompt's last-position logits (the first call) for the bitwise check
            out = real_logits(hidden)
            if not first_logits:
                first_logits.append(out.detach().to("cpu", copy=True))
            return out

        e.model.logits = logits
        try:
            sync()
            t0 = time.perf_counter()
            reply = e.generate(list(prompt), reply_tokens, {"temperature": 0.0})
            sync()
            wall = time.perf_counter() - t0
        finally:
            del e.model.logits
        self.state = e.state
        s = e.last_stats
        return {"wall_s": wall, "ttft_s": s.get("ttft_s"), "prompt_tokens": s["prompt_tokens"],
                "cached_tokens": s["cached_tokens"], "reply": reply, "_logits": first_logits[0]}


def pair(on: Side, off: Side, prompt: list[int], reply: int, i: int) -> tuple[dict, dict]:
    """One sample of each arm, the order alternating between samples (no arm always runs first)."""
    if i % 2:
        b = off.generate(prompt, reply)
        return on.generate(prompt, reply), b
    a = on.generate(prompt, reply)
    return a, off.generate(prompt, reply)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Replies equal and the prompt's last logits bitwise equal; drops the tensors from the record."""
    la, lb = a.pop("_logits"), b.pop("_logits")
    return a["reply"] == b["reply"] and torch.equal(la.view(torch.int32), lb.view(torch.int32))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rand_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def scenario_turns(engine, args, rng, mismatches: list[str]) -> dict[str, Any]:
    """The conversation `--repeats` times over (fresh caches each time, the same tokens: the replies
    are greedy), so every turn has that many samples of cache on; the first `--off-repeats` of them
    (default all) also of cache off, side by side. A repeat without cache off is checked against the
    first repeat's cache-off reply and logits for that turn. Medians compared. Before them
    `--warmup-repeats` conversations, cache on and off, are run and discarded (warm-up runs are not
    results): without them the first repeat is the slowest (H200, 4 layers: turn 1 in 59 ms against
    40 and 44; its cause, some first use in the process, not isolated)."""
    turns = [rand_tokens(rng, args.turn_tokens, engine.vocab_size) for _ in range(args.turns)]
    off_repeats = args.repeats if args.off_repeats is None else min(args.off_repeats, args.repeats)
    samples: list[list[tuple[dict, dict | None]]] = [[] for _ in turns]
    reference: list[tuple[list[int], torch.Tensor]] = []  # each turn's cache-off reply and last logits
    for rep in range(-args.warmup_repeats, args.repeats):
        on = Side(engine, "on", args.on_env)
        off = Side(engine, "off", {"TF_GLM53_PREFIX_CACHE": "0"}) if rep < off_repeats else None
        prompt: list[int] = []
        for i, new in enumerate(turns):
            prompt = prompt + new
            if rep < 0:  # a warm-up conversation: run, not counted
                a = on.generate(prompt, args.reply)
                off.generate(prompt, args.reply)
                log(f"turn {i + 1} (warm-up): on {a['wall_s']:.3f}s")
                prompt = prompt + a["reply"]
                continue
            if off is not None:
                a, b = pair(on, off, prompt, args.reply, i + rep)
                if rep == 0:
                    reference.append((b["reply"], b["_logits"]))
                equal = same(a, b)
            else:
                a, b = on.generate(prompt, args.reply), None
                equal = same(a, {"reply": reference[i][0], "_logits": reference[i][1]})
            if not equal:
                mismatches.append(f"turns: turn {i + 1} (repeat {rep})")
            samples[i].append((a, b))
            off_wall = f"{b['wall_s']:.3f}s" if b is not None else "-"
            log(f"turn {i + 1} (repeat {rep}): prompt {a['prompt_tokens']} cached {a['cached_tokens']} "
                f"on {a['wall_s']:.3f}s off {off_wall}")
            prompt = prompt + a["reply"]
            time.sleep(args.turn_gap)  # an agent's tool call or its user between turns (not timed)
        on.cache.close()
    rows = []
    for i, pairs in enumerate(samples):
        on_s = summary([a["wall_s"] for a, _ in pairs])
        off_s = summary([b["wall_s"] for _, b in pairs if b is not None])
        rows.append({"turn": i + 1, "prompt_tokens": pairs[0][0]["prompt_tokens"],
                     "cached_tokens": pairs[0][0]["cached_tokens"], "on_s": on_s, "off_s": off_s,
                     "speedup": off_s["median"] / on_s["median"], "samples": [{"on": a, "off": b} for a, b in pairs]})
    last = rows[-1]["on_s"]["median"]
    # each repeat's own last turn over its first: the ratio's spread across repeats, paired
    by_repeat = [last_on["wall_s"] / first_on["wall_s"] for (first_on, _), (last_on, _) in zip(samples[0], samples[-1])]
    # turn 2 on: the first turn whose every query has a full top-k of history to attend over (turn
    # 1's first index_topk positions see fewer keys, with the cache on or off alike)
    return {"turns": rows, "on_turn_last_over_first": last / rows[0]["on_s"]["median"],
            "on_turn_last_over_first_by_repeat": by_repeat,
            "on_turn_last_over_second": last / rows[1]["on_s"]["median"] if len(rows) > 1 else None}


def scenario_one_word(engine, args, rng, mismatches: list[str]) -> dict[str, Any]:
    on, off = Side(engine, "on", args.on_env), Side(engine, "off", {"TF_GLM53_PREFIX_CACHE": "0"})
    base = rand_tokens(rng, args.long, engine.vocab_size)
    first = on.generate(base, args.reply)  # fills the cache (not a sample)
    first.pop("_logits")
    cold, warm, eager, unsplit = [], [], [], []
    # the reused request with short windows on the prefill attention kernel (its own graphs), side by side
    unsplit_graphs = WindowGraphs(engine.model) if engine.graphs is not None else None
    for i in range(args.repeats):
        word = rand_tokens(rng, 1, engine.vocab_size)
        w, c = pair(on, off, base + word, args.reply, i)
        if engine.graphs is not None:  # the same reused request without CUDA graphs, for the ratio
            graphs, engine.graphs = engine.graphs, None
            try:
                e = on.generate(base + word, args.reply)
            finally:
                engine.graphs = graphs
            if not same(e, dict(c)):
                mismatches.append(f"one-word: eager sample {i}")
            eager.append(e)
            from glm53.ops import triton_attention

            graphs, split_rows = engine.graphs, triton_attention.SPLIT_ROWS
            engine.graphs, triton_attention.SPLIT_ROWS = unsplit_graphs, 0
            try:
                u = on.generate(base + word, args.reply)
            finally:
                engine.graphs, triton_attention.SPLIT_ROWS = graphs, split_rows
            if not same(u, dict(c)):
                mismatches.append(f"one-word: unsplit-attention sample {i}")
            unsplit.append(u)
        if not same(w, c):
            mismatches.append(f"one-word: sample {i}")
        warm.append(w)
        cold.append(c)
        log(f"one-word {i}: cold {c['wall_s']:.3f}s reused {w['wall_s']:.4f}s (cached {w['cached_tokens']})"
            + (f", without graphs {eager[-1]['wall_s']:.4f}s, prefill attention kernel "
               f"{unsplit[-1]['wall_s']:.4f}s" if eager else ""))
    cw, ww = [x["wall_s"] for x in cold], [x["wall_s"] for x in warm]
    out = {"prompt_tokens": len(base) + 1, "fill_s": first["wall_s"], "cold": cold, "reused": warm,
           "cold_s": summary(cw), "reused_s": summary(ww), "speedup": statistics.median(cw) / statistics.median(ww),
           "ttft_speedup": statistics.median([x["ttft_s"] for x in cold]) / statistics.median([x["ttft_s"] for x in warm])}
    if eager:
        out.update(reused_eager=eager, reused_eager_s=summary([x["wall_s"] for x in eager]),
                   reused_unsplit=unsplit, reused_unsplit_s=summary([x["wall_s"] for x in unsplit]))
    return out


def scenario_switch(engine, args, rng, mismatches: list[str]) -> dict[str, Any]:
    """Two agents taking turns on one server: each request extends the other conversation's last
    prompt by one word, so its prefix comes back from the host tier (the live rows are the other
    conversation's). Cold (cache off) against restored."""
    on, off = Side(engine, "on", args.on_env), Side(engine, "off", {"TF_GLM53_PREFIX_CACHE": "0"})
    convs = [rand_tokens(rng, args.long, engine.vocab_size) for _ in range(2)]
    for c in convs:  # both stored; the second one's rows are live
        on.generate(c, args.reply).pop("_logits")
    cold, warm = [], []
    for i in range(args.repeats):
        prompt = convs[i % 2]  # the conversation whose rows are not live
        prompt.extend(rand_tokens(rng, 1, engine.vocab_size))
        before = on.cache.stats.host_tokens
        w, c = pair(on, off, prompt, args.reply, i)
        w["host_tokens"] = on.cache.stats.host_tokens - before
        if not same(w, c):
            mismatches.append(f"switch: sample {i}")
        warm.append(w)
        cold.append(c)
        log(f"switch {i}: cold {c['wall_s']:.3f}s restored {w['wall_s']:.4f}s (cached {w['cached_tokens']}, "
            f"{w['host_tokens']} from the host tier)")
    cw, ww = [x["wall_s"] for x in cold], [x["wall_s"] for x in warm]
    return {"prompt_tokens": [x["prompt_tokens"] for x in warm], "cold": cold, "restored": warm, "cold_s": summary(cw),
            "restored_s": summary(ww), "speedup": statistics.median(cw) / statistics.median(ww)}


def scenario_disk(engine, args, rng, mismatches: list[str], disk_dir: Path) -> dict[str, Any]:
    env = {**args.on_env, "TF_GLM53_DISK_CACHE": str(disk_dir), "TF_GLM53_DISK_CACHE_BYTES": args.disk_bytes}
    on, off = Side(engine, "on", env), Side(engine, "off", {"TF_GLM53_PREFIX_CACHE": "0"})
    base = rand_tokens(rng, args.disk_long, engine.vocab_size)
    first = on.generate(base, args.reply)  # writes the chunks to disk (background thread)
    first.pop("_logits")
    on.cache.flush()
    disk_bytes = on.cache.disk.used_bytes
    cold, warm, kept = [], [], []
    for i in range(args.repeats):
        word = rand_tokens(rng, 1, engine.vocab_size)
        on.restart()
        advised = drop_page_cache(disk_dir)
        w, c = pair(on, off, base + word, args.reply, i)
        w["disk_tokens"] = on.cache.stats.disk_tokens
        w.update({f"restore_{k}_s": v for k, v in on.cache.restore_times().items()})
        w["page_cache_dropped_bytes"] = advised
        # a process restart, not a reboot: the files' pages are still in the OS page cache (the
        # resume above just read them), so this one reads memory, not the disk (a few samples:
        # each costs a restart and ~1 s, not a cold prefill)
        for j in range(args.page_cache_samples):
            on.restart()
            k = on.generate(base + word, args.reply)
            k["disk_tokens"] = on.cache.stats.disk_tokens
            k.update({f"restore_{name}_s": v for name, v in on.cache.restore_times().items()})
            if not same(k, dict(c)):
                mismatches.append(f"disk: page-cache sample {i}.{j}")
            kept.append(k)
        if not same(w, c):
            mismatches.append(f"disk: sample {i}")
        warm.append(w)
        cold.append(c)
        pages = kept[-args.page_cache_samples:]

        def each(field: str, digits: int) -> str:  # one value per page-cache resume of this sample
            return " / ".join(f"{r[field]:.{digits}f}" for r in pages)

        log(f"disk {i}: cold {c['wall_s']:.3f}s disk resume {w['wall_s']:.4f}s (from disk {w['disk_tokens']}), "
            f"from the page cache {each('wall_s', 4)}s; the restore's copying thread waited on the readers "
            f"{w['restore_waited_s']:.3f} / {each('restore_waited_s', 3)}s, worked {w['restore_copying_s']:.3f} / "
            f"{each('restore_copying_s', 3)}s (disk / page cache)")
    on.cache.close()  # finish background writes before the folder goes away
    cw, ww, kw = ([x["wall_s"] for x in arm] for arm in (cold, warm, kept))
    return {"prompt_tokens": len(base) + 1, "fill_s": first["wall_s"], "disk_bytes": disk_bytes,
            "cold": cold, "disk_resume": warm, "cold_s": summary(cw), "disk_resume_s": summary(ww),
            "speedup": statistics.median(cw) / statistics.median(ww),
            "page_cache_resume": kept, "page_cache_resume_s": summary(kw),
            "page_cache_speedup": statistics.median(cw) / statistics.median(kw)}


def scenario_profile(engine, args, rng, out: Path, disk_dir: Path) -> dict[str, Any]:
    """Where the time of a cold prefill, of a reused one-word extension and of a disk resume goes
    (not timed samples): torch.profiler's op tables, and cProfile's Python view of the disk resume
    (from the disk, then from the OS page cache)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    on, off = Side(engine, "on", args.on_env), Side(engine, "off", {"TF_GLM53_PREFIX_CACHE": "0"})
    base = rand_tokens(rng, args.long, engine.vocab_size)
    on.generate(base, args.reply)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    sections, walls = [], {}
    on.generate(base + rand_tokens(rng, 1, engine.vocab_size), args.reply)  # the reused path's graph captured
    for name, side in (("cold prefill", off), ("reused one-word", on)):
        prompt = base + rand_tokens(rng, 1, engine.vocab_size)
        with profile(activities=activities) as prof:
            walls[name] = side.generate(prompt, args.reply)["wall_s"]
        table = prof.key_averages()
        sections.append(f"== {name}: {len(prompt)} prompt tokens, wall {walls[name]:.4f} s, by {sort} ==\n"
                        + table.table(sort_by=sort, row_limit=25)
                        + f"\n== {name}: by self_cpu_time_total ==\n" + table.table(sort_by="self_cpu_time_total", row_limit=25))
    sections.append(profile_turns(engine, args, rng, activities, sort, walls))
    timeline = request_timeline(engine, on, base, rng, args.reply)
    sections.append("== reused one-word: host timeline (perf_counter, no profiler; medians of "
                    f"{TIMELINE_SAMPLES}, ms from the call) ==\n"
                    + "\n".join(f"{name:>14}: {a:7.3f} -> {b:7.3f}" for name, (a, b) in timeline.items()))
    env = {**args.on_env, "TF_GLM53_DISK_CACHE": str(disk_dir), "TF_GLM53_DISK_CACHE_BYTES": args.disk_bytes}
    disk = Side(engine, "disk", env)
    base = rand_tokens(rng, args.disk_long, engine.vocab_size)
    disk.generate(base, args.reply)
    prompt = base + rand_tokens(rng, 1, engine.vocab_size)
    # from the disk (pages dropped), then after another restart from the OS page cache (the same
    # prompt: the one-token window's graph is captured by the first, replayed by the second)
    for name, drop in (("disk resume", True), ("disk resume from the page cache", False)):
        disk.restart()
        if drop:
            drop_page_cache(disk_dir)
        prof = cProfile.Profile()
        prof.enable()
        walls[name] = disk.generate(prompt, args.reply)["wall_s"]
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        sections.append(f"== {name}: {len(prompt)} prompt tokens, wall {walls[name]:.4f} s "
                        f"(cProfile{', page cache dropped' if drop else ''}) ==\n" + text.getvalue())
    disk.cache.close()
    path = out.with_suffix(".profile.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(sections))
    log(f"profile tables: {path}")
    return {"profile_file": str(path), "wall_s": walls, "one_word_timeline_ms": timeline}


def profile_turns(engine, args, rng, activities, sort: str, walls: dict[str, float]) -> str:
    """Turn 1 and the last turn of a fresh conversation (cache on) under torch.profiler: what grows."""
    from torch.profiler import profile

    side = Side(engine, "on", args.on_env)
    prompt: list[int] = []
    text = []
    for i in range(args.turns):
        prompt = prompt + rand_tokens(rng, args.turn_tokens, engine.vocab_size)
        if i in (0, args.turns - 1):
            with profile(activities=activities) as prof:
                got = side.generate(prompt, args.reply)
            name = f"turn {i + 1}"
            walls[name] = got["wall_s"]
            text.append(f"== {name}: {got['prompt_tokens']} prompt tokens, {got['cached_tokens']} cached, wall "
                        f"{got['wall_s']:.4f} s, by {sort} ==\n" + prof.key_averages().table(sort_by=sort, row_limit=30))
        else:
            got = side.generate(prompt, args.reply)
        prompt = prompt + got["reply"]
    side.cache.close()
    return "\n\n".join(text)


TIMELINE_SAMPLES = 5


def request_timeline(engine, side: Side, base: list[int], rng, reply: int) -> dict[str, tuple[float, float]]:
    """When each step of a reused one-word request starts and ends on the host (ms after the call;
    no sync added: the first sample() waits for the GPU's forward)."""
    import glm53.runtime.engine as engine_module

    stamps: list[dict[str, tuple[float, float]]] = []
    current: dict[str, tuple[float, float]] = {}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                current.setdefault(name, (t0, time.perf_counter()))
        return wrapper

    steps = {"_check_prompt": engine._check_prompt, "_state_for": engine._state_for, "run": engine.run,
             "store_prefix": engine.store_prefix}
    real_sample = engine_module.sample
    try:
        for name, fn in steps.items():
            setattr(engine, name, timed(name, fn))
        engine_module.sample = timed("sample", real_sample)
        for _ in range(TIMELINE_SAMPLES):
            current.clear()
            prompt = base + rand_tokens(rng, 1, engine.vocab_size)
            sync()
            t0 = time.perf_counter()
            side.generate(prompt, reply)
            current["generate"] = (t0, time.perf_counter())
            stamps.append({k: ((a - t0) * 1e3, (b - t0) * 1e3) for k, (a, b) in current.items()})
    finally:
        for name in steps:
            delattr(engine, name)
        engine_module.sample = real_sample
    return {k: (statistics.median(s[k][0] for s in stamps), statistics.median(s[k][1] for s in stamps))
            for k in stamps[0]}


# ---- report ------------------------------------------------------------------------------------
def spread(s: dict[str, float], digits: int) -> str:
    """A summary's median and range: '0.037s [0.034, 0.285]'."""
    return f"{s['median']:.{digits}f}s [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def table(result: dict[str, Any]) -> str:
    lines = []
    t = result.get("turns")
    if t:
        lines += ["turn | prompt | cached | on median [min, max] (s) | off median (s) | speedup",
                  "---- | ------ | ------ | ------------------------ | -------------- | -------"]
        for r in t["turns"]:
            on_s = r["on_s"]
            lines.append(f"{r['turn']:4d} | {r['prompt_tokens']:6d} | {r['cached_tokens']:6d} | "
                         f"{on_s['median']:6.3f} [{on_s['min']:.3f}, {on_s['max']:.3f}] | "
                         f"{r['off_s']['median']:14.3f} | {r['speedup']:6.1f}x")
        lines.append(f"cache on: turn {len(t['turns'])} / turn 1 = {t['on_turn_last_over_first']:.2f} (medians; goal <= 1.2)")
        if t.get("on_turn_last_over_first_by_repeat"):
            own = ", ".join(f"{r:.2f}" for r in t["on_turn_last_over_first_by_repeat"])
            lines.append(f"  each repeat's own: {own}")
        if t.get("on_turn_last_over_second"):
            lines.append(f"cache on: turn {len(t['turns'])} / turn 2 = {t['on_turn_last_over_second']:.2f} (medians)")
    o = result.get("one_word")
    if o:
        lines.append(f"one-word extension of {o['prompt_tokens'] - 1} tokens: cold {spread(o['cold_s'], 3)}, reused "
                     f"{spread(o['reused_s'], 4)}: {o['speedup']:.0f}x (goal >= 100x); "
                     f"time to first token {o['ttft_speedup']:.0f}x")
        if "reused_eager_s" in o:
            lines.append(f"  the reused request without CUDA graphs: {o['reused_eager_s']['median']:.4f}s "
                         f"({o['cold_s']['median'] / o['reused_eager_s']['median']:.0f}x)")
            lines.append(f"  the reused request with short windows on the prefill attention kernel: "
                         f"{o['reused_unsplit_s']['median']:.4f}s "
                         f"({o['cold_s']['median'] / o['reused_unsplit_s']['median']:.0f}x)")
    w = result.get("switch")
    if w:
        lines.append(f"switching between two conversations of {w['prompt_tokens'][0]}-{w['prompt_tokens'][-1]} tokens: "
                     f"cold {spread(w['cold_s'], 3)}, restored from the host tier {spread(w['restored_s'], 4)}: "
                     f"{w['speedup']:.0f}x")
    d = result.get("disk")
    if d:
        lines.append(f"disk resume of {d['prompt_tokens'] - 1} tokens ({d['disk_bytes'] / 2**20:.0f} MiB): cold "
                     f"{d['cold_s']['median']:.3f}s, disk {spread(d['disk_resume_s'], 4)}: {d['speedup']:.0f}x (goal >= 50x)")
        if "page_cache_resume_s" in d:
            lines.append(f"  the same after a process restart, files still in the OS page cache: "
                         f"{d['page_cache_resume_s']['median']:.4f}s: {d['page_cache_speedup']:.0f}x")
    lines.append(f"replies and last-position logits bitwise identical cache on/off: {not result['mismatches']}"
                 + (f" (differ: {', '.join(result['mismatches'])})" if result["mismatches"] else ""))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="an existing checkpoint (default: generate one)")
    p.add_argument("--real-dims", action="store_true", help="generate a GLM-5.3-layer-size checkpoint (GPU)")
    p.add_argument("--layers", type=int, default=4, help="--real-dims: layers (default 4)")
    p.add_argument("--moe-experts", type=int, default=0,
                   help="--real-dims: MoE layers with this many routed experts (top 8, one shared; 256 is "
                        "GLM-5.3's, 19 GB of bf16 a layer) instead of dense ones (default 0: dense)")
    p.add_argument("--dense-layers", type=int, default=0,
                   help="--moe-experts: the checkpoint's first this many layers dense (with --depth they fill "
                        "GLM-5.3's first 3 positions, the MoE ones the rest; default 0)")
    p.add_argument("--vocab", type=int, default=32768, help="--real-dims: vocabulary (default 32768)")
    p.add_argument("--depth", type=int, default=None,
                   help="run the model at this many layers, the checkpoint's repeated with shared weights "
                        "(GLM-5.3 has 78; see deepen())")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--chunk", type=int, default=None, help="prefill grid C (engine default: 2048 cuda, 256 cpu)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=None, help="new tokens per turn (default 2700)")
    p.add_argument("--long", type=int, default=None, help="one-word scenario prompt length (default 19000)")
    p.add_argument("--disk-long", type=int, default=None, help="disk scenario prompt length (default: 94000 "
                   "with --real-dims, else --long)")
    p.add_argument("--disk-bytes", default="64G")
    p.add_argument("--page-cache-samples", type=int, default=1,
                   help="disk scenario: resumes from the OS page cache after each cold sample (default 1)")
    p.add_argument("--reply", type=int, default=1, help="tokens generated per request (default 1: prefill cost)")
    p.add_argument("--repeats", type=int, default=None, help="samples per one-word/disk arm (default 3)")
    p.add_argument("--turn-gap", type=float, default=0.0,
                   help="turns: seconds idle after each turn, untimed (what a store still copying in the background "
                        "may use; default 0: back to back)")
    p.add_argument("--warmup-repeats", type=int, default=1,
                   help="turns: conversations run first and discarded, cache on and off (default 1)")
    p.add_argument("--off-repeats", type=int, default=None,
                   help="turns: the first this many repeats also run cache off (default all; the rest are "
                        "checked against the first repeat's cache-off replies)")
    p.add_argument("--boundary", choices=("auto", "1", "0"), default="auto",
                   help="TF_GLM53_PREFIX_REUSE_BOUNDARY (auto: at any token where the ops are row-invariant; "
                        "1: floored to the prefill grid; the bitwise check says whether reuse was exact)")
    p.add_argument("--block", type=int, default=None, help="prefix-cache block size (engine default: 256)")
    p.add_argument("--scenarios", nargs="*", default=["turns", "one-word", "disk"],
                   choices=["turns", "one-word", "disk", "switch"])
    p.add_argument("--small", action="store_true", help="CPU smoke defaults: 300-token turns, 2k prompts, 2 repeats")
    p.add_argument("--profile", action="store_true", help="also profile a cold prefill and a reused one-word extension")
    p.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = p.parse_args()
    small = {"turn_tokens": 300, "long": 2048, "repeats": 2, "disk_long": 2048}
    full = {"turn_tokens": 2700, "long": 19000, "repeats": 3}
    for name, value in (small if args.small else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.disk_long is None:
        args.disk_long = 94000 if args.real_dims else args.long
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; run on the GPU machine or use --device cpu",
              file=sys.stderr)
        return 2
    if args.depth is not None and args.depth <= 0:
        print("error: --depth must be positive (GLM-5.3 has 78 layers)", file=sys.stderr)
        return 2
    if min(args.turns, args.turn_tokens, args.long, args.disk_long, args.repeats, args.page_cache_samples) <= 0:
        print("error: --turns, --turn-tokens, --long, --disk-long, --repeats and --page-cache-samples must be positive",
              file=sys.stderr)
        return 2
    if args.turn_gap < 0:
        print("error: --turn-gap must be >= 0 seconds", file=sys.stderr)
        return 2
    if args.moe_experts < 0 or (args.moe_experts and not args.real_dims):
        print("error: --moe-experts takes a count >= 0 and goes with --real-dims", file=sys.stderr)
        return 2
    if args.dense_layers and not (args.moe_experts and 0 < args.dense_layers < args.layers):
        print("error: --dense-layers goes with --moe-experts and must leave MoE layers after it (below --layers)",
              file=sys.stderr)
        return 2
    if args.warmup_repeats < 0:
        print("error: --warmup-repeats must be >= 0", file=sys.stderr)
        return 2
    if args.off_repeats is not None and args.off_repeats < 1:
        print("error: --off-repeats must be positive (the first repeat's cache-off replies are the reference)",
              file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="bench_prefix_cache."))
    try:
        if args.model_dir:
            model_dir = args.model_dir
        elif args.real_dims:
            model_dir = real_dims_checkpoint(work, args.layers, args.vocab, args.moe_experts, args.dense_layers)
        else:
            model_dir = tiny_checkpoint(work)
        log(f"loading the engine on {model_dir} ...")
        engine = Glm53Engine(model_dir, device=args.device, prefill_chunk=args.chunk, cache_block=args.block,
                             prefix_reuse_boundary=args.boundary)
        distinct_layers = len(engine.model.w.layers)
        if args.depth:
            log(f"running {args.depth} layers: the checkpoint's {distinct_layers} repeated (shared weights) ...")
        try:
            deepen(engine, args.depth)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rng = random.Random(1129)
        mismatches: list[str] = []
        warm = Side(engine, "warmup", {"TF_GLM53_PREFIX_CACHE": "0"})
        warm.generate(rand_tokens(rng, min(2 * engine.chunk + 3, 4096), engine.vocab_size), 2)  # discarded
        args.on_env = {}
        settings = {"model_dir": str(model_dir), "real_dims": args.real_dims, "layers": len(engine.model.w.layers),
                    "moe_experts": engine.cfg.n_routed_experts if "sparse" in engine.cfg.mlp_layer_types else 0,
                    "distinct_layers": distinct_layers,
                    "mlp_layer_types": "".join("D" if t == "dense" else "M" for t in engine.cfg.mlp_layer_types),
                    "hidden": engine.cfg.hidden_size, "compute_dtype": engine.dtype_name,
                    "kv_dtype": engine.kv_dtype, "chunk": engine.chunk, "wave": engine.wave, "ranks": 1, "dcp": False,
                    "drafting": False, "reply_tokens": args.reply, "turns": args.turns,
                    "turn_tokens": args.turn_tokens, "long": args.long, "disk_long": args.disk_long,
                    "repeats": args.repeats, "off_repeats": args.off_repeats, "warmup_repeats": args.warmup_repeats,
                    "turn_gap_s": args.turn_gap,
                    "page_cache_samples": args.page_cache_samples, "reuse_boundary": engine.reuse_boundary,
                    "cache_block": engine.cache_block,
                    "timing": "wall clock of generate(), interleaved on/off"}
        result: dict[str, Any] = {**result_header("prefix_cache", settings, device=engine.device),
                                  "mismatches": mismatches}
        if "turns" in args.scenarios:
            result["turns"] = scenario_turns(engine, args, rng, mismatches)
        if "one-word" in args.scenarios:
            result["one_word"] = scenario_one_word(engine, args, rng, mismatches)
        if "disk" in args.scenarios:
            result["disk"] = scenario_disk(engine, args, rng, mismatches, work / "disk_cache")
        if "switch" in args.scenarios:
            result["switch"] = scenario_switch(engine, args, rng, mismatches)
        if args.profile:
            result["profile"] = scenario_profile(engine, args, rng, args.out, work / "disk_profile")
        write_json(args.out, result)
        print(table(result))
        print(f"full results: {args.out}")
        return 1 if mismatches else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
