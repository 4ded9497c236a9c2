"""The engine behind the front: jobs queued by the HTTP side, run on one worker thread.

Two ways, chosen by what the engine offers:
- batched (an engine with `batch_engine()`: glm53 at one rank or several): the worker loops over the
  runtime's steps, admitting queued jobs as sequences (up to TF_GLM53_MAX_SEQS running, KV memory
  permitting) and streaming each sequence's tokens to its own client. Past TF_GLM53_MAX_WAITING
  queued jobs `submit` refuses with 429 and Retry-After.
- one at a time (the grid-boundary mode, stand-in engines): `engine.generate` per job, in arrival order.
Either way a job that is over (its client went away, or a stop string appeared: `Job.over`) stops
at the engine's next step; batched, its rows are released before the next step.

A steered job (glm53/serving/front/steer.py: a thinking budget, a forced tool call, one call only) runs as several
engine calls, bursts, inside the one job, each burst's prompt the job's prompt and the reply so far
(`_bursts`): one at a time, each burst is an `engine.generate`; batched, each burst is a sequence,
the next submitted when the previous one finishes. The queue, cancellation, drain and metrics see
one request.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from glm53.serving.front.errors import ApiError
from glm53.serving.front.observe import Snapshot, Timing, cache_stats, holder, log, request_drafts, request_line
from glm53.serving.front.settings import DEFAULT_MAX_WAITING
from glm53.serving.front.steer import Steer

# one burst of a steered reply: (prompt, cap, on_tokens) out, (the burst's tokens, its stats) back
Burst = tuple[list[int], int, Callable[[list[int]], bool]]
Bursts = Generator[Burst, tuple[list[int], dict[str, Any]], tuple[list[int], dict[str, Any]]]


class EventSink(Protocol):
    """Where a job's events go; `put` is called on the worker's thread."""

    def put(self, item: tuple[str, Any]) -> None: ...


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: Any
    events: EventSink = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stopped: threading.Event = field(default_factory=threading.Event)  # a stop string appeared (glm53/serving/front/stop.py)
    logprobs: list[Any] = field(default_factory=list)  # the engine's records of the tokens handed over
    generated: int = 0  # tokens the engine handed over, read by the metrics
    rid: str = "-"  # the response id, named in the log line
    timing: Timing = field(default_factory=lambda: Timing(time.perf_counter()))
    steer: Steer | None = None  # None: one engine call, nothing appended

    def over(self) -> bool:
        """The client left or a stop string appeared: the engine stops at its next step."""
        return self.cancelled.is_set() or self.stopped.is_set()


class _Stream:
    """A job's events while it runs: "started" once (before any tokens; ids appended by the steering
    before it are held until then), then its tokens, with the engine's logprobs records."""

    def __init__(self, job: Job, records: Callable[[], list[Any] | None]) -> None:
        self.job, self.records = job, records
        self.started = False
        self.held: list[int] = []

    def start(self, stats: dict[str, Any]) -> None:
        if not self.started:
            self.started = True
            self.job.events.put(("started", {"prompt_tokens": len(self.job.prompt),
                                             "cached_tokens": int(stats.get("cached_tokens", 0) or 0)}))
            if self.held:
                self.job.events.put(("tokens", list(self.held)))

    def on_tokens(self, tokens: list[int], stats: dict[str, Any]) -> bool:
        job, timing = self.job, self.job.timing
        timing.last_token = time.perf_counter()
        if job.generated == 0:
            timing.first_token = timing.last_token
        tokens = [int(t) for t in tokens]
        job.generated += len(tokens)
        records = self.records()
        if records is not None:  # the engine filled them before handing the tokens over (never steered)
            job.logprobs.extend(records[len(job.logprobs):job.generated])
        self.start(stats)
        job.events.put(("tokens", tokens))
        return not job.over()

    def appended(self, ids: list[int]) -> None:
        if self.started:
            self.job.events.put(("tokens", ids))
        else:
            self.held.extend(ids)


