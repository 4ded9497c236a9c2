"""glm53.runtime.logits_policy and glm53.runtime.grammar: penalties, logit_bias, the grammar mask and logprobs, one
request's state keyed by absolute position; and on the tiny engine, with every field set, drafted
replies equal serial ones and the prefix cache on equals off (tokens and logprobs), greedy and seeded."""
from __future__ import annotations

import json
import random

import pytest
import torch

from drafter.glm53_target import DraftPlan
from drafter_fixtures import OracleDrafts, one_thread  # noqa: F401  (autouse fixture)
from glm53.runtime.engine import Glm53Engine
from glm53.runtime.grammar import GrammarMatcher, grammar_for
from glm53.runtime.logits_policy import LogitsPolicy
from glm53.runtime.errors import SamplingError
from glm53.runtime.sampling import SamplingParams
from glm53.settings import Settings
from kv_cache.cache import PrefixCache
from kv_cache.keys import CacheKey
from tests.fixtures_tiny import tiny_dirs  # noqa: F401  (one tiny checkpoint for the whole test run)

CHUNK = 8
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}


def test_penalties_and_bias_follow_their_formulas() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={4: 10.0, 1: -100.0})
    policy = LogitsPolicy(params, prompt=[2], vocab_size=5)
    policy.advance(0)
    policy.advance(0)
    policy.advance(1)
    got = policy.process(row)
    # repetition on prompt + reply tokens {0, 1, 2}; then frequency x count + presence on reply {0: 2, 1: 1}
    want = torch.tensor([2.0 / 2 - (2 * 0.25 + 0.5), -1.0 * 2 - (0.25 + 0.5) - 100.0, 0.5 / 2, 3.0, 10.0])
    assert torch.equal(got, want)


def test_rewind_forgets_later_positions_and_refuses_gaps() -> None:
    params = SamplingParams(frequency_penalty=1.5, logprobs=2)
    policy = LogitsPolicy(params, prompt=[0, 0, 0], vocab_size=4)
    row = torch.tensor([0.0, 5.0, 4.0, 1.0])
    assert [policy.choose(row, p) for p in (3, 4, 5)] == [1, 2, 1]  # each choice penalizes itself
    assert policy.choose(row, 4) == 2 and policy.reply == [1, 2]  # position 4 again: 5 was dropped
    assert sorted(policy.records) == [3, 4] and policy.counts == {1: 1, 2: 1}
    with pytest.raises(RuntimeError, match="position 6"):
        policy.choose(row, 6)


def test_reply_start_counts_the_reply_the_prompt_holds() -> None:
    """A steered reply's later engine call (prompt = request prompt + reply so far) processes a row as
    one call over the whole reply would; the held part is never rolled back."""
    params = dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    whole = LogitsPolicy(SamplingParams(**params), prompt=[2], vocab_size=5)
    for t in (0, 0, 1):
        whole.advance(t)
    burst = LogitsPolicy(SamplingParams(**params, reply_start=1), prompt=[2, 0, 0, 1], vocab_size=5)
    assert torch.equal(burst.process(row), whole.process(row))
    burst.choose(row, 4)
    burst.rewind(4)
    assert burst.counts == {0: 2, 1: 1} and burst.reply == []


def test_logprobs_are_the_raw_rows_log_softmax() -> None:
    row = torch.tensor([1.0, 3.0, 2.0, 3.0])
    policy = LogitsPolicy(SamplingParams(logprobs=3, logit_bias={0: 50.0}), prompt=[1], vocab_size=4)
    assert policy.choose(row, 1) == 0  # the bias chose it ...
    rec = policy.records[1]
    lp = torch.log_softmax(row.double(), -1)
    assert rec.logprob == pytest.approx(float(lp[0]), abs=0) and rec.token == 0  # ... its logprob is the model's
    assert [t for t, _ in rec.top] == [1, 3, 2]  # ties: the lower id first


def test_grammar_masks_rolls_back_and_ends_with_eos(tiny_dirs) -> None:  # noqa: F811
    engine_vocab, eos = 2048, (2026,)
    matcher = GrammarMatcher(grammar_for(JSON_SCHEMA), tiny_dirs.model, engine_vocab, eos)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dirs.model / "tokenizer.json"))
    allowed = matcher.allowed()
    assert allowed.shape == (engine_vocab,) and 0 < int(allowed.sum()) < engine_vocab
    assert all(tok.decode([int(i)]).startswith("{") for i in allowed.nonzero().flatten()[:20])
    ids = tok.encode('{"ok":true,"n":7}', add_special_tokens=False).ids
    before = [matcher.allowed()]
    for t in ids:
        assert matcher.allowed()[t]
        matcher.accept(t)
    assert matcher.allowed().nonzero().flatten().tolist() == [2026]  # complete: only the end
    matcher.rollback(len(ids))
    assert torch.equal(matcher.allowed(), before[0])


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "response_format"),
    ("json", "response_format"),
])
def test_bad_response_formats_name_the_field(response_format, param) -> None:
    with pytest.raises(SamplingError) as err:
        SamplingParams.from_request({"response_format": response_format})
    assert err.value.param == param


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", "x"),
                                          ("repetition_penalty", 0), ("logit_bias", {"a": 1}),
                                          ("logit_bias", {"5": 101}), ("logprobs", 21),
                                          ("reply_start", -1)])
