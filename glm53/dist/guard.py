"""Failure detection for a group of ranks: a dead or stuck peer stops the lane within seconds.

torch.distributed alone cannot promise that: a gloo collective whose peer was SIGKILLed may error
with a message naming only a socket, or block until its timeout; an NCCL collective blocks on the
GPU. So each rank runs a small side channel over the rendezvous TCPStore:

- a heartbeat thread writes ``hb/<rank> = "<beat>:<seq>"`` every ``heartbeat_s`` seconds (``seq``
  is the number of collectives this rank has entered), and reads every peer's value;
- a peer whose value has not changed for ``dead_after_s`` is dead; a peer that wrote
  ``failed:<reason>`` failed and says why; a store that cannot be reached means its host (rank 0,
  or torchrun's agent next to it) is gone;
- a collective running longer than ``collective_timeout_s`` is stuck; the peers whose ``seq`` is
  behind ours are the ones that never reached it, and the message names them.

On failure the guard writes one line naming the peer to stderr and ends the process with a
documented exit code (``on_failure`` replaces that, e.g. for an engine that must clean up first).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from glm53.settings import Settings

# Exit codes of a rank stopped by the guard (documented for the launcher).
EXIT_PEER_FAILED = 3  # a peer died, stopped answering, or reported a failure
EXIT_COLLECTIVE_TIMEOUT = 4  # a collective did not complete in time (some peer never reached it)
EXIT_STORE_LOST = 5  # the rendezvous store (hosted with rank 0) is unreachable

KEY_PREFIX = "glm53/hb/"


class DistFailure(RuntimeError):
    """The group cannot continue; the message names the peer (rank) and what happened."""


@dataclass(frozen=True)
class GuardSettings:
    """The guard's timings (defaults: Settings'); a rendezvous without them uses these defaults."""

    heartbeat_s: float = 0.5
    dead_after_s: float = 4.0
    collective_timeout_s: float = 120.0

    @classmethod
    def from_settings(cls, settings: "Settings") -> "GuardSettings":
        """TF_GLM53_HEARTBEAT_S, TF_GLM53_DEAD_AFTER_S, TF_GLM53_COLLECTIVE_TIMEOUT_S (glm53/settings.py)."""
        return cls(heartbeat_s=settings.heartbeat_s, dead_after_s=settings.dead_after_s,
                   collective_timeout_s=settings.collective_timeout_s)


def heartbeat_key(rank: int) -> str:
    return f"{KEY_PREFIX}{rank}"


def exit_process(message: str, code: int) -> None:
    """Default failure action: one line on stderr, then end the process without running cleanups
    that could block on the dead peer (a collective still in flight, atexit handlers)."""
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


class Guard:
    """Heartbeat + collective watchdog for one rank. ``start()`` after rendezvous, ``stop()`` on
    orderly shutdown (tells peers this rank is leaving, so its silence is not a death)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        settings: GuardSettings = GuardSettings(),
        on_failure: Callable[[str, int], None] = exit_process,
        hosts_store: bool = False,
    ) -> None:
        self.host, self.port = host, port
        self.rank, self.world_size = rank, world_size
        self.settings = settings
        self.on_failure = on_failure
        # The store host's exit takes the store down; it lingers so peers can read its reason first.
        self.linger_s = 3 * settings.heartbeat_s if hosts_store else 0.0
        self.failure: str | None = None
        self._seq = 0
        self._op: tuple[str, int, float] | None = None  # (name, seq, start) of the collective in flight
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._handled = threading.Event()
        self._reported = False
        self._thread: threading.Thread | None = None
        self._store: dist.TCPStore | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        # Its own client connection: the main thread's store may be busy inside a collective.
        self._store = dist.TCPStore(
            self.host, self.port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=self.settings.dead_after_s),
        )
        self._thread = threading.Thread(target=self._run, name=f"glm53-guard-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Orderly leave: peers stop watching this rank; this rank stops watching them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.heartbeat_s * 4 + self.settings.dead_after_s)
            self._thread = None
        if self._store is not None and self.failure is None:
            with contextlib.suppress(Exception):
                self._store.set(heartbeat_key(self.rank), "bye")
        self._store = None

    def report_failure(self, reason: str) -> None:
        """Tell the peers this rank is failing (best effort), so their message carries the reason."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(heartbeat_key(self.rank), "failed:" + reason.replace("\n", " ")[:500])

    # ---- collectives ---------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Wrap one collective: the watchdog times it, and an error inside it is turned into a
        failure that names the peer (waiting briefly for the heartbeat to tell which one)."""
        if self.failure is not None:
            raise DistFailure(self.failure)
        self._seq += 1
        self._op = (name, self._seq, time.monotonic())
        try:
            yield
        except Exception as exc:  # the backend noticed first (e.g. gloo: connection closed by peer)
            self._op = None
            self._explain(name, exc)
            raise
        finally:
            self._op = None

    def _explain(self, name: str, exc: Exception) -> None:
        # Give the heartbeat thread time to see which peer went silent; it reports and exits.
        self._failed.wait(self.settings.dead_after_s + 3 * self.settings.heartbeat_s)
        message = self.failure or (
            f"glm53.dist: rank {self.rank}: collective '{name}' #{self._seq} failed and no peer was "
            f"found dead or late: {type(exc).__name__}: {exc}"
        )
        self._fail(message, EXIT_PEER_FAILED, from_main=True)
        raise DistFailure(message) from exc

    # ---- the heartbeat thread ------------------------------------------------------------
    def _run(self) -> None:
        assert self._store is not None
        peers = [r for r in range(self.world_size) if r != self.rank]
        keys = [heartbeat_key(r) for r in peers]
        last: dict[int, str] = {}
        changed: dict[int, float] = {r: time.monotonic() for r in peers}
        gone: set[int] = set()
        beat = 0
        while not self._stop.is_set():
            beat += 1
            now = time.monotonic()
            try:
                self._store.set(heartbeat_key(self.rank), f"{beat}:{self._seq}")
                values = [v.decode() for v in self._store.multi_get(keys)] if keys else []
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._fail(
                    f"glm53.dist: rank {self.rank}: the rendezvous store at {self.host}:{self.port} "
                    f"(hosted with rank 0) is unreachable, so rank 0 is presumed dead: {exc}",
                    EXIT_STORE_LOST,
                )
                return
            now = time.monotonic()
            for peer, value in zip(peers, values):
                if peer in gone:
                    continue
                if value == "bye":
                    gone.add(peer)
                    continue
                if value.startswith("failed:"):
                    self._fail(
                        f"glm53.dist: rank {self.rank}: rank {peer} failed: {value[len('failed:'):]}",
                        EXIT_PEER_FAILED,
                    )
                    return
                if value != last.get(peer):
                    last[peer] = value
                    changed[peer] = now
                elif now - changed[peer] > self.settings.dead_after_s:
                    self._fail(
                        f"glm53.dist: rank {self.rank}: rank {peer} stopped responding (no heartbeat for "
                        f"{now - changed[peer]:.1f} s): the process died or its machine is unreachable",
                        EXIT_PEER_FAILED,
                    )
                    return
            op = self._op
            if op is not None and now - op[2] > self.settings.collective_timeout_s:
                name, seq, _ = op
                behind = [p for p, v in zip(peers, values) if _seq_of(v) < seq]
                who = f"ranks {behind} never reached it" if behind else "every rank reached it"
                self._fail(
                    f"glm53.dist: rank {self.rank}: collective '{name}' #{seq} timed out after "
                    f"{now - op[2]:.1f} s; {who}",
                    EXIT_COLLECTIVE_TIMEOUT,
                )
                return
            self._stop.wait(self.settings.heartbeat_s)

    def _fail(self, message: str, code: int, from_main: bool = False) -> None:
        with self._lock:  # one report per process, whichever thread sees the failure first
            first = not self._reported
            self._reported = True
            if first:
                self.failure = message
        if not first:
            if from_main:  # the guard thread is ending the process: do not race it with a traceback
                self._handled.wait(self.linger_s + 10.0)
            return
        self._failed.set()
        self.report_failure(message)
        time.sleep(self.linger_s)
        self.on_failure(message, code)
        self._handled.set()  # reached only when on_failure returns instead of exiting


def _seq_of(value: str) -> int:
    """The collective count in a heartbeat value ("beat:seq"); unknown values count as not behind."""
    try:
        return int(value.split(":", 1)[1])
    except (IndexError, ValueError):
        return 1 << 62
