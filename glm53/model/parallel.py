"""Where tensor parallelism (TP) and decode context parallelism (DCP) enter the forward.

Every place that changes with the rank count goes through one `RankPlan` method, so the layout
work (glm53/layout, glm53/dist) replaces this class (or subclasses it) without touching the model:

- which attention heads / expert columns / vocabulary rows this rank owns (the loader slices with them),
- the sum of row-parallel partial outputs (o_proj, MLP down projections),
- the gather of vocabulary-sharded logits,
- the cache object for one sequence (`new_state`: a DCP layout keeps only its owned positions),
- the indexer's global top-k over the positions this rank holds (`merge_topk`),
- attention of this rank's heads over the selected positions, for one layer's spans of one or
  several sequences (`attend_spans`: under DCP, partial (out, lse) from every rank merged by
  log-sum-exp at the heads' owners, every span's rows in the same exchanges).

World 1 is implemented here: every method is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from glm53 import ops
from glm53.model import indexer
from glm53.model.kv_state import KVState
from glm53.model.mla import absorbed_queries, attend
from glm53.model.paged_kv import PagedKVState, PageStore

if TYPE_CHECKING:
    from glm53.model.indexer import Selection
    from glm53.model.mla import AttentionWeights


@dataclass
class AttentionSpan:
    """One sequence's part of a layer's attention on this rank: its heads' queries q_nope [T, h, nope],
    q_rot [T, h, rope], the cache rows this rank holds [n, r + rope] at key_positions (None: every
    position) and the selection over them (merge_topk's result: a plan may return its own form, as
    DCP's pending selection). `read_rows` gives the rows when the span
    attends, so a batch holds one span's read at a time (an fp8 cache dequantizes on read).
    `rows_of` turns the selection's indices (into the rows held, in position order) into rows of what
    read_rows gives, where that is a paged store (None: they are the same)."""

    q_nope: torch.Tensor
    q_rot: torch.Tensor
    read_rows: Callable[[], torch.Tensor]
    key_positions: torch.Tensor | None
    selection: "Selection"
    rows_of: Callable[[torch.Tensor], torch.Tensor] | None = None

    def selected_rows(self, selection: "Selection") -> "Selection":
        """A resolved selection of this span as rows of read_rows()."""
        if self.rows_of is None:
            return selection
        return indexer.Selection(self.rows_of(selection.indices), selection.valid)


def _one_store(spans: list[AttentionSpan]) -> torch.Tensor | None:
    """The paged store every span reads in place (its rows through rows_of), or None."""
    if any(s.rows_of is None for s in spans):
        return None
    stores = [s.read_rows() for s in spans]  # the store's layer itself: nothing read
    return stores[0] if all(t is stores[0] for t in stores) else None


@dataclass(frozen=True)
class RankPlan:
    world: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside world {self.world}; ranks run 0..world-1")

    # ---- what this rank holds ------------------------------------------------------------
    def head_range(self, n_heads: int) -> range:
        """Attention heads owned here (q_b / kv_b rows, o_proj columns)."""
        self._world_one("head slicing")
        return range(n_heads)

    def ffn_columns(self, layer: int, width: int) -> range:
        """Intermediate columns of a dense MLP / expert owned here (gate/up rows, down columns)."""
        self._world_one("expert block slicing")
        return range(width)

    def vocab_range(self, vocab: int) -> range:
        """Vocabulary rows of the embedding and the head owned here."""
        self._world_one("vocabulary slicing")
        return range(vocab)

    # ---- collectives ---------------------------------------------------------------------
    def sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce of row-parallel partial outputs (fixed order where the layout needs bitwise)."""
        return x

    def embed(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding lookup on a vocabulary-sharded table (world 1: a plain lookup)."""
        return table[tokens]

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return local_logits

    # ---- attention (heads by TP, positions by DCP) ------------------------------------------
    def merge_topk(self, scores: torch.Tensor, key_positions: torch.Tensor | None, k: int,
                   nan_flag: torch.Tensor | None = None) -> "Selection":
        """The indexer's selection over the rows this rank holds (indices into them, fixed width k).

        scores [Tq, n] are for the keys at key_positions (None: the cache holds every position
        0..n-1, the world-1 case); the top-k is global, ties toward the lower position. nan_flag:
        as in indexer.select_topk (a graph-captured window checks NaN after the forward)."""
        return indexer.select_topk(scores, k, nan_flag)

    def attend_spans(self, w: "AttentionWeights", spans: list[AttentionSpan], total_heads: int) -> torch.Tensor:
        """Attention of this rank's heads over the selected cache rows, for one layer's spans of one
        or several sequences -> [sum T, h, v] for those heads (before o_proj), the spans' rows in order.

        Each span's queries attend over the rows this rank holds at its key_positions, with its
        selection from merge_topk. World 1: the absorbed attention of glm53.model.mla.attend, each
        query over its own selected rows (so the cost per query is bounded by index_topk): the
        queries' products (W_uk^T, W_uv) over every span's rows at once, the attention in one call
        where every span reads one paged store (their selections as its slots), else a call a span.
        Each op is row-invariant: a row's bits are the ones it gets alone."""
        if len(spans) == 1:
            s = spans[0]
            return attend(w, s.q_nope, s.q_rot, s.read_rows(), s.selected_rows(s.selection))[0]
        q = absorbed_queries(w, torch.cat([s.q_nope for s in spans]), torch.cat([s.q_rot for s in spans]))
        selections = [s.selected_rows(s.selection) for s in spans]
        store = _one_store(spans)
        if store is not None:
            latent, _ = ops.latent_attention(q, store, torch.cat([x.indices for x in selections]),
                                             torch.cat([x.valid for x in selections]), w.scale, w.kv_rank,
                                             valid_prefix=True)
        else:
            outs, t0 = [], 0
            for s, x in zip(spans, selections):  # one span's rows read at a time (fp8 gathers them)
                n = s.q_nope.shape[0]
                outs.append(ops.latent_attention(q[t0:t0 + n], s.read_rows(), x.indices, x.valid, w.scale, w.kv_rank,
                                                 valid_prefix=True)[0])
                t0 += n
            latent = torch.cat(outs)
        return ops.head_linear(latent, w.w_uv)

    # ---- the cache ------------------------------------------------------------------------
    def new_state(self, model, kv_dtype: str = "bf16"):  # noqa: ANN001, ANN201 - (Glm53Model) -> KVState
        """The cache for one sequence on this rank (a DCP layout keeps only its owned positions)."""
        indexed = frozenset(l.index for l in model.w.layers if l.indexer is not None)
        return KVState(n_layers=len(model.w.layers), latent_dim=model.cfg.latent_dim,
                       index_dim=model.cfg.index_head_dim, indexed_layers=indexed, kv_dtype=kv_dtype,
                       device=model.device)

    def new_paged_state(self, store: PageStore) -> PagedKVState:
        """An empty sequence in pages of a KV pool's store (glm53/model/paged_kv.py)."""
        return PagedKVState(store)

    def _world_one(self, what: str) -> None:
        if self.world != 1:
            raise NotImplementedError(
                f"{what} for world {self.world} comes from glm53.layout; this RankPlan implements world 1 only"
            )
