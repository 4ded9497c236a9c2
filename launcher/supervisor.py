"""The supervisor: starts the ranks (highest first, rank 0 last), follows their progress, says
READY when rank 0 answers and a smoke completion went through every rank, and stops the whole lane
when any rank dies (naming it) or when told to stop (SIGTERM).

It runs detached (`python -m launcher supervise RUN_DIR`) so that serve.sh can return; its state
is RUN_DIR/lane.json, each rank's output RUN_DIR/rankN.log (kept after stop).
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx

from glm53.serving.lane import DRAIN_TIMEOUT_S
from launcher.commands import alive_command, rank_command, stop_command
from launcher.config import LaneConfig, Node, api_keys
from launcher.nodes import node_argv, run, ssh_argv
from launcher.state import write_json

EXIT_RANK_DIED = 4
EXIT_NOT_READY = 5
EXIT_SMOKE_FAILED = 6
EXIT_CODES_EXPLAINED = {98: "its HTTP port is taken", 70: "the engine failed", 75: "the memory guard stopped it",
                        3: "glm53.dist: a peer died or failed", 4: "glm53.dist: a collective timed out",
                        5: "glm53.dist: rank 0's rendezvous store is unreachable",
                        255: "ssh lost the connection", -9: "killed (SIGKILL)", -15: "terminated (SIGTERM)",
                        137: "killed (SIGKILL)", 143: "terminated (SIGTERM)"}
CONSEQUENCES = (3, 4, 5)  # glm53.dist: the rank stopped because of a peer
SMOKE = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


WILDCARDS = ("0.0.0.0", "::", "")


def http_base(config: LaneConfig) -> str:
    """The lane's URL as clients on rank 0's node see it."""
    host = "127.0.0.1" if config.listen in WILDCARDS else config.listen
    return f"http://{host}:{config.port}"


def api_key_header(env: dict[str, str]) -> dict[str, str]:
    """The header that authorizes a request to the lane: its first API key, when it has any."""
    keys = api_keys(env)
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def lane_url(config: LaneConfig) -> str:
    node = config.nodes[0]
    return http_base(config) + ("" if node.is_local else f" on {node.host}")


class Tunnel:
    """An ssh port forward from this machine to rank 0's HTTP address on its node: readiness and
    the smoke completion reach a remote rank 0 that listens on its loopback (the default)."""

    def __init__(self, config: LaneConfig) -> None:
        node = config.nodes[0]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        target = "127.0.0.1" if config.listen in WILDCARDS else config.listen
        argv = ssh_argv(node, config) + ["-N", "-o", "ExitOnForwardFailure=yes",
                                         "-L", f"127.0.0.1:{self.port}:{target}:{config.port}"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class RankProcess:
    """One rank's ssh (or local bash) process, its log, and its last reported state."""

    def __init__(self, node: Node, argv: list[str], log_path: Path) -> None:
        self.node, self.log_path = node, log_path
        self.state: dict[str, Any] = {"rank": node.rank, "node": node.host, "state": "starting"}
        self._log: IO[str] = open(log_path, "a", buffering=1)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.died_at: float | None = None  # when the supervisor first saw it gone

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            if line.startswith("@state "):
                try:
                    self.state.update(json.loads(line[7:]))
                except json.JSONDecodeError:
                    pass
        self._log.flush()

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def close(self) -> None:
        self.reader.join(timeout=5)
        self._log.close()


