"""Unit behaviour of the drafter's parts: verification, frontier, relaxed mode, copy drafts,
policy and statistics, DFlash2 pieces, source alignment with the target, and the manifest."""
from __future__ import annotations

import inspect
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter import manifest as mf
from drafter.decode_loop import StopRule, drafted_decode, serial_decode
from drafter.policy import AcceptanceStats, AdaptiveDepth, PolicyConfig
from glm53.settings import Settings
from drafter.reference_lm import ReferenceLM
from drafter.sources import CopySource, MtpSource
from drafter.sources.dflash2 import Dflash2Model, Dflash2Source, grouped_dynamic_conv
from drafter.target import Target, TargetContractError, drive
from drafter.tiny_dflash import write_tiny_dflash2
from drafter_fixtures import one_thread, reference_dflash2  # noqa: F401  (one_thread: autouse fixture)
from drafter.verify import verify_window

MODEL = ReferenceLM()
GREEDY = lambda row, position: int(torch.argmax(row))  # noqa: E731
REPO = Path(__file__).resolve().parents[1]


def serial_tokens(prompt, n):
    return serial_decode(MODEL.session(), prompt, GREEDY, StopRule(max_tokens=n)).tokens


# --- verification ---

def test_reference_session_is_a_target():
    assert isinstance(MODEL.session(), Target)


def test_verify_keeps_matching_prefix_plus_target_token_and_truncates_the_rest():
    prompt = [5, 17, 42, 8, 8, 30]
    truth = serial_tokens(prompt, 10)
    target = MODEL.session()
    target.forward(prompt, 0)
    pending = truth[0]
    wrong = (truth[3] + 1) % MODEL.config.vocab_size
    drafts = [truth[1], truth[2], wrong, truth[4], truth[5]]
    res = drive(target, verify_window(target, pending, drafts, GREEDY))
    assert res.accepted == 2
    assert res.tokens == truth[1:4]                 # two drafts + the target's token where the third failed
    assert res.kept_rows == 3
    assert res.written == range(len(prompt), len(prompt) + 6)
    assert target.length() == len(prompt) + 3       # rows of the rejected drafts are gone
    ref = MODEL.session()
    ref.forward(prompt + truth[:3], 0)
    assert torch.equal(target.cache_rows(), ref.cache_rows())


def test_verify_all_accepted_commits_a_free_token():
    prompt = [1, 2, 3, 4]
    truth = serial_tokens(prompt, 6)
    target = MODEL.session()
    target.forward(prompt, 0)
    res = drive(target, verify_window(target, truth[0], truth[1:5], GREEDY))
    assert res.accepted == 4 and res.tokens == truth[1:6]
    assert target.length() == len(prompt) + 5


def test_verification_rows_are_beyond_the_canonical_frontier():
    prompt = list(range(10, 22))
    target = MODEL.session()
    target.forward(prompt, 0)
    target.set_frontier(len(prompt))                # the prefix cache's reusable extent ends at the prompt
    res = drive(target, verify_window(target, 3, [4, 5], GREEDY))
    assert res.beyond_frontier and res.written.start >= target.canonical_frontier()
    target.truncate(8)                              # a window that would overwrite canonical rows is refused
    with pytest.raises(TargetContractError, match="frontier"):
        drive(target, verify_window(target, 3, [4], GREEDY))


def test_target_returning_wrong_row_count_is_refused():
    class Short:
        vocab_size = 4

        def __init__(self):
            self.inner = MODEL.session()

        def length(self):
            return self.inner.length()

        def forward(self, tokens, start, taps=()):
            out = self.inner.forward(tokens, start, taps=taps)
            out.logits = out.logits[:1]
            return out

        def truncate(self, n):
            self.inner.truncate(n)

        def canonical_frontier(self):
            return 0

    t = Short()
    t.forward([1, 2], 0)
    with pytest.raises(TargetContractError, match="one row per token"):
        drive(t, verify_window(t, 3, [4, 5], GREEDY))


# --- relaxed acceptance: opt-in, lossy ---

class SecondBest:
    """Always drafts the target's second choice: only relaxed acceptance would keep it."""
    name, taps, needs_hidden, max_depth = "second", (), False, 13

    def commit(self, tokens, out, kept_rows):
        pass

    def propose(self, tokens, depth, sample=None):
        peek = MODEL.session().forward(list(tokens), 0).logits[-1]   # the next row, from a side session
        return [int(torch.topk(peek, 2).indices[1])]


