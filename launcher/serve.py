"""serve.sh's work: resolve the settings, preflight, plan memory, start the supervisor and follow
it to READY; stop, restart and status. Exit codes are EXIT_* below (documented in `--help`)."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from glm53.serving.lane import API_KEYS_ENV, DRAIN_TIMEOUT_S
from glm53.settings import env_name
from launcher import commands
from launcher.config import KIT_DIR, LaneConfig, from_dict, to_dict
from launcher.memplan import MemoryPlan, config_dict, kv_function, kv_per_token, plan_memory, weights_per_rank
from launcher.nodes import display, node_argv, run
from launcher.preflight import Preflight, preflight
from launcher.probe import git_commit, gpus
from launcher.state import pid_alive, read_json, write_json
from launcher.supervisor import http_base, tail
from launcher.tiny_cache import ensure_tiny, tiny_dir

EXIT_OK = 0
EXIT_START_FAILED = 1
EXIT_USAGE = 2
EXIT_PREFLIGHT = 3
EXIT_MEMORY = 4
EXIT_BUSY = 5


class LaneError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def lane_dir(config: LaneConfig) -> Path:
    """This machine's state and logs for the lane (the nodes keep only pid files, under kit_dir)."""
    return KIT_DIR / ".work" / "lanes" / str(config.port)


def running_supervisor(run_dir: Path) -> dict[str, Any] | None:
    state = read_json(run_dir / "lane.json")
    if state and pid_alive(state.get("pid")) and state.get("phase") not in ("stopped", "failed"):
        return state
    return None


def local_device() -> str:
    return "cuda" if gpus() else "cpu"


def model_path(config: LaneConfig, dry_run: bool) -> str:
    if config.model:
        return config.model
    if dry_run:
        return str(tiny_dir())
    return str(ensure_tiny())


# ---- checks ------------------------------------------------------------------------------------
def memory_plan(config: LaneConfig, model: str, checks: Preflight, freed: dict[str, int] | None = None) -> MemoryPlan:
    """The plan against each node's available memory now (+ what a lane being replaced will free)."""
    raw = config_dict(model)
    max_context = int(raw.get("max_position_embeddings", 0))
    weights, source = weights_per_rank(model, config.ranks)
    per_token = kv_per_token(model, config.kv_dtype)
    kv_for = kv_function(model, config.ranks, config.dcp, config.kv_dtype)
    available = []
    unified = config.memory.unified == "yes"
    for node in config.nodes:
        probe = checks.probes[node.rank]
        gpu_free = [g["free_mib"] for g in probe["gpus"] if g["free_mib"] is not None]
        node_unified = config.memory.unified == "yes" or (config.memory.unified == "auto" and (
            probe["unified"] or config.device == "cpu"))
        unified = unified or node_unified
        if node_unified or not gpu_free:  # one pool per node: its ranks share it (plan_memory sums them)
            where, avail = node.host, probe["mem_available"]
        else:  # device memory: each rank has its host's GPU number LOCAL_RANK
            index = commands.local_rank(config, node) % len(gpu_free)
            where, avail = f"{node.host}/gpu{index}", gpu_free[index] * (1 << 20)
        available.append((where, avail + (freed or {}).get(where, 0)))
    context = config.context or max_context
    plan = plan_memory(context=context, per_token=per_token, kv_for=kv_for, weights=weights, weights_source=source,
                       available=available, settings=config.memory, unified=unified, max_context=max_context)
    if not config.context and not plan.fits and plan.largest_context > 0:  # no context asked: take what fits
        plan = plan_memory(context=plan.largest_context, per_token=per_token, kv_for=kv_for, weights=weights,
                           weights_source=source, available=available, settings=config.memory, unified=unified,
                           max_context=max_context)
    return plan


