"""Tool calling and thinking on /v1/chat/completions, with the official `openai` client against the
real front over the real engine on the tiny checkpoint (tests/scripted_model.py: where a test needs
the model to think, answer or call a tool, its token choice is scripted; everything else is real).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from lane_fixtures import front_server, standin_for, tiny_dirs, tiny_model  # noqa: F401
from scripted_model import ASK, MODEL, OBSERVATION, openai_chat, openai_tiny_lane, scripted

from glm53.serving.front.glm_markup import END_THINK, THINK

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" \
       "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
CALL2 = "<tool_call>get_time<arg_key>zone</arg_key><arg_value>CET</arg_value></tool_call>"


@pytest.fixture(scope="module")
def lane(tiny_model: Path) -> Iterator[tuple[Any, Any, openai.OpenAI]]:  # noqa: F811
    with openai_tiny_lane(tiny_model) as running:
        yield running


chat = openai_chat


def streamed(sdk: openai.OpenAI, **body: Any) -> dict[str, Any]:
    """The stream's deltas joined as a client joins them: reasoning, content, calls by index."""
    reasoning, content, calls, finish, chunks = "", "", {}, None, []
    for chunk in chat(sdk, stream=True, **body):
        chunks.append(chunk)
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": "", "type": None})
                entry["id"] = call.id or entry["id"]
                entry["type"] = call.type or entry["type"]
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return {"reasoning": reasoning, "content": content, "calls": [calls[i] for i in sorted(calls)],
            "finish": finish, "chunks": chunks}


def test_thinking_is_split_into_reasoning_content(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}Two and two.{END_THINK}It is 4."):
        reply = chat(sdk)
        stream = streamed(sdk)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "Two and two."
    assert message.content == "It is 4." and message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    assert (stream["reasoning"], stream["content"], stream["finish"]) == ("Two and two.", "It is 4.", "stop")
    # reasoning arrives as its own deltas, before the content
    kinds = [("r" if (c.choices[0].delta.model_extra or {}).get("reasoning_content") else "c")
             for c in stream["chunks"] if c.choices and (c.choices[0].delta.content or
                                                         (c.choices[0].delta.model_extra or {}).get("reasoning_content"))]
    assert kinds == sorted(kinds, key="rc".index) and set(kinds) == {"r", "c"}


@pytest.mark.parametrize("switch", [{"chat_template_kwargs": {"enable_thinking": False}},
                                    {"reasoning_effort": "none"}])
