"""Drafted decoding of one sequence inside batched steps.

drafter.decode_loop.drafted_decode_steps is the drafter's loop (sources, adaptive depth, acceptance)
written as a generator of its forwards: it yields each verification window and is sent the window's
output. Here the scheduler drives it: `resume()` runs the loop until it asks for its next window, the
scheduler puts that window in the next step's batch and resumes the loop with its rows. So a drafted
sequence runs the loop a lone request runs, on the scheduler's own thread.
"""
from __future__ import annotations

from typing import Any

import torch

from drafter.decode_loop import DecodeResult, StopRule, drafted_decode_steps
from drafter.target import Steps, Window, WindowOutput
from glm53.model.transformer import ForwardOutput
from glm53.runtime.state_target import StateTarget


class _Cancelled(Exception):
    """on_tokens returned False: the client went away."""


class DraftedRun:
    """drafted_decode_steps for one sequence. `resume()` runs the loop until it asks for its next window
    (`window`) or ends (`done`); the scheduler answers a window with
    `resume((ForwardOutput, logits))`. `abort()` stops the loop where it waits (preemption, cancellation)."""

    def __init__(self, seq: Any, engine: Any, prefilled: Any, eos: frozenset[int]) -> None:
        self.seq, self.engine = seq, engine
        self.window: Window | None = None  # the forward the loop waits for (tokens, start, taps)
        self.done = False
        self._base = len(seq.reply)  # tokens kept from before a preemption
        self._eos = eos
        self._steps: Steps[DecodeResult] = drafted_decode_steps(
            StateTarget(engine, seq.state), seq.context, seq.choose,
            StopRule(seq.max_tokens - self._base, eos, seq.params.ignore_eos), engine.drafter,
            policy=engine.depth_policy(seq.params), on_tokens=self._on_tokens, prefilled=prefilled)

    def resume(self, answer: tuple[ForwardOutput, torch.Tensor] | None = None) -> None:
        """Run the loop until its next window or its end; `answer`: the last window's (output, logits)."""
        window, self.window = self.window, None
        try:
            with torch.inference_mode():
                if answer is None:
                    asked = next(self._steps)
                else:
                    out, logits = answer
                    assert window is not None, "resume() answered a window nobody asked for"
                    asked = self._steps.send(WindowOutput(start=window.start, logits=logits, hidden=out.hidden,
                                                          taps={k: out.taps[k] for k in window.taps}))
        except StopIteration as finished:
            self._finished(finished.value)
            return
        except _Cancelled:
            self.seq.finish_reason = "cancelled"
            self._steps.close()
            self.done = True
            return
        except BaseException:  # the scheduler re-raises it: the engine's state is unknown
            self.done = True
            raise
        self.window = asked

    def abort(self) -> None:
        """Stop the loop where it waits (its rows are about to be released); tokens handed out stay."""
        if not self.done:
            self._steps.close()
            self.window, self.done = None, True

    def _on_tokens(self, new: list[int]) -> None:
        self.seq.commit(new)
        if not self.seq.emit(new):
            raise _Cancelled

    def _finished(self, result: DecodeResult) -> None:
        seq = self.seq
        seq.stats["draft"] = result.stats.metrics() if hasattr(result.stats, "metrics") else {}
        last = seq.reply[-1] if seq.reply else None
        seq.finish_reason = "stop" if last in self._eos and not seq.params.ignore_eos else "length"
        self.done = True
