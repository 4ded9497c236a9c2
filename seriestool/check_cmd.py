"""`check`: lint the series; where the upstream is reachable, also apply it into a temporary
workdir, export, and compare byte for byte. Where it is not, say exactly what went unchecked."""
from __future__ import annotations

import tempfile
from pathlib import Path

from .apply_cmd import apply_patches, verify_pin
from .context import Invocation, note, say
from .errors import ExitCode, SeriesToolError
from .family_check import CHECK, require_no_clash
from .git_ops import BRANCH, Workdir
from .lint import full_lint
from .transport import probe


def run_check(inv: Invocation, offline: bool, require_upstream: bool) -> int:
    series = inv.series()
    problems = full_lint(series)
    if problems:
        for problem in problems:
            note(f"lint: {problem}")
        raise SeriesToolError(ExitCode.SERIES_INVALID, f"{len(problems)} problem(s) in {series.path} "
                              "and patches/ (listed above)")
    count = len(series.names)
    pin = series.pin
    say(f"lint: ok: {count} patch(es) present, each used once, well formed, headers complete "
        "with existing guard tests")
    source = inv.source(series)
    unchecked = (f"NOT checked against upstream: that {pin.tag} still resolves to {pin.commit[:12]}, "
                 f"that the {count} patch(es) apply to it, and that they equal a fresh export byte for "
                 "byte.")

    def skipped(reason: str) -> int:
        say(f"upstream: {reason}")
        say(unchecked)
        if require_upstream:
            raise SeriesToolError(ExitCode.UNREACHABLE, f"--require-upstream: {reason}")
        return ExitCode.OK

    if offline:
        return skipped("not contacted (--offline)")
    if source.is_remote:
        reason = probe(source.spec)
        if reason:
            return skipped(f"{source.spec} is unreachable ({reason})")
    with tempfile.TemporaryDirectory(prefix="glm53-check-") as tmp:
        wd = Workdir.open_or_init(Path(tmp) / "upstream")
        try:
            wd.fetch_tag(source, pin.tag, shallow=True)
        except SeriesToolError as exc:
            if exc.code != ExitCode.UNREACHABLE:
                raise
            return skipped(exc.message)
        verify_pin(wd, pin)
        wd.must("checkout", "-q", "-B", BRANCH, pin.commit)
        stamp = {"pin": pin.commit, "tag": pin.tag, "applied": [], "head": pin.commit}
        apply_patches(wd, series, inv, stamp, 0)
        require_no_clash(wd.path, series, series.names, inv, mode=CHECK, tag=pin.tag)
        stale = [item["name"] for item in stamp["applied"]
                 if wd.format_patch(item["commit"]) != series.patch_path(item["name"]).read_bytes()]
    if stale:
        raise SeriesToolError(ExitCode.STALE, "\n".join([
            f"{len(stale)} patches are stale (their bytes differ from a fresh normalized export): "
            + ", ".join(stale),
            "Refresh them (nothing else changes if the content is right):",
            f"  {inv.command()}", f"  {inv.command('export', with_repo=False)}",
            "  git diff -- patches/    # review, then commit series and patches/"]))
    say(f"upstream: {pin.tag} resolves to the pin {pin.commit[:12]} at {source.spec}; all {count} "
        "patch(es) apply and equal a fresh export byte for byte")
    return ExitCode.OK
