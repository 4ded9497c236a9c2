"""Tensor-parallel partition rules (DESIGN.md "Layout across ranks"), as pure functions.

- heads: contiguous ranges, earlier ranks take the remainder (64/4 = 16 each; 64/3 = 22/21/21);
- intermediate widths (routed experts, shared expert, dense MLP): 128-column blocks, contiguous
  per rank in rank order; with a remainder the extra blocks rotate by layer index (16 blocks over
  3 ranks: 6/5/5 at layer 0, 5/6/5 at layer 1, 5/5/6 at layer 2, ...), so no rank is always the
  heaviest;
- vocabulary: contiguous ranges, earlier ranks take the remainder.

glm53.layout.plan is the authority for which bytes each rank reads; these rules are the same ones
(tests/test_dist_tp.py checks the two agree when the plan is importable).
"""
from __future__ import annotations

BLOCK_COLUMNS = 128


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges of n items over `parts` ranks, earlier ranks taking the remainder."""
    if parts < 1:
        raise ValueError(f"cannot split over {parts} ranks")
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def head_ranges(n_heads: int, ranks: int) -> list[tuple[int, int]]:
    return split_evenly(n_heads, ranks)


def block_counts(n_blocks: int, ranks: int, layer: int) -> list[int]:
    """Blocks per rank at `layer`: the remainder goes to ranks layer, layer+1, ... (mod R)."""
    base, extra = divmod(n_blocks, ranks)
    counts = [base] * ranks
    for i in range(extra):
        counts[(layer + i) % ranks] += 1
    return counts


def column_ranges(width: int, ranks: int, layer: int, block: int = BLOCK_COLUMNS) -> list[tuple[int, int]]:
    """[start, end) columns of an intermediate of `width` per rank at `layer`, in whole blocks."""
    if width % block:
        raise ValueError(f"intermediate width {width} is not a multiple of the {block}-column block")
    ranges, start = [], 0
    for count in block_counts(width // block, ranks, layer):
        ranges.append((start, start + count * block))
        start += count * block
    return ranges


def vocab_ranges(vocab: int, ranks: int) -> list[tuple[int, int]]:
    return split_evenly(vocab, ranks)