def test_bad_processing_fields_name_the_field(field, value) -> None:
    with pytest.raises(SamplingError) as err:
        SamplingParams.from_request({field: value})
    assert err.value.param == field


# ---- on the engine: exactness with every field set ------------------------------------------------
def engine(model_dir, *, cache: bool, drafter=None) -> Glm53Engine:
    key = CacheKey("tiny", "float32", "float32", 1, 0, False, CHUNK, "cpu", "test")
    return Glm53Engine(model_dir, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=CHUNK,
                       drafter=drafter, reuse_live=cache,
                       prefix_cache=PrefixCache(key, host_bytes=1 << 26) if cache else None)


EVERY_FIELD = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.3,
               "logit_bias": {"17": 4.0, "40": -3.0, "99": 2.5}, "logprobs": 3}


def requests(rng: random.Random):
    """(prompt, max_tokens, sampling) with every field set, greedy and seeded, JSON-constrained or not;
    about half extend the previous conversation (reuse composes with drafting)."""
    for i in range(4):
        fields = dict(EVERY_FIELD)
        if i % 2:
            fields.update(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30))
        if i % 4 < 2:
            fields["response_format"] = JSON_SCHEMA
        yield [rng.randrange(1900) for _ in range(rng.randint(3, 12))], rng.randint(8, 14), fields


def run(engine_, prompt, max_tokens, fields):
    engine_.trace = []
    tokens = engine_.generate(prompt, max_tokens, SamplingParams.from_request(fields))
    return tokens, list(engine_.last_stats.get("logprobs") or [])


@pytest.mark.parametrize("source", ["oracle", "mtp"])
def test_every_field_drafted_equals_serial_and_cache_on_equals_off(tiny_dirs, source) -> None:  # noqa: F811
    serial = engine(tiny_dirs.model, cache=True)
    cold = engine(tiny_dirs.model, cache=False)
    oracle = OracleDrafts(max_depth=8, corrupt=0.4, pad=7)
    drafted = engine(tiny_dirs.model, cache=True)
    drafted.drafter = oracle if source == "oracle" else DraftPlan.from_contract(drafted, settings=Settings())
    rng = random.Random(7)
    history: list[int] = []
    reused = accepted = parsed = 0
    for n, (fresh, max_tokens, fields) in enumerate(requests(rng)):
        prompt = history + fresh if n % 2 and history else fresh
        want, want_lp = run(serial, prompt, max_tokens, {**fields, "draft": False})
        oracle.truth = prompt + want
        got, got_lp = run(drafted, prompt, max_tokens, fields)
        off, off_lp = run(cold, prompt, max_tokens, {**fields, "draft": False})
        assert drafted.last_stats["drafted"] and not serial.last_stats["drafted"]
        assert got == want == off, f"request {n}: drafted {got}, serial {want}, cache off {off}"
        assert got_lp == want_lp == off_lp and [r.token for r in want_lp] == want
        # the records are the model's log_softmax of the logits serial decoding saw
        for (pos, row), rec in zip(serial.trace, want_lp):
            assert rec.position == pos and rec.logprob == float(torch.log_softmax(row.double(), -1)[rec.token])
        if "response_format" in fields and serial.last_stats["finish_reason"] == "stop":
            text = decode(tiny_dirs.model, want[:-1])
            value = json.loads(text)
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
            parsed += 1
        reused += serial.last_stats["cached_tokens"]
        accepted += (drafted.last_stats.get("draft") or {}).get("tf_glm53_draft_accepted_total", 0)
        history = prompt + want
    assert reused > 0 and parsed > 0
    if source == "oracle":
        assert accepted > 0, "no draft was accepted: the windows' rows past their first were never compared"


def decode(model_dir, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def test_penalties_change_the_reply(tiny_dirs) -> None:  # noqa: F811
    """The fields are applied, not accepted and dropped: each changes a greedy reply of the tiny model."""
    e = engine(tiny_dirs.model, cache=False)
    prompt = [5, 6, 7, 8, 9, 10]
    plain = e.generate(prompt, 12, SamplingParams())
    # the random model rarely repeats a token by itself: the penalties that favour repeats show they act
    # (their signs and sizes are test_penalties_and_bias_follow_their_formulas')
    for fields in ({"frequency_penalty": -2.0}, {"presence_penalty": -2.0}, {"repetition_penalty": 0.3},
                   {"logit_bias": {str(plain[0]): -100}}):
        assert e.generate(prompt, 12, SamplingParams.from_request(fields)) != plain, fields
    assert e.generate(prompt, 12, SamplingParams(frequency_penalty=-2.0)) == [plain[0]] * 12
    forced = e.generate(prompt, 4, SamplingParams.from_request({"logit_bias": {"42": 100}}))
    assert forced == [42, 42, 42, 42]
