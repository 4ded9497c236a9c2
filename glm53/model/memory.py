"""What a rank's weights hold on the device: every tensor counted once (by storage), the packed EXL3
banks among them, and the linears decoded at load. The engine logs it at load and /health reports it,
beside the layout plan's bytes for the rank (the memory plan's figure)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from glm53.exl3.bank import Exl3Bank


def _storages(obj: Any, seen: set[int], found: dict[int, int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, Exl3Bank):
        for t in (obj.words, obj.scales, obj.table):
            _storages(t, seen, found)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _storages(item, seen, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _storages(item, seen, found)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            _storages(item, seen, found)


def resident_bytes(obj: Any) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` (weights, banks, derived views)."""
    found: dict[int, int] = {}
    _storages(obj, set(), found)
    return sum(found.values())


def weights_report(weights: Any, planned: int | None, workspace: int) -> dict[str, Any]:
    """The figures the load log and /health show: resident weight bytes (all of them), the packed EXL3
    banks' share, the linears decoded at load (name -> bytes), the kernels' reserved workspace, and the
    layout plan's bytes for this rank with the difference in percent."""
    resident = resident_bytes(weights)
    report: dict[str, Any] = {"weights_bytes": resident, "exl3_packed_bytes": weights.exl3_bytes,
                              "decoded_at_load": dict(weights.dense_from_exl3), "workspace_bytes": workspace}
    if planned:
        report.update(planned_bytes=planned, vs_plan_percent=round(100.0 * (resident - planned) / planned, 2))
    return report


def report_line(report: dict[str, Any]) -> str:
    gib = 1 << 30
    decoded = sum(report["decoded_at_load"].values())
    line = (f"glm53: weights resident {report['weights_bytes'] / gib:.3f} GiB (packed EXL3 "
            f"{report['exl3_packed_bytes'] / gib:.3f} GiB; decoded at load: {len(report['decoded_at_load'])} linears, "
            f"{decoded / gib:.3f} GiB), EXL3 workspace {report['workspace_bytes'] / gib:.3f} GiB")
    if "planned_bytes" in report:
        line += f"; the layout plan says {report['planned_bytes'] / gib:.3f} GiB ({report['vs_plan_percent']:+.2f}%)"
    return line
