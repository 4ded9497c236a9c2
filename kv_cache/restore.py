"""Putting a hit's rows back into the engine's cache, reading disk nodes while earlier ones copy.

A lookup finds disk nodes through the index alone; their files are read here, when the engine
restores the hit. Reader threads read each file with one readinto into one of a ring of reused
buffers (pinned where the cache lives on a GPU) and verify it there (diskfile.py); the caller's
thread takes the nodes in order, copies each file to the device in one transfer into a scratch
buffer and from there into the cache's tensors. At most `depth` files are in flight, so the
memory a resume needs is the ring's whatever its size (a 94k-token resume of GLM-5.3 is 8.7 GiB,
the ring 16 buffers of ~25 MB), and no page of it is new (fresh buffers per file cost their page
faults). A buffer is refilled only after the transfer out of it has finished (an event per
buffer). A file that fails verification ends the restore at its node; the caller continues from
there (the engine prefills the rest; ranks agree again on what all of them restored).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from . import diskfile
from .disk import DiskTier
from .hit import Piece
from .rows import Rows

WriteRows = Callable[[int, int, Rows], None]


class Restorer:
    def __init__(self, disk: DiskTier, pinned: bool) -> None:
        self.disk = disk
        self.pinned = pinned and torch.cuda.is_available()
        self.depth = 2 * disk.threads  # a file in each reader's hands and one waiting per reader
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: list[torch.Tensor | None] = [None] * self.depth
        self._copied: list[torch.cuda.Event | None] = [None] * self.depth  # the transfer out of each buffer
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()  # one restore at a time: the ring is shared
        self.files_read = 0
        if self.pinned:  # pinned memory is slow to allocate: at start-up, not in the first resume
            biggest = disk.largest_file()
            if biggest:
                self._buffers = [torch.empty(biggest, dtype=torch.uint8, pin_memory=True) for _ in range(self.depth)]

    def restore(self, pieces: Sequence[Piece], write_rows: WriteRows, device: torch.device | str | None) -> int:
        """write_rows(start, length, rows) for each piece in order (a disk piece's rows are valid
        only during the call: they live in the ring). Returns where the restored rows end: the
        last piece's end, or the start of the first disk piece whose file was a miss."""
        if not pieces:
            return 0
        dev = torch.device(device) if device is not None else torch.device("cpu")
        sizes = {i: self._size(p) for i, p in enumerate(pieces) if p.source == "disk"}
        need = max((s for s in sizes.values() if s is not None), default=0)
        with self._lock:
            futures: dict[int, Future] = {}

            def submit(i: int) -> None:
                if i < len(pieces) and sizes.get(i) is not None:
                    futures[i] = self._readers().submit(self._fill, i % self.depth, pieces[i].node, need)

            for i in range(self.depth):
                submit(i)
            end = pieces[0].start
            try:
                for i, piece in enumerate(pieces):
                    if piece.source == "disk":
                        got = futures.pop(i).result() if i in futures else None
                        if got is None:
                            break
                        self.files_read += 1
                        rows = self._on_device(*got, slot=i % self.depth, device=dev)
                    else:
                        rows = piece.rows
                    write_rows(piece.start, piece.length, rows)
                    end = piece.start + piece.length
                    submit(i + self.depth)
            finally:
                for f in futures.values():  # reads past a miss: done before their buffers are reused
                    f.result()
            return end

    def _size(self, piece: Piece) -> int | None:
        e = self.disk.entry(piece.node)
        return None if e is None else e.size

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.disk.threads, thread_name_prefix="kv_cache-disk-read")
        return self._pool

    def _fill(self, slot: int, h: bytes, need: int) -> tuple[diskfile.Header, torch.Tensor, list] | None:
        """A reader's task: node h's file, verified, in ring buffer `slot`, and its tensors'
        layout (worked out here, off the thread that copies: DiskTier.read); None: a miss."""
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        buf = self._buffers[slot]
        if buf is None or buf.numel() < need:
            buf = self._buffers[slot] = torch.empty(need, dtype=torch.uint8, pin_memory=self.pinned)
        return self.disk.read(h, buf)

    def _on_device(self, hdr: diskfile.Header, buf: torch.Tensor, runs: list, *, slot: int,
                   device: torch.device) -> Rows:
        """The file's rows where the cache is: views of the ring buffer on the CPU; on a GPU, views
        of a scratch buffer the whole file went to in one transfer (the cache's copies out of it
        follow on the same stream, so the next transfer into it waits for them)."""
        if device.type == "cpu":
            return diskfile.views(hdr, buf, runs)
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < hdr.file_size:
            scratch = self._scratch[device] = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
        scratch[:hdr.file_size].copy_(buf[:hdr.file_size], non_blocking=True)
        if device.type == "cuda":
            event = self._copied[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return diskfile.views(hdr, scratch, runs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers = [None] * self.depth
        self._scratch.clear()
