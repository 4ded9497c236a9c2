"""glm53.dist with real processes: gloo on the CPU, rendezvous over loopback, real SIGKILLs.

One OS process per rank (tests/dist_workers.py). What is proved:
- rendezvous by a torchrun-style environment (R = 4) and by master/port (the failure tests);
- the DCP attention merge equals single-rank attention (fp32, atol 2e-6), is bitwise the same on
  every rank and bitwise equal to the merge recomputed here in one process (a pure function of
  the per-rank partials: deterministic run to run), with ranks that own nothing (context shorter
  than R, selection all on one rank, nothing at all) giving no NaN;
- the merged top-k equals the single-rank top-k with the same tie-break, ties included;
- a SIGKILLed rank (rank 2, and rank 0 which hosts the store) makes every survivor exit within
  seconds with a message naming it; a rank that never arrives, a rank that never joins a
  collective, and an absent rank 0 each give an error naming the rank or address.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glm53.dist import dcp, tp
from glm53.dist.guard import EXIT_COLLECTIVE_TIMEOUT, EXIT_PEER_FAILED, EXIT_STORE_LOST

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_workers as W  # noqa: E402

WORKER = Path(__file__).resolve().parent / "dist_workers.py"
ROOT = WORKER.parents[1]
pytestmark = pytest.mark.slow
FAST_GUARD = {"TF_GLM53_HEARTBEAT_S": "0.25", "TF_GLM53_DEAD_AFTER_S": "2.5"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Launch ranks as subprocesses with stderr to files; wait with a deadline."""

    def __init__(self, tmp: Path, scenario: str, world: int, ranks: list[int] | None = None,
                 env_mode: bool = False, timeout: float = 30.0, extra_env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.tmp, self.port = tmp, port or free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        cpus = sorted(os.sched_getaffinity(0))
        for r in range(world) if ranks is None else ranks:
            env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
            args = [sys.executable, str(WORKER), scenario, "--out", str(tmp), "--timeout", str(timeout)]
            if env_mode:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), RANK=str(r), WORLD_SIZE=str(world))
                args.append("--env")
            else:
                args += ["--rank", str(r), "--world", str(world), "--port", str(self.port)]
            err = open(tmp / f"stderr{r}.txt", "w")
            # each rank on one CPU (rank r on the r-th modulo the count): more ranks than cores wait
            # on each other's collectives at every hop, and unpinned they also migrate between cores
            # (gloo all-reduce at four ranks on two cores: 4.9 ms unpinned, 2.1 ms pinned;
            # bench/bench_gloo_pinning.py, bench/results/gloo_pinning_cpu.json)
            cpu = {cpus[r % len(cpus)]}
            self.procs[r] = subprocess.Popen(args, env=env, cwd=ROOT, stdout=err, stderr=subprocess.STDOUT,
                                             preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, cpu))
            err.close()

    def stderr(self, r: int) -> str:
        return (self.tmp / f"stderr{r}.txt").read_text()

    def wait(self, within: float) -> dict[int, int]:
        deadline = time.monotonic() + within
        codes = {}
        try:
            for r, p in self.procs.items():
                codes[r] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            self.kill_all()
        return codes

    def wait_for_files(self, names: list[str], within: float) -> None:
        deadline = time.monotonic() + within
        while not all((self.tmp / n).exists() for n in names):
            dead = {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"ranks not ready (exited: {dead}): " +
                                     " | ".join(self.stderr(r)[-800:] for r in self.procs))
            time.sleep(0.05)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ok(tmp: Path, scenario: str, world: int, **kw) -> list[dict]:
    ranks = Ranks(tmp, scenario, world, **kw)
    codes = ranks.wait(within=60)
    assert codes == {r: 0 for r in range(world)}, "\n".join(ranks.stderr(r)[-2000:] for r in range(world))
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


