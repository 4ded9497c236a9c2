"""The batched runtime (glm53/runtime): several requests over one KV pool, each reply the bits it
gets alone. The bar: random arrival schedules of 200+ requests over mixed lengths (shared
prefixes, cancellations, preemptions; greedy and seeded sampling; drafted and serial requests;
penalties, logit_bias, a json_schema grammar and logprobs) against each request run alone through
Glm53Engine.generate, tokens and logprobs records, with the prefix cache on and off."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from drafter.glm53_target import DraftPlan
from glm53.runtime.engine import Glm53Engine
from glm53.runtime import BatchEngine, QueueFull, TooLarge
from glm53.runtime.sequence import Status
from glm53.settings import Settings
from kv_cache.engine_adapter import attach_prefix_cache
from tests.drafter_fixtures import one_thread  # noqa: F401
from tests.fixtures_tiny import TINY_CHUNK, tiny_dirs  # noqa: F401


@pytest.fixture(scope="module")
def engine(tiny_dirs):  # noqa: F811
    """Its own engine (the shared tiny_engine keeps no drafter): MTP drafts, no prefix cache."""
    e = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                    cache_block=TINY_CHUNK)
    e.drafter = DraftPlan.from_contract(e, settings=Settings())
    assert e.drafter.kind == "mtp"
    return e


def alone(engine: Glm53Engine, prompt: list[int], max_tokens: int, sampling: dict) -> list[int]:
    """The request on its own: a fresh conversation, nothing reused."""
    return alone_with_records(engine, prompt, max_tokens, sampling)[0]


def alone_with_records(engine: Glm53Engine, prompt: list[int], max_tokens: int, sampling: dict
                       ) -> tuple[list[int], list]:
    """The request on its own, and its logprobs records (empty when it asks for none)."""
    saved = engine.prefix_cache, engine.reuse_live
    engine.prefix_cache, engine.reuse_live, engine.state = None, False, None
    try:
        tokens = engine.generate(prompt, max_tokens, dict(sampling))
        return tokens, list(engine.last_stats.get("logprobs") or [])
    finally:
        engine.prefix_cache, engine.reuse_live = saved


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}


def processing_fields(rng: random.Random) -> dict:
    """Some of penalties, logit_bias, a json_schema response_format and logprobs (each request's
    LogitsPolicy, glm53/runtime/logits_policy.py)."""
    fields: dict = {}
    if rng.random() < 0.5:
        fields.update(presence_penalty=0.7, frequency_penalty=0.4)
    if rng.random() < 0.3:
        fields["repetition_penalty"] = 1.3
    if rng.random() < 0.4:
        fields["logit_bias"] = {str(rng.randrange(1900)): rng.choice((4.0, -3.0, 2.5)) for _ in range(3)}
    if rng.random() < 0.5:
        fields["logprobs"] = rng.choice((0, 3))
    if rng.random() < 0.3:
        fields["response_format"] = JSON_SCHEMA
    return fields or {"logprobs": 2}


def positions_bytes(engine: Glm53Engine, n: int) -> int:
    return n * engine.model.new_state(engine.kv_dtype).bytes_per_position()


# ---- the model's batched forward ------------------------------------------------------------------
def test_forward_batch_rows_equal_each_sequence_alone(engine) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(n)] for n in (5, 40, 1, 17)]
    with torch.inference_mode():
        want = []
        for p in prompts:
            s = engine.model.new_state(engine.kv_dtype)
            want.append(engine.model.forward(s, p, 0).hidden)
        states = [engine.model.new_state(engine.kv_dtype) for _ in prompts]
        got = engine.model.forward_batch(list(zip(states, prompts)))
        # a second step: decode rows of two sequences next to a prefill piece of another
        more = [[7], [9, 11, 13], [2]]
        step2 = engine.model.forward_batch(list(zip(states[:3], more)))
        for s, p, m in zip(states[:3], prompts, more):
            assert s.tokens == p + m
    for w, g in zip(want, got):
        assert torch.equal(w, g.hidden)
    for p, m, g in zip(prompts, more, step2):
        s = engine.model.new_state(engine.kv_dtype)
        with torch.inference_mode():
            whole = engine.model.forward(s, p + m, 0).hidden
        assert torch.equal(whole[len(p):], g.hidden)


def test_forward_batch_takes_a_states_pieces_only_adjacent(engine) -> None:
    s, t = engine.model.new_state(engine.kv_dtype), engine.model.new_state(engine.kv_dtype)
    with pytest.raises(ValueError, match="adjacent"):
        engine.model.forward_batch([(s, [1]), (t, [3]), (s, [2])])
    with torch.inference_mode():
        pieces = engine.model.forward_batch([(s, [1, 2, 3]), (s, [4, 5]), (t, [6])])
        whole = engine.model.forward(engine.model.new_state(engine.kv_dtype), [1, 2, 3, 4, 5], 0).hidden
    assert s.tokens == [1, 2, 3, 4, 5] and torch.equal(torch.cat([pieces[0].hidden, pieces[1].hidden]), whole)


# ---- pool, queue, admission ---------------------------------------------------------------------
def test_wait_queue_is_bounded_and_too_large_is_refused(engine) -> None:
    batch = BatchEngine(engine, max_seqs=1, max_waiting=2, pool_bytes=positions_bytes(engine, 256))
    batch.submit([1, 2, 3], 4)
    batch.submit([1, 2, 3], 4)
    with pytest.raises(QueueFull):
        batch.submit([1, 2, 3], 4)
    with pytest.raises(TooLarge):
        BatchEngine(engine, pool_bytes=positions_bytes(engine, 64)).submit(list(range(1, 60)), 10)
    batch.run()
    assert batch.pool.used == 0 and batch.idle


def test_long_prompt_does_not_freeze_decoding_streams(engine) -> None:
    """A prompt of 4 pieces arrives while two sequences decode: each step still gives both a token."""
    batch = BatchEngine(engine, max_seqs=4, step_tokens=TINY_CHUNK, pool_bytes=positions_bytes(engine, 1024))
    streams = [batch.submit([5 + i, 6, 7], 10, {"draft": False, "ignore_eos": True}) for i in range(2)]
    while any(s.status is not Status.DECODE for s in streams):
        batch.step()
    long = batch.submit(list(range(1, 4 * TINY_CHUNK)), 2, {"draft": False})
    while long.status is not Status.DECODE and not long.finished:
        before = [len(s.reply) for s in streams]
        batch.step()
        assert [len(s.reply) for s in streams] == [n + 1 for n in before]
    batch.run()
    assert long.reply == alone(engine, long.prompt, 2, {"draft": False})
    # /metrics' glm53_step_seconds: every step timed once, by what it carried; the pieces beside the
    # streams are the mixed steps their gaps waited for
    counts = {kind: snap["count"] for kind, snap in batch.stats()["step_seconds"].items()}
    assert sum(counts.values()) == batch.steps
    assert counts["prefill"] >= 1 and counts["decode"] >= 1 and counts["mixed"] >= 4


def test_greedy_choices_of_a_step_come_from_one_argmax_and_equal_alone(engine, monkeypatch) -> None:
    """Greedy sequences with nothing processing their logits take their tokens from one argmax over
    the step's rows (the first maximum, as sample's); a penalised or sampled one still samples its
    own row. Every reply equals its request alone."""
    import glm53.runtime.logits_policy as logits_policy

    sampled: list[bool] = []
    real = logits_policy.sample
    monkeypatch.setattr(logits_policy, "sample", lambda row, params, pos: sampled.append(params.greedy) or
                        real(row, params, pos))
    batch = BatchEngine(engine, max_seqs=4, pool_bytes=positions_bytes(engine, 1024))
    plain = {"draft": False, "ignore_eos": True}
    asks = [plain, plain, {**plain, "presence_penalty": 0.5}, {**plain, "temperature": 0.8, "seed": 3}]
    seqs = [batch.submit([9 + i, 4, 4, 7], 12, ask) for i, ask in enumerate(asks)]
    batch.run()
    assert sampled.count(False) == 12 and sampled.count(True) == 12, "only the penalised and sampled rows sample"
    monkeypatch.setattr(logits_policy, "sample", real)
    for seq, ask in zip(seqs, asks):
        assert seq.reply == alone(engine, seq.prompt, 12, ask)


def test_cancel_releases_rows_at_once(engine) -> None:
    batch = BatchEngine(engine, max_seqs=2, pool_bytes=positions_bytes(engine, 512))
    a = batch.submit(list(range(1, 50)), 12)
    b = batch.submit(list(range(3, 20)), 12, {"temperature": 0.7, "seed": 5})
    for _ in range(3):
        batch.step()
    used = batch.pool.used
    batch.cancel(a)
    assert a.finish_reason == "cancelled" and batch.pool.used < used
    batch.run()
    assert batch.pool.used == 0
    assert b.reply == alone(engine, b.prompt, 12, {"temperature": 0.7, "seed": 5})


def test_youngest_is_preempted_and_resumes_exactly(engine) -> None:
    """Two sequences outgrow a pool of 96 positions: the younger is preempted (its rows
    released), recomputed when room comes back, and both replies are the ones they get alone."""
    batch = BatchEngine(engine, max_seqs=2, pool_bytes=positions_bytes(engine, 3 * TINY_CHUNK))
    old = batch.submit(list(range(1, 21)), 36, {"ignore_eos": True})
    young = batch.submit(list(range(40, 60)), 36, {"temperature": 1.0, "seed": 11, "ignore_eos": True})
    batch.run()
    assert young.preemptions >= 1 and old.preemptions == 0
    assert old.reply == alone(engine, old.prompt, 36, {"ignore_eos": True})
    assert young.reply == alone(engine, young.prompt, 36, {"temperature": 1.0, "seed": 11, "ignore_eos": True})


# ---- the bar: random arrival schedules ---------------------------------------------------------
@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    sampling: dict
    arrival: int  # step at which it is submitted
    cancel_after: int | None = None  # the client leaves after this many streamed tokens
    cancel_at_step: int | None = None  # cancelled by the server side (queued, prefilling or decoding)
    streamed: list[int] = field(default_factory=list)


def schedule(seed: int, n: int, vocab: int) -> list[Req]:
    rng = random.Random(seed)
    fields_rng = random.Random(seed + 1)  # its own stream: the schedule's shape is the seed's
    shared = [[rng.randrange(vocab) for _ in range(rng.randint(20, 45))] for _ in range(4)]
    reqs, step = [], 0
    for i in range(n):
        step += rng.choice((0, 0, 0, 0, 1, 1))  # bursts: several requests arrive in one step
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        prompt = rng.choice(shared)[: rng.randint(8, 45)] + tail if rng.random() < 0.35 else tail
        sampling: dict = {"draft": rng.random() < 0.5}
        if rng.random() < 0.5:
            sampling.update(temperature=rng.choice((0.7, 1.0)), seed=rng.randrange(1 << 30), top_p=0.95)
        long = rng.random() < 0.15  # longer replies: running sequences outgrow the pool
        if long:
            sampling["ignore_eos"] = True
        if fields_rng.random() < 0.2:  # penalties, logit_bias, a grammar, logprobs
            sampling.update(processing_fields(fields_rng))
            if "response_format" in sampling:  # the grammar ends the reply with an eos
                sampling.pop("ignore_eos", None)
        r = Req(prompt, rng.randint(8, 14) if long else rng.randint(1, 5), sampling, step)
        kind = rng.random()
        if kind < 0.08:
            r.cancel_after = rng.randint(1, 3)
        elif kind < 0.12:
            r.cancel_at_step = step + rng.randint(0, 4)
        reqs.append(r)
    return reqs


@pytest.fixture(scope="module")
def requests_alone(engine) -> tuple[list[Req], list[tuple[list[int], list]]]:
    reqs = schedule(2026, 200, engine.vocab_size)
    return reqs, [alone_with_records(engine, r.prompt, r.max_tokens, r.sampling) for r in reqs]


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-reuse", "cache-and-live"])
def test_random_schedule_replies_equal_alone(engine, requests_alone, prefix_cache: bool) -> None:
    """no-reuse: no prefix cache, no rows copied from running sequences; cache-and-live: the
    prefix cache, and rows copied from running sequences that share a prefix."""
    reqs, want = requests_alone
    engine.reuse_live = prefix_cache
    if prefix_cache:
        attach_prefix_cache(engine, revision="tiny-batch", settings=Settings())
    try:
        # 256 positions in grants of 4 for up to 16 sequences: running sequences outgrow it and the
        # youngest are preempted
        batch = BatchEngine(engine, max_seqs=16, max_waiting=len(reqs), step_tokens=96,
                            pool_bytes=positions_bytes(engine, 256), pool_block=4)
        seqs: list = [None] * len(reqs)
        step, nxt = 0, 0
        while nxt < len(reqs) or not batch.idle:
            while nxt < len(reqs) and reqs[nxt].arrival <= step:
                r = reqs[nxt]

                def on_tokens(tokens: list[int], r: Req = r) -> bool:
                    r.streamed.extend(tokens)
                    return r.cancel_after is None or len(r.streamed) < r.cancel_after

                r.streamed = []
                seqs[nxt] = batch.submit(r.prompt, r.max_tokens, r.sampling, on_tokens=on_tokens)
                nxt += 1
            for r, s in zip(reqs[:nxt], seqs):
                if r.cancel_at_step == step:
                    batch.cancel(s)
            batch.step()
            step += 1
        assert batch.pool.used == 0
        cancelled = preempted = drafted = cached = live = processed = 0
        for r, s, (w, w_lp) in zip(reqs, seqs, want):
            lp = s.stats.get("logprobs") or []
            if s.finish_reason == "cancelled":
                cancelled += 1
                assert s.reply == w[: len(s.reply)], (r, s.reply, w)
                assert lp == w_lp[: len(lp)] and len(lp) == (len(s.reply) if w_lp else 0), r
            else:
                assert s.reply == w, (r, s.reply, w)
                assert lp == w_lp, r
            preempted += s.preemptions > 0
            processed += s.params.processes_logits or s.params.logprobs is not None
            drafted += s.drafted and len(s.reply) > 1
            cached += s.stats["cached_tokens"] > 0
            live += s.stats.get("live_tokens", 0) > 0
        assert cancelled >= 10 and preempted >= 5 and drafted >= 30 and processed >= 30
        assert (cached >= 20 and live >= 1) if prefix_cache else cached == 0, (cached, live)
        assert max(batch.batch_sizes) >= 8  # many requests a step
    finally:
        engine.reuse_live = True
        if prefix_cache:
            engine.prefix_cache.close()
            engine.prefix_cache = None


def test_a_lone_prompt_prefills_in_waves_and_streams_hold_it_to_a_piece(engine) -> None:
    """With nothing decoding, a prompt takes a wave of pieces a step (the experts read once for
    several pieces, as generate's prefill does); the reply is still the one it gets alone."""
    batch = BatchEngine(engine, step_tokens=TINY_CHUNK, pool_bytes=positions_bytes(engine, 1024))
    seq = batch.submit(list(range(1, 4 * TINY_CHUNK + 3)), 2, {"draft": False})
    batch.step()
    assert seq.state.length == engine.wave  # 4 pieces in the first step
    batch.run()
    assert seq.reply == alone(engine, seq.prompt, 2, {"draft": False})


def test_a_new_sequence_shares_the_pages_of_the_prefix_a_running_one_prefilled(engine) -> None:
    """B arrives while A decodes and shares A's first 40 prompt tokens (pages of 32): B takes A's
    first page in place (its count raised, no copy), copies the 8 rows of the partial page and
    prefills the rest (no prefix cache attached); both replies are as alone, and the page goes
    back to the store only when both have finished."""
    shared = [(11 * i) % engine.vocab_size for i in range(40)]
    batch = BatchEngine(engine, pool_bytes=positions_bytes(engine, 512), pool_block=32)
    store = batch.pool.store
    a = batch.submit(shared + [1, 2, 3], 6, {"draft": False})
    batch.step()
    assert a.status is Status.DECODE
    b = batch.submit(shared + [4, 5], 6, {"temperature": 0.8, "seed": 3})
    batch.step()
    first = a.state.table[0]
    assert b.state.table[0] == first and store.refs[first] == 2 and b.state.table[1] != a.state.table[1]
    batch.run()
    assert b.stats["cached_tokens"] == 40 and b.stats["shared_tokens"] == 32 and b.stats["live_tokens"] == 8
    assert store.refs[first] == 0 and batch.pool.used == 0
    assert a.reply == alone(engine, a.prompt, 6, {"draft": False})
    assert b.reply == alone(engine, b.prompt, 6, {"temperature": 0.8, "seed": 3})


def test_processing_fields_batched_and_preempted_equal_alone(engine) -> None:
    """Penalties, logit_bias, a json_schema grammar and logprobs on every request, drafted (MTP) and
    serial, greedy and seeded, longer replies in a pool that preempts: tokens and logprobs records
    equal the request alone, each record published before its token streams; one request stops
    mid-reply as a stop string stops it (on_tokens returning False)."""
    rng = random.Random(36)
    reqs = []
    for i in range(12):
        fields = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logprobs": 3,
                  "logit_bias": {str(rng.randrange(1900)): 4.0, str(rng.randrange(1900)): -3.0},
                  "draft": i % 3 != 0}
        if i % 2:
            fields.update(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30))
        if i % 4 < 2:
            fields["response_format"] = JSON_SCHEMA
        if i % 5 == 4:
            fields["repetition_penalty"] = 1.3
        reqs.append(([rng.randrange(1900) for _ in range(rng.randint(3, 30))], rng.randint(10, 16), fields))
    want = [alone_with_records(engine, p, n, f) for p, n, f in reqs]
    batch = BatchEngine(engine, max_seqs=12, step_tokens=64, pool_bytes=positions_bytes(engine, 160), pool_block=4)
    seqs: list = []
    streamed: list[list[int]] = [[] for _ in reqs]
    stop_at = 3  # request 1 stops after its third streamed token

    def stream(i: int):
        def on_tokens(tokens: list[int]) -> bool:
            streamed[i].extend(tokens)
            records = seqs[i].stats["logprobs"]
            assert len(records) >= len(seqs[i].reply)  # published before the tokens go out
            return not (i == 1 and len(streamed[i]) >= stop_at)
        return on_tokens

    for i, (p, n, f) in enumerate(reqs):
        seqs.append(batch.submit(p, n, f, on_tokens=stream(i)))
        if i % 4 == 3:
            batch.step()
    batch.run()
    assert batch.pool.used == 0
    for i, (s, (w, w_lp)) in enumerate(zip(seqs, want)):
        lp = s.stats["logprobs"]
        assert [r.token for r in lp] == s.reply
        if i == 1:
            assert s.finish_reason == "cancelled" and s.reply == w[: len(s.reply)] and lp == w_lp[: len(lp)]
        else:
            assert s.reply == w and lp == w_lp, (i, s.reply, w)
    assert sum(s.preemptions > 0 for s in seqs) >= 2
    assert sum(s.drafted and len(s.reply) > 1 for s in seqs) >= 4


