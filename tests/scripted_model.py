"""A real lane over the tiny checkpoint whose token choice a test can script.

The tiny model's weights are random: it never chooses to think, answer or call a tool. `scripted`
replaces only its token choice (glm53.runtime.logits_policy's `sample`, the sampler of both decode loops): everything else stays real (the chat
template, the tokenizer, the ids the front appends, the bursts and the engine's KV, the markup parser,
SSE, the official clients). At each position the script reads the reply so far (the ids after the
prompt's last `<|assistant|>`, decoded with the markup visible, e.g. "<think>hm</think>") and writes the
next token of the text `plan(reply)` says the reply is; once the reply is that text, or leaves it, it
ends with `end`. `script.first` is the reply as it stood at the model's first choice (what the front
appended before it is visible there), `script.prompts` the prompt of each engine call (one per burst:
an `engine.generate`, or a sequence submitted to the batched runtime, whose rows the script then reads).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from glm53.synthetic.tiny_tokenizer import special_id

MODEL = "glm-5.3-exl3"
ASSISTANT = special_id("<|assistant|>")
EOS = special_id("<|endoftext|>")
OBSERVATION = special_id("<|observation|>")


class Script:
    def __init__(self, engine: Any, tokenizer: Any, plan: Callable[[str], str], end: int) -> None:
        self.engine, self.tok, self.plan, self.end = engine, tokenizer, plan, end
        self.first: str | None = None
        self.prompts: list[list[int]] = []
        self.calls = 0
        self.state: Any = None  # the batched runtime: the rows of the sequence choosing now

    def reply_so_far(self, pos: int) -> tuple[list[int], str]:
        state = self.state if self.state is not None else self.engine.state
        context = [int(t) for t in state.token_ids()[:pos]]
        start = max(i for i, t in enumerate(context) if t == ASSISTANT) + 1
        return context, self.tok.decode(context[start:], skip_special_tokens=True)

    def __call__(self, logits: Any, params: Any, pos: int) -> int:
        _, text = self.reply_so_far(pos)
        self.calls += 1
        if self.first is None:
            self.first = text
        target = self.plan(text)
        if not target.startswith(text) or target == text:
            return self.end
        return self.tok.encode(target[len(text):], add_special_tokens=False).ids[0]


@contextlib.contextmanager
def scripted(monkeypatch: pytest.MonkeyPatch, engine: Any, plan: Callable[[str], str] | str,
             end: int = EOS) -> Iterator[Script]:
    """While inside, the engine writes `plan` (a text, or reply so far -> the text it is to become)."""
    import glm53.runtime.engine
    import glm53.runtime.logits_policy
    from glm53.runtime.batch import BatchEngine
    from glm53.runtime.sequence import Sequence

    from glm53.serving.front.chat import ChatText

    tokenizer = ChatText(engine.model_dir).tokenizer
    script = Script(engine, tokenizer, plan if callable(plan) else (lambda _reply: plan), end)
    generate = engine.generate

    def recorded(prompt: list[int], *args: Any, **kwargs: Any) -> list[int]:
        script.prompts.append(list(prompt))
        return generate(prompt, *args, **kwargs)

    submit, choose = BatchEngine.submit, Sequence.choose

    def submitted(batch: Any, prompt: list[int], *args: Any, **kwargs: Any) -> Any:
        script.prompts.append(list(prompt))
        return submit(batch, prompt, *args, **kwargs)

    def chosen(seq: Any, row: Any, position: int, first_max: int | None = None) -> int:
        script.state = seq.state
        try:  # without the step's first maxima: the script, standing in for sample, decides every token
            return choose(seq, row, position)
        finally:
            script.state = None

    with monkeypatch.context() as patch:
        patch.setattr(glm53.runtime.logits_policy, "sample", script)
        patch.setattr(engine, "generate", recorded)
        patch.setattr(BatchEngine, "submit", submitted)
        patch.setattr(Sequence, "choose", chosen)
        yield script


@contextlib.contextmanager
def tiny_lane(model_dir: Path, **settings: Any) -> Iterator[tuple[Any, Any]]:
    """(the FrontServer, its Glm53Engine): the real front over the real engine on the tiny checkpoint,
    in this process (CPU, fp32)."""
    from glm53.serving.rank import glm53_sampling
    from glm53.runtime.engine import Glm53Engine
    from lane_fixtures import front_server

    engine = Glm53Engine(model_dir, device="cpu", dtype="fp32", kv_dtype="fp32")
    with front_server(model_dir, engine, sampling_factory=glm53_sampling,
                      **{"context": 1024, "default_max_tokens": 16, **settings}) as server:
        yield server, engine


@contextlib.contextmanager
def openai_tiny_lane(model_dir: Path) -> Iterator[tuple[Any, Any, Any]]:
    """tiny_lane with the official openai client pointed at its /v1."""
    import openai

    with tiny_lane(model_dir) as (server, engine):
        yield server, engine, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EXTRA_FIELDS = ("thinking_budget", "chat_template_kwargs", "repetition_penalty")  # not in the SDK's signature


def openai_chat(sdk: Any, **body: Any) -> Any:
    """A chat completion of ASK at temperature 0 (any field overridable); the kit's own fields go as
    extra_body."""
    extra = {k: body.pop(k) for k in EXTRA_FIELDS if k in body}
    return sdk.chat.completions.create(model=MODEL, **{"messages": ASK, "max_tokens": 60, "temperature": 0, **body},
                                       extra_body=extra or None)
