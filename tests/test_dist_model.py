"""The tiny GLM-5.3 over R = 2, 3, 4 real processes (gloo), DCP on and off, against R = 1.

One spawned job per R: each rank loads its slices of the tiny EXL3 checkpoint once (heads split by
TP whether DCP is on or off), then runs DCP off and on through two DistRankPlans on the same group:
a 45-token prompt (past the indexer's top-k of 32, in pieces of 13 so chunk starts are not
multiples of R) and 64 greedy steps, and a 2-token prompt with 6 steps (at R = 3, 4 some ranks hold
none of the selected positions, or no row at all). Proved:
- each rank holds q_b rows of its own heads only (no replicated attention weights under DCP);
- the short context: tokens equal, logits finite and within the tolerance (lse = -inf, never NaN);
- greedy tokens equal R = 1's over all 64 steps, every rank, DCP on and off;
- fp32 logits within 5e-5 (absolute; logits reach ~5) of R = 1's at every step;
- every rank computes the same logits bit for bit (rank-order sums, rank-order merges);
- at R = 4 with DCP, the same request twice (fresh cache) gives the same logits bit for bit;
- with DCP each rank's cache holds exactly the positions p % R == rank, at slots p // R, and its
  layer-0 rows equal R = 1's rows at those positions bit for bit; with DCP off, every position.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from glm53.dist import tp
from tests.fixtures_tiny import tiny_dirs  # noqa: F401
from tests.test_dist_processes import Ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_workers as W  # noqa: E402

pytestmark = pytest.mark.slow
LOGIT_ATOL = 5e-5


@pytest.fixture(scope="module")
def world_one(tiny_dirs):  # noqa: F811
    from glm53.model.parallel import RankPlan

    model = W.load_model(tiny_dirs.model, RankPlan())
    state = model.new_state("fp32")
    tokens, logits = W.greedy(model, state, W.PROMPT, W.STEPS)
    short = W.greedy(model, model.new_state("fp32"), W.SHORT_PROMPT, W.SHORT_STEPS)
    return tokens, logits, state.latent[0][: state.length].clone(), short, model.cfg


@pytest.mark.parametrize("R", [2, 3, 4])
def test_ranks_match_world_one_with_dcp_on_and_off(tmp_path: Path, tiny_dirs, world_one, R: int) -> None:  # noqa: F811
    ref_tokens, ref_logits, ref_rows, (short_tokens, short_logits), cfg = world_one
    started = time.monotonic()
    ranks = Ranks(tmp_path, "model", R, timeout=60, extra_env={"GLM53_TEST_MODEL": str(tiny_dirs.model)})
    codes = ranks.wait(within=400)
    assert codes == {r: 0 for r in range(R)}, "\n".join(ranks.stderr(r)[-3000:] for r in range(R))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    length = len(W.PROMPT) + W.STEPS
    worst = 0.0
    for x in res:  # heads split by TP with DCP on too: q_b holds this rank's heads only
        a, b = tp.head_ranges(cfg.num_attention_heads, R)[x["rank"]]
        assert x["q_b_rows"] == (b - a) * cfg.qk_head_dim
    for dcp in (0, 1):
        for x in res:
            tokens, logits = x[f"dcp{dcp}"]
            assert tokens == ref_tokens, f"R={R} DCP={dcp} rank {x['rank']}: tokens diverge"
            torch.testing.assert_close(logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
            assert torch.equal(logits, res[0][f"dcp{dcp}"][1]), "ranks disagree on the logits"
            worst = max(worst, float((logits - ref_logits).abs().max()))
            tokens, logits = x[f"dcp{dcp}_short"]  # some ranks hold none of the selected positions
            assert tokens == short_tokens, f"R={R} DCP={dcp} short context: tokens diverge"
            assert torch.isfinite(logits).all()
            torch.testing.assert_close(logits, short_logits, atol=LOGIT_ATOL, rtol=0)
            worst = max(worst, float((logits - short_logits).abs().max()))
            positions, _capacity, rows = x[f"dcp{dcp}_rows"]
            want = torch.arange(x["rank"], length, R) if dcp else torch.arange(length)
            assert torch.equal(positions, want)
            assert torch.equal(rows, ref_rows[positions]), "cached rows are not R = 1's rows of those positions"
    if R == 4:
        for x in res:
            assert torch.equal(x["dcp1_again"][1], x["dcp1"][1]) and x["dcp1_again"][0] == x["dcp1"][0]
    print(f"R={R}: max |logit diff| vs R=1 = {worst:.3g}, wall {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize("R,dcp", [(2, "1")])
def test_rank_engine_leader_and_followers_match_world_one(tmp_path: Path, tiny_dirs, R: int, dcp: str) -> None:  # noqa: F811
    """RankEngine: rank 0 serves four requests (reuse of the live conversation, a cancellation
    after 3 tokens, sampling with a seed drawn on rank 0); followers follow and leave on stop.
    Replies equal a world-1 Glm53Engine's with the same seeds. Before them, with the followers 0.3 s
    behind: two requests rank 0 refuses and three of max_tokens 0, none of which meets the ranks in
    a collective (rank 0 deleted a request before a slower follower had read it: the lane hung)."""
    from glm53.runtime.engine import Glm53Engine

    ranks = Ranks(tmp_path, "engine", R, timeout=60,
                  extra_env={"GLM53_TEST_MODEL": str(tiny_dirs.model), "TF_GLM53_DCP": dcp,
                             "GLM53_TEST_FOLLOW_DELAY": "0.3"})
    codes = ranks.wait(within=400)
    assert codes == {r: 0 for r in range(R)}, "\n".join(ranks.stderr(r)[-3000:] for r in range(R))
    got = torch.load(tmp_path / "rank0.pt")["replies"]
    one = Glm53Engine(tiny_dirs.model, **W.ENGINE_OPTIONS)
    for (prompt, max_tokens, sampling, cancel), (reply, seed, finish) in zip(W.ENGINE_REQUESTS, got):
        params = dict(sampling or {}, seed=seed) if sampling else None
        seen: list[int] = []
        want = one.generate(prompt, max_tokens, params,
                            lambda new: seen.extend(new) or cancel is None or len(seen) < cancel)
        assert reply == want and finish == one.last_stats["finish_reason"], (prompt[:3], reply, want)
    assert got[2][2] == "cancelled" and len(got[2][0]) == 3
