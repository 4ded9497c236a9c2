"""Anthropic's Messages API (POST /v1/messages) with the official `anthropic` client against the real
front over the real engine on the tiny checkpoint (tests/scripted_model.py scripts the model's token
choice where a test needs it to think, answer or call a tool)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import pytest

from lane_fixtures import front_server, standin_for, tiny_dirs, tiny_model, write_tokenizer  # noqa: F401
from scripted_model import MODEL, OBSERVATION, scripted, tiny_lane

from glm53.serving.front.glm_markup import END_THINK, THINK

WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" \
       "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
CALL2 = "<tool_call>get_time<arg_key>zone</arg_key><arg_value>CET</arg_value></tool_call>"


@pytest.fixture(scope="module")
def lane(tiny_model: Path) -> Iterator[tuple[Any, Any, anthropic.Anthropic]]:  # noqa: F811
    with tiny_lane(tiny_model) as (server, engine):
        yield server, engine, anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


SAMPLING = ("temperature", "top_p", "top_k", "frequency_penalty")  # sent as fields the SDK no longer types


def request(body: dict[str, Any]) -> dict[str, Any]:
    out = {"model": MODEL, "max_tokens": 60, "messages": ASK, **body}
    extra = {"temperature": 0, **{k: out.pop(k) for k in SAMPLING if k in out}}
    return {**out, "extra_body": extra}


def create(sdk: anthropic.Anthropic, **body: Any) -> Any:
    return sdk.messages.create(**request(body))


def stream(sdk: anthropic.Anthropic, **body: Any) -> tuple[list[Any], Any]:
    """The raw events and the SDK's accumulated message."""
    with sdk.messages.stream(**request(body)) as s:
        events = list(s)
        return events, s.get_final_message()


def kinds(events: list[Any]) -> list[str]:
    """The raw event sequence, a block's deltas as one entry (the SDK's derived events left out)."""
    out: list[str] = []
    for e in events:
        name = e.type if e.type != "content_block_start" else f"start:{e.content_block.type}"
        if e.type == "content_block_delta":
            name = f"delta:{e.delta.type}"
        if e.type in ("text", "thinking", "input_json", "signature") or (out and out[-1] == name):
            continue
        out.append(name)
    return out


def test_text_reply_usage_and_the_event_sequence(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Sunny.") as script:
        reply = create(sdk)
        again = create(sdk)
        cached = engine.last_stats["cached_tokens"]  # the batched lane reuses through the prefix cache only
        events, final = stream(sdk)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == MODEL and reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "Sunny."
    # no thinking asked: thinking off (Anthropic's default), the prompt's block closed
    assert reply.usage.output_tokens == len(script.tok.encode("Sunny.", add_special_tokens=False).ids) + 1  # + end
    assert again.usage.cache_read_input_tokens == cached
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert kinds(events) == ["message_start", "start:text", "delta:text_delta", "content_block_stop",
                             "message_delta", "message_stop"]
    assert final.content[0].text == "Sunny." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_thinking_blocks_streaming_and_not(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    words = " one two three four five six seven eight nine ten"

    def plan(reply: str) -> str:
        return reply.split(END_THINK)[0] + END_THINK + "Done." if END_THINK in reply else THINK + words

    thinking = {"type": "enabled", "budget_tokens": 4}
    with scripted(monkeypatch, engine, plan) as script:
        reply = create(sdk, thinking=thinking)
        events, final = stream(sdk, thinking=thinking)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert len(script.tok.encode(reply.content[0].thinking, add_special_tokens=False).ids) == 4
    assert words.startswith(reply.content[0].thinking) and reply.content[1].text == "Done."
    assert kinds(events) == ["message_start", "start:thinking", "delta:thinking_delta", "content_block_stop",
                             "start:text", "delta:text_delta", "content_block_stop", "message_delta", "message_stop"]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", reply.content[0].thinking), ("text", "Done.")]
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Plain.") as script:
        off = create(sdk, thinking={"type": "disabled"})
    assert script.first == f"{THINK}{END_THINK}" and [b.type for b in off.content] == ["text"]


def test_tool_use_round_trip(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Checking.{CALL}{CALL2}", end=OBSERVATION) as script:
        reply = create(sdk, tools=[WEATHER, TIME])
        events, final = stream(sdk, tools=[WEATHER, TIME])
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["text", "tool_use", "tool_use"]
    text, weather, time_ = reply.content
    assert text.text == "Checking." and weather.id.startswith("toolu_") and weather.id != time_.id
    assert (weather.name, weather.input, time_.name, time_.input) == \
        ("get_weather", {"city": "Paris", "days": 3}, "get_time", {"zone": "CET"})
    assert kinds(events) == ["message_start", "start:text", "delta:text_delta", "content_block_stop",
                             "start:tool_use", "delta:input_json_delta", "content_block_stop",
                             "start:tool_use", "delta:input_json_delta", "content_block_stop",
                             "message_delta", "message_stop"]
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == \
        [("text", None), ("tool_use", {"city": "Paris", "days": 3}), ("tool_use", {"zone": "CET"})]
    assert final.stop_reason == "tool_use"
    # the results go back as tool_result blocks; the calls and results render as GLM's turns
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": time_.id, "content": "10:00"},
                         {"type": "tool_result", "tool_use_id": weather.id,
                          "content": [{"type": "text", "text": "no data"}], "is_error": True},
                         {"type": "text", "text": "Summarize."}]}]
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Sunny at 10.") as script:
        after = create(sdk, messages=history, tools=[WEATHER, TIME])
    assert after.content[0].text == "Sunny at 10." and after.stop_reason == "end_turn"
    prompt = script.tok.decode(script.prompts[-1], skip_special_tokens=False)
    assert (f"<|assistant|>{THINK}{END_THINK}Checking.{CALL}{CALL2}<|observation|>"
            "<tool_response>Error: no data</tool_response><tool_response>10:00</tool_response>"
            "<|user|>Summarize.<|assistant|>") in prompt


