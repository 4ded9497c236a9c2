"""Timing a call: its GPU time without the host's launches (CUDA graphs), or one call as events or wall time."""
from __future__ import annotations

import time
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


def call_timer(device: torch.device | str) -> Callable[[Callable[[], object]], float]:
    """Seconds one call takes: CUDA events around it on a GPU (its device time, the host's launch
    included only where it stalls the stream), perf_counter on the CPU."""
    if torch.device(device).type == "cuda":
        def timed(fn: Callable[[], object]) -> float:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
    else:
        def timed(fn: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return timed
