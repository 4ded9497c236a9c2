"""A request's logits processing, applied at one place before sampling: penalties, logit_bias, the
grammar mask; and the log-probabilities a request asks for.

`LogitsPolicy.choose(row, position)` is the sampler both decode loops call (serial steps, and each
row of a verification window, drafter/verify.py). Its state is keyed by absolute position: the
reply's tokens at positions [start, next), with their counts and the grammar matcher advanced over
them (with `reply_start`, the counts also hold the reply's tokens the prompt already holds: a steered
reply's later engine calls count the earlier calls' tokens). A call for position p first rolls the
state back to p (dropping tokens at p and later), then processes the row with the tokens before p, samples, and advances over the chosen token. So:

- in a verification window, row i sees the counts and grammar state of the tokens accepted up to
  i (the pending token and drafts 0..i-1, which equal what the rows before chose, else the window
  would have stopped): exactly the state a serial step at that position sees;
- a draft source that samples its own proposals (MTP) advances the state over its drafts; the
  window's first row rolls them back, so a rejected draft never counts;
- identical rows (drafted and serial windows give the same logits bit for bit) and identical
  state give identical processed rows, so the same token is chosen.

Order: repetition penalty, frequency and presence penalties (on the model's logits), logit_bias,
grammar mask (-inf where the grammar forbids), then sampling's temperature and filters
(glm53/runtime/sampling.py). Log-probabilities are the model's: log_softmax of the raw row, before
temperature, penalties, bias and grammar (vLLM's default, and what a client can compare across
requests).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from glm53.runtime.sampling import SamplingParams, sample


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token at a position, its log-probability, and the `top` most likely (id, logprob)."""

    position: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(row: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log_softmax of the raw row in fp64: the token's value and the k largest (ties: lower id first)."""
    lp = torch.log_softmax(row.detach().to("cpu", torch.float64), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = lp.topk(min(k, lp.shape[0]))
        top = tuple(sorted(zip(ids.tolist(), values.tolist()), key=lambda p: (-p[1], p[0])))
    return float(lp[token]), top


class LogitsPolicy:
    """One request's processing state (see the module doc). `grammar` is a GrammarMatcher or None."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int, grammar: object = None) -> None:
        self.params, self.vocab_size, self.grammar = params, vocab_size, grammar
        self.start = len(prompt)
        self.reply: list[int] = []  # tokens at positions [start, start + len(reply))
        # the reply's tokens the prompt already holds (params.reply_start) count, and are never rolled back
        prior = prompt[params.reply_start:] if params.reply_start is not None else ()
        self.counts: Counter[int] = Counter(int(t) for t in prior)
        self.records: dict[int, TokenLogprob] = {}
        self._prompt_ids = sorted(set(int(t) for t in prompt)) if params.repetition_penalty != 1.0 else []
        self._cache: dict[torch.device, dict[str, torch.Tensor]] = {}

    @property
    def next_position(self) -> int:
        return self.start + len(self.reply)

    def rewind(self, position: int) -> None:
        """Forget the tokens at `position` and later (draft tokens a window did not keep)."""
        if position > self.next_position:
            raise RuntimeError(f"logits policy: a token for position {position} was asked before position "
                               f"{self.next_position} was decided")
        drop = self.next_position - max(position, self.start)
        for _ in range(drop):
            token = self.reply.pop()
            self.counts[token] -= 1
            if not self.counts[token]:
                del self.counts[token]
        if drop and self.grammar is not None:
            self.grammar.rollback(drop)
        for p in [p for p in self.records if p >= position]:
            del self.records[p]

    def advance(self, token: int) -> None:
        if self.grammar is not None:
            self.grammar.accept(token)
        self.reply.append(token)
        self.counts[token] += 1

    def process(self, row: torch.Tensor) -> torch.Tensor:
        """The row after penalties, bias and the grammar mask, as fp32 on the row's device (the row itself
        when nothing applies)."""
        p = self.params
        if not p.processes_logits:
            return row
        logits = row.detach().to(torch.float32).clone()
        fixed = self._fixed(logits.device)
        if p.repetition_penalty != 1.0:
            seen = fixed["prompt_seen"].clone()
            if self.counts:
                seen[torch.tensor(list(self.counts), dtype=torch.long, device=logits.device)] = True
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        if (p.frequency_penalty or p.presence_penalty) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=logits.device)
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=logits.device)
            logits[ids] -= n * p.frequency_penalty + p.presence_penalty
        if p.logit_bias:
            logits[fixed["bias_ids"]] += fixed["bias_values"]
        if self.grammar is not None:
            allowed = self.grammar.allowed().to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        return logits

    def _fixed(self, device: torch.device) -> dict[str, torch.Tensor]:
        """What does not change during the request, on the row's device (made once)."""
        if device not in self._cache:
            fixed: dict[str, torch.Tensor] = {}
            if self.params.repetition_penalty != 1.0:
                seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
                if self._prompt_ids:
                    seen[torch.tensor(self._prompt_ids, dtype=torch.long, device=device)] = True
                fixed["prompt_seen"] = seen
            if self.params.logit_bias:
                ids = sorted(self.params.logit_bias)
                fixed["bias_ids"] = torch.tensor(ids, dtype=torch.long, device=device)
                fixed["bias_values"] = torch.tensor([float(self.params.logit_bias[i]) for i in ids],
                                                    dtype=torch.float32, device=device)
            self._cache[device] = fixed
        return self._cache[device]

    @property
    def takes_argmax(self) -> bool:
        """Whether a choice is the row's first maximum as it comes (greedy, nothing processed): a batch
        may then find it for several rows at once (choose's first_max)."""
        return self.params.greedy and not self.params.processes_logits

    def choose(self, row: torch.Tensor, position: int, first_max: int | None = None) -> int:
        """The token at absolute `position` from its logits row (drafter.verify.Sampler). first_max:
        the row's first maximum where the caller found it with other rows' (used when takes_argmax)."""
        self.rewind(position)
        if first_max is not None and self.takes_argmax:
            token = first_max
        else:
            token = sample(self.process(row), self.params, position)
        if self.params.logprobs is not None:
            logprob, top = token_logprobs(row, token, self.params.logprobs)
            self.records[position] = TokenLogprob(position, token, logprob, top)
        self.advance(token)
        return token

    def logprobs_at(self, positions: range) -> list[TokenLogprob]:
        """The records of decided positions (empty when the request asked for none)."""
        if self.params.logprobs is None:
            return []
        return [self.records[p] for p in positions]


def policy_for(params: SamplingParams, prompt: Sequence[int], vocab_size: int,
               grammar_factory: Callable[[str], object]) -> LogitsPolicy:
    """The request's policy; `grammar_factory(grammar)` builds its GrammarMatcher when it has one."""
    grammar = grammar_factory(params.grammar) if params.grammar is not None else None
    return LogitsPolicy(params, prompt, vocab_size, grammar)
