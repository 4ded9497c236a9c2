"""glm53.model.mla.attend (absorbed MLA, each query over its own selected rows) and the indexer's
select_topk, on CPU at small dims.

Tolerance: fp32 everywhere; out and lse agree with the reference's expanded formulation
(mla.attend_expanded: keys expanded through kv_b, every key scored under the selection as a mask)
to atol 2e-5, rtol 1e-5 (different summation order). Rows with no allowed key must be exactly 0 /
-inf. Bitwise claims (determinism, unselected rows, other queries) are checked with torch.equal.
"""
from __future__ import annotations

import pytest
import torch

from glm53.model.indexer import Selection, select_topk
from glm53.model.mla import AttentionWeights, attend, attend_expanded

H, NOPE, ROPE, V, R = 4, 16, 8, 12, 32
ATOL, RTOL = 2e-5, 1e-5


def weights(seed: int = 0) -> AttentionWeights:
    g = torch.Generator().manual_seed(seed)
    unused = torch.zeros(1, 1)
    return AttentionWeights(q_a=unused, q_a_norm=unused, q_b=unused, kv_a=unused, kv_a_norm=unused,
                            kv_b=torch.randn(H * (NOPE + V), R, generator=g) * 0.3, o=unused, n_heads=H,
                            nope=NOPE, rope=ROPE, v_dim=V, kv_rank=R, scale=(NOPE + ROPE) ** -0.5)


