"""The front's worker over the batched runtime: concurrent jobs each get the reply they get alone,
a job whose client leaves releases its rows, a full wait queue answers 429 with Retry-After, and
/metrics shows the runtime's families."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from glm53.serving.front.errors import ApiError
from glm53.serving.front.metrics import Metrics
from glm53.serving.front.worker import EngineWorker, Job
from glm53.runtime.engine import Glm53Engine
from glm53.settings import Settings
from tests.drafter_fixtures import one_thread  # noqa: F401
from tests.fixtures_tiny import TINY_CHUNK, tiny_dirs  # noqa: F401


@pytest.fixture(scope="module")
def engine(tiny_dirs):  # noqa: F811
    return Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                       cache_block=TINY_CHUNK)


def alone(engine: Glm53Engine, prompt: list[int], n: int, sampling: dict | None) -> list[int]:
    engine.state = None
    return engine.generate(prompt, n, sampling)


def result(job: Job, timeout: float = 300, started: bool = False) -> tuple[list[int], dict]:
    """Streamed tokens and the done event's payload; "started" comes once, before any token
    (`started`: the caller read it already)."""
    streamed, deadline = [], time.monotonic() + timeout
    while True:
        kind, value = job.events.get(timeout=max(0.1, deadline - time.monotonic()))
        if kind == "started":
            assert not started and not streamed
            started = True
        elif kind == "tokens":
            assert started
            streamed += value
        elif kind == "error":
            raise value
        else:
            assert started
            return streamed, value


def test_concurrent_jobs_stream_their_own_replies(engine) -> None:
    fatal: list[BaseException] = []
    worker = EngineWorker(engine, fatal.append)
    assert worker.batch is not None
    reqs = [([3 + i, 9, 27, 81 % (i + 2)], 6, {"temperature": 0.9, "seed": i} if i % 2 else None) for i in range(6)]
    try:
        jobs = [Job(p, n, s) for p, n, s in reqs]
        for job in jobs:
            worker.submit(job)
        outs = [result(job) for job in jobs]
        for (p, n, s), (streamed, done) in zip(reqs, outs):
            want = alone(engine, p, n, s)
            assert done["tokens"] == want and not done["cancelled"]
            assert streamed == [t for t in want if t not in engine.eos]  # eos ends the reply unstreamed
        stats = worker.runtime_stats()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["pool_used_bytes"] == 0
        assert max(stats["batch_sizes"]) >= 2  # they ran together
        text = Metrics(worker.depth, worker.runtime_stats).render()
        for family in ("glm53_running_sequences 0.0", "glm53_waiting_sequences 0.0", "glm53_preempted_total",
                       'glm53_batch_size_bucket{le="+Inf"}', "glm53_kv_pool_free_bytes",
                       'glm53_step_seconds_bucket{kind="decode",le="+Inf"}'):
            assert family in text
    finally:
        worker.stop()
    assert not fatal


def test_cancelled_job_stops_and_frees_rows(engine) -> None:
    worker = EngineWorker(engine, lambda exc: None)
    try:
        job = Job(list(range(1, 40)), 200, {"ignore_eos": True, "draft": False})
        worker.submit(job)
        assert job.events.get(timeout=300)[0] == "started"
        kind, _ = job.events.get(timeout=300)
        assert kind == "tokens"
        job.cancelled.set()
        streamed, done = result(job, started=True)
        assert done["cancelled"] and len(done["tokens"]) < 200
        assert worker.runtime_stats()["pool_used_bytes"] == 0
    finally:
        worker.stop()


def test_full_wait_queue_answers_429(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = Settings.from_env({"TF_GLM53_MAX_WAITING": "2"}).max_waiting  # as glm53.serving.rank passes it on
    worker = EngineWorker(engine, lambda exc: None, retry_after_s=7, max_waiting=waiting)
    gate = threading.Event()
    step = worker.batch.step
    monkeypatch.setattr(worker.batch, "step", lambda: gate.wait(300) and step())
    try:
        jobs = [Job([5, 6, 7], 2, None), Job([8, 9], 2, None)]
        for job in jobs:
            worker.submit(job)
        with pytest.raises(ApiError) as refused:
            worker.submit(Job([1, 2], 2, None))
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "7"
        gate.set()
        for job in jobs:
            assert result(job)[1]["tokens"] == alone(engine, job.prompt, 2, None)
        worker.submit(Job([1, 2], 2, None, events=queue.Queue()))  # room again
        with pytest.raises(ApiError) as too_large:  # could never be admitted: 400, not a wait
            worker.submit(Job([1, 2], worker.batch.pool.capacity, None))
        assert too_large.value.status == 400 and too_large.value.code == "context_length_exceeded"
    finally:
        gate.set()
        worker.stop()


class _OneAtATime:
    """The engine without its batched runtime: the worker runs each job through generate."""

    def __init__(self, engine: Glm53Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        if name == "batch_engine":
            raise AttributeError(name)
        return getattr(self._engine, name)


def test_steered_and_stopped_jobs_match_the_one_at_a_time_worker(engine) -> None:
    """A steered job (a thinking budget: `</think>` appended after 3 tokens, then a second burst) runs
    as a chain of sequences and gets the one-at-a-time worker's reply, bursts and stream; a job
    stopped after its second token (a stop string: Job.stopped) stops at the next step."""
    from glm53.serving.front.chat import ChatText
    from glm53.serving.front.steer import Steer

    tok = ChatText(engine.model_dir).tokenizer
    sampling = {"temperature": 0.9, "seed": 11, "ignore_eos": True}

    def jobs() -> list[Job]:
        steered = Job([3, 9, 27, 81, 5], 9, dict(sampling),
                      steer=Steer(tok, thinking_started=True, budget=3, eos=engine.eos, ignore_eos=True))
        return [steered, Job([4, 8, 15, 16, 23, 42], 7, dict(sampling)), Job([2, 7, 1, 8], 30, dict(sampling))]

    outs = {}
    for name, eng in (("batched", engine), ("alone", _OneAtATime(engine))):
        worker = EngineWorker(eng, lambda exc: None)
        assert (worker.batch is not None) == (name == "batched")
        try:
            js = jobs()
            for job in js:
                worker.submit(job)
            stopper = js[2]
            kind, _ = stopper.events.get(timeout=300)
            assert kind == "started"
            seen = []
            while len(seen) < 2:
                kind, value = stopper.events.get(timeout=300)
                assert kind == "tokens"
                seen += value
            stopper.stopped.set()
            rest, done = result(stopper, started=True)
            stopped = (seen + rest, done)
            outs[name] = [result(j) for j in js[:2]] + [stopped]
        finally:
            worker.stop()
    (b_steer, b_plain, b_stop), (a_steer, a_plain, a_stop) = outs["batched"], outs["alone"]
    assert b_steer[1]["tokens"] == a_steer[1]["tokens"] and b_steer[0] == a_steer[0]
    assert b_steer[1]["stats"]["bursts"] == a_steer[1]["stats"]["bursts"] == 2
    assert tok.token_to_id("</think>") in b_steer[1]["tokens"]
    assert b_plain[1]["tokens"] == a_plain[1]["tokens"] == alone(engine, [4, 8, 15, 16, 23, 42], 7, sampling)
    for streamed, done in (b_stop, a_stop):
        assert not done["cancelled"] and done["stats"]["finish_reason"] == "cancelled"
        assert len(done["tokens"]) < 30 and streamed == done["tokens"]
    assert b_stop[1]["tokens"][:2] == a_stop[1]["tokens"][:2]


def test_a_job_whose_grammar_fails_gets_its_error_and_the_lane_serves_on(engine, monkeypatch) -> None:
    """One job's grammar matcher fails mid-reply (llguidance's own error, provoked by no input here: a
    matcher that fails at its fourth token stands in): that job gets the error, the jobs beside it and
    one submitted after it get their replies alone, and the lane is not failed."""
    from glm53.runtime import engine as engine_module
    from glm53.runtime.grammar import GrammarError, GrammarMatcher

    class FailingMatcher(GrammarMatcher):
        def accept(self, token: int) -> None:
            if len(self._kept) == 3:
                raise GrammarError("grammar matcher failed: the fourth token")
            super().accept(token)

    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}}
    good = [([5, 9, 27, 4], 6, None), ([3, 8, 1], 6, {"temperature": 0.9, "seed": 2})]
    want = [alone(engine, p, n, s) for p, n, s in good]
    monkeypatch.setattr(engine_module, "GrammarMatcher", FailingMatcher)
    fatal: list[BaseException] = []
    worker = EngineWorker(engine, fatal.append)
    try:
        jobs = [Job(*good[0]), Job([7, 7, 2], 12, {"response_format": schema}), Job(*good[1])]
        for job in jobs:
            worker.submit(job)
        with pytest.raises(GrammarError, match="the fourth token"):
            result(jobs[1])
        assert [result(jobs[0])[1]["tokens"], result(jobs[2])[1]["tokens"]] == want
        after = Job(*good[0])
        worker.submit(after)
        assert result(after)[1]["tokens"] == want[0]
        assert worker.runtime_stats()["pool_used_bytes"] == 0
    finally:
        worker.stop()
    assert not fatal and worker.failed is None