# ---- collectives, DCP merge, top-k merge (R = 4, torchrun-style environment) ---------------
def test_suite_at_four_ranks_from_torchrun_environment(tmp_path: Path) -> None:
    R = 4
    res = run_ok(tmp_path, "suite", R, env_mode=True)
    assert [x["rank"] for x in res] == [0, 1, 2, 3] and {x["backend"] for x in res} == {"gloo"}
    for x in res:
        assert torch.equal(x["all_gather"], torch.tensor([[1.5], [11.5], [21.5], [31.5]]))
        assert torch.equal(x["sum"], torch.full((5,), 0.25 + 1.25 + 2.25 + 3.25))

    for n in W.ATTN_LENGTHS:
        q, k, v = W.attention_inputs(n)
        want_o, want_lse = dcp.attend_reference(q, k, v, W.SCALE)
        # recompute the per-rank partials here and merge them in one process
        partial = [dcp.attend_reference(q, k[own], v[own], W.SCALE)
                   for own in (dcp.Ownership(r, R).owned_positions(0, n) for r in range(R))]
        local_o, local_lse = dcp.merge_partials(torch.stack([p[0] for p in partial]),
                                                torch.stack([p[1] for p in partial]))
        for x in res:
            o, lse = x[f"attn{n}"]
            assert not torch.isnan(o).any() and not torch.isnan(lse).any()
            torch.testing.assert_close(o, want_o, atol=2e-6, rtol=2e-6)
            torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=2e-6)
            assert torch.equal(o, local_o) and torch.equal(lse, local_lse), "merge is not a pure function"
            assert x[f"attn{n}_again_equal"]
            assert torch.equal(o, res[0][f"attn{n}"][0])  # same bits on every rank
            h0, h1 = tp.head_ranges(W.HEADS, R)[x["rank"]]
            assert torch.equal(x[f"attn{n}_heads"][0], o[h0:h1])
            got_o, got_lse = x[f"attn{n}_owners"]  # the all-to-all variant: same bits for own heads
            assert torch.equal(got_o, o[h0:h1]) and torch.equal(got_lse, lse[h0:h1])
            # uneven ownership (3/3/2/0 heads): padding never leaks, an owner of no heads gets []
            a, b = (tp.head_ranges(W.HEADS, 3) + [(W.HEADS, W.HEADS)])[x["rank"]]
            got_o, got_lse = x[f"attn{n}_owners3"]
            assert torch.equal(got_o, o[a:b]) and torch.equal(got_lse, lse[a:b])
            # bf16 partials sent as bf16 (half the bytes): bitwise the merge of their fp32 widening
            half, widened = x[f"attn{n}_owners_bf16"], x[f"attn{n}_owners_bf16_widened"]
            assert x[f"attn{n}_owners_bf16_collectives"] == 1
            width = max(b - a for a, b in tp.head_ranges(W.HEADS, R))
            assert x[f"attn{n}_owners_bf16_bytes"] == [R * width * (W.V_DIM * 2 + 4)]  # bf16 out, fp32 lse
            assert half[0].dtype == torch.float32 and torch.equal(half[0], widened[0]) and torch.equal(half[1], widened[1])

    q, k, v = W.attention_inputs(40, seed=1)
    sel = torch.arange(1, 40, R)
    want_o, want_lse = dcp.attend_reference(q, k[sel], v[sel], W.SCALE)
    for x in res:
        o, lse = x["sparse_one_owner"]
        assert not torch.isnan(o).any()
        torch.testing.assert_close(o, want_o, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=2e-6)
        o, lse = x["all_empty"]
        assert torch.equal(o, torch.zeros(W.HEADS, W.V_DIM)) and bool(torch.isneginf(lse).all())

    for n, k_sel in W.TOPK_CASES:
        scores, positions = W.topk_inputs(n)
        want_s, want_p = topk_by_sorting(scores, positions, k_sel)
        for x in res:
            got_s, got_p = x[f"topk{n}_{k_sel}"]
            assert torch.equal(got_p, want_p), (n, k_sel, got_p, want_p)
            assert torch.equal(got_s, want_s)


    for n_heads in W.MLA_HEADS:  # vs the model's own world-1 absorbed attention
        want = world_one_mla(n_heads)
        for x in res:
            a, b = tp.head_ranges(n_heads, R)[x["rank"]]
            got = x[f"mla{n_heads}"]
            assert not torch.isnan(got).any()
            torch.testing.assert_close(got, want[:, a:b], atol=2e-5, rtol=2e-5)

    for x in res:
        # all_gather_packed: the bytes of every tensor, dtypes and shapes restored, in one collective
        assert x["packed_collectives"] == 1
        for got, want, local in zip(x["packed"], x["packed_separate"], W.packed_inputs(x["rank"])):
            assert got.dtype == want.dtype and got.shape == want.shape == (R, *local.shape)
            assert torch.equal(got, want) and torch.equal(got[x["rank"]], local)
        # the top-k candidates ride with the queries: the same bits, one collective fewer
        assert x["mla_topk_selections_equal"]
        assert torch.equal(x["mla_topk_pending"], x["mla_topk_separate"])
        assert torch.equal(x["mla_topk_shared"], x["mla_topk_separate"])
        assert (x["mla_topk_separate_collectives"], x["mla_topk_pending_collectives"],
                x["mla_topk_shared_collectives"]) == (3, 2, 2)
        # a batched step's spans share the two exchanges, each span's rows as alone, bit for bit
        assert x["mla_spans_collectives"] == 2
        assert x["mla_spans_together"].shape == x["mla_spans_alone"].shape
        assert torch.equal(x["mla_spans_together"], x["mla_spans_alone"])
        # draft-window calls: tokens up to INLINE_TOKENS ride in the header (one broadcast)
        assert x["window_collectives"] == [1, 1, 1, 2, 2, 2]
    sent = W.window_messages()
    for x in res[1:]:
        assert len(x["window_received"]) == len(sent)
        for (op, value, tokens, rows), got in zip(sent, x["window_received"]):
            assert got[:3] == (op, value, tokens)
            assert (got[3] is None) == (rows is None)
            if rows is not None:
                assert got[3].dtype == rows.dtype and torch.equal(got[3], rows)


