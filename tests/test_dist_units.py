"""glm53.dist pure parts in one process: ownership, merges, top-k keys, TP partitions, settings."""
from __future__ import annotations

import math

import pytest
import torch

from glm53.dist import dcp, tp
from glm53.dist.guard import GuardSettings
from glm53.dist.rendezvous import RendezvousError, RendezvousSpec, spec_from_env
from glm53.settings import Settings, SettingsError


# ---- ownership ------------------------------------------------------------------------------
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_ownership_partitions_every_range_and_maps_slots_both_ways(R: int) -> None:
    n = 29
    owners = [dcp.Ownership(r, R) for r in range(R)]
    for start, end in [(0, n), (5, 17), (3, 4), (7, 7)]:
        got = torch.cat([o.owned_positions(start, end) for o in owners]).sort().values
        assert torch.equal(got, torch.arange(start, end))
    for o in owners:
        pos = o.owned_positions(0, n)
        assert o.count(n) == pos.numel()
        assert torch.equal(o.positions_of(o.slots_of(pos)), pos)
        assert all(o.owner(int(p)) == o.index and o.slot(int(p)) == int(p) // R for p in pos)
        assert torch.equal(o.slots_of(pos), torch.arange(pos.numel()))  # dense slots 0..count-1
    if R > 1:
        with pytest.raises(ValueError, match="lives on DCP rank 1"):
            owners[0].slot(1)


def test_prefill_chunks_written_to_owners_rebuild_the_cache() -> None:
    R, n, d = 3, 23, 5
    rows = torch.randn(n, d)
    caches = [torch.full((dcp.Ownership(r, R).slots_needed(n), d), float("nan")) for r in range(R)]
    for start in range(0, n, 7):  # chunks of 7 positions, computed on every rank
        chunk = rows[start:start + 7]
        for r in range(R):
            slots, mine = dcp.Ownership(r, R).rows_to_write(start, chunk)
            caches[r][slots] = mine
    rebuilt = torch.empty(n, d)
    for r in range(R):
        own = dcp.Ownership(r, R)
        rebuilt[own.positions_of(torch.arange(caches[r].shape[0]))] = caches[r]
    assert torch.equal(rebuilt, rows)


def test_dcp_off_means_every_rank_holds_every_position() -> None:
    assert Settings.from_env({}).dcp and not Settings.from_env({"TF_GLM53_DCP": "0"}).dcp
    with pytest.raises(ValueError, match="TF_GLM53_DCP='yes'"):
        Settings.from_env({"TF_GLM53_DCP": "yes"})
    own = dcp.Ownership.for_rank(2, 4, enabled=False)
    assert own == dcp.Ownership(0, 1) and torch.equal(own.owned_positions(0, 9), torch.arange(9))


# ---- attention merge ------------------------------------------------------------------------
@pytest.mark.parametrize("R,n", [(1, 50), (3, 50), (4, 2), (4, 0)])
def test_merge_equals_single_rank_attention(R: int, n: int) -> None:
    g = torch.Generator().manual_seed(R * 100 + n)
    q, k, v = torch.randn(6, 16, generator=g), torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)
    want_o, want_lse = dcp.attend_reference(q, k, v, 0.25)
    parts = [dcp.attend_reference(q, k[p], v[p], 0.25)
             for p in (dcp.Ownership(r, R).owned_positions(0, n) for r in range(R))]
    o, lse = dcp.merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o, want_o, atol=2e-6, rtol=2e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=2e-6)


def test_merge_ignores_garbage_from_empty_ranks_and_defines_all_empty() -> None:
    outs = torch.tensor([[[float("nan"), float("inf")]], [[1.0, 2.0]], [[float("nan"), 0.0]]])
    lses = torch.tensor([[float("-inf")], [0.5], [float("-inf")]])
    o, lse = dcp.merge_partials(outs, lses)
    assert torch.equal(o, torch.tensor([[1.0, 2.0]])) and torch.equal(lse, torch.tensor([0.5]))
    o, lse = dcp.merge_partials(outs, torch.full((3, 1), float("-inf")))
    assert torch.equal(o, torch.zeros(1, 2)) and bool(torch.isneginf(lse).all())


def test_merge_is_stable_for_huge_lse_gaps() -> None:
    outs = torch.tensor([[[1.0]], [[3.0]]])
    o, lse = dcp.merge_partials(outs, torch.tensor([[1000.0], [-1000.0]]))
    assert torch.equal(o, torch.tensor([[1.0]])) and float(lse) == 1000.0
    o, lse = dcp.merge_partials(outs, torch.tensor([[7.0], [7.0]]))
    assert torch.equal(o, torch.tensor([[2.0]])) and math.isclose(float(lse), 7.0 + math.log(2), rel_tol=1e-6)


