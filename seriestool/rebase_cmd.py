"""`rebase --onto TAG`: carry the series onto another upstream tag with 3-way merges.

Patches are applied one `git am --3way` at a time on a scratch branch, so the tool always knows
which patch stopped and which ones became empty (absorbed upstream). State lives in the
workdir's git dir; `series` and `patches/` are written only at the very end (patches first,
the series with its new pin last), so --abort has nothing of theirs to undo.
"""
from __future__ import annotations

from .apply_cmd import LACKS_BLOBS, failure_report, guard_series_branch
from .context import Invocation, ensure_quiet, say
from .errors import ExitCode, SeriesToolError
from .families import family_of_path, scan_families
from .family_check import REBASE, kit_families, require_no_clash
from .export import record_stamp, write_export, report
from .git_ops import BRANCH, REBASE_BRANCH, Workdir, sha256_file
from .lint import require_structure
from .series import Pin, Series
from .rebase_state import RebaseState
from .transport import require_reachable

def fingerprint(series: Series) -> dict[str, str]:
    prints = {"series": sha256_file(series.path)}
    for name in series.names:
        prints[name] = sha256_file(series.patch_path(name))
    return prints


def start(inv: Invocation, onto: str, drop: tuple[str, ...] = ()) -> int:
    series = inv.series()
    require_structure(series)
    unknown = [name for name in drop if name not in series.names]
    if unknown:
        raise SeriesToolError(ExitCode.USAGE, f"--drop {', '.join(unknown)}: not in {series.path} "
                              f"(its patches: {', '.join(series.names) or 'none'})")
    source = inv.source(series)
    require_reachable(source)
    wd = Workdir.open_or_init(inv.workdir)
    ensure_quiet(wd, inv)
    guard_series_branch(wd, inv, series.pin, wd.read_stamp())
    wd.fetch_tag(source, onto, shallow=inv.shallow)
    onto_commit = wd.resolve(f"refs/tags/{onto}")
    if onto_commit is None:
        raise SeriesToolError(ExitCode.PIN_MISMATCH, f"tag {onto} did not resolve to a commit")
    stamp = wd.read_stamp() or {}
    old_tip = stamp.get("head") if stamp.get("pin") == series.pin.commit and \
        [a["name"] for a in stamp.get("applied", [])] == series.names else None
    state = RebaseState(series_path=str(series.path), onto_tag=onto, onto_commit=onto_commit,
                        old_pin=series.pin.commit, old_tip=old_tip,
                        orig_ref=wd.current_branch() or wd.head() or "",
                        names=series.names, fingerprint=fingerprint(series),
                        dropped=list(dict.fromkeys(drop)))
    wd.must("checkout", "-q", "-B", REBASE_BRANCH, onto_commit)
    state.save(wd)
    say(f"rebasing {len(series.names)} patches from {series.pin.tag} ({series.pin.commit[:12]}) "
        f"onto {onto} ({onto_commit[:12]}, {wd.tag_kind(onto)} tag)")
    return _advance(wd, inv, series, state)


def _load(inv: Invocation) -> tuple[Workdir, Series, RebaseState]:
    wd = Workdir.open_existing(inv.workdir)
    if not RebaseState.exists(wd):
        raise SeriesToolError(ExitCode.BAD_STATE, f"no series rebase in progress in {wd.path} "
                              f"(start one with {inv.command('rebase', '--onto', 'TAG')})")
    state = RebaseState.load(wd)
    series = inv.series()
    if str(series.path) != state.series_path:
        raise SeriesToolError(ExitCode.BAD_STATE, f"the rebase in progress is for {state.series_path}, "
                              f"not {series.path}; pass --series {state.series_path}")
    return wd, series, state


def _check_untouched(series: Series, state: RebaseState, inv: Invocation) -> None:
    if fingerprint(series) != state.fingerprint:
        raise SeriesToolError(ExitCode.BAD_STATE, f"{series.path} or its patches changed while the "
                              f"rebase was stopped; abort it ({inv.command('rebase', '--abort')}) "
                              "and start again")