def port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def check(config: LaneConfig, model: str, out: TextIO, freed: dict[str, int] | None = None,
          dry_run: bool = False) -> tuple[LaneConfig, MemoryPlan | None, list[str]]:
    """Preflight + memory plan. Returns the config with the context settled, the plan, the problems."""
    problems: list[str] = []
    t0 = time.monotonic()
    local_commit = git_commit(config.kit_dir) if not config.local else None
    tiny_pending = dry_run and not config.model and not (Path(model) / "config.json").is_file()
    checks = preflight(config, model, local_commit, check_runtime_key=not config.local, model_expected=not tiny_pending)
    for rank, probe in sorted(checks.probes.items()):
        node = config.nodes[rank]
        gpu = ", ".join(g["name"] for g in probe["gpus"]) or "no GPU"
        verdict = "FAILED" if any(f.startswith(node.label + ":") for f in checks.failures) else "ok"
        print(f"preflight: {node.label}: {verdict} ({gpu}; {probe['mem_available'] / 2**30:.1f} GiB available; "
              f"kit {probe['kit_version']} @ {(probe['kit_commit'] or '-')[:12]})", file=out)
    problems += [f"preflight: {f}" for f in checks.failures]
    print(f"preflight: {len(checks.probes)}/{config.ranks} nodes answered in {time.monotonic() - t0:.1f} s", file=out)
    if not freed and config.nodes[0].is_local and port_taken(config.listen, config.port):
        problems.append(f"port {config.port} on {config.listen} is in use: stop what holds it "
                        f"(bash serve.sh stop --port {config.port}) or choose another --port")
    plan = None
    if len(checks.probes) == config.ranks and not checks.failures:
        if tiny_pending:
            print(f"memory plan: the tiny checkpoint {model} does not exist yet (generated on first start: "
                  f"{sys.executable} -m glm53.synthetic.tiny {model})", file=out)
        elif not (Path(model) / "config.json").is_file():
            problems.append(f"memory plan: {model}/config.json is not on this machine; the plan reads the "
                            f"checkpoint's headers here: start serve.sh on a node that holds the weights")
        else:
            try:
                plan = memory_plan(config, model, checks, freed)
            except (OSError, ValueError) as exc:  # unreadable headers, a config the layout refuses
                problems.append(f"memory plan: cannot plan {model}: {exc}")
            else:
                print(plan.table(), file=out)
                if plan.refusal():
                    problems.append(plan.refusal())
                else:
                    config = replace(config, context=plan.context,
                                     env=kv_pool_env(config.env, plan, sequence_kv_share(model, config.kv_dtype)))
    return config, plan, problems


KV_POOL_ENV = env_name("kv_pool_bytes")


def kv_pool_env(env: dict[str, str], plan: MemoryPlan, share: float = 1.0) -> dict[str, str]:
    """The ranks' environment with the batched runtime's KV pool sized from the plan: the KV the plan
    holds room for on the tightest rank (the context's positions, shared by the sequences that run at
    once), rather than what the device has free after loading; `share` of it, the part that is the
    sequences' own cache (the MTP layer's rows live beside the pool). A value the user set wins."""
    if KV_POOL_ENV in env or not plan.ranks:
        return env
    return {**env, KV_POOL_ENV: str(int(min(r.kv for r in plan.ranks) * share))}


def sequence_kv_share(model: str, kv_dtype: str) -> float:
    """The planned KV's part that the model's layers hold (the plan also counts the MTP layer's)."""
    return kv_per_token(model, kv_dtype, include_mtp=False) / kv_per_token(model, kv_dtype)


