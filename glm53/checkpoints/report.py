"""The verification report: a summary users want before serving, findings, exit code; text and JSON.

Exit codes (also in fetch_weights.sh --help and docs/weights.md):
  0  the checkpoint is complete and valid (warnings may be printed)
  1  file problems: a shard/index/config missing, truncated, an LFS pointer, an invalid header,
     a size or hash differing from the hub's, or --deep without recorded hashes
  2  usage error (bad flags)
  3  model-level problems: the files are sound but the tensors do not match config.json
  4  no checkpoint to verify: offline or hub unreachable and no local copy; repo or revision
     not found; the download failed
  130 interrupted
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

from glm53.formats.checkpoint_rules import mtp_layers
from glm53.layout.plan import PlanError, plan_layouts
from .verify import VerifyResult

EXIT_OK = 0
EXIT_FILES = 1
EXIT_USAGE = 2
EXIT_MODEL = 3
EXIT_NO_CHECKPOINT = 4
EXIT_INTERRUPTED = 130

REPORT_RANKS = (3, 4)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.trellis$")


def exit_code(result: VerifyResult) -> int:
    if result.file_errors:
        return EXIT_FILES
    if result.model_errors:
        return EXIT_MODEL
    return EXIT_OK


def _k_label(words: int) -> str:
    k = words / 16
    return str(int(k)) if k.is_integer() else str(k)


def summarize(result: VerifyResult) -> dict[str, Any]:
    """Model, EXL3 codebooks and widths, bytes, bytes per rank: from headers only."""
    tensors = result.tensors
    names = set(tensors)
    summary: dict[str, Any] = {"tensors": len(tensors), "shards": len(result.headers)}
    summary["file_bytes"] = sum(h.file_size for h in result.headers.values())
    summary["tensor_bytes"] = sum(t.nbytes for t in tensors.values())
    cfg = result.config
    if cfg is not None:
        moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        full = sum(cfg.indexer_is_full(i) for i in range(cfg.num_hidden_layers))
        summary["model"] = {
            "model_type": "glm_moe_dsa", "layers": cfg.num_hidden_layers, "dense_layers": cfg.num_hidden_layers - moe,
            "moe_layers": moe, "mtp_layers": len(mtp_layers(cfg, names)), "indexer_full_layers": full,
            "indexer_shared_layers": cfg.num_hidden_layers - full, "routed_experts": cfg.n_routed_experts,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "quantization_config_bits": cfg.quantization_config.get("bits"),
        }
    codebooks: Counter[str] = Counter()
    expert_codebooks: Counter[str] = Counter()
    widths: dict[str, Counter[str]] = {p: Counter() for p in ("gate_proj", "up_proj", "down_proj")}
    expert_bits = expert_weights = 0
    for name, info in tensors.items():
        if not name.endswith(".trellis"):
            continue
        prefix = name[: -len(".trellis")]
        book = "mcg" if f"{prefix}.mcg" in names else "mul1" if f"{prefix}.mul1" in names else "3inst"
        codebooks[book] += 1
        m = _EXPERT.match(name)
        if m and len(info.shape) == 3:
            expert_codebooks[book] += 1
            widths[m.group(3)][_k_label(info.shape[-1])] += 1
            weights = info.shape[0] * info.shape[1] * 256
            expert_weights += weights
            expert_bits += weights * info.shape[-1] // 16
    summary["exl3"] = {
        "linears": sum(codebooks.values()),
        "codebooks": dict(sorted(codebooks.items())),
        "routed_expert_codebooks": dict(sorted(expert_codebooks.items())),
        "routed_expert_width_histogram": {p: dict(sorted(c.items(), key=lambda kv: float(kv[0]))) for p, c in widths.items()},
        "routed_expert_mean_bits": round(expert_bits / expert_weights, 3) if expert_weights else None,
    }
    summary["bytes_per_rank"] = {}
    if cfg is not None and tensors and not result.file_errors:
        try:
            plans = plan_layouts(tensors, REPORT_RANKS, cfg)
            summary["bytes_per_rank"] = {str(r): p.bytes_per_rank() for r, p in plans.items()}
        except PlanError as exc:
            summary["bytes_per_rank"] = {str(r): f"cannot plan: {exc}" for r in REPORT_RANKS}
    return summary


def build_report(result: VerifyResult, *, source: dict[str, Any] | None = None) -> dict[str, Any]:
    code = exit_code(result)
    status = {EXIT_OK: "ok", EXIT_FILES: "file_errors", EXIT_MODEL: "model_errors"}[code]
    return {
        "tool": "glm53.checkpoints verify",
        "model_dir": result.model_dir,
        "status": status,
        "exit_code": code,
        "source": source or {},
        "summary": summarize(result),
        "deep": result.deep,
        "findings": [f.__dict__ for f in result.findings],
    }


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def render_text(report: dict[str, Any]) -> str:
    """The human summary (stdout). Findings that are errors also go to stderr, by the caller."""
    s = report["summary"]
    lines = [f"checkpoint  {report['model_dir']}"]
    src = report.get("source") or {}
    if src.get("commit"):
        lines.append(f"source      {src['repo']} @ {src['commit']}" + ("" if src.get("online") else " (manifest; checked offline)"))
    elif src:
        lines.append("source      local folder without a manifest (not fetched by fetch_weights.sh): sizes and hashes unknown")
    m = s.get("model")
    if m:
        lines.append(f"model       {m['model_type']}: {m['layers']} layers ({m['dense_layers']} dense, {m['moe_layers']} MoE), "
                     f"{m['mtp_layers']} MTP; indexer {m['indexer_full_layers']} full / {m['indexer_shared_layers']} shared; "
                     f"{m['routed_experts']} routed experts")
    lines.append(f"files       {s['shards']} shards, {s['tensors']:,} tensors, {human_bytes(s['file_bytes'])}")
    ex = s["exl3"]
    if ex["linears"]:
        books = ", ".join(f"{k} x{v}" for k, v in ex["codebooks"].items())
        lines.append(f"EXL3        {ex['linears']:,} linears; codebooks: {books}")
        if ex["routed_expert_mean_bits"] is not None:
            lines.append(f"experts     mean {ex['routed_expert_mean_bits']} bits; width histogram (K: count)")
            for proj, hist in ex["routed_expert_width_histogram"].items():
                lines.append(f"  {proj:<10} " + "  ".join(f"{k}-bit: {v:,}" for k, v in hist.items()))
    for ranks, per in s.get("bytes_per_rank", {}).items():
        if isinstance(per, list):
            lines.append(f"{ranks} ranks     " + " / ".join(human_bytes(b) for b in per) + " of weights per rank")
        else:
            lines.append(f"{ranks} ranks     {per}")
    if report.get("deep"):
        d = report["deep"]
        lines.append(f"deep        {d.get('checked', 0)} files hashed, {d.get('mismatches', 0)} mismatches"
                     + (f", {d['mib_per_s']} MiB/s" if d.get("mib_per_s") else ""))
    for f in report["findings"]:
        if f["level"] == "warning":
            lines.append(f"warning     {(f['file'] + ': ') if f['file'] else ''}{f['message']}")
    verdict = {"ok": "OK: complete and valid", "file_errors": "FAILED: file problems (see errors)",
               "model_errors": "FAILED: tensors do not match config.json"}[report["status"]]
    lines.append(f"result      {verdict} (exit {report['exit_code']})")
    return "\n".join(lines)


def render_errors(report: dict[str, Any]) -> list[str]:
    out = []
    for f in report["findings"]:
        if f["level"] in ("error", "model"):
            where = f"{f['file']}: " if f["file"] else ""
            out.append(f"error: {where}{f['message']}" + (f"; {f['remedy']}" if f["remedy"] else ""))
    return out
