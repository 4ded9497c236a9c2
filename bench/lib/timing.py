"""GPU time of a kernel-sized call, without the host's launch cost in it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def graph_time_us(calls: list[Callable[[], Any]], replays: int = 10) -> float:
    """Mean GPU time of one call: the calls captured in one CUDA graph, replayed, event-timed.
    Pass calls over inputs (or weight copies) that together exceed L2, so each call reads memory."""
    for f in calls[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))
