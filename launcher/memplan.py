"""The memory plan: what each rank needs against what its node has available now.

Per rank: its share of the weights (the layout plan's bytes when glm53.layout is present, else an
even split of the checkpoint's safetensors bytes, labelled as an estimate), KV for the requested
context (DCP divides positions across ranks: ceil(context / R) each), a workspace, and a stated
overhead (a fixed part plus a fraction of weights + KV). A start is refused when any node would be
left under the floor, and the plan says the largest context that fits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from launcher.config import MemorySettings
from launcher.meminfo import GIB, MIB

KV_ELEMENT_BYTES = {"bf16": 2, "fp8": 1}
FP8_SCALE_BYTES = 4  # one fp32 scale per cached row (e4m3 with a scale per row)
INDEXER_KEY_BYTES = 2  # the indexer's keys stay bf16


@dataclass(frozen=True)
class RankNeed:
    rank: int
    node: str
    weights: int
    kv: int
    workspace: int
    overhead: int
    available: int
    floor: int

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.workspace + self.overhead

    @property
    def left(self) -> int:
        return self.available - self.need

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


def kv_bytes_per_token(config_dict: dict, kv_dtype: str) -> int:
    """Cached bytes for one position over all layers (MTP included): the MLA latent (kv_lora_rank +
    qk_rope_head_dim values, plus a scale per row in fp8) and the indexer key (index_head_dim, bf16)."""
    layers = int(config_dict.get("num_hidden_layers", 78)) + int(config_dict.get("num_nextn_predict_layers", 0))
    latent = int(config_dict.get("kv_lora_rank", 512)) + int(config_dict.get("qk_rope_head_dim", 64))
    per_layer = latent * KV_ELEMENT_BYTES[kv_dtype] + (FP8_SCALE_BYTES if kv_dtype == "fp8" else 0)
    per_layer += int(config_dict.get("index_head_dim", 128)) * INDEXER_KEY_BYTES
    return layers * per_layer


def kv_bytes_per_rank(per_token: int, context: int, ranks: int, dcp: bool) -> int:
    positions = -(-context // ranks) if dcp else context
    return positions * per_token


def weights_per_rank(model_dir: str | Path, ranks: int) -> tuple[list[int], str]:
    """Bytes of weights each rank holds. The layout plan when it is importable, else an even split."""
    try:
        from glm53.layout import plan as layout_plan  # the layout issue's plan (same code as the CLI)
    except ImportError:
        layout_plan = None
    if layout_plan is not None:
        plan = layout_plan(model_dir, ranks)
        per_rank = getattr(plan, "bytes_per_rank", None)
        if per_rank is not None:
            return [int(b) for b in per_rank], "glm53.layout plan"
    total = checkpoint_bytes(model_dir)
    share = -(-total // ranks)
    return [share] * ranks, f"estimate: {total / GIB:.2f} GiB of safetensors split evenly over {ranks} (no layout plan)"


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Tensor bytes in the checkpoint's safetensors files, from their headers (no data read)."""
    from glm53.safetensors_header import read_header

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (fetch the weights first: bash fetch_weights.sh)")
    return sum(read_header(f).data_bytes for f in files)


def plan_memory(*, context: int, per_token: int, weights: list[int], weights_source: str, dcp: bool,
                available: list[tuple[str, int]], settings: MemorySettings, unified: bool,
                max_context: int) -> MemoryPlan:
    """available[r] = (node name, bytes available now on rank r's node)."""
    ranks = len(weights)
    floor = int(settings.floor_gib * GIB)
    workspace = int(settings.workspace_gib * GIB)
    fraction = settings.overhead_fraction
    if unified:  # running a unified-memory node out freezes it: double the floor and the slack
        floor, fraction = floor * 2, fraction * 2
    fixed = int(settings.overhead_gib * GIB)

    def need(rank: int, ctx: int) -> RankNeed:
        kv = kv_bytes_per_rank(per_token, ctx, ranks, dcp)
        node, avail = available[rank]
        overhead = fixed + int(fraction * (weights[rank] + kv))
        return RankNeed(rank, node, weights[rank], kv, workspace, overhead, avail, floor)

    rows = tuple(need(r, context) for r in range(ranks))
    # largest context: binary search on whole tokens (need is monotone in the context)
    lo, hi = 0, max_context
    if not all(need(r, 1).fits for r in range(ranks)):
        lo = hi = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(need(r, mid).fits for r in range(ranks)):
            lo = mid
        else:
            hi = mid - 1
    return MemoryPlan(context, rows, lo, weights_source, per_token, unified)


def config_dict(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text())
