"""The memory guard every rank runs while serving: below the floor, stop the lane cleanly.

Running a unified-memory machine out of memory freezes it (no OOM error, just a dead node), so
each rank watches its node's MemAvailable and exits with EXIT_MEMORY_GUARD and a message naming
the node, the numbers and the fix before that happens; the launcher then stops the other ranks.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Callable

from glm53.serving.meminfo import MIB, PROC_MEMINFO, available_bytes

EXIT_MEMORY_GUARD = 75
DEFAULT_INTERVAL_S = 1.0


def breach_message(rank: int, available: int, floor: int) -> str:
    return (f"memory guard: rank {rank} on {socket.gethostname()}: available memory {available // MIB} MiB fell "
            f"below the floor of {floor // MIB} MiB; stopping the lane before the node runs out. "
            f"Fix: free memory on that node, or serve a shorter context (--context), or lower the floor "
            f"(TF_GLM53_MEM_FLOOR_MB) if you are sure")


class MemoryGuard(threading.Thread):
    """Polls available memory (of the `meminfo` file); calls `on_breach(message)` once when it drops
    below `floor` bytes (Settings.mem_floor_mb: TF_GLM53_MEM_FLOOR_MB)."""

    def __init__(self, rank: int, floor: int, interval: float = DEFAULT_INTERVAL_S,
                 on_breach: Callable[[str], None] | None = None, meminfo: str = PROC_MEMINFO) -> None:
        super().__init__(name="memory-guard", daemon=True)
        self.rank, self.floor, self.interval, self.meminfo = rank, floor, interval, meminfo
        self.on_breach = on_breach or _exit_lane
        self._stop = threading.Event()

    def check(self) -> str | None:
        available = available_bytes(self.meminfo)
        return breach_message(self.rank, available, self.floor) if available < self.floor else None

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            message = self.check()
            if message:
                self.on_breach(message)
                return

    def stop(self) -> None:
        self._stop.set()


def _exit_lane(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_MEMORY_GUARD)
