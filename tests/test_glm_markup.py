"""glm53/serving/front/glm_markup.py on the tiny checkpoint's tokenizer and chat template: rendering GLM-5.3's markup,
parsing replies (streamed at every split = parsed whole), malformed markup as text, request errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm53.serving.front.chat import ChatText
from glm53.serving.front.glm_markup import (ContentDelta, MarkupError, ReasoningDelta, Reply, ReplyParser, Steering,
                              ToolCallArguments, ToolCallBegin, ToolCallEnd, close_thinking, forced_call_ids,
                              openai_delta, parse_reply, plan_tools, render_messages, thinking_controls,
                              thinking_open)
from glm53.synthetic.tiny_tokenizer import special_id, write_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "where": {"type": "object"}, "hours": {"type": "array"}, "scale": {"type": "number"},
        "note": {"type": ["string", "null"]}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = plan_tools([WEATHER, CLOCK]).schemas


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatText:
    d: Path = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return ChatText(d)


def ids(chat: ChatText, text: str) -> list[int]:
    return chat.encode(text)


def streamed(chat: ChatText, reply: list[int], cuts: list[int], thinking: bool, tools=TOOLS) -> Reply:
    parser = ReplyParser(chat.tokenizer, thinking, tools, "call_r1")
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(reply)]):
        events += parser.push(reply[a:b])
    events += parser.finish()
    assert not any("\ufffd" in getattr(e, "text", "") for e in events)  # never half a character
    return Reply.of(events)


def check_every_split(chat: ChatText, reply: list[int], thinking: bool, tools=TOOLS) -> Reply:
    whole = parse_reply(chat.tokenizer, reply, thinking, tools, "call_r1")
    for k in range(len(reply) + 1):
        assert streamed(chat, reply, [k], thinking, tools) == whole, k
    assert streamed(chat, reply, list(range(1, len(reply))), thinking, tools) == whole  # one token at a time
    return whole


def test_thinking_content_and_typed_tool_calls_stream_like_the_whole(chat) -> None:
    text = ("Let me think: Grüße 😀 first.</think>Checking the weather.\n"
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value> Berlin, DE </arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
            "<arg_key>where</arg_key><arg_value>{\"lat\": 52.5, \"tags\": [\"ü\"]}</arg_value>"
            "<arg_key>hours</arg_key><arg_value>[1, 2]</arg_value><arg_key>scale</arg_key><arg_value>1.5</arg_value>"
            "<arg_key>note</arg_key><arg_value>null</arg_value>"
            "<arg_key>extra</arg_key><arg_value>{\"a\": 1}</arg_value>"
            "</tool_call>\n<tool_call>now</tool_call><|observation|>")
    reply = check_every_split(chat, ids(chat, text), thinking=True)
    assert reply.reasoning_content == "Let me think: Grüße 😀 first."
    assert reply.content == "Checking the weather."  # the newline before the call is a separator
    assert [(c.id, c.name) for c in reply.tool_calls] == [("call_r1_0", "get_weather"), ("call_r1_1", "now")]
    assert json.loads(reply.tool_calls[0].arguments) == {
        "city": " Berlin, DE ", "days": 3, "metric": True, "where": {"lat": 52.5, "tags": ["ü"]},
        "hours": [1, 2], "scale": 1.5, "note": None, "extra": {"a": 1}}
    assert reply.tool_calls[1].arguments == "{}"
    assert reply.finish_reason("stop") == "tool_calls" and reply.finish_reason("length") == "length"
    assert reply.message()["tool_calls"][1] == {"id": "call_r1_1", "type": "function",
                                                "function": {"name": "now", "arguments": "{}"}}


def test_the_streamed_events_and_their_openai_deltas(chat) -> None:
    parser = ReplyParser(chat.tokenizer, True, TOOLS, "c")
    events = parser.push(ids(chat, "hm</think>ok<tool_call>now</tool_call>")) + parser.finish()
    assert events == [ReasoningDelta("hm"), ContentDelta("ok"), ToolCallBegin(0, "c_0", "now"),
                      ToolCallArguments(0, "{}"), ToolCallEnd(0)]
    assert [openai_delta(e) for e in events] == [
        {"reasoning_content": "hm"}, {"content": "ok"},
        {"tool_calls": [{"index": 0, "id": "c_0", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, None]


def test_glm45_layout_and_a_reply_that_opens_thinking_itself(chat) -> None:
    text = ("<think>plan</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "</tool_call>\nDone.\n")
    reply = check_every_split(chat, ids(chat, text), thinking=False)
    assert reply.reasoning_content == "plan" and reply.content == "Done.\n"  # whitespace around the call dropped
    assert json.loads(reply.tool_calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>",  # never closed
    "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",  # a key without its value
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>",  # not JSON
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>NaN</arg_value></tool_call>",  # not JSON either
    "<tool_call>launch_rockets<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>",  # no such tool
    "<tool_call>now<arg_key>a</arg_key><arg_value>1</arg_value>"
    "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",  # a key twice
    "<tool_call>now<arg_value>1</arg_value></tool_call>",  # a value without its key
    "<tool_call>now<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>",  # text between the tags
])
def test_malformed_calls_are_their_original_text(chat, text: str) -> None:
    reply = check_every_split(chat, ids(chat, "Sure. " + text), thinking=False)
    assert reply == Reply("Sure. " + text, None, [])


def test_markup_out_of_place_and_calls_not_offered(chat) -> None:
    # no tools offered (tool_choice none): a well-formed call stays text
    call = "<tool_call>now</tool_call>"
    assert check_every_split(chat, ids(chat, call), False, tools=None) == Reply(call, None, [])
    # call markup inside thinking is reasoning text; a stray arg tag in content is text
    reply = check_every_split(chat, ids(chat, "a <tool_call>now</tool_call></think>b </arg_key>"), thinking=True)
    assert reply == Reply("b </arg_key>", "a <tool_call>now</tool_call>", [])
    # </think> with no thinking open is dropped (the template would split history content there)
    assert check_every_split(chat, ids(chat, "x</think>y"), thinking=False) == Reply("xy", None, [])
    # a call interrupted by <think> is text; the thinking that follows is reasoning
    reply = check_every_split(chat, ids(chat, "<tool_call>now<think>r</think>z"), thinking=False)
    assert reply == Reply("<tool_call>nowz", "r", [])


def test_rendering_tool_calls_and_results_is_glm53s_markup(chat) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Berlin?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Berlin\", \"days\": 2}"}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "<think>Done.</think> Sunny at noon. "},
        {"role": "user", "content": "Thanks"},
    ]
    plan = plan_tools([CLOCK], None)
    prompt = chat.render(render_messages(messages), plan.render, {})
    assert prompt == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        "{\"name\": \"now\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}\n</tools>\n\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
        "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
        "<|system|>Be brief.<|user|>Weather in Berlin?"
        "<|assistant|><think>Use the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Berlin"
        "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>now</tool_call>"
        "<|observation|><tool_response>sunny</tool_response><tool_response>12:00</tool_response>"
        "<|assistant|><think>Done.</think>Sunny at noon.<|user|>Thanks<|assistant|><think>")
    # what the parser reads back from the model's markup is what the client sent
    call_text = prompt.split("<|assistant|><think>")[1].split("<|observation|>")[0]
    reply = parse_reply(chat.tokenizer, ids(chat, call_text), True, TOOLS)
    assert reply.reasoning_content == "Use the tool." and reply.content is None
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Berlin", "days": 2}), ("now", {})]


def test_thinking_switch_effort_and_budget(chat) -> None:
    tok = chat.tokenizer
    think, end = special_id("<think>"), special_id("</think>")
    on = thinking_controls("low", {})
    assert on == thinking_controls("minimal") and on.enabled and on.template_kwargs == {"reasoning_effort": "low"}
    assert thinking_controls("medium").template_kwargs["reasoning_effort"] == "high"
    assert thinking_controls("xhigh").template_kwargs["reasoning_effort"] == "max"
    off = thinking_controls("none", {"clear_thinking": True})
    assert not off.enabled and off.template_kwargs == {"clear_thinking": True, "enable_thinking": False}
    msgs = render_messages([{"role": "user", "content": "hi"}])
    assert chat.render(msgs, None, on.template_kwargs).startswith("[gMASK]<sop><|system|>Reasoning Effort: Low<|user|>")
    prompt = chat.encode(chat.render(msgs, None, {}))
    assert thinking_open(prompt, tok) and close_thinking(prompt, True, tok) == []
    # a stock GLM-5.3 template ignores enable_thinking: the front closes the block itself, to the
    # same ids the tiny template gives when told
    closed = prompt + close_thinking(prompt, False, tok)
    assert closed == chat.encode(chat.render(msgs, None, off.template_kwargs))
    assert closed[-2:] == [think, end] and not thinking_open(closed, tok) and close_thinking(closed, False, tok) == []
    # a budget of 3 thinking tokens: </think> is due once the block holds 3
    steer = Steering(tok, thinking_started=True, budget=3)
    steer.push(ids(chat, "a b"))
    assert steer.thinking_left() == 3 - len(ids(chat, "a b")) and steer.due() == []
    steer.push(ids(chat, " c d e")[: steer.thinking_left()])
    assert steer.due() == [end] and steer.thinking_left() == 0
    steer.push([end])
    assert steer.due() == [] and steer.thinking_left() is None


def test_tool_choice_is_realised_by_forcing_the_call(chat) -> None:
    tok = chat.tokenizer
    call = special_id("<tool_call>")
    assert plan_tools(None, None).render is None and plan_tools([WEATHER], None).schemas.keys() == {"get_weather"}
    none = plan_tools([WEATHER], "none")
    assert none.render is None and none.schemas is None and forced_call_ids(none, tok) == []
    required = plan_tools([WEATHER, CLOCK], "required")
    assert required.render == plan_tools([WEATHER, CLOCK], "auto").render and forced_call_ids(required, tok) == [call]
    named = plan_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}})
    assert named.render == required.render and set(named.schemas) == {"now"}
    forced = forced_call_ids(named, tok)
    assert forced == [call, *ids(chat, "now")]
    # thinking first, then the call where the answer starts; at once when thinking is closed
    steer = Steering(tok, thinking_started=True, forced_call=forced)
    assert steer.stop_ids == {special_id("</think>")} and steer.due() == []
    steer.push(ids(chat, "why</think>"))
    assert steer.due() == forced
    steer.push(forced)
    assert steer.due() == []
    assert Steering(tok, thinking_started=False, forced_call=forced).due() == forced
    late = Steering(tok, thinking_started=False, forced_call=forced)
    late.push(ids(chat, "text"))
    assert late.due() == []  # the answer already started: too late to force
    # the forced ids and what the model writes next parse as the named call
    reply = parse_reply(tok, forced + ids(chat, "</tool_call>"), False, named.schemas)
    assert [c.name for c in reply.tool_calls] == ["now"]


@pytest.mark.parametrize("messages, param", [
    ("hi", "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q"}, {"role": "user", "content": "q"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
     "messages[3].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "a b", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": {"function": {}}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": "x", "reasoning_content": 5}], "messages[0].reasoning_content"),
])
def test_bad_messages_name_the_field(messages, param: str) -> None:
    with pytest.raises(MarkupError) as err:
        render_messages(messages)
    assert err.value.param == param and param in str(err.value)


@pytest.mark.parametrize("tools, choice, param", [
    ({"type": "function"}, None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([WEATHER, {"type": "function", "function": {"name": ""}}], None, "tools[1].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools[0].function.parameters"),
    ([WEATHER], "always", "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "now"}}, "tool_choice.function.name"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, choice, param: str) -> None:
    with pytest.raises(MarkupError) as err:
        plan_tools(tools, choice)
    assert err.value.param == param


def test_bad_thinking_controls_name_the_field() -> None:
    for effort, kwargs, param in [("medium-ish", {}, "reasoning_effort"),
                                  ("high", {"enable_thinking": False}, "reasoning_effort"),
                                  ("none", {"enable_thinking": True}, "reasoning_effort"),
                                  (None, {"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking")]:
        with pytest.raises(MarkupError) as err:
            thinking_controls(effort, kwargs)
        assert err.value.param == param