@pytest.mark.parametrize("drafted", [False, True], ids=["serial", "drafted"])
def test_a_requests_failing_grammar_ends_it_alone(engine, monkeypatch, drafted: bool) -> None:
    """A request whose grammar matcher fails mid-reply (llguidance's own error, which no input here can
    provoke: a matcher that fails at its fourth token stands in) ends alone with that error and its rows
    released; the requests beside it, serial and drafted, finish with the replies they get alone."""
    from glm53.runtime import engine as engine_module
    from glm53.runtime.grammar import GrammarError, GrammarMatcher

    class FailingMatcher(GrammarMatcher):
        def accept(self, token: int) -> None:
            if len(self._kept) == 3:
                raise GrammarError("grammar matcher failed: the fourth token")
            super().accept(token)

    others = [(list(range(5, 30)), 12, {"draft": True}), (list(range(7, 19)), 12, {"temperature": 0.8, "seed": 3})]
    want = [alone(engine, p, n, f) for p, n, f in others]
    monkeypatch.setattr(engine_module, "GrammarMatcher", FailingMatcher)
    batch = BatchEngine(engine, max_seqs=3, pool_bytes=positions_bytes(engine, 512))
    first = batch.submit(*others[0])
    bad = batch.submit(list(range(40, 60)), 12, {"response_format": JSON_SCHEMA, "draft": drafted})
    last = batch.submit(*others[1])
    batch.run()
    assert bad.finish_reason == "error" and isinstance(bad.error, GrammarError), (bad.finish_reason, bad.error)
    assert len(bad.reply) <= 4
    assert [first.reply, last.reply] == want
    assert first.finish_reason in ("stop", "length") and last.finish_reason in ("stop", "length")
    assert batch.pool.used == 0 and batch.idle
