"""Rendezvous of R ranks at rank 0's address and port, then a guarded process group.

Two ways in, one result (a `Comm`):
- the family contract: ``rendezvous(RendezvousSpec(rank, world_size, master, master_port))``;
- a torchrun environment: ``rendezvous(spec_from_env())`` (MASTER_ADDR, MASTER_PORT, RANK,
  WORLD_SIZE; under torchrun's agent store every rank is a store client).

Rank 0 hosts a TCPStore at master:master_port; each rank announces itself there (its first
heartbeat) and waits for all others, so a rank that never arrives is named after the timeout,
and a rank 0 that is not there is reported with the address tried. Backend: NCCL when the
rank's device is CUDA, gloo otherwise (`backend=`: Settings.dist_backend, TF_GLM53_DIST_BACKEND).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from glm53.dist.collectives import Comm
from glm53.dist.guard import DistFailure, Guard, GuardSettings, exit_process, heartbeat_key

DEFAULT_MASTER_PORT = 29551  # TensorFold's --master-port default


class RendezvousError(DistFailure):
    """Rendezvous failed; the message names the address, the missing ranks and the remedy."""


@dataclass(frozen=True)
class RendezvousSpec:
    rank: int
    world_size: int
    master: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    timeout_s: float = 120.0  # how long to wait for every rank to arrive
    agent_store: bool = False  # torchrun's agent already hosts the store at master_port

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise RendezvousError(f"world size {self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise RendezvousError(f"rank {self.rank} is outside 0..{self.world_size - 1} (world size {self.world_size})")
        if not 0 < self.master_port < 65536:
            raise RendezvousError(f"master port {self.master_port} is not a TCP port (1..65535)")


def spec_from_env(env: dict[str, str] | None = None, timeout_s: float = 120.0) -> RendezvousSpec:
    """A torchrun-style environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE."""
    env = os.environ if env is None else env
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not env.get(k)]
    if missing:
        raise RendezvousError(
            f"environment lacks {', '.join(missing)}; start the ranks with torchrun or pass master/master_port"
        )
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError:
        raise RendezvousError(
            f"RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r}, MASTER_PORT={env['MASTER_PORT']!r} must be integers"
        ) from None
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return RendezvousSpec(rank, world, env["MASTER_ADDR"], port, timeout_s, agent_store=agent)


def choose_backend(device: torch.device, forced: str | None = None) -> str:
    if forced:
        if forced not in ("nccl", "gloo"):
            raise RendezvousError(f"backend {forced!r}: use 'nccl' or 'gloo'")
        return forced
    return "nccl" if device.type == "cuda" else "gloo"


def rendezvous(
    spec: RendezvousSpec,
    device: torch.device | str = "cpu",
    settings: GuardSettings | None = None,
    on_failure=exit_process,
    backend: str | None = None,
) -> Comm:
    """Join the group and return its guarded collectives. Raises RendezvousError naming what is missing.
    `settings` (default GuardSettings()) and `backend` (None: by device) come from the caller's
    glm53.settings.Settings (GuardSettings.from_settings, Settings.dist_backend)."""
    device = torch.device(device)
    settings = settings or GuardSettings()
    store = _connect_store(spec)
    _announce_and_wait(store, spec)
    backend = choose_backend(device, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("glm53/pg", store),
        rank=spec.rank,
        world_size=spec.world_size,
        # later than the guard's own timeout, so the guard (which names the late ranks) speaks first
        timeout=timedelta(seconds=settings.collective_timeout_s + settings.dead_after_s + 5.0),
        device_id=device if backend == "nccl" else None,
    )
    guard = Guard(spec.master, spec.master_port, spec.rank, spec.world_size, settings, on_failure,
                  hosts_store=spec.rank == 0 and not spec.agent_store)
    guard.start()
    return Comm(spec.rank, spec.world_size, device, backend, guard, store)


def _connect_store(spec: RendezvousSpec) -> dist.TCPStore:
    host_it = spec.rank == 0 and not spec.agent_store
    where = f"{spec.master}:{spec.master_port}"
    try:
        return dist.TCPStore(
            spec.master, spec.master_port, world_size=None, is_master=host_it,
            timeout=timedelta(seconds=spec.timeout_s), wait_for_workers=False,
        )
    except Exception as exc:  # the message from c10d names neither our role nor the remedy
        if host_it:
            raise RendezvousError(
                f"rank 0 could not listen at {where} ({exc}); is the port taken by another lane? "
                "pick another --master-port"
            ) from None
        raise RendezvousError(
            f"rank {spec.rank} could not reach rank 0 at {where} within {spec.timeout_s:.0f} s ({exc}); "
            "is rank 0 started, is the address right, is the port open between the machines?"
        ) from None


def _announce_and_wait(store: dist.TCPStore, spec: RendezvousSpec) -> None:
    store.set(heartbeat_key(spec.rank), "0:0")
    deadline = time.monotonic() + spec.timeout_s
    waiting = set(range(spec.world_size))
    while True:
        try:
            waiting = {r for r in waiting if not store.check([heartbeat_key(r)])}
        except Exception as exc:  # rank 0 (the store) left, e.g. its own wait ran out first
            raise RendezvousError(
                f"rank {spec.rank}: ranks {sorted(waiting)} did not arrive at {spec.master}:{spec.master_port} "
                f"and rank 0's store closed while waiting ({type(exc).__name__}); start every rank or lower --tp"
            ) from None
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank {spec.rank}: ranks {sorted(waiting)} did not arrive at {spec.master}:{spec.master_port} "
                f"within {spec.timeout_s:.0f} s (world size {spec.world_size}); start them or lower --tp"
            )
        time.sleep(0.05)