def resume(inv: Invocation, action: str) -> int:
    wd, series, state = _load(inv)
    if action == "abort":
        return _abort(wd, inv, state)
    _check_untouched(series, state, inv)
    if state.clash:
        if action == "skip":
            raise SeriesToolError(ExitCode.USAGE, (
                "every patch is through; the rebase stopped at a model family clash, so there is no "
                f"patch to skip. To leave a patch out: {inv.command('rebase', '--abort')}, then "
                f"{inv.command('rebase', '--onto', state.onto_tag, '--drop', 'NAME')}"))
        _fold_staged(wd, inv, series, state)
        return _finish(wd, inv, series, state)
    if state.current is None:
        return _advance(wd, inv, series, state)
    name = state.current
    resolved_to_nothing = False
    if not wd.am_in_progress() and action == "continue" and wd.head() == state.head_before:
        raise SeriesToolError(ExitCode.BAD_STATE, (
            f"git am is no longer in progress and nothing was committed for {name} (was `git am "
            f"--abort` or `--skip` run by hand?). Drop the patch with {inv.command('rebase', '--skip')}"
            f" or stop with {inv.command('rebase', '--abort')}."))
    if wd.am_in_progress():
        result = wd.am_control("continue" if action == "continue" else "skip")
        if not result.ok and action == "continue" and "No changes" in result.output \
                and not wd.conflicted_files() and wd.run("diff", "--cached", "--quiet").ok:
            # The resolution kept upstream's side entirely: the patch is absorbed upstream.
            resolved_to_nothing = wd.am_control("skip").ok
        elif not result.ok:
            raise SeriesToolError(ExitCode.PATCH_FAILED, (
                f"{name} is still not resolved:\n{result.output}\nEdit the files, "
                f"`{inv.git_command('add')} <files>`, then {inv.command('rebase', '--continue')} "
                f"(or {inv.command('rebase', '--skip')} / {inv.command('rebase', '--abort')})"))
    moved = wd.head() != state.head_before and not resolved_to_nothing
    if action == "skip" or not moved:
        state.outcomes[name] = "skipped" if action == "skip" else "absorbed upstream (resolved to nothing)"
        if wd.am_in_progress():
            wd.am_control("skip")
        if wd.head() != state.head_before:   # committed by hand, then skipped: drop it for real
            wd.must("reset", "-q", "--hard", state.head_before)
    else:
        state.outcomes[name] = "applied after resolving a conflict"
        state.commits[name] = wd.head()
    state.current = None
    state.index += 1
    state.save(wd)
    say(f"{name}: {state.outcomes[name]}")
    return _advance(wd, inv, series, state)


def _advance(wd: Workdir, inv: Invocation, series: Series, state: RebaseState) -> int:
    while state.index < len(state.names):
        name = state.names[state.index]
        if name in state.dropped:
            state.outcomes[name] = "dropped (--drop)"
            say(f"{name}: {state.outcomes[name]}")
            state.index += 1
            state.save(wd)
            continue
        before = wd.head()
        result = wd.am(series.patch_path(name), three_way=True)
        if result.ok:
            if wd.head() == before:
                state.outcomes[name] = "absorbed upstream (empty on the new base)"
            else:
                state.outcomes[name] = "applied"
                state.commits[name] = wd.head()
            say(f"{name}: {state.outcomes[name]}")
            state.index += 1
            state.save(wd)
            continue
        if LACKS_BLOBS in result.output:
            wd.am_control("abort")
            _abort(wd, inv, state, quiet=True)
            raise SeriesToolError(ExitCode.BAD_STATE, (
                f"{name} needs a 3-way merge, but {wd.path} is a shallow clone that lacks the blobs "
                f"the patch was made against (its pre-image at {state.old_pin[:12]}):\n"
                f"{result.output}\nNothing was changed (rebase aborted). Fetch the history, then "
                f"run the rebase again:\n  {inv.git_command('fetch', '--unshallow', 'upstream')}\n"
                f"  or: {inv.git_command('fetch', '--depth=1', 'upstream', state.old_pin)}\n"
                f"  {inv.command('rebase', '--onto', state.onto_tag)}  (without --shallow)"))
        state.current = name
        state.head_before = before
        state.save(wd)
        report_text = failure_report(series, inv, state.index, result,
                                     [n for n in state.names[:state.index] if n in state.commits],
                                     f"{state.onto_tag} ({state.onto_commit[:12]})",
                                     conflicts=wd.conflicted_files())
        report_text = report_text.replace(f"branch {BRANCH}", f"branch {REBASE_BRANCH}")
        conflicts = wd.conflicted_files()
        by_hand = [] if conflicts else [
            "git could not merge this patch at all (no conflict markers were written; a patch "
            "edited by hand does not match the blobs in its index lines). Make its change by hand "
            f"(`{inv.git_command('apply', '--reject', str(series.patch_path(name)))}` applies what "
            "it can and leaves .rej files), then:"]
        raise SeriesToolError(ExitCode.PATCH_FAILED, "\n".join([
            f"CONFLICT: rebase stopped at {name}.", report_text, *by_hand,
            f"Resolve the conflicts in {wd.path}, `{inv.git_command('add')} <files>`, then:",
            f"  {inv.command('rebase', '--continue')}   # keep the resolution and go on",
            f"  {inv.command('rebase', '--skip')}       # drop {name} from the series",
            f"  {inv.command('rebase', '--abort')}      # back to {state.orig_ref[:40] or 'the start'}; "
            "series and patches/ untouched"]))
    return _finish(wd, inv, series, state)


