"""verify.sh: check a real completion from a running lane, not just /health.

Checks, in order: models (the served id), completion (text: reasoning and content; finish reason, usage), repeat
(temperature 0 twice: the same text), draft (`"draft": false` gives the drafted text), cached (an
extended resend reports cached tokens > 0), stream (SSE delivers the same text). A check whose
feature the server reports as off is SKIPPED with the reason, never passed.
Exit codes: 0 every check passed or was skipped with a reason; 1 a check failed; 2 no server.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import click
import httpx

from glm53.settings import SettingsError
from glm53.serving.lane import API_KEYS_ENV
from launcher.config import api_keys

PROMPT = "Write one sentence about the sea."
SENTENCE = "The lighthouse keeper counted ships in the harbour every evening and wrote their names down. "


def reply_text(message: dict[str, Any]) -> str:
    """What the model wrote: its reasoning (`reasoning_content`, where the server splits thinking
    out) and its content. A thinking model's short reply may be reasoning alone."""
    return (message.get("reasoning_content") or "") + (message.get("content") or "")


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL, SKIPPED
    detail: str


def base_url(url: str) -> str:
    """The server's root from what a user passes: the root itself, or the OpenAI base URL ending in /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class Verifier:
    def __init__(self, url: str, timeout: float, max_tokens: int, api_key: str | None = None) -> None:
        self.url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.max_tokens = max_tokens
        self.model: str | None = None
        self.health: dict[str, Any] = {}
        self.outcomes: list[Outcome] = []

    def record(self, name: str, status: str, detail: str) -> None:
        self.outcomes.append(Outcome(name, status, detail))
        print(f"{status:<8} {name}: {detail}", flush=True)

    def chat(self, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0, **extra}
        r = self.client.post(self.url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def stream(self, messages: list[dict[str, str]]) -> tuple[str, str | None]:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True}
        text, finish, done = [], None, False
        with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise AssertionError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise AssertionError(f"error event: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    text.append((delta.get("reasoning_content") or "") + (delta.get("content") or ""))
                    finish = choice.get("finish_reason") or finish
        if not done:
            raise AssertionError("the stream ended without data: [DONE]")
        return "".join(text), finish

    # ---- the checks ----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            r = self.client.get(self.url + "/v1/models")
        except httpx.HTTPError as exc:
            print(f"FAIL     models: no OpenAI server at {self.url} ({type(exc).__name__}: {exc}); "
                  f"start one with bash serve.sh", flush=True)
            return 2
        try:
            self.model = r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            hint = " (set --api-key or TF_GLM53_API_KEYS)" if r.status_code == 401 else ""
            print(f"FAIL     models: GET {self.url}/v1/models gave HTTP {r.status_code}, not a model list{hint}: "
                  f"{r.text[:300]}", flush=True)
            return 2
        self.record("models", "PASS", f"serves {self.model!r}")
        try:
            self.health = self.client.get(self.url + "/health").json()
        except (httpx.HTTPError, ValueError):
            self.health = {}
        messages = [{"role": "user", "content": PROMPT}]
        first = self.check("completion", lambda: self.completion(messages))
        if first is None:
            return self.summary()
        text = reply_text(first["choices"][0]["message"])
        self.check("repeat", lambda: self.same(messages, text, {}, "a second temperature-0 request"))
        self.check("draft", lambda: self.draft(messages, text))
        self.check("cached", self.cached)
        self.check("stream", lambda: self.streamed(messages, text, first["choices"][0]["finish_reason"]))
        return self.summary()

    def check(self, name: str, fn):
        try:
            result = fn()
        except (AssertionError, httpx.HTTPError, ValueError, KeyError) as exc:
            self.record(name, "FAIL", f"{type(exc).__name__ + ': ' if not isinstance(exc, AssertionError) else ''}{exc}")
            return None
        if isinstance(result, tuple):  # (status, detail)
            self.record(name, *result)
            return result
        self.record(name, "PASS", result.pop("_detail"))
        return result

    def completion(self, messages):
        body = self.chat(messages)
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        if not reply_text(choice["message"]):
            raise AssertionError(f"the reply has no content or reasoning (message: {choice['message']!r})")
        if choice.get("finish_reason") not in ("stop", "length"):
            raise AssertionError(f"finish_reason is {choice.get('finish_reason')!r}, expected stop or length")
        if not (usage.get("prompt_tokens", 0) > 0 and usage.get("completion_tokens", 0) > 0):
            raise AssertionError(f"usage lacks prompt/completion tokens: {usage!r}")
        if "cached_tokens" not in (usage.get("prompt_tokens_details") or {}):
            raise AssertionError(f"usage lacks prompt_tokens_details.cached_tokens: {usage!r}")
        body["_detail"] = (f"{usage['completion_tokens']} tokens, finish {choice['finish_reason']}, "
                           f"{usage['prompt_tokens']} prompt tokens")
        return body

    def same(self, messages, text: str, extra: dict[str, Any], what: str) -> dict[str, Any]:
        again = reply_text(self.chat(messages, **extra)["choices"][0]["message"])
        if again != text:
            raise AssertionError(f"{what} gave different text:\n  first:  {text!r}\n  second: {again!r}")
        return {"_detail": f"{what} gave the same text"}

    def draft(self, messages, text: str):
        result = self.same(messages, text, {"draft": False}, '"draft": false')
        if self.health.get("drafting") is False:
            return ("SKIPPED", 'the server reports drafting off, so "draft": false is not compared with a drafted '
                               'reply (the texts did match)')
        return result

    def cached(self):
        """A first turn longer than the prefill chunk, then the same conversation extended: the
        resend must reuse the prefix (reuse happens in whole chunks)."""
        chunk = int(self.health.get("prefill_chunk") or 0)
        context = int(self.health.get("context") or 0)
        one = self.chat([{"role": "user", "content": SENTENCE}], max_tokens=1)["usage"]["prompt_tokens"]
        two = self.chat([{"role": "user", "content": SENTENCE * 2}], max_tokens=1)["usage"]["prompt_tokens"]
        per_sentence = max(1, two - one)
        sentences = max(4, -(-(chunk + 64 - one) // per_sentence) + 1)
        if context and one + sentences * per_sentence + 64 > context:
            return ("SKIPPED", f"the server's context ({context}) is too short for a first turn longer than its "
                               f"prefill chunk ({chunk}) plus a second turn")
        first_turn = [{"role": "user", "content": SENTENCE * sentences}]
        a = self.chat(first_turn, max_tokens=4)
        if a["usage"]["prompt_tokens"] <= chunk:
            raise AssertionError(f"the first turn has {a['usage']['prompt_tokens']} tokens, not more than the "
                                 f"prefill chunk {chunk}; cannot test reuse")
        extended = first_turn + [{"role": "assistant", "content": a["choices"][0]["message"].get("content") or ""},
                                 {"role": "user", "content": "And one more?"}]
        b = self.chat(extended, max_tokens=4)
        cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached > 0:
            return {"_detail": f"the extended resend reused {cached} of {b['usage']['prompt_tokens']} prompt tokens"}
        state = self.health.get("prefix_cache")
        if state in ("off", "absent"):
            return ("SKIPPED", f"the server reports its prefix cache {state} and reused nothing (cached_tokens 0)")
        raise AssertionError(f"the extended resend reported cached_tokens 0 of {b['usage']['prompt_tokens']} "
                             f"(server prefix cache: {state or 'not reported'})")

    def streamed(self, messages, text: str, finish: str):
        got, got_finish = self.stream(messages)
        if got != text:
            raise AssertionError(f"the stream gave different text:\n  plain:  {text!r}\n  stream: {got!r}")
        if got_finish != finish:
            raise AssertionError(f"the stream's finish_reason {got_finish!r} differs from {finish!r}")
        return {"_detail": f"the stream delivered the same text, finish {got_finish}"}

    def summary(self) -> int:
        failed = [o.name for o in self.outcomes if o.status == "FAIL"]
        skipped = [o.name for o in self.outcomes if o.status == "SKIPPED"]
        passed = sum(o.status == "PASS" for o in self.outcomes)
        print(f"verify: {passed} passed, {len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, "
              f"{len(skipped)} skipped{' (' + ', '.join(skipped) + ')' if skipped else ''}", flush=True)
        return 1 if failed else 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__)
@click.option("--url", default="http://127.0.0.1:8300", show_default=True,
              help="the lane's URL, with or without /v1 (the base URL OpenAI clients take)")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds per request")
@click.option("--max-tokens", type=int, default=24, show_default=True)
@click.option("--api-key", default=None, help=f"the key the lane asks for (default: the first of ${API_KEYS_ENV})")
def main(url: str, timeout: float, max_tokens: int, api_key: str | None) -> None:
    if api_key is None:
        try:
            api_key = next(iter(api_keys(os.environ)), None)
        except SettingsError as exc:
            sys.exit(f"verify: {exc}")
    sys.exit(Verifier(url, timeout, max_tokens, api_key).run())


if __name__ == "__main__":
    main()

