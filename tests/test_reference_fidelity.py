"""Reference fidelity: the kit's forward on the tiny EXL3 checkpoint (one rank, fp32, CPU) against
transformers 5.23's GlmMoeDsaForCausalLM on the dequantized twin (same weights: every EXL3 linear as
the matrix the format defines, glm53.exl3.decode.dequantize_exact, which the kit computes from the
packed trellis without forming it). Both checkpoints: the default (routed experts EXL3) and the one
with every decoder linear EXL3 (tiny's exl3_all, padded as exllamav3 pads; kv_b decoded at load).

Tolerance: max |logit difference| <= 1e-4 at every position, greedy tokens equal over 64 steps.
Both sides compute in fp32 from identical weights; what differs is only summation order (chunked
vs whole-sequence matmuls, the absorbed decode path, expert accumulation order), which moves fp32
logits of magnitude ~5 by ~5e-6 here (measured). 1e-4 leaves a 20x margin, while any real
mismatch (a wrong top-k set, rope layout, eps, routing) moves logits by 1e-2 or more.

The one thing patched on the reference side: its indexer picks top-k with torch.topk, whose order
among exactly equal scores is unspecified. With the tiny's 4 indexer heads, keys whose every head
has relu(q.k) = 0 score exactly 0 and tie at the top-k boundary (a few rows per 100 positions).
The kit breaks such ties toward the lower position (a rule every rank layout can reproduce); the
comparison runs the reference with the same rule (a stable sort in place of topk), and
`test_reference_ties_are_real` shows the unpatched reference differs only because of them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from tests.fixtures_tiny import (TINY_CHUNK, fresh_engine_state, tiny_dirs, tiny_engine,  # noqa: F401
                                 tiny_exl3_all_dirs)

TOLERANCE = 1e-4
STEPS = 64
_TOPK = torch.Tensor.topk


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextmanager
def ties_toward_lower_position() -> Iterator[None]:
    torch.Tensor.topk = _stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = _TOPK


def _reference_model(folder):  # noqa: ANN001, ANN202
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def reference(tiny_dirs):  # noqa: F811
    return _reference_model(tiny_dirs.reference)


@pytest.fixture(scope="module")
def exl3_all_pair(tiny_exl3_all_dirs):  # noqa: F811
    from glm53.runtime.engine import Glm53Engine

    engine = Glm53Engine(tiny_exl3_all_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32",
                         prefill_chunk=TINY_CHUNK, cache_block=TINY_CHUNK)
    return engine, _reference_model(tiny_exl3_all_dirs.reference)


@pytest.fixture(params=["experts-exl3", "all-exl3"])
def pair(request, tiny_engine, reference, exl3_all_pair):  # noqa: F811
    return (tiny_engine, reference) if request.param == "experts-exl3" else exl3_all_pair


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2000, (length,), generator=g).tolist()


def _ours(engine, prompt: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(greedy reply, prompt-position logits from chunked prefill, decode-step logits)."""
    with fresh_engine_state(engine, reuse_live=False):
        engine.trace = []
        reply = engine.generate(prompt, STEPS, {"ignore_eos": True})
        decode = torch.stack([row for _, row in engine.trace])
        state = engine.model.new_state("fp32")
        with torch.inference_mode():
            outs = engine.run(state, prompt, 0, len(prompt))
            prefill = engine.model.logits(torch.cat([o.hidden for o in outs]))
    return reply, prefill, decode


@pytest.mark.parametrize("length", [20, 100], ids=["shorter-than-topk", "longer-than-topk"])
def test_logits_and_greedy_tokens_match_reference(pair, length: int) -> None:
    tiny_engine, reference = pair
    cfg = tiny_engine.cfg
    assert length < cfg.index_topk < length + STEPS or length > cfg.index_topk
    prompt = _prompt(length, seed=length)
    reply, prefill, decode = _ours(tiny_engine, prompt)
    assert len(reply) == STEPS
    with torch.no_grad(), ties_toward_lower_position():
        ref = reference(torch.tensor([prompt + reply])).logits[0]
    prefill_err = (prefill - ref[:length]).abs().amax(dim=-1)
    decode_err = (decode - ref[length - 1:length - 1 + STEPS]).abs().amax(dim=-1)
    print(f"\nprompt {length}: max |dlogit| prefill {prefill_err.max():.2e}, decode {decode_err.max():.2e}, "
          f"max |logit| {ref.abs().max():.2f}, tolerance {TOLERANCE:.0e}")
    assert prefill_err.max() <= TOLERANCE, f"prefill positions over tolerance: {(prefill_err > TOLERANCE).nonzero().flatten().tolist()}"
    assert decode_err.max() <= TOLERANCE, f"decode steps over tolerance: {(decode_err > TOLERANCE).nonzero().flatten().tolist()}"
    assert ref[length - 1:length - 1 + STEPS].argmax(dim=-1).tolist() == reply


def test_reference_ties_are_real(tiny_engine, reference) -> None:  # noqa: F811
    """Without the tie rule the reference departs from us exactly where index scores tie at the
    top-k boundary: before the first such row both agree within tolerance."""
    import glm53.model.indexer as indexer

    prompt = _prompt(100, seed=100)
    tie_rows: list[int] = []
    select = indexer.select_topk

    def spy(scores: torch.Tensor, k: int, nan_flag: torch.Tensor | None = None) -> indexer.Selection:
        if len(tie_rows) == 0:
            finite = torch.isfinite(scores)
            threshold = scores.topk(min(k, scores.shape[-1]), dim=-1).values[:, -1:]
            boundary_ties = ((scores == threshold) & finite).sum(-1) > 1
            rows = (boundary_ties & (finite.sum(-1) > k)).nonzero().flatten().tolist()
            tie_rows.extend(rows)
        return select(scores, k, nan_flag)

    state = tiny_engine.model.new_state("fp32")
    try:
        indexer.select_topk = spy
        with torch.inference_mode():
            hidden = tiny_engine.model.forward(state, prompt, 0).hidden
    finally:
        indexer.select_topk = select
    assert tie_rows, "expected exact index-score ties at the top-k boundary on this prompt"
    ours = tiny_engine.model.logits(hidden)
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0]
    first = min(tie_rows)
    assert (ours[:first] - ref[:first]).abs().max() <= TOLERANCE
