"""glm53.dist over NCCL (GPU machines with 2+ GPUs): the same checks as the gloo suite, on CUDA
tensors, and a SIGKILLed rank stopping the survivor (NCCL alone would block forever).

Run on a 2-GPU machine:  python -m pytest -q tests/test_dist_nccl.py
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from glm53.dist import dcp, tp
from glm53.dist.guard import EXIT_PEER_FAILED, EXIT_STORE_LOST
from tests.test_dist_processes import FAST_GUARD, Ranks, run_ok, topk_by_sorting

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_workers as W  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def two_gpus() -> int:
    if _gpus() < 2:
        pytest.skip(f"NCCL tests need 2 GPUs; this machine has {_gpus()}")
    return min(_gpus(), 4)


def test_nccl_collectives_and_merges_match_the_cpu_reference(tmp_path: Path, two_gpus: int) -> None:
    R = two_gpus
    res = run_ok(tmp_path, "nccl", R)
    assert {x["backend"] for x in res} == {"nccl"}
    for x in res:
        assert torch.equal(x["all_gather"].view(-1), torch.tensor([r * 10 + 1.5 for r in range(R)]))
    for n in W.ATTN_LENGTHS:
        q, k, v = W.attention_inputs(n)
        want_o, want_lse = dcp.attend_reference(q, k, v, W.SCALE)
        for x in res:
            o, lse = x[f"attn{n}"]
            assert not torch.isnan(o).any()
            torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)  # GPU fp32 matmul (TF32 off by default)
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
            assert torch.equal(o, res[0][f"attn{n}"][0])
            a, b = tp.head_ranges(W.HEADS, R)[x["rank"]]
            assert torch.equal(x[f"attn{n}_owners"][0], o[a:b])
    for n, k_sel in W.TOPK_CASES:
        want_s, want_p = topk_by_sorting(*W.topk_inputs(n), k_sel)
        for x in res:
            got_s, got_p = x[f"topk{n}_{k_sel}"]
            assert torch.equal(got_p, want_p) and torch.equal(got_s, want_s)


def test_nccl_killed_rank_stops_the_survivors(tmp_path: Path, two_gpus: int) -> None:
    R = two_gpus
    ranks = Ranks(tmp_path, "spin_cuda", R, extra_env=FAST_GUARD)
    ranks.wait_for_files([f"ready{r}" for r in range(R)], within=120)
    victim = R - 1
    ranks.procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for r in range(R - 1):
        code = ranks.procs[r].wait(timeout=30)
        assert time.monotonic() - killed_at < 10
        assert code in (EXIT_PEER_FAILED, EXIT_STORE_LOST), ranks.stderr(r)
        assert f"rank {victim} stopped responding" in ranks.stderr(r)
    ranks.kill_all()
