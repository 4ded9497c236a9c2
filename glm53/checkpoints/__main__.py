"""`python -m glm53.checkpoints`: fetch a GLM-5.3 checkpoint (or find it offline) and prove it complete.

fetch_weights.sh is a thin front over this. Exit codes: see glm53/checkpoints/report.py and docs/weights.md.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import click

from drafter.manifest import LOCK_NAME
from drafter.manifest import ManifestError as DrafterManifestError
from drafter.manifest import load_manifest as load_drafter_manifest
from glm53.atomic_json import write_json_atomic

from .fetch import DEFAULT_REPO, DrafterFetched, FetchError, fetch, fetch_drafter
from .manifest import ManifestError
from .report import (
    EXIT_FILES,
    EXIT_INTERRUPTED,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    EXIT_USAGE,
    build_report,
    render_errors,
    render_text,
)
from .verify import verify_checkpoint

EXIT_LICENCE = 5  # --drafter: the drafter's licence was not accepted; nothing was downloaded

EPILOG = """\b
Exit codes:
  0    complete and valid (warnings may be printed)
  1    file problems: shard/index/config missing, truncated, Git LFS pointer,
       invalid header, size or SHA-256 differing from the hub's, --deep without hashes
  2    usage error
  3    model-level problems: files sound, but the tensors do not match config.json
  4    no checkpoint: offline/unreachable hub and no local copy, repo or revision
       not found, or the download failed
  5    --drafter: its licence (CC BY-NC-ND 4.0) was not accepted; nothing downloaded
  130  interrupted

\b
--drafter fetches only the DFlash2 drafter named by drafter/MANIFEST.json
(--dir/--revision then apply to it), pins its files against the hub's sizes and
SHA-256 (DIR/drafter.lock.json) and verifies them; --offline re-verifies them.
"""


class _Progress:
    """One updating line on a terminal, a line every few seconds otherwise; always stderr."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r" + message)
            sys.stderr.flush()
        elif now - self.last >= 5.0:
            self.last = now
            sys.stderr.write(message + "\n")

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def _verify(obtained: Any, deep: bool, workers: int, check_model: bool) -> dict[str, Any]:
    progress = _Progress()
    result = verify_checkpoint(obtained.model_dir, manifest=obtained.manifest, deep=deep, workers=workers,
                               progress=progress, check_model=check_model)
    if deep:
        progress.done()
    return build_report(result, source=obtained.source)


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.option("--repo", default=None, help=f"Hub repository of the checkpoint [default: {DEFAULT_REPO}].")
@click.option("--revision", default=None, help="Branch, tag or commit (default: the pinned one; 'main' with a warning while it is a placeholder).")
@click.option("--dir", "local_dir", type=click.Path(file_okay=False), default=None, help="Folder for the checkpoint, or the drafter with --drafter (default: the Hugging Face cache).")
@click.option("--offline", is_flag=True, help="No network: verify the copy at --dir or in the cache.")
@click.option("--deep", is_flag=True, help="Also SHA-256 every shard against the hashes the hub recorded (manifest). The drafter is always hashed.")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Hashing threads for --deep.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the whole report here (atomically).")
@click.option("--drafter", is_flag=True, help="Fetch (or with --offline re-verify) the DFlash2 drafter of drafter/MANIFEST.json instead of the checkpoint.")
@click.option("--accept-licence", "--accept-license", "accept_licence", is_flag=True,
              help="With --drafter: accept its licence (CC BY-NC-ND 4.0) without the prompt; needed when stdin is not a terminal.")
def main(repo: str | None, revision: str | None, local_dir: str | None, offline: bool, deep: bool, workers: int,
         json_path: str | None, drafter: bool, accept_licence: bool) -> None:
    """Fetch a GLM-5.3 EXL3 checkpoint and prove it complete, reading headers only."""
    try:
        if drafter:
            if repo is not None:
                raise click.UsageError("--drafter takes its repository from drafter/MANIFEST.json; drop --repo")
            code = _run_drafter(revision, local_dir, offline, json_path, accept_licence)
        else:
            if accept_licence:
                raise click.UsageError("--accept-licence only goes with --drafter")
            code = _run(repo or DEFAULT_REPO, revision, local_dir, offline, deep, workers, json_path)
    except KeyboardInterrupt:
        click.echo("\ninterrupted; run the same command again to resume (nothing half-written)", err=True)
        code = EXIT_INTERRUPTED
    sys.exit(code)