class Supervisor:
    def __init__(self, config: LaneConfig, model: str, run_dir: Path, ready_timeout: float) -> None:
        self.config, self.model, self.run_dir, self.ready_timeout = config, model, run_dir, ready_timeout
        self.ranks: dict[int, RankProcess] = {}
        self.phase, self.message = "starting", ""
        self.t0 = time.monotonic()
        self.stop_requested = threading.Event()
        self.tunnel: Tunnel | None = None

    def reach(self) -> str:
        """Where this supervisor reaches rank 0's HTTP front (through ssh when rank 0 is remote)."""
        if self.config.nodes[0].is_local:
            return http_base(self.config)
        if self.tunnel is None or self.tunnel.proc.poll() is not None:
            self.tunnel = Tunnel(self.config)
        return self.tunnel.base

    def write_state(self) -> None:
        write_json(self.run_dir / "lane.json", {
            "pid": __import__("os").getpid(), "port": self.config.port, "phase": self.phase, "message": self.message,
            "url": lane_url(self.config), "elapsed_s": round(time.monotonic() - self.t0, 1),
            "ranks": [{**r.state, "exit": r.exit_code(), "log": str(r.log_path)} for _, r in sorted(self.ranks.items())]})

    def start_ranks(self) -> None:
        for node in sorted(self.config.nodes, key=lambda n: -n.rank):  # highest first, rank 0 last
            argv = node_argv(node, self.config, rank_command(self.config, node, self.model))
            self.ranks[node.rank] = RankProcess(node, argv, self.run_dir / f"rank{node.rank}.log")
            self.write_state()

    def dead_rank(self) -> RankProcess | None:
        """The rank whose death stops the lane: a rank that failed on its own comes before one that
        only followed a peer's failure (glm53.dist's exits 3/4/5), then the first seen, then rank order."""
        now = time.monotonic()
        dead = []
        for _, r in sorted(self.ranks.items()):
            if r.exit_code() is not None:
                r.died_at = r.died_at or now
                dead.append(r)
        if not dead:
            return None
        return min(dead, key=lambda r: (r.exit_code() in CONSEQUENCES, r.died_at, r.node.rank))

    def describe_death(self, r: RankProcess) -> str:
        code = r.exit_code()
        why = EXIT_CODES_EXPLAINED.get(code, "")
        if code == 255 and not r.node.is_local:  # ssh's own failure, or the remote rank killed by a signal
            probe = run(r.node, self.config, alive_command(self.config, r.node), timeout=15)
            if probe.returncode == 0 and probe.stdout.strip() == "gone":
                why = "ssh reports 255: the rank process is gone, killed by a signal or crashed"
            elif probe.returncode == 0:
                why = "ssh lost the connection; the rank was still running and is being stopped"
        return (f"rank {r.node.rank} on {r.node.host} exited with code {code}{' (' + why + ')' if why else ''}; "
                f"the lane is stopped. Its log: {r.log_path}")

    def stop_all(self, drain: bool = False) -> None:
        """With `drain` (an orderly stop of a healthy lane) rank 0 goes first and alone: it finishes the
        requests in flight (up to DRAIN_TIMEOUT_S) while the followers still serve them, and its
        engine's close lets them return. Then every rank left gets SIGTERM; SIGKILL whatever outlives 10 s."""
        if drain and 0 in self.ranks:
            self.signal([self.ranks[0]], "TERM", DRAIN_TIMEOUT_S + 10.0)
        for signame, grace in (("TERM", 10.0), ("KILL", 5.0)):
            self.signal(list(self.ranks.values()), signame, grace)
        if self.tunnel is not None:
            self.tunnel.close()
        for r in self.ranks.values():
            if r.exit_code() is None:  # the remote kill failed: at least drop the ssh session
                r.proc.kill()
                r.proc.wait()
            r.close()

    def signal(self, ranks: list[RankProcess], signame: str, grace: float) -> None:
        """Send SIGTERM or SIGKILL to those of `ranks` still running; wait up to `grace` s for them to end."""
        live = [r for r in sorted(ranks, key=lambda r: r.node.rank) if r.exit_code() is None]
        for r in live:
            if r.node.is_local:
                try:
                    r.proc.send_signal(signal.SIGTERM if signame == "TERM" else signal.SIGKILL)
                except ProcessLookupError:
                    pass
            else:
                run(r.node, self.config, stop_command(self.config, r.node, signame, grace), timeout=grace + 5)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(r.exit_code() is None for r in live):
            time.sleep(0.1)

    def wait_ready(self) -> int:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.stop_requested.is_set():
                return 0
            dead = self.dead_rank()
            if dead:
                self.phase, self.message = "failed", self.describe_death(dead)
                return EXIT_RANK_DIED
            base = self.reach()
            try:
                health = httpx.get(base + "/health", timeout=2)
                if health.status_code == 200 and health.json().get("status") == "ok":
                    return self.smoke(base)
            except httpx.HTTPError:
                pass
            self.phase = "loading"
            self.write_state()
            time.sleep(0.3)
        self.phase = "failed"
        self.message = f"rank 0 did not answer {lane_url(self.config)} /health within {self.ready_timeout:.0f} s"
        return EXIT_NOT_READY

    def smoke(self, base: str) -> int:
        self.phase = "smoke"
        self.write_state()
        try:
            r = httpx.post(base + "/v1/chat/completions", json={**SMOKE, "model": self.config.served_model},
                           headers=api_key_header(self.config.env), timeout=max(60.0, self.ready_timeout / 4))
            body = r.json()
            ok = r.status_code == 200 and body["usage"]["completion_tokens"] > 0
            detail = f"HTTP {r.status_code}: {r.text[:300]}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            dead = self.dead_rank()
            self.phase = "failed"
            self.message = self.describe_death(dead) if dead else f"the smoke completion through all ranks failed: {detail}"
            return EXIT_RANK_DIED if dead else EXIT_SMOKE_FAILED
        self.phase = "ready"
        self.message = (f"READY: {self.config.served_model} on {lane_url(self.config)} ({self.config.ranks} rank"
                        f"{'s' if self.config.ranks > 1 else ''}); smoke completion: "
                        f"{body['usage']['completion_tokens']} tokens, finish {body['choices'][0]['finish_reason']}")
        return 0

    def serve(self) -> int:
        try:
            return self._serve()
        except BaseException as exc:  # the supervisor itself failed: never leave ranks behind
            print(f"supervisor: {type(exc).__name__}: {exc}; stopping every rank", file=sys.stderr, flush=True)
            self.stop_all()
            raise

    def _serve(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop_requested.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_requested.set())
        self.start_ranks()
        code = self.wait_ready()
        self.write_state()
        while code == 0 and not self.stop_requested.wait(0.2):
            dead = self.dead_rank()
            if dead:
                self.phase, self.message, code = "failed", self.describe_death(dead), EXIT_RANK_DIED
            if int(time.monotonic() - self.t0) % 5 == 0 or code:
                self.write_state()
        if code == 0:
            self.phase, self.message = "stopping", "stopping on request"
        self.write_state()
        self.stop_all(drain=code == 0)
        if code == 0:
            self.phase, self.message = "stopped", "stopped on request; logs kept in " + str(self.run_dir)
        self.write_state()
        print(self.message, file=sys.stderr, flush=True)
        return code