# ---- start -------------------------------------------------------------------------------------
def print_commands(config: LaneConfig, model: str, out: TextIO) -> None:
    print("DRY_RUN: nothing is started or changed. Commands, per node:", file=out)
    if API_KEYS_ENV in config.env:  # printed plans get pasted into tickets: no keys in them
        config = replace(config, env={**config.env, API_KEYS_ENV: "<hidden>"})
    for node in config.nodes:
        print(f"  {node.label}:", file=out)
        print(f"    preflight: {display(node_argv(node, config, commands.probe_command(config, model)))}", file=out)
        if not config.local:
            print(f"    prepare:   {display(node_argv(node, config, commands.prepare_command(config, commands.runtime_key())))}",
                  file=out)
    print("  start order: " + ", ".join(f"rank {n.rank}" for n in sorted(config.nodes, key=lambda n: -n.rank))
          + " (rank 0 last)", file=out)
    for node in sorted(config.nodes, key=lambda n: -n.rank):
        print(f"    start {node.label}: {display(node_argv(node, config, commands.rank_command(config, node, model)))}",
              file=out)
    for node in config.nodes:
        print(f"    stop {node.label}: {display(node_argv(node, config, commands.stop_command(config, node)))}", file=out)
    print(f"  supervisor: {sys.executable} -m launcher supervise {lane_dir(config)} (detached; logs and state there)",
          file=out)
    where = "" if config.nodes[0].is_local else f" on {config.nodes[0].host}, through an ssh tunnel"
    print(f"  readiness: GET {http_base(config)}/health{where}; then a smoke chat completion", file=out)


def start(config: LaneConfig, *, dry_run: bool, ready_timeout: float, out: TextIO = sys.stderr) -> int:
    run_dir = lane_dir(config)
    live = running_supervisor(run_dir)
    if live and not dry_run:
        raise LaneError(f"a lane already serves port {config.port} (supervisor pid {live['pid']}, {live['phase']}). "
                        f"Stop it (bash serve.sh stop --port {config.port}) or replace it (bash serve.sh restart ...)",
                        EXIT_BUSY)
    model = model_path(config, dry_run)
    config, plan, problems = check(config, model, out, dry_run=dry_run)
    if dry_run:
        for p in problems:
            print("DRY_RUN would refuse: " + p, file=out)
        print_commands(config, model, out)
        return EXIT_OK
    if problems:
        for p in problems:
            err(p)
        code = EXIT_MEMORY if any(p.startswith("memory plan") for p in problems) else \
            EXIT_BUSY if any("is in use" in p for p in problems) else EXIT_PREFLIGHT
        return code
    return launch(config, model, run_dir, ready_timeout, out, plan)


