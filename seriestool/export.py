"""`export` and `new`: commits on top of the pin -> normalized patch files + the series, atomically.

Bytes depend only on the commits (see git_ops.EXPORT_*), so exporting twice changes nothing.
All patches are rendered before anything is written; files are replaced by rename, dropped files
removed after, and the series file is written last.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import git

from .context import Invocation, ensure_quiet, say
from .errors import ExitCode, SeriesToolError
from .git_ops import BRANCH, Workdir, sha256_file
from .patchfile import read_patch
from .series import PATCH_NAME_RE, Pin, Series, write_atomic, write_series


@dataclass
class ExportResult:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    series_changed: bool = False


def slug(text: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return (words[:48].rstrip("-")) or "change"


def next_number(names: list[str]) -> int:
    numbers = [int(m.group(1)) for m in map(PATCH_NAME_RE.match, names) if m]
    return max(numbers, default=0) + 1


def write_export(wd: Workdir, series: Series, pin: Pin, named: list[tuple[str, str]]) -> ExportResult:
    """Write commit -> file name pairs as the whole series on `pin`."""
    rendered = [(name, wd.format_patch(commit)) for commit, name in named]
    result = ExportResult()
    series.patch_dir.mkdir(exist_ok=True)
    for name, data in rendered:
        changed = write_atomic(series.patch_path(name), data)
        (result.written if changed else result.unchanged).append(name)
    keep = {name for name, _ in rendered}
    for name in series.names:
        if name not in keep and series.patch_path(name).exists():
            series.patch_path(name).unlink()
            result.removed.append(name)
    result.series_changed = write_series(series, pin, [name for name, _ in rendered])
    return result


def name_commits(wd: Workdir, series: Series, commits: list[str]) -> list[tuple[str, str]]:
    """Give each commit its patch file name: the one apply.py recorded for it, else the series
    patch with the same subject, else a new NNNN-subject.patch after the highest number."""
    stamp = wd.read_stamp() or {}
    by_commit = {a["commit"]: a["name"] for a in stamp.get("applied", []) if a["name"] in series.names}
    by_subject: dict[str, str] = {}
    for name in series.names:
        if series.patch_path(name).is_file():
            by_subject.setdefault(read_patch(series.patch_path(name)).subject, name)
    used: set[str] = set()
    named: list[tuple[str, str]] = []
    all_names = list(series.names)
    for commit in commits:
        name = by_commit.get(commit)
        if name is None or name in used:
            subject = wd.must("log", "-1", "--format=%s", commit)
            name = by_subject.get(subject)
        if name is None or name in used:
            subject = wd.must("log", "-1", "--format=%s", commit)
            name = f"{next_number(all_names):04d}-{slug(subject)}.patch"
            all_names.append(name)
        used.add(name)
        named.append((commit, name))
    return named


def record_stamp(wd: Workdir, series: Series, pin: Pin, named: list[tuple[str, str]]) -> None:
    wd.write_stamp({"pin": pin.commit, "tag": pin.tag, "head": wd.head(),
                    "applied": [{"name": name, "commit": commit,
                                 "sha256": sha256_file(series.patch_path(name))}
                                for commit, name in named]})


def report(result: ExportResult, series: Series) -> None:
    for name in result.written:
        say(f"wrote {series.patch_path(name)}")
    for name in result.removed:
        say(f"removed {series.patch_path(name)} (no longer in the series)")
    say(f"series {'rewritten' if result.series_changed else 'unchanged'}; "
        f"{len(result.unchanged)} patch file(s) already up to date")


def run_export(inv: Invocation) -> int:
    series = inv.series()
    wd = Workdir.open_existing(inv.workdir)
    ensure_quiet(wd, inv)
    pin = series.pin
    if not wd.has_object(pin.commit) or not wd.is_ancestor(pin.commit):
        raise SeriesToolError(ExitCode.BAD_STATE, f"HEAD in {wd.path} is not on top of the pinned "
                              f"commit {pin.commit[:12]}; check out the series branch "
                              f"({inv.git_command('checkout', BRANCH)}) or run {inv.command()}")
    commits = wd.commits_since(pin.commit)
    merges = wd.must("rev-list", "--merges", f"{pin.commit}..HEAD").split()
    if merges:
        raise SeriesToolError(ExitCode.BAD_STATE, f"merge commits on top of the pin cannot become "
                              f"patches: {', '.join(m[:12] for m in merges)}; linearize the branch first")
    named = name_commits(wd, series, commits)
    result = write_export(wd, series, pin, named)
    record_stamp(wd, series, pin, named)
    report(result, series)
    return ExitCode.OK


def _user_identity() -> str | None:
    """The maintainer's own git identity (their config, read only for this), if they have one."""
    try:
        name = git.Git().config("--get", "user.name")
        email = git.Git().config("--get", "user.email")
    except git.GitCommandError:
        return None
    return f"{name} <{email}>" if name and email else None


