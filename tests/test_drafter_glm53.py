"""Drafted equals serial on the real GLM-5.3 engine (glm53.runtime.engine over the tiny checkpoint, CPU fp32),
with the prefix cache on: copy drafts, MTP drafts from the checkpoint's MTP layer, the tiny DFlash2
drafter, and an oracle source (true continuation with corruptions: deep acceptance and rejections).
200 short prompts in all, greedy and seeded; prompts continue earlier conversations so that reuse
(live rows and the prefix cache) composes with drafting. Also: rows written by draft verification
are never reused by a later request."""
from __future__ import annotations

import random

import pytest
import torch

from drafter.glm53_target import DraftPlan, Glm53MtpAdapter
from drafter.sources import MtpSource
from drafter.tiny_dflash import write_tiny_dflash2
from drafter_fixtures import OracleDrafts, one_thread  # noqa: F401  (autouse fixture)
from drafter.target import drive
from drafter.verify import verify_window
from glm53.runtime.engine import Glm53Engine, Glm53Target
from glm53.runtime.sampling import SamplingParams, sample
from glm53.settings import Settings
from glm53.synthetic.tiny import write_tiny_checkpoint
from kv_cache.cache import PrefixCache
from kv_cache.keys import CacheKey

CHUNK = 4
PER_SOURCE = 50


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm53")
    model_dir = write_tiny_checkpoint(root / "tiny")
    return model_dir


def new_engine(model_dir, drafter=None) -> Glm53Engine:
    key = CacheKey("tiny", "bfloat16", "float32", 1, 0, False, CHUNK, "cpu", "test")
    return Glm53Engine(model_dir, device="cpu", dtype="fp32", prefill_chunk=CHUNK, drafter=drafter,
                       prefix_cache=PrefixCache(key, host_bytes=1 << 26))


def conversation(rng: random.Random, n: int, vocab: int):
    """Prompts where about half continue the previous prompt (+ its reply, filled in later)."""
    for i in range(n):
        fresh = [rng.randrange(vocab - 32) for _ in range(rng.randint(3, 9))]
        params = SamplingParams() if i % 2 == 0 else SamplingParams(
            temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30))
        yield rng.random() < 0.5, fresh, params, rng.randint(2, 5)


@pytest.mark.parametrize("kind", ["copy", "mtp", "dflash2", "oracle"])
def test_drafted_equals_serial_on_the_engine(kind, tiny, tmp_path):
    serial = new_engine(tiny)
    drafted = new_engine(tiny)
    oracle = OracleDrafts()
    if kind == "oracle":
        drafted.drafter = oracle
    elif kind == "dflash2":
        dfl = write_tiny_dflash2(tmp_path / "dflash2", vocab_size=drafted.cfg.vocab_size,
                                 hidden_size=drafted.cfg.hidden_size, target_layer_ids=[1, 2], block_size=6)
        drafted.drafter = DraftPlan.from_contract(drafted, drafter=str(dfl), settings=Settings())
    else:
        drafted.drafter = DraftPlan.from_contract(drafted, mtp_drafts=None if kind == "mtp" else 0, settings=Settings())
    if kind in ("copy", "mtp", "dflash2"):
        assert drafted.drafter.kind == kind
    rng = random.Random(hash(kind) % 1000)
    history: list[int] = []
    reused = 0
    for extend, fresh, params, max_tokens in conversation(rng, PER_SOURCE, drafted.cfg.vocab_size):
        prompt = (history + fresh) if extend and history else fresh
        want = serial.generate(prompt, max_tokens, params)
        oracle.truth = prompt + want
        got = drafted.generate(prompt, max_tokens, params)
        assert got == want, f"{kind}: drafted {got} != serial {want} for prompt {prompt} {params}"
        assert drafted.last_stats["drafted"] and drafted.last_stats["cached_tokens"] == serial.last_stats["cached_tokens"]
        reused += drafted.last_stats["cached_tokens"]
        history = prompt + got
    assert reused > 0, "no prefix was reused: the test would not show drafting composing with reuse"
    if kind in ("mtp", "dflash2"):
        # these always propose; copy drafts rarely land on a random model's text (phase-1 tests and
        # the oracle cover acceptance), random-weight MTP/DFlash2 acceptance means nothing
        assert drafted.drafter.stats.per_source[kind].proposed > 0


