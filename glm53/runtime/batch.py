"""The batched runtime: sequences admitted into one KV pool, stepped together.

`BatchEngine(engine)` serves several requests at once on a Glm53Engine's model (world 1):
`submit` queues a request as a Sequence, `step` runs one forward over the scheduler's batch and
hands each sequence its tokens, `cancel` releases a sequence's rows at once. Each reply is the one
the request gets alone from `Glm53Engine.generate`, bit for bit (tests/test_batch_exact.py).

Knobs: the engine's settings (glm53/settings.py) max_seqs, max_waiting, step_tokens and
kv_pool_bytes (TF_GLM53_MAX_SEQS, TF_GLM53_MAX_WAITING: past it `submit` raises QueueFull,
TF_GLM53_STEP_TOKENS, TF_GLM53_KV_POOL_BYTES); the options max_seqs=, max_waiting=, step_tokens= and
pool_bytes= win over them. pool_block=: positions a grant of the pool (default the prefix-cache block B).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

from drafter.target import WindowOutput
from glm53.runtime.cuda_graphs import piece_rows
from glm53.runtime.drafted import DraftedRun
from glm53.runtime.durations import Durations
from glm53.runtime.errors import SamplingError
from glm53.runtime.kv_pool import PagedPool
from glm53.runtime.options import with_options
from glm53.runtime.runner import ModelRunner
from glm53.runtime.scheduler import QueueFull, Scheduler, TooLarge, Work
from glm53.runtime.sequence import OnTokens, Sequence, Status

__all__ = ["BatchEngine", "QueueFull", "TooLarge"]

# rows a step while sequences decode, unless set (docs/decisions/step-budget.md): a piece step that replays
# graphs costs about its rows (128: the streams' gap at most 3x their step), an eager one its host work
# whatever its rows up to 256
STEP_TOKENS_GRAPHED, STEP_TOKENS_EAGER = 128, 256


STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(work: list[Work]) -> str:
    """decode: only decode or verification windows; prefill: only prompt rows; mixed: both (a
    prompt's piece beside streams, the step their gap waits for)."""
    prefill = sum(w.prefill for w in work)
    return "decode" if not prefill else "prefill" if prefill == len(work) else "mixed"


def default_pool_bytes(device: torch.device, settings: Any) -> int:
    """The KV pool's bytes when TF_GLM53_KV_POOL_BYTES is unset: on a GPU, pool_bytes_of_free over its
    free memory; 256 MiB on the CPU, where lanes serve small checkpoints (both capped by what max_seqs
    sequences of the model's longest context take). serve.sh sets the variable from its memory plan."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return pool_bytes_of_free(free, torch.cuda.get_device_properties(device).is_integrated, settings)
    return 256 << 20


def pool_bytes_of_free(free: int, unified: bool, settings: Any) -> int:
    """90% of `free` (a paged pool takes it at once; what stays free holds a step's activations and the
    captured graphs). On unified memory (a DGX Spark: the GPU allocates from the node's memory) the
    prefix cache's host tier and the memory guard's floor come out of the same memory later, so they
    are set aside first: a pool of 90% would leave the node nothing and the guard would stop the lane."""
    mib = 1 << 20
    kept = 0
    if unified:
        kept = (settings.host_cache_bytes if settings.prefix_cache else 0) + settings.mem_floor_mb * mib
    if free - kept <= 0:
        raise ValueError(f"the KV pool has no room: {free // mib} MiB free on the unified-memory GPU, of which the "
                         f"prefix cache's host tier (TF_GLM53_HOST_CACHE_BYTES) and the memory guard's floor "
                         f"(TF_GLM53_MEM_FLOOR_MB) take {kept // mib} MiB; set TF_GLM53_KV_POOL_BYTES (serve.sh sets "
                         f"it from its memory plan) or lower those two")
    return int((free - kept) * 0.9)


def _chooses_serially(w: Work) -> bool:
    """Whether a step's logits for w end in its sequence's choose (BatchEngine._take_rows' last branch):
    a prefill that completes an undrafted context, or a decode window without a draft run."""
    return w.seq.policy is not None and (not w.seq.drafted if w.prefill else w.seq.draft_run is None)


class BatchEngine:
    def __init__(self, engine: Any, *, max_seqs: int | None = None, max_waiting: int | None = None,
                 step_tokens: int | None = None, pool_bytes: int | None = None, pool_block: int | None = None,
                 lockstep: bool = False) -> None:
        if engine.plan.world != 1 and not lockstep:
            raise ValueError("over several ranks the batched runtime runs in lockstep on every rank "
                             "(glm53.dist.rank_batch.RankBatch)")
        self.engine = engine
        self.eos = frozenset(engine.eos)
        s = with_options(engine.settings, max_seqs=max_seqs, max_waiting=max_waiting, step_tokens=step_tokens,
                         kv_pool_bytes=pool_bytes)
        budget = s.kv_pool_bytes if s.kv_pool_bytes is not None else default_pool_bytes(engine.device, s)
        probe = engine.model.new_state(engine.kv_dtype)
        block = pool_block or engine.cache_block
        self.pool = PagedPool(probe, budget, page=block, max_positions=s.max_seqs * engine.cfg.max_position_embeddings,
                              new_state=engine.model.new_paged_state)
        graphs = getattr(engine, "graphs", None)
        graphed = graphs is not None and graphs.rows_safe(piece_rows(STEP_TOKENS_GRAPHED))
        step_tokens = s.step_tokens or (STEP_TOKENS_GRAPHED if graphed else STEP_TOKENS_EAGER)
        self.scheduler = Scheduler(self.pool, max_seqs=s.max_seqs, max_waiting=s.max_waiting,
                                   step_tokens=step_tokens, chunk=engine.chunk, wave=engine.wave)
        self.runner = ModelRunner(engine)
        # called with every step's work before its forward (several ranks: the ranks compare it)
        self.on_plan: Callable[[list[Work]], None] | None = None
        self.steps = 0
        self.batch_sizes: Counter[int] = Counter()  # sequences in a step -> steps
        # a step's wall time is every running stream's gap between tokens; by what it carried (step_kind)
        self.step_seconds = {kind: Durations() for kind in STEP_KINDS}
        self._arrivals = 0

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, sampling: Any = None, on_tokens: OnTokens | None = None,
               on_done: Any = None, rid: str = "-", on_admit: Any = None) -> Sequence:
        """Queue a request (the checks of Glm53Engine.generate, and its logits policy built as generate
        builds it). Raises QueueFull past the wait queue's bound and TooLarge for a request the pool
        could never hold. `on_admit(seq)` runs once, when the sequence is first admitted (its cached
        tokens known, before any of its tokens stream)."""
        prompt, ids = self.engine._check_prompt(prompt, max_tokens)
        params = self.engine._params(sampling).with_seed()
        policy = self.engine._policy(params, prompt)
        seq = Sequence(prompt, ids, max_tokens, params, self.engine.will_draft(params), on_tokens, on_done, policy,
                       on_admit, rid, number=self._arrivals)
        seq.stats = {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": 0,
                     "prefill_tokens": len(prompt), "seed": params.seed, "finish_reason": "length",
                     "drafted": seq.drafted, "preemptions": 0}
        if params.logprobs is not None:  # TokenLogprob per decided token, filled before on_tokens sees it
            seq.stats["logprobs"] = []
        if max_tokens == 0:
            self._finish(seq, "length")
            return seq
        self.scheduler.add(seq)
        self._arrivals += 1
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence now (the client left, or a stop string appeared): its rows go back to the
        pool before the next step. finish_reason "cancelled", as Glm53Engine.generate's when
        on_tokens returns False."""
        if seq.finished:
            return
        if seq.draft_run is not None:
            seq.draft_run.abort()
        self._finish(seq, "cancelled")

    @property
    def idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.waiting

    @property
    def running(self) -> int:
        """Sequences admitted and not finished."""
        return len(self.scheduler.running)

    def stats(self) -> dict[str, Any]:
        """What /metrics shows of the runtime."""
        s, p = self.scheduler, self.pool
        return {"running": len(s.running), "waiting": len(s.waiting), "preempted_total": s.preempted_total,
                "pool_positions": p.capacity, "pool_used_positions": p.used,
                "pool_used_bytes": p.used * p.position_bytes, "pool_free_bytes": p.free * p.position_bytes,
                "pool_block": p.block, "pool_used_blocks": p.used // p.block, "pool_free_blocks": p.free // p.block,
                "pool_shared_blocks": p.shared_blocks,
                "steps": self.steps, "batch_sizes": dict(self.batch_sizes),
                "step_seconds": {kind: d.snapshot() for kind, d in self.step_seconds.items()}}

    # ---- a step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> bool:
        """Admit what fits, run one forward over the scheduler's batch, hand out its tokens.
        False when there was nothing to run."""
        t0 = time.perf_counter()
        self._admit()
        work = self.scheduler.plan(self._window_of, self._make_room)
        if self.on_plan is not None:
            self.on_plan(work)
        if not work:
            return False
        taps = tuple(getattr(self.engine.drafter, "taps", ()) or ()) if any(w.seq.drafted for w in work) else ()
        outs = self.runner.forward(work, taps)
        wanted = [self._rows_read(w, o) for w, o in zip(work, outs)]
        read = iter(self.runner.logits([r for r in wanted if r is not None]))
        logits = [next(read) if rows is not None else None for rows in wanted]
        firsts = self._first_maxima(work, logits)
        self.steps += 1
        self.batch_sizes[len({id(w.seq) for w in work})] += 1
        for w, out, row_logits, first in zip(work, outs, logits, firsts):
            self._advance(w, out, row_logits, first)
        self.step_seconds[step_kind(work)].observe(time.perf_counter() - t0)
        return True

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while not self.idle:
            self.step()

    def _admit(self) -> None:
        s = self.scheduler
        while (seq := s.admissible()) is not None:
            state = self.pool.allocate(seq.context_length + 1)
            if state is None:
                return
            seq.state = state
            s.start(seq)
            if seq.started != seq.started:
                seq.started = time.perf_counter()
            seq.cached = self._reuse(seq)
            if not self.pool.ensure(state, seq.context_length + 1):  # paged: the pages past what it shares
                raise RuntimeError("the KV pool admitted a sequence it cannot hold (a bug)")
            seq.prefill_start = seq.cached
            if seq.preemptions == 0:
                seq.stats["cached_tokens"] = seq.cached
                seq.stats["prefill_tokens"] = len(seq.prompt) - seq.cached
                if seq.on_admit is not None:
                    seq.on_admit(seq)

    def _reuse(self, seq: Sequence) -> int:
        """Rows of the prompt reused into the sequence's fresh state: the whole pages of the running
        sequence whose canonical rows share the longest prefix, shared in place; then what the prefix
        cache holds past them, restored; then the rest of that running sequence's shared prefix,
        copied (its partial last page). None without a prefix cache and without `reuse_live`."""
        engine, state, prompt = self.engine, seq.state, seq.prompt
        if engine.prefix_cache is None and not engine.reuse_live:
            return 0
        source, n = self._longest_running_prefix(seq)
        if source is not None:
            seq.stats["shared_tokens"] = self.pool.share_prefix(state, source, n)
        reused = state.length
        if engine.prefix_cache is not None:
            with _CacheDelta(engine.prefix_cache, seq):
                hit = engine.prefix_cache.lookup(seq.prompt_ids, live_tokens=state.token_ids(),
                                                 live_frontier=state.frontier)
            state.truncate(hit.live_tokens)
            reused = hit.restore(lambda start, n, rows: state.import_rows(start, rows, prompt[start:start + n]),
                                 device=state.device)
            state.truncate(reused)
        if n > reused:
            state.import_rows(reused, source.export_rows(reused, n), prompt[reused:n])
            seq.stats["live_tokens"] = n - reused
            reused = n
        return reused

    def _longest_running_prefix(self, seq: Sequence) -> tuple[Any, int]:
        """The running state whose canonical prefill rows share the longest prefix with seq's
        prompt, and that length (leaving the prompt's last token to compute)."""
        best, length = None, 0
        limit = len(seq.prompt) - 1
        for other in self.scheduler.running:
            if other is seq or other.state is None:
                continue
            n = min(_common_prefix(other.state.token_ids(), seq.prompt_ids), other.state.frontier, limit)
            if n > length:
                best, length = other.state, n
        return best, length

    def _window_of(self, seq: Sequence) -> list[int] | None:
        if seq.draft_run is not None:
            window = seq.draft_run.window
            return window.tokens if window is not None else None
        return [seq.reply[-1]]

    def _make_room(self, seq: Sequence, positions: int) -> bool:
        """Grow `seq`'s rows, preempting the youngest running sequences while the pool is short."""
        while not self.pool.ensure(seq.state, positions):
            victim = self.scheduler.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        if seq.draft_run is not None:
            seq.draft_run.abort()
        self.scheduler.preempt(seq)
        seq.stats["preemptions"] = seq.preemptions

    def _rows_read(self, w: Work, out: Any) -> torch.Tensor | None:
        """The hidden rows whose logits this step reads: a decode window's (all of a drafted
        window's), a prefill's last row once the context is complete."""
        if not w.prefill:
            return out.hidden if w.seq.draft_run is not None else out.hidden[-1:]
        return out.hidden[-1:] if w.end == w.seq.context_length else None

    @staticmethod
    def _first_maxima(work: list[Work], logits: list[torch.Tensor | None]) -> list[int | None]:
        """The first maximum of each row a sequence chooses from serially where its policy takes it as
        it comes (LogitsPolicy.takes_argmax), found for all of them with one argmax and one read to the
        host, not one a sequence; None elsewhere."""
        picks = [i for i, (w, rows) in enumerate(zip(work, logits))
                 if rows is not None and _chooses_serially(w) and w.seq.policy.takes_argmax]
        firsts: list[int | None] = [None] * len(work)
        if len(picks) > 1:
            found = torch.stack([logits[i][-1] for i in picks]).argmax(dim=1).tolist()
            for i, token in zip(picks, found):
                firsts[i] = token
        return firsts

    def _advance(self, w: Work, out: Any, logits: torch.Tensor | None, first_max: int | None) -> None:
        """Hand the step's rows to their sequence. A failure of the request's own sampling (its grammar,
        glm53.runtime.errors.SamplingError) ends that sequence alone, with the error; anything else
        leaves the engine's state unknown and propagates."""
        try:
            self._take_rows(w, out, logits, first_max)
        except SamplingError as exc:
            seq = w.seq
            if seq.draft_run is not None:
                seq.draft_run.abort()
            seq.error = exc
            self._finish(seq, "error")

    def _take_rows(self, w: Work, out: Any, logits: torch.Tensor | None, first_max: int | None) -> None:
        seq = w.seq
        if w.prefill:
            if seq.drafted:
                seq.prefill_outs.append(out)
            if logits is None:
                return
            seq.status = Status.DECODE
            if seq.drafted:
                self._start_drafting(seq, logits[-1])
                return
        elif seq.draft_run is not None:
            seq.draft_run.resume((out, logits))
            if seq.draft_run.done:
                self._finish(seq, seq.finish_reason)
            return
        if self.engine.trace is not None:  # generate's serial loop records the same (tests read it)
            self.engine.trace.append((seq.context_length, logits[-1].clone()))
        if seq.take(seq.choose(logits[-1], seq.context_length, first_max), self.eos):
            self._finish(seq, seq.finish_reason)

    def _start_drafting(self, seq: Sequence, last_logits: torch.Tensor) -> None:
        outs, seq.prefill_outs = seq.prefill_outs, []
        hidden = torch.cat([o.hidden for o in outs])
        taps = {k: torch.cat([o.taps[k] for o in outs]) for k in outs[0].taps}
        prefilled = WindowOutput(start=seq.prefill_start, logits=last_logits[None].expand(hidden.shape[0], -1),
                                 hidden=hidden, taps=taps)
        seq.draft_run = DraftedRun(seq, self.engine, prefilled, self.eos)
        seq.draft_run.resume()
        if seq.draft_run.done:
            self._finish(seq, seq.finish_reason)

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        seq.finish_reason = reason or "length"
        seq.status = Status.FINISHED
        self.scheduler.remove(seq)
        state, seq.state, seq.draft_run = seq.state, None, None
        if state is not None:
            if self.engine.prefix_cache is not None and reason != "cancelled":
                # the prompt's canonical rows (decode rows lie past the frontier, never stored)
                with _CacheDelta(self.engine.prefix_cache, seq):
                    self.engine.prefix_cache.store(seq.prompt_ids, min(state.frontier, len(seq.prompt)),
                                                   state.export_rows)
            self.pool.release(state)
        now = time.perf_counter()
        seq.stats.update(finish_reason=seq.finish_reason, completion_tokens=len(seq.reply),
                         preemptions=seq.preemptions)
        if seq.first_token == seq.first_token:
            seq.stats["ttft_s"] = seq.first_token - seq.arrived
            seq.stats["decode_s"] = now - seq.first_token
        if seq.started == seq.started:
            seq.stats["queue_s"] = seq.started - seq.arrived
        self.engine.last_stats = seq.stats  # the engine's contract: the last finished request's stats
        if seq.on_done is not None:
            seq.on_done(seq)


class _CacheDelta:
    """Adds the prefix cache's counters' change over a lookup or a store to seq.stats["cache_delta"]:
    the cache is shared by every running sequence, so a request's share is measured around its own
    calls (the log line's cache_hits / cache_misses / cache_evictions)."""

    NAMES = ("hits", "misses", "evictions")

    def __init__(self, cache: Any, seq: Sequence) -> None:
        self.cache, self.seq = cache, seq

    def _read(self) -> dict[str, Any]:
        read = getattr(self.cache, "stats_dict", None)
        return read(settle=False) if callable(read) else {}

    def __enter__(self) -> None:
        self.before = self._read()

    def __exit__(self, *exc: Any) -> None:
        after, delta = self._read(), self.seq.stats.setdefault("cache_delta", {})
        for name in self.NAMES:
            delta[name] = delta.get(name, 0) + int(after.get(name, 0)) - int(self.before.get(name, 0))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
