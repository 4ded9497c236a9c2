"""Feed-forward blocks: the dense SwiGLU MLP, the noaux_tc router and the routed experts.

Router (as the reference): fp32 logits, sigmoid scores; selection on scores + e_score_correction_bias,
restricted to the best `topk_group` of `n_group` groups (a group's rank is the sum of its two best
biased scores); the gate weights are the unbiased scores of the chosen experts, renormalized when
norm_topk_prob, times routed_scaling_factor. Routed experts run through an `ExpertBank` so faster
kernels (grouped by EXL3 width) can replace the decoded-weights matmul without touching the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from glm53 import ops
from glm53.model.indexer import SMALL_WINDOW_ROWS, orderable_keys


@dataclass
class MLPWeights:
    gate: torch.Tensor  # [width, hidden]   (this rank's columns)
    up: torch.Tensor  # [width, hidden]
    down: torch.Tensor  # [hidden, width]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(ops.silu(ops.linear(x, self.gate)) * ops.linear(x, self.up), self.down)


@dataclass
class RouterWeights:
    weight: torch.Tensor  # [experts, hidden], fp32
    bias: torch.Tensor  # [experts] fp32 e_score_correction_bias
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float


def route(r: RouterWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (expert ids [T, k] int64, gate weights [T, k] fp32)."""
    scores = ops.sigmoid(ops.linear_fp32(x, r.weight))
    biased = scores + r.bias
    n_exp = biased.shape[-1]
    if r.n_group > 1:
        grouped = biased.view(-1, r.n_group, n_exp // r.n_group)
        group_rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_rank, dtype=torch.bool)
        keep.scatter_(1, group_rank.topk(r.topk_group, dim=-1).indices, True)
        biased = biased.masked_fill(~keep.repeat_interleave(n_exp // r.n_group, dim=1), float("-inf"))
    ids = topk_ids(biased, r.top_k)
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, weights.shape[1]):  # in order, not a reduction whose tree follows the row count
            total = total + weights[:, j]
        weights = weights / (total[:, None] + 1e-20)
    return ids, weights * r.scaling


def topk_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of each row's k largest fp32 values, largest first, ties toward the lower index (a
    saturated sigmoid ties at exactly 1.0): one order whatever kernel torch.topk runs."""
    n = values.shape[-1]
    lower_first = torch.arange(n - 1, -1, -1, device=values.device, dtype=torch.long)
    keys = orderable_keys(values) * (1 << 32) + lower_first
    return (n - 1) - keys.topk(k, dim=-1).values.remainder(1 << 32)


class ExpertBank(Protocol):
    """Routed experts of one layer (this rank's columns of each)."""

    n_experts: int

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids/weights [T, k] -> sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        ...

    def capturable(self, rows: int) -> bool:
        """Whether `rows` tokens run without a host read (glm53.runtime.cuda_graphs can capture them)."""
        ...


class DecodedExperts:
    """Experts as dense matrices in the compute dtype (EXL3 decoded once at load).

    Two forms, the same bits: many rows group the token slots by expert (each expert's matrices
    read once; on CUDA one grouped launch per projection, `runs`, else a loop over the experts
    that reads the counts on the host, a sync); a short window (at most
    SLOT_ROWS tokens: decode, verification) runs every slot against its own expert through
    ops.expert_linear and sums a token's slots in ascending expert order, as the grouped form's
    index_add_ does, with no sync, so it can be graph-captured."""

    SLOT_ROWS = SMALL_WINDOW_ROWS  # at least the windows glm53.runtime.cuda_graphs captures (no sync there)

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up = gate_up  # [E, 2 * width, hidden]: gate rows then up rows
        self.down = down  # [E, hidden, width]
        self.n_experts = gate_up.shape[0]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.SLOT_ROWS:
            return self.by_slot(x, ids, weights)
        return self.grouped(x, ids, weights)

    def capturable(self, rows: int) -> bool:
        """Whether `rows` tokens run without a host sync: the slot form, or `runs` (CUDA, where the device
        gives the grouped products linear's bits: asked here, outside any capture, once a shape)."""
        return rows <= self.SLOT_ROWS or self._runs_exact()

    def _runs_exact(self) -> bool:
        """Whether `runs` gives each row linear's bits here (CUDA, checked once a shape; the weights sit on
        the activations' device, so they name it)."""
        return ops.grouped_experts_for(self.gate_up, self.gate_up, self.down)

    def by_slot(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        sorted_ids, order = ids.sort(dim=1, stable=True)  # a token's experts are distinct: ascending
        slot_weights = weights.gather(1, order).reshape(-1, 1)
        flat_ids = sorted_ids.reshape(-1)
        gate, up = ops.expert_linear(x.repeat_interleave(k, dim=0), self.gate_up, flat_ids).chunk(2, dim=-1)
        y = ops.expert_linear(ops.silu(gate) * up, self.down, flat_ids)
        return _sum_in_expert_order((y * slot_weights).to(x.dtype).view(t, k, -1), x)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Many rows: `runs` where the device gives its grouped products linear's bits, else `by_expert`."""
        if self._runs_exact():
            return self.runs(x, ids, weights)
        return self.by_expert(x, ids, weights)

    def by_expert(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The grouped form as a loop over the experts, which reads their counts on the host (a sync)."""
        out = torch.zeros_like(x)
        _, tokens, slot_weights = _slots_by_expert(ids, weights)
        counts = torch.bincount(ids.reshape(-1), minlength=self.n_experts).tolist()
        begin = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[begin:begin + n]
            gate, up = ops.linear(x[rows], self.gate_up[expert]).chunk(2, dim=-1)
            y = ops.linear(ops.silu(gate) * up, self.down[expert])
            # weight in fp32, then back to the compute dtype (the reference's rounding point)
            out.index_add_(0, rows, (y * slot_weights[begin:begin + n, None]).to(out.dtype))
            begin += n
        return out

    def runs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The grouped form on the device without a sync: the token slots sorted by expert, each
        projection one launch over every expert's run of rows (`by_expert` launches ~10 kernels an
        expert, counted in its loop, after reading the counts on the host), then each token's slots
        summed in ascending expert order, as `by_expert`'s index_add_ adds them."""
        t, k = ids.shape
        order, tokens, slot_weights = _slots_by_expert(ids, weights)
        counts = ops.expert_counts(ids, self.n_experts)
        gate, up = ops.grouped_expert_linear(x[tokens], self.gate_up, counts).chunk(2, dim=-1)
        y = ops.grouped_expert_linear(ops.silu(gate) * up, self.down, counts)
        parts = (y * slot_weights[:, None]).to(x.dtype)
        rank = ids.argsort(dim=1, stable=True).argsort(dim=1)  # a slot's place among its token's experts
        place = tokens * k + rank.reshape(-1)[order]
        return _sum_in_expert_order(torch.empty_like(parts).index_copy_(0, place, parts).view(t, k, -1), x)


def _slots_by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token slots [T, k] in ascending expert order (stable, so a run's tokens ascend): the
    order of the flat slots, each slot's token and its routing weight."""
    order = torch.argsort(ids.reshape(-1), stable=True)
    return order, order // ids.shape[1], weights.reshape(-1)[order]


def _sum_in_expert_order(parts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """sum_j parts[:, j] from zeros, j ascending (each token's experts in ascending order), rounding
    after each add as index_add_ does: parts [T, k, hidden] in the compute dtype."""
    out = torch.zeros_like(like)
    for j in range(parts.shape[1]):
        out = out + parts[:, j]
    return out


@dataclass
class MoEWeights:
    router: RouterWeights
    experts: ExpertBank
    shared: MLPWeights | None

    def capturable(self, rows: int) -> bool:
        """Whether `rows` tokens run without a host sync (glm53.runtime.cuda_graphs can capture them)."""
        return self.experts.capturable(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(self.router, x)
        out = self.experts(x, ids, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
