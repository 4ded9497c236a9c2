"""The collectives the layout needs, each guarded (timed, failures name the peer).

Sums that must be deterministic at any rank count go through ``sum_in_rank_order``: gather every
rank's part, then add them in rank order 0, 1, ..., R-1 on every rank, so every rank holds the
same bits and a rerun gives the same bits whatever the backend's reduction algorithm. For the
decode-sized messages of this model (a few KiB) the extra bytes cost less than a round trip.
"""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
import torch.distributed as dist

from glm53.dist.guard import DistFailure, Guard

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); the GPU machine has 2.11.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def byte_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t's values as [rows, bytes per row] uint8, in t's row-major order (a dense copy where t's
    layout does not allow the view: a transposed or size-1 last dimension)."""
    flat = t.reshape(rows, -1)
    if flat.stride(-1) != 1 or not flat.is_contiguous():
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8)


class Comm:
    """One rank's view of the group: rank, world size, device, backend, guarded collectives."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str, guard: Guard,
                 store: dist.Store) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.backend = device, backend
        self.guard, self.store = guard, store

    # ---- collectives ---------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor, name: str = "all_gather") -> torch.Tensor:
        """Every rank's tensor (same shape and dtype on all ranks), stacked in rank order: [R, *shape]."""
        flat = tensor.contiguous().view(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        with self.guard.collective(name):
            _all_gather_flat(out, flat)  # the concatenated form: gloo and NCCL both accept it
        return out.view(self.world_size, *tensor.shape)

    def all_gather_packed(self, tensors: Sequence[torch.Tensor], name: str = "all_gather_packed") -> list[torch.Tensor]:
        """Several tensors (any dtypes; the same shapes on all ranks) in one all-gather: their bytes
        side by side, each piece 8-byte aligned. One round trip instead of len(tensors); each comes
        back as all_gather would return it, [R, *shape] in its own dtype."""
        pieces: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for t in tensors:
            raw = byte_rows(t, 1).view(-1)
            spans.append((offset, raw.numel()))
            pieces.append(raw)
            pad = -raw.numel() % 8
            if pad:
                pieces.append(raw.new_zeros(pad))
            offset += raw.numel() + pad
        gathered = self.all_gather(torch.cat(pieces), name)  # [R, offset] bytes
        return [gathered[:, a:a + n].contiguous().view(t.dtype).view(self.world_size, *t.shape)
                for t, (a, n) in zip(tensors, spans)]

    def all_to_all(self, chunks: torch.Tensor, name: str = "all_to_all") -> torch.Tensor:
        """chunks [R, *shape]: chunk j goes to rank j; returns [R, *shape], row i from rank i."""
        chunks = chunks.contiguous()
        out = torch.empty_like(chunks)
        with self.guard.collective(name):
            dist.all_to_all_single(out, chunks)
        return out

    def sum_in_rank_order(self, tensor: torch.Tensor, name: str = "sum_in_rank_order") -> torch.Tensor:
        """Deterministic all-reduce: gather, then add in fixed rank order (fp32 accumulation)."""
        parts = self.all_gather(tensor, name)
        acc = parts[0].float()
        for r in range(1, self.world_size):
            acc = acc + parts[r].float()
        return acc.to(tensor.dtype)

    def all_reduce_sum(self, tensor: torch.Tensor, name: str = "all_reduce") -> torch.Tensor:
        """The backend's own all-reduce (in place); same bits on every rank, order is the backend's."""
        with self.guard.collective(name):
            dist.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0, name: str = "broadcast") -> torch.Tensor:
        with self.guard.collective(name):
            dist.broadcast(tensor, src)
        return tensor

    def broadcast_object(self, obj: object, src: int = 0, name: str = "broadcast_object") -> object:
        box = [obj]
        with self.guard.collective(name):
            dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self, name: str = "barrier") -> None:
        with self.guard.collective(name):
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def store_barrier(self, tag: str, timeout_s: float) -> None:
        """Wait for every rank to reach `tag`, through the store, not a collective: for long
        uneven phases (loading weights) that must not trip the collective timeout. The guard
        still stops the rank within seconds if a peer dies meanwhile."""
        self.store.set(f"glm53/barrier/{tag}/{self.rank}", "1")
        keys = {r: f"glm53/barrier/{tag}/{r}" for r in range(self.world_size)}
        deadline = time.monotonic() + timeout_s
        while keys:
            if self.guard.failure is not None:
                raise DistFailure(self.guard.failure)
            keys = {r: k for r, k in keys.items() if not self.store.check([k])}
            if keys and time.monotonic() > deadline:
                raise DistFailure(f"glm53.dist: rank {self.rank}: ranks {sorted(keys)} did not reach '{tag}' "
                                  f"within {timeout_s:.0f} s")
            time.sleep(0.05)

    # ---- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        """Orderly leave: stop the heartbeat (peers see 'bye'), meet at a barrier, tear down."""
        self.guard.stop()
        with contextlib.suppress(Exception):
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
