"""Getting a checkpoint onto this machine (huggingface_hub), or finding the copy already here.

Online: the hub's file list with sizes and LFS SHA-256 (`model_info(files_metadata=True)`) is
written as the manifest first, then `snapshot_download` fetches (resumable, with progress; files
already complete are skipped), pinned to the commit the revision resolved to.
Offline (`--offline`, or the hub unreachable): the copy at `--dir`, or in the Hugging Face cache,
is used without any network; none there is a clear error (exit 4).

Revision: the default repo's revision is meant to be pinned in `PINNED_REVISIONS`. The real commit
of vcruz305/GLM-5.3-EXL3-3.38bpw is not known to the kit, so the entry is a placeholder (None):
without `--revision` the tool fetches `main`, warns, and records the commit `main` resolved to in
the manifest (so the download itself is pinned after the fact; pass that commit as `--revision` on
the other machines to get identical files).

The DFlash2 drafter (`fetch_drafter`) is driven by drafter/MANIFEST.json instead: its repository,
revision and allow_patterns; after the download its files are pinned against the hub's metadata
(drafter.manifest.pin) and re-hashed (drafter.manifest.verify). Accepting its licence is the
caller's job (glm53/checkpoints/__main__.py asks), before this is called.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from drafter.manifest import LOCK_NAME, HubFile, PinRefused, pin, verify
from drafter.manifest import load_manifest as load_drafter_manifest

from .manifest import Manifest, load_manifest, manifest_from_model_info, save_manifest

DEFAULT_REPO = "vcruz305/GLM-5.3-EXL3-3.38bpw"
# PLACEHOLDER: fill in the 40-hex commit once it can be looked up (huggingface.co/<repo>/commits/main).
# The drafter's revision lives in drafter/MANIFEST.json, not here.
PINNED_REVISIONS: dict[str, str | None] = {DEFAULT_REPO: None}


class FetchError(RuntimeError):
    """No checkpoint can be had (exit 4); the message says what to do."""


class HubDown(Exception):
    """The hub cannot be reached or answered 5xx: callers fall back to a local copy."""


@dataclass
class Obtained:
    model_dir: Path
    manifest: Manifest | None
    source: dict[str, Any]  # repo, revision, commit, online, endpoint


def resolve_revision(repo: str, revision: str | None, warn: Callable[[str], None]) -> str:
    if revision:
        return revision
    pinned = PINNED_REVISIONS.get(repo)
    if pinned:
        return pinned
    warn(f"no pinned revision for {repo} (placeholder in glm53/checkpoints/fetch.py): using 'main'; "
         "the commit it resolves to is recorded in the manifest; pass --revision <commit> to pin")
    return "main"


def _connectivity_errors() -> tuple[type[BaseException], ...]:
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for mod in ("httpx2", "httpx"):
        try:
            m = __import__(mod)
            errors += [m.ConnectError, m.TimeoutException, m.NetworkError, m.RemoteProtocolError]
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _has_weights(folder: Path) -> bool:
    return folder.is_dir() and ((folder / "model.safetensors.index.json").exists() or any(folder.glob("*.safetensors")))


def find_local_copy(repo: str, revision: str, local_dir: str | Path | None,
                    allow_patterns: list[str] | None = None) -> Path | None:
    """The copy at `local_dir`, else the cached snapshot for (repo, revision); no network.
    `allow_patterns` as at download time (the cache knows the whole tree; without them a partial
    snapshot counts as incomplete)."""
    if local_dir is not None:
        path = Path(local_dir)
        return path if _has_weights(path) else None
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=allow_patterns))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if _has_weights(path) else None


def use_local_copy(repo: str, revision: str, local_dir: str | Path | None, why: str) -> Obtained:
    path = find_local_copy(repo, revision, local_dir)
    if path is None:
        where = f"at {local_dir}" if local_dir is not None else f"in the Hugging Face cache ({_cache_dir()}) for {repo}@{revision}"
        raise FetchError(f"{why}, and there is no local copy {where}. Connect to the hub and run bash fetch_weights.sh"
                         + (f" --dir {local_dir}" if local_dir is not None else "")
                         + ", or pass --dir pointing at an existing copy (set HF_ENDPOINT for a mirror)")
    manifest = load_manifest(path)
    source = {"repo": repo, "revision": revision, "commit": manifest.commit if manifest else None, "online": False,
              "note": why}
    return Obtained(path, manifest, source)


def _cache_dir() -> str:
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _snapshot_dir(repo: str, commit: str) -> Path:
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub.file_download import repo_folder_name

    return Path(_cache_dir()) / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / commit


def hub_info(repo: str, revision: str, warn: Callable[[str], None]) -> tuple[Any, str]:
    """(`model_info(files_metadata=True)`, endpoint); FetchError for a request the hub refuses,
    HubDown when it cannot be reached or answers 5xx."""
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = str(constants.ENDPOINT)
    try:
        return HfApi().model_info(repo, revision=revision, files_metadata=True), endpoint
    except GatedRepoError:
        raise FetchError(f"{repo} is gated: accept its terms on the hub and set HF_TOKEN (or `hf auth login`)") from None
    except RevisionNotFoundError:
        raise FetchError(f"{repo} has no revision {revision!r}: check --revision") from None
    except RepositoryNotFoundError:
        raise FetchError(f"{repo} was not found on {endpoint} (or is private): check --repo, and HF_TOKEN for private repos") from None
    except _connectivity_errors() as exc:
        warn(f"the hub at {endpoint} is unreachable ({type(exc).__name__}); verifying the local copy instead")
        raise HubDown(f"the hub at {endpoint} is unreachable") from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None and status >= 500:
            warn(f"the hub at {endpoint} answered {status}; verifying the local copy instead")
            raise HubDown(f"the hub at {endpoint} answered {status}") from None
        raise FetchError(f"the hub refused the request for {repo}@{revision}: {exc}") from None


def download(repo: str, revision: str, commit: str, local_dir: str | Path | None, endpoint: str, *,
             max_workers: int = 8, allow_patterns: list[str] | None = None) -> Path:
    """snapshot_download with errors turned into FetchError; in the cache, insists on `commit`."""
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        # into a folder: the commit the file list came from, so a branch moving meanwhile cannot mix revisions;
        # into the cache: the name, so the cache records refs/<name> (the offline lookup needs it), checked below
        got = snapshot_download(repo, revision=commit if local_dir is not None else revision, local_dir=str(local_dir) if local_dir is not None else None,
                                max_workers=max_workers, allow_patterns=allow_patterns)
    except _connectivity_errors() as exc:
        raise FetchError(f"the download from {endpoint} broke off ({type(exc).__name__}: {exc}); run the same command "
                         "again: it resumes, keeping what is complete") from None
    except (HfHubHTTPError, OSError) as exc:
        raise FetchError(f"the download of {repo}@{commit} failed: {exc}; run the same command again to resume") from None
    if local_dir is None and Path(got).name != commit:
        raise FetchError(f"{repo}@{revision} moved from {commit} to {Path(got).name} during the download; "
                         "run again, or pin it with --revision <commit>")
    return Path(got)


def fetch(
    repo: str,
    revision: str | None,
    local_dir: str | Path | None,
    *,
    offline: bool = False,
    warn: Callable[[str], None] = lambda m: None,
    max_workers: int = 8,
) -> Obtained:
    """Download (or find offline) the checkpoint; writes the manifest before downloading."""
    if _offline(offline):
        quiet = local_dir is not None  # the revision only matters when looking in the cache
        revision = resolve_revision(repo, revision, (lambda m: None) if quiet else warn)
        return use_local_copy(repo, revision, local_dir, "offline mode")
    revision = resolve_revision(repo, revision, warn)
    try:
        info, endpoint = hub_info(repo, revision, warn)
    except HubDown as exc:
        return use_local_copy(repo, revision, local_dir, str(exc))
    manifest = manifest_from_model_info(info, repo, revision, endpoint)
    target = Path(local_dir) if local_dir is not None else _snapshot_dir(repo, info.sha)
    target.mkdir(parents=True, exist_ok=True)
    save_manifest(target, manifest)  # first: an interrupted download keeps the hub's hashes
    got = download(repo, revision, info.sha, local_dir, endpoint, max_workers=max_workers)
    source = {"repo": repo, "revision": revision, "commit": info.sha, "online": True, "endpoint": endpoint}
    return Obtained(got, manifest, source)


def _offline(flag: bool) -> bool:
    return flag or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


# --- the DFlash2 drafter (drafter/MANIFEST.json) ---

@dataclass
class DrafterFetched:
    directory: Path
    problems: list[str]      # from drafter.manifest.verify (or the pin's refusal); empty: complete and matching
    lock: dict[str, Any] | None
    source: dict[str, Any]   # repository, revision, commit, online, endpoint / note


def drafter_hub_files(info: Any, allow_patterns: tuple[str, ...]) -> dict[str, Any]:
    """The hub's metadata for the files the manifest's allow_patterns select (what snapshot_download fetches)."""
    # on use: offline verification never loads huggingface_hub (~0.4 s)
    from huggingface_hub.utils import filter_repo_objects

    files = manifest_from_model_info(info, "", "", "").files
    chosen = filter_repo_objects(list(files), allow_patterns=list(allow_patterns) or None)
    return {name: HubFile(files[name].size, files[name].sha256, files[name].blob_id) for name in chosen}


def fetch_drafter(
    local_dir: str | Path | None,
    revision: str | None = None,
    *,
    offline: bool = False,
    warn: Callable[[str], None] = lambda m: None,
    max_workers: int = 8,
    manifest: Any = None,
) -> DrafterFetched:
    """Download the DFlash2 drafter named by drafter/MANIFEST.json (the licence already accepted),
    pin it against the hub's metadata and verify it; offline (or with the hub down), verify the
    copy at `local_dir` / in the cache against its lock. FetchError when there is nothing to check."""
    manifest = manifest or load_drafter_manifest()
    repo = manifest.repository
    if revision is None:
        revision = manifest.fetch_revision
        if manifest.revision_is_placeholder and not (_offline(offline) and local_dir is not None):
            warn(f"{manifest.source} pins no revision of {repo} (placeholder): using 'main'; the commit it resolves "
                 "to is recorded in drafter.lock.json; pass --revision <commit> to pin")
    elif not manifest.revision_is_placeholder and revision != manifest.revision:
        warn(f"--revision {revision} is not the revision {manifest.source} pins ({manifest.revision})")

    def offline_copy(why: str) -> DrafterFetched:
        pinned_here = local_dir is not None and (Path(local_dir) / LOCK_NAME).is_file()
        path = Path(local_dir) if pinned_here else find_local_copy(repo, revision, local_dir, list(manifest.allow_patterns))
        if path is None:
            where = f"at {local_dir}" if local_dir is not None else f"in the Hugging Face cache ({_cache_dir()}) for {repo}@{revision}"
            raise FetchError(f"{why}, and there is no drafter {where}. Connect to the hub and run "
                             "bash fetch_weights.sh --drafter" + (f" --dir {local_dir}" if local_dir is not None else "")
                             + " (set HF_ENDPOINT for a mirror)")
        lock = _read_lock(path)
        source = {"repo": repo, "revision": revision, "commit": (lock or {}).get("revision"), "online": False, "note": why}
        return DrafterFetched(path, verify(path, manifest), lock, source)

    if _offline(offline):
        return offline_copy("offline mode")
    try:
        info, endpoint = hub_info(repo, revision, warn)
    except HubDown as exc:
        return offline_copy(str(exc))
    hub_files = drafter_hub_files(info, manifest.allow_patterns)
    got = download(repo, revision, info.sha, local_dir, endpoint, max_workers=max_workers,
                   allow_patterns=list(manifest.allow_patterns))
    source = {"repo": repo, "revision": revision, "commit": info.sha, "online": True, "endpoint": endpoint}
    try:
        lock = pin(got, manifest, commit=info.sha, hub_files=hub_files)
    except PinRefused as exc:  # a size or git blob id not the hub's: nothing pinned, an older lock (if any) untouched
        return DrafterFetched(got, exc.problems, None, source)
    return DrafterFetched(got, verify(got, manifest), lock, source)


def _read_lock(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return None
