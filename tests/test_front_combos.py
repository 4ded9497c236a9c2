"""The sampling fields together with tool calling and thinking (docs/API.md, "Fields together"), with
the official clients against the real front over the real engine on the tiny checkpoint; the model's
token choice is scripted where a test needs it to think or call (tests/scripted_model.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from lane_fixtures import front_server, standin_for, tiny_dirs, tiny_model  # noqa: F401
from scripted_model import ASK, MODEL, openai_chat, openai_tiny_lane, scripted

from glm53.serving.front.glm_markup import END_THINK, THINK

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


@pytest.fixture(scope="module")
def lane(tiny_model: Path) -> Iterator[tuple[Any, Any, openai.OpenAI]]:  # noqa: F811
    with openai_tiny_lane(tiny_model) as running:
        yield running


chat = openai_chat


def streamed(sdk: openai.OpenAI, **body: Any) -> dict[int, dict[str, Any]]:
    """Per choice index: the deltas joined as a client joins them, the finish reason, the logprobs."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chat(sdk, stream=True, **body):
        for choice in chunk.choices:
            entry = out.setdefault(choice.index, {"reasoning": "", "content": "", "calls": {}, "finish": None,
                                                  "logprobs": 0})
            delta = choice.delta
            entry["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            entry["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                got = entry["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                got["id"] = call.id or got["id"]
                got["name"] += (call.function.name or "") if call.function else ""
                got["arguments"] += (call.function.arguments or "") if call.function else ""
            entry["finish"] = choice.finish_reason or entry["finish"]
            entry["logprobs"] += len(choice.logprobs.content or []) if choice.logprobs else 0
    return out


def test_n_choices_each_read_by_the_markup_parser(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}Look it up.{END_THINK}{CALL}"):
        reply = chat(sdk, n=2, tools=[WEATHER], logprobs=True, top_logprobs=1)
        stream = streamed(sdk, n=2, tools=[WEATHER], logprobs=True)
    assert [c.index for c in reply.choices] == [0, 1]
    ids = set()
    for choice in reply.choices:
        message = choice.message
        assert message.model_extra["reasoning_content"] == "Look it up." and message.content is None
        (call,) = message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
        assert choice.finish_reason == "tool_calls"
        ids.add(call.id)
    assert len(ids) == 2  # call ids are unique across choices
    # logprobs still apply per choice: one entry for every token of each reply
    assert sum(len(c.logprobs.content) for c in reply.choices) == reply.usage.completion_tokens
    assert sorted(stream) == [0, 1]
    for entry in stream.values():
        assert (entry["reasoning"], entry["content"], entry["finish"]) == ("Look it up.", "", "tool_calls")
        assert [c["name"] for c in entry["calls"].values()] == ["get_weather"]
        assert entry["logprobs"] == reply.usage.completion_tokens // 2


@pytest.mark.parametrize("stop,reasoning,content", [
    (["4."], "Two and two.", "It is "),  # in the content
    (["and"], "Two ", None),  # in the thinking: the reply ends there
])
def test_stop_strings_cut_the_generated_text_then_it_is_parsed(lane, monkeypatch, stop, reasoning, content) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}Two and two.{END_THINK}It is 4. Really."):
        reply = chat(sdk, stop=stop)
        stream = streamed(sdk, stop=stop)[0]
    message = reply.choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == (reasoning, content or "")
    assert reply.choices[0].finish_reason == "stop"
    assert (stream["reasoning"], stream["content"], stream["finish"]) == (reasoning, content or "", "stop")


def test_a_stop_after_a_call_keeps_the_call(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}x{END_THINK}{CALL}Bye now"):
        reply = chat(sdk, tools=[WEATHER], stop=["now"])
        stream = streamed(sdk, tools=[WEATHER], stop=["now"])[0]
    choice = reply.choices[0]
    assert choice.message.tool_calls[0].function.name == "get_weather" and choice.message.content == "Bye "
    assert choice.finish_reason == "tool_calls"
    assert stream["content"] == "Bye " and stream["finish"] == "tool_calls"


def test_steered_reply_with_the_fields_that_hold_across_bursts(lane, monkeypatch) -> None:
    """Penalties (counted from the reply's start in every burst) and logit_bias are honoured with a budget."""
    _, engine, sdk = lane
    words = " one two three four five six"

    def plan(reply: str) -> str:
        return reply.split(END_THINK)[0] + END_THINK + "Done." if END_THINK in reply else THINK + words

    with scripted(monkeypatch, engine, plan):
        reply = chat(sdk, thinking_budget=2, repetition_penalty=1.2, logit_bias={"5": 1.0}, stop=["Do"],
                     presence_penalty=0.3, frequency_penalty=0.2)
    message = reply.choices[0].message
    assert words.startswith(message.model_extra["reasoning_content"]) and message.content == ""
    assert reply.choices[0].finish_reason == "stop"


def test_every_burst_counts_the_reply_from_its_start(tiny_model: Path) -> None:  # noqa: F811
    """The sampling of each burst carries reply_start = the request prompt's length, so a later burst's
    penalties count the reply its prompt holds (glm53/runtime/logits_policy.py)."""
    engine = standin_for(tiny_model)
    with front_server(tiny_model, engine, context=1024) as server:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 6, "thinking_budget": 2, "ignore_eos": True,
                "seed": 3, "presence_penalty": 0.5, "frequency_penalty": 0.5}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        first, second = engine.calls
        assert first["sampling"]["reply_start"] == second["sampling"]["reply_start"] == len(first["prompt"])
        assert len(second["prompt"]) == len(first["prompt"]) + 3  # two thinking tokens and the appended </think>
        engine.calls.clear()
        httpx.post(server.url + "/v1/chat/completions", json={**body, "thinking_budget": None}, timeout=30)
        assert "reply_start" not in engine.calls[0]["sampling"]  # one engine call: nothing held