def _stop_at_clash(wd: Workdir, inv: Invocation, series: Series, state: RebaseState) -> None:
    """Before anything is written: a family clash stops the rebase (resumable, exit 9)."""
    applied = [name for name in state.names if name in state.commits]
    try:
        require_no_clash(wd.path, series, applied, inv, mode=REBASE, tag=state.onto_tag,
                         dropped=tuple(state.dropped))
    except SeriesToolError as exc:
        if exc.code != ExitCode.FAMILY_CLASH:
            raise
        kit = kit_families(series, applied)
        clashing = [f.name for c in scan_families(wd.path).clashes for f in c.families if f.name in kit]
        state.clash, state.head_before = True, wd.head()
        state.fold_into = kit[clashing[0]] if clashing else None
        state.save(wd)
        raise
    if state.clash:
        state.clash = False
        state.save(wd)


def _fold_staged(wd: Workdir, inv: Invocation, series: Series, state: RebaseState) -> None:
    """At a clash stop, `--continue` folds the staged fix into the patch that owns it: the kit
    family's patch when a staged file is in a kit family, else the clashing family's patch."""
    if wd.head() != state.head_before:
        raise SeriesToolError(ExitCode.BAD_STATE, (
            f"HEAD in {wd.path} moved since the rebase stopped at the family clash; stage the fix "
            "instead of committing it. Turn your commits back into staged changes with\n  "
            f"{inv.git_command('reset', '--soft', state.head_before or 'HEAD')}\nthen "
            f"{inv.command('rebase', '--continue')}"))
    if not wd.run("diff", "--quiet").ok:
        raise SeriesToolError(ExitCode.BAD_STATE, (
            f"unstaged changes in {wd.path}: `{inv.git_command('add')} <files>` what belongs to the "
            f"fix, discard the rest ({inv.git_command('checkout', '--', '<files>')}), then "
            f"{inv.command('rebase', '--continue')}"))
    staged = wd.must("diff", "--cached", "--name-only").split()
    if not staged:
        return                  # nothing changed: the check runs again and says the same
    applied = [name for name in state.names if name in state.commits]
    owners = kit_families(series, applied)
    target = next((owners[f] for f in map(family_of_path, staged) if f in owners), state.fold_into)
    if target is None:
        raise SeriesToolError(ExitCode.BAD_STATE, (
            "no patch of the series registers a family in this clash, so there is no patch to fold "
            f"the staged change into; stop with {inv.command('rebase', '--abort')}"))
    target_commit = state.commits[target]
    wd.must("commit", "-q", "--no-verify", f"--fixup={target_commit}")
    fixup = wd.head()
    result = wd.run("rebase", "-q", "-i", "--autosquash", f"{target_commit}^",
                    env={"GIT_SEQUENCE_EDITOR": "true"})
    commits = wd.commits_since(state.onto_commit) if result.ok else []
    if not result.ok or len(commits) != len(applied):
        if wd.git_rebase_in_progress():
            wd.run("rebase", "--abort")
        wd.must("reset", "-q", "--hard", fixup)
        wd.must("reset", "-q", "--soft", "HEAD~1")     # the fix is staged again, as you left it
        raise SeriesToolError(ExitCode.BAD_STATE, (
            f"could not fold the staged change into {target} (a later patch conflicts with it, or "
            f"became empty):\n{result.output}\nYour change is staged again in {wd.path}; adjust it "
            f"and run {inv.command('rebase', '--continue')}, or {inv.command('rebase', '--abort')}"))
    state.commits = dict(zip(applied, commits))
    state.outcomes[target] = state.outcomes.get(target, "applied") + "; amended at the family clash"
    state.head_before = wd.head()
    state.save(wd)
    say(f"{target}: staged change folded in ({', '.join(staged)})")