def test_verification_rows_never_reused(tiny):
    engine = new_engine(tiny)
    oracle = OracleDrafts()
    oracle.rng = random.Random(3)
    engine.drafter = oracle
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]                     # frontier ends at 9 (chunks of 4)
    cold_reply = new_engine(tiny).generate(prompt, 12, SamplingParams())
    oracle.truth = prompt + cold_reply
    reply = engine.generate(prompt, 12, SamplingParams())
    assert reply == cold_reply
    assert engine.state.frontier <= len(prompt)                       # decode/verify rows never advance it
    follow = prompt + reply + [21, 22]
    hit = engine.prefix_cache.lookup(follow, live_tokens=list(engine.state.tokens), live_frontier=engine.state.frontier)
    assert hit.reused_tokens <= len(prompt)
    cold = new_engine(tiny)
    cold.trace, engine.trace = [], []
    warm_reply = engine.generate(follow, 6, SamplingParams(draft=False))
    cold_reply = cold.generate(follow, 6, SamplingParams(draft=False))
    assert engine.last_stats["cached_tokens"] <= len(prompt)
    assert warm_reply == cold_reply
    for (p1, l1), (p2, l2) in zip(engine.trace, cold.trace):
        assert p1 == p2 and torch.equal(l1, l2)                       # bit for bit: contract 1 holds after drafting


def test_engine_window_truncates_rejected_rows_and_reports_frontier(tiny):
    engine = new_engine(tiny)
    prompt = [3, 4, 5, 6, 7, 8]
    truth = engine.generate(prompt, 6, SamplingParams(draft=False))
    state = engine.model.new_state()
    target = Glm53Target(engine, state, len(prompt))
    target.forward(prompt, 0)
    frontier = target.canonical_frontier()
    assert frontier == len(prompt)
    drafts = [truth[1], (truth[2] + 1) % 2000, truth[3]]
    res = drive(target, verify_window(target, truth[0], drafts, lambda row, pos: sample(row, SamplingParams(), pos)))
    assert res.accepted == 1 and res.tokens == truth[1:3]
    assert state.length == len(prompt) + 2 and res.beyond_frontier
    assert target.canonical_frontier() == frontier


def test_mtp_adapter_pads_unseen_rows_and_drafts(tiny):
    engine = new_engine(tiny)
    adapter = Glm53MtpAdapter(engine.model, "bf16")
    src = MtpSource(adapter, max_depth=4)
    state = engine.model.new_state()
    target = Glm53Target(engine, state, 8)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2]
    target.forward(prompt[:5], 0)                                      # rows the MTP layer never sees
    out = target.forward(prompt[5:], 5)
    logits_next = out.logits[-1]
    pending = int(logits_next.argmax())
    src.commit(prompt + [pending], out, 3)
    assert adapter.padded_rows == 5 and adapter.state.length == 8
    drafts = src.propose(prompt + [pending], 4)
    assert len(drafts) == 4 and all(0 <= d < engine.cfg.vocab_size for d in drafts)
    assert adapter.state.length == 8 + 3                              # chained speculative rows, truncated next commit


