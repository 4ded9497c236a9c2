"""A real OpenSSH server on loopback for the launcher's tests: generated host and user keys, an
ssh client config that trusts only that host key. Skips (with the reason and the fix) where
sshd is not installed: CI needs `apt-get install -y openssh-server`."""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
SKIP_REASON = ("sshd is not installed here: the ssh launcher tests need a real OpenSSH server "
               "(apt-get install -y openssh-server; add it to .ci/run)")


@dataclass
class Sshd:
    port: int
    user: str
    key: Path  # authorized user key
    stranger_key: Path  # a key the server does not know
    client_config: Path  # -F file: known_hosts with the generated host key, batch mode
    proc: subprocess.Popen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start_sshd(tmp: Path) -> Sshd:
    if SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip(SKIP_REASON)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    tmp.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp, 0o700)
    for name in ("host_key", "user_key", "stranger_key"):
        _keygen(tmp / name)
    (tmp / "authorized_keys").write_text((tmp / "user_key.pub").read_text())
    os.chmod(tmp / "authorized_keys", 0o600)
    port = _free_port()
    (tmp / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp / 'host_key'}\nPidFile {tmp / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n"
        f"LogLevel ERROR\n")
    host_pub = (tmp / "host_key.pub").read_text().split()
    (tmp / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    (tmp / "ssh_config").write_text(
        f"Host *\n  UserKnownHostsFile {tmp / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
        f"  GlobalKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "sshd.log", "w"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(tmp / 'sshd.log').read_text()}")
            time.sleep(0.05)
    return Sshd(port, getpass.getuser(), tmp / "user_key", tmp / "stranger_key", tmp / "ssh_config", proc)


def stop_sshd(sshd: Sshd) -> None:
    sshd.proc.terminate()
    try:
        sshd.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        sshd.proc.kill()
        sshd.proc.wait()
