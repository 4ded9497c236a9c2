"""The startup heap out of the garbage collector's walk.

A lane's process holds a large, lasting heap built before it serves: the model's modules and tensors,
compiled kernels, the tokenizer, the KV pool's bookkeeping (hundreds of thousands of tracked objects).
A collection of the oldest generation walks all of it, and stops the step loop while it does (tens of
ms at a 4-layer checkpoint on the CPU, more at 78 layers): a stall in every stream's gap between
tokens. Serving allocates little that lives, and what it drops refcounting frees, so after startup
the heap is moved to the permanent generation (gc.freeze) and later collections walk only what
serving allocated. The collector stays on: a cycle made while serving is still found.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once (startup's garbage is not kept), then freeze every object alive; returns how many
    objects the collector now skips. Call it once the process is loaded and ready to serve."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
