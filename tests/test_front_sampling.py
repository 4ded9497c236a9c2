"""The sampling fields people send (stop, logprobs, penalties, n, response_format, logit_bias) through
the real front over the real glm53 engine on the tiny checkpoint, with the official `openai` client:
each field streaming and not; with every field set, a drafted reply equals `"draft": false` and a
lane with its prefix cache equals one without; logprobs against the engine's logits; stop strings
never cutting a UTF-8 character; bad values answered 400 naming the field, the next request served."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from drafter.glm53_target import DraftPlan
from drafter_fixtures import one_thread  # noqa: F401  (autouse fixture)
from glm53.serving.front.chat import ChatText
from glm53.serving.front.stop import StopScanner
from glm53.runtime.engine import Glm53Engine
from glm53.settings import Settings
from lane_fixtures import front_server, tiny_dirs, tiny_model  # noqa: F401  (fixtures)

MODEL = "glm-5.3-exl3"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
EVERY_FIELD = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"300": 3.0, "77": -2.0},
               "logprobs": True, "top_logprobs": 3, "n": 2, "stop": ["zz", "\u00e9"],
               "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}
MESSAGES = [{"role": "user", "content": "hello world"}]


def glm53_sampling(request):
    from glm53.runtime.sampling import SamplingParams

    return SamplingParams.from_request(request)


def new_engine(model_dir, cache: bool) -> Glm53Engine:
    engine = Glm53Engine(model_dir, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=32, reuse_live=cache)
    engine.drafter = DraftPlan.from_contract(engine, settings=Settings())  # MTP drafts (the tiny checkpoint has it)
    if cache:
        from kv_cache.engine_adapter import attach_prefix_cache

        attach_prefix_cache(engine, settings=Settings())
    return engine


@pytest.fixture(scope="module")
def lanes(tiny_model):  # noqa: F811
    """(cache-on front, its engine, cache-off front)."""
    on, off = new_engine(tiny_model, True), new_engine(tiny_model, False)
    with front_server(tiny_model, on, sampling_factory=glm53_sampling, context=512) as a, \
            front_server(tiny_model, off, sampling_factory=glm53_sampling, context=512) as b:
        yield a, on, b


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def strip(body: dict) -> dict:
    """What must not change: all but the id, the time and the cached-token count."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "usage": usage}


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 11}])
def test_every_field_drafted_equals_serial_and_cache_on_equals_off(lanes, sampling) -> None:
    on, engine, off = lanes
    body = {"messages": MESSAGES, "max_tokens": 10, **EVERY_FIELD, **sampling}
    drafted = post(on, "/v1/chat/completions", body)
    assert engine.last_stats["drafted"]
    serial = post(on, "/v1/chat/completions", {**body, "draft": False})
    cold = post(off, "/v1/chat/completions", {**body, "draft": False})
    again = post(on, "/v1/chat/completions", body)  # the prompt is cached now
    assert engine.last_stats["cached_tokens"] > 0
    assert strip(drafted) == strip(serial) == strip(again)
    assert strip(cold) == strip(drafted)
    choices = drafted["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["logprobs"]["content"] for c in choices)
    assert drafted["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)


def test_choices_differ_and_each_is_reproduced_by_its_seed(lanes) -> None:
    on, _, _ = lanes
    from glm53.serving.front.service import derive_seed

    body = {"prompt": "the quick", "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    both = post(on, "/v1/completions", {**body, "n": 2})
    texts = [c["text"] for c in both["choices"]]
    assert texts[0] != texts[1] and both["usage"]["completion_tokens"] == 12
    assert post(on, "/v1/completions", body)["choices"][0]["text"] == texts[0]
    second = post(on, "/v1/completions", {**body, "seed": derive_seed(11, 1)})
    assert second["choices"][0]["text"] == texts[1]


def test_streaming_equals_the_whole_reply_for_every_field(lanes) -> None:
    on, _, _ = lanes
    body = {"messages": MESSAGES, "max_tokens": 14, **EVERY_FIELD, "temperature": 0.8, "seed": 5}
    whole = sdk(on).chat.completions.create(model=MODEL, **body)
    content = {0: "", 1: ""}
    tokens = {0: [], 1: []}
    finish = {}
    usage = None
    for chunk in sdk(on).chat.completions.create(model=MODEL, **body, stream=True,
                                                 stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            tokens[c.index] += [t.model_dump() for t in (c.logprobs.content if c.logprobs else [])]
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole.choices:
        assert content[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert tokens[c.index] == [t.model_dump() for t in c.logprobs.content]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_are_the_engines_log_softmax_chat_and_legacy(lanes) -> None:
    on, engine, _ = lanes
    for route in ("chat", "legacy"):
        engine.trace = []
        if route == "chat":
            reply = sdk(on).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                                    top_logprobs=4, extra_body={"draft": False, "ignore_eos": True})
            got = [(t.logprob, [a.logprob for a in t.top_logprobs]) for t in reply.choices[0].logprobs.content]
        else:
            reply = sdk(on).completions.create(model=MODEL, prompt="the quick", max_tokens=6, logprobs=4,
                                               extra_body={"draft": False, "ignore_eos": True})
            lp = reply.choices[0].logprobs
            got = [(v, sorted(top.values(), reverse=True)) for v, top in zip(lp.token_logprobs, lp.top_logprobs)]
            assert lp.text_offset[0] == 0 and "".join(lp.tokens) == reply.choices[0].text
        assert len(got) == 6 == len(engine.trace)
        for (_, row), (value, top) in zip(engine.trace, got):
            ref = torch.log_softmax(row.double(), -1)
            assert value in ref.tolist() and top == sorted(ref.topk(4).values.tolist(), reverse=True)
    engine.trace = None


def test_json_schema_output_parses_and_validates(lanes) -> None:
    on, _, _ = lanes
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=40, response_format=fmt, temperature=0.7, seed=3)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in sdk(on).chat.completions.create(**kwargs, stream=True)
                           if c.choices)
        else:
            reply = sdk(on).chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason == "stop"
            text = reply.choices[0].message.content
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    obj = sdk(on).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                          response_format={"type": "json_object"}, seed=1)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_stop_strings_cut_the_reply_streaming_or_not(lanes) -> None:
    on, _, _ = lanes
    plain = sdk(on).completions.create(model=MODEL, prompt="the quick", max_tokens=24, extra_body={"ignore_eos": True})
    text = plain.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.index(stop)]
    reply = sdk(on).completions.create(model=MODEL, prompt="the quick", max_tokens=24, stop=[stop, "\u2603\u2603"],
                                       extra_body={"ignore_eos": True})
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < plain.usage.completion_tokens
    streamed = list(sdk(on).completions.create(model=MODEL, prompt="the quick", max_tokens=24, stop=stop, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


def test_stop_scanner_never_splits_a_character_and_holds_back_prefixes(tiny_model) -> None:  # noqa: F811
    text = ChatText(tiny_model)
    ids = text.encode("ab\u20acz\U0001d11ey")  # the euro sign and the G clef span several byte tokens
    assert len(ids) > 6
    scanner = StopScanner(text, ["\U0001d11e", "zq"])
    released = []
    for t in ids:
        if scanner.push([t]):
            break
        released.append(scanner.releasable())
    assert scanner.stopped and scanner.text == "ab\u20acz"
    assert scanner.tokens_used == len(text.encode("ab\u20acz\U0001d11e"))  # through the clef's last byte
    assert "z" not in "".join(released)  # held back: it might have begun "zq"
    assert all("\ufffd" not in r for r in released) and "".join(released) + scanner.releasable() == "ab\u20acz"
    whole = StopScanner(text, ["\u20ac"])
    whole.push(ids)
    assert whole.text == "ab" and whole.tokens_used == len(text.encode("ab\u20ac"))


@pytest.mark.parametrize("body, param", [
    ({"stop": 5}, "stop"), ({"stop": ["a"] * 5}, "stop"), ({"n": 0}, "n"), ({"n": "2"}, "n"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"999999": 1}}, "logit_bias.999999"), ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"audio": {"voice": "x"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
])
def test_bad_values_are_400_naming_the_field_and_the_next_request_is_served(lanes, body, param) -> None:
    on, _, _ = lanes
    r = httpx.post(on.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(on.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("body, param", [({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
                                         ({"logprobs": 6}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs")])
def test_legacy_fields_the_front_cannot_honour_are_400(lanes, body, param) -> None:
    on, _, _ = lanes
    r = httpx.post(on.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