def launch(config: LaneConfig, model: str, run_dir: Path, ready_timeout: float, out: TextIO,
           plan: MemoryPlan | None) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "lane.json").unlink(missing_ok=True)
    planned: dict[str, int] = {}
    for need in plan.ranks if plan else ():
        planned[need.node] = planned.get(need.node, 0) + need.need
    write_json(run_dir / "config.json", {"config": to_dict(config), "model": model, "ready_timeout": ready_timeout,
                                         "planned_bytes": planned})
    with open(run_dir / "supervisor.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "supervise", str(run_dir)], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=config.kit_dir)
    print(f"serve: starting {config.ranks} rank{'s' if config.ranks > 1 else ''} (highest first, rank 0 last); "
          f"logs in {run_dir}", file=out, flush=True)
    try:
        return follow(run_dir, proc, out)
    except KeyboardInterrupt:  # an interrupted start leaves nothing running behind
        err("serve: interrupted before READY: stopping the lane being started")
        stop(run_dir, out)
        return EXIT_START_FAILED


def follow(run_dir: Path, proc: subprocess.Popen, out: TextIO) -> int:
    """Print progress until READY (0) or failure (1, with the failing rank's log tail)."""
    last_line, last_print = "", 0.0
    while True:
        state = read_json(run_dir / "lane.json") or {}
        phase = state.get("phase", "starting")
        if state.get("ranks"):
            states = phase + " ".join(f"{r['rank']}:{r.get('state')}" for r in state["ranks"])
            line = " | ".join(f"rank {r['rank']} ({r['node']}): {r.get('state', '?')}"
                              + (f", {r['available_mib'] / 1024:.1f} GiB free" if r.get("available_mib", -1) >= 0 else "")
                              for r in state["ranks"])
            now = time.monotonic()
            if states != last_line or now - last_print > 10:  # on a change of state, else every 10 s
                print(f"[{state.get('elapsed_s', 0):7.1f}s] {phase}: {line}", file=out, flush=True)
                last_line, last_print = states, now
        if phase == "ready":
            print(state["message"], file=out, flush=True)
            print(f"serve: stop with: bash serve.sh stop --port {state['port']}", file=out, flush=True)
            return EXIT_OK
        if phase in ("failed", "stopped"):
            proc.wait(timeout=60)
            err(f"serve: {state.get('message') or 'the lane stopped'}")
            failed = [r for r in state.get("ranks", []) if r.get("exit") not in (None, 0, -15, 143)]
            for r in failed[:1] or state.get("ranks", [])[-1:]:
                err(f"--- last lines of rank {r['rank']}'s log ({r['log']}) ---\n{tail(Path(r['log']))}")
            return EXIT_START_FAILED
        if proc.poll() is not None:
            err(f"serve: the supervisor exited with {proc.returncode} before READY:\n{tail(run_dir / 'supervisor.log')}")
            return EXIT_START_FAILED
        time.sleep(0.3)


# ---- stop / restart / status ---------------------------------------------------------------------
def stop(run_dir: Path, out: TextIO = sys.stderr, timeout: float = DRAIN_TIMEOUT_S + 60) -> int:
    """SIGTERM to the supervisor, which stops the ranks (rank 0 drains first); SIGKILL after `timeout`."""
    state = read_json(run_dir / "lane.json")
    saved = read_json(run_dir / "config.json")
    if state and pid_alive(state.get("pid")):
        os.kill(state["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(state["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if pid_alive(state["pid"]):
            os.kill(state["pid"], signal.SIGKILL)
        final = read_json(run_dir / "lane.json") or {}
        print(f"serve: {final.get('message') or 'stopped'}", file=out)
    elif saved:  # no supervisor: make sure no rank outlived it
        config = from_dict(saved["config"])
        for node in config.nodes:
            run(node, config, commands.stop_command(config, node), timeout=15)
        print(f"serve: no supervisor was running on port {config.port}; any rank left was stopped. "
              f"Logs kept in {run_dir}", file=out)
    else:
        print(f"serve: no lane on this port ({run_dir} has no state); nothing to stop", file=out)
    return EXIT_OK


def planned_usage(run_dir: Path) -> dict[str, int]:
    """Memory a running lane will free when stopped, by node, from its saved plan."""
    saved = read_json(run_dir / "config.json") or {}
    return {host: int(b) for host, b in (saved.get("planned_bytes") or {}).items()}


def restart(config: LaneConfig, *, ready_timeout: float, out: TextIO = sys.stderr) -> int:
    """Check the new settings first (against memory the old lane will free); stop the old lane only
    when they pass."""
    run_dir = lane_dir(config)
    model = model_path(config, dry_run=False)
    old = running_supervisor(run_dir)
    freed = planned_usage(run_dir) if old else None
    config, plan, problems = check(config, model, out, freed=freed)
    if problems:
        for p in problems:
            err(p)
        err("serve: restart refused; the running lane (if any) was left as it was")
        return EXIT_MEMORY if any(p.startswith("memory plan") for p in problems) else EXIT_PREFLIGHT
    if old:
        stop(run_dir, out)
    return launch(config, model, run_dir, ready_timeout, out, plan)


def status(run_dir: Path, out: TextIO = sys.stdout) -> int:
    state = read_json(run_dir / "lane.json")
    if not state:
        print(f"no lane state in {run_dir}", file=out)
        return EXIT_START_FAILED
    alive = pid_alive(state.get("pid"))
    print(json.dumps({**state, "supervisor_alive": alive}, indent=1), file=out)
    return EXIT_OK if alive and state.get("phase") == "ready" else EXIT_START_FAILED