def _bursts(job: Job, steer: Steer, on_tokens: Callable[[list[int]], bool],
            appended: Callable[[list[int]], None]) -> Bursts:
    """A steered reply (glm53/serving/front/steer.py) as the bursts it needs: yields each burst's (prompt, cap,
    on_tokens) and is sent the burst's tokens and stats; returns (reply, stats). Stats: the first
    burst's (its prompt and cached tokens are the request's), prefill summed over the bursts,
    `bursts` counted. The one rule of both ways the worker runs jobs."""
    reply: list[int] = []
    stats: dict[str, Any] = {}
    bursts = 0
    while len(reply) < job.max_tokens and not job.over() and not steer.finished:
        due = steer.due()[:job.max_tokens - len(reply)]
        if due:
            steer.push(due)
            reply += due
            appended(due)
            continue
        cap = steer.cap(job.max_tokens - len(reply))
        if cap <= 0:
            break
        kept = 0
        cut = False

        def take(batch: list[int]) -> bool:
            nonlocal kept, cut
            ids, cut = steer.take([int(t) for t in batch])
            kept += len(ids)
            go = on_tokens(ids) if ids else not job.over()
            return go and not cut

        burst, last = yield job.prompt + reply, cap, take
        burst = [int(t) for t in burst]
        bursts += 1
        if bursts == 1:
            stats = {**last, "prompt_tokens": len(job.prompt)}
        else:
            stats["prefill_tokens"] = stats.get("prefill_tokens", 0) + last.get("prefill_tokens", 0)
            delta, more = stats.get("cache_delta"), last.get("cache_delta")
            if delta is not None and more is not None:  # batched: each burst's share of the cache counters
                stats["cache_delta"] = {k: delta.get(k, 0) + more.get(k, 0) for k in {*delta, *more}}
        if cut:
            reply += burst[:kept]
            continue
        steer.push(burst[kept:])  # what on_tokens did not see: the model's end
        reply += burst
        if steer.ended(burst, cap):
            break
    stats.update(bursts=bursts, completion_tokens=len(reply))
    return reply, stats


@dataclass(eq=False)
class _Running:
    """A job in the batched runtime: its current sequence, and for a steered job its bursts."""

    job: Job
    stream: _Stream
    seq: Any = None  # glm53.runtime.sequence.Sequence of the running burst
    bursts: Bursts | None = None
    first: Any = None  # the job's first sequence (its admission and preemptions)
    preemptions: int = 0


