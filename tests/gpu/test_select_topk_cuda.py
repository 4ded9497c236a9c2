"""The indexer's top-k selection on CUDA equals the CPU's (which tests/test_attention.py checks
against the brute-force rule), at GLM-5.3's k = 2048 over prefill-sized rows with exact ties at,
above and below the k-th score, -0.0 against 0.0, and future (-inf) keys. More than 16 rows run the
Triton kernel (glm53/ops/triton_topk.py) where rows have at most its MAX_KEYS keys, one program a
row; up to 16 rows (decode, verification) each row spread over programs; longer rows the torch form.

    pytest -m gpu tests/gpu/test_select_topk_cuda.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm53.model.indexer import SMALL_WINDOW_ROWS, select_topk, select_topk_torch  # noqa: E402

pytestmark = pytest.mark.gpu


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device here; run on the lent H200 (see bench/results/README.md)")


@pytest.mark.parametrize("n,t", [(2047, 48), (2048, 48), (2049, 48), (2050, 48), (6000, 48), (70001, 40),
                                 (140001, 20), (270001, 20), (3000, SMALL_WINDOW_ROWS), (19001, 1), (19001, 4),
                                 (2047, 2), (94001, 6), (262144, 3), (270001, 2)])
def test_cuda_selection_equals_the_cpu_rule(n: int, t: int) -> None:
    _cuda()
    k = 2048
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(max(t, 4), n, generator=g)  # short windows: the first t of these rows
    half = max(t, 4) // 2
    scores[:half] = (scores[:half] * 4).round()  # half the rows: few values, ties everywhere
    scores[half - 1] = torch.arange(n, 0, -1).float()
    if n > k + 1:
        scores[half - 1, k] = scores[half - 1, k - 1]  # a boundary tie in an otherwise distinct row
    scores[half] = torch.where(scores[half] > 0, scores[half], torch.full_like(scores[half], -0.0))
    scores[half + 1] = 0.0
    if t < 4:  # a window of one or two: the tie rows first
        scores = scores[[0, half - 1, half, half + 1][:t]]
    future = torch.arange(n)[None, :] > (n - t + torch.arange(t))[:, None]  # the last t keys causal
    scores = scores.masked_fill(future, float("-inf"))
    want = select_topk(scores, k)
    got = select_topk(scores.cuda(), k)
    assert torch.equal(got.valid.cpu(), want.valid)
    assert torch.equal(got.indices.cpu(), want.indices)


def test_kernel_and_torch_form_agree_on_cuda_and_nan_is_reported() -> None:
    """The kernel against the torch form on the same device (prefill-sized, both tie kinds), and NaN:
    raised without a flag, or-ed into the flag with one (nothing read on the host)."""
    _cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    scores = torch.randn(700, 20000, generator=g, device="cuda")
    scores[::3] = (scores[::3] * 6).round()
    a, b = select_topk(scores, 2048), select_topk_torch(scores, 2048)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.valid, b.valid)
    scores[11, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        select_topk(scores, 2048)
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    select_topk(scores, 2048, flag)
    assert bool(flag)


def test_short_window_selection_replays_in_a_cuda_graph() -> None:
    """The decode form (each row over many programs, a fixed count of launches, nothing read on the
    host) captured once and replayed on new scores in place: each replay the selection of an eager
    call, NaN into the flag."""
    _cuda()
    g = torch.Generator(device="cuda").manual_seed(9)
    scores = torch.randn(4, 19001, generator=g, device="cuda")
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    select_topk(scores, 2048, flag)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select_topk(scores, 2048, flag)
    for seed in range(3):
        fresh = torch.randn(4, 19001, generator=g, device="cuda")
        if seed == 1:
            fresh[:2] = (fresh[:2] * 3).round()  # ties at the k-th score
        scores.copy_(fresh)
        graph.replay()
        want = select_topk_torch(fresh, 2048)
        assert torch.equal(captured.indices, want.indices) and torch.equal(captured.valid, want.valid), seed
    assert not bool(flag)
    scores[2, 100] = float("nan")
    graph.replay()
    assert bool(flag)


@pytest.mark.parametrize("n,t", [(16205, 300), (262144, 40), (16205, 1), (94001, 4), (3000, 16)])
def test_dcp_pending_selection_on_cuda_equals_the_reference_merge(n: int, t: int) -> None:
    """Under DCP a rank's candidates come from the selection kernels over its own quarter of the
    keys (glm53.dist.dcp.PendingSelection), the global share from a threshold on the gathered keys:
    each of 4 ranks' Selection equals the reference (sorted int64 top-k keys per rank, merged,
    owned_selection), with ties at the k-th score, +inf and -inf among the keys. Ranks simulated on
    one device: their words stacked as the all-gather would hand them over."""
    _cuda()
    from glm53.dist import dcp

    k, R = 2048, 4
    g = torch.Generator().manual_seed(n + t)
    scores = torch.randn(t, n, generator=g)
    scores[: t // 2] = (scores[: t // 2] * 4).round()  # ties everywhere
    scores[:, n - n // 5:] = float("-inf")  # the future
    scores[t - 1, ::997] = float("inf")
    scores = scores.cuda()
    positions = torch.arange(n, device="cuda")
    owned = [dcp.Ownership(r, R).owned_positions(0, n, device="cuda") for r in range(R)]
    pending = [dcp.PendingSelection.of(scores[:, p], positions[p], dcp.Ownership(r, R), k)
               for r, p in enumerate(owned)]
    words = torch.stack([p.words for p in pending])
    keys = torch.stack([dcp.local_topk_keys(scores[:, p], positions[p], k) for p in owned])
    reference = dcp.merge_topk_keys(keys, k)
    for r in range(R):
        want = dcp.owned_selection(*reference, dcp.Ownership(r, R), k)
        got = pending[r].resolve(words)
        assert torch.equal(got.valid, want.valid) and torch.equal(got.indices, want.indices), r
