"""The DFlash2 drafter manifest (drafter/MANIFEST.json): what to fetch, from where, under which
licence, and how to check what was fetched.

The weights may not be redistributed (see drafter/NOTICE): the fetcher downloads them for the
user. What was fetched is pinned into `<dir>/drafter.lock.json` and enforced from then on. When
the fetcher passes the hub's file metadata (`hub_files`), the lock holds the hub's record: its size
and LFS SHA-256 for large files (so `verify` hashes them against the hub, never against a damaged
download), and for small (git) files a local SHA-256 taken only after the file's git blob id
matched the hub's; a size or git blob id that disagrees with the hub is refused, not pinned.
Without hub metadata (the CLI's `pin`) the lock trusts the files on first use. Hashes the
manifest itself knows are always enforced.

CLI (for fetch_weights.sh --drafter):
    python -m drafter.manifest show             print repository, revision, patterns, licence (JSON)
    python -m drafter.manifest pin DIR [--commit SHA]   hash the fetched files into DIR/drafter.lock.json
    python -m drafter.manifest verify DIR       check DIR against the manifest and the lock
Exit codes: 0 ok; 1 files missing or not matching; 2 bad manifest, lock or usage.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glm53.atomic_json import write_json_atomic

MANIFEST_PATH = Path(__file__).with_name("MANIFEST.json")
LOCK_NAME = "drafter.lock.json"
PLACEHOLDER_PREFIX = "PLACEHOLDER"


class ManifestError(ValueError):
    """The manifest or a lock file is malformed."""


@dataclass(frozen=True)
class ExpectedFile:
    path: str
    sha256: str | None     # None: unknown until pinned
    size: int | None


@dataclass(frozen=True)
class DrafterManifest:
    name: str
    repository: str
    revision: str
    licence_spdx: str
    licence_url: str
    redistribution: bool
    allow_patterns: tuple[str, ...]
    files: tuple[ExpectedFile, ...]
    source: str = field(default=str(MANIFEST_PATH), compare=False)

    @property
    def revision_is_placeholder(self) -> bool:
        return self.revision.startswith(PLACEHOLDER_PREFIX)

    @property
    def fetch_revision(self) -> str:
        """What to ask the hub for: the pinned commit, or 'main' while the pin is a placeholder."""
        return "main" if self.revision_is_placeholder else self.revision

    def licence_notice(self) -> str:
        return (f"{self.repository} is licensed {self.licence_spdx} ({self.licence_url}): non-commercial use, "
                f"no derivatives, and it may not be redistributed. Fetching it accepts that licence for your own use.")


def load_manifest(path: str | Path | None = None) -> DrafterManifest:
    """Read and validate drafter/MANIFEST.json (or `path`)."""
    path = Path(path) if path else MANIFEST_PATH
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: drafter manifest not found") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None

    def need(obj: dict, key: str, kind: type, where: str):
        if key not in obj:
            raise ManifestError(f"{path}: field '{where}{key}' is missing")
        if not isinstance(obj[key], kind):
            raise ManifestError(f"{path}: field '{where}{key}' must be {kind.__name__}")
        return obj[key]

    revision = need(raw, "revision", str, "")
    if not (revision.startswith(PLACEHOLDER_PREFIX) or re.fullmatch(r"[0-9a-f]{40}", revision)):
        raise ManifestError(f"{path}: 'revision' must be a full 40-hex commit or start with {PLACEHOLDER_PREFIX}")
    repository = need(raw, "repository", str, "")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repository):
        raise ManifestError(f"{path}: 'repository' must look like owner/name, got {repository!r}")
    lic = need(raw, "licence", dict, "")
    files = []
    for i, entry in enumerate(need(raw, "files", list, "")):
        where = f"files[{i}]."
        if not isinstance(entry, dict):
            raise ManifestError(f"{path}: 'files[{i}]' must be an object")
        rel = need(entry, "path", str, where)
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ManifestError(f"{path}: '{where}path' must be relative inside the repository, got {rel!r}")
        sha = entry.get("sha256")
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise ManifestError(f"{path}: '{where}sha256' must be null or 64 lowercase hex digits")
        size = entry.get("size")
        if size is not None and not (isinstance(size, int) and size >= 0):
            raise ManifestError(f"{path}: '{where}size' must be null or a non-negative integer")
        files.append(ExpectedFile(rel, sha, size))
    return DrafterManifest(
        name=need(raw, "name", str, ""), repository=repository, revision=revision,
        licence_spdx=need(lic, "spdx", str, "licence."), licence_url=need(lic, "url", str, "licence."),
        redistribution=need(lic, "redistribution", bool, "licence."),
        allow_patterns=tuple(need(raw, "allow_patterns", list, "")), files=tuple(files), source=str(path))


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _atomic_json(path: Path, obj: dict) -> None:
    write_json_atomic(path, obj, indent=2, sort_keys=True)


def _fetched_files(directory: Path, manifest: DrafterManifest) -> list[str]:
    names = {f.path for f in manifest.files}
    names |= {p.relative_to(directory).as_posix() for p in directory.rglob("*.safetensors")}
    names |= {p.relative_to(directory).as_posix() for p in directory.glob("*.json") if p.name != LOCK_NAME}
    return sorted(names)


@dataclass(frozen=True)
class HubFile:
    """What the hub says one file of the fetched revision is (`model_info(files_metadata=True)`)."""
    size: int | None
    sha256: str | None = None   # LFS files: the hub's content hash
    blob_id: str | None = None  # git blob id (of the content for git files, of the pointer for LFS files)


class PinRefused(ValueError):
    """The fetched files do not match what the hub (or the manifest) says; nothing was pinned."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def git_blob_id(path: Path, chunk: int = 1 << 24) -> str:
    """git's object id of the file's content (sha1 over "blob <size>\\0" + content)."""
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hub_record(directory: Path, rel: str, hub: HubFile) -> tuple[dict | None, str | None]:
    """(lock entry, None) when the local file agrees with the hub's record, else (None, problem)."""
    p = directory / rel
    if not p.is_file():
        return None, f"{p}: missing, though the hub lists it (download incomplete; fetch again)"
    size = p.stat().st_size
    if hub.size is not None and size != hub.size:
        return None, f"{p}: size {size}, the hub says {hub.size} (incomplete or damaged download; fetch again)"
    if hub.sha256:  # LFS: the hub's hash is the record; `verify` hashes the file against it
        return {"sha256": hub.sha256, "size": size, "from": "hub"}, None
    if hub.blob_id and git_blob_id(p) != hub.blob_id:
        return None, f"{p}: content differs from the hub's (git blob id {hub.blob_id}); fetch again"
    return {"sha256": sha256_of(p), "size": size, "from": "hub-git" if hub.blob_id else "local"}, None


