"""Running a command on a node: through ssh in batch mode, or directly for the local node."""
from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass

from launcher.config import LaneConfig, Node

SSH_CONNECT_TIMEOUT_S = 5


def ssh_argv(node: Node, config: LaneConfig) -> list[str]:
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-p", str(node.ssh_port)]
    if node.identity:
        argv += ["-i", node.identity, "-o", "IdentitiesOnly=yes"]
    argv += list(config.ssh_options)
    argv.append(f"{node.user}@{node.host}" if node.user else node.host)
    return argv


def node_argv(node: Node, config: LaneConfig, command: str) -> list[str]:
    """argv that runs the shell `command` on `node`."""
    if node.is_local:
        return ["bash", "-c", command]
    return ssh_argv(node, config) + ["--", command]


def display(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


@dataclass
class Result:
    node: Node
    returncode: int
    stdout: str
    stderr: str


def run(node: Node, config: LaneConfig, command: str, timeout: float = 60) -> Result:
    try:
        p = subprocess.run(node_argv(node, config, command), capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        return Result(node, p.returncode, p.stdout, p.stderr)
    except subprocess.TimeoutExpired:
        return Result(node, 124, "", f"timed out after {timeout:.0f} s")


def ssh_failure(result: Result) -> str | None:
    """Name an ssh failure (exit 255) and its fix; None when ssh itself worked."""
    node = result.node
    if node.is_local or result.returncode != 255:
        return None
    err = result.stderr.strip().splitlines()
    last = err[-1] if err else "ssh exited with 255"
    dest = f"{node.user + '@' if node.user else ''}{node.host}:{node.ssh_port}"
    if "Permission denied" in result.stderr or "Too many authentication failures" in result.stderr:
        return (f"{node.label}: ssh to {dest} refused the key ({last}). Fix: install your public key on that "
                f"node (ssh-copy-id -p {node.ssh_port} {dest}) or set identity: in the cluster file")
    if "Host key verification failed" in result.stderr or "REMOTE HOST IDENTIFICATION" in result.stderr:
        return (f"{node.label}: ssh to {dest}: host key not trusted ({last}). Fix: ssh {dest} once by hand "
                f"to accept its key, or add it to known_hosts")
    return (f"{node.label}: cannot reach {dest} by ssh ({last}). Fix: check the node is up, the host name "
            f"and ssh_port in the cluster file, and that sshd runs there")