def test_contract_arguments_choose_the_source(tiny, tmp_path):
    engine = new_engine(tiny)
    assert DraftPlan.from_contract(engine, no_drafts=True, settings=Settings()) is None
    assert DraftPlan.from_contract(engine, settings=Settings.from_env({"TF_GLM53_DRAFT_SOURCE": "off"})) is None
    assert DraftPlan.from_contract(engine, settings=Settings()).kind == "mtp"  # the tiny checkpoint has an MTP layer
    plan = DraftPlan.from_contract(engine, mtp_drafts=3, settings=Settings())
    assert plan.kind == "mtp" and plan.max_depth == 3
    assert DraftPlan.from_contract(engine, mtp_drafts=0, settings=Settings()).kind == "copy"
    assert DraftPlan.from_contract(engine, settings=Settings.from_env({"TF_GLM53_DRAFT_SOURCE": "copy"})).kind == "copy"
    with pytest.raises(ValueError, match="TF_GLM53_DRAFT_SOURCE"):
        DraftPlan.from_contract(engine, settings=Settings.from_env({"TF_GLM53_DRAFT_SOURCE": "fast"}))
    with pytest.raises(ValueError, match="needs the drafter directory"):
        DraftPlan.from_contract(engine, settings=Settings.from_env({"TF_GLM53_DRAFT_SOURCE": "dflash2"}))
    wrong = write_tiny_dflash2(tmp_path / "wrong", vocab_size=64, hidden_size=32, target_layer_ids=[0])
    with pytest.raises(ValueError, match="does not match the model"):
        DraftPlan.from_contract(engine, drafter=str(wrong), settings=Settings())


def test_window_logits_equal_serial_logits_bitwise(tiny):
    """Why drafted equals serial by construction: a verification window of k tokens computes, row for
    row, the logits (and rows) of k serial one-token steps, bit for bit (row-invariant ops), here
    past the indexer's top-k (32) and across several windows."""
    engine = new_engine(tiny)
    rng = random.Random(12)
    prompt = [rng.randrange(2000) for _ in range(60)]
    window = [rng.randrange(2000) for _ in range(13)]
    states = []
    for split in ((13,), (1,) * 13, (5, 1, 7)):
        state = engine.model.new_state(engine.kv_dtype)
        target = Glm53Target(engine, state, len(prompt))
        with torch.inference_mode():
            target.forward(prompt, 0)
            logits, at = [], len(prompt)
            for n in split:
                logits.append(target.forward(window[at - len(prompt):at - len(prompt) + n], at).logits)
                at += n
        states.append((torch.cat(logits), state.export_rows(0, at)))
    for logits, rows in states[1:]:
        assert torch.equal(logits, states[0][0])
        assert all(torch.equal(rows[k], states[0][1][k]) for k in rows)


def test_windows_past_the_indexer_topk_equal_serial(tiny):
    """Contexts longer than index_topk (32 in the tiny config), oracle drafts with rejections: the
    tokens of drafted and serial decoding agree, greedy and seeded."""
    serial, drafted = new_engine(tiny), new_engine(tiny)
    oracle = OracleDrafts()
    drafted.drafter = oracle
    rng = random.Random(11)
    for i in range(4):
        prompt = [rng.randrange(2000) for _ in range(70)]
        params = SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i)
        want = serial.generate(prompt, 16, params)
        oracle.truth = prompt + want
        assert drafted.generate(prompt, 16, params) == want
    assert drafted.last_stats["draft"]["tf_glm53_draft_accepted_total"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_drafted_equals_serial_on_cuda(tiny, dtype):
    """On the GPU a window's rows must still equal rows computed one at a time (batch invariance of
    the engine's decode path); otherwise drafted != serial. Oracle drafts give deep windows."""
    def engine():
        return Glm53Engine(tiny, device="cuda", dtype=dtype, prefill_chunk=CHUNK)
    serial, drafted = engine(), engine()
    oracle = OracleDrafts()
    drafted.drafter = oracle
    rng = random.Random(7)
    mismatches = []
    for extend, fresh, params, max_tokens in conversation(rng, 60, drafted.cfg.vocab_size):
        want = serial.generate(fresh, max_tokens + 10, params)
        oracle.truth = fresh + want
        got = drafted.generate(fresh, max_tokens + 10, params)
        if got != want:
            mismatches.append((fresh, params, want, got))
    assert not mismatches, f"{len(mismatches)}/60 drafted replies differ from serial on CUDA ({dtype}); first: {mismatches[0]}"
