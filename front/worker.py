"""The engine behind the front: jobs queued by the HTTP side, run on one worker thread.

Two ways, chosen by what the engine offers:
- batched (an engine with `batch_engine()`, glm53 at one rank): the worker loops over the
  runtime's steps, admitting queued jobs as sequences (up to TF_GLM53_MAX_SEQS running, KV memory
  permitting) and streaming each sequence's tokens to its own client. Past TF_GLM53_MAX_WAITING
  queued jobs `submit` refuses with 429 and Retry-After.
- one at a time (several ranks, stand-in engines): `engine.generate` per job, in arrival order.
Either way a job whose client went away is cancelled: its rows are released at the next step
(batched) or the engine stops at its next decode step.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from front.errors import ApiError
from front.observe import Snapshot, Timing, cache_stats, holder, log, request_drafts, request_line


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
    generated: int = 0  # tokens the engine handed over, read by the metrics
    rid: str = "-"  # the response id, named in the log line
    timing: Timing = field(default_factory=lambda: Timing(time.perf_counter()))


def _max_waiting() -> int:
    raw = os.environ.get("TF_GLM53_MAX_WAITING", "").strip()
    n = int(raw) if raw else 64
    if n < 1:
        raise ValueError(f"TF_GLM53_MAX_WAITING={raw!r}: expected a positive integer")
    return n


class EngineWorker:
    """Runs queued jobs on the engine. Events on a job: ("tokens", list[int]), then exactly one of
    ("done", {"tokens": [...], "stats": {...}, "cancelled": bool}) or ("error", exception)."""

    def __init__(self, engine: Any, on_fatal: Callable[[BaseException], None], retry_after_s: int = 2) -> None:
        self.engine = engine
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._on_fatal = on_fatal
        self.retry_after_s = retry_after_s
        make = getattr(engine, "batch_engine", None)
        self.batch = make(max_waiting=1 << 30) if callable(make) else None  # the bound is kept here
        self.max_waiting = _max_waiting()
        self._lock = threading.Lock()
        self._queued = 0  # accepted, not yet admitted (batched)
        self._left_queue: set[int] = set()  # jobs running that the count has let go (worker thread only)
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
            return self._queued + len(self.batch.scheduler.running)
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

    def _generate(self, job: Job) -> dict[str, Any]:
        timing = job.timing
        before = Snapshot.take(self.engine)  # only this thread runs the engine: the deltas are this job's
        timing.started = time.perf_counter()
        tokens = [int(t) for t in self.engine.generate(job.prompt, job.max_tokens, job.sampling,
                                                       self._streamer(job))]
        after = Snapshot.take(self.engine)
        stats = dict(getattr(holder(self.engine), "last_stats", None) or {})
        cancelled = job.cancelled.is_set()
        log.info(request_line(job.rid, len(job.prompt), len(tokens), stats, timing,
                              request_drafts(self.engine, before, after, stats), before, after,
                              "cancelled" if cancelled else "done"))
        return {"tokens": tokens, "stats": stats, "cancelled": cancelled}

    @staticmethod
    def _streamer(job: Job) -> Callable[[list[int]], bool]:
        timing = job.timing

        def on_tokens(tokens: list[int]) -> bool:
            timing.last_token = time.perf_counter()
            if job.generated == 0:
                timing.first_token = timing.last_token
            tokens = [int(t) for t in tokens]
            job.generated += len(tokens)
            job.events.put(("tokens", tokens))
            return not job.cancelled.is_set()

        return on_tokens

    # ---- batched -----------------------------------------------------------------------------------
    def _run_batched(self) -> None:
        batch = self.batch
        active: dict[int, tuple[Job, Any]] = {}  # id(job) -> the job and its sequence (glm53.runtime.sequence)
        stepped = True
        while True:
            incoming: list[Job | None] = []
            try:
                # block for work only when nothing runs (or, never expected, a step found nothing to run)
                if batch.idle:
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
                        for _, seq in list(active.values()):
                            batch.cancel(seq)
                        return
                    self._admit(job, active)
                for job, seq in list(active.values()):
                    if job.cancelled.is_set():
                        batch.cancel(seq)  # its rows go back to the pool before the next step
                stepped = batch.step()
                self._count_admitted(active)
            except BaseException as exc:  # the engine's state is unknown: the lane must stop
                self._fail(exc, [job for job, _ in active.values()])
                return

    def _dequeue(self, job: Job) -> None:
        """The job no longer waits (admitted, or ended before): it leaves the bounded count once."""
        if id(job) not in self._left_queue:
            self._left_queue.add(id(job))
            with self._lock:
                self._queued -= 1

    def _count_admitted(self, active: dict[int, tuple[Job, Any]]) -> None:
        for job, seq in active.values():
            if seq.started == seq.started:  # not NaN: admitted once (a preempted one waits again, uncounted)
                self._dequeue(job)

    def _admit(self, job: Job, active: dict[int, tuple[Job, Any]]) -> None:
        if job.cancelled.is_set():  # the client left while waiting in the queue
            self._dequeue(job)
            self._left_queue.discard(id(job))
            job.events.put(("done", {"tokens": [], "stats": {}, "cancelled": True}))
            return

        def on_done(seq: Any) -> None:
            active.pop(id(job), None)
            self._dequeue(job)
            self._left_queue.discard(id(job))
            job.timing.started = seq.started
            self._finished(job, seq)

        try:
            seq = self.batch.submit(job.prompt, job.max_tokens, job.sampling, self._streamer(job), on_done, job.rid)
        except ValueError as exc:  # a request the engine refuses (the front's checks come first)
            self._dequeue(job)
            self._left_queue.discard(id(job))
            job.events.put(("error", exc))
            return
        if not seq.finished:
            active[id(job)] = (job, seq)

    def _finished(self, job: Job, seq: Any) -> None:
        tokens = [int(t) for t in seq.reply]
        stats = dict(seq.stats)
        cancelled = seq.finish_reason == "cancelled" or job.cancelled.is_set()
        # counters are shared by the batch: the request's share is what the runtime measured around
        # its own lookup and store (cache) and its own loop (drafts)
        none = Snapshot(None, None)
        after = Snapshot(cache_stats(self.engine), None)
        delta = stats.pop("cache_delta", None)
        before = none
        if after.cache is not None and delta is not None:
            before = Snapshot({k: v - delta.get(k, 0) for k, v in after.cache.items()}, None)
        line = request_line(job.rid, len(job.prompt), len(tokens), stats, job.timing,
                            request_drafts(self.engine, none, none, stats), before, after,
                            "cancelled" if cancelled else "done")
        log.info(f"{line} preempted={seq.preemptions}")
        job.events.put(("done", {"tokens": tokens, "stats": stats, "cancelled": cancelled}))