def test_relaxed_top2_is_off_by_default_and_lossy_when_asked():
    assert PolicyConfig().relaxed_top2 is False
    assert PolicyConfig.from_settings(Settings.from_env({})).relaxed_top2 is False
    assert inspect.signature(drafted_decode).parameters["relaxed_top2"].default is False
    assert inspect.signature(verify_window).parameters["relaxed_top2"].default is False
    assert PolicyConfig.from_settings(Settings.from_env({"TF_GLM53_DRAFT_RELAXED_TOP2": "1"})).relaxed_top2 is True
    prompt = [9, 8, 7, 6, 5]
    stop = StopRule(max_tokens=12)
    ref = serial_decode(MODEL.session(), prompt, GREEDY, stop)
    s = MODEL.session()
    exact = drafted_decode(s, prompt, GREEDY, stop, SecondBest())
    assert exact.tokens == ref.tokens and exact.stats.lossy_steps == 0
    s = MODEL.session()
    lossy = drafted_decode(s, prompt, GREEDY, stop, SecondBest(), relaxed_top2=True)
    assert lossy.stats.lossy_steps > 0 and lossy.tokens != ref.tokens
    assert "LOSSY" in lossy.stats.log_line()


# --- copy drafts ---

def brute_force_copy(tokens, depth, min_n=2, max_n=8):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + depth]
    return []


def test_copy_source_matches_brute_force_incrementally():
    rng = random.Random(7)
    for _ in range(60):
        alphabet = rng.randint(2, 6)
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(3, 40))]
        src = CopySource()
        for cut in range(1, len(seq) + 1):
            depth = rng.randint(1, 13)
            assert src.propose(seq[:cut], depth) == brute_force_copy(seq[:cut], depth), (seq[:cut], depth)


def test_copy_source_prefers_longest_then_most_recent():
    src = CopySource()
    toks = [1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3]
    assert src.propose(toks, 2) == [9, 9]          # "1 2 3" (len 3) beats the more recent "2 3"
    src = CopySource()
    assert src.propose([4, 5, 1, 4, 5, 2, 4, 5], 1) == [2]   # most recent earlier "4 5"
    assert CopySource().propose([1, 2, 3, 4], 3) == []       # nothing repeats


# --- policy and statistics ---

def test_depth_climbs_to_13_on_full_acceptance_and_falls_to_1_on_none():
    pol = AdaptiveDepth()
    for _ in range(30):
        d = pol.depth()
        pol.update(d, d)
    assert pol.depth() == 13
    for _ in range(30):
        d = pol.depth()
        pol.update(d, 0)
    assert pol.depth() == 1
    assert pol.depth(source_max=1) == 1
    assert AdaptiveDepth(enabled=False).depth() == 0
    with pytest.raises(ValueError, match="TF_GLM53_DRAFT_MAX_DEPTH"):
        Settings.from_env({"TF_GLM53_DRAFT_MAX_DEPTH": "14"})
    with pytest.raises(ValueError, match="TF_GLM53_DRAFT_MAX_DEPTH"):
        Settings.from_env({"TF_GLM53_DRAFT_MAX_DEPTH": "deep"})
    with pytest.raises(ValueError, match="TF_GLM53_DRAFT_MAX_DEPTH"):
        PolicyConfig(max_depth=14)
    capped = AdaptiveDepth(PolicyConfig.from_settings(Settings.from_env({"TF_GLM53_DRAFT_MAX_DEPTH": "4"})))
    capped.mean = 50
    assert capped.depth() == 4


def test_acceptance_statistics():
    a, b = AcceptanceStats(), AcceptanceStats()
    a.record("copy", 5, 3)
    a.record("copy", 4, 0)
    b.record("mtp", 2, 2)
    a.merge(b)
    assert (a.steps, a.proposed, a.accepted, a.committed) == (3, 11, 5, 8)
    assert a.histogram[:4] == [1, 0, 1, 1]
    m = a.metrics()
    assert m['tf_glm53_draft_source_accepted_total{source="copy"}'] == 3
    assert m['tf_glm53_draft_accepted_length_bucket{accepted="3"}'] == 1
    assert "copy=3/9" in a.log_line() and "mtp=2/2" in a.log_line()


# --- MTP and DFlash2 stay aligned with the target ---

class RecordingMtp:
    def __init__(self, inner):
        self.inner, self.calls, self.truncations = inner, [], []

    def forward(self, hidden, tokens, start):
        self.calls.append((hidden.clone(), list(tokens), start))
        return self.inner.forward(hidden, tokens, start)

    def truncate(self, length):
        self.truncations.append(length)