# ---- top-k ----------------------------------------------------------------------------------
def test_keys_round_trip_and_order_by_score_then_lower_position() -> None:
    scores = torch.tensor([0.0, -0.0, 1e-38, -1e-38, 3.5, -3.5, float("inf"), float("-inf"), 3.5])
    positions = torch.tensor([9, 3, 4, 5, 7, 8, 100, 0, 2])
    s, p = dcp.decode_keys(dcp.topk_keys(scores, positions))
    assert torch.equal(p, positions) and torch.equal(s, scores + 0.0)
    s, p = dcp.topk_tiebreak(scores, positions, 20)
    assert p.tolist() == [100, 2, 7, 4, 3, 9, 5, 8, 0]  # +-0.0 tie: position 3 before 9


def test_topk_merge_over_ranks_equals_single_rank_with_ties() -> None:
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 3, (4, 300), generator=g).float()  # massive ties
    positions = torch.arange(300)
    for R in (2, 3, 4):
        for k in (1, 17, 64, 300, 400):
            want = dcp.topk_tiebreak(scores, positions, k)
            keys = torch.stack([dcp.local_topk_keys(scores[:, p], positions[p], k)
                                for p in (dcp.Ownership(r, R).owned_positions(0, 300) for r in range(R))])
            got = dcp.merge_topk_keys(keys, k)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (R, k)


def _ranks_resolve(scores: torch.Tensor, R: int, k: int, nan_flag: torch.Tensor | None = None):
    """Every rank's PendingSelection over its owned columns, resolved against the stacked words (what
    tp_dcp_attention_spans' all-gather hands each rank)."""
    n = scores.shape[1]
    positions = torch.arange(n)
    owned = [dcp.Ownership(r, R).owned_positions(0, n) for r in range(R)]
    pending = [dcp.PendingSelection.of(scores[:, p], positions[p], dcp.Ownership(r, R), k, nan_flag)
               for r, p in enumerate(owned)]
    words = torch.stack([p.words for p in pending])
    return [p.resolve(words) for p in pending], owned


def test_pending_selection_equals_the_reference_merge_with_ties_and_infinities() -> None:
    """The kernels' local selection + a threshold from the gathered keys gives each rank exactly what
    the reference (every rank's sorted top-k keys, merged, owned_selection) gives: massive ties, +inf
    (ranked first, then dropped), -inf, -0.0 against 0.0, rows shorter than k, k past the row."""
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        n = int(torch.randint(1, 300, (1,), generator=g))
        scores = torch.randint(0, 3, (6, n), generator=g).float()
        scores[torch.rand(6, n, generator=g) < 0.05] = float("inf")
        scores[torch.rand(6, n, generator=g) < 0.1] = float("-inf")
        scores[1] = float("-inf")  # a query that sees nothing
        scores[0, 0] = -0.0
        positions = torch.arange(n)
        for R in (1, 2, 3, 4):
            for k in (1, 3, 17, 64, 300):
                keys = torch.stack([dcp.local_topk_keys(scores[:, p], positions[p], k)
                                    for p in (dcp.Ownership(r, R).owned_positions(0, n) for r in range(R))])
                reference = dcp.merge_topk_keys(keys, k)
                got, _ = _ranks_resolve(scores, R, k)
                for r in range(R):
                    want = dcp.owned_selection(*reference, dcp.Ownership(r, R), k)
                    assert torch.equal(got[r].indices, want.indices) and torch.equal(got[r].valid, want.valid), \
                        (trial, n, R, k, r)


def test_pending_selection_with_more_inf_than_k_keeps_nothing() -> None:
    """+inf entries fill the global top-k and are dropped as not finite: no finite entry is chosen,
    although every rank's own candidates are finite."""
    scores = torch.zeros(2, 40)
    scores[:, 0:40:4] = float("inf")  # 10 +inf, all on rank 0 of 4
    got, _ = _ranks_resolve(scores, 4, 8)
    assert all(int(s.valid.sum()) == 0 for s in got)
    got, owned = _ranks_resolve(scores, 4, 12)  # room for 2 finite: positions 1 and 2 (lowest first)
    for row in range(2):
        chosen = sorted(int(owned[r][i]) for r, s in enumerate(got) for i in s.indices[row][s.valid[row]])
        assert chosen == [1, 2]


