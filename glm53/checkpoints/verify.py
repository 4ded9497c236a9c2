"""Proving a checkpoint folder complete from headers alone (and, with `deep`, by SHA-256).

File-level problems (errors): index unreadable, a shard missing / truncated / an LFS pointer /
an invalid header, a size differing from the manifest, a tensor the index maps absent from its
shard, a tensor in two shards, a hash mismatch. Model-level problems: the tensors are not what the
config implies, by the rule of glm53/formats/checkpoint_rules.py (the one glm53.check() applies).
Warnings: shards or tensors the index does not know, index total_size off.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from glm53.formats.checkpoint_rules import MISMATCH, check_tensors, tensor_table
from glm53.config import ConfigError, Glm53Config
from glm53.formats.safetensors_header import ShardError, ShardHeader, TensorInfo, read_header
from .manifest import MANIFEST_NAME, Manifest

INDEX_NAME = "model.safetensors.index.json"
FETCH_HINT = "bash fetch_weights.sh"
_HASH_CHUNK = 8 << 20

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Finding:
    level: str  # "error" (file problem) | "model" (config/tensor set) | "warning"
    kind: str
    file: str | None
    message: str
    remedy: str = ""

    def text(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.message}" + (f"; {self.remedy}" if self.remedy else "")


@dataclass
class VerifyResult:
    model_dir: str
    findings: list[Finding] = field(default_factory=list)
    config: Glm53Config | None = None
    headers: dict[str, ShardHeader] = field(default_factory=dict)  # shard file name -> header
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor -> shard file name
    declared_total_size: int | None = None  # the index's metadata.total_size
    deep: dict[str, object] | None = None

    @property
    def file_errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def model_errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "model"]

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {n: t for h in self.headers.values() for n, t in h.tensors.items()}

    def add(self, level: str, kind: str, file: str | None, message: str, remedy: str = "") -> None:
        self.findings.append(Finding(level, kind, file, message, remedy))


def verify_checkpoint(
    model_dir: str | Path,
    *,
    manifest: Manifest | None = None,
    deep: bool = False,
    workers: int = 4,
    progress: Progress | None = None,
    check_model: bool = True,
) -> VerifyResult:
    """File checks always; with `check_model` also config.json and the tensor set it implies
    (off for checkpoints of other architectures, e.g. the drafter)."""
    root = Path(model_dir)
    result = VerifyResult(str(root))
    if not root.is_dir():
        result.add("error", "no_checkpoint", str(root), "is not a folder", f"fetch the checkpoint first: {FETCH_HINT} --dir {root}")
        return result
    expected_sizes = {p: r.size for p, r in manifest.files.items()} if manifest else {}
    if check_model:
        _check_config(root, result)
    shard_names = _read_index(root, result)
    for name in shard_names:
        try:
            result.headers[name] = read_header(root / name, expected_size=expected_sizes.get(name))
        except ShardError as exc:
            result.add("error", exc.kind, exc.path, exc.detail, exc.remedy)
    _check_manifest_files(root, manifest, shard_names, result)
    _check_index_against_shards(root, result)
    if result.config is not None:
        _check_model_tensors(result.config, root, result)
    if deep:
        result.deep = _deep_check(root, manifest, shard_names, result, workers, progress)
    return result


# ---- pieces ---------------------------------------------------------------------------------

def _check_config(root: Path, result: VerifyResult) -> None:
    try:
        result.config = Glm53Config.from_dir(root)
    except ConfigError as exc:
        missing = not (root / "config.json").exists()
        result.add("error" if missing else "model", "config", str(root / "config.json"), str(exc).split(": ", 1)[-1],
                   f"re-download it: {FETCH_HINT}" if missing else "this kit serves GLM-5.3 (glm_moe_dsa) checkpoints")


def _read_index(root: Path, result: VerifyResult) -> list[str]:
    """Shard file names the checkpoint consists of (from the index, or the folder when there is none)."""
    index_path = root / INDEX_NAME
    if not index_path.exists():
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if not shards:
            result.add("error", "no_weights", str(root), f"holds no {INDEX_NAME} and no *.safetensors", f"fetch the checkpoint: {FETCH_HINT} --dir {root}")
        elif len(shards) > 1:
            result.add("error", "index", str(index_path), f"is missing but there are {len(shards)} shards", f"re-download it: {FETCH_HINT}")
        return shards
    try:
        doc = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        result.add("error", "index", str(index_path), f"cannot be parsed ({exc})", f"re-download it: {FETCH_HINT}")
        return []
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        result.add("error", "index", str(index_path), "has no weight_map object of tensor -> shard file", f"re-download it: {FETCH_HINT}")
        return []
    bad = sorted({v for v in wm.values() if "/" in v or v.startswith(".")})
    if bad:
        result.add("error", "index", str(index_path), f"names shard files outside the folder: {bad[:3]}", f"re-download it: {FETCH_HINT}")
        return []
    result.weight_map = dict(wm)
    total = (doc.get("metadata") or {}).get("total_size") if isinstance(doc.get("metadata"), dict) else None
    if isinstance(total, int):
        result.declared_total_size = total
    return sorted(set(wm.values()))


def _check_manifest_files(root: Path, manifest: Manifest | None, shard_names: list[str], result: VerifyResult) -> None:
    """Non-shard files the hub listed (config, tokenizer, ...) must be present at the recorded size."""
    if manifest is None:
        return
    shards = set(shard_names)
    for path, rec in sorted(manifest.files.items()):
        if path in shards or path.startswith(".") or path == MANIFEST_NAME:
            continue
        local = root / path
        if not local.exists():
            result.add("error", "missing", str(local), "is missing (the hub lists it)", f"re-download: {FETCH_HINT}")
        elif rec.size is not None and local.is_file() and local.stat().st_size != rec.size:
            result.add("error", "size_mismatch", str(local), f"is {local.stat().st_size:,} bytes, the hub recorded {rec.size:,}", f"re-download: {FETCH_HINT}")
    for name in shard_names:
        if name not in manifest.files:
            result.add("warning", "not_in_manifest", str(root / name), "is named by the index but the hub's file list (manifest) does not have it")


def _check_index_against_shards(root: Path, result: VerifyResult) -> None:
    where: dict[str, str] = {}
    for shard, header in result.headers.items():
        for name in header.tensors:
            if name in where:
                result.add("error", "duplicate_tensor", str(root / shard), f"tensor '{name}' is also in {where[name]}", f"re-download: {FETCH_HINT}")
            else:
                where[name] = shard
    if not result.weight_map:
        return
    absent: dict[str, list[str]] = {}
    for name, shard in result.weight_map.items():
        if shard in result.headers and name not in result.headers[shard].tensors:
            absent.setdefault(shard, []).append(name)
    for shard, names in sorted(absent.items()):
        elsewhere = [f"{n} (found in {where[n]})" if n in where else n for n in names[:3]]
        result.add("error", "tensor_absent", str(root / shard), f"lacks {len(names)} tensor(s) the index maps to it: {', '.join(elsewhere)}",
                   f"the index and the shard disagree; re-download both: {FETCH_HINT}")
    unknown = sorted(n for n in where if n not in result.weight_map)
    if unknown:
        result.add("warning", "unknown_tensor", None, f"{len(unknown)} tensor(s) in shards are not in the index (unused): {', '.join(unknown[:3])}")
    named = set(result.weight_map.values())
    extra = sorted(p.name for p in root.glob("*.safetensors") if p.name not in named)
    if extra:
        result.add("warning", "unknown_shard", None, f"{len(extra)} *.safetensors file(s) the index does not name (ignored): {', '.join(extra[:3])}")
    declared = result.declared_total_size
    if declared is not None and len(result.headers) == len(named):
        actual = sum(t.nbytes for h in result.headers.values() for t in h.tensors.values())
        if actual != declared:
            result.add("warning", "total_size", str(root / INDEX_NAME), f"metadata.total_size is {declared:,} but the shards hold {actual:,} tensor bytes")


# ---- model level ----------------------------------------------------------------------------

_LISTED_PER_KIND = 20  # findings of one kind listed one by one; the rest counted in one more


def _check_model_tensors(cfg: Glm53Config, root: Path, result: VerifyResult) -> None:
    """The shared rule (glm53/formats/checkpoint_rules.py) over the index's tensors: absent tensors grouped
    per layer, every other problem (shape, width, placement, parts) named with its shard."""
    where = result.weight_map or {n: shard for shard, h in result.headers.items() for n in h.tensors}
    headers = {str(root / shard): h for shard, h in result.headers.items()}
    table = tensor_table({n: root / shard for n, shard in where.items()}, headers)
    missing_by_layer: dict[int | None, list[str]] = {}
    listed: dict[str, int] = {}
    for problem in check_tensors(cfg, table, root):
        if problem.kind == "missing" and problem.file == str(root):
            missing_by_layer.setdefault(problem.layer, []).append(problem.tensor)
            continue
        listed[problem.kind] = listed.get(problem.kind, 0) + 1
        if listed[problem.kind] <= _LISTED_PER_KIND:
            result.add("model", problem.kind, problem.file, problem.detail, problem.remedy)
    for kind, n in listed.items():
        if n > _LISTED_PER_KIND:
            result.add("model", kind, None, f"{n - _LISTED_PER_KIND} more problem(s) of kind '{kind}' (not listed)")
    for layer, missing in sorted(missing_by_layer.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        what = "top level" if layer is None else f"layer {layer}"
        result.add("model", "tensors_missing", None, f"{what}: {len(missing)} tensor(s) the config needs are not in the checkpoint: {', '.join(missing[:4])}",
                   MISMATCH)
    present_layers = {int(m.group(1)) for n in table if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    beyond = sorted(i for i in present_layers if i >= cfg.num_hidden_layers + cfg.num_mtp_layers)
    if beyond:
        result.add("warning", "extra_layers", None, f"tensors for layers {beyond[:5]} beyond the config's {cfg.num_hidden_layers} (+{cfg.num_mtp_layers} MTP)")


# ---- deep -----------------------------------------------------------------------------------

class _Stopped(Exception):
    """Hashing abandoned because the run is being interrupted."""


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None, stop: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        while True:
            if stop is not None and stop.is_set():
                raise _Stopped(str(path))
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])  # releases the GIL: threads hash in parallel
            if on_bytes:
                on_bytes(n)
    return h.hexdigest()


def _deep_check(root: Path, manifest: Manifest | None, shard_names: list[str], result: VerifyResult,
                workers: int, progress: Progress | None) -> dict[str, object]:
    if manifest is None:
        result.add("error", "no_hashes", str(root / MANIFEST_NAME), "is missing, so --deep has no hashes to check against",
                   f"run {FETCH_HINT} online once (it records the hub's hashes and skips files already complete)")
        return {"checked": 0, "skipped": "no manifest"}
    todo: list[tuple[str, str]] = []
    for name in sorted(set(shard_names) | {p for p, r in manifest.files.items() if r.sha256}):
        rec = manifest.files.get(name)
        if rec is None or rec.sha256 is None:
            result.add("error", "no_hashes", str(root / name), "has no hub SHA-256 in the manifest", f"run {FETCH_HINT} online to refresh the manifest")
            continue
        if (root / name).is_file() and not any(f.file == str(root / name) and f.level == "error" for f in result.findings):
            todo.append((name, rec.sha256))
    total = sum((root / n).stat().st_size for n, _ in todo)
    done = [0]
    lock = threading.Lock()
    started = time.monotonic()
    last = [0.0]

    def tick(n: int) -> None:
        with lock:
            done[0] += n
            now = time.monotonic()
            if progress and (now - last[0] > 0.5 or done[0] == total):
                last[0] = now
                rate = done[0] / max(now - started, 1e-9)
                progress(f"deep: {done[0] / 2**30:8.2f} / {total / 2**30:.2f} GiB  {rate / 2**20:7.1f} MiB/s")

    stop = threading.Event()

    def one(item: tuple[str, str]) -> tuple[str, str, str]:
        name, want = item
        return name, want, sha256_file(root / name, tick, stop)

    mismatches = 0
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        for name, want, got in pool.map(one, todo):
            if got != want:
                mismatches += 1
                result.add("error", "hash_mismatch", str(root / name), f"SHA-256 {got[:16]}... differs from the hub's {want[:16]}...",
                           f"delete it and re-download: {FETCH_HINT}")
    except BaseException:
        stop.set()  # Ctrl-C: workers stop at their next chunk instead of finishing whole shards
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    seconds = time.monotonic() - started
    return {"checked": len(todo), "mismatches": mismatches, "bytes": total, "seconds": round(seconds, 3),
            "mib_per_s": round(total / 2**20 / seconds, 1) if seconds > 0 else None, "workers": workers}