def test_mtp_source_sees_target_hidden_and_committed_tokens():
    prompt = [3, 14, 15, 92, 65, 35]
    s = MODEL.session()
    rec = RecordingMtp(s.mtp())
    res = drafted_decode(s, prompt, GREEDY, StopRule(max_tokens=20), MtpSource(rec))
    full = prompt + res.tokens
    hidden = MODEL.session().forward(full, 0).hidden     # the target's hidden state at every position
    covered = set()
    for h, toks, start in rec.calls:
        # a commit call: the TARGET's hidden rows at [start, start + r) paired with the committed tokens
        pairs_match = toks == full[start + 1:start + 1 + len(toks)]
        if pairs_match and torch.equal(h, hidden[start:start + len(toks)]):
            covered.update(range(start, start + len(toks)))
    # every position up to the last commit got an MTP row computed from the target's own hidden state
    assert covered >= set(range(len(full) - 2)), sorted(set(range(len(full) - 2)) - covered)
    assert rec.calls[0][2] == 0 and len(rec.calls[0][1]) == len(prompt)      # the prefill commit
    assert rec.truncations and all(t <= len(full) for t in rec.truncations)


@pytest.fixture(scope="module")
def tiny_dflash(tmp_path_factory):
    path = reference_dflash2(tmp_path_factory.mktemp("dfl"), MODEL, block_size=6)
    return path, Dflash2Model.load(path)


def test_dflash2_context_equals_target_taps_of_committed_rows(tiny_dflash):
    _, model = tiny_dflash
    prompt = [7, 1, 8, 2, 8, 1, 8]
    s = MODEL.session()
    src = Dflash2Source(model, MODEL)
    res = drafted_decode(s, prompt, GREEDY, StopRule(max_tokens=15), src)
    full = prompt + res.tokens
    out = MODEL.session().forward(full[:src._ctx_len], 0, taps=(0, 1))
    want = model.context_rows([out.taps[0], out.taps[1]], torch.arange(src._ctx_len))
    assert src._ctx_len == len(full) - 2 or src._ctx_len == len(full) - 1
    for (k, v), k2, v2 in zip(want, src._ctx_k, src._ctx_v):
        torch.testing.assert_close(k2, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v2, v, rtol=1e-5, atol=1e-5)
    assert len(src.propose(full[:src._ctx_len + 1], 13)) == 5       # block_size - 1 drafts at most


