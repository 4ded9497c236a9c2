"""`python -m glm53.weights`: fetch a GLM-5.3 checkpoint (or find it offline) and prove it complete.

fetch_weights.sh is a thin front over this. Exit codes: see glm53/weights/report.py and README.md.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from .fetch import DEFAULT_REPO, DRAFTER_NOTICE, DRAFTER_REPO, FetchError, fetch
from .manifest import ManifestError, write_json_atomic
from .report import EXIT_INTERRUPTED, EXIT_NO_CHECKPOINT, build_report, render_errors, render_text
from .verify import verify_checkpoint

EPILOG = """\b
Exit codes:
  0    complete and valid (warnings may be printed)
  1    file problems: shard/index/config missing, truncated, Git LFS pointer,
       invalid header, size or SHA-256 differing from the hub's, --deep without hashes
  2    usage error
  3    model-level problems: files sound, but the tensors do not match config.json
  4    no checkpoint: offline/unreachable hub and no local copy, repo or revision
       not found, or the download failed
  130  interrupted
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
@click.option("--repo", default=DEFAULT_REPO, show_default=True, help="Hub repository of the checkpoint.")
@click.option("--revision", default=None, help="Branch, tag or commit (default: the pinned one; 'main' with a warning while it is a placeholder).")
@click.option("--dir", "local_dir", type=click.Path(file_okay=False), default=None, help="Folder for the checkpoint (default: the Hugging Face cache).")
@click.option("--offline", is_flag=True, help="No network: verify the copy at --dir or in the cache.")
@click.option("--deep", is_flag=True, help="Also SHA-256 every shard against the hashes the hub recorded (manifest).")
@click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True, help="Hashing threads for --deep.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the whole report here (atomically).")
@click.option("--drafter", is_flag=True, help=f"Also fetch and check the drafter {DRAFTER_REPO} (beside --dir, or in the cache).")
def main(repo: str, revision: str | None, local_dir: str | None, offline: bool, deep: bool, workers: int,
         json_path: str | None, drafter: bool) -> None:
    """Fetch a GLM-5.3 EXL3 checkpoint and prove it complete, reading headers only."""
    try:
        code = _run(repo, revision, local_dir, offline, deep, workers, json_path, drafter)
    except KeyboardInterrupt:
        click.echo("\ninterrupted; run the same command again to resume (nothing half-written)", err=True)
        code = EXIT_INTERRUPTED
    sys.exit(code)


def _run(repo: str, revision: str | None, local_dir: str | None, offline: bool, deep: bool, workers: int,
         json_path: str | None, drafter: bool) -> int:
    report: dict[str, Any]
    try:
        obtained = fetch(repo, revision, local_dir, offline=offline, warn=_warn)
        report = _verify(obtained, deep, workers, check_model=True)
    except (FetchError, ManifestError) as exc:
        click.echo(f"error: {exc}", err=True)
        report = {"tool": "glm53.weights verify", "model_dir": local_dir, "status": "no_checkpoint",
                  "exit_code": EXIT_NO_CHECKPOINT, "source": {"repo": repo, "revision": revision}, "error": str(exc)}
        if json_path:
            write_json_atomic(json_path, report)
        return EXIT_NO_CHECKPOINT
    click.echo(render_text(report))
    for line in render_errors(report):
        click.echo(line, err=True)
    code = report["exit_code"]
    if drafter:
        click.echo(f"note: {DRAFTER_NOTICE}", err=True)
        drafter_dir = str(Path(local_dir).resolve().parent / DRAFTER_REPO.split("/")[1]) if local_dir else None
        try:
            got = fetch(DRAFTER_REPO, None, drafter_dir, offline=offline, warn=_warn)
            sub = _verify(got, deep, workers, check_model=False)
            click.echo(f"drafter     {got.model_dir}: {sub['summary']['shards']} shard(s), {sub['status']}")
            for line in render_errors(sub):
                click.echo(line, err=True)
            sub_code = sub["exit_code"]
        except (FetchError, ManifestError) as exc:
            click.echo(f"error: drafter: {exc}", err=True)
            sub = {"status": "no_checkpoint", "exit_code": EXIT_NO_CHECKPOINT, "error": str(exc)}
            sub_code = EXIT_NO_CHECKPOINT
        report["drafter"] = sub
        code = code or sub_code
    if json_path:
        write_json_atomic(json_path, report)
    return code


if __name__ == "__main__":
    main(prog_name=os.environ.get("GLM53_WEIGHTS_PROG", "python -m glm53.weights"))
