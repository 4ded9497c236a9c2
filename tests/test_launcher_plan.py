"""The memory plan's arithmetic: needs per rank, the floor, DCP, unified memory, the largest context."""
from __future__ import annotations

from pathlib import Path

import pytest

from lane_fixtures import tiny_dirs, tiny_model  # noqa: F401  (fixture)

from launcher.config import MemorySettings
from glm53.serving.meminfo import GIB, MIB
from launcher.memplan import plan_memory

SETTINGS = MemorySettings(floor_gib=4.0, overhead_fraction=0.05, overhead_gib=1.5, workspace_gib=2.0)


def dcp_kv(per_token: int, ranks: int):
    return lambda ctx: [max(0, -(-(ctx - r) // ranks)) * per_token for r in range(ranks)]


def test_one_rank_need_is_weights_kv_workspace_and_stated_overhead() -> None:
    plan = plan_memory(context=1000, per_token=1000, kv_for=dcp_kv(1000, 1), weights=[10 * GIB],
                       weights_source="test", available=[("a", 40 * GIB)], settings=SETTINGS, unified=False,
                       max_context=10**9)
    r = plan.ranks[0]
    assert r.weights == 10 * GIB and r.kv == 1_000_000 and r.workspace == 2 * GIB
    assert r.overhead == int(1.5 * GIB) + int(0.05 * (10 * GIB + 1_000_000))
    assert r.need == r.weights + r.kv + r.workspace + r.overhead
    assert r.left == 40 * GIB - r.need and r.floor == 4 * GIB and plan.fits and plan.refusal() is None


def test_largest_context_is_exact_and_refusal_names_rank_node_and_fix() -> None:
    per_token = 1 << 20  # 1 MiB a position: easy to reason about
    kv = dcp_kv(per_token, 4)
    weights = [20 * GIB, 20 * GIB, 21 * GIB, 20 * GIB]
    avail = [("spark1", 40 * GIB), ("spark2", 40 * GIB), ("spark3", 40 * GIB), ("spark4", 40 * GIB)]
    plan = plan_memory(context=100_000, per_token=per_token, kv_for=kv, weights=weights, weights_source="t",
                       available=avail, settings=SETTINGS, unified=False, max_context=1 << 20)
    assert not plan.fits
    n = plan.largest_context
    # rank 2 (the heaviest) binds: 40 - 4 floor - 2 work - 1.5 fixed = 32.5 GiB for 1.05 * (21 GiB + kv)
    budget = 40 * GIB - 4 * GIB - 2 * GIB - int(1.5 * GIB)
    kv_max = budget / 1.05 - 21 * GIB
    assert abs(-(-(n - 2) // 4) * per_token - kv_max) <= per_token  # within one position of the bound
    at = plan_memory(context=n, per_token=per_token, kv_for=kv, weights=weights, weights_source="t",
                     available=avail, settings=SETTINGS, unified=False, max_context=1 << 20)
    over = plan_memory(context=n + 4, per_token=per_token, kv_for=kv, weights=weights, weights_source="t",
                       available=avail, settings=SETTINGS, unified=False, max_context=1 << 20)
    assert at.fits and not over.fits
    message = plan.refusal()
    assert "rank 2 on spark3" in message and f"--context {n}" in message and "under the floor" in message


def test_dcp_divides_kv_and_no_dcp_does_not() -> None:
    per_token = 1000
    with_dcp = dcp_kv(per_token, 4)(1001)
    assert with_dcp == [251_000, 250_000, 250_000, 250_000]
    plan = plan_memory(context=1001, per_token=per_token, kv_for=lambda c: [c * per_token] * 4, weights=[GIB] * 4,
                       weights_source="t", available=[("n", 64 * GIB)] * 4, settings=SETTINGS, unified=False,
                       max_context=10**6)
    assert [r.kv for r in plan.ranks] == [1_001_000] * 4


def test_unified_memory_is_conservative() -> None:
    args = dict(context=1000, per_token=1000, kv_for=dcp_kv(1000, 1), weights=[10 * GIB], weights_source="t",
                available=[("spark", 20 * GIB)], settings=SETTINGS, max_context=10**6)
    device = plan_memory(unified=False, **args)
    unified = plan_memory(unified=True, **args)
    assert unified.ranks[0].floor == 2 * device.ranks[0].floor
    assert unified.ranks[0].overhead > device.ranks[0].overhead
    assert unified.largest_context < device.largest_context


def test_weights_alone_too_big_says_so() -> None:
    plan = plan_memory(context=10, per_token=1, kv_for=dcp_kv(1, 1), weights=[100 * GIB], weights_source="t",
                       available=[("small", 50 * GIB)], settings=SETTINGS, unified=False, max_context=1000)
    assert plan.largest_context == 0 and "weights alone do not fit" in plan.refusal()


def test_plan_on_the_tiny_checkpoint_uses_the_layout_plan(tiny_model: Path) -> None:
    from glm53.layout.kv import kv_bytes_per_rank
    from glm53.layout.plan import plan_layout
    from glm53.config import Glm53Config
    from launcher.config import local_lane
    from launcher.preflight import Preflight
    from launcher.serve import memory_plan

    config = local_lane(2, device="cpu", context=4096)
    probe = {"gpus": [], "unified": False, "mem_available": 30 * GIB}
    plan = memory_plan(config, str(tiny_model), Preflight(probes={0: probe, 1: probe}))
    layout = plan_layout(tiny_model, 2).bytes_per_rank()
    kv = kv_bytes_per_rank(Glm53Config.from_dir(tiny_model), 4096, 2, dcp=True)
    assert [r.weights for r in plan.ranks] == layout and [r.kv for r in plan.ranks] == kv
    # two ranks share one node: its memory and its floor
    assert [r.available for r in plan.ranks] == [30 * GIB, 30 * GIB]
    assert plan.ranks[0].left == plan.ranks[1].left == 30 * GIB - plan.ranks[0].need - plan.ranks[1].need
    assert plan.fits and "glm53.layout" in plan.table()


def test_ranks_on_a_multi_gpu_host_each_get_their_own_gpu(tiny_model: Path) -> None:
    from launcher.config import local_lane
    from launcher.preflight import Preflight
    from launcher.serve import memory_plan

    config = local_lane(2, device="cuda", context=4096)
    gpus = [{"name": "H200", "total_mib": 143771, "free_mib": 100_000}, {"name": "H200", "total_mib": 143771,
                                                                          "free_mib": 50_000}]
    probe = {"gpus": gpus, "unified": False, "mem_available": 500 * GIB}
    plan = memory_plan(config, str(tiny_model), Preflight(probes={0: probe, 1: probe}))
    assert [(r.node, r.available) for r in plan.ranks] == [("local/gpu0", 100_000 * MIB), ("local/gpu1", 50_000 * MIB)]
    assert [r.left for r in plan.ranks] == [r.available - r.need for r in plan.ranks]  # nothing shared
    assert not plan.unified


def test_the_ranks_kv_pool_is_the_kv_the_plan_holds_room_for(tiny_model: Path) -> None:
    """serve.sh hands every rank TF_GLM53_KV_POOL_BYTES = the plan's KV on the tightest rank (its
    model layers' part: the MTP layer's rows live beside the pool), so the batched runtime's pool
    holds the planned context's positions (DCP: each rank a position in R), not what the device has
    free; a value the user set is kept."""
    from glm53.config import Glm53Config
    from glm53.dist.dcp import Ownership
    from glm53.dist.dcp_state import DcpKVState
    from glm53.layout.kv import kv_bytes_per_rank
    from glm53.runtime.kv_pool import PagedPool
    from launcher.config import local_lane
    from launcher.preflight import Preflight
    from launcher.serve import KV_POOL_ENV, kv_pool_env, memory_plan, sequence_kv_share

    context, ranks = 4096, 2
    config = local_lane(ranks, device="cpu", context=context)
    probe = {"gpus": [], "unified": False, "mem_available": 30 * GIB}
    plan = memory_plan(config, str(tiny_model), Preflight(probes={0: probe, 1: probe}))
    cfg = Glm53Config.from_dir(tiny_model)
    share = sequence_kv_share(str(tiny_model), "bf16")
    assert cfg.num_mtp_layers and 0 < share < 1
    env = kv_pool_env({"TF_GLM53_DCP": "1"}, plan, share)
    assert int(env[KV_POOL_ENV]) == int(min(kv_bytes_per_rank(cfg, context, ranks, dcp=True)) * share)
    assert kv_pool_env({KV_POOL_ENV: "8G"}, plan, share) == {KV_POOL_ENV: "8G"}
    indexed = frozenset(i for i in range(cfg.num_hidden_layers) if cfg.indexer_is_full(i))
    for r in range(ranks):
        probe = DcpKVState(n_layers=cfg.num_hidden_layers, latent_dim=cfg.latent_dim, index_dim=cfg.index_head_dim,
                           indexed_layers=indexed, kv_dtype="bf16", own=Ownership(r, ranks))
        pool = PagedPool(probe, int(env[KV_POOL_ENV]), page=256)
        assert context - 256 < pool.capacity <= context, (r, pool.capacity)


def test_the_memory_plan_sizes_a_lane_without_importing_torch(tiny_model: Path) -> None:
    """serve.sh plans memory before any rank starts: the plan (weights from the safetensors headers,
    KV from glm53.kv_format's row sizes) runs in a process that never imports torch (~3 s)."""
    import subprocess
    import sys

    probe = ("import sys; from launcher.memplan import kv_function, kv_per_token, weights_per_rank; "
             f"m = {str(tiny_model)!r}; kv_per_token(m, 'bf16'); kv_function(m, 2, True, 'fp8')(4096); "
             "weights_per_rank(m, 2); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
