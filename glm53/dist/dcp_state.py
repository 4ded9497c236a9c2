"""The KV state of one sequence on one rank under DCP: only the positions this rank owns."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.dist import dcp
from glm53.model.kv_state import KVState


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
