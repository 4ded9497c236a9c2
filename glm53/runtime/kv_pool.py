"""One byte budget for the KV rows of every running sequence.

Each sequence keeps its rows in its own KVState (contiguous per layer, so the attention and the
prefix cache's import/export work unchanged); the pool decides how many positions each may hold
and refuses what the budget cannot take. Capacity is granted in blocks of `block` positions and a
grant is exact (KVState.reserve(exact=True)), so the pool's count is what is allocated.
Decision record: docs/decisions/kv-pool.md.
"""
from __future__ import annotations

from typing import Callable

from glm53.model.kv_state import KVState


class KVPool:
    def __init__(self, new_state: Callable[[], KVState], budget_bytes: int, block: int = 256) -> None:
        probe = new_state()
        self.new_state = new_state
        self.position_bytes = max(1, probe.bytes_per_position())
        self.block = block
        self.capacity = max(block, budget_bytes // self.position_bytes // block * block)  # positions
        self._held: dict[int, int] = {}  # id(state) -> positions granted

    @property
    def used(self) -> int:
        """Positions granted to live states."""
        return sum(self._held.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def blocks(self, positions: int) -> int:
        """Positions rounded up to whole blocks."""
        return -(-positions // self.block) * self.block

    def fits(self, positions: int) -> bool:
        return self.blocks(positions) <= self.free

    def allocate(self, positions: int) -> KVState | None:
        """A fresh state with room for `positions`, or None when the budget cannot take it."""
        grant = self.blocks(max(positions, 1))
        if grant > self.free:
            return None
        state = self.new_state()
        state.reserve(grant, exact=True)
        self._held[id(state)] = grant
        return state

    def ensure(self, state: KVState, positions: int) -> bool:
        """Room in `state` for `positions`: grown by half its size where the budget allows (fewer
        copies of its rows), else to the blocks it needs; False when even that does not fit."""
        held = self._held[id(state)]
        if positions <= held:
            return True
        want = self.blocks(max(positions, held + held // 2))
        if want - held > self.free:
            want = self.blocks(positions)
            if want - held > self.free:
                return False
        state.reserve(want, exact=True)
        self._held[id(state)] = want
        return True

    def release(self, state: KVState | None) -> None:
        if state is None:
            return
        self._held.pop(id(state), None)
