"""A chunk's rows on one rank: named tensors (e.g. "latent.3", "scale.3", "index.3"), whatever
the engine caches per position. The cache never looks inside beyond dtype, shape and bytes."""
from __future__ import annotations

import torch

Rows = dict[str, torch.Tensor]


class StackedRows(dict):
    """Rows whose tensors are slices of a few stacks, as a node read into one buffer is:
    `stacks` holds (names, stack) with stack[i] the tensor named names[i]. A consumer may copy a
    whole stack at once (glm53.model.kv_state.KVState.import_rows); to anyone else it is plain Rows."""

    stacks: tuple[tuple[tuple[str, ...], torch.Tensor], ...] = ()


def rows_nbytes(rows: Rows) -> int:
    return sum(t.numel() * t.element_size() for t in rows.values())


def rows_to_host(rows: Rows) -> Rows:
    """An independent CPU copy (the engine may overwrite its buffers right after). Pageable
    memory on purpose: the pinned caching allocator rounds every block up to a power of two,
    which would make the host budget a fiction."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in rows.items()}


def rows_equal(a: Rows, b: Rows) -> bool:
    """Bitwise equality (NaN payloads included): compares raw bytes."""
    if a.keys() != b.keys():
        return False
    for name in a:
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    return True