def _run(repo: str, revision: str | None, local_dir: str | None, offline: bool, deep: bool, workers: int,
         json_path: str | None) -> int:
    report: dict[str, Any]
    try:
        obtained = fetch(repo, revision, local_dir, offline=offline, warn=_warn)
        report = _verify(obtained, deep, workers, check_model=True)
    except (FetchError, ManifestError) as exc:
        click.echo(f"error: {exc}", err=True)
        report = {"tool": "glm53.checkpoints verify", "model_dir": local_dir, "status": "no_checkpoint",
                  "exit_code": EXIT_NO_CHECKPOINT, "source": {"repo": repo, "revision": revision}, "error": str(exc)}
        if json_path:
            write_json_atomic(json_path, report)
        return EXIT_NO_CHECKPOINT
    click.echo(render_text(report))
    for line in render_errors(report):
        click.echo(line, err=True)
    code = report["exit_code"]
    if json_path:
        write_json_atomic(json_path, report)
    return code


# --- the DFlash2 drafter ---

def licence_accepted(manifest: Any, flag: bool, interactive: bool) -> bool:
    """The user's consent to the drafter's licence: --accept-licence, or yes at a terminal prompt."""
    click.echo(f"licence: {manifest.licence_notice()}", err=True)
    if flag:
        click.echo("licence: accepted with --accept-licence", err=True)
        return True
    if not interactive:
        click.echo(f"error: {manifest.repository} is licensed {manifest.licence_spdx} ({manifest.licence_url}) and "
                   "is fetched only when you accept that licence; stdin is not a terminal, so pass --accept-licence "
                   "to accept it. Nothing was downloaded.", err=True)
        return False
    try:
        yes = click.confirm(f"Accept {manifest.licence_spdx} for {manifest.repository}?", default=False, err=True)
    except click.Abort:  # end of input or ^C at the prompt
        yes = False
    if not yes:
        click.echo("licence not accepted; nothing was downloaded", err=True)
    return yes


def _drafter_report(got: DrafterFetched | None, manifest: Any, code: int, status: str, error: str | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {"tool": "glm53.checkpoints drafter", "status": status, "exit_code": code,
                              "repository": manifest.repository, "licence": manifest.licence_spdx,
                              "licence_url": manifest.licence_url}
    if got is not None:
        report.update(drafter_dir=str(got.directory), source=got.source, problems=got.problems,
                      files=(got.lock or {}).get("files"))
    if error:
        report["error"] = error
    return report


def _run_drafter(revision: str | None, local_dir: str | None, offline: bool, json_path: str | None,
                 accept_flag: bool) -> int:
    def finish(report: dict[str, Any]) -> int:
        if json_path:
            write_json_atomic(json_path, report)
        return report["exit_code"]

    try:
        manifest = load_drafter_manifest()
    except DrafterManifestError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_USAGE
    online = not offline and os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes")
    if online and not licence_accepted(manifest, accept_flag, sys.stdin.isatty()):
        return finish(_drafter_report(None, manifest, EXIT_LICENCE, "licence_not_accepted"))
    try:
        got = fetch_drafter(local_dir, revision, offline=offline, warn=_warn, manifest=manifest)
    except (FetchError, DrafterManifestError) as exc:
        click.echo(f"error: drafter: {exc}", err=True)
        return finish(_drafter_report(None, manifest, EXIT_NO_CHECKPOINT, "no_checkpoint", str(exc)))
    commit = got.source.get("commit") or "unknown commit"
    click.echo(f"drafter     {got.directory}")
    click.echo(f"source      {manifest.repository}@{commit} ({manifest.licence_spdx}: yours to use, not to redistribute)")
    for line in got.problems:
        click.echo(f"error: {line}", err=True)
    if got.problems:
        click.echo(f"verify      FAILED: {len(got.problems)} problem(s); run bash fetch_weights.sh --drafter"
                   + (f" --dir {local_dir}" if local_dir else "") + " online to fetch it again")
        return finish(_drafter_report(got, manifest, EXIT_FILES, "files"))
    n = len((got.lock or {}).get("files", {}))
    click.echo(f"verify      ok: {n} files, sizes and SHA-256 match {got.directory / LOCK_NAME} (the hub's record)")
    # the engine takes the drafter as the family contract's `drafter` argument (glm53.cuda_engine, the composition
    # root -> drafter.glm53_target.DraftPlan.from_contract); the launcher passes the cluster file's `drafter:` as --drafter
    click.echo(f"use it      cluster file (bash serve.sh):   drafter: {got.directory}")
    click.echo(f"            rank / TensorFold CLI:          --drafter {got.directory}")
    click.echo("            TF_GLM53_DRAFT_SOURCE=dflash2 makes it the only draft source (default auto: it wins when given)")
    return finish(_drafter_report(got, manifest, EXIT_OK, "ok"))


if __name__ == "__main__":
    main(prog_name=os.environ.get("GLM53_WEIGHTS_PROG", "python -m glm53.checkpoints"))