def _finish(wd: Workdir, inv: Invocation, series: Series, state: RebaseState) -> int:
    _stop_at_clash(wd, inv, series, state)
    new_pin = Pin(series.pin.url, state.onto_tag, state.onto_commit)
    named = [(state.commits[name], name) for name in state.names if name in state.commits]
    # Move the series branch first (the commits are safe in git), then write files, series last.
    wd.must("checkout", "-q", "-B", BRANCH, wd.head())
    if wd.resolve(f"refs/heads/{REBASE_BRANCH}"):
        wd.must("branch", "-q", "-D", REBASE_BRANCH)
    result = write_export(wd, series, new_pin, named)
    record_stamp(wd, series, new_pin, named)
    RebaseState.path(wd).unlink()
    say("")
    say(f"rebased onto {state.onto_tag} ({state.onto_commit[:12]}):")
    for name in state.names:
        say(f"  {name}: {state.outcomes.get(name, '?')}")
    absorbed = [n for n in state.names if state.outcomes.get(n, "").startswith("absorbed")]
    dropped = [n for n in state.names if n in state.dropped]
    if dropped:
        say(f"dropped with --drop (removed from the series): {', '.join(dropped)}")
    if absorbed:
        say(f"absorbed upstream (dropped from the series): {', '.join(absorbed)}")
    _range_diff(wd, state)
    report(result, series)
    say(f"series now pins {state.onto_tag} {state.onto_commit}; review `git diff -- series patches/`, "
        f"run {inv.command('check', with_repo=True)} and the tests, then commit")
    return ExitCode.OK


def _range_diff(wd: Workdir, state: RebaseState) -> None:
    if not state.old_tip or not wd.has_object(state.old_tip):
        say("range-diff: skipped (the old series was not applied in this workdir before the rebase)")
        return
    result = wd.run("range-diff", "--no-color", "--no-patch",
                    f"{state.old_pin}..{state.old_tip}", f"{state.onto_commit}..HEAD")
    say("range-diff (old series vs new; '=' same change, '!' changed, '<' dropped):")
    for line in (result.stdout if result.ok else result.output).splitlines():
        say(f"  {line}")


def _abort(wd: Workdir, inv: Invocation, state: RebaseState, quiet: bool = False) -> int:
    if wd.am_in_progress():
        wd.am_control("abort")
    wd.must("reset", "-q", "--hard")
    if state.orig_ref and wd.resolve(state.orig_ref):
        wd.must("checkout", "-q", state.orig_ref)
    else:  # the workdir had no commits before: stay detached on the tag's commit
        wd.must("checkout", "-q", "--detach")
    if wd.resolve(f"refs/heads/{REBASE_BRANCH}"):
        wd.must("branch", "-q", "-D", REBASE_BRANCH)
    RebaseState.path(wd).unlink(missing_ok=True)
    if not quiet:
        say(f"rebase aborted: {wd.path} is back on {state.orig_ref or 'its previous state'}; "
            "series and patches/ were not touched")
    return ExitCode.OK
