"""The token ids a KV state holds, as a list that also keeps an int64 array of itself current.

The prefix cache compares every prompt with the live tokens. Converting a Python list of n ids to
an array costs ~50 ns an id (a 1M-token conversation: ~50 ms a request); this list converts only
what was appended since the last `array()` call. Appends keep the array's prefix valid; every
other mutation (truncation through `del`, item or slice assignment, insert, pop, remove, sort,
reverse, clear, *=) marks the array valid only below the first index it may have changed.
"""
from __future__ import annotations

from typing import Iterable, SupportsIndex

import numpy as np


class TokenLog(list):
    def __init__(self, ids: Iterable[int] = ()) -> None:
        super().__init__(ids)
        self._arr = np.empty(0, dtype=np.int64)
        self._valid = 0  # self._arr[:_valid] == self[:_valid]

    def array(self) -> np.ndarray:
        """The ids as a read-only int64 array (valid until the next mutation)."""
        n = len(self)
        valid = min(self._valid, n)
        if self._arr.shape[0] < n:
            grown = np.empty(max(n, 2 * self._arr.shape[0], 1024), dtype=np.int64)
            grown[:valid] = self._arr[:valid]
            self._arr = grown
        if valid < n:
            self._arr[valid:n] = self[valid:n]
        self._valid = n
        view = self._arr[:n]
        view.flags.writeable = False
        return view

    def _changed_from(self, index: int) -> None:
        self._valid = min(self._valid, max(0, index))

    def _first_index(self, key: SupportsIndex | slice) -> int:
        if isinstance(key, slice):
            start, _, step = key.indices(len(self))
            return start if step == 1 else 0
        i = key.__index__()
        return i + len(self) if i < 0 else i

    def __setitem__(self, key, value) -> None:
        self._changed_from(self._first_index(key))
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changed_from(self._first_index(key))
        super().__delitem__(key)

    def insert(self, index: SupportsIndex, value: int) -> None:
        self._changed_from(min(self._first_index(index), len(self)))
        super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> int:
        self._changed_from(self._first_index(index))
        return super().pop(index)

    def remove(self, value: int) -> None:
        self._changed_from(0)
        super().remove(value)

    def clear(self) -> None:
        self._changed_from(0)
        super().clear()

    def sort(self, *args, **kwargs) -> None:
        self._changed_from(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._changed_from(0)
        super().reverse()

    def __imul__(self, n: SupportsIndex) -> "TokenLog":
        if n.__index__() <= 0:
            self._changed_from(0)
        return super().__imul__(n)
