"""One engine, one stream: requests run one at a time on a worker thread, in arrival order.

The engine is single-stream (and on several ranks every rank must execute the same request), so
the HTTP side never calls it; it queues a Job and reads its events. A job whose client went away
is cancelled: `on_tokens` returns False and the engine stops at its next decode step. A steered job
(front/steer.py: a thinking budget, a forced tool call, one call only) runs as several engine calls,
bursts, inside the one job: the queue, cancellation, drain and metrics see one request.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from front.observe import Snapshot, Timing, holder, log, request_drafts, request_line
from front.steer import Steer


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
    steer: Steer | None = None  # None: one engine call, nothing appended

    def over(self) -> bool:
        """The client left or a stop string appeared: the engine stops at its next step."""
        return self.cancelled.is_set() or self.stopped.is_set()


class EngineWorker:
    """Runs `engine.generate` for queued jobs. Events on a job: ("started", {"prompt_tokens",
    "cached_tokens"}) once the engine has the prompt (before any tokens; at the end when no token came
    out), ("tokens", list[int]) for each batch of the reply, then exactly one of ("done", {"tokens":
    [...], "stats": {...}, "cancelled": bool, "steer_ended": bool}) or ("error", exception). `steer_ended`: the
    steering ended the reply (one call only), not the model, a stop string or max_tokens."""

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
        started = False
        held: list[int] = []  # appended ids before the engine's first token: sent after "started"

        def start(stats: dict[str, Any] | None = None) -> None:
            nonlocal started
            if not started:
                started = True
                stats = stats if stats is not None else getattr(holder(self.engine), "last_stats", None) or {}
                job.events.put(("started", {"prompt_tokens": len(job.prompt),
                                            "cached_tokens": int(stats.get("cached_tokens", 0) or 0)}))
                if held:
                    job.events.put(("tokens", list(held)))

        def on_tokens(tokens: list[int]) -> bool:
            timing.last_token = time.perf_counter()
            if job.generated == 0:
                timing.first_token = timing.last_token
            tokens = [int(t) for t in tokens]
            job.generated += len(tokens)
            records = (getattr(holder(self.engine), "last_stats", None) or {}).get("logprobs")
            if records is not None:  # the engine filled them before handing the tokens over (never steered)
                job.logprobs.extend(records[len(job.logprobs):job.generated])
            start()
            job.events.put(("tokens", tokens))
            return not job.over()

        def appended(ids: list[int]) -> None:
            if started:
                job.events.put(("tokens", ids))
            else:
                held.extend(ids)

        before = Snapshot.take(self.engine)  # only this thread runs the engine: the deltas are this job's
        timing.started = time.perf_counter()
        if job.steer is None:
            tokens = [int(t) for t in self.engine.generate(job.prompt, job.max_tokens, job.sampling, on_tokens)]
            stats = dict(getattr(holder(self.engine), "last_stats", None) or {})
        else:
            tokens, stats = self._steered(job, job.steer, on_tokens, appended)
        start(stats)
        after = Snapshot.take(self.engine)
        cancelled = job.cancelled.is_set()
        log.info(request_line(job.rid, len(job.prompt), len(tokens), stats, timing,
                              request_drafts(self.engine, before, after, stats), before, after,
                              "cancelled" if cancelled else "done"))
        return {"tokens": tokens, "stats": stats, "cancelled": cancelled,
                "steer_ended": bool(job.steer and job.steer.finished)}

    def _steered(self, job: Job, steer: Steer, on_tokens: Callable[[list[int]], bool],
                 appended: Callable[[list[int]], None]) -> tuple[list[int], dict[str, Any]]:
        """The reply in bursts (front/steer.py). Stats: the first burst's (its prompt and cached
        tokens are the request's), prefill summed over the bursts, `bursts` counted."""
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

            burst = [int(t) for t in self.engine.generate(job.prompt + reply, cap, job.sampling, take)]
            bursts += 1
            last = dict(getattr(holder(self.engine), "last_stats", None) or {})
            if bursts == 1:
                stats = {**last, "prompt_tokens": len(job.prompt)}
            else:
                stats["prefill_tokens"] = stats.get("prefill_tokens", 0) + last.get("prefill_tokens", 0)
            if cut:
                reply += burst[:kept]
                continue
            steer.push(burst[kept:])  # what on_tokens did not see: the model's end
            reply += burst
            if steer.ended(burst, cap):
                break
        stats.update(bursts=bursts, completion_tokens=len(reply))
        return reply, stats
