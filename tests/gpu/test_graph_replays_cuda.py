"""CUDA graphs of short windows (glm53.runtime.cuda_graphs) against the eager forward, bit for bit.

- ops.expert_linear (the routed experts' slot form) gives every row the bits linear() gives it,
  alone and among many rows of its expert (the grouped form's tile configs);
- the MoE prefill's sorted form (ops.grouped_expert_linear, one launch per projection) gives the
  bits of the per-expert loop it replaces;
- the engine decoding with graphs equals the engine without them (tokens and every position's
  logits), over bound steps and cache growth, in bf16, bf16 with an fp8 cache, and fp32;
- the batched runtime's steps replay graphs over several sequences and give each request its
  reply alone;
- prefill pieces beside decode steps replay graphs of their own (padded to a power of two) and every
  request still gets its reply alone;
- a one-word extension reused from the prefix cache replays a graph and equals a cold run.

    pytest -m gpu tests/gpu/test_graph_replays_cuda.py
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures_tiny import tiny_dirs, tiny_exl3_all_dirs  # noqa: E402,F401

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(4096, 6144), (6144, 2048), (96, 64)])
def test_expert_linear_rows_equal_linear_rows(dtype: torch.dtype, n: int, k: int) -> None:
    from glm53 import ops

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(6, n, k, generator=g, device="cuda").to(dtype) * k ** -0.5
    x = torch.randn(300, k, generator=g, device="cuda").to(dtype)
    ids = torch.randint(0, 6, (300,), generator=g, device="cuda")
    got = ops.expert_linear(x, w, ids)
    for e in range(6):
        rows = (ids == e).nonzero().squeeze(1)
        grouped = ops.linear(x[rows], w[e])  # many rows: the prefill tile config
        assert torch.equal(got[rows], grouped), (e, "grouped")
        for r in rows[:3].tolist():
            assert torch.equal(got[r:r + 1], ops.linear(x[r:r + 1], w[e])), (e, r)


@pytest.mark.parametrize("row_tile", [64, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("experts,hidden,width,tokens", [(16, 512, 256, 300), (256, 1024, 256, 700), (4, 96, 64, 17)])
def test_grouped_experts_give_the_loop_bits(dtype: torch.dtype, experts: int, hidden: int, width: int,
                                            tokens: int, row_tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE prefill's sorted form (one grouped launch per projection, no sync) against the loop
    over experts that it replaces, and each expert's run against linear over it, bit for bit; with
    linear's tile for 64 rows and its prefill tile (GROUPED_ROWS)."""
    from glm53 import ops
    from glm53.model.moe import DecodedExperts, _slots_by_expert
    from glm53.ops import triton_linear

    monkeypatch.setattr(triton_linear, "GROUPED_ROWS", row_tile)

    g = torch.Generator(device="cuda").manual_seed(experts + hidden + tokens)
    bank = DecodedExperts((torch.randn(experts, 2 * width, hidden, generator=g, device="cuda") * hidden ** -0.5).to(dtype),
                          (torch.randn(experts, hidden, width, generator=g, device="cuda") * width ** -0.5).to(dtype))
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:min(8, experts)] for _ in range(tokens)])
    weights = torch.rand(tokens, ids.shape[1], generator=g, device="cuda")
    assert ops.grouped_experts_for(x, bank.gate_up, bank.down), "the H200 should give the grouped form linear's bits"
    assert torch.equal(bank.runs(x, ids, weights), bank.by_expert(x, ids, weights))
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    xs = x[_slots_by_expert(ids, weights)[1]]
    got = ops.grouped_expert_linear(xs, bank.gate_up, counts)
    begin = 0
    for e, c in enumerate(counts.tolist()):
        assert torch.equal(got[begin:begin + c], ops.linear(xs[begin:begin + c], bank.gate_up[e])), e
        begin += c


def _engine(tiny_dirs, compute: str, kv: str, graphs: str, **kw):  # noqa: ANN001, F811
    from glm53.runtime.engine import Glm53Engine

    return Glm53Engine(tiny_dirs.model, device="cuda", dtype=compute, kv_dtype=kv, cuda_graphs=graphs, **kw)


def _decode(engine, prompt: list[int], n: int) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:  # noqa: ANN001
    engine.trace = []
    reply = engine.generate(prompt, n, {"temperature": 0.0, "ignore_eos": True, "draft": False})
    trace, engine.trace = engine.trace, None
    return reply, trace


@pytest.mark.parametrize("compute,kv", [("bf16", "bf16"), ("bf16", "fp8"), ("fp32", "fp32")])
def test_decoding_with_graphs_equals_eager_bitwise(tiny_dirs, compute: str, kv: str) -> None:  # noqa: F811
    """A 230-token prompt (capacity 256: the cache grows while decoding), then 80 greedy tokens
    with bound step 32: several captures, many replays, the eager engine's tokens and logits."""
    rng = random.Random(5)
    eager = _engine(tiny_dirs, compute, kv, "0")
    graphed = _engine(tiny_dirs, compute, kv, "1")
    graphed.graphs.bound_step = 32
    prompt = [rng.randrange(3, eager.vocab_size) for _ in range(230)]
    want, want_trace = _decode(eager, prompt, 80)
    got, got_trace = _decode(graphed, prompt, 80)
    assert got == want
    for (p, a), (q, b) in zip(got_trace, want_trace):
        assert p == q and torch.equal(a, b), p
    stats = graphed.graphs.stats
    assert stats.captures >= 3 and stats.replays >= 60, stats