def test_pending_selection_nan_on_one_rank_raises_on_every_rank() -> None:
    """NaN scores travel as a count in the words: every rank's resolve sees them and raises (no rank
    is left waiting in a collective its peer skipped), or flags them where the caller checks later."""
    scores = torch.randn(3, 50)
    scores[2, 13] = float("nan")  # rank 1 of 4 owns position 13
    n = scores.shape[1]
    pending = [dcp.PendingSelection.of(scores[:, p], torch.arange(n)[p], dcp.Ownership(r, 4), 8)
               for r, p in enumerate(dcp.Ownership(r, 4).owned_positions(0, n) for r in range(4))]
    words = torch.stack([p.words for p in pending])
    for p in pending:
        with pytest.raises(ValueError, match="NaN"):
            p.resolve(words)
    flag = torch.zeros((), dtype=torch.bool)
    got, _ = _ranks_resolve(scores, 4, 8, nan_flag=flag)
    assert bool(flag) and len(got) == 4
    flag.zero_()
    _ranks_resolve(torch.randn(3, 50), 4, 8, nan_flag=flag)
    assert not bool(flag)


def test_topk_rejects_nan_scores() -> None:
    with pytest.raises(ValueError, match="NaN"):
        dcp.topk_tiebreak(torch.tensor([1.0, float("nan")]), torch.arange(2), 1)


# ---- TP partitions --------------------------------------------------------------------------
def test_head_and_vocab_partitions() -> None:
    assert [e - s for s, e in tp.head_ranges(64, 4)] == [16, 16, 16, 16]
    assert tp.head_ranges(64, 3) == [(0, 22), (22, 43), (43, 64)]
    v = tp.vocab_ranges(154880, 3)
    assert v[0][0] == 0 and v[-1][1] == 154880 and all(a[1] == b[0] for a, b in zip(v, v[1:]))
    assert [e - s for s, e in v] == [51627, 51627, 51626]


def test_intermediate_blocks_rotate_the_extra_by_layer() -> None:
    assert tp.block_counts(16, 4, 7) == [4, 4, 4, 4]
    assert [tp.block_counts(16, 3, layer) for layer in range(4)] == [[6, 5, 5], [5, 6, 5], [5, 5, 6], [6, 5, 5]]
    for layer in range(3):
        ranges = tp.column_ranges(2048, 3, layer)
        assert ranges[0][0] == 0 and ranges[-1][1] == 2048
        assert all(a[1] == b[0] and (b[1] - b[0]) % 128 == 0 for a, b in zip(ranges, ranges[1:]))
    assert tp.column_ranges(12288, 3, 0) == [(0, 4096), (4096, 8192), (8192, 12288)]
    with pytest.raises(ValueError, match="not a multiple"):
        tp.column_ranges(100, 2, 0)


# ---- settings -------------------------------------------------------------------------------
def test_settings_and_specs_reject_bad_input_naming_it() -> None:
    assert GuardSettings.from_settings(Settings.from_env({"TF_GLM53_DEAD_AFTER_S": "2.5"})).dead_after_s == 2.5
    assert GuardSettings.from_settings(Settings()) == GuardSettings()  # one set of defaults
    with pytest.raises(SettingsError, match="TF_GLM53_HEARTBEAT_S='fast'"):
        Settings.from_env({"TF_GLM53_HEARTBEAT_S": "fast"})
    with pytest.raises(RendezvousError, match="lacks MASTER_PORT, RANK"):
        spec_from_env({"MASTER_ADDR": "h", "WORLD_SIZE": "2"})
    spec = spec_from_env({"MASTER_ADDR": "h", "MASTER_PORT": "1234", "RANK": "1", "WORLD_SIZE": "3",
                          "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (spec.rank, spec.world_size, spec.master, spec.master_port, spec.agent_store) == (1, 3, "h", 1234, True)
    with pytest.raises(RendezvousError, match="rank 4 is outside 0..3"):
        RendezvousSpec(4, 4)


# ---- attention over the selected rows only ----------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 37])
def test_selected_attention_equals_masked_attention_and_empty_selections_give_minus_inf(n: int) -> None:
    """What a DCP rank computes over its own selected rows (glm53.ops.latent_attention on a fixed-width
    Selection) against plain masked attention over all its rows."""
    from glm53 import ops
    from glm53.model.indexer import Selection

    g = torch.Generator().manual_seed(n)
    T, H, r, rope = 70, 3, 12, 4  # more queries than one block (64)
    q_lat, q_rot = torch.randn(T, H, r, generator=g), torch.randn(T, H, rope, generator=g)
    rows = torch.randn(n, r + rope, generator=g)
    mask = torch.rand(T, n, generator=g) < 0.3
    mask[5] = False  # a query that selected nothing on this rank
    want_out, want_lse = dcp.attend_latent(q_lat, q_rot, rows, 0.3, mask)
    sel = Selection.from_mask(mask, max(n, 1))
    got_out, got_lse = ops.latent_attention(torch.cat([q_lat, q_rot], -1), rows, sel.indices, sel.valid, 0.3, r)
    torch.testing.assert_close(got_out, want_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=2e-6, rtol=0)
    assert torch.isneginf(got_lse[5]).all() and (got_out[5] == 0).all()
    assert not torch.isnan(got_out).any()
