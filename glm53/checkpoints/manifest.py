"""The download manifest: what the hub said each file is, kept beside the checkpoint.

Written at download time (before any file arrives, so an interrupted download keeps it) from the
hub's file metadata: size, git blob id, and for LFS files the SHA-256 the hub recorded. A later
`--deep` check, offline, hashes the local files against it; the plain check uses its sizes.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm53.atomic_json import write_json_atomic

MANIFEST_NAME = "glm53-manifest.json"
MANIFEST_FORMAT = 1


class ManifestError(ValueError):
    """A manifest file that cannot be read; the message names it and the remedy."""


@dataclass(frozen=True)
class FileRecord:
    size: int | None
    sha256: str | None = None  # LFS files only: the hub's content hash
    blob_id: str | None = None  # git blob id (of the pointer, for LFS files)


@dataclass
class Manifest:
    repo: str
    revision: str  # as asked for (branch, tag or commit)
    commit: str | None  # the commit it resolved to
    endpoint: str
    files: dict[str, FileRecord] = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["format"] = MANIFEST_FORMAT
        return doc

    @classmethod
    def from_json(cls, doc: Any, source: str) -> "Manifest":
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), dict):
            raise ManifestError(f"{source}: not a format-{MANIFEST_FORMAT} manifest; delete it and run bash fetch_weights.sh online to rewrite it")
        try:
            files = {path: FileRecord(rec.get("size"), rec.get("sha256"), rec.get("blob_id")) for path, rec in doc["files"].items()}
            return cls(str(doc["repo"]), str(doc["revision"]), doc.get("commit"), str(doc.get("endpoint", "")), files, str(doc.get("created", "")))
        except (KeyError, AttributeError, TypeError) as exc:
            raise ManifestError(f"{source}: malformed manifest ({exc}); delete it and run bash fetch_weights.sh online") from None


def load_manifest(model_dir: str | Path) -> Manifest | None:
    path = Path(model_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc.msg}); delete it and run bash fetch_weights.sh online to rewrite it") from None
    return Manifest.from_json(doc, str(path))


def save_manifest(model_dir: str | Path, manifest: Manifest) -> Path:
    path = Path(model_dir) / MANIFEST_NAME
    write_json_atomic(path, manifest.to_json())
    return path


def manifest_from_model_info(info: Any, repo: str, revision: str, endpoint: str) -> Manifest:
    """From `HfApi.model_info(..., files_metadata=True)`: per-file size, blob id, LFS sha256."""
    files: dict[str, FileRecord] = {}
    for sib in info.siblings or []:
        lfs = getattr(sib, "lfs", None)
        sha = None
        size = sib.size
        if lfs is not None:
            sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
            lfs_size = lfs.get("size") if isinstance(lfs, dict) else getattr(lfs, "size", None)
            size = lfs_size if lfs_size is not None else size
        files[sib.rfilename] = FileRecord(size, sha, getattr(sib, "blob_id", None))
    return Manifest(repo, revision, info.sha, endpoint, files)