def run_new(inv: Invocation, name: str, message: str | None, author: str | None) -> int:
    """Staged changes in the workdir become a new commit at the series' tip and its patch file."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise SeriesToolError(ExitCode.USAGE, f"NAME {name!r}: use lowercase letters, digits and '-' "
                              "(the file becomes NNNN-NAME.patch)")
    series = inv.series()
    wd = Workdir.open_existing(inv.workdir)
    ensure_quiet(wd, inv, allow_dirty=True)
    stamp = wd.read_stamp() or {}
    if stamp.get("pin") != series.pin.commit or stamp.get("head") != wd.head() or \
            [a["name"] for a in stamp.get("applied", [])] != series.names:
        raise SeriesToolError(ExitCode.BAD_STATE, f"the workdir is not at the tip of the applied "
                              f"series; run {inv.command()} first (or {inv.command('export')} to keep "
                              "commits you made by hand)")
    if wd.run("diff", "--cached", "--quiet").ok:
        raise SeriesToolError(ExitCode.BAD_STATE, f"nothing staged in {wd.path}: `git add` the changes "
                              "that make up the patch first")
    unstaged = wd.run("diff", "--quiet")
    if message is None:
        message = (f"{name.replace('-', ' ')}\n\nWhat: TODO\nWhy: TODO\nVerified: TODO\n"
                   "Not verified: TODO\nGuarded-By: TODO\n")
    author = author or _user_identity()
    env = {}
    if author:
        match = re.fullmatch(r"\s*(.+?)\s*<([^>]+)>\s*", author)
        if not match:
            raise SeriesToolError(ExitCode.USAGE, f"--author {author!r}: use 'Name <email>'")
        env = {"GIT_AUTHOR_NAME": match.group(1), "GIT_AUTHOR_EMAIL": match.group(2)}
    result = wd.run("commit", "-q", "--no-verify", "--cleanup=strip", "-m", message, env=env)
    if not result.ok:
        raise SeriesToolError(ExitCode.BAD_STATE, f"git commit failed:\n{result.output}")
    file_name = f"{next_number(series.names):04d}-{name}.patch"
    if series.patch_path(file_name).exists():
        raise SeriesToolError(ExitCode.SERIES_INVALID, f"{series.patch_path(file_name)} already exists "
                              "but is not in the series; remove it or list it")
    named = [(a["commit"], a["name"]) for a in stamp.get("applied", [])] + [(wd.head(), file_name)]
    result_export = write_export(wd, series, series.pin, named)
    record_stamp(wd, series, series.pin, named)
    report(result_export, series)
    if not unstaged.ok:
        say("note: unstaged changes stay in the workdir (not part of the patch)")
    if "TODO" in message:
        say(f"fill in What/Why/Verified/Not verified/Guarded-By in {series.patch_path(file_name)} "
            f"(git -C {wd.path} commit --amend, then {inv.command('export')}); check fails until then")
    return ExitCode.OK
