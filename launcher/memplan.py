"""The memory plan: what each rank needs against what its node has available now.

Per rank: its share of the weights (glm53.layout's plan, from the safetensors headers), KV for the
requested context (glm53.layout.kv; DCP divides positions across ranks), a workspace, and a stated
overhead (a fixed part plus a fraction of weights + KV). A start is refused when any node would be
left under the floor, and the plan says the largest context that fits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from glm53.config import Glm53Config
from glm53.layout.kv import kv_bytes_per_rank, kv_token_bytes
from glm53.layout.plan import plan_layout
from launcher.config import MemorySettings
from glm53.serving.meminfo import GIB, MIB

@dataclass(frozen=True)
class RankNeed:
    rank: int
    node: str
    weights: int
    kv: int
    workspace: int
    overhead: int
    available: int  # on this rank's node now
    floor: int
    left: int  # what the node keeps once every rank on it has what it needs

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.workspace + self.overhead

    @property
    def fits(self) -> bool:
        return self.left >= self.floor


@dataclass(frozen=True)
class MemoryPlan:
    context: int
    ranks: tuple[RankNeed, ...]
    largest_context: int  # the longest context every node can hold above the floor (0: none)
    weights_source: str
    kv_bytes_per_token: int  # all layers, one position, before DCP
    unified: bool
    max_context: int = 0  # the model's max_position_embeddings (0: unknown)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def table(self) -> str:
        head = f"memory plan: context {self.context} tokens, KV {self.kv_bytes_per_token} B/token, " \
               f"{'unified memory (conservative)' if self.unified else 'device memory'}; weights: {self.weights_source}"
        rows = [head, f"  {'rank':<5}{'node':<18}{'weights':>10}{'kv':>10}{'work':>9}{'overhd':>9}"
                      f"{'need':>10}{'avail':>10}{'left':>10}{'floor':>9}  ok"]
        for r in self.ranks:
            rows.append(f"  {r.rank:<5}{r.node[:17]:<18}{_gib(r.weights):>10}{_gib(r.kv):>10}{_gib(r.workspace):>9}"
                        f"{_gib(r.overhead):>9}{_gib(r.need):>10}{_gib(r.available):>10}{_gib(r.left):>10}"
                        f"{_gib(r.floor):>9}  {'yes' if r.fits else 'NO'}")
        rows.append(f"  largest context that fits every node: {self.largest_context} tokens")
        return "\n".join(rows)

    def refusal(self) -> str | None:
        if self.max_context and self.context > self.max_context:
            # the front would accept requests the engine then refuses, stopping the lane
            return (f"--context {self.context} is more than the model holds (config.json "
                    f"max_position_embeddings = {self.max_context}): serve at most --context {self.max_context}")
        bad = [r for r in self.ranks if not r.fits]
        if not bad:
            return None
        worst = min(bad, key=lambda r: r.left - r.floor)
        fix = (f"serve a context of at most {self.largest_context} tokens (--context {self.largest_context})"
               if self.largest_context > 0 else "the weights alone do not fit: use more ranks or free memory")
        return (f"memory plan refuses the start: rank {worst.rank} on {worst.node} would have "
                f"{_gib(worst.left)} left of {_gib(worst.available)} available, under the floor of "
                f"{_gib(worst.floor)} (needs weights {_gib(worst.weights)} + KV {_gib(worst.kv)} for "
                f"{self.context} tokens + workspace {_gib(worst.workspace)} + overhead {_gib(worst.overhead)}). "
                f"Fix: {fix}")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}G" if abs(n) >= GIB // 10 else f"{n / MIB:.1f}M"


def kv_per_token(model_dir: str | Path, kv_dtype: str, include_mtp: bool = True) -> int:
    """Cached bytes for one position over all layers (glm53.layout.kv: latent + full-indexer keys);
    include_mtp=False: the model's layers alone (what a sequence's KVState holds)."""
    return kv_token_bytes(Glm53Config.from_dir(model_dir), kv_dtype, include_mtp).per_token


def kv_function(model_dir: str | Path, ranks: int, dcp: bool, kv_dtype: str) -> Callable[[int], list[int]]:
    """context -> KV bytes each rank holds (DCP: position p on rank p % R)."""
    cfg = Glm53Config.from_dir(model_dir)
    return lambda context: kv_bytes_per_rank(cfg, context, ranks, dcp=dcp, kv_dtype=kv_dtype)


def weights_per_rank(model_dir: str | Path, ranks: int) -> tuple[list[int], str]:
    """Bytes of weights each rank holds, from glm53.layout's plan (safetensors headers only)."""
    return plan_layout(model_dir, ranks).bytes_per_rank(), "glm53.layout plan (safetensors headers)"


def plan_memory(*, context: int, per_token: int, kv_for: Callable[[int], list[int]], weights: list[int],
                weights_source: str, available: list[tuple[str, int]], settings: MemorySettings, unified: bool,
                max_context: int) -> MemoryPlan:
    """available[r] = (node name, bytes available now for rank r); kv_for(context)[r] = rank r's KV bytes."""
    ranks = len(weights)
    floor = int(settings.floor_gib * GIB)
    workspace = int(settings.workspace_gib * GIB)
    fraction = settings.overhead_fraction
    if unified:  # running a unified-memory node out freezes it: double the floor and the slack
        floor, fraction = floor * 2, fraction * 2
    fixed = int(settings.overhead_gib * GIB)

    def needs(ctx: int) -> tuple[RankNeed, ...]:
        kv = kv_for(ctx)
        own = [weights[r] + kv[r] + workspace + fixed + int(fraction * (weights[r] + kv[r])) for r in range(ranks)]
        used: dict[str, int] = {}
        for r in range(ranks):
            used[available[r][0]] = used.get(available[r][0], 0) + own[r]
        return tuple(RankNeed(r, available[r][0], weights[r], kv[r], workspace,
                              fixed + int(fraction * (weights[r] + kv[r])), available[r][1], floor,
                              available[r][1] - used[available[r][0]]) for r in range(ranks))

    def fits(ctx: int) -> bool:
        return all(n.fits for n in needs(ctx))

    rows = needs(context)
    # largest context: binary search on whole tokens (need is monotone in the context)
    lo, hi = 0, max_context
    if not fits(1):
        lo = hi = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return MemoryPlan(context, rows, lo, weights_source, per_token, unified, max_context)


def config_dict(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text())
