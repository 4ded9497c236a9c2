"""The KV state of one sequence on one rank under DCP: only the positions this rank owns, in a
cache of its own (DcpKVState) or in pages of the rank's KV pool (PagedDcpKVState)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.dist import dcp
from glm53.model.kv_state import KVState
from glm53.model.paged_kv import PagedKVState, PageStore


@dataclass
class DcpKVState(KVState):
    """KVState holding only this rank's positions (p % R == rank, at slot p // R).

    Writes take rows for absolute positions and keep the owned ones; reads return only the owned
    rows of [0, stop), in position order, and `owned_positions(stop)` says which positions they
    are (the model scores and attends over exactly these). Capacity counts local slots."""

    own: dcp.Ownership = dcp.Ownership(0, 1)

    def reserve(self, n: int, exact: bool = False) -> None:
        super().reserve(self.own.count(n), exact)

    def bytes_per_position(self) -> int:
        """A position's share of this rank's bytes (it holds one position in R): what a KV pool
        counts, so that R ranks' pools hold as many positions as one rank's of R times the bytes."""
        return -(-super().bytes_per_position() // self.own.ranks)

    def owned_positions(self, stop: int) -> torch.Tensor | None:
        if self.own.ranks == 1:
            return None
        return self.own.owned_positions(0, stop, device=self.device)

    def write_latent(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._write_owned(self.latent[layer], self.latent_scale[layer], start, rows)

    def write_index(self, layer: int, start: int, rows: torch.Tensor) -> None:
        self._write_owned(self.index_keys[layer], self.index_scale[layer], start, rows)

    def read_latent(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.latent[layer], self.latent_scale[layer], self.own.count(stop), dtype)

    def read_index(self, layer: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.index_keys[layer], self.index_scale[layer], self.own.count(stop), dtype)

    def slots(self, start: int, stop: int) -> tuple[int, int]:
        """This rank's local slots of positions [start, stop): [own.count(start), own.count(stop)).
        The prefix cache stores and restores exactly these per rank (each rank its own chunk rows)."""
        return self.own.count(start), self.own.count(stop)

    def _write_owned(self, store: torch.Tensor, scale: torch.Tensor | None, start: int, rows: torch.Tensor) -> None:
        slots, mine = self.own.rows_to_write(start, rows)
        if slots.numel():
            self._write(store, scale, int(slots[0]), mine)  # owned slots of a range are consecutive

    @property
    def positions_per_slot(self) -> int:
        return self.own.ranks


class PagedDcpKVState(PagedKVState):
    """PagedKVState holding only this rank's positions (p % R == rank at local slot p // R, as
    DcpKVState), its local slots in pages: slot s at table[s // page] * page + s % page.

    What every rank must decide alike is counted in whole positions of all ranks: a context of n
    positions takes pages for ceil(n / R) slots on every rank (rank 0 holds that many; the others
    one fewer at most), a shared prefix is whole pages of every rank (page * R positions), and the
    pages made private before a write start where the lowest rank's next write lands. So the ranks'
    stores take, share and free the same pages step by step and their pools admit alike."""

    def __init__(self, store: PageStore, own: dcp.Ownership) -> None:
        super().__init__(store)
        self.own = own

    @property
    def positions_per_page(self) -> int:
        return self.store.page * self.own.ranks

    def _local_count(self, n: int) -> int:
        return self.own.count(n)

    def _local_room(self, n: int) -> int:
        return -(-n // self.own.ranks)

    def _first_write_slot(self) -> int:
        return self.length // self.own.ranks

    def _window_rows(self, start: int | None, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if start is None:
            raise NotImplementedError("a split cache's window starts at a host position (not captured as a graph)")
        mine = self.own.owned_positions(start, start + positions.shape[0], device=positions.device)
        return torch.div(mine, self.own.ranks, rounding_mode="floor"), mine - start

    def owned_positions(self, stop: int) -> torch.Tensor | None:
        if self.own.ranks == 1:
            return None
        return self.own.owned_positions(0, stop, device=self.device)

    def bytes_per_position(self) -> int:
        return -(-self.store.position_bytes // self.own.ranks)

    def write_latent_at(self, layer: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        raise NotImplementedError("a split cache writes from a host start (windows over several ranks are not "
                                  "captured as graphs)")

    write_index_at = write_latent_at