@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}])
def test_response_format_turns_thinking_off(lane, monkeypatch, fmt) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f'{THINK}{END_THINK}{{"a":1}}') as script:
        reply = chat(sdk, response_format=fmt)
        chat(sdk, response_format=fmt, reasoning_effort="none")  # asks for no thinking: served alike
    assert script.first == f"{THINK}{END_THINK}"  # the prompt closed the block before the model's first token
    assert reply.choices[0].message.content == '{"a":1}'
    assert reply.choices[0].message.model_extra.get("reasoning_content") is None


def test_stop_sequences_on_messages(lane, monkeypatch) -> None:
    server, engine, _ = lane
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    ask = {"model": MODEL, "max_tokens": 40, "messages": ASK, "stop_sequences": ["world", "nope"]}
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Hello world, bye."):
        reply = sdk.messages.create(**ask)
        with sdk.messages.stream(**ask) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert [b.text for b in reply.content] == ["Hello "]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "world")
    assert text == "Hello " and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "world")
    assert reply.usage.output_tokens == final.usage.output_tokens > 0


def test_output_config_format_on_messages(lane, monkeypatch) -> None:
    server, engine, _ = lane
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with scripted(monkeypatch, engine, f'{THINK}{END_THINK}{{"a":1}}') as script:
        reply = sdk.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert script.first == f"{THINK}{END_THINK}"
    assert [b.text for b in reply.content] == ['{"a":1}'] and reply.stop_reason == "end_turn"


def test_trim_tail_cuts_across_text_events_and_stops_at_a_call() -> None:
    from glm53.serving.front.chat_stop import trim_tail
    from glm53.serving.front.glm_markup import ContentDelta, ReasoningDelta, ToolCallEnd

    events = [ReasoningDelta("ab"), ContentDelta("cd")]
    assert trim_tail(events, 3) == [ReasoningDelta("a")]
    assert trim_tail(events, 2) == [ReasoningDelta("ab")]
    assert trim_tail(events, 0) == events
    assert trim_tail([ToolCallEnd(0), ContentDelta("x")], 5) == [ToolCallEnd(0)]