class EngineWorker:
    """Runs queued jobs on the engine. Events on a job: ("started", {"prompt_tokens",
    "cached_tokens"}) once the engine has the prompt (batched: the sequence is admitted; before any
    tokens; at the end when no token came out), ("tokens", list[int]) for each batch of the reply,
    then exactly one of ("done", {"tokens": [...], "stats": {...}, "cancelled": bool, "steer_ended":
    bool}) or ("error", exception). `steer_ended`: the steering ended the reply (one call only), not
    the model, a stop string or max_tokens."""

    def __init__(self, engine: Any, on_fatal: Callable[[BaseException], None], retry_after_s: int = 2,
                 max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        self.engine = engine
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._on_fatal = on_fatal
        self.retry_after_s = retry_after_s
        make = getattr(engine, "batch_engine", None)
        self.batch = make(max_waiting=1 << 30) if callable(make) else None  # the bound is kept here
        self.max_waiting = max_waiting  # FrontSettings.max_waiting: TF_GLM53_MAX_WAITING
        self._lock = threading.Lock()
        self._queued = 0  # accepted, not yet admitted (batched)
        self._left_queue: set[int] = set()  # jobs running that the count has let go (worker thread only)
        self._active: dict[int, _Running] = {}  # id(job) -> the job in the runtime (batched; worker thread)
        self._next_bursts: list[tuple[_Running, Any]] = []  # steered jobs whose burst finished in a step
        self.busy = False
        self.failed: BaseException | None = None
        run = self._run_batched if self.batch is not None else self._run
        self._thread = threading.Thread(target=run, name="engine-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self.batch is not None and self.failed is None:
            pool = self.batch.pool
            if pool.blocks(len(job.prompt) + job.max_tokens) > pool.capacity:  # could never be admitted
                raise ApiError(400, f"the prompt ({len(job.prompt)} tokens) and max_tokens ({job.max_tokens}) exceed "
                               f"the KV pool ({pool.capacity} positions, TF_GLM53_KV_POOL_BYTES)", "max_tokens",
                               "context_length_exceeded")
            with self._lock:
                if self._queued >= self.max_waiting:
                    raise ApiError(429, f"{self._queued} requests are waiting for the engine already; retry later",
                                   code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
                self._queued += 1
        self._jobs.put(job)
        if self.failed is not None:  # no thread runs jobs any more: answer every one left
            self._fail_queued(self.failed)

    def _fail_queued(self, exc: BaseException) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.events.put(("error", exc))

    def depth(self) -> int:
        """Jobs waiting or running."""
        if self.batch is not None:
            return self._queued + self.batch.running
        return self._jobs.qsize() + (1 if self.busy else 0)

    def runtime_stats(self) -> dict[str, Any] | None:
        """The batched runtime's gauges and counters (/metrics); None when jobs run one at a time."""
        if self.batch is None:
            return None
        stats = self.batch.stats()
        stats["waiting"] = self._queued
        return stats

    def stop(self) -> None:
        self._jobs.put(None)

    # ---- one at a time -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():  # the client left while waiting in the queue
                job.events.put(("done", {"tokens": [], "stats": {}, "cancelled": True}))
                continue
            self.busy = True
            try:
                result = self._generate(job)
            except BaseException as exc:  # the engine's state is unknown: the lane must stop
                self._fail(exc, [job])
                return
            finally:
                self.busy = False
            job.events.put(("done", result))  # off the engine by then: the queue depth no longer counts it

    def _fail(self, exc: BaseException, jobs: list[Job]) -> None:
        self.failed = exc
        self._on_fatal(exc)  # before the error reaches the clients: /health says failed by then
        for job in jobs:
            job.events.put(("error", exc))
        self._fail_queued(exc)

    def _last_stats(self) -> dict[str, Any]:
        return getattr(holder(self.engine), "last_stats", None) or {}

    def _generate(self, job: Job) -> dict[str, Any]:
        timing = job.timing
        stream = _Stream(job, lambda: self._last_stats().get("logprobs"))

        def on_tokens(tokens: list[int]) -> bool:
            return stream.on_tokens(tokens, self._last_stats())

        before = Snapshot.take(self.engine)  # only this thread runs the engine: the deltas are this job's
        timing.started = time.perf_counter()
        if job.steer is None:
            tokens = [int(t) for t in self.engine.generate(job.prompt, job.max_tokens, job.sampling, on_tokens)]
            stats = dict(self._last_stats())
        else:
            bursts = _bursts(job, job.steer, on_tokens, stream.appended)
            try:
                prompt, cap, take = next(bursts)
                while True:
                    burst = [int(t) for t in self.engine.generate(prompt, cap, job.sampling, take)]
                    prompt, cap, take = bursts.send((burst, dict(self._last_stats())))
            except StopIteration as end:
                tokens, stats = end.value
        stream.start(stats)
        after = Snapshot.take(self.engine)
        cancelled = job.cancelled.is_set()
        log.info(request_line(job.rid, len(job.prompt), len(tokens), stats, timing,
                              request_drafts(self.engine, before, after, stats), before, after,
                              "cancelled" if cancelled else "done"))
        return {"tokens": tokens, "stats": stats, "cancelled": cancelled,
                "steer_ended": bool(job.steer and job.steer.finished)}

    # ---- batched -----------------------------------------------------------------------------------
    def _run_batched(self) -> None:
        batch = self.batch
        active = self._active
        stepped = True
        while True:
            incoming: list[Job | None] = []
            try:
                # block for work only when nothing runs (or, never expected, a step found nothing to run)
                if batch.idle and not self._next_bursts:
                    incoming.append(self._jobs.get())
                elif not stepped:
                    incoming.append(self._jobs.get(timeout=0.05))
                while True:
                    incoming.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            try:
                for job in incoming:
                    if job is None:
                        for run in list(active.values()):
                            if run.seq is not None:
                                batch.cancel(run.seq)
                        return
                    self._admit(job, active)
                self._continue_bursts(active)
                for run in list(active.values()):
                    if run.job.over() and run.seq is not None:
                        batch.cancel(run.seq)  # its rows go back to the pool before the next step
                self._continue_bursts(active)
                stepped = batch.step()
                self._count_admitted(active)
                self._continue_bursts(active)
            except BaseException as exc:  # the engine's state is unknown: the lane must stop
                self._fail(exc, [run.job for run in active.values()])
                return

    def _dequeue(self, job: Job) -> None:
        """The job no longer waits (admitted, or ended before): it leaves the bounded count once."""
        if id(job) not in self._left_queue:
            self._left_queue.add(id(job))
            with self._lock:
                self._queued -= 1

    def _count_admitted(self, active: dict[int, _Running]) -> None:
        for run in active.values():
            first = run.first
            if first is not None and first.started == first.started:  # not NaN: admitted once
                self._dequeue(run.job)

    def _admit(self, job: Job, active: dict[int, _Running]) -> None:
        if job.cancelled.is_set():  # the client left while waiting in the queue
            self._retire(job)
            job.events.put(("done", {"tokens": [], "stats": {}, "cancelled": True}))
            return
        run = _Running(job, _Stream(job, lambda: None))
        active[id(job)] = run
        if job.steer is None:
            run.stream.records = lambda: run.seq.stats.get("logprobs") if run.seq is not None else None
            self._submit(run, active, job.prompt, job.max_tokens,
                         lambda tokens: run.stream.on_tokens(tokens, run.seq.stats), self._finished_single)
            return

        def on_tokens(tokens: list[int]) -> bool:
            return run.stream.on_tokens(tokens, run.first.stats if run.first is not None else {})

        run.bursts = _bursts(job, job.steer, on_tokens, run.stream.appended)
        self._step_bursts(run, active, None)

    def _submit(self, run: _Running, active: dict[int, _Running], prompt: list[int], max_tokens: int,
                on_tokens: Callable[[list[int]], bool], finished: Callable[[_Running, Any], None]) -> None:
        job = run.job

        def on_admit(seq: Any) -> None:
            if run.first is seq:
                job.timing.started = seq.started
                run.stream.start(seq.stats)

        def on_done(seq: Any) -> None:
            run.preemptions += seq.preemptions
            finished(run, seq)

        try:
            seq = self.batch.submit(prompt, max_tokens, job.sampling, on_tokens, on_done, job.rid, on_admit)
        except ValueError as exc:  # a request the engine refuses (the front's checks come first)
            self._retire(job)
            job.events.put(("error", exc))
            return
        run.seq = seq
        if run.first is None:
            run.first = seq

    def _finished_single(self, run: _Running, seq: Any) -> None:
        if seq.error is not None:
            self._failed_alone(run, seq.error)
            return
        self._done(run, [int(t) for t in seq.reply], dict(seq.stats))

    def _finished_burst(self, run: _Running, seq: Any) -> None:
        """A steered job's burst finished inside a step: its next burst is submitted after the step."""
        run.seq = None
        if seq.error is not None:
            self._failed_alone(run, seq.error)
            return
        self._next_bursts.append((run, seq))

    def _failed_alone(self, run: _Running, exc: BaseException) -> None:
        """The request failed on its own (its grammar): it gets the error; the lane and the others go on."""
        job = run.job
        self._retire(job)
        log.warning(f"request {job.rid} failed alone: {type(exc).__name__}: {exc}")
        job.events.put(("error", exc))

    def _continue_bursts(self, active: dict[int, _Running]) -> None:
        while self._next_bursts:
            run, seq = self._next_bursts.pop(0)
            self._step_bursts(run, active, ([int(t) for t in seq.reply], dict(seq.stats)))

    def _step_bursts(self, run: _Running, active: dict[int, _Running],
                     result: tuple[list[int], dict[str, Any]] | None) -> None:
        assert run.bursts is not None
        try:
            prompt, cap, take = next(run.bursts) if result is None else run.bursts.send(result)
        except StopIteration as end:
            tokens, stats = end.value
            self._done(run, tokens, stats)
            return
        self._submit(run, active, prompt, cap, take, self._finished_burst)

    def _done(self, run: _Running, tokens: list[int], stats: dict[str, Any]) -> None:
        job = run.job
        self._retire(job)
        run.stream.start(stats)
        cancelled = job.cancelled.is_set()
        # counters are shared by the batch: the request's share is what the runtime measured around
        # its own lookup and store (cache) and its own loop (drafts)
        none = Snapshot(None, None)
        after = Snapshot(cache_stats(self.engine), None)
        delta = stats.pop("cache_delta", None)
        before = none
        if after.cache is not None and delta is not None:
            before = Snapshot({k: v - delta.get(k, 0) for k, v in after.cache.items()}, None)
        stats["preemptions"] = run.preemptions
        line = request_line(job.rid, len(job.prompt), len(tokens), stats, job.timing,
                            request_drafts(self.engine, none, none, stats), before, after,
                            "cancelled" if cancelled else "done")
        log.info(f"{line} preempted={run.preemptions}")
        job.events.put(("done", {"tokens": tokens, "stats": stats, "cancelled": cancelled,
                                 "steer_ended": bool(job.steer and job.steer.finished)}))

    def _retire(self, job: Job) -> None:
        """The job is over (done, failed alone, refused or cancelled while waiting): off the running
        jobs and the wait queue's count, its bookkeeping forgotten."""
        self._active.pop(id(job), None)
        self._dequeue(job)
        self._left_queue.discard(id(job))
