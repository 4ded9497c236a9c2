"""`apply` (the default command): the upstream at the pin, verified, with every patch on top."""
from __future__ import annotations

import re

from .context import Invocation, ensure_quiet, say
from .errors import ExitCode, SeriesToolError
from .family_check import APPLY, kit_families, print_families, require_no_clash
from .families import scan_families
from .git_ops import BRANCH, GitResult, Workdir, sha256_file
from .lint import require_structure
from .patchfile import hunk_at, read_patch
from .rebase_state import RebaseState
from .series import Pin, Series
from .transport import require_reachable

FAILED_AT_RE = re.compile(r"^error: patch failed: (.+):(\d+)$", re.M)
LACKS_BLOBS = "lacks necessary blobs"
# git am's own "what next" lines: apply.py prints its own commands instead (they keep the
# series state consistent), so these would only mislead.
GIT_AM_ADVICE = ("hint:", "Patch failed at ", "When you have resolved this problem",
                 "If you prefer to skip this patch", "To restore the original branch")


def verify_pin(wd: Workdir, pin: Pin) -> None:
    """The tag must resolve (annotated or lightweight) to exactly the pinned commit."""
    got = wd.resolve(f"refs/tags/{pin.tag}")
    if got is None:
        raise SeriesToolError(ExitCode.PIN_MISMATCH, f"tag {pin.tag} is not in {wd.path}; fetch it "
                              "(drop --no-fetch) or give --repo with a clone that has it")
    if got != pin.commit:
        raise SeriesToolError(ExitCode.PIN_MISMATCH, (
            f"pin mismatch: tag {pin.tag} ({wd.tag_kind(pin.tag)}) resolves to {got}, but the series "
            f"pins {pin.commit}.\nThe tag moved upstream (or --repo is another repository). Refusing: "
            "a tag is a label, the commit is the pin. If the new commit is intended, review it and "
            f"carry the series onto it with `apply.py rebase --onto {pin.tag}`."))
    if not wd.has_object(pin.commit):
        raise SeriesToolError(ExitCode.PIN_MISMATCH, f"pinned commit {pin.commit} is missing in {wd.path}")


def fetch_and_verify(wd: Workdir, inv: Invocation, series: Series, *, fetch: bool) -> None:
    if fetch:
        wd.fetch_tag(inv.source(series), series.pin.tag, shallow=inv.shallow)
    verify_pin(wd, series.pin)


def wanted(series: Series) -> list[dict]:
    return [{"name": name, "sha256": sha256_file(series.patch_path(name))} for name in series.names]


def _same(applied: list[dict], want: list[dict]) -> bool:
    return [(a["name"], a["sha256"]) for a in applied] == [(w["name"], w["sha256"]) for w in want]


def failure_report(series: Series, inv: Invocation, index: int, result: GitResult,
                   applied: list[str], base: str, conflicts: list[str] = ()) -> str:
    """Everything a maintainer needs when patch number `index` did not apply."""
    name = series.names[index]
    info = read_patch(series.patch_path(name))
    lines = [f"patch {index + 1} of {len(series.names)}, {name}, does not apply to {base}:",
             f"  files: {', '.join(info.files) or '(none)'}"]
    for path, line in FAILED_AT_RE.findall(result.output):
        hunk = hunk_at(info, path, int(line))
        if hunk is not None:
            lines.append(f"  failing hunk in {path}: {hunk.header}")
            lines += [f"      {text}" for text in hunk.lines[:12]]
    for path in conflicts:
        for hunk in (h for h in info.hunks if h.file == path):
            lines.append(f"  conflicting hunk in {path}: {hunk.header}")
            lines += [f"      {text}" for text in hunk.lines[:12]]
    lines.append("git says:")
    lines += [f"  {text}" for text in result.output.splitlines()
              if text.strip() and not text.startswith(GIT_AM_ADVICE)]
    lines.append(f"applied: {', '.join(applied) if applied else 'none'} "
                 f"(branch {BRANCH} in {inv.workdir} stops there)")
    lines.append(f"not applied: {', '.join(series.names[index:])}")
    return "\n".join(lines)