def world_one_mla(n_heads: int) -> torch.Tensor:
    from glm53.model.indexer import Selection
    from glm53.model.mla import AttentionWeights, attend

    q_nope, q_rot, kv_b, rows, mask = W.mla_inputs(n_heads)
    empty = torch.empty(0)
    w = AttentionWeights(q_a=empty, q_a_norm=empty, q_b=empty, kv_a=empty, kv_a_norm=empty, kv_b=kv_b, o=empty,
                         n_heads=n_heads, nope=W.MLA_NOPE, rope=W.MLA_ROPE, v_dim=W.MLA_V, kv_rank=W.MLA_R,
                         scale=W.MLA_SCALE)
    out, _ = attend(w, q_nope, q_rot, rows, Selection.from_mask(mask, W.MLA_N))
    return out


def topk_by_sorting(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent single-rank reference: Python sort by (-score, position)."""
    out_s, out_p = [], []
    for row in scores:
        order = sorted(range(len(positions)), key=lambda i: (-float(row[i]), int(positions[i])))[:k]
        out_s.append([float(row[i]) + 0.0 for i in order])
        out_p.append([int(positions[i]) for i in order])
    return torch.tensor(out_s), torch.tensor(out_p)


# ---- failures ------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", [2, 0])
def test_killed_rank_stops_the_others_naming_it(tmp_path: Path, victim: int) -> None:
    R = 3
    ranks = Ranks(tmp_path, "spin", R, extra_env=FAST_GUARD)
    ranks.wait_for_files([f"ready{r}" for r in range(R)], within=60)
    ranks.procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivors = [r for r in range(R) if r != victim]
    for r in survivors:
        code = ranks.procs[r].wait(timeout=20)
        assert time.monotonic() - killed_at < 10, f"rank {r} took {time.monotonic() - killed_at:.1f} s to stop"
        text = ranks.stderr(r)
        assert code in (EXIT_PEER_FAILED, EXIT_STORE_LOST), (code, text)
        line = [ln for ln in text.splitlines() if ln.startswith("glm53.dist:")][-1]
        if victim == 0:  # rank 0 hosts the store: its loss is seen as either
            assert "rank 0 stopped responding" in line or "rank 0 is presumed dead" in line, text
        else:
            assert f"rank {victim} stopped responding" in line, text
    ranks.kill_all()


def test_ranks_with_different_prefix_cache_settings_are_refused_naming_each(tmp_path: Path) -> None:
    """A disk tier on one rank only would desynchronise the restores' agreement: every rank stops
    at start-up with each rank's settings named (a real 3-process gloo group)."""
    ranks = Ranks(tmp_path, "cache_settings", 3)
    codes = ranks.wait(within=60)
    assert codes == {0: 0, 1: 0, 2: 0}, [ranks.stderr(r) for r in range(3)]
    for r in range(3):
        text = (tmp_path / f"refused{r}").read_text()
        assert ("rank 0: TF_GLM53_PREFIX_CACHE=1, disk tier on, reuse boundary any token; "
                "rank 1: TF_GLM53_PREFIX_CACHE=1, disk tier off, reuse boundary any token") in text
        assert "TF_GLM53_DISK_CACHE" in text
        text = (tmp_path / f"refused_boundary{r}").read_text()
        assert "rank 1: TF_GLM53_PREFIX_CACHE=1, disk tier on, reuse boundary 16" in text


def test_rank_that_never_arrives_is_named(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, "suite", 3, ranks=[0, 1], timeout=2)
    codes = ranks.wait(within=30)
    for r in (0, 1):
        assert codes[r] != 0
        assert "ranks [2] did not arrive" in ranks.stderr(r), ranks.stderr(r)


def test_rank_zero_absent_is_reported_with_its_address(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, "suite", 2, ranks=[1], timeout=1)
    codes = ranks.wait(within=30)
    assert codes[1] != 0
    assert f"could not reach rank 0 at 127.0.0.1:{ranks.port}" in ranks.stderr(1), ranks.stderr(1)


def test_collective_timeout_names_the_rank_that_never_joined(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, "stuck", 3, extra_env={"TF_GLM53_COLLECTIVE_TIMEOUT_S": "2"})
    ranks.wait_for_files(["ready0", "ready1", "ready2"], within=60)
    start = time.monotonic()
    for r in (0, 2):
        code = ranks.procs[r].wait(timeout=20)
        text = ranks.stderr(r)
        assert code in (EXIT_COLLECTIVE_TIMEOUT, EXIT_PEER_FAILED), (code, text)
        assert "rank 1" in text or "ranks [1]" in text, text
    assert time.monotonic() - start < 12
    assert "ranks [1] never reached it" in ranks.stderr(0) + ranks.stderr(2)
    ranks.kill_all()


def test_real_torchrun_launch_uses_the_agent_store(tmp_path: Path) -> None:
    """torchrun's agent already listens at MASTER_PORT; every rank joins it as a client."""
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(WORKER), "suite", "--env", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    want = dcp.attend_reference(*W.attention_inputs(37), W.SCALE)[0]
    for r in range(2):
        x = torch.load(tmp_path / f"rank{r}.pt")
        assert x["world"] == 2
        torch.testing.assert_close(x["attn37"][0], want, atol=2e-6, rtol=2e-6)
