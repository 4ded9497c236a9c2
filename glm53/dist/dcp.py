"""Decode context parallelism (DCP): which rank holds which token position, and the two merges.

Ownership: position p lives on rank p % R at local slot p // R (latent cache and indexer keys).
With ``TF_GLM53_DCP=0`` every rank holds every position (R_dcp = 1, slot = p).

Attention merge: each rank attends over the selected positions it owns and returns
(out [..., dv], lse [...]) with lse the natural-log sum of exp(score) over those positions;
the merge is exact log-sum-exp, computed in fixed rank order 0..R-1 (deterministic at any R):

    m = max_r lse_r;  w_r = exp(lse_r - m);  out = sum_r w_r out_r / sum_r w_r;  lse = m + log sum_r w_r

A rank that owns none of the positions reports lse = -inf; its w_r is exactly 0 and its out_r
is ignored (even if NaN). When every rank has lse = -inf (no position at all) the merge defines
out = 0 and lse = -inf.

Top-k: scores and positions are packed into one int64 key per entry that orders by higher score
first, then lower position first (a total order), so a rank's local top-k, an all-gather and a
global top-k of the keys give exactly the single-rank top-k with the same tie-break.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from glm53 import ops
from glm53.dist.collectives import Comm, byte_rows
from glm53.model.indexer import Selection, _check_nan, select_topk_nan_counts
from glm53.model.parallel import AttentionSpan

POSITION_BITS = 31  # positions < 2**31 (the model's context is 2**20)
_POS_MASK = (1 << POSITION_BITS) - 1
PAD_KEY = -1  # below every real key (real keys are >= 0)


# ---- ownership ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ownership:
    """Positions held by one rank: p with p % ranks == index, at local slot p // ranks."""

    index: int  # this rank's index among the DCP ranks (0 when DCP is off)
    ranks: int  # number of DCP ranks (1 when DCP is off)

    @classmethod
    def for_rank(cls, rank: int, world_size: int, enabled: bool = True) -> "Ownership":
        """enabled: Settings.dcp (TF_GLM53_DCP), on by default."""
        return cls(rank, world_size) if enabled else cls(0, 1)

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.ranks:
            raise ValueError(f"DCP rank {self.index} outside 0..{self.ranks - 1}")

    def owner(self, position: int) -> int:
        return position % self.ranks

    def owns(self, position: int) -> bool:
        return position % self.ranks == self.index

    def slot(self, position: int) -> int:
        """Local slot of an owned position."""
        if not self.owns(position):
            raise ValueError(f"position {position} lives on DCP rank {self.owner(position)}, not {self.index}")
        return position // self.ranks

    def position(self, slot: int) -> int:
        return slot * self.ranks + self.index

    def count(self, length: int) -> int:
        """How many of the positions [0, length) this rank holds (its used slots)."""
        return max(0, (length - self.index + self.ranks - 1) // self.ranks)

    def slots_needed(self, capacity: int) -> int:
        """Local slots to allocate for a context of `capacity` positions."""
        return self.count(capacity)

    def owned_positions(self, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The positions in [start, end) this rank holds, ascending (int64)."""
        first = start + (self.index - start) % self.ranks
        return torch.arange(first, max(first, end), self.ranks, dtype=torch.int64, device=device)

    def positions_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots * self.ranks + self.index

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Local slots of positions that must all be owned here."""
        if positions.numel() and bool(((positions % self.ranks) != self.index).any()):
            raise ValueError(f"positions not owned by DCP rank {self.index} of {self.ranks}")
        return torch.div(positions, self.ranks, rounding_mode="floor")

    def select_owned(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From globally selected positions [n] (e.g. the merged top-k): the owned ones and their slots."""
        mine = positions[(positions % self.ranks) == self.index]
        return mine, torch.div(mine, self.ranks, rounding_mode="floor")

    def rows_to_write(self, start: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: `rows` [T, ...] hold positions start..start+T-1 (computed on every rank, the latent
        projection being replicated); return (local slots, the rows this rank keeps)."""
        positions = self.owned_positions(start, start + rows.shape[0], device=rows.device)
        return torch.div(positions, self.ranks, rounding_mode="floor"), rows[positions - start]


# ---- attention over owned positions, and the merge -----------------------------------------
def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of queries q [H, d] over keys k [n, d], values v [n, dv] (n may be 0):
    (out [H, dv], lse [H]) in fp32. The contract every rank's attention kernel meets."""
    scores = (q.float() @ k.float().T) * scale  # [H, n]
    if k.shape[0] == 0:
        return q.new_zeros((q.shape[0], v.shape[-1]), dtype=torch.float32), torch.full(
            (q.shape[0],), float("-inf"), dtype=torch.float32, device=q.device)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[:, None])
    return weights @ v.float(), lse


def attend_latent(q_lat: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over latent rows [n, r + rope] (n may be 0) for queries q_lat [T, H, r],
    q_rot [T, H, rope], optionally only where mask [T, n]: (latent out [T, H, r] in q's dtype,
    lse [T, H] fp32; a query with no row: out 0, lse -inf). What a DCP rank computes for every head
    over the selected positions it owns; W_uv is applied after the merge."""
    r = q_lat.shape[-1]
    if rows.shape[0] == 0:
        return (q_lat.new_zeros(q_lat.shape),
                torch.full(q_lat.shape[:-1], float("-inf"), dtype=torch.float32, device=q_lat.device))
    c, k_rot = rows[:, :r].to(q_lat.dtype), rows[:, r:].to(q_lat.dtype)
    scores = (torch.einsum("thr,kr->thk", q_lat, c) + torch.einsum("thp,kp->thk", q_rot, k_rot)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe[..., None]).to(q_lat.dtype)
    return torch.einsum("thk,kr->thr", probs, c), lse


@dataclass
class PendingSelection:
    """A 'full' indexer layer's selection under DCP before the exchange. tp_dcp_attention_spans sends
    `words` in the same all-gather as the absorbed queries (one round trip for both) and resolves
    the Selection here, so the 'shared' layers after it reuse the resolved one.

    This rank's candidates are its own top-k finite entries (`local`: the single-rank selection over
    its scores, glm53.model.indexer: the Triton kernels on CUDA, ascending, no sort and no host
    sync); `words` [T, k + 2] int64 are their keys (PAD_KEY where invalid), then the row's count of
    +inf scores and of NaN scores. Why that is the global top-k's share (dcp_topk + owned_selection,
    the reference, which these are tested against): the global top-k ranks all R * n keys; its +inf
    entries (P of them, summed over ranks) come first and are dropped as not finite, so its finite
    entries are the best k - P finite keys overall. A rank with p <= P of them chose its best k - p
    finite ones, which holds every one of its own among those. tau, the (k - P)-th largest gathered
    finite key (the k-th largest once P keys above all stand for the +inf ones), is the same number
    on every rank; a candidate is kept when its key is >= tau (keys are unique: positions differ).
    -inf entries rank below every finite one and are never kept."""

    local: "Selection"
    words: torch.Tensor
    own: Ownership
    k: int
    nan_flag: torch.Tensor | None = None
    resolved: "Selection | None" = None

    @classmethod
    def of(cls, scores: torch.Tensor, positions: torch.Tensor, own: Ownership, k: int,
           nan_flag: torch.Tensor | None = None) -> "PendingSelection":
        """scores [T, n] fp32 over this rank's rows, positions [n] their positions, ascending (so a
        lower column is a lower position: the kernels' tie-break is the keys')."""
        local, nans = select_topk_nan_counts(scores, k)
        t, n = scores.shape
        if n:
            cols = local.indices
            keys = (_orderable_bits(scores.gather(1, cols)) << POSITION_BITS) \
                | (_POS_MASK - positions.to(device=cols.device, dtype=torch.int64)[cols])
            keys = torch.where(local.valid, keys, PAD_KEY)
        else:
            keys = torch.full((t, k), PAD_KEY, dtype=torch.int64, device=scores.device)
        counts = torch.stack([torch.isposinf(scores).sum(dim=1), nans.to(torch.int64)], dim=1)
        return cls(local, torch.cat([keys, counts], dim=1), own, k, nan_flag)

    def split_rows(self, length: int) -> list["PendingSelection"]:
        """Per window of `length` rows (a group's candidates, its windows' rows in order): each window's
        own, as PendingSelection.of gives it alone (a row's words are its own)."""
        return [PendingSelection(local, words, self.own, self.k, self.nan_flag)
                for local, words in zip(self.local.split_rows(length), self.words.split(length))]

    def resolve(self, gathered_words: torch.Tensor) -> "Selection":
        """gathered_words [R, T, k + 2]: every rank's words, in rank order (the same on every rank)."""
        k = self.k
        _check_nan(gathered_words[..., k + 1].sum(dim=0).gt(0).any(), self.nan_flag)  # every rank alike
        every = gathered_words[..., :k].movedim(0, -2).flatten(-2)  # [T, R * k]
        # the row's +inf entries as P keys above every finite one: the k-th largest of them all is
        # then the (k - P)-th largest finite key (above every key where P >= k, -1 where fewer than
        # k keys exist), with an unsorted top-k and no per-row index
        plus_inf = gathered_words[..., k].sum(dim=0)[:, None]
        above = torch.where(torch.arange(k, device=every.device)[None, :] < plus_inf, torch.iinfo(torch.int64).max,
                            PAD_KEY)
        tau = torch.topk(torch.cat([every, above], dim=1), k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
        keep = self.local.valid & (self.words[:, :k] >= tau)
        # compact the kept ones to the front, in their (ascending) order: a cumsum, not a sort
        t = keep.shape[0]
        slot = torch.where(keep, keep.cumsum(dim=1) - 1, k)  # dropped ones land in a spare column
        indices = torch.zeros(t, k + 1, dtype=torch.int64, device=keep.device)
        indices.scatter_(1, slot, torch.where(keep, self.local.indices, 0))
        valid = torch.arange(k, device=keep.device)[None, :] < keep.sum(dim=1, keepdim=True)
        self.resolved = Selection(torch.where(valid, indices[:, :k], 0), valid)
        return self.resolved


def tp_dcp_attention_spans(comm: Comm, spans: list[AttentionSpan], w_uk_t: torch.Tensor, w_uv: torch.Tensor,
                           head_ranges: list[tuple[int, int]], scale: float) -> torch.Tensor:
    """MLA with heads split by TP and positions by DCP on the same ranks (absorbed form), over the
    spans of several sequences in one exchange.

    This rank holds its heads' weights w_uk_t [h, r, nope], w_uv [h, v, r] and, per span, its queries
    and the latent rows it owns (read as the span attends; span.key_positions unused) with the
    selection (indices into those rows, fixed width; a PendingSelection travels with the queries
    and is resolved on arrival). One all-gather of every
    span's absorbed queries (every rank attends with every head over its own rows), one all-to-all
    merge to the heads' owners (rank order), then W_uv on this rank's heads: out [sum T, h, v], the
    spans' rows in order, as one rank attending over all positions. The exchanges carry every
    span's rows side by side, so a batch of sequences costs two round trips a layer, not two a
    sequence. Each query attends over its own fixed-width selection (glm53.ops.latent_attention) and
    the merge is per row, so a row's bits depend neither on the other queries nor on the other spans."""
    sizes = [span.q_nope.shape[0] for span in spans]
    q_nope = spans[0].q_nope if len(spans) == 1 else torch.cat([span.q_nope for span in spans])
    q_rot = spans[0].q_rot if len(spans) == 1 else torch.cat([span.q_rot for span in spans])
    q_lat = ops.head_linear(q_nope, w_uk_t)  # row-invariant: all spans' rows in one product
    width = max(b - a for a, b in head_ranges)
    packed = torch.cat([q_lat, q_rot.to(q_lat.dtype)], dim=-1)
    packed = torch.nn.functional.pad(packed, (0, 0, 0, width - packed.shape[1]))
    pending = [isinstance(span.selection, PendingSelection) and span.selection.resolved is None for span in spans]
    if any(pending):  # a 'full' layer: every span's top-k candidates ride with the queries
        if not all(pending):
            raise ValueError("spans of one layer mix pending and resolved selections")
        words = torch.cat([span.selection.words for span in spans])
        every, gathered_words = comm.all_gather_packed([packed, words], name="tp_dcp_queries_topk")
    else:
        every = comm.all_gather(packed, name="tp_dcp_queries")  # [R, T, width, r + rope]
    q_all = torch.cat([every[j][:, : b - a] for j, (a, b) in enumerate(head_ranges)], dim=1)  # [T, H, r + rope]
    r = q_lat.shape[-1]
    outs, lses, t0 = [], [], 0
    for span, n, fresh in zip(spans, sizes, pending):
        selection = span.selection
        if fresh:
            selection = selection.resolve(gathered_words[:, t0:t0 + n])
        elif isinstance(selection, PendingSelection):  # a 'shared' layer after the 'full' one
            selection = selection.resolved
        selection = span.selected_rows(selection)  # a paged cache: its store's slots
        out, lse = ops.latent_attention(q_all[t0:t0 + n], span.read_rows(), selection.indices, selection.valid, scale,
                                        r, valid_prefix=True)  # one span's rows read at a time
        outs.append(out)
        lses.append(lse)
        t0 += n
    latent_out = outs[0] if len(outs) == 1 else torch.cat(outs)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses)
    merged, _ = dcp_merge_to_owners(comm, latent_out.transpose(0, 1), lse.transpose(0, 1), head_ranges)
    return ops.head_linear(merged.to(q_lat.dtype).transpose(0, 1).contiguous(), w_uv)


def owned_selection(top_scores: torch.Tensor, top_positions: torch.Tensor, own: Ownership, k: int) -> "Selection":
    """The global top-k (scores, positions [T, m], from dcp_topk) as this rank's Selection: its owned
    finite entries as local slots p // R, ascending, in a fixed width k (padding: index 0, invalid)."""
    t = top_positions.shape[0]
    keep = torch.isfinite(top_scores) & ((top_positions % own.ranks) == own.index)
    sentinel = torch.iinfo(torch.long).max
    slots = torch.where(keep, torch.div(top_positions, own.ranks, rounding_mode="floor"),
                        torch.full_like(top_positions, sentinel)).sort(dim=1).values
    indices = torch.zeros(t, k, dtype=torch.long, device=top_positions.device)
    valid = torch.zeros(t, k, dtype=torch.bool, device=top_positions.device)
    m = min(k, slots.shape[1])
    valid[:, :m] = slots[:, :m] != sentinel
    indices[:, :m] = torch.where(valid[:, :m], slots[:, :m], torch.zeros_like(slots[:, :m]))
    return Selection(indices, valid)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-rank partial attention (outs [R, ..., dv], lses [R, ...]) in rank order; fp32 result."""
    lses = lses.float()
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # all -inf: avoid -inf - -inf
    total = torch.zeros_like(m)
    acc = torch.zeros(outs.shape[1:], dtype=torch.float32, device=outs.device)
    for r in range(outs.shape[0]):
        w = torch.exp(lses[r] - m_safe)  # exactly 0 where lses[r] = -inf
        total = total + w
        acc = acc + torch.where(w[..., None] > 0, w[..., None] * outs[r].float(), 0.0)
    empty = total == 0
    out = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, total)[..., None])
    lse = torch.where(empty, float("-inf"), m_safe + torch.log(torch.where(empty, 1.0, total)))
    return out, lse


def dcp_merge(comm: Comm, out: torch.Tensor, lse: torch.Tensor,
              heads: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' (out [H, dv], lse [H]) gathered in one collective and merged in rank order.
    `heads` keeps only this rank's heads (TP) after the gather; every rank gets the same bits."""
    packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1)
    parts = comm.all_gather(packed, name="dcp_merge")  # [R, H, dv + 1]
    if heads is not None:
        parts = parts[:, heads]
    return merge_partials(parts[..., :-1], parts[..., -1])