def test_tool_choice_any_tool_none_and_single_call(lane, monkeypatch) -> None:
    _, engine, sdk = lane

    def plan(reply: str) -> str:
        if "<tool_call>get_time" in reply:
            return reply.split("<tool_call>")[0] + CALL2
        if "<tool_call>" in reply:  # forced by the front: the model goes on with a call
            return reply.split("<tool_call>")[0] + CALL
        return f"{THINK}{END_THINK}No tools."

    with scripted(monkeypatch, engine, plan, end=OBSERVATION) as script:
        named = create(sdk, tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
        named_first = script.first
        script.first = None
        any_ = create(sdk, tools=[WEATHER, TIME], tool_choice={"type": "any"})
    assert named_first == f"{THINK}{END_THINK}<tool_call>get_time" and script.first == f"{THINK}{END_THINK}<tool_call>"
    assert [(b.type, b.name, b.input) for b in named.content] == [("tool_use", "get_time", {"zone": "CET"})]
    assert [(b.type, b.name) for b in any_.content] == [("tool_use", "get_weather")] and any_.stop_reason == "tool_use"
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}{CALL}{CALL2}", end=OBSERVATION):
        single = create(sdk, tools=[WEATHER, TIME], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        none = create(sdk, tools=[WEATHER, TIME], tool_choice={"type": "none"})
    assert [b.name for b in single.content] == ["get_weather"] and single.stop_reason == "tool_use"
    assert [b.type for b in none.content] == ["text"] and none.content[0].text == CALL + CALL2


def test_system_string_and_blocks_and_sampling_fields(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Yes.") as script:
        create(sdk, system="Be brief.", top_p=0.9, top_k=5, temperature=0.5)
        create(sdk, system=[{"type": "text", "text": "Be brief."},
                            {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}],
               metadata={"user_id": "u1"})
    one, two = (script.tok.decode(p, skip_special_tokens=False) for p in script.prompts[-2:])
    assert "<|system|>Be brief.<|user|>" in one and "<|system|>Be brief.<|system|>Be kind.<|user|>" in two


def test_the_unscripted_model_streams_and_max_tokens_is_the_stop_reason(lane) -> None:
    _, _, sdk = lane
    reply = create(sdk, max_tokens=5, thinking={"type": "enabled", "budget_tokens": 2})
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 5
    events, final = stream(sdk, max_tokens=5)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5 and kinds(events)[0] == "message_start"


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": ASK + [{"role": "assistant", "content": "The weather is"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": 3}, "system"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),  # honoured, up to 4 (as stop)
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stream": "yes"}, "stream"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
    ({"output_config": {"effort": "huge"}, "thinking": {"type": "adaptive"}}, "output_config.effort"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "thinking": {"type": "adaptive"}},
     "output_config.format"),  # the JSON would land in the thinking block
    ({"speed": "fast"}, "speed"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
]


@pytest.fixture(scope="module")
def checked(tiny_model: Path) -> Iterator[tuple[Any, anthropic.Anthropic]]:  # noqa: F811
    """Validation is the front's alone: a stand-in engine over the tiny checkpoint's tokenizer and template."""
    with front_server(tiny_model, standin_for(tiny_model), context=1024) as server:
        yield server, anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_fields_are_400_in_anthropic_shape(checked, change, field) -> None:
    server, sdk = checked
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert f"'{field}'" in r.json()["error"]["message"], r.json()
    with pytest.raises(anthropic.BadRequestError):  # the SDK reads the shape
        sdk.messages.create(**request(change if None not in change.values() else {"max_tokens": 0}))
    assert create(sdk, max_tokens=2).usage.output_tokens == 2  # the next request is served


def test_auth_and_route_errors_in_anthropic_shape(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    with front_server(tmp_path, standin_for(tmp_path), api_keys=("k1",)) as server:
        keyed = anthropic.Anthropic(base_url=server.url, api_key="k1", max_retries=0, timeout=30)
        reply = keyed.messages.create(model=MODEL, max_tokens=3, messages=ASK)  # x-api-key, as the SDK sends it
        assert reply.usage.output_tokens == 3 and reply.content[0].type == "text"
        with pytest.raises(anthropic.AuthenticationError) as denied:
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=3, messages=ASK)
        assert denied.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.NotFoundError) as unknown:
            keyed.messages.create(model="claude-9", max_tokens=3, messages=ASK)
        assert unknown.value.body["type"] == "error" and "claude-9" in unknown.value.body["error"]["message"]
        r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": "k1"})
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        # the OpenAI routes keep OpenAI's shape
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK}, headers={"x-api-key": "nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        server.state.draining = True
        r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": ASK},
                       headers={"x-api-key": "k1"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert r.headers["retry-after"]


def test_engine_failure_mid_stream_is_an_error_event(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    with front_server(tmp_path, standin_for(tmp_path, fail=True)) as server:
        with httpx.stream("POST", server.url + "/v1/messages", timeout=30,
                          json={"model": MODEL, "max_tokens": 3, "messages": ASK, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: error"
    assert json.loads(lines[1][6:])["error"]["type"] == "api_error"