def _recovery(inv: Invocation, series: Series, name: str) -> str:
    return "\n".join([
        "apply never fuzzes: the patch must match the pinned tree exactly. To recover, either",
        f"  carry the series with a 3-way merge and resolve the conflict:\n    {inv.command('rebase', '--onto', series.pin.tag)}",
        f"    then edit the files, `{inv.git_command('add')} <files>`, and one of",
        f"    {inv.command('rebase', '--continue')}   # keep your resolution, re-export the series",
        f"    {inv.command('rebase', '--skip')}       # drop {name} from the series",
        f"    {inv.command('rebase', '--abort')}      # back to where you were; series untouched",
        f"  or fix {series.patch_path(name)} and run {inv.command()} again.",
    ])


def apply_patches(wd: Workdir, series: Series, inv: Invocation, stamp: dict, start: int) -> None:
    """git am each patch from `start` on, one at a time, recording progress in the stamp."""
    for index in range(start, len(series.names)):
        name = series.names[index]
        path = series.patch_path(name)
        result = wd.am(path, three_way=False)
        if not result.ok:
            report = failure_report(series, inv, index, result, [a["name"] for a in stamp["applied"]],
                                    f"{series.pin.tag} ({series.pin.commit[:12]})")
            wd.am_control("abort")
            raise SeriesToolError(ExitCode.PATCH_FAILED, report + "\n" + _recovery(inv, series, name))
        head = wd.head()
        stamp["applied"].append({"name": name, "sha256": sha256_file(path), "commit": head})
        stamp["head"] = head
        wd.write_stamp(stamp)
        say(f"applied {name}")


def guard_series_branch(wd: Workdir, inv: Invocation, pin: Pin, stamp: dict | None) -> str | None:
    """The series branch's tip; refuse when it holds commits this tool did not make."""
    branch_tip = wd.resolve(f"refs/heads/{BRANCH}")
    ours = {pin.commit, stamp.get("head") if stamp else None}
    if branch_tip is not None and branch_tip not in ours:
        raise SeriesToolError(ExitCode.BAD_STATE, (
            f"branch {BRANCH} in {wd.path} holds commits apply.py did not make (your unexported "
            f"work?); refusing to overwrite it. Keep them: {inv.command('export')}; or drop them: "
            f"{inv.git_command('checkout', '--detach')} && {inv.git_command('branch', '-D', BRANCH)}"))
    return branch_tip


def run_apply(inv: Invocation, upstream_tag: str | None, fetch: bool) -> int:
    series = inv.series()
    require_structure(series)
    if upstream_tag and upstream_tag != series.pin.tag:
        raise SeriesToolError(ExitCode.PIN_MISMATCH, (
            f"--upstream {upstream_tag}: the series at {series.path} pins {series.pin.tag}. To move "
            f"the series to {upstream_tag}, run `apply.py rebase --onto {upstream_tag}`."))
    if fetch:
        require_reachable(inv.source(series))
    elif not (inv.workdir / ".git").exists():
        raise SeriesToolError(ExitCode.BAD_STATE, f"--no-fetch: no workdir at {inv.workdir} yet")
    wd = Workdir.open_or_init(inv.workdir)
    ensure_quiet(wd, inv)
    fetch_and_verify(wd, inv, series, fetch=fetch)
    pin = series.pin
    want = wanted(series)
    stamp = wd.read_stamp()
    head = wd.head()
    if stamp and stamp.get("pin") == pin.commit and _same(stamp.get("applied", []), want) \
            and head == stamp.get("head"):
        say(f"up to date: {len(want)} patches applied on {pin.tag} ({pin.commit[:12]}) "
            f"in {wd.path}")
        require_no_clash(wd.path, series, series.names, inv, mode=APPLY, tag=pin.tag)
        return ExitCode.OK
    branch_tip = guard_series_branch(wd, inv, pin, stamp)
    start = 0
    applied = stamp.get("applied", []) if stamp else []
    if stamp and stamp.get("pin") == pin.commit and branch_tip == stamp.get("head") \
            and _same(applied, want[:len(applied)]):
        start = len(applied)          # a prefix is already there: continue from it
        wd.must("checkout", "-q", BRANCH)
    else:
        wd.must("checkout", "-q", "-B", BRANCH, pin.commit)
        stamp = {"pin": pin.commit, "tag": pin.tag, "applied": [], "head": pin.commit}
        wd.write_stamp(stamp)
    apply_patches(wd, series, inv, stamp, start)
    say(f"applied {len(want) - start} of {len(want)} patches on {pin.tag} ({pin.commit[:12]}) in "
        f"{wd.path}, branch {BRANCH}")
    require_no_clash(wd.path, series, series.names, inv, mode=APPLY, tag=pin.tag)
    return ExitCode.OK


