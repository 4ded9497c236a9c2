"""What every command needs: the series, the workdir, the upstream source, and how to re-run."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import click

from .errors import ExitCode, SeriesToolError
from .git_ops import Workdir
from .rebase_state import RebaseState
from .series import Series, parse_series
from .transport import Source, validate_source

def _default_series() -> Path:
    """`series` at the kit root (beside apply.py); from an installed copy, the one in the cwd."""
    beside = Path(__file__).resolve().parent.parent / "series"
    return beside if beside.is_file() else Path.cwd() / "series"


@dataclass
class Invocation:
    series_path: Path
    workdir: Path
    repo: str | None          # --repo as given (explicit source), None = the series URL
    shallow: bool = False
    given: tuple[str, ...] = ()  # the non-default options, to print exact recovery commands

    @classmethod
    def build(cls, series: str | None, workdir: str | None, repo: str | None,
              shallow: bool = False) -> "Invocation":
        series_path = Path(series).resolve() if series else _default_series()
        work = Path(workdir).resolve() if workdir else series_path.parent / "build" / "tensorfold"
        given: list[str] = []
        if series:
            given += ["--series", str(series_path)]
        if workdir:
            given += ["--workdir", str(work)]
        if repo:
            given += ["--repo", repo]
        return cls(series_path, work, repo, shallow, tuple(given))

    def command(self, *words: str, with_repo: bool = True) -> str:
        """The exact command line to run this tool again with the same series/workdir."""
        options = list(self.given)
        if not with_repo and "--repo" in options:
            at = options.index("--repo")
            del options[at:at + 2]
        return shlex.join(["python", "apply.py", *words, *options])

    def git_command(self, *words: str) -> str:
        return shlex.join(["git", "-C", str(self.workdir), *words])

    def series(self) -> Series:
        return parse_series(self.series_path)

    def source(self, series: Series) -> Source:
        if self.repo:
            return validate_source(self.repo, explicit=True)
        return validate_source(series.pin.url, explicit=False)


def say(text: str = "") -> None:
    click.echo(text)


def note(text: str) -> None:
    click.echo(text, err=True)


def ensure_quiet(wd: Workdir, inv: Invocation, *, allow_dirty: bool = False) -> None:
    """Refuse to touch a workdir with work in flight: an am/rebase or uncommitted changes."""
    if RebaseState.exists(wd):
        raise SeriesToolError(ExitCode.BAD_STATE, f"a series rebase is in progress in {wd.path}; "
                              f"finish it first:\n  {inv.command('rebase', '--continue')}\n  "
                              f"{inv.command('rebase', '--skip')}\n  {inv.command('rebase', '--abort')}")
    if wd.am_in_progress() or wd.git_rebase_in_progress():
        raise SeriesToolError(ExitCode.BAD_STATE, f"a git am or rebase is in progress in {wd.path} "
                              f"(an interrupted run, or your own); finish it, or abort it with "
                              f"{inv.git_command('am', '--abort')} (or "
                              f"{inv.git_command('rebase', '--abort')}), then run again")
    if not allow_dirty:
        dirty = wd.dirty_files()
        if dirty:
            listed = "\n  ".join(dirty[:20]) + ("\n  ..." if len(dirty) > 20 else "")
            raise SeriesToolError(ExitCode.BAD_STATE, f"workdir {wd.path} has uncommitted changes; "
                                  f"refusing to touch it:\n  {listed}\nKeep them as a patch "
                                  f"(`git add` them, then {inv.command('new', 'NAME')}) or discard "
                                  f"them ({inv.git_command('reset', '--hard')}).")
