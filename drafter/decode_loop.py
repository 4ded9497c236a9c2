"""Generation loops over a Target: serial (one token per forward) and drafted
(draft -> verify -> commit -> on_tokens). Both stop the same way, so their outputs compare.

Stop rule (both loops): after each committed token, stop when it is an end-of-sequence token
(unless ignore_eos; the eos token is part of the reply) or when max_tokens are committed.
On return the target's cache holds rows [0, len(prompt) + len(reply) - 1): the last reply token
is pending, exactly as serial decoding leaves it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

from .policy import AcceptanceStats, AdaptiveDepth, PolicyConfig
from .sources.base import DraftSource
from .target import Steps, Target, Window, WindowOutput, check_window, drive
from .verify import Sampler, verify_window

log = logging.getLogger("drafter.decode")

OnTokens = Callable[[list[int]], None]


class SourceFactory(Protocol):
    def new_source(self, target: Target) -> DraftSource: ...


@dataclass
class StopRule:
    max_tokens: int
    eos: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def take(self, reply: list[int], new: Iterable[int]) -> tuple[list[int], bool]:
        """Append from `new` until the rule stops; return (tokens taken, stopped)."""
        taken: list[int] = []
        for token in new:
            if len(reply) + len(taken) >= self.max_tokens:
                return taken, True
            taken.append(token)
            if (token in self.eos and not self.ignore_eos) or len(reply) + len(taken) >= self.max_tokens:
                return taken, True
        return taken, False


@dataclass
class DecodeResult:
    tokens: list[int]
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    forwards: int = 0


def prefill(target: Target, prompt: Sequence[int], *, taps: Sequence[int] = ()) -> Steps[WindowOutput]:
    """Forward the prompt rows the cache lacks (all of them unless a prefix was reused): a generator of
    that forward (drafter.target.Steps)."""
    start = target.length()
    if not 0 <= start < len(prompt):
        raise ValueError(f"prefill needs at least one uncached prompt token: cache holds {start} rows, "
                         f"prompt has {len(prompt)} tokens")
    out = yield Window(list(prompt[start:]), start, tuple(taps))
    check_window(target, out, start, len(prompt) - start)
    return out


def _finish(target: Target, prompt: Sequence[int], reply: list[int]) -> None:
    keep = len(prompt) + len(reply) - 1
    if target.length() > keep:
        target.truncate(keep)      # rows of tokens past the stop were committed inside a window


def serial_decode(target: Target, prompt: Sequence[int], sample: Sampler, stop: StopRule,
                  on_tokens: OnTokens | None = None) -> DecodeResult:
    """One token per forward: the reference every drafted run must equal."""
    result = DecodeResult(tokens=[])
    if stop.max_tokens <= 0:
        return result
    out = drive(target, prefill(target, prompt))
    result.forwards += 1
    tokens = list(prompt)
    while True:
        token = sample(out.logits[-1], len(tokens))
        taken, stopped = stop.take(result.tokens, [token])
        result.tokens += taken
        tokens += taken
        if on_tokens and taken:
            on_tokens(taken)
        if stopped:
            break
        out = target.forward([tokens[-1]], len(tokens) - 1)
        check_window(target, out, len(tokens) - 1, 1)
        result.forwards += 1
    _finish(target, prompt, result.tokens)
    return result


def drafted_decode(target: Target, prompt: Sequence[int], sample: Sampler, stop: StopRule,
                   source: DraftSource | SourceFactory, *, policy: AdaptiveDepth | None = None,
                   on_tokens: OnTokens | None = None, relaxed_top2: bool = False,
                   prefilled: WindowOutput | None = None) -> DecodeResult:
    """Draft -> verify (one forward) -> commit -> on_tokens, until the stop rule fires.

    `source` is a DraftSource, or a factory with `new_source(target)` (one fresh source per
    request; sources keep per-request state) and optionally `finish(stats)`.
    `prefilled`: the caller already ran the prompt's uncached rows (with `source.taps`, and the
    hidden states MTP needs); the loop then starts from that output instead of its own prefill.
    Its logits may be the last row only.
    `policy.enabled = False` (a request with "draft": false) makes every window empty, which is
    serial decoding through the same code. `relaxed_top2` is LOSSY and must be asked for by name
    (argument, or the policy's config: the engine's depth_policy builds it from TF_GLM53_DRAFT_RELAXED_TOP2).
    Without `policy`, the default PolicyConfig."""
    return drive(target, drafted_decode_steps(target, prompt, sample, stop, source, policy=policy,
                                              on_tokens=on_tokens, relaxed_top2=relaxed_top2, prefilled=prefilled))


def drafted_decode_steps(target: Target, prompt: Sequence[int], sample: Sampler, stop: StopRule,
                         source: DraftSource | SourceFactory, *, policy: AdaptiveDepth | None = None,
                         on_tokens: OnTokens | None = None, relaxed_top2: bool = False,
                         prefilled: WindowOutput | None = None) -> Steps[DecodeResult]:
    """drafted_decode as a generator of its forwards (drafter.target.Steps): the batched runtime drives
    it beside other sequences' windows; drafted_decode drives it through target.forward."""
    factory = source if hasattr(source, "new_source") else None
    if factory is not None:
        source = factory.new_source(target)
    policy = policy or AdaptiveDepth(PolicyConfig())
    relaxed_top2 = relaxed_top2 or policy.config.relaxed_top2
    if relaxed_top2:
        log.warning("relaxed top-2 acceptance requested: LOSSY, outputs may differ from serial decoding")
    result = DecodeResult(tokens=[])
    if stop.max_tokens <= 0:
        return result
    taps = source.taps if policy.enabled else ()
    if prefilled is None:
        out = yield from prefill(target, prompt, taps=taps)
        result.forwards += 1
    else:
        # logits may hold only the last row (the others are never read); hidden / taps cover every row
        rows = max([prefilled.rows] + ([prefilled.hidden.shape[0]] if prefilled.hidden is not None else [])
                   + [t.shape[0] for t in prefilled.taps.values()])
        if prefilled.start + rows != len(prompt) or target.length() != len(prompt):
            raise ValueError(f"prefilled output covers [{prefilled.start}, {prefilled.start + rows}) and the "
                             f"cache holds {target.length()} rows; both must end at the prompt's length {len(prompt)}")
        out = prefilled
    start = out.start
    tokens = list(prompt)
    first = sample(out.logits[-1], len(tokens))
    taken, stopped = stop.take(result.tokens, [first])
    result.tokens += taken
    tokens += taken
    if on_tokens and taken:
        on_tokens(taken)
    if not stopped and policy.enabled:
        source.commit(tokens, out, len(prompt) - start)
    while not stopped:
        remaining = stop.max_tokens - len(result.tokens)
        depth = min(policy.depth(source.max_depth), remaining - 1)   # the window's free token is one more
        drafts = source.propose(tokens, depth, sample) if depth > 0 else []
        drafts = drafts[:max(depth, 0)]
        step = yield from verify_window(target, tokens[-1], drafts, sample, taps=taps, relaxed_top2=relaxed_top2)
        result.forwards += 1
        result.stats.record(source.name if drafts else "none", step.proposed, step.accepted, step.lossy)
        policy.update(step.proposed, step.accepted)
        taken, stopped = stop.take(result.tokens, step.tokens)
        result.tokens += taken
        tokens += taken
        if on_tokens and taken:
            on_tokens(taken)
        if not stopped and policy.enabled:
            source.commit(tokens, step.output, step.kept_rows)
    _finish(target, prompt, result.tokens)
    if result.stats.steps:
        log.info(result.stats.log_line())
    finish = getattr(factory, "finish", None)
    if finish is not None:
        finish(result.stats)
    return result
