"""Putting a hit's rows back into the engine's cache, reading disk nodes while earlier ones copy.

A lookup finds disk nodes through the index alone; their files are read here, when the engine
restores the hit. Reader threads read each file into one of a ring of reused buffers (pinned
where the cache lives on a GPU) with one readinto and verifies it there (disk.py); the caller's
thread takes the nodes in order, copies each to the device in one transfer into a scratch buffer
and from there into the cache's tensors. Host-tier nodes take the same path: a reader packs the
node's tensors into a ring buffer (diskfile.plan; a stored node's stacks one memcpy each,
diskfile.pack), so a node is one pinned transfer, not ~117 pageable ones (3.5-4 GB/s on the H200
host, against 55 GB/s pinned). At most `depth` nodes are in flight, so the memory a resume
needs is the ring's whatever its size (a 94k-token resume of GLM-5.3 is 8.7 GiB, the ring 16
buffers of ~25 MB), and no page of it is new (fresh buffers per file cost their page faults).
A buffer is refilled only after the transfer out of it has finished (an event per buffer). A
file that fails verification ends the restore at its node; the caller continues from there (the
engine prefills the rest; ranks agree again on what all of them restored).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from . import diskfile
from .disk import DiskTier, default_threads
from .hit import Piece
from .rows import Rows

WriteRows = Callable[[int, int, Rows], None]

# what a node's ring buffer holds beyond its rows: a disk file's header and each tensor's 64-byte
# alignment (GLM-5.3 at 78 layers: ~117 tensors, a header of a few KB)
RING_SLACK = 1 << 20


def node_bytes(block: int, position_bytes: int, ranks: int = 1, dcp: bool = False) -> int:
    """Ring room for one full node: `block` positions of `position_bytes` each (this rank's local
    slots: a quarter of them at DCP 4) and RING_SLACK."""
    slots = -(-block // ranks) if dcp else block
    return slots * position_bytes + RING_SLACK


class Restorer:
    def __init__(self, disk: DiskTier | None, pinned: bool, threads: int | None = None, ring_bytes: int = 0) -> None:
        self.disk = disk
        self.pinned = pinned and torch.cuda.is_available()
        self.threads = threads or (disk.threads if disk is not None else default_threads())
        self.depth = 2 * self.threads  # a node in each reader's hands and one waiting per reader
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: list[torch.Tensor | None] = [None] * self.depth
        self._copied: list[torch.cuda.Event | None] = [None] * self.depth  # the transfer out of each buffer
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()  # one restore at a time: the ring is shared
        self.files_read = 0
        self.nodes_packed = 0
        # the copying thread's time, summed over restores: blocked on the readers, and its own
        # work (transfers queued, rows written); which one dominates says what bounds a resume
        self.waited_s = 0.0
        self.copying_s = 0.0
        # the readers' time, summed over their tasks: blocked until their ring buffer's previous
        # transfer finished, and reading, verifying or packing (8 readers: up to 8x the wall time)
        self.ring_waited_s = 0.0
        self.reading_s = 0.0
        self._count = threading.Lock()
        # pinned memory: allocated at start-up, not in the first resume; `ring_bytes` sizes a node
        # whether or not the disk has files yet (a host-tier restore needs the ring too)
        biggest = max(disk.largest_file() if disk is not None else 0, ring_bytes)
        if self.pinned and biggest:
            self._buffers = [torch.empty(biggest, dtype=torch.uint8, pin_memory=True) for _ in range(self.depth)]

    def restore(self, pieces: Sequence[Piece], write_rows: WriteRows, device: torch.device | str | None) -> int:
        """write_rows(start, length, rows) for each piece in order (rows that went through the ring
        are valid only during the call). Returns where the restored rows end: the last piece's
        end, or the start of the first disk piece whose file was a miss."""
        if not pieces:
            return 0
        dev = torch.device(device) if device is not None else torch.device("cpu")
        plans = [self._plan(p) for p in pieces]
        need = max((plan[0] for plan in plans if plan is not None), default=0)
        with self._lock:
            futures: dict[int, Future] = {}

            def submit(i: int) -> None:
                if i < len(pieces) and plans[i] is not None:
                    futures[i] = self._readers().submit(self._fill, i % self.depth, pieces[i], plans[i], need)

            for i in range(self.depth):
                submit(i)
            end = pieces[0].start
            try:
                for i, piece in enumerate(pieces):
                    if i in futures:
                        t0 = time.perf_counter()
                        got = futures.pop(i).result()
                        t1 = time.perf_counter()
                        self.waited_s += t1 - t0
                        if got is None:
                            break
                        if piece.source == "disk":
                            self.files_read += 1
                        else:
                            self.nodes_packed += 1
                        rows = self._on_device(*got, slot=i % self.depth, device=dev)
                    else:  # a disk node gone from the index since the lookup
                        break
                    write_rows(piece.start, piece.length, rows)
                    end = piece.start + piece.length
                    submit(i + self.depth)
                    self.copying_s += time.perf_counter() - t1
            finally:
                for f in futures.values():  # reads past a miss: done before their buffers are reused
                    f.result()
            return end

    def take_times(self) -> dict[str, float]:
        """Seconds since the last call, then zeroed: the copying thread's `waited` (on the readers)
        and `copying` (its own work); the readers' `ring_waited` (on their buffer's previous
        transfer) and `reading` (their own work), summed over readers."""
        with self._count:
            times = {"waited": self.waited_s, "copying": self.copying_s,
                     "ring_waited": self.ring_waited_s, "reading": self.reading_s}
            self.waited_s = self.copying_s = self.ring_waited_s = self.reading_s = 0.0
        return times

    def _plan(self, piece: Piece) -> tuple[int, list | None] | None:
        """(bytes the piece needs in the ring, a host piece's layout); None for a disk node gone
        from the index. Every piece takes the ring, to a CPU cache too: one path for all, which
        the CPU tests then run whole (a CPU cache pays one more copy of its host rows)."""
        if piece.source == "disk":
            e = self.disk.entry(piece.node) if self.disk is not None else None
            return None if e is None else (e.size, None)
        runs, size = diskfile.plan(piece.rows)
        return size, runs

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kv_cache-restore")
        return self._pool

    def _fill(self, slot: int, piece: Piece, plan: tuple[int, list | None], need: int) -> tuple[int, torch.Tensor, list] | None:
        """A reader's task: the piece's node in ring buffer `slot`, as (bytes, buffer, layout): a
        disk node's file read and verified (its layout worked out here, off the thread that
        copies: DiskTier.read), a host node's rows packed; None: a miss."""
        t0 = time.perf_counter()
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        t1 = time.perf_counter()
        buf = self._buffers[slot]
        if buf is None or buf.numel() < need:
            buf = self._buffers[slot] = torch.empty(need, dtype=torch.uint8, pin_memory=self.pinned)
        if piece.source == "disk":
            got = self.disk.read(piece.node, buf)
        else:
            size, runs = plan
            diskfile.pack(piece.rows, runs, buf)
            got = size, buf, runs
        with self._count:
            self.ring_waited_s += t1 - t0
            self.reading_s += time.perf_counter() - t1
        return got

    def _on_device(self, nbytes: int, buf: torch.Tensor, runs: list, *, slot: int, device: torch.device) -> Rows:
        """The node's rows where the cache is: views of the ring buffer on the CPU; on a GPU, views
        of a scratch buffer the node went to in one transfer (the cache's copies out of it follow
        on the same stream, so the next transfer into it waits for them)."""
        if device.type == "cpu":
            return diskfile.views(runs, buf)
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < nbytes:
            scratch = self._scratch[device] = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
        scratch[:nbytes].copy_(buf[:nbytes], non_blocking=True)
        if device.type == "cuda":
            event = self._copied[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return diskfile.views(runs, scratch)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers = [None] * self.depth
        self._scratch.clear()
