"""The indexer's top-k selection on CUDA equals the CPU's (which tests/test_attention.py checks
against the brute-force rule), at GLM-5.3's k = 2048 over prefill-sized rows with exact ties at,
above and below the k-th score, -0.0 against 0.0, and future (-inf) keys.

    pytest -m gpu tests/gpu/test_select_topk_cuda.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm53.model.indexer import select_topk  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [2047, 2048, 2049, 2050, 6000])
def test_cuda_selection_equals_the_cpu_rule(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device here; run on the lent H200 (see bench/results/README.md)")
    k, t = 2048, 48
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(t, n, generator=g)
    scores[: t // 2] = (scores[: t // 2] * 4).round()  # half the rows: few values, ties everywhere
    scores[t // 2 - 1] = torch.arange(n, 0, -1).float()
    if n > k + 1:
        scores[t // 2 - 1, k] = scores[t // 2 - 1, k - 1]  # a boundary tie in an otherwise distinct row
    scores[t // 2] = torch.where(scores[t // 2] > 0, scores[t // 2], torch.full_like(scores[t // 2], -0.0))
    scores[t // 2 + 1] = 0.0
    future = torch.arange(n)[None, :] > (n - t + torch.arange(t))[:, None]  # the last t keys causal
    scores = scores.masked_fill(future, float("-inf"))
    want = select_topk(scores, k)
    got = select_topk(scores.cuda(), k)
    assert torch.equal(got.valid.cpu(), want.valid)
    assert torch.equal(got.indices.cpu(), want.indices)