def pin(directory: str | Path, manifest: DrafterManifest | None = None, *, commit: str | None = None,
        hub_files: dict[str, HubFile] | None = None) -> dict:
    """Record the fetched files in DIR/drafter.lock.json (atomically) and return the lock.

    With `hub_files` (the hub's metadata for the fetched revision, already filtered by the
    manifest's allow_patterns) the lock holds the hub's sizes and hashes; a file whose size or git
    blob id disagrees is refused (PinRefused), LFS content is left to `verify` against the hub's
    SHA-256; without `hub_files` every fetched file is hashed as found (trust on first use).
    Manifest hashes that are known must match either way."""
    manifest = manifest or load_manifest()
    directory = Path(directory)
    problems = check_against_manifest(directory, manifest)
    files: dict[str, dict] = {}
    if hub_files is None:
        if problems:
            raise FileNotFoundError("\n".join(problems))
        for rel in _fetched_files(directory, manifest):
            p = directory / rel
            files[rel] = {"sha256": sha256_of(p), "size": p.stat().st_size, "from": "local"}
    else:
        unlisted = sorted({f.path for f in manifest.files} - set(hub_files))
        problems += [f"{manifest.source}: expects {rel}, which the hub's revision does not have" for rel in unlisted]
        for rel, hub in sorted(hub_files.items()):
            entry, problem = _hub_record(directory, rel, hub)
            if problem:
                problems.append(problem)
            else:
                files[rel] = entry
        if problems:
            raise PinRefused(problems)
    lock = {"repository": manifest.repository, "revision": commit or manifest.revision,
            "licence": manifest.licence_spdx, "files": files}
    _atomic_json(directory / LOCK_NAME, lock)
    return lock