def test_thinking_off_opens_the_reply_after_a_closed_block(lane, monkeypatch, switch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Just 4.") as script:
        reply = chat(sdk, **switch)
    assert script.first == f"{THINK}{END_THINK}"  # the prompt closed the block: the model never thought
    assert reply.choices[0].message.content == "Just 4."
    assert reply.choices[0].message.model_extra.get("reasoning_content") is None


def test_reasoning_effort_reaches_the_template(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    from glm53.serving.front.chat import ChatText

    text = ChatText(engine.model_dir)
    with scripted(monkeypatch, engine, f"{THINK}ok{END_THINK}fine") as script:
        chat(sdk, reasoning_effort="minimal", max_tokens=4)
        chat(sdk, reasoning_effort="medium", max_tokens=4)
        chat(sdk, max_tokens=4)
    prompts = [text.decode(p) for p in script.prompts]
    assert "Reasoning Effort: Low" in prompts[0] and "Reasoning Effort: High" in prompts[1]
    assert "Reasoning Effort: Max" in prompts[2]


def test_thinking_budget_closes_the_block_and_the_model_answers(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    words = " one two three four five six seven eight nine ten eleven twelve"

    def plan(reply: str) -> str:  # thinks without end; answers once the block is closed
        return reply.split(END_THINK)[0] + END_THINK + "Done." if END_THINK in reply else THINK + words

    with scripted(monkeypatch, engine, plan) as script:
        reply = chat(sdk, thinking_budget=5)
        stream = streamed(sdk, thinking_budget=5)
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    tok = script.tok
    assert len(tok.encode(reasoning, add_special_tokens=False).ids) == 5 and words.startswith(reasoning)
    assert message.content == "Done." and reply.choices[0].finish_reason == "stop"
    # budget + the appended </think> + "Done." + the end token, one reply
    assert reply.usage.completion_tokens == 5 + 1 + len(tok.encode("Done.", add_special_tokens=False).ids) + 1
    assert (stream["reasoning"], stream["content"]) == (reasoning, "Done.")
    # the second burst's prompt is the first's and the reply up to the appended </think>
    first, second = script.prompts[-2:]
    assert second[:len(first)] == first and second[-1] == tok.token_to_id(END_THINK)
    assert len(second) == len(first) + 5 + 1


def test_a_zero_budget_answers_at_once(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Now.") as script:
        reply = chat(sdk, thinking_budget=0)
    assert script.first == f"{THINK}{END_THINK}"
    assert reply.choices[0].message.content == "Now."


def test_a_tool_call_is_parsed_into_tool_calls(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}I need the weather.{END_THINK}{CALL}", end=OBSERVATION):
        reply = chat(sdk, tools=[WEATHER, TIME])
        stream = streamed(sdk, tools=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # days by its schema: an integer
    assert stream["finish"] == "tool_calls" and stream["content"] == ""
    [streamed_call] = stream["calls"]
    assert streamed_call["name"] == "get_weather" and streamed_call["type"] == "function"
    assert json.loads(streamed_call["arguments"]) == {"city": "Paris", "days": 3}
    assert streamed_call["id"].startswith("call_") and streamed_call["id"] != call.id  # unique per request


def test_parallel_calls_and_parallel_tool_calls_false(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}{CALL}{CALL2}", end=OBSERVATION) as script:
        both = chat(sdk, tools=[WEATHER, TIME])
        stream = streamed(sdk, tools=[WEATHER, TIME])
        one = streamed(sdk, tools=[WEATHER, TIME], parallel_tool_calls=False, stream_options={"include_usage": True})
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    assert [(c["name"], json.loads(c["arguments"])) for c in stream["calls"]] == \
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    indexes = [tc.index for c in stream["chunks"] if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert sorted(set(indexes)) == [0, 1]
    # one call only: the reply ends at the first call's </tool_call>, finish tool_calls
    assert [c["name"] for c in one["calls"]] == ["get_weather"] and one["finish"] == "tool_calls"
    tok = script.tok
    assert one["chunks"][-1].usage.completion_tokens == \
        len(tok.encode(f"{END_THINK}{CALL}", add_special_tokens=False).ids)


def test_tool_choice_named_forces_the_call(lane, monkeypatch) -> None:
    _, engine, sdk = lane

    def plan(reply: str) -> str:  # the model would answer in text; after a forced call it writes the arguments
        if "<tool_call>get_time" in reply:
            return reply.split("<tool_call>")[0] + CALL2
        return f"{THINK}{END_THINK}No tool needed."

    with scripted(monkeypatch, engine, plan, end=OBSERVATION) as script:
        named = chat(sdk, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                     chat_template_kwargs={"enable_thinking": False})
        first = script.first
        free = chat(sdk, tools=[WEATHER, TIME], chat_template_kwargs={"enable_thinking": False})
    assert first == f"{THINK}{END_THINK}<tool_call>get_time"  # appended by the front before any choice
    [call] = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "CET"})
    assert named.choices[0].finish_reason == "tool_calls"
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content == "No tool needed."


def test_tool_choice_required_after_thinking(lane, monkeypatch) -> None:
    """Thinking on: the model thinks, the burst ends at its </think>, the front appends <tool_call>."""
    _, engine, sdk = lane

    def plan(reply: str) -> str:
        if reply.endswith("<tool_call>") or "<tool_call>get" in reply:
            return reply.split("<tool_call>")[0] + CALL
        return f"{THINK}Which tool?{END_THINK}Let me answer directly."

    with scripted(monkeypatch, engine, plan, end=OBSERVATION) as script:
        reply = chat(sdk, tools=[WEATHER, TIME], tool_choice="required")
        stream = streamed(sdk, tools=[WEATHER, TIME], tool_choice="required")
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "Which tool?"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] and message.content is None
    assert stream["reasoning"] == "Which tool?" and [c["name"] for c in stream["calls"]] == ["get_weather"]
    tok = script.tok
    assert script.prompts[-1][-2:] == [tok.token_to_id(END_THINK), tok.token_to_id("<tool_call>")]


def test_tool_choice_none_leaves_markup_as_text_and_tools_unrendered(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    from glm53.serving.front.chat import ChatText

    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}{CALL}", end=OBSERVATION) as script:
        reply = chat(sdk, tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == CALL
    assert reply.choices[0].finish_reason == "stop"
    assert "# Tools" not in ChatText(engine.model_dir).decode(script.prompts[-1])


def test_malformed_markup_ends_as_content(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    bad = "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>"  # a key without its value
    unknown = "<tool_call>launch_rockets<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>"
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}{bad} and {unknown}", end=OBSERVATION):
        reply = chat(sdk, tools=[WEATHER])
        stream = streamed(sdk, tools=[WEATHER])
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == f"{bad} and {unknown}"
    assert stream["content"] == f"{bad} and {unknown}" and stream["calls"] == []
    # and the unscripted tiny model, forced into a call it then writes as noise: content, never a 500
    noise = chat(sdk, tools=[WEATHER], tool_choice="required", max_tokens=12, temperature=1, seed=3,
                 chat_template_kwargs={"enable_thinking": False})
    assert noise.choices[0].finish_reason in ("length", "stop")
    assert noise.choices[0].message.content.startswith("<tool_call>") or noise.choices[0].message.tool_calls


def test_history_with_calls_and_results_renders_back(lane, monkeypatch) -> None:
    _, engine, sdk = lane
    from glm53.serving.front.chat import ChatText

    history = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "Both.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
                        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "10:00"},  # out of order: rendered in call order
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with scripted(monkeypatch, engine, f"{THINK}{END_THINK}Sunny, 10:00.") as script:
        reply = chat(sdk, messages=history, tools=[WEATHER, TIME])
    assert reply.choices[0].message.content == "Sunny, 10:00."
    prompt = ChatText(engine.model_dir).tokenizer.decode(script.prompts[-1], skip_special_tokens=False)
    assert (f"<|assistant|>{THINK}Both.{END_THINK}{CALL}{CALL2}<|observation|><tool_response>sunny</tool_response>"
            "<tool_response>10:00</tool_response><|assistant|><think>") in prompt


def test_unscripted_tiny_model_reply_is_reasoning(lane) -> None:
    """The stock template opens <think>: the random model's text is reasoning until it closes it."""
    _, _, sdk = lane
    reply = chat(sdk, max_tokens=6)
    message = reply.choices[0].message
    assert reply.usage.completion_tokens == 6
    assert (message.model_extra.get("reasoning_content") or "") + (message.content or "")


BAD = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
    ({"thinking_budget": -1}, "thinking_budget"),
    ({"thinking_budget": "8"}, "thinking_budget"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "user", "content": "x"}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    # the legacy tool fields would change the reply: refused, not ignored
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    # steered replies (glm53/serving/front/combos.py): what the bursts cannot keep exact
    ({"tools": [WEATHER], "tool_choice": "required", "logprobs": True}, "logprobs"),
    ({"tools": [WEATHER], "parallel_tool_calls": False, "response_format": {"type": "json_object"}},
     "response_format"),
    # a JSON reply cannot think: the grammar would hold the thinking block
    ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": True}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "reasoning_effort": "high"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "thinking_budget": 8}, "response_format"),
]


@pytest.fixture(scope="module")
def checked(tiny_model: Path) -> Iterator[tuple[Any, openai.OpenAI]]:  # noqa: F811
    """Validation is the front's alone: a stand-in engine over the tiny checkpoint's tokenizer and template."""
    with front_server(tiny_model, standin_for(tiny_model), context=1024) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_400_naming_the_field(checked, extra, param) -> None:
    server, sdk = checked
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)  # the next request is served
    assert ok.usage.completion_tokens == 2


def test_chat_fields_are_refused_on_completions(checked) -> None:
    server, _ = checked
    for name, value in (("tool_choice", "auto"), ("thinking_budget", 4), ("reasoning_effort", "low")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_a_steered_reply_is_one_job_and_cancels_like_one(tiny_model: Path) -> None:  # noqa: F811
    """Bursts stay inside one job: one request in the metrics and the queue, the second burst's prompt
    the first's plus the reply and the appended </think>; a client leaving mid-burst ends the job."""
    from glm53.serving.front.chat import ChatText
    from lane_fixtures import wait_for
    from tests.prometheus_text import parse_prometheus, value

    end_think = ChatText(tiny_model).tokenizer.token_to_id(END_THINK)
    engine = standin_for(tiny_model, delay=0.05)
    with front_server(tiny_model, engine, context=1024) as server:
        # a fixed seed: the stand-in's ids are then fixed too, none of them GLM's thinking markup
        body = {"model": MODEL, "messages": ASK, "max_tokens": 9, "thinking_budget": 3, "ignore_eos": True, "seed": 7}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 9
        first, second = engine.calls
        assert first["max_tokens"] == 3 and first["generated"] == 3 and second["max_tokens"] == 9 - 4
        assert second["prompt"] == first["prompt"] + second["prompt"][len(first["prompt"]):len(first["prompt"]) + 3] \
            + [end_think] and len(second["prompt"]) == len(first["prompt"]) + 4
        assert first["sampling"]["seed"] == second["sampling"]["seed"] == 7
        engine.calls.clear()  # without a seed the front draws one for all the bursts
        httpx.post(server.url + "/v1/chat/completions", json={**body, "seed": None, "max_tokens": 4,
                                                             "thinking_budget": 1}, timeout=30)
        seeds = [c["sampling"].get("seed") for c in engine.calls]
        assert len(seeds) == 2 and seeds[0] is not None and seeds[0] == seeds[1]
        metrics = parse_prometheus(httpx.get(server.url + "/metrics").text)
        assert value(metrics, "glm53_requests_total", route="/v1/chat/completions", status="200") == 2
        assert value(metrics, "glm53_completion_tokens_total") == 9 + 4
        engine.calls.clear()
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                          json={**body, "max_tokens": 400, "thinking_budget": 300, "stream": True}) as s:
            lines = s.iter_lines()
            next(lines)
            next(lines)  # a token arrived: the job runs; leaving now cancels it
        wait_for(lambda: "glm53_cancelled_total 1.0" in httpx.get(server.url + "/metrics").text, 30, "the cancel")
        wait_for(lambda: engine.active == 0 and server.state.service.worker.depth() == 0, 30, "the job to end")
        assert len(engine.calls) == 1 and engine.calls[0]["generated"] < 300  # no burst after the cancel
