"""What every suite gets: the server (and the cache-off one), the settings, the run's id, its
progress, and two measurements shared by the suites (warm-up, the server's characters per token)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glm53.apibench.endpoint import BenchError, Endpoint
from glm53.apibench.progress import Display
from glm53.apibench.schema import ServerInfo, Settings
from glm53.apibench.streaming import Reply, chat
from glm53.apibench.texts import tool_output

WARMUP_PROMPT = "Say hello."


@dataclass
class RunContext:
    endpoint: Endpoint
    server: ServerInfo
    settings: Settings
    run_id: str
    display: Display
    no_cache: Endpoint | None = None
    _chars_per_token: float | None = field(default=None, repr=False)
    _warm: bool = field(default=False, repr=False)

    def body(self, **extra: Any) -> dict[str, Any]:
        """Extra body fields of a request: ignore_eos where asked, then `extra`."""
        return {**({"ignore_eos": True} if self.settings.ignore_eos else {}), **extra}

    def warm_up(self) -> int:
        """One short request whose timing is discarded (bench/results/README.md, "Method": warm-up runs are not results), before
        the run's first suite; returns how many were sent now (1, then 0)."""
        if self._warm:
            return 0
        chat(self.endpoint, [{"role": "user", "content": WARMUP_PROMPT}], 2, "the warm-up request")
        self._warm = True
        return 1

    def chars_per_token(self) -> float:
        """Characters of the shipped tool text per token of the server's tokenizer: the difference of
        two prompts' usage.prompt_tokens (so the chat template's tokens cancel). Measured once."""
        if self._chars_per_token is None:
            short, long = tool_output("calibrate", 200), tool_output("calibrate", 800)
            counts = [self._prompt_tokens(text) for text in (short, long)]
            if counts[1] <= counts[0]:
                raise BenchError(f"{self.endpoint.base} counted {counts[0]} and {counts[1]} prompt tokens for "
                                 f"{len(short)} and {len(long)} characters: usage.prompt_tokens is not usable")
            self._chars_per_token = (len(long) - len(short)) / (counts[1] - counts[0])
        return self._chars_per_token

    def _prompt_tokens(self, text: str) -> int:
        reply: Reply = chat(self.endpoint, [{"role": "user", "content": text}], 1, "a request that sizes the texts")
        return reply.timing.prompt_tokens

    def check_fits(self, tokens: int, flag: str) -> None:
        """Refuse up front a prompt the server's context cannot hold, naming the flag that sizes it."""
        context = self.server.context
        if context is not None and tokens >= context:
            raise BenchError(f"{self.endpoint.base} serves a context of {context} tokens; a prompt of ~{tokens} "
                             f"tokens does not fit: lower {flag}")