def test_grouped_dynamic_conv_matches_definition():
    g = torch.Generator().manual_seed(0)
    n, h, gs, taps = 5, 8, 4, 2
    x, dyn, base = torch.randn(n, h, generator=g), torch.randn(n, taps, h // gs, generator=g), torch.randn(taps, h, generator=g)
    out = grouped_dynamic_conv(x, dyn, base, gs)
    for t in range(n):
        for c in range(h):
            want = sum((base[k, c] + dyn[t, k, c // gs]) * x[t - k, c] for k in range(taps) if t - k >= 0)
            assert abs(float(out[t, c]) - float(want)) < 1e-5


def test_dflash2_block_attention_direction(tiny_dflash):
    path, model = tiny_dflash
    ctx = model.context_rows([torch.randn(4, 32), torch.randn(4, 32)], torch.arange(4))
    emb = torch.randn(6, 32)
    changed = emb.clone()
    changed[-1] += 1.0
    a, b = model.block_hidden(emb, 4, ctx), model.block_hidden(changed, 4, ctx)
    assert not torch.allclose(a[0], b[0])            # default: full-attention block rows see later rows
    model.config.is_causal = True
    try:
        a, b = model.block_hidden(emb, 4, ctx), model.block_hidden(changed, 4, ctx)
        torch.testing.assert_close(a[:-1], b[:-1])   # causal: earlier rows ignore the last one
    finally:
        model.config.is_causal = None


def test_dflash2_selector_walk_is_greedy_over_topk(tiny_dflash):
    _, model = tiny_dflash
    g = torch.Generator().manual_seed(1)
    states, logits = torch.randn(3, 32, generator=g), torch.randn(3, MODEL.config.vocab_size, generator=g)
    path = model.select(states, logits, anchor=5)
    gate = states @ model.w["candidate_selector.hidden_projection.weight"].T
    A, B = model.w["candidate_selector.predecessor_codebook"], model.w["candidate_selector.successor_codebook"]
    prev = 5
    for t in range(3):
        cands = torch.topk(logits[t], model.config.selector_top_k).indices
        scores = {int(c): float(logits[t, c] + (A[prev] * gate[t]) @ B[c]) for c in cands}
        prev = max(scores, key=scores.get)
        assert path[t] == prev


def test_dflash2_loader_names_the_bad_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    path = write_tiny_dflash2(tmp_path / "d", vocab_size=16, hidden_size=16, target_layer_ids=[0])
    tensors = load_file(str(path / "model.safetensors"))
    tensors["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(3, 3\)"):
        Dflash2Model.load(path)
    del tensors["norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="lack 1 tensors.*norm.weight"):
        Dflash2Model.load(path)
    with pytest.raises(FileNotFoundError, match="fetch_weights.sh --drafter"):
        Dflash2Model.load(tmp_path / "nowhere")


# --- manifest ---

def test_manifest_records_repo_placeholder_revision_and_licence():
    m = mf.load_manifest()
    assert m.repository == "incoai/GLM-5.3-DFlash2"
    assert m.licence_spdx == "CC-BY-NC-ND-4.0" and m.redistribution is False
    assert m.revision_is_placeholder and m.fetch_revision == "main"
    assert {f.path for f in m.files} >= {"config.json", "model.safetensors"}
    assert "may not be redistributed" in m.licence_notice()
    assert "NOT REDISTRIBUTED" in (REPO / "drafter" / "NOTICE").read_text()


def test_manifest_rejects_malformed(tmp_path):
    raw = json.loads(mf.MANIFEST_PATH.read_text())
    raw["revision"] = "main"
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(mf.ManifestError, match="revision"):
        mf.load_manifest(bad)
    raw["revision"] = "a" * 40
    raw["files"][0]["sha256"] = "xyz"
    bad.write_text(json.dumps(raw))
    with pytest.raises(mf.ManifestError, match=r"files\[0\]\.sha256"):
        mf.load_manifest(bad)


def test_pin_then_verify_detects_changes(tmp_path):
    d = write_tiny_dflash2(tmp_path / "drafter", vocab_size=16, hidden_size=16, target_layer_ids=[0])
    cli = [sys.executable, "-m", "drafter.manifest"]
    run = lambda *a: subprocess.run(cli + list(a), cwd=REPO, capture_output=True, text=True)  # noqa: E731
    r = run("verify", str(d))
    assert r.returncode == 1 and "no lock file" in r.stderr
    r = run("pin", str(d), "--commit", "b" * 40)
    assert r.returncode == 0, r.stderr
    lock = json.loads((d / mf.LOCK_NAME).read_text())
    assert lock["revision"] == "b" * 40 and set(lock["files"]) == {"config.json", "model.safetensors"}
    assert run("verify", str(d)).returncode == 0
    blob = bytearray((d / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(blob))
    r = run("verify", str(d))
    assert r.returncode == 1 and "model.safetensors: sha256 differs" in r.stderr
    (d / "config.json").unlink()
    r = run("verify", str(d))
    assert r.returncode == 1 and "config.json: missing" in r.stderr
    assert run("bogus").returncode == 2


def test_pin_with_hub_metadata_records_the_hubs_hashes_and_refuses_disagreement(tmp_path):
    import hashlib
    d = write_tiny_dflash2(tmp_path / "drafter", vocab_size=16, hidden_size=16, target_layer_ids=[0])
    shard, cfg = (d / "model.safetensors").read_bytes(), (d / "config.json").read_bytes()
    hub_sha = hashlib.sha256(shard).hexdigest()
    good = {"model.safetensors": mf.HubFile(len(shard), hub_sha, "f" * 40),
            "config.json": mf.HubFile(len(cfg), None, hashlib.sha1(b"blob %d\0" % len(cfg) + cfg).hexdigest())}
    lock = mf.pin(d, commit="c" * 40, hub_files=good)
    assert lock["files"]["model.safetensors"] == {"sha256": hub_sha, "size": len(shard), "from": "hub"}
    assert lock["files"]["config.json"]["from"] == "hub-git" and lock["revision"] == "c" * 40
    assert mf.verify(d) == []
    (d / mf.LOCK_NAME).unlink()
    with pytest.raises(mf.PinRefused) as e:  # size and git blob id disagreeing with the hub: nothing pinned
        mf.pin(d, hub_files={"model.safetensors": mf.HubFile(len(shard) + 1, hub_sha),
                             "config.json": mf.HubFile(len(cfg), None, "0" * 40)})
    assert any("model.safetensors: size" in p for p in e.value.problems)
    assert any("config.json: content differs from the hub's" in p for p in e.value.problems)
    with pytest.raises(mf.PinRefused, match="expects config.json, which the hub's revision does not have"):
        mf.pin(d, hub_files={"model.safetensors": good["model.safetensors"]})
    assert not (d / mf.LOCK_NAME).exists()


def test_prefilled_handoff_equals_own_prefill():
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]
    stop = StopRule(max_tokens=15)
    ref = drafted_decode(MODEL.session(), prompt, GREEDY, stop, MtpSource(MODEL.session().mtp()))
    target = MODEL.session()
    out = target.forward(prompt, 0, taps=(0, 1))
    out.logits = out.logits[-1:]                       # the engine hands over the last row only
    src = MtpSource(target.mtp())
    got = drafted_decode(target, prompt, GREEDY, stop, src, prefilled=out)
    assert got.tokens == ref.tokens and got.stats.proposed == ref.stats.proposed
    with pytest.raises(ValueError, match="prefilled output covers"):
        drafted_decode(MODEL.session(), prompt, GREEDY, stop, CopySource(), prefilled=out)
