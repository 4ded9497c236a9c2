"""One request inside the batched runtime: its tokens, KV state, sampling and draft state.

A sequence's rows must hold its *context* (prompt + reply so far) before its next token can be
chosen. Prefill writes them in pieces; a serial decode step writes the pending token (the reply's
last); a drafted sequence's verification windows come from its DraftedRun. After a preemption the
rows are gone and the context is prefilled again: by row invariance the recomputed rows, and so
every later token, are the bits the sequence would have had.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from glm53.model.kv_state import KVState
from glm53.model.transformer import ForwardOutput
from glm53.runtime.logits_policy import LogitsPolicy
from glm53.runtime.sampling import SamplingParams

OnTokens = Callable[[list[int]], Any]


class Status(enum.Enum):
    WAITING = "waiting"      # queued, or preempted (no rows)
    PREFILL = "prefill"      # rows being written for the context
    DECODE = "decode"        # one window a step (a token, or a drafted verification window)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    prompt_ids: np.ndarray
    max_tokens: int
    params: SamplingParams
    drafted: bool  # decodes through the drafter (per request, params.draft and the engine's drafter)
    on_tokens: OnTokens | None = None
    on_done: Callable[["Sequence"], None] | None = None
    policy: LogitsPolicy | None = None  # the request's logits policy (Glm53Engine._policy), built at submit
    on_admit: Callable[["Sequence"], None] | None = None  # called once, at the first admission
    rid: str = "-"
    number: int = 0  # arrival order
    status: Status = Status.WAITING
    reply: list[int] = field(default_factory=list)
    state: KVState | None = None
    admitted: int = -1  # admission counter: the largest is the youngest running sequence
    cached: int = 0  # rows reused from the prefix cache at the last admission
    prefill_outs: list[ForwardOutput] = field(default_factory=list)  # drafted: the prefill's hidden/taps
    prefill_start: int = 0
    draft_run: Any = None  # glm53.runtime.drafted.DraftedRun while drafting
    finish_reason: str | None = None
    error: BaseException | None = None  # why the request failed on its own (finish_reason "error")
    preemptions: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    arrived: float = field(default_factory=time.perf_counter)
    started: float = float("nan")  # first admitted
    first_token: float = float("nan")

    # ---- what the rows must hold -------------------------------------------------------------
    @property
    def context(self) -> list[int]:
        """Tokens whose rows come before the next choice: the prompt and the reply so far."""
        return self.prompt + self.reply

    @property
    def context_length(self) -> int:
        return len(self.prompt) + len(self.reply)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.reply)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    # ---- the one place a token is chosen ---------------------------------------------------------
    def choose(self, logits_row: torch.Tensor, position: int, first_max: int | None = None) -> int:
        """The token at absolute `position` from its logits row, through the request's LogitsPolicy
        (penalties, logit_bias, grammar, logprobs records; sampling keyed by (seed, position)). The
        policy's state is keyed by absolute position and rolls back to `position` first, so the choice
        does not depend on the batch, the step, a rejected draft or a preemption. first_max: the row's
        first maximum, found with the step's other rows (LogitsPolicy.choose)."""
        assert self.policy is not None
        return self.policy.choose(logits_row, position, first_max)

    def commit(self, tokens: list[int]) -> None:
        """Append decided tokens to the reply and publish their logprobs records (stats["logprobs"],
        when asked for) before anything streams them, as Glm53Engine.generate does."""
        self.reply.extend(tokens)
        out = self.stats.get("logprobs")
        if out is not None and self.policy is not None:
            first = self.policy.start + len(out)
            out.extend(self.policy.logprobs_at(range(first, first + len(tokens))))

    def take(self, token: int, eos: frozenset[int]) -> bool:
        """Commit a serially decoded token (glm53.runtime.engine's serial rule: an eos token ends the reply
        and is part of it, but is not streamed; on_tokens returning False cancels). True: stop."""
        self.commit([token])
        if token in eos and not self.params.ignore_eos:
            self.finish_reason = "stop"
            return True
        if not self.emit([token]):
            self.finish_reason = "cancelled"
            return True
        if len(self.reply) >= self.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def emit(self, tokens: list[int]) -> bool:
        """Hand streamed tokens to the client; False: the client went away."""
        if self.first_token != self.first_token:  # NaN: the first token of the request
            self.first_token = time.perf_counter()
        return not (self.on_tokens is not None and self.on_tokens(tokens) is False)
