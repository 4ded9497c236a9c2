"""How one chat reply is steered on the engine worker: the ids the front appends itself instead of
sampling (glm_markup.Steering: `</think>` when the thinking budget is spent, the forced tool-call prefix
of tool_choice required/named) and where a burst of generation must end early (`</think>` before a
forced call, `<think>` reopened under a budget, the first complete call when parallel_tool_calls is
false).

The worker generates a steered reply in bursts, each one `engine.generate` call inside the same job:
a burst ends at a stop id (the worker keeps the batch up to it and tells the engine to stop), at its cap
(the thinking budget left), at the model's end or at max_tokens. The next burst's prompt is the
request's prompt and the reply so far, appended ids included (batched, glm53/serving/front/worker.py: a sequence a
burst, submitted when the previous one finishes). The prompt's rows are reused (the engine's retained
rows, or the prefix cache) and the reply's rows computed again in one prefill (decode rows are never
offered for reuse), which with row-invariant ops gives the bits serial decoding would. Sampling is keyed
by (seed, position), so a fixed seed keeps the bursts one reply (Service fixes it).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from glm53.serving.front.glm_markup import MarkupIds, Steering, TokenizerLike, parse_reply


class Steer:
    """One reply's steering state. Push every id of the reply in order (`take` for a burst's batches,
    `push` for appended ids); `due()` says what to append before the next sampled token, `cap(n)` how
    many tokens the next burst may decide, `ended(burst, cap)` whether the model ended the reply.
    `single_call`: the tools a call may name when parallel_tool_calls is false (the reply ends after the
    first call that parses); `finished` is then true."""

    def __init__(self, tokenizer: TokenizerLike, thinking_started: bool, budget: int | None = None,
                 forced_call: Sequence[int] = (), single_call: Mapping[str, Any] | None = None,
                 eos: Collection[int] = (), ignore_eos: bool = False) -> None:
        self._tok = tokenizer
        self._markup = MarkupIds.of(tokenizer)
        self._steering = Steering(tokenizer, thinking_started, budget, forced_call)
        self._thinking_started = thinking_started
        self._single_call = single_call
        self._eos, self._ignore_eos = frozenset(eos), ignore_eos
        self._reply: list[int] = []
        self._stops = set(self._steering.stop_ids)
        if budget is not None and self._markup.think is not None:
            self._stops.add(self._markup.think)  # thinking reopened: the next burst is capped again
        if single_call is not None and self._markup.end_tool_call is not None:
            self._stops.add(self._markup.end_tool_call)
        self.finished = False  # the single-call rule ended the reply

    def due(self) -> list[int]:
        return [] if self.finished else self._steering.due()

    def cap(self, left: int) -> int:
        thinking = self._steering.thinking_left()
        return left if thinking is None else min(left, thinking)

    def push(self, ids: Sequence[int]) -> None:
        self._steering.push(ids)
        self._reply.extend(ids)

    def take(self, batch: Sequence[int]) -> tuple[list[int], bool]:
        """The part of a generated batch that belongs to the reply, and whether the burst must stop
        there (a stop id; the ids after it are dropped: the next burst decides them again)."""
        start = 0
        for i, t in enumerate(batch):
            if t not in self._stops:
                continue
            self.push(batch[start:i + 1])
            start = i + 1
            if t == self._markup.end_tool_call and self._single_call is not None:
                if not self._one_call():
                    continue  # no valid call closed here: the reply goes on
                self.finished = True
            return list(batch[:i + 1]), True
        self.push(batch[start:])
        return list(batch), False

    def _one_call(self) -> bool:
        """Whether the reply so far holds a complete, valid call (outside thinking)."""
        reply = parse_reply(self._tok, self._reply, self._thinking_started, self._single_call)
        return bool(reply.tool_calls)

    def ended(self, burst: Sequence[int], cap: int) -> bool:
        """Whether the model ended the reply in this burst (it stopped before its cap, or at an eos)."""
        if len(burst) < cap:
            return True
        return bool(burst) and burst[-1] in self._eos and not self._ignore_eos