def inputs(tq: int, tk: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries for the last tq positions of a tk-row cache, and causal indexer-like scores [tq, tk]."""
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(tq, H, NOPE, generator=g)
    q_rot = torch.randn(tq, H, ROPE, generator=g)
    cached = torch.randn(tk, R + ROPE, generator=g)
    scores = torch.randn(tq, tk, generator=g)
    q_pos = torch.arange(tk - tq, tk)
    scores = scores.masked_fill(torch.arange(tk)[None, :] > q_pos[:, None], float("-inf"))
    return q_nope, q_rot, cached, scores


def without(selection: Selection, rows: list[int]) -> Selection:
    valid = selection.valid.clone()
    valid[rows] = False
    return Selection(selection.indices, valid)


def check_close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (out, lse), (out_ref, lse_ref) = got, want
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=RTOL)
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tq,tk,k", [(6, 5, 8),      # Tk < k: every causal key, padded to k
                                     (8, 8, 8),      # Tk == k
                                     (24, 300, 8),   # Tk >> k
                                     (40, 120, 16)])
def test_matches_the_expanded_reference(tq: int, tk: int, k: int) -> None:
    w = weights()
    q_nope, q_rot, cached, scores = inputs(tq, tk)
    selection = without(select_topk(scores, k), [1, tq - 1])  # queries with no allowed key
    got = attend(w, q_nope, q_rot, cached, selection)
    check_close(got, attend_expanded(w, q_nope, q_rot, cached, selection.mask(tk)))
    out, lse = got
    assert out.shape == (tq, H, V) and lse.shape == (tq, H) and lse.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros(H, V)) and torch.isneginf(lse[1]).all()
    assert torch.isfinite(lse[2:-1]).all()


def test_all_rows_empty_and_empty_cache() -> None:
    w = weights()
    q_nope, q_rot, cached, _ = inputs(3, 10)
    none = Selection(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.bool))
    for rows in (cached, cached[:0]):
        out, lse = attend(w, q_nope, q_rot, rows, none)
        assert torch.equal(out, torch.zeros(3, H, V)) and torch.isneginf(lse).all()


def test_deterministic_bitwise() -> None:
    w = weights()
    q_nope, q_rot, cached, scores = inputs(32, 200)
    selection = select_topk(scores, 16)
    a = attend(w, q_nope, q_rot, cached, selection)
    b = attend(w, q_nope, q_rot, cached, selection)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_query_does_not_depend_on_the_other_queries() -> None:
    """Any slice of the queries (one, an odd count, an offset block) gives its rows' bits: decode,
    a verification window and a resumed prefill piece compute what a cold prefill computes."""
    w = weights()
    q_nope, q_rot, cached, scores = inputs(300, 400)
    sel = select_topk(scores, 16)
    full = attend(w, q_nope, q_rot, cached, sel)
    for a, b in ((0, 1), (299, 300), (5, 18), (17, 290), (256, 300)):
        part = attend(w, q_nope[a:b], q_rot[a:b], cached, Selection(sel.indices[a:b], sel.valid[a:b]))
        assert torch.equal(part[0], full[0][a:b]) and torch.equal(part[1], full[1][a:b]), (a, b)


def test_unselected_rows_do_not_change_bits() -> None:
    """A query's result depends on its selected rows only: more history (never selected) or other
    values in unselected rows leave the output bitwise unchanged (so it cannot depend on Tk)."""
    w, k = weights(), 8
    q_nope, q_rot, cached, scores = inputs(16, 64)
    selection = select_topk(scores, k)
    base = attend(w, q_nope, q_rot, cached, selection)
    longer = torch.cat([cached, torch.randn(500, R + ROPE)])
    used = selection.mask(64).any(0)
    noisy = torch.where(used[:, None], cached, torch.randn_like(cached))
    for rows in (longer, noisy):
        other = attend(w, q_nope, q_rot, rows, selection)
        assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])


def brute_force_topk(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per row: the k best finite scores by (higher score, lower position), ascending positions."""
    out = []
    for row in scores.tolist():
        finite = [(-s, p) for p, s in enumerate(row) if s != float("-inf")]
        out.append(sorted(p for _, p in sorted(finite)[:k]))
    return out


@pytest.mark.parametrize("k", [1, 7, 40, 400])
def test_select_topk_ties_toward_the_lower_position(k: int) -> None:
    """Many exact ties (zeros, -0.0, repeated values) and future (-inf) keys: the set is the brute-force
    rule's, ascending, padded to width k with index 0 / invalid."""
    g = torch.Generator().manual_seed(3)
    _, _, _, scores = inputs(50, 300)
    scores = torch.where(torch.rand(scores.shape, generator=g) < 0.4, torch.zeros(()), scores.round())
    scores = scores.masked_fill(torch.arange(300)[None, :] > torch.arange(250, 300)[:, None], float("-inf"))
    scores[3, ::2] = -0.0
    scores[4, :250] = 0.0
    sel = select_topk(scores, k)
    assert sel.indices.shape == (50, k) and sel.valid.shape == (50, k)
    want = brute_force_topk(scores, k)
    for t in range(50):
        got = sel.indices[t][sel.valid[t]].tolist()
        assert got == want[t], t
        assert sel.valid[t].tolist() == [True] * len(got) + [False] * (k - len(got))
        assert sel.indices[t][~sel.valid[t]].eq(0).all()


@pytest.mark.parametrize("n", [39, 40, 41, 42, 43, 80])
def test_select_topk_at_every_width_around_k_with_ties_at_above_and_below_the_kth(n: int) -> None:
    """k = 40 over n keys: rows whose k-th score ties with the (k+1)-th (the packed keys decide),
    whose (k+1)-th ties with the (k+2)-th only (the plain top-k+1 decides), ties above the k-th,
    -0.0 against 0.0, fewer than k finite keys: always the brute-force rule's set."""
    k, t = 40, 24
    g = torch.Generator().manual_seed(n)
    scores = torch.randint(-6, 7, (t, n), generator=g).float()  # few values: ties everywhere
    scores[:, :n // 3] += torch.rand(t, n // 3, generator=g)  # some rows' head distinct
    order = scores.sort(dim=1, descending=True).values
    if n > k + 1:
        scores[0] = torch.arange(n, 0, -1).float()
        scores[0, k] = scores[0, k - 1]  # k-th == (k+1)-th: a boundary tie
        scores[1] = torch.arange(n, 0, -1).float()
        scores[1, k + 1] = scores[1, k]  # (k+1)-th == (k+2)-th only: no boundary tie
    scores[2] = torch.where(scores[2] == 0, torch.full_like(scores[2], -0.0), scores[2])
    scores[3, : n - 5] = float("-inf")  # five finite keys
    scores[4] = order[4]  # already sorted, ties in runs
    scores[5] = 0.0
    sel = select_topk(scores, k)
    want = brute_force_topk(scores, k)
    for row in range(t):
        assert sel.indices[row][sel.valid[row]].tolist() == want[row], row


def test_select_topk_without_ties_takes_the_plain_topk_and_the_same_set(monkeypatch) -> None:
    """Continuous scores (no tie at any row's k-th score): the fp32 top-k path alone (the packed
    keys are never built) gives the brute-force set; one planted boundary tie sends that row, and
    only that row, through the packed keys."""
    import glm53.model.indexer as indexer

    g = torch.Generator().manual_seed(8)
    scores = torch.randn(40, 500, generator=g)
    scores = scores.masked_fill(torch.arange(500)[None, :] > torch.arange(460, 500)[:, None], float("-inf"))
    packed_rows = []
    real = indexer._packed_topk
    monkeypatch.setattr(indexer, "_packed_topk", lambda s, w: packed_rows.append(s.shape[0]) or real(s, w))
    sel = select_topk(scores, 32)
    assert packed_rows == []
    for t, want in enumerate(brute_force_topk(scores, 32)):
        assert sel.indices[t][sel.valid[t]].tolist() == want
    kth = scores[5].topk(32).values[-1]
    scores[5, 499] = float("-inf")
    scores[5, 0:2] = kth  # position 0 or 1 already held the 32nd score: now it ties with the other
    sel = select_topk(scores, 32)
    assert packed_rows == [1]
    assert sel.indices[5][sel.valid[5]].tolist() == brute_force_topk(scores, 32)[5]


@pytest.mark.parametrize("rows_each", [1, 5])
def test_select_topk_over_rows_padded_with_minus_inf_equals_each_row_alone(rows_each: int) -> None:
    """A batched step selects several windows' rows in one call, each row padded with -inf to the
    longest window's keys: each row's indices and validity are the ones its window's own rows give
    (fewer keys than k, about k, many; ties, -0.0, +inf; 4 windows of 1 row and of 5: both torch forms)."""
    k = 40
    g = torch.Generator().manual_seed(rows_each)
    lengths = [7, 40, 41, 300]
    windows = []
    for n in lengths:
        scores = torch.randint(-3, 4, (rows_each, n), generator=g).float()
        scores[:, ::3] = -0.0
        scores[0, n // 2] = float("inf")
        scores[-1, : n // 4] = float("-inf")
        windows.append(scores)
    padded = torch.full((rows_each * len(lengths), max(lengths)), float("-inf"))
    for i, w in enumerate(windows):
        padded[i * rows_each:(i + 1) * rows_each, : w.shape[1]] = w
    together = select_topk(padded, k)
    for i, w in enumerate(windows):
        alone, rows = select_topk(w, k), slice(i * rows_each, (i + 1) * rows_each)
        assert torch.equal(together.indices[rows], alone.indices) and torch.equal(together.valid[rows], alone.valid), i
