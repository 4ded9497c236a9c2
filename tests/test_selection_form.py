"""Every producer of a Selection writes its valid slots first (valid[t, j] exactly for j < the row's
count): latent_attention is called with valid_prefix=True on that promise and derives validity from
the count instead of loading it (a mask of another form would give wrong attention, silently)."""
from __future__ import annotations

import torch

from glm53.dist import dcp
from glm53.model.indexer import Selection, select_topk_torch

from tests.test_dist_units import _ranks_resolve


def assert_prefix_form(sel: Selection, what: str) -> None:
    counts = sel.valid.sum(dim=1, keepdim=True)
    first = torch.arange(sel.valid.shape[1])[None, :] < counts
    assert torch.equal(sel.valid, first), f"{what}: valid slots are not each row's first"
    assert not sel.indices[~sel.valid].any(), f"{what}: an invalid slot's index is not 0"


def scores_with_gaps(g: torch.Generator, t: int, n: int) -> torch.Tensor:
    """Ties, -inf (never valid) and +inf (chosen, then invalid as not finite) among finite scores."""
    scores = torch.randint(0, 4, (t, n), generator=g).float()
    scores[torch.rand(t, n, generator=g) < 0.3] = float("-inf")
    scores[torch.rand(t, n, generator=g) < 0.05] = float("inf")
    scores[0] = float("-inf")  # a row that selects nothing
    return scores


def test_from_mask_gives_the_prefix_form() -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        mask = torch.rand(6, 50, generator=g) < torch.rand(6, 1, generator=g) * 0.4
        assert_prefix_form(Selection.from_mask(mask, 24), "from_mask")


def test_torch_top_k_gives_the_prefix_form() -> None:
    """The CPU's (and long CUDA rows') selection, in all its ways: short windows, every column chosen,
    top-(k + 1) with and without ties."""
    g = torch.Generator().manual_seed(4)
    for t, n, k in [(2, 40, 16), (30, 40, 16), (30, 12, 16), (30, 300, 64), (30, 64, 64)]:
        assert_prefix_form(select_topk_torch(scores_with_gaps(g, t, n), k), f"select_topk_torch {t}x{n} k={k}")


def test_dcp_selections_give_the_prefix_form() -> None:
    """A rank's share of the global top-k: owned_selection, and PendingSelection resolved against
    every rank's keys (the form tp_dcp_attention_spans attends with)."""
    g = torch.Generator().manual_seed(5)
    for n, k in [(40, 8), (300, 64), (200, 300)]:
        scores = scores_with_gaps(g, 6, n)
        positions = torch.arange(n)
        for R in (1, 2, 4):
            keys = torch.stack([dcp.local_topk_keys(scores[:, p], positions[p], k)
                                for p in (dcp.Ownership(r, R).owned_positions(0, n) for r in range(R))])
            reference = dcp.merge_topk_keys(keys, k)
            resolved, _ = _ranks_resolve(scores, R, k)
            for r in range(R):
                assert_prefix_form(dcp.owned_selection(*reference, dcp.Ownership(r, R), k), f"owned {n} {R} {r}")
                assert_prefix_form(resolved[r], f"resolved {n} {R} {r}")