def run_status(inv: Invocation) -> int:
    """Pin against checkout, patches against series, dirty tree, work in flight. Always exit 0
    unless the series itself cannot be read."""
    series = inv.series()
    pin = series.pin
    say(f"series:  {series.path} ({len(series.names)} patches)")
    say(f"pin:     {pin.tag} {pin.commit} ({pin.url})")
    if not (inv.workdir / ".git").exists():
        say(f"workdir: {inv.workdir} does not exist yet (run {inv.command()})")
        return ExitCode.OK
    wd = Workdir(inv.workdir)
    head = wd.head()
    tag_commit = wd.resolve(f"refs/tags/{pin.tag}")
    say(f"workdir: {wd.path} on {wd.current_branch() or 'detached HEAD'} at {head or '(no commits)'}"
        + (" (shallow)" if wd.is_shallow() else ""))
    if tag_commit is None:
        say(f"tag:     {pin.tag} not fetched here")
    else:
        verdict = "matches the pin" if tag_commit == pin.commit else "DOES NOT match the pin (moved?)"
        say(f"tag:     {pin.tag} -> {tag_commit} here: {verdict}")
    stamp = wd.read_stamp() or {}
    applied = {a["name"]: a for a in stamp.get("applied", [])} if stamp.get("pin") == pin.commit else {}
    tool_head = stamp.get("head") == head
    for item in wanted(series) if not _missing(series) else [{"name": n, "sha256": ""} for n in series.names]:
        done = applied.get(item["name"])
        if done is None:
            state = "not applied"
        elif done["sha256"] != item["sha256"]:
            state = "applied, but the file changed since (re-run apply)"
        else:
            state = "applied"
        say(f"  {item['name']}: {state}")
    if head and not tool_head and stamp:
        extra = wd.commits_since(stamp.get("head", pin.commit)) if wd.is_ancestor(stamp.get("head", pin.commit)) else []
        say(f"HEAD moved since apply.py last applied: {len(extra)} commit(s) not exported"
            if extra else "HEAD is not where apply.py left it")
    dirty = wd.dirty_files()
    say(f"tree:    {'dirty: ' + ', '.join(dirty) if dirty else 'clean'}")
    say("families (in the checkout as it is now):")
    print_families(scan_families(wd.path), kit_families(series, series.names), indent="  ")
    if RebaseState.exists(wd):
        state = RebaseState.load(wd)
        where = "a model family clash, after the last patch" if state.clash else state.current
        say(f"in progress: series rebase onto {state.onto_tag}, stopped at {where}")
    elif wd.am_in_progress():
        say("in progress: git am (run `git am --abort` or finish it)")
    elif wd.git_rebase_in_progress():
        say("in progress: git rebase")
    return ExitCode.OK


def _missing(series: Series) -> bool:
    return any(not series.patch_path(n).is_file() for n in series.names)
