"""Several requests at once over R real processes (gloo), TP R + DCP R, tiny checkpoint: the batched
runtime stepping in lockstep on every rank (glm53/dist/rank_batch.py) gives every request the reply
it gets alone.

One spawned job per R (tests/dist_workers.py `batch_ranks`): RankEngine as glm53.cuda_engine builds it
(a prefix cache on every rank; MTP drafts at R = 2, copy drafts at R = 4, for the requests that ask).
Rank 0 serves each request alone first (one at a time, the followers replaying it), then all of them
through `batch_engine()` in a random arrival schedule: shared openings, greedy and seeded sampling,
drafted and serial, clients leaving after 2 tokens, two requests sharing an opening while both run
(its pages shared in place on every rank: the paged split cache), and a pool of 64 positions, so
sequences are preempted and recomputed. Every batched reply and finish reason equals the alone one;
every rank ran the same number of steps and got every page back; reuse, page sharing, preemption
batches of several sequences happened, and their indexer ran a group of windows at a time on every rank.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures_tiny import tiny_dirs  # noqa: F401
from tests.test_dist_processes import Ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.slow

REQUESTS = {2: 36, 4: 20}
DRAFTS = {2: "mtp", 4: "copy"}


@pytest.mark.parametrize("R", [2, 4])
def test_batched_replies_over_ranks_equal_each_request_alone(tmp_path: Path, tiny_dirs, R: int) -> None:  # noqa: F811
    env = {"GLM53_TEST_MODEL": str(tiny_dirs.model), "GLM53_TEST_REQUESTS": str(REQUESTS[R]),
           "TF_GLM53_PREFIX_CACHE": "1", "TF_GLM53_DCP": "1", "TF_GLM53_DISK_CACHE": "",
           "TF_GLM53_DRAFT_SOURCE": DRAFTS[R], "TF_GLM53_STORE_STAGING_BYTES": "0"}
    ranks = Ranks(tmp_path, "batch_ranks", R, timeout=60, extra_env=env)
    codes = ranks.wait(within=400)
    assert codes == {r: 0 for r in range(R)}, "\n".join(ranks.stderr(r)[-3000:] for r in range(R))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    lead = res[0]
    assert all(x["drafter"] == DRAFTS[R] for x in res)
    for i, (req, (reply, reason), got) in enumerate(zip(lead["requests"], lead["alone"], lead["batched"])):
        assert got[0] == reply, f"request {i} ({req}): batched {got[0]} != alone {reply}"
        assert got[1] == reason, f"request {i}: finish {got[1]} batched, {reason} alone"
    assert [x["steps"] for x in res] == [lead["steps"]] * R, "the ranks ran different numbers of steps"
    assert [x["pool_capacity"] for x in res] == [lead["pool_capacity"]] * R
    cancelled = sum(reason == "cancelled" for _, reason in lead["alone"])
    drafted = sum(bool(r["sampling"]["draft"]) for r in lead["requests"])
    reused = sum(got[2] > 0 for got in lead["batched"])
    shared = sum(got[4] > 0 for got in lead["batched"])  # prompt pages taken in place from a running sequence
    print(f"R={R}: {len(lead['requests'])} requests, {lead['steps']} steps, at most {lead['most_running']} running, "
          f"{lead['preempted']} preemptions, {cancelled} cancelled, {drafted} drafted, {reused} reusing, {shared} sharing pages")
    assert cancelled >= 2 and drafted >= 4 and reused >= 2 and shared >= 1
    assert all(x["pages"][0] == x["pages"][1] for x in res), "pages not returned: " + repr([x["pages"] for x in res])
    assert lead["preempted"] >= 1, "the pool never ran short: preemption was not exercised"
    assert lead["most_running"] >= 3, "never more than two sequences in one step"
    # windows of one length scored and selected together on every rank alike (the split cache's group path)
    assert lead["grouped"] > 0 and [x["grouped"] for x in res] == [lead["grouped"]] * R
