"""The command line of apply.py (click). Commands: apply (default), check, status, export,
rebase, new. Exit codes: seriestool.errors.ExitCode, documented in docs/MAINTAINERS.md."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import rebase_cmd
from .apply_cmd import run_apply, run_status
from .check_cmd import run_check
from .context import Invocation
from .errors import ExitCode, SeriesToolError
from .export import run_export, run_new


def _handled(func):
    """Turn SeriesToolError into its message on stderr and its exit code."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            code = func(*args, **kwargs)
        except SeriesToolError as exc:
            click.echo(f"error: {exc.message}", err=True)
            sys.stdout.flush()
            raise click.exceptions.Exit(int(exc.code))
        raise click.exceptions.Exit(int(code or 0))

    return wrapper


def _common(func):
    """--series/--workdir/--repo, accepted before or after the command name."""
    func = click.option("--repo", default=None, metavar="URL|PATH",
                        help="Where to get the upstream: an https URL, or a local clone/bare mirror "
                             "path or file:// URL (default: the series' URL).")(func)
    func = click.option("--workdir", default=None, metavar="DIR",
                        help="The upstream checkout (default: build/tensorfold beside the series).")(func)
    func = click.option("--series", "series_file", default=None, metavar="FILE",
                        help="The series file (default: series at the kit root).")(func)
    return func


def _inv(ctx: click.Context, series_file, workdir, repo, shallow: bool = False) -> Invocation:
    parent = ctx.find_root().params
    return Invocation.build(series_file or parent.get("series_file"), workdir or parent.get("workdir"),
                            repo or parent.get("repo"), shallow or bool(parent.get("shallow")))


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@_common
@click.option("--upstream", default=None, metavar="TAG", help="The tag to apply on; must be the "
              "series' pinned tag (to move, use `rebase --onto`).")
@click.option("--shallow", is_flag=True, help="Fetch only the tag's commit (depth 1).")
@click.option("--no-fetch", is_flag=True, help="Use what the workdir already holds (offline).")
@click.pass_context
def main(ctx: click.Context, series_file, workdir, repo, upstream, shallow, no_fetch) -> None:
    """Pin, apply, check, export and rebase the TensorFold patch series.

    Without a command: apply (the upstream at the pin, verified, every patch on top). After
    apply, check and rebase, the model families in src/tensorfold/families are read statically
    and two families claiming one model_type stop the command (exit 9).

    \b
    Exit codes (docs/MAINTAINERS.md):
      0 ok   1 crash (a bug)   2 usage / refused upstream   3 patch does not apply or conflict
      4 check: stale patches   5 pin mismatch   6 bad workdir state   7 series invalid
      8 upstream unreachable   9 model family clash, or a family file that does not parse"""
    if ctx.invoked_subcommand is None:
        ctx.invoke(apply_command, upstream=upstream, shallow=shallow, no_fetch=no_fetch)


@main.command("apply")
@_common
@click.option("--upstream", default=None, metavar="TAG", help="Must equal the series' pinned tag.")
@click.option("--shallow", is_flag=True, help="Fetch only the tag's commit (depth 1).")
@click.option("--no-fetch", is_flag=True, help="Use what the workdir already holds (offline).")
@click.pass_context
@_handled
def apply_command(ctx, series_file=None, workdir=None, repo=None, upstream=None, shallow=False,
                  no_fetch=False):
    """Fetch the pinned tag, verify it, and apply every patch with git am (no fuzz)."""
    return run_apply(_inv(ctx, series_file, workdir, repo, shallow), upstream, fetch=not no_fetch)


@main.command("check")
@_common
@click.option("--offline", is_flag=True, help="Lint only; do not contact the upstream.")
@click.option("--require-upstream", is_flag=True,
              help="Fail (exit 8) instead of reporting when the upstream is unreachable.")
@click.pass_context
@_handled
def check_command(ctx, series_file, workdir, repo, offline, require_upstream):
    """Lint the series; against a reachable upstream also apply, export and compare bytes."""
    return run_check(_inv(ctx, series_file, workdir, repo), offline, require_upstream)


@main.command("status")
@_common
@click.pass_context
@_handled
def status_command(ctx, series_file, workdir, repo):
    """Pin vs checkout, applied vs series, dirty tree, work in progress (exit 0)."""
    return run_status(_inv(ctx, series_file, workdir, repo))


@main.command("export")
@_common
@click.pass_context
@_handled
def export_command(ctx, series_file, workdir, repo):
    """Write the workdir's commits on top of the pin as normalized patches + the series."""
    return run_export(_inv(ctx, series_file, workdir, repo))


@main.command("rebase")
@_common
@click.option("--onto", "onto", default=None, metavar="TAG", help="The upstream tag to carry the series onto.")
@click.option("--continue", "action", flag_value="continue", help="Go on after resolving a conflict.")
@click.option("--skip", "action", flag_value="skip", help="Drop the patch that stopped and go on.")
@click.option("--abort", "action", flag_value="abort", help="Stop; series and patches/ stay untouched.")
@click.option("--drop", "drop", multiple=True, metavar="NAME",
              help="With --onto: leave patch NAME out of the rebased series (repeatable).")
@click.option("--shallow", is_flag=True, help="Fetch only the new tag's commit (depth 1).")
@click.pass_context
@_handled
def rebase_command(ctx, series_file, workdir, repo, onto, action, drop, shallow):
    """Carry the series onto another tag (3-way), stopping at conflicts (exit 3) and, after the
    last patch, at a model family clash (exit 9; nothing written, --continue folds a staged fix
    into the kit's registration patch)."""
    if bool(onto) == bool(action):
        raise click.UsageError("give exactly one of --onto TAG, --continue, --skip, --abort")
    if drop and not onto:
        raise click.UsageError("--drop goes with --onto (abort the rebase in progress first)")
    inv = _inv(ctx, series_file, workdir, repo, shallow)
    if onto:
        return rebase_cmd.start(inv, onto, drop)
    return rebase_cmd.resume(inv, action)


@main.command("new")
@_common
@click.argument("name")
@click.option("-m", "--message", default=None, help="The commit message (subject, blank line, "
              "What:/Why:/Verified:/Not verified:/Guarded-By: lines).")
@click.option("-F", "--message-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Read the message from a file.")
@click.option("--author", default=None, metavar="'NAME <EMAIL>'", help="Patch author.")
@click.pass_context
@_handled
def new_command(ctx, series_file, workdir, repo, name, message, message_file, author):
    """Turn the staged changes in the workdir into a new patch at the end of the series."""
    if message and message_file:
        raise click.UsageError("give -m or -F, not both")
    if message_file:
        message = message_file.read_text(encoding="utf-8")
    return run_new(_inv(ctx, series_file, workdir, repo), name, message, author)