def dcp_merge_to_owners(comm: Comm, out: torch.Tensor, lse: torch.Tensor,
                        head_ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Like dcp_merge(heads=own range) with 1/R of the bytes: one all-to-all sends each rank only
    the heads it owns (padded to the largest range), then the same rank-order merge.
    out [H, *lead, d], lse [H, *lead] over this rank's positions -> merged (out, lse) of this
    rank's heads: [h, *lead, d] (fp32), [h, *lead].
    out travels in its own dtype and lse in fp32, side by side as bytes: a bf16 out costs half the
    bytes of an fp32 copy (the merge widens it to fp32 on arrival, exactly as it would before), and
    under DCP this exchange is a prefill chunk's largest (T x heads x 513 values a layer)."""
    n_heads, lead, d = out.shape[0], tuple(out.shape[1:-1]), out.shape[-1]
    width = max(b - a for a, b in head_ranges)
    out_bytes, lse_bytes = byte_rows(out, n_heads), byte_rows(lse.float(), n_heads)
    packed = torch.cat([out_bytes, lse_bytes], dim=-1)  # [H, bytes of one head's out and lse]
    send = packed.new_zeros((len(head_ranges), width, packed.shape[-1]))
    for j, (a, b) in enumerate(head_ranges):
        send[j, : b - a] = packed[a:b]
    got = comm.all_to_all(send, name="dcp_merge_to_owners")  # [R, width, bytes], row i from rank i
    a, b = head_ranges[comm.rank]
    n_out = out_bytes.shape[-1]
    outs = got[:, : b - a, :n_out].contiguous().view(out.dtype).reshape(len(head_ranges), b - a, *lead, d)
    lses = got[:, : b - a, n_out:].contiguous().view(torch.float32).reshape(len(head_ranges), b - a, *lead)
    return merge_partials(outs, lses)


# ---- top-k with a deterministic tie-break ---------------------------------------------------
def _orderable(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int64 in [0, 2**32) with the same order (-0.0 and +0.0 equal); NaN raises."""
    if bool(torch.isnan(scores).any()):
        raise ValueError("top-k scores contain NaN; the indexer must mask with -inf, never NaN")
    return _orderable_bits(scores)


def _orderable_bits(scores: torch.Tensor) -> torch.Tensor:
    """_orderable without the NaN check (a host sync): for callers that count NaNs themselves."""
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0
    u = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = (u & 0x80000000) != 0
    return torch.where(negative, (~u) & 0xFFFFFFFF, u | 0x80000000)


def topk_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 key per entry: larger key = higher score, then lower position."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) > _POS_MASK):
        raise ValueError(f"positions must lie in 0..{_POS_MASK}")
    return (_orderable(scores) << POSITION_BITS) | (_POS_MASK - positions.to(torch.int64))


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys -> (scores fp32, positions int64)."""
    positions = _POS_MASK - (keys & _POS_MASK)
    o = keys >> POSITION_BITS
    u = torch.where((o & 0x80000000) != 0, o & 0x7FFFFFFF, (~o) & 0xFFFFFFFF)
    signed = torch.where(u >= 0x80000000, u - (1 << 32), u).to(torch.int32)
    return signed.view(torch.float32), positions


def local_topk_keys(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest keys of scores [..., n] at positions [n] (or [..., n]), padded with PAD_KEY to k."""
    keys = topk_keys(scores, positions.expand_as(scores))
    n = keys.shape[-1]
    top = torch.topk(keys, min(k, n), dim=-1, sorted=True).values if n else keys
    if top.shape[-1] < k:
        pad = torch.full((*top.shape[:-1], k - top.shape[-1]), PAD_KEY, dtype=torch.int64, device=keys.device)
        top = torch.cat([top, pad], dim=-1)
    return top


def topk_tiebreak(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-rank top-k (higher score first, lower position on ties), min(k, n) entries, sorted."""
    n = scores.shape[-1]
    keys = local_topk_keys(scores, positions, k)[..., : min(k, n)]
    return decode_keys(keys)


def merge_topk_keys(gathered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered local top-k keys [R, ..., k] -> the global top-k (scores, positions), pads dropped.
    Every query row must have the same number of real entries (true for one decode step)."""
    flat = gathered.movedim(0, -2).flatten(-2)  # [..., R*k]
    top = torch.topk(flat, k, dim=-1, sorted=True).values
    real = int((top >= 0).sum(dim=-1).min()) if top.numel() else 0
    return decode_keys(top[..., :real])


def dcp_topk(comm: Comm, scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k over all ranks' owned positions: one all-gather of k int64 keys per query row.
    Identical on every rank, and identical to `topk_tiebreak` over the union of positions."""
    local = local_topk_keys(scores, positions, k)
    return merge_topk_keys(comm.all_gather(local, name="dcp_topk"), k)
