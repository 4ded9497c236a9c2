"""Token choice: greedy, or temperature / top-k / top-p / min-p sampling keyed by (seed, position).
A request's penalties, logit_bias and grammar change the row before this (glm53/runtime/logits_policy.py).

The randomness for the token at absolute position p depends only on the request's seed and p
(Gumbel noise from a generator seeded by a hash of both, drawn on the CPU so every device draws the
same), so a drafted reply and a serial one pick the same tokens from the same logits.
Filters apply in this order: temperature, top-k, top-p, min-p; then Gumbel-max over what is left.
"""
from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from glm53.runtime.errors import SamplingError
from glm53.runtime.grammar import grammar_for


MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    min_p: float = 0.0
    seed: int | None = None
    draft: bool = True
    ignore_eos: bool = False
    # per-request logits processing (glm53/runtime/logits_policy.py), applied before the filters above
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token the reply already holds
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the reply
    repetition_penalty: float = 1.0  # CTRL / transformers: tokens of the prompt or reply, logit / p if > 0 else * p
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    grammar: str | None = None  # an llguidance grammar (glm53/runtime/grammar.py), from response_format
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the k most likely
    # where the reply began when the prompt already holds part of it (a steered reply's later engine
    # calls, glm53/serving/front/steer.py): presence and frequency penalties count the reply from there
    reply_start: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0.0, math.inf)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_int("top_k", self.top_k, 0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2 ** 63))
        for name in ("draft", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(f"'{name}' must be true or false, got {getattr(self, name)!r}", name)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingError(f"'logit_bias' must map token ids to numbers, got {self.logit_bias!r}", "logit_bias")
            for token, bias in self.logit_bias.items():
                _check_int(f"logit_bias key {token!r}", token, 0, "logit_bias")
                _check_number(f"logit_bias[{token}]", bias, -100.0, 100.0, param="logit_bias")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise SamplingError("'grammar' must be an llguidance grammar string", "response_format")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise SamplingError(f"'logprobs' asks for {self.logprobs} alternatives; at most {MAX_TOP_LOGPROBS}",
                                    "logprobs")
        if self.reply_start is not None:
            _check_int("reply_start", self.reply_start, 0)
        if self.grammar is not None and self.ignore_eos:
            raise SamplingError("'ignore_eos' cannot be combined with 'response_format': the grammar ends the "
                                "reply with an end-of-sequence token", "ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_request(cls, request: dict[str, Any]) -> "SamplingParams":
        """Read the OpenAI-style fields of a request body; unknown fields are ignored, null means default."""
        if not isinstance(request, dict):
            raise SamplingError(f"the request must be a JSON object, got {type(request).__name__}")
        kwargs = {name: request[name] for name in cls.__dataclass_fields__ if request.get(name) is not None}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if name in kwargs and isinstance(kwargs[name], int) and not isinstance(kwargs[name], bool):
                kwargs[name] = float(kwargs[name])
        if isinstance(kwargs.get("logit_bias"), dict):  # JSON object keys are strings: "123" -> 123
            kwargs["logit_bias"] = {_token_key(k): v for k, v in kwargs["logit_bias"].items()} or None
        if request.get("response_format") is not None:
            kwargs["grammar"] = grammar_for(request["response_format"])
        return cls(**kwargs)

    @property
    def processes_logits(self) -> bool:
        """Whether a logits row is changed before the filters (penalties, bias, grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.grammar is not None)

    def with_seed(self) -> "SamplingParams":
        """These params with a seed drawn now when sampling needs one and the request gave none."""
        if self.greedy or self.seed is not None:
            return self
        return SamplingParams(**{**self.__dict__, "seed": secrets.randbits(63)})


def _token_key(key: Any) -> Any:
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key  # refused by the check, which names it


def _check_number(name: str, value: Any, low: float, high: float, low_open: bool = False,
                  param: str | None = None) -> None:
    param = param or name
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SamplingError(f"'{name}' must be a number, got {value!r}", param)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise SamplingError(f"'{name}' is {value}; it must lie in {bracket}{low}, {high}]", param)


def _check_int(name: str, value: Any, low: int, param: str | None = None) -> None:
    param = param or name
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"'{name}' must be an integer, got {value!r}", param)
    if value < low:
        raise SamplingError(f"'{name}' is {value}; it must be >= {low}", param)


def noise_key(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"glm53-sampling:{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gumbel_noise(seed: int, position: int, n: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(noise_key(seed, position))
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    return -torch.log(-torch.log(u))


def filtered_logprobs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp64 log-probabilities after temperature and the filters; -inf where filtered out."""
    logits = logits_row.detach().to("cpu", torch.float64) / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    logp = torch.log_softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_lp, order = logp.sort(descending=True, stable=True)
        before = torch.cumsum(sorted_lp.exp(), 0) - sorted_lp.exp()  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p (never the first)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logp = logp.masked_fill(drop, -math.inf)
    if params.min_p > 0.0:
        logp = logp.masked_fill(logp < logp.max() + math.log(params.min_p), -math.inf)
    return logp


def sample(logits_row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token for absolute position `position` given that position's logits row [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits_row).item())  # first maximum on ties
    if params.seed is None:
        raise SamplingError("sampling at temperature > 0 needs a seed; call SamplingParams.with_seed() per request")
    logp = filtered_logprobs(logits_row, params)
    return int(torch.argmax(logp + gumbel_noise(params.seed, position, logp.shape[0])).item())
