"""The packed EXL3 path through the whole engine on CUDA: the tiny checkpoint with every linear EXL3
(its experts, shared expert, dense MLP and attention projections from the trellis).

A 300-token prompt's prefill hidden states and its greedy reply are the same bits whether the prefill
runs in 32-row pieces (every matrix decoded inside its row tiles) or in one 300-row piece (every
matrix of 128 rows or more decoded once into the stage, glm53/ops/triton_exl3.py), and whether its
first half comes from the prefix cache or is computed.

    pytest -m gpu tests/gpu/test_exl3_engine_cuda.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures_tiny import tiny_exl3_all_dirs  # noqa: E402,F401  (the session's EXL3 checkpoint)

pytestmark = pytest.mark.gpu

PROMPT = 300
GREEDY = {"temperature": 0.0}


def prefill(engine, prompt: list[int], reuse: bool) -> tuple[torch.Tensor, list[int], int]:
    """(the prefill's hidden states, the greedy reply, the tokens taken from the cache)."""
    captured: list[torch.Tensor] = []
    real_run = engine.run

    def run(*args, **kwargs):
        outs = real_run(*args, **kwargs)
        if not captured:
            captured.append(torch.cat([o.hidden for o in outs]))
        return outs

    engine.run = run
    if not reuse:
        engine.state = None
    try:
        reply = engine.generate(prompt, 8, GREEDY)
    finally:
        engine.run = real_run
    return captured[0], reply, engine.last_stats["cached_tokens"]


def test_prefill_bits_do_not_depend_on_staging_or_reuse(tiny_exl3_all_dirs, monkeypatch):  # noqa: F811
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    from glm53.runtime.engine import Glm53Engine
    from glm53.ops import triton_exl3

    staged: list[list[int]] = []
    rows: list[int] = []  # of every EXL3 linear the kernels ran
    stage_into, linear = triton_exl3._stage_into, triton_exl3.linear
    monkeypatch.setattr(triton_exl3, "_stage_into", lambda bank, mats, *a: staged.append(mats) or stage_into(
        bank, mats, *a))
    monkeypatch.setattr(triton_exl3, "linear", lambda x, *a, **k: rows.append(x.shape[0]) or linear(x, *a, **k))
    g = torch.Generator().manual_seed(5)
    pieces = Glm53Engine(tiny_exl3_all_dirs.model, device="cuda", prefill_chunk=32, prefill_wave=32,
                         prefix_cache=None, reuse_live=False)
    rows.clear()  # the load's own device checks (decode_form, forms_agree) ran rows of their own
    staged.clear()
    prompt = torch.randint(0, pieces.vocab_size, (PROMPT,), generator=g).tolist()
    small_hidden, small_reply, _ = prefill(pieces, prompt, reuse=False)
    assert rows and max(rows) <= 32, "the EXL3 linears ran on the kernels, 32 rows at most"
    assert not staged, "32-row pieces stage nothing"
    whole = Glm53Engine(tiny_exl3_all_dirs.model, device="cuda", prefill_chunk=512, prefix_cache=None)
    whole_hidden, whole_reply, _ = prefill(whole, prompt, reuse=False)
    assert staged, "a 300-row piece stages its matrices"
    assert whole_reply == small_reply
    assert torch.equal(whole_hidden, small_hidden), "staged and unstaged prefill differ"
    # the first half computed alone, then the whole prompt reusing it: the second half's rows, same bits
    prefill(whole, prompt[:PROMPT // 2], reuse=False)
    reused_hidden, reused_reply, cached = prefill(whole, prompt, reuse=True)
    assert cached == PROMPT // 2
    assert reused_reply == small_reply
    assert torch.equal(reused_hidden, small_hidden[cached:]), "reused prefix: rows after it differ"
