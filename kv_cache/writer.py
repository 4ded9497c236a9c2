"""Writes chains to a DiskTier on one background thread, so disk I/O stays off the request's path;
touches (a file time per node) go the same way.

The rows handed over are the host tier's copies, never modified afterwards. `flush` waits for
everything submitted (the facade registers it at exit, so a stopping server finishes its writes).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Sequence

from .disk import DiskTier
from .node import Node

log = logging.getLogger("kv_cache")


class BackgroundWriter:
    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.written = 0
        self._jobs: "queue.Queue[tuple[bytes, list[Node], list[bytes]] | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv_cache-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, root: bytes, nodes: Sequence[Node], held: Sequence[bytes] = ()) -> None:
        """Write the chain's absent nodes, then touch `held` (the blocks before them), root newest."""
        self._jobs.put((root, list(nodes), list(held)))

    def touch(self, chain: Sequence[bytes]) -> None:
        """Mark a chain used (in order, after everything submitted before)."""
        self._jobs.put((b"", [], list(chain)))

    def flush(self) -> None:
        """Wait until every submitted chain is on disk (or failed and was logged)."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                root, nodes, held = job
                if nodes:
                    self.written += self.tier.put_chain(root, nodes)
                self.tier.touch_chain(held)
            except Exception:  # a cache write must never take the server down
                log.exception("kv_cache disk: background write failed; entry skipped")
            finally:
                self._jobs.task_done()
