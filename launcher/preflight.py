"""Preflight: ask every node, in parallel, whether it can run its rank; each failure names the
node and the fix."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from launcher.commands import probe_command, runtime_key
from launcher.config import LaneConfig, Node
from glm53.serving.meminfo import GIB
from launcher.nodes import run, ssh_failure

MIN_DISK_FREE = 2 * GIB  # logs and pid files; the weights are checked by fetch_weights.sh


@dataclass
class Preflight:
    probes: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def probe_node(node: Node, config: LaneConfig, model: str, timeout: float = 60) -> tuple[dict[str, Any] | None, str | None]:
    result = run(node, config, probe_command(config, model), timeout=timeout)
    failure = ssh_failure(result)
    if failure:
        return None, failure
    if result.returncode != 0:
        tail = " | ".join(result.stderr.strip().splitlines()[-3:])
        if result.returncode == 127 or "No such file" in result.stderr or "No module named" in result.stderr:
            return None, (f"{node.label}: the runtime is not ready ({tail}). Fix: python -m launcher prepare "
                          f"--cluster {config.source}")
        return None, f"{node.label}: probe failed with exit {result.returncode}: {tail}"
    try:
        return json.loads(result.stdout.strip().splitlines()[-1]), None
    except (json.JSONDecodeError, IndexError):
        return None, f"{node.label}: probe printed no JSON: {result.stdout[-200:]!r}"


def preflight(config: LaneConfig, model: str, local_commit: str | None, check_runtime_key: bool = True,
              model_expected: bool = True) -> Preflight:
    report = Preflight()
    with ThreadPoolExecutor(max_workers=max(1, config.ranks)) as pool:
        futures = {node.rank: pool.submit(probe_node, node, config, model) for node in config.nodes}
    for node in config.nodes:
        probe, failure = futures[node.rank].result()
        if failure:
            report.failures.append(failure)
            continue
        assert probe is not None
        report.probes[node.rank] = probe
        if config.device == "cuda" and not probe["gpus"]:
            report.failures.append(f"{node.label}: no GPU visible (nvidia-smi shows none). Fix: check the driver "
                                   f"and CUDA_VISIBLE_DEVICES there, or set device: cpu for a CPU lane")
        if model_expected and not probe["model_present"]:
            report.failures.append(f"{node.label}: {model}/config.json is missing. Fix: fetch the weights on that "
                                   f"node (bash fetch_weights.sh) at the same path")
        if probe["disk_free"] < MIN_DISK_FREE:
            report.failures.append(f"{node.label}: only {probe['disk_free'] / GIB:.1f} GiB free under {config.kit_dir}."
                                   f" Fix: free at least {MIN_DISK_FREE / GIB:.0f} GiB for logs")
        if probe["kit_version"] is None and not config.local:  # a local lane runs from this checkout
            report.failures.append(f"{node.label}: the kit is not installed in the runtime ({probe['python']}). "
                                   f"Fix: python -m launcher prepare --cluster {config.source}")
    _check_same(config, report, local_commit, check_runtime_key)
    return report


def _check_same(config: LaneConfig, report: Preflight, local_commit: str | None, check_runtime_key: bool) -> None:
    """The kit commit and version, the patched checkout and the runtime key must agree everywhere."""
    probes = report.probes
    if not probes:
        return
    want_key = runtime_key() if check_runtime_key and config.runtime.venv and config.workdir else None
    for rank, probe in sorted(probes.items()):
        node = config.nodes[rank]
        if local_commit and probe["kit_commit"] and probe["kit_commit"] != local_commit:
            report.failures.append(f"{node.label}: kit checkout at {probe['kit_commit'][:12]}, this machine at "
                                   f"{local_commit[:12]}. Fix: git -C {config.kit_dir} fetch && git -C {config.kit_dir} "
                                   f"checkout {local_commit} on that node")
        if want_key and probe["runtime_key"] != want_key:
            report.failures.append(f"{node.label}: runtime key {probe['runtime_key'] or 'absent'} != {want_key} "
                                   f"(series, patches, kit version). Fix: python -m launcher prepare --cluster {config.source}")
    for name in ("kit_version", "workdir_commit"):
        values = {probe[name] for probe in probes.values()}
        if len(values) > 1:
            detail = ", ".join(f"rank {r}: {p[name]}" for r, p in sorted(probes.items()))
            report.failures.append(f"{name.replace('_', ' ')} differs across nodes ({detail}). Fix: python -m launcher "
                                   f"prepare --cluster {config.source}")