@pytest.mark.parametrize("compute,kv", [("bf16", "bf16"), ("fp32", "fp32")])
def test_batched_steps_replay_graphs_and_equal_each_request_alone(tiny_dirs, compute: str, kv: str) -> None:  # noqa: F811
    """Seven requests (greedy and seeded, MTP-drafted and serial, logprobs) through the batched
    runtime with graphs, four at a time (arrivals join running batches): each reply and its
    logprobs are the ones the request gets alone from an eager engine, and the batched decode
    steps replay captured graphs."""
    from drafter.glm53_target import DraftPlan
    from glm53.runtime import BatchEngine
    from glm53.settings import Settings

    rng = random.Random(13)
    eager = _engine(tiny_dirs, compute, kv, "0")
    graphed = _engine(tiny_dirs, compute, kv, "1")
    for e in (eager, graphed):
        e.drafter = DraftPlan.from_contract(e, settings=Settings())
    graphed.graphs.bound_step = 64
    requests = []
    for i in range(7):
        prompt = [rng.randrange(3, eager.vocab_size) for _ in range(rng.choice((9, 40, 130)))]
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i}
        sampling.update(ignore_eos=True, draft=i % 3 == 0, logprobs=2)
        requests.append((prompt, sampling))
    want = []
    for prompt, sampling in requests:
        reply = eager.generate(prompt, 40, dict(sampling))
        want.append((reply, eager.last_stats["logprobs"]))
        eager.state = None
    batch = BatchEngine(graphed, max_seqs=4)
    seqs = [batch.submit(prompt, 40, dict(sampling)) for prompt, sampling in requests]
    batch.run()
    for i, (seq, (reply, records)) in enumerate(zip(seqs, want)):
        assert seq.reply == reply, i
        assert seq.stats["logprobs"] == records, i
    stats = graphed.graphs.stats
    assert stats.replays >= 40 and stats.captures >= 2, stats


@pytest.mark.parametrize("compute,kv,weights", [("bf16", "bf16", "tiny"), ("fp32", "fp32", "tiny"),
                                                ("bf16", "bf16", "exl3_all")])
def test_prefill_pieces_beside_decode_steps_replay_graphs_and_equal_alone(tiny_dirs, tiny_exl3_all_dirs, compute: str,  # noqa: F811
                                                                          kv: str, weights: str) -> None:
    """Three streams decoding while two 700-token prompts arrive, 64 rows a step: the prompts' 61-row
    pieces replay piece graphs (64 rows: the packed EXL3 experts in their sorted form, and with every
    linear packed (exl3_all) the attention's too; the top-k in its kernel) captured for real; every
    reply equals its request's alone from an eager engine, and the second prompt replays the first
    one's piece graphs."""
    from tests.test_cuda_graphs import _piece_keys, streams_beside_long_prompts

    dirs = tiny_dirs if weights == "tiny" else tiny_exl3_all_dirs
    eager = _engine(dirs, compute, kv, "0")
    graphed = _engine(dirs, compute, kv, "1")
    graphed.graphs.bound_step = 64
    got, want, piece_keys = streams_beside_long_prompts(graphed, eager, step_tokens=64, long_prompt=700)
    assert got == want
    stats = graphed.graphs.stats
    assert stats.pieces >= 2 * (700 // 61) - 2, stats
    assert {rows for rows, _ in piece_keys} <= {32, 64} and _piece_keys(graphed.graphs) == piece_keys, stats
    assert not any("capture failed" in reason or "piece" in reason for reason in stats.reasons), stats.reasons


def test_one_word_extension_replays_a_graph_and_equals_cold(tiny_dirs) -> None:  # noqa: F811
    from glm53.settings import Settings
    from kv_cache.engine_adapter import attach_prefix_cache

    rng = random.Random(6)
    on = _engine(tiny_dirs, "bf16", "bf16", "1")
    cold = _engine(tiny_dirs, "bf16", "bf16", "0")
    attach_prefix_cache(on, revision="test", settings=Settings())
    base = [rng.randrange(3, on.vocab_size) for _ in range(300)]
    on.generate(base, 1, {"temperature": 0.0})
    for i in range(3):
        prompt = base + [rng.randrange(3, on.vocab_size)]
        got, got_trace = _decode(on, prompt, 4)
        assert on.last_stats["cached_tokens"] == len(base)
        want, want_trace = _decode(cold, prompt, 4)
        cold.state = None
        assert got == want and all(torch.equal(a, b) for (_, a), (_, b) in zip(got_trace, want_trace)), i
    assert on.graphs.stats.replays >= 6


def test_eager_forward_on_cuda_raises_on_nan_scores_after_its_layers(tiny_dirs) -> None:  # noqa: F811
    """On a GPU the eager forward's selections or NaN into one device flag, read once after the
    layers (no host sync per full layer): NaN scores still raise, prefill-sized and one token."""
    engine = _engine(tiny_dirs, "fp32", "fp32", "0")
    model, rng = engine.model, random.Random(9)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(50)]
    with torch.inference_mode():
        state = model.new_state("fp32")
        model.forward(state, prompt, 0)  # clean: no error
        layer = min(state.index_keys)
        state.index_keys[layer][7] = float("nan")
        for window in ([6], [rng.randrange(3, engine.vocab_size) for _ in range(40)]):
            with pytest.raises(ValueError, match="NaN"):
                model.forward(state.clone(), window, state.length)
