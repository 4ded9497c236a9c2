"""Copy drafts (prompt lookup): continue the longest n-gram suffix that occurred earlier.

The suffix of the committed tokens (longest first, max_ngram down to min_ngram) is looked up in
an index of every earlier n-gram; the tokens that followed its most recent earlier occurrence are
the drafts. Deterministic, no model, O(max_ngram) per committed token to keep the index current.
Strong on code and structured text, where spans repeat.
"""
from __future__ import annotations

from typing import Sequence

from ..target import WindowOutput
from .base import Sampler


class CopySource:
    name = "copy"
    taps: tuple[int, ...] = ()
    needs_hidden = False

    def __init__(self, *, min_ngram: int = 2, max_ngram: int = 8, max_depth: int = 13) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"copy drafts need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_depth = max_depth
        self._tokens: list[int] = []
        # n -> {n-gram: end index (exclusive) of its most recent occurrence}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed_upto = 0   # n-grams ending at or before this index are in the index

    def reset(self) -> None:
        self._tokens = []
        self._index = {n: {} for n in self._index}
        self._indexed_upto = 0

    def commit(self, tokens: Sequence[int], out: WindowOutput | None = None, kept_rows: int = 0) -> None:
        self._sync(tokens)

    def _sync(self, tokens: Sequence[int]) -> None:
        known = len(self._tokens)
        if known > len(tokens) or list(tokens[:known]) != self._tokens:
            self.reset()              # a different (or rewound) sequence: rebuild
            known = 0
        self._tokens.extend(int(t) for t in tokens[known:])

    def _index_until(self, end: int) -> None:
        # Index n-grams ending at positions (indexed_upto, end]; the current suffix itself (ending
        # at len(tokens)) is never indexed before it is queried, so a hit is always an earlier one.
        toks = self._tokens
        for e in range(self._indexed_upto + 1, end + 1):
            for n, table in self._index.items():
                if e - n >= 0:
                    table[tuple(toks[e - n:e])] = e
        self._indexed_upto = max(self._indexed_upto, end)

    def propose(self, tokens: Sequence[int], depth: int, sample: Sampler | None = None) -> list[int]:
        self._sync(tokens)
        toks = self._tokens
        size = len(toks)
        depth = min(depth, self.max_depth)
        if depth <= 0 or size < self.min_ngram + 1:
            return []
        self._index_until(size - 1)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            end = self._index[n].get(tuple(toks[size - n:]))
            if end is not None:
                return toks[end:end + depth]
        return []
