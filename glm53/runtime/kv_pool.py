"""The KV pool of the batched runtime: where running sequences' rows live and how many fit.

`PagedPool`: pages of one store per rank, shared between sequences that share a prompt prefix, a
sequence's rows reached through its page table (glm53/model/paged_kv.py). It counts positions in
whole pages and refuses what its pages cannot take; the scheduler admits and preempts by it.
Decision record: docs/decisions/kv-pool.md.
"""
from __future__ import annotations

from typing import Callable

from glm53.model.kv_state import KVState
from glm53.model.paged_kv import PagedKVState, PageStore


class PagedPool:
    """Every running sequence's rows in pages of one PageStore (glm53/model/paged_kv.py), with
    the scheduler's interface: positions counted in whole pages (`block` positions a
    page), a page shared by several sequences counted once. The store is allocated here, once:
    `budget_bytes` of pages, at most what `max_positions` take.

    A cache split by position over R ranks (DCP) pages its local slots: a page of `block // R`
    slots holds `block` positions of all ranks, so `block` and the capacity count positions on
    every layout, and each rank's store holds 1/R of the bytes a position takes."""

    def __init__(self, probe: KVState, budget_bytes: int, page: int = 256, max_positions: int | None = None,
                 new_state: Callable[[PageStore], PagedKVState] = PagedKVState) -> None:
        """probe: a sequence's cache as the rank lays it out (what a slot holds, how many positions
        one stands for); new_state: an empty sequence in the store (the rank plan's new_paged_state)."""
        self.new_state = new_state
        ranks = probe.positions_per_slot  # R under DCP
        slots = max(1, page // ranks)  # local slots a page
        pages = max(1, budget_bytes // (probe.position_bytes() * slots))
        if max_positions is not None:
            pages = min(pages, -(-max_positions // (slots * ranks)))
        self.store = PageStore(probe, pages + 1, slots)  # + the null page
        self.block = slots * ranks  # positions a page
        self.position_bytes = max(1, probe.bytes_per_position())

    @property
    def capacity(self) -> int:
        """Positions the store's usable pages hold."""
        return self.store.usable_pages * self.block

    def limit(self, positions: int) -> None:
        """Hold at most `positions` (several ranks: the smallest rank's capacity), the rest of the
        store's pages never handed out."""
        self.store.limit(positions // self.block)

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
        return self.new_state(self.store) if self.fits(max(positions, 1)) else None

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
