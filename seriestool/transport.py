"""Where the upstream may come from, and a fast answer to "is it reachable at all?".

Allowed: https:// URLs; file:// URLs and local paths only when given explicitly (--repo).
Refused: ext::/fd:: and every other `transport::address` helper, ssh/git/http, scp-like
`host:path`, anything starting with '-' (option injection). git is additionally run with
protocol.allow=never plus an allow-list, so a redirect or submodule cannot widen this.
"""
from __future__ import annotations

import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ExitCode, SeriesToolError

PROBE_TIMEOUT_S = 3.0
_HELPER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::")


@dataclass(frozen=True)
class Source:
    """A validated upstream location: `spec` is what git is given."""

    spec: str
    kind: str  # "https" | "file" | "path"

    @property
    def is_remote(self) -> bool:
        return self.kind == "https"


def _refuse(spec: str, why: str) -> SeriesToolError:
    return SeriesToolError(ExitCode.USAGE, f"refusing upstream {spec!r}: {why}. Allowed: an "
                           "https:// URL, or (given explicitly with --repo) a local path or file:// URL")


def validate_source(spec: str, *, explicit: bool) -> Source:
    """Check an upstream spec; `explicit` is True only for --repo given on the command line."""
    if not spec or spec != spec.strip() or any(ord(c) < 32 or c == "\x7f" for c in spec):
        raise _refuse(spec, "empty, padded or containing control characters")
    if spec.startswith("-"):
        raise _refuse(spec, "looks like a command-line option")
    if _HELPER_RE.match(spec) or "::" in spec:
        raise _refuse(spec, "git remote-helper transports (ext::, fd::, ...) can run commands")
    lowered = spec.lower()
    if lowered.startswith("https://"):
        parts = urlsplit(spec)
        if not parts.hostname:
            raise _refuse(spec, "no host in the URL")
        return Source(spec, "https")
    if lowered.startswith("file://"):
        if not explicit:
            raise _refuse(spec, "file:// URLs are accepted only when given explicitly with --repo")
        return Source(spec, "file")
    if "://" in spec:
        raise _refuse(spec, f"the {spec.split('://', 1)[0]}:// transport is not allowed")
    if not explicit:
        raise _refuse(spec, "local paths are accepted only when given explicitly with --repo")
    head = spec.split("/", 1)[0]
    if ":" in head:
        raise _refuse(spec, "scp-like `host:path` means ssh to git; write ./path for a local "
                      "directory named with a colon")
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise SeriesToolError(ExitCode.USAGE, f"--repo {spec}: no such directory (a local clone "
                              "or bare mirror of the upstream)")
    return Source(str(path), "path")


def _proxy_for_https() -> str | None:
    for name in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the URL's host (or the https proxy) opens within the
    timeout; otherwise the reason. Bounds DNS too (it runs in a thread), so no network is
    detected in a few seconds instead of git's minutes-long connect timeouts."""
    target = _proxy_for_https() or url
    parts = urlsplit(target if "://" in target else f"http://{target}")
    host = parts.hostname
    if not host:
        return f"no host in {target!r}"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"bad port in {target!r}"
    result: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result.append(None)
        except OSError as exc:
            result.append(f"{host}:{port}: {exc.strerror or exc}")

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    if not result:
        return f"{host}:{port}: no answer within {timeout_s:.0f} s"
    return result[0]


def require_reachable(source: Source) -> None:
    """Fail in seconds, before anything is created, when an https upstream cannot be reached."""
    if not source.is_remote:
        return
    reason = probe(source.spec)
    if reason:
        raise SeriesToolError(ExitCode.UNREACHABLE, (
            f"upstream {source.spec} is unreachable ({reason}). Work offline with --repo PATH "
            "(a local clone or bare mirror of the upstream), or with --no-fetch when the workdir "
            "already holds the tag."))
