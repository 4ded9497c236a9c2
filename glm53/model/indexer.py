"""The sparse-attention indexer (DSA): which cached positions each query attends to.

As the reference computes it: a query per indexer head from the q LoRA residual (wq_b), one key per
position (LayerNorm(wk x)), interleaved RoPE on the first qk_rope_head_dim dims of both; the score of
key t for query s is sum_h w_h(s) * relu(q_h(s) . k(t) / sqrt(d)), w = weights_proj(x) / sqrt(H),
in fp32. Future positions are excluded; each query keeps its top `index_topk` positions (all of its
causal positions when it has fewer). 'shared' layers reuse the previous 'full' layer's selection.

Ties are broken toward the lower position, so the selection is a function of the scores alone
(the reference's torch.topk leaves tie order unspecified; exact ties are real: a key whose every
head's relu is zero scores exactly 0). With glm53.ops the scores are row-invariant, so a query's
selection does not depend on the chunk it was computed in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53 import ops
from glm53.model.norm import INDEXER_KEY_NORM_EPS
from glm53.model.rope import apply_rope


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor  # [heads * head_dim, q_lora_rank]
    wk: torch.Tensor  # [head_dim, hidden]
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor  # [heads, hidden]: fp32, or bf16 as stored (exact in fp32; ops.linear_fp32)
    n_heads: int
    head_dim: int
    rope_dim: int


@dataclass
class Selection:
    """Per query, the cache rows it attends to: indices [T, k] (rows of the cache this rank reads,
    ascending, padded with 0) and valid [T, k]. A fixed width k (index_topk) for every query, so a
    query's attention has the same shape whatever else is in its forward. Every producer writes the
    valid slots first (valid[t, j] exactly for j < the row's count): attention relies on it
    (`ops.latent_attention(valid_prefix=True)`), tests/test_selection_form.py checks each producer."""

    indices: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def from_mask(cls, mask: torch.Tensor, width: int) -> "Selection":
        """A bool mask [T, n] with at most `width` True a row, as ascending indices of fixed width."""
        t, n = mask.shape
        counts = mask.sum(dim=1)
        if t and n and int(counts.max()) > width:
            raise ValueError(f"a row selects {int(counts.max())} rows, more than the width {width}")
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]  # selected first, ascending
        valid = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
        indices = torch.zeros(t, width, dtype=torch.long, device=mask.device)
        indices[:, :order.shape[1]] = order
        return cls(torch.where(valid, indices, torch.zeros_like(indices)), valid)

    def split_rows(self, length: int) -> list["Selection"]:
        """Per window of `length` rows (a group's selection, its windows' rows in order), views."""
        return [Selection(i, v) for i, v in zip(self.indices.split(length), self.valid.split(length))]

    def mask(self, n_rows: int) -> torch.Tensor:
        """The same selection as a bool mask [T, n_rows] (tests, and the reference formulation)."""
        out = torch.zeros(self.indices.shape[0], n_rows, dtype=torch.bool, device=self.indices.device)
        rows = torch.arange(self.indices.shape[0], device=self.indices.device)[:, None].expand_as(self.indices)
        out[rows[self.valid], self.indices[self.valid]] = True
        return out


def indexer_keys(w: IndexerWeights, x_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, head_dim] keys to cache, rope on the leading rope_dim values."""
    k = ops.layer_norm(ops.linear(x_norm, w.wk), w.k_norm_weight, w.k_norm_bias, INDEXER_KEY_NORM_EPS)
    return torch.cat([apply_rope(k[:, : w.rope_dim], cos, sin), k[:, w.rope_dim:]], dim=-1)


def indexer_queries(w: IndexerWeights, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q = ops.project(q_resid, w.wq_b).view(q_resid.shape[0], w.n_heads, w.head_dim)
    return torch.cat([apply_rope(q[..., : w.rope_dim], cos, sin), q[..., w.rope_dim:]], dim=-1)


def index_head_weights(w: IndexerWeights, x_norm: torch.Tensor) -> torch.Tensor:
    """[T, n_heads] fp32: each query row's weight of every indexer head (row-invariant: a batch's
    rows in one product)."""
    return ops.linear_fp32(x_norm, w.weights_proj) * (w.n_heads ** -0.5)


def index_scores(w: IndexerWeights, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                 q_positions: torch.Tensor, key_positions: torch.Tensor | None = None,
                 key_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[Tq, Tk] fp32 scores of keys at key_positions (default [0, Tk); a DCP rank passes the
    positions it owns) for queries at q_positions (their head weights from index_head_weights); -inf
    where the key lies in the query's future. key_rows: key n is keys[key_rows[n]] (a paged cache's
    slots, read in place)."""
    return ops.index_scores(q, head_weights, keys, w.head_dim ** -0.5, q_positions, key_positions, key_rows)


def index_scores_spans(w: IndexerWeights, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                       q_positions: torch.Tensor, key_table: torch.Tensor,
                       key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """index_scores of several sequences' windows of T rows each in one call -> [B * T, N]: window b's
    key n is keys[key_table[b, n]] at position key_positions[n] (default n; a DCP rank's owned
    positions, the same for every window), a paged store's slots; a shorter window's table padded
    past its key bound, whose keys then lie in all its queries' future and score -inf. A row's scores
    over its own keys are the ones index_scores gives its window alone (key-invariant)."""
    return ops.index_scores_spans(q, head_weights, keys, w.head_dim ** -0.5, q_positions, key_table, key_positions)


def selects_without_sync(rows: int, n_keys: int, device: torch.device) -> bool:
    """Whether select_topk over `rows` rows of n_keys keys reads nothing back to the host (a captured
    graph can hold it; several windows' rows may share one call): on CUDA the torch form syncs for more
    than SMALL_WINDOW_ROWS rows, and it takes rows over triton_topk.MAX_KEYS keys."""
    return device.type != "cuda" or rows <= SMALL_WINDOW_ROWS or ops.triton_topk_keys(n_keys, device)


def orderable_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int64 with the same order, -0.0 equal to +0.0 (one of the two packed halves
    of a top-k key; glm53.dist.dcp packs the same way for the merge across ranks)."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.long)


SMALL_WINDOW_ROWS = 16  # up to this many query rows the packed keys are cheap: no tie test, no host sync


def select_topk(scores: torch.Tensor, k: int, nan_flag: torch.Tensor | None = None) -> Selection:
    """Each row's k best finite scores, ties toward the lower position, as ascending indices.

    The rule is the one of packed (score, -position) int64 keys, which cannot tie, so the set is
    unique. On CUDA it runs as Triton kernels (glm53/ops/triton_topk.py: a radix select per row, over
    a sampled bracket of its scores where one holds, the chosen columns written in ascending order;
    no sort, no tie test, no host sync; a short window's
    rows each spread over many programs) for rows of up to triton_topk.MAX_KEYS keys; otherwise the
    torch form below (`select_topk_torch`), which the kernels are tested against.

    NaN scores leave the selection undefined: raised here (a host sync), or, given `nan_flag` (a
    device bool), or-ed into it for the caller to check after the forward (glm53.runtime.cuda_graphs)."""
    _check_scores(scores, k)
    if scores.shape[1] and ops.triton_topk_for(scores):
        from glm53.ops import triton_topk  # Triton: CUDA only

        indices, valid, nans = triton_topk.select(scores, k)
        _check_nan(nans.any(), nan_flag)
        return Selection(indices, valid)
    return _select_torch(scores, k, nan_flag)


def select_topk_nan_counts(scores: torch.Tensor, k: int) -> tuple[Selection, torch.Tensor]:
    """select_topk's selection and each row's NaN count ([T] int32), raising nothing: a DCP rank
    sends the counts to its peers with its candidates, so that every rank sees a NaN and raises
    together (glm53.dist.dcp). The counts come out of the kernels' own pass where they run."""
    _check_scores(scores, k)
    if scores.shape[1] and ops.triton_topk_for(scores):
        from glm53.ops import triton_topk  # Triton: CUDA only

        indices, valid, nans = triton_topk.select(scores, k)
        return Selection(indices, valid), nans
    absorbed = torch.zeros((), dtype=torch.bool, device=scores.device)  # the rows' counts report it instead
    return _select_torch(scores, k, absorbed), torch.isnan(scores).sum(dim=1, dtype=torch.int32)


def select_topk_torch(scores: torch.Tensor, k: int, nan_flag: torch.Tensor | None = None) -> Selection:
    """select_topk's rule in torch ops (the CPU, and CUDA rows over triton_topk.MAX_KEYS keys).

    Most rows have no tie at their k-th score: for those a plain fp32 top-(k + 1) less its least
    score gives the set (half the bits to sort, no int64 copies of the [T, N] scores, and the tie
    shows in those k + 1 scores); only rows where the k-th finite score ties with an unselected one
    go through the packed keys. A window of at most SMALL_WINDOW_ROWS rows (decode, verification)
    takes the packed keys directly: the same set, and no host sync, so the call can be captured in
    a CUDA graph."""
    _check_scores(scores, k)
    return _select_torch(scores, k, nan_flag)


def _select_torch(scores: torch.Tensor, k: int, nan_flag: torch.Tensor | None) -> Selection:
    tq, tk = scores.shape
    indices = torch.zeros(tq, k, dtype=torch.long, device=scores.device)
    valid = torch.zeros(tq, k, dtype=torch.bool, device=scores.device)
    if tq == 0 or tk == 0:
        return Selection(indices, valid)
    _check_nan(torch.isnan(scores).any(), nan_flag)
    width = min(k, tk)
    if tq <= SMALL_WINDOW_ROWS:
        return _as_selection(scores, _packed_topk(scores, width), indices, valid)
    if width == tk:  # every column is chosen (the non-finite ones end invalid): nothing to rank
        return _as_selection(scores, torch.arange(tk, device=scores.device).expand(tq, tk), indices, valid)
    # one score more than the width: the k-th score ties with an unselected one exactly when it
    # equals the (k+1)-th, the least of these, which then occurs twice. A test over [T, k + 1]
    # instead of counting the k-th score over the whole row ([T, N], twice)
    top = scores.topk(width + 1, dim=1, sorted=False)
    floor = top.values.amin(dim=1, keepdim=True)
    tied = torch.isfinite(floor[:, 0]) & ((top.values == floor).sum(1) > 1)
    # untied rows: the k best are these less their least, which is unique; drop it by moving the
    # last column into its place
    least = top.values.argmin(dim=1, keepdim=True)
    chosen = top.indices.scatter(1, least, top.indices[:, -1:])[:, :width]
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        chosen = chosen.clone()
        chosen[rows] = _packed_topk(scores[rows], width)
    return _as_selection(scores, chosen, indices, valid)


def _check_scores(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [Tq, Tk] (index_scores), got {scores.dtype} {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"k (index_topk) must be >= 1, got {k}")


def _check_nan(any_nan: torch.Tensor, nan_flag: torch.Tensor | None) -> None:
    """NaN scores: raised at once (a host sync), or or-ed into the caller's device flag."""
    if nan_flag is None:
        if bool(any_nan):
            raise ValueError("indexer scores contain NaN; the selection is undefined")
    else:
        nan_flag.logical_or_(any_nan)


def _as_selection(scores: torch.Tensor, chosen: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor
                  ) -> Selection:
    """Chosen columns [T, width] -> ascending indices, non-finite ones invalid, padded to indices' width."""
    tk, width = scores.shape[1], chosen.shape[1]
    finite = torch.isfinite(scores.gather(1, chosen))
    chosen = torch.where(finite, chosen, torch.full_like(chosen, tk)).sort(dim=1).values  # not finite: last
    valid[:, :width] = chosen < tk
    indices[:, :width] = torch.where(valid[:, :width], chosen, torch.zeros_like(chosen))
    return Selection(indices, valid)


def _packed_topk(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Column indices of each row's `width` largest (score, -position) keys (no ties possible)."""
    tk = scores.shape[1]
    lower_first = torch.arange(tk - 1, -1, -1, device=scores.device, dtype=torch.long)
    return (orderable_keys(scores) * (1 << 32) + lower_first[None, :]).topk(width, dim=1, sorted=False).indices
