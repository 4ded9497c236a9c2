"""One rank of the TP R + DCP R layout, through the model's plug points (glm53.model.parallel.RankPlan).

    comm = rendezvous(RendezvousSpec(rank, R, master, master_port))
    plan = DistRankPlan.create(comm, cfg.vocab_size)   # DCP on (Settings.dcp, TF_GLM53_DCP, says)
    weights = load_weights(model_dir, cfg, plan=plan)  # this rank's slices
    model = Glm53Model(cfg, weights, plan)
    state = plan.new_state(model, kv_dtype)            # holds only this rank's positions under DCP

What each plug point does here:
- head_range / ffn_columns / vocab_range: glm53.dist.tp (the layout plan's split arithmetic); heads
  are split by TP whether DCP is on or off (q_b / kv_b rows and o_proj columns of this rank only);
- sum_partials: gather + sum in fixed rank order (same bits on every rank, deterministic at any R);
- embed: lookup in this rank's vocabulary rows, zeros elsewhere, summed (exact: one term is non-zero);
- gather_logits: all-gather of the vocabulary slices (padded to the largest), concatenated;
- new_state: DcpKVState, holding (and reading back) only this rank's positions under DCP;
- merge_topk: DCP on: index scores of the owned positions (with their global positions) -> this
  rank's own top-k candidates and their keys (glm53.dist.dcp.PendingSelection), merged after attend's exchange into
  the global top-k (ties to the lower position, the model's own rule) as a Selection of this
  rank's rows (local slots, fixed width); DCP off: local (every rank holds every position and
  every score);
- attend_spans: DCP on: glm53.dist.dcp.tp_dcp_attention_spans (every sequence's span of a
  layer in the same exchanges): each rank absorbs its heads' queries through
  its W_UK slice, one all-gather shares them (with a 'full' layer's top-k candidates: one round
  trip for both), each rank attends with every head over the selected
  rows it owns (a rank with none: lse = -inf), one all-to-all returns (out, lse) to the heads'
  owners, merged by log-sum-exp in rank order, W_UV of the owner's heads; o_proj row partials are
  then summed in rank order by sum_partials. DCP off: the world-1 attention on this rank's heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from glm53.dist import dcp, tp
from glm53.dist.collectives import Comm
from glm53.dist.dcp_state import DcpKVState, PagedDcpKVState
from glm53.model.indexer import Selection, select_topk
from glm53.model.kv_state import KVState
from glm53.model.paged_kv import PagedKVState, PageStore
from glm53.model.mla import AttentionWeights
from glm53.model.parallel import AttentionSpan, RankPlan

if TYPE_CHECKING:
    from glm53.model.transformer import Glm53Model


@dataclass(frozen=True)
class DistRankPlan(RankPlan):
    comm: Comm | None = field(default=None, compare=False, repr=False)
    vocab_size: int = 0
    dcp: bool = False

    @classmethod
    def create(cls, comm: Comm, vocab_size: int, dcp_on: bool = True) -> "DistRankPlan":
        return cls(world=comm.world_size, rank=comm.rank, comm=comm, vocab_size=vocab_size,
                   dcp=dcp_on and comm.world_size > 1)

    @property
    def ownership(self) -> dcp.Ownership:
        return dcp.Ownership.for_rank(self.rank, self.world, enabled=self.dcp)

    # ---- what this rank holds ------------------------------------------------------------
    def head_range(self, n_heads: int) -> range:
        return range(*tp.head_ranges(n_heads, self.world)[self.rank])

    def ffn_columns(self, layer: int, width: int) -> range:
        return range(*tp.column_ranges(width, self.world, layer)[self.rank])

    def vocab_range(self, vocab: int) -> range:
        return range(*tp.vocab_ranges(vocab, self.world)[self.rank])

    # ---- collectives ---------------------------------------------------------------------
    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.world == 1 else self._comm.sum_in_rank_order(x, name="sum_partials")

    def embed(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return table[tokens]
        first = tp.vocab_ranges(self.vocab_size, self.world)[self.rank][0]
        local = tokens - first
        mine = (local >= 0) & (local < table.shape[0])
        rows = table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)
        return self._comm.sum_in_rank_order(rows, name="embed")

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return local_logits
        sizes = [b - a for a, b in tp.vocab_ranges(self.vocab_size, self.world)]
        width = max(sizes)
        padded = torch.nn.functional.pad(local_logits, (0, width - local_logits.shape[-1]))
        parts = self._comm.all_gather(padded, name="gather_logits")  # [R, T, width]
        return torch.cat([parts[r][..., : sizes[r]] for r in range(self.world)], dim=-1)

    # ---- attention: heads by TP, positions by DCP -------------------------------------------
    def merge_topk(self, scores: torch.Tensor, key_positions: torch.Tensor | None, k: int,
                   nan_flag: torch.Tensor | None = None) -> Selection | dcp.PendingSelection:
        """scores [Tq, n] of the keys this rank holds at key_positions -> the Selection of those among
        the global top-k, as indices into this rank's rows. key_positions None (DCP off, or a cache
        that holds every position): local. DCP on: this rank's candidates, exchanged in attend's
        all-gather of the queries (dcp.PendingSelection: one round trip for both)."""
        if key_positions is None:
            return select_topk(scores, k, nan_flag)
        if nan_flag is not None and nan_flag.is_cuda and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError("a DCP rank's top-k syncs with its peers; it is never graph-captured")
        # NaN scores on any rank reach every rank in the exchange: all raise (or flag) together
        return dcp.PendingSelection.of(scores, key_positions, self.ownership, k, nan_flag)

    def attend_spans(self, w: AttentionWeights, spans: list[AttentionSpan], total_heads: int) -> torch.Tensor:
        """DCP on: every span's queries in one all-gather and their partials in one all-to-all."""
        if all(s.key_positions is None for s in spans):  # every rank holds every position: local, our heads
            return super().attend_spans(w, spans, total_heads)
        return dcp.tp_dcp_attention_spans(self._comm, spans, w.w_uk_t, w.w_uv, tp.head_ranges(total_heads, self.world),
                                          w.scale)

    # ---- state ---------------------------------------------------------------------------
    def new_state(self, model: "Glm53Model", kv_dtype: str = "bf16") -> KVState:
        """The cache for one sequence on this rank (only owned positions under DCP)."""
        indexed = frozenset(l.index for l in model.w.layers if l.indexer is not None)
        return DcpKVState(n_layers=len(model.w.layers), latent_dim=model.cfg.latent_dim,
                          index_dim=model.cfg.index_head_dim, indexed_layers=indexed, kv_dtype=kv_dtype,
                          device=model.device, own=self.ownership)

    def new_paged_state(self, store: PageStore) -> PagedKVState:
        """An empty sequence in pages of a KV pool's store on this rank (its own slots under DCP)."""
        return PagedDcpKVState(store, self.ownership)

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def _comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError(f"DistRankPlan for world {self.world} has no Comm; build it with DistRankPlan.create(comm)")
        return self.comm
