"""The KV pools of the batched runtime: where running sequences' rows live and how many fit.

`PagedPool` (one rank, the default): pages of one store, shared between sequences that share a
prompt prefix. `KVPool` (several ranks in lockstep, whose split caches are not paged): one byte
budget over contiguous per-sequence caches, as below.

Each sequence keeps its rows in its own KVState (contiguous per layer, so the attention and the
prefix cache's import/export work unchanged); the pool decides how many positions each may hold
and refuses what the budget cannot take. Capacity is granted in blocks of `block` positions and a
grant is exact (KVState.reserve(exact=True)), so the pool's count is what is allocated.
Decision record: docs/decisions/kv-pool.md.
"""
from __future__ import annotations

from typing import Callable

from glm53.model.kv_state import KVState
from glm53.model.paged_kv import PagedKVState, PageStore


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

    shared_blocks = 0  # contiguous caches share nothing

    def share_prefix(self, state: KVState, source: KVState, n: int) -> int:
        """Rows a fresh state takes from a running one in place: none here (the caller copies them)."""
        return 0

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


class PagedPool:
    """Every running sequence's rows in pages of one PageStore (glm53/model/paged_kv.py), with
    KVPool's interface for the scheduler: positions counted in whole pages (`block` = the page),
    a page shared by several sequences counted once. The store is allocated here, once: `budget_bytes`
    of pages, at most what `max_positions` take."""

    def __init__(self, probe: KVState, budget_bytes: int, page: int = 256, max_positions: int | None = None) -> None:
        self.position_bytes = max(1, probe.bytes_per_position())
        self.block = page
        pages = max(1, budget_bytes // (self.position_bytes * page))
        if max_positions is not None:
            pages = min(pages, -(-max_positions // page))
        self.store = PageStore(probe, pages + 1, page)  # + the null page
        self.capacity = self.store.usable_pages * page

    @property
    def used(self) -> int:
        return self.capacity - self.free

    @property
    def free(self) -> int:
        return self.store.free_pages * self.block

    @property
    def shared_blocks(self) -> int:
        """Pages held by more than one sequence (a prompt prefix shared in place)."""
        refs = self.store.refs[1:]  # not the null page
        return int((refs > 1).sum())

    def blocks(self, positions: int) -> int:
        return -(-positions // self.block) * self.block

    def fits(self, positions: int) -> bool:
        return self.blocks(positions) <= self.free

    def allocate(self, positions: int) -> PagedKVState | None:
        """An empty state when `positions` would fit (its pages come with ensure, after any shared
        prefix is in: sharing takes none), else None."""
        return PagedKVState(self.store) if self.fits(max(positions, 1)) else None

    def ensure(self, state: PagedKVState, positions: int) -> bool:
        """Pages in `state` for `positions`, the ones its next writes land in made private; False
        when the store has not enough free pages."""
        if state.pages_wanted(positions) > self.store.free_pages:
            return False
        state.reserve(positions)
        return True

    def share_prefix(self, state: PagedKVState, source: PagedKVState, n: int) -> int:
        """The whole pages of `source`'s first n canonical rows into the fresh `state`, in place (their
        counts raised); the positions taken."""
        return state.share_prefix(source, n)

    def release(self, state: PagedKVState | None) -> None:
        if state is not None:
            state.release()
