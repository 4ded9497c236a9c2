"""One engine, one stream: requests run one at a time on a worker thread, in arrival order.

The engine is single-stream (and on several ranks every rank must execute the same request), so
the HTTP side never calls it; it queues a Job and reads its events. A job whose client went away
is cancelled: `on_tokens` returns False and the engine stops at its next decode step.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from front.observe import Snapshot, Timing, holder, log, request_drafts, request_line


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
    stopped: threading.Event = field(default_factory=threading.Event)  # a stop string appeared (front/stop.py)
    logprobs: list[Any] = field(default_factory=list)  # the engine's records of the tokens handed over
    generated: int = 0  # tokens the engine handed over, read by the metrics
    rid: str = "-"  # the response id, named in the log line
    timing: Timing = field(default_factory=lambda: Timing(time.perf_counter()))


class EngineWorker:
    """Runs `engine.generate` for queued jobs. Events on a job: ("tokens", list[int]), then exactly
    one of ("done", {"tokens": [...], "stats": {...}}) or ("error", exception)."""

    def __init__(self, engine: Any, on_fatal: Callable[[BaseException], None]) -> None:
        self.engine = engine
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._on_fatal = on_fatal
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.busy = False
        self.failed: BaseException | None = None
        self._thread.start()

    def submit(self, job: Job) -> None:
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
        return self._jobs.qsize() + (1 if self.busy else 0)

    def stop(self) -> None:
        self._jobs.put(None)

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
                self.failed = exc
                self._on_fatal(exc)  # before the error reaches the client: /health says failed by then
                job.events.put(("error", exc))
                self._fail_queued(exc)
                return
            finally:
                self.busy = False
            job.events.put(("done", result))  # off the engine by then: the queue depth no longer counts it

    def _generate(self, job: Job) -> dict[str, Any]:
        timing = job.timing

        def on_tokens(tokens: list[int]) -> bool:
            timing.last_token = time.perf_counter()
            if job.generated == 0:
                timing.first_token = timing.last_token
            tokens = [int(t) for t in tokens]
            job.generated += len(tokens)
            records = (getattr(holder(self.engine), "last_stats", None) or {}).get("logprobs")
            if records is not None:  # the engine filled them before handing the tokens over
                job.logprobs.extend(records[len(job.logprobs):job.generated])
            job.events.put(("tokens", tokens))
            return not (job.cancelled.is_set() or job.stopped.is_set())

        before = Snapshot.take(self.engine)  # only this thread runs the engine: the deltas are this job's
        timing.started = time.perf_counter()
        tokens = [int(t) for t in self.engine.generate(job.prompt, job.max_tokens, job.sampling, on_tokens)]
        after = Snapshot.take(self.engine)
        stats = dict(getattr(holder(self.engine), "last_stats", None) or {})
        cancelled = job.cancelled.is_set()
        log.info(request_line(job.rid, len(job.prompt), len(tokens), stats, timing,
                              request_drafts(self.engine, before, after, stats), before, after,
                              "cancelled" if cancelled else "done"))
        return {"tokens": tokens, "stats": stats, "cancelled": cancelled}