def check_against_manifest(directory: Path, manifest: DrafterManifest) -> list[str]:
    """Problems with DIR against the manifest's known sizes and hashes (empty list: fine)."""
    problems = []
    for f in manifest.files:
        p = directory / f.path
        if not p.is_file():
            problems.append(f"{p}: missing (fetch it: bash fetch_weights.sh --drafter)")
            continue
        if f.size is not None and p.stat().st_size != f.size:
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {f.size} (incomplete download? fetch again)")
        elif f.sha256 is not None and sha256_of(p) != f.sha256:
            problems.append(f"{p}: sha256 differs from {manifest.source} (corrupt or another revision; fetch again)")
    return problems


def verify(directory: str | Path, manifest: DrafterManifest | None = None) -> list[str]:
    """Problems with DIR against the manifest and DIR/drafter.lock.json (empty list: fine)."""
    manifest = manifest or load_manifest()
    directory = Path(directory)
    problems = check_against_manifest(directory, manifest)
    lock_path = directory / LOCK_NAME
    if not lock_path.is_file():
        problems.append(f"{lock_path}: no lock file; run `python -m drafter.manifest pin {directory}` after fetching")
        return problems
    try:
        lock = json.loads(lock_path.read_text())
        entries = lock["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ManifestError(f"{lock_path}: malformed lock file ({e}); delete it and fetch again") from None
    if lock.get("repository") != manifest.repository:
        problems.append(f"{lock_path}: pinned for {lock.get('repository')!r}, manifest names {manifest.repository!r}")
    for rel, want in sorted(entries.items()):
        p = directory / rel
        if not p.is_file():
            problems.append(f"{p}: listed in {LOCK_NAME} but missing")
        elif p.stat().st_size != want.get("size"):
            problems.append(f"{p}: size {p.stat().st_size}, {LOCK_NAME} says {want.get('size')}")
        elif sha256_of(p) != want.get("sha256"):
            whose = "the hub's record" if want.get("from") == "hub" else "the hash pinned"
            problems.append(f"{p}: sha256 differs from {whose} in {LOCK_NAME} (corrupt or changed since it was "
                            "fetched; fetch again: bash fetch_weights.sh --drafter)")
    if not entries:
        problems.append(f"{lock_path}: lists no files; fetch again")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m drafter.manifest show | pin DIR [--commit SHA] | verify DIR"
    try:
        manifest = load_manifest()
        if argv[:1] == ["show"] and len(argv) == 1:
            out = asdict(manifest)
            out.update(fetch_revision=manifest.fetch_revision, revision_is_placeholder=manifest.revision_is_placeholder,
                       licence_notice=manifest.licence_notice())
            print(json.dumps(out, indent=2))
            return 0
        if argv[:1] == ["pin"] and len(argv) in (2, 4):
            commit = None
            if len(argv) == 4:
                if argv[2] != "--commit":
                    print(usage, file=sys.stderr)
                    return 2
                commit = argv[3]
            lock = pin(argv[1], manifest, commit=commit)
            print(f"pinned {len(lock['files'])} files in {Path(argv[1]) / LOCK_NAME}")
            return 0
        if argv[:1] == ["verify"] and len(argv) == 2:
            problems = verify(argv[1], manifest)
            for line in problems:
                print(line, file=sys.stderr)
            if not problems:
                print(f"{argv[1]}: drafter files complete and matching")
            return 1 if problems else 0
    except ManifestError as e:
        print(f"drafter.manifest: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PinRefused) as e:
        print(f"drafter.manifest: {e}", file=sys.stderr)
        return 1
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
