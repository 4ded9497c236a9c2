"""Tensor-parallel partitions (docs/distribution.md, "Who holds what") as [start, end) ranges per rank.

The arithmetic is glm53.layout.plan's `split_units` (the layout plan that decides which bytes each
rank reads), so the model's slices and the loader's reads cannot disagree:
- heads: contiguous, earlier ranks take the remainder (64/4 = 16 each; 64/3 = 22/21/21);
- intermediate widths (routed experts, shared expert, dense MLP): 128-column blocks, contiguous in
  rank order; the extra blocks go to rank (layer % R) and onward (16 blocks over 3 ranks: 6/5/5 at
  layer 0, 5/6/5 at layer 1, 5/5/6 at layer 2, ...);
- vocabulary: contiguous, earlier ranks take the remainder.
"""
from __future__ import annotations

from glm53.layout.plan import BLOCK as BLOCK_COLUMNS
from glm53.layout.plan import split_units


def head_ranges(n_heads: int, ranks: int) -> list[tuple[int, int]]:
    return list(split_units(n_heads, ranks))


def block_counts(n_blocks: int, ranks: int, layer: int) -> list[int]:
    return [b - a for a, b in split_units(n_blocks, ranks, layer % ranks)]


def column_ranges(width: int, ranks: int, layer: int, block: int = BLOCK_COLUMNS) -> list[tuple[int, int]]:
    """[start, end) columns of an intermediate of `width` per rank at `layer`, in whole blocks."""
    if width % block:
        raise ValueError(f"intermediate width {width} is not a multiple of the {block}-column block")
    return [(a * block, b * block) for a, b in split_units(width // block, ranks, layer % ranks)]


def vocab_ranges(vocab: int, ranks: int) -> list[tuple[int, int]]:
    return list(split_units(vocab, ranks))
