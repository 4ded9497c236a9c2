"""Drafted decoding of one sequence inside batched steps.

drafter.decode_loop.drafted_decode is a loop that calls `target.forward` for each verification
window. Here it runs on its own thread in lockstep with the scheduler: the thread runs only while
the scheduler waits for it, and its target's `forward` posts the window and hands control back;
the scheduler puts the window in the next step's batch and resumes the thread with its rows.
So the drafter's loop (sources, adaptive depth, acceptance) is the one a lone request runs, and
only one thread computes at any time.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from typing import Any

import torch

from drafter.decode_loop import StopRule, drafted_decode
from drafter.target import WindowOutput
from glm53.model.transformer import ForwardOutput
from glm53.runtime.state_target import StateTarget


class Preempted(Exception):
    """Raised inside the draft thread's forward to unwind it (preemption or cancellation)."""


class _Cancelled(Exception):
    """on_tokens returned False: the client went away."""


class WindowTarget(StateTarget):
    """The drafter's Target over one sequence's state; forward() goes through the batch."""

    def __init__(self, run: "DraftedRun", engine: Any, state: Any) -> None:
        super().__init__(engine, state)
        self.run = run

    def forward(self, tokens: Seq[int], start: int, *, taps: Seq[int] = ()) -> WindowOutput:
        out, logits = self.run.post(list(tokens), start)
        return WindowOutput(start=start, logits=logits, hidden=out.hidden, taps={k: out.taps[k] for k in taps})


class DraftedRun:
    """drafted_decode for one sequence on a lockstep thread. `resume()` runs the thread until it
    posts its next window (`window`) or ends (`done`); the scheduler answers a window with
    `resume((ForwardOutput, logits))`."""

    def __init__(self, seq: Any, engine: Any, prefilled: Any, eos: frozenset[int]) -> None:
        self.seq, self.engine = seq, engine
        self.window: tuple[list[int], int] | None = None
        self.done = False
        self.error: BaseException | None = None
        self._answer: tuple[ForwardOutput, torch.Tensor] | None = None
        self._abort = False
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self.target = WindowTarget(self, engine, seq.state)
        self._thread = threading.Thread(target=self._main, args=(prefilled, eos), daemon=True,
                                        name=f"draft-{seq.rid}")
        self._thread.start()

    # ---- the scheduler's side ------------------------------------------------------------------
    def resume(self, answer: tuple[ForwardOutput, torch.Tensor] | None = None) -> None:
        self.window, self._answer = None, answer
        self._go.release()
        self._back.acquire()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Unwind the thread (its rows are about to be released); tokens already handed out stay."""
        if self.done:
            return
        self._abort = True
        self.resume()

    # ---- the thread's side ---------------------------------------------------------------------
    def post(self, tokens: list[int], start: int) -> tuple[ForwardOutput, torch.Tensor]:
        self.window = (tokens, start)
        self._back.release()
        self._go.acquire()
        if self._abort:
            raise Preempted
        assert self._answer is not None
        return self._answer

    def _main(self, prefilled: Any, eos: frozenset[int]) -> None:
        self._go.acquire()
        seq = self.seq
        base = len(seq.reply)  # tokens kept from before a preemption

        def forward_tokens(new: list[int]) -> None:
            seq.commit(new)
            if not seq.emit(new):
                raise _Cancelled

        try:
            if self._abort:
                raise Preempted
            with torch.inference_mode():
                result = drafted_decode(self.target, seq.context, seq.choose,
                                        StopRule(seq.max_tokens - base, eos, seq.params.ignore_eos),
                                        self.engine.drafter, policy=self.engine.depth_policy(seq.params),
                                        on_tokens=forward_tokens, prefilled=prefilled)
            seq.stats["draft"] = result.stats.metrics() if hasattr(result.stats, "metrics") else {}
            last = seq.reply[-1] if seq.reply else None
            seq.finish_reason = "stop" if last in eos and not seq.params.ignore_eos else "length"
        except _Cancelled:
            seq.finish_reason = "cancelled"
        except Preempted:
            pass
        except BaseException as exc:  # the scheduler re-raises it: the engine's state is unknown
            self.error = exc
        finally:
            self.done = True
            self._back.release()
