"""The startup heap out of the garbage collector's walk.

A lane's process holds a large, lasting heap built before it serves: the model's modules and tensors,
compiled kernels, the tokenizer, the KV pool's bookkeeping (hundreds of thousands of tracked objects).
A collection of the oldest generation walks all of it, and stops the step loop while it does (37-75
ms at a 4-layer checkpoint on the CPU; the walk grows with the heap): a stall in every stream's gap
between tokens. Serving allocates little that lives, and what it drops refcounting frees, so after startup
the heap is moved to the permanent generation (gc.freeze) and later collections walk only what
serving allocated. The collector stays on: a cycle made while serving is still found, and its
pauses are counted for /metrics (`collector_pauses`).
"""
from __future__ import annotations

import gc
import time
from typing import Any

from glm53.runtime.durations import Durations


def freeze_startup_heap() -> int:
    """Collect once (startup's garbage is not kept), then freeze every object alive; returns how many
    objects the collector now skips. Call it once the process is loaded and ready to serve."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class CollectorPauses:
    """The collector's pauses in this process, by the oldest generation collected (gc.callbacks): the
    stalls a frozen heap keeps short, shown in /metrics. One per process (`collector_pauses`)."""

    def __init__(self) -> None:
        self.pauses = {generation: Durations() for generation in range(3)}
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses[info["generation"]].observe(time.perf_counter() - self._start)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        return {generation: d.snapshot() for generation, d in self.pauses.items()}


_pauses: CollectorPauses | None = None


def collector_pauses() -> CollectorPauses:
    """This process's pause counts, started on first use (the front's metrics start them)."""
    global _pauses
    if _pauses is None:
        _pauses = CollectorPauses()
    return _pauses
