"""Which sequences run, and what each contributes to the next step.

A step holds every decoding sequence's window (one token, or a drafted verification window) and
then prefill pieces of admitted sequences under a token budget, so a long prompt advances a piece
a step while the streams keep decoding. Admission is by KV memory (the pool must take the whole
context) and by the running limit; past `max_waiting` queued requests `add` refuses (the front
answers 429). When a running sequence cannot grow, the youngest running sequence is preempted:
its rows are released and it waits at the head of the queue, to be prefilled again (recompute).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from glm53.runtime.kv_pool import PagedPool
from glm53.runtime.sequence import Sequence, Status


class QueueFull(RuntimeError):
    """The wait queue is at its bound: the request should come back later."""


class TooLarge(ValueError):
    """A request whose prompt and max_tokens could never fit the KV pool, even alone."""


@dataclass
class Work:
    """One sequence's rows in a step: tokens at [start, start + len(tokens))."""

    seq: Sequence
    tokens: list[int]
    start: int
    prefill: bool  # rows of the context (prefill or its recompute), else a decode window

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class Scheduler:
    def __init__(self, pool: PagedPool, *, max_seqs: int = 8, max_waiting: int = 64, step_tokens: int = 256,
                 chunk: int = 256, wave: int | None = None) -> None:
        self.pool, self.max_seqs, self.max_waiting = pool, max_seqs, max_waiting
        self.step_tokens, self.chunk = step_tokens, chunk
        # with no stream to hold up, prefill takes a wave (glm53.runtime.engine's prefill_waves: a MoE layer
        # reads its experts once for several pieces)
        self.wave = max(wave or step_tokens, step_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the youngest
        self.preempted_total = 0
        self._admissions = 0

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.pool.blocks(len(seq.prompt) + seq.max_tokens) > self.pool.capacity:
            raise TooLarge(f"prompt ({len(seq.prompt)}) + max_tokens ({seq.max_tokens}) exceed the KV pool "
                           f"({self.pool.capacity} positions): send a shorter prompt or a smaller max_tokens, or "
                           "give the pool more memory (TF_GLM53_KV_POOL_BYTES)")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests wait already (TF_GLM53_MAX_WAITING={self.max_waiting})")
        self.waiting.append(seq)

    def admissible(self) -> Sequence | None:
        """The head of the queue when it can start now (a running slot and room for its context
        and its next token), else None: first come, first served, nobody jumps the queue."""
        if not self.waiting or len(self.running) >= self.max_seqs:
            return None
        head = self.waiting[0]
        return head if self.pool.fits(head.context_length + 1) else None

    def start(self, seq: Sequence) -> None:
        """The head of the queue becomes a running sequence (its state allocated by the caller)."""
        assert self.waiting and self.waiting[0] is seq
        self.waiting.popleft()
        seq.admitted = self._admissions
        self._admissions += 1
        seq.status = Status.PREFILL
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """A finished or cancelled sequence leaves (its rows are released by the caller)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Back to the head of the queue without rows (the caller unwinds its draft run first)."""
        self.pool.release(seq.state)
        seq.state, seq.status, seq.draft_run = None, Status.WAITING, None
        seq.prefill_outs.clear()
        seq.preemptions += 1
        self.preempted_total += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ---- a step --------------------------------------------------------------------------------
    def plan(self, window_of, make_room) -> list[Work]:
        """The next step's work. `window_of(seq)` gives a decoding sequence's window (None: it has
        none this step); `make_room(seq, positions)` grows its rows or preempts (False: `seq` itself
        was preempted)."""
        work: list[Work] = []
        budget = self.step_tokens
        for seq in list(self.running):
            if seq.status is not Status.DECODE or seq not in self.running:
                continue
            tokens = window_of(seq)
            if not tokens:
                continue
            start = seq.state.length
            if not make_room(seq, start + len(tokens)):
                continue
            work.append(Work(seq, tokens, start, prefill=False))
            budget -= len(tokens)
        work = [w for w in work if w.seq in self.running]  # make_room may have preempted an earlier one
        if not work:
            budget = self.wave
        for seq in self.running:
            if seq.status is not Status.PREFILL:
                continue
            start, context = seq.state.length, seq.context_length
            while start < context and (budget > 0 or not work):
                # pieces of at most C that never cross the prompt's end (rows past it are not
                # canonical prefill); a sequence's pieces in one step are adjacent: a wave
                stop = len(seq.prompt) if start < len(seq.prompt) else context
                n = min(stop - start, self.chunk, max(budget, 1))
                work.append(Work(seq, seq.context[start:start + n], start, prefill=True))
                budget -= n
                start += n
            if budget <= 0:
                break
        return work
