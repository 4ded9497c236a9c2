"""The prefix cache and drafted decoding over R real processes (gloo), TP R + DCP R, tiny checkpoint.

One spawned job per R = 2, 4 (tests/dist_workers.py `cache_draft`): RankEngine(features=ServeFeatures()) as
glm53.cuda_engine builds it (a PrefixCache on every rank, copy drafts; CPU, fp32, fp32 cache, grid 16).
The cases run warm (one cache, in serving order), then again after re-attaching the cache with
TF_GLM53_PREFIX_CACHE=0 (nothing reused: the cold run at the same R). Proved, on every rank:
(a) append / identical resend / one-word extension / middle edit / a return to an evicted
    conversation (host-tier chunks restored through DcpKVState.import_rows; at R = 2 stored by
    background stores, at R = 4 inside the call): the reused rows, all
    rows after the request and every later logit equal the cold run bit for bit; replies equal;
    cached_tokens is the grid-floored agreed length, the same on every rank;
(b) drafted replies equal serial ones (3 prompts, greedy and seeded), cache on: copy drafts (by name) (drafts accepted),
    and a scripted source on rank 0 that proposes the serial reply with planted errors (windows
    accepted in full, in part, rejected: the followers replay every window and truncation);
(c) after a drafted request, the next prompt reuses only the drafted prompt's canonical chunks
    (verification rows past the frontier are never offered), and only those chunks were stored.
A second job (`draft_sources`, R = 4, grid 4, prefix cache on) switches the plan through copy, MTP
and DFlash2 drafts on every rank and serves through the batched runtime in lockstep (each request
serial and drafted in one batch): drafted == serial for each source, greedy and seeded.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from tests.fixtures_tiny import tiny_dirs  # noqa: F401
from tests.test_dist_processes import Ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_workers as W  # noqa: E402

pytestmark = pytest.mark.slow
C = W.ENGINE_OPTIONS["prefill_chunk"]


def expected_cached(prompt_len: int, reply_len: int) -> dict[str, int]:
    """Reused rows per case (token-exact: row-invariant ops; one token always left to prefill)."""
    p = len(W.CACHE_PROMPT)  # 45
    return {
        "base": 0,
        "append": p,                       # live rows; the base's frontier is its prompt (45)
        "resend": p - 1,                   # identical prompt: the last token is recomputed
        "one_word": p,                     # live rows, frontier 45
        "edit": 30,                        # edited at 30: exactly the rows before it
        # back to `append`'s prompt after the edit: live rows give 30, the stored blocks and tail of
        # the append request's canonical prefill give all but its last token, from the host tier
        "restore": p + reply_len + 7 - 1,
        "after_draft": len(W.DRAFT_PROMPTS[0]),  # its frontier: verification rows are never reused
    }


@pytest.mark.parametrize("R", [2, 4])
def test_prefix_cache_and_drafts_over_ranks(tmp_path: Path, tiny_dirs, R: int) -> None:  # noqa: F811
    started = time.monotonic()
    # the settings under test, whatever the caller's; at R = 2 stores run in the background (the GPU
    # default, kv_cache/staging.py: each rank's nodes are its own DCP slots), at R = 4 inside the call
    env = {"GLM53_TEST_MODEL": str(tiny_dirs.model), "TF_GLM53_PREFIX_CACHE": "1", "TF_GLM53_DRAFT_SOURCE": "copy",
           "TF_GLM53_DCP": "1", "TF_GLM53_DISK_CACHE": "", "TF_GLM53_STORE_STAGING_BYTES": "4M" if R == 2 else "0"}
    ranks = Ranks(tmp_path, "cache_draft", R, timeout=60, extra_env=env)
    codes = ranks.wait(within=240)
    assert codes == {r: 0 for r in range(R)}, "\n".join(ranks.stderr(r)[-3000:] for r in range(R))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    lead = res[0]
    assert all(x["drafter"] == "copy" for x in res) and all(x["health"] == (True, True) for x in res)
    assert all(x["background_stores"] == (R == 2) for x in res)
    want = expected_cached(len(W.CACHE_PROMPT), len(lead["warm/base"]["reply"]))
    names = [key[len("warm/"):] for key in lead if key.startswith("warm/")]
    assert names == [name for name, *_ in W.cache_draft_cases({})]
    for name in names:
        warm, cold = lead[f"warm/{name}"], lead[f"cold/{name}"]
        assert warm["reply"] == cold["reply"], f"{name}: reply differs with the prefix cache off"
        assert cold["stats"]["cached_tokens"] == 0
        for x in res:
            w, c = x[f"warm/{name}"], x[f"cold/{name}"]
            where = f"{name}, rank {x['rank']}"
            assert w["stats"]["cached_tokens"] == warm["stats"]["cached_tokens"], f"{where}: ranks disagree on reuse"
            assert (w["length"], w["frontier"]) == (c["length"], c["frontier"]), where
            # each rank holds only its own positions: slots [0, ceil((length - rank) / R))
            assert w["slots"] == (0, max(0, (w["length"] - x["rank"] + R - 1) // R)), where
            assert w["rows"].keys() == c["rows"].keys()
            for key in w["rows"]:
                assert torch.equal(w["rows"][key], c["rows"][key]), f"{where}: {key} rows differ from the cold run"
            assert [p for p, _ in w["trace"]] == [p for p, _ in c["trace"]], where
            for (pos, a), (_, b) in zip(w["trace"], c["trace"]):
                assert torch.equal(a, b), f"{where}: logits at position {pos} differ from the cold run"
    for name, n in want.items():  # (a), (c): how much was reused
        assert lead[f"warm/{name}"]["stats"]["cached_tokens"] == n, f"{name}: reused {lead[f'warm/{name}']['stats']}"
    # (a): the serial cases' logits were compared (a trace exists on every rank)
    assert all(len(x["warm/append"]["trace"]) == W.CACHE_STEPS for x in res)
    # (b) drafted == serial, greedy and seeded, and drafts were really accepted
    accepted = 0
    drafted = [(i, mode) for i in range(len(W.DRAFT_PROMPTS)) for mode in ("greedy", "seeded")
               if f"warm/drafted{i}_{mode}" in lead]
    for i, mode in drafted:
        d, s = lead[f"warm/drafted{i}_{mode}"], lead[f"warm/serial{i}_{mode}"]
        assert d["stats"]["drafted"] and not s["stats"]["drafted"]
        assert d["reply"] == s["reply"], f"prompt {i} {mode}: drafted reply differs from serial"
        assert d["reply"] == lead[f"cold/drafted{i}_{mode}"]["reply"]
        accepted += d["stats"]["draft"]["tf_glm53_draft_accepted_total"]
        for x in res:  # every rank ends the request holding the same rows as rank 0
            assert x[f"warm/drafted{i}_{mode}"]["length"] == d["length"] == len(W.DRAFT_PROMPTS[i]) + len(d["reply"]) - 1
    assert accepted > 0, "copy drafts were never accepted: the drafted path was not exercised"
    assert lead["draft_totals"]["tf_glm53_draft_accepted_total"] >= accepted
    # scripted drafts (rank 0 only) force long windows, partial acceptance and rejections
    proposed = accepted = 0
    for i, mode in drafted:
        d = lead[f"warm/scripted{i}_{mode}"]
        assert d["reply"] == lead[f"warm/serial{i}_{mode}"]["reply"], f"prompt {i} {mode}: scripted drafts"
        proposed += d["stats"]["draft"]["tf_glm53_draft_proposed_total"]
        accepted += d["stats"]["draft"]["tf_glm53_draft_accepted_total"]
        for x in res:
            assert x[f"warm/scripted{i}_{mode}"]["length"] == d["length"]
    assert 0 < accepted < proposed, f"scripted drafts: {accepted} of {proposed} accepted (need both outcomes)"
    # (c) the drafted request stored only its prompt (whole blocks and the tail), on every rank
    for x in res:
        first_draft = x["warm/drafted0_greedy"]
        assert first_draft["stored_chunks"] == -(-len(W.DRAFT_PROMPTS[0]) // W.ENGINE_OPTIONS["cache_block"])
        assert first_draft["frontier"] == len(W.DRAFT_PROMPTS[0])
    print(f"R={R}: {len(names)} cases warm + cold, wall {time.monotonic() - started:.1f} s; "
          f"per-request seconds (rank 0, warm): " +
          ", ".join(f"{n}={lead[f'warm/{n}']['seconds']:.2f}" for n in names[:6]))


# requests per source, each served serial and drafted: 3 x 67 = 201 prompts at R = 4 through the
# batched runtime (issue 10 asks for at least 200 at four ranks); one at a time (rank 0 drafts, the
# others replay its windows) 3 x 8 at R = 2
PER_SOURCE = {("batched", 4): 67, ("one at a time", 2): 8}


@pytest.mark.parametrize("serving,R", list(PER_SOURCE), ids=["batched-R4", "one-at-a-time-R2"])
def test_each_draft_source_over_ranks_equals_serial(tmp_path: Path, tiny_dirs, serving: str, R: int) -> None:  # noqa: F811
    """Copy, MTP and DFlash2 drafts over R gloo ranks, prefix cache on (grid 4, so short prompts reuse
    chunks): every drafted reply equals the serial one, greedy and seeded; each source proposed; reuse
    happened. Batched: every rank runs the drafter in the lockstep runtime (MTP's and DFlash2's
    collectives meet like the model's) and every rank ran the same steps. One at a time: rank 0 drafts
    (MTP replayed on every rank's MTP cache, DFlash2 on rank 0's taps) and every rank ends each request
    holding the rows rank 0 holds."""
    from drafter.tiny_dflash import write_tiny_dflash2
    from glm53.config import Glm53Config

    started = time.monotonic()
    per_source = PER_SOURCE[serving, R]
    cfg = Glm53Config.from_dir(tiny_dirs.model)
    dflash = write_tiny_dflash2(tmp_path / "dflash2", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                target_layer_ids=[1, 2], block_size=6)
    env = {"GLM53_TEST_MODEL": str(tiny_dirs.model), "GLM53_TEST_DFLASH": str(dflash),
           "GLM53_TEST_PER_SOURCE": str(per_source), "TF_GLM53_PREFIX_CACHE": "1", "TF_GLM53_DCP": "1",
           "TF_GLM53_DISK_CACHE": ""}
    scenario = "draft_sources_batched" if serving == "batched" else "draft_sources"
    ranks = Ranks(tmp_path, scenario, R, timeout=60, extra_env=env)
    codes = ranks.wait(within=600)
    assert codes == {r: 0 for r in range(R)}, "\n".join(ranks.stderr(r)[-3000:] for r in range(R))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    lead = res[0]
    prompts = 0
    for source in W.DRAFT_SOURCES:
        got = lead[source]
        assert got["kind"] == source
        reused = 0
        for i, req in enumerate(got["requests"]):
            assert req["serial"] == req["drafted"], f"{source} request {i}: drafted {req['drafted']} != serial {req['serial']}"
            assert req["drafted_stats"]["drafted"] and not req["serial_stats"]["drafted"]
            reused += req["drafted_stats"]["cached_tokens"]
            if serving == "one at a time":
                for x in res:
                    mine = x[source]["requests"][i]
                    assert (mine["serial_length"], mine["drafted_length"]) == (req["serial_length"], req["drafted_length"]), \
                        f"{source} request {i}: rank {x['rank']} holds other rows than rank 0"
        prompts += len(got["requests"])
        print(f"R={R} {serving} {source}: {len(got['requests'])} prompts serial + drafted, "
              f"{got['totals']['tf_glm53_draft_accepted_total']}/{got['totals']['tf_glm53_draft_proposed_total']} "
              f"drafts accepted, reused {reused} rows, {got['seconds']:.1f} s")
        assert reused > 0, f"{source}: no prefix was reused"
        assert got["totals"]["tf_glm53_draft_proposed_total"] > 0, f"{source}: never proposed"
    assert prompts == 3 * per_source
    if serving == "batched":
        assert [x["steps"] for x in res] == [lead["steps"]] * R, "the ranks ran different numbers of steps"
    print(f"R={R}: {prompts} prompts, wall {time.monotonic() - started:.1f} s")


# ---- the pieces, in one process --------------------------------------------------------------------
def _dcp_state(rank: int, ranks: int):
    from glm53.dist.dcp import Ownership
    from glm53.dist.dcp_state import DcpKVState

    return DcpKVState(n_layers=2, latent_dim=6, index_dim=3, indexed_layers=frozenset({1}), kv_dtype="fp32",
                      own=Ownership(rank, ranks))


def test_dcp_state_moves_its_own_slots_of_a_grid_chunk() -> None:
    """export_rows / import_rows of positions [kC, (k+1)C) move local slots [own.count(kC),
    own.count((k+1)C)); a mismatched chunk is refused before anything is written."""
    src = _dcp_state(rank=1, ranks=4)
    n = 41
    rows = torch.arange(n * 6, dtype=torch.float32).view(n, 6)
    keys = -torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    src.reserve(n)
    for layer in range(2):
        src.write_latent(layer, 0, rows + layer)
    src.write_index(1, 0, keys)
    src.tokens.extend(range(n))
    chunk = src.export_rows(16, 32)  # positions 17, 21, 25, 29 live on rank 1, at slots 4..7
    assert src.slots(16, 32) == (4, 8)
    assert torch.equal(chunk["latent.0"], rows[[17, 21, 25, 29]])
    assert torch.equal(chunk["index.1"], keys[[17, 21, 25, 29]])

    dst = _dcp_state(rank=1, ranks=4)
    dst.import_rows(0, src.export_rows(0, 16), list(range(16)))
    dst.import_rows(16, {k: v.clone() for k, v in chunk.items()}, list(range(16, 32)))
    assert dst.length == dst.frontier == 32
    assert torch.equal(dst.read_latent(1, 32, torch.float32), (rows + 1)[1:32:4])
    bad = {k: v[:1] for k, v in src.export_rows(32, 41).items()}  # 32..40 holds 33, 37 on rank 1: 2 rows
    bad["index.1"] = src.export_rows(32, 41)["index.1"]
    before = dst.latent[0].clone()
    with pytest.raises(ValueError, match="restored latent"):
        dst.import_rows(32, bad, list(range(32, 41)))
    assert dst.length == 32 and torch.equal(dst.latent[0], before)  # nothing half-written


def test_draft_plan_over_ranks_follows_the_choice() -> None:
    from drafter.glm53_target import DraftPlan
    from glm53.settings import Settings

    engine = object()  # copy / off never need the model; mtp / dflash2 over ranks run in the spawned job
    copy, off = (Settings.from_env({"TF_GLM53_DRAFT_SOURCE": v}) for v in ("copy", "off"))
    assert DraftPlan.from_contract(engine, world=2, settings=copy).kind == "copy"
    assert DraftPlan.from_contract(engine, world=2, settings=off) is None
