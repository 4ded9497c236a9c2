"""apply.py and the series tool against real git repositories built by the tests."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from seriestool.cli import main
from seriestool.errors import ExitCode
from series_fixtures import NAMES, Kit, Upstream, build_upstream, copy_upstream, git, make_kit, write

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Upstream:
    return build_upstream(tmp_path_factory.mktemp("series-upstream"))


@pytest.fixture
def kit(tmp_path: Path, upstream: Upstream) -> Kit:
    return make_kit(tmp_path / "kit", upstream)


def run(args: list[str], code: int = 0):
    result = CliRunner().invoke(main, args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == code, f"exit {result.exit_code} != {code}\n{result.output}"
    return result


def head(kit: Kit) -> str:
    return git(kit.workdir, "rev-parse", "HEAD")


def subjects(kit: Kit, base: str) -> list[str]:
    return git(kit.workdir, "log", "--reverse", "--format=%s", f"{base}..HEAD").splitlines()


# ---- apply -------------------------------------------------------------------------------

def test_clean_apply_one_commit_per_patch_on_the_pin(kit: Kit, upstream: Upstream) -> None:
    out = run(kit.args("apply")).output
    assert "applied 3 of 3 patches on v0.6.0" in out
    assert git(kit.workdir, "rev-parse", "HEAD~3") == upstream.a
    assert subjects(kit, upstream.a) == ["families: register the glm53 family",
                                         "cli: lift the two-rank limit", "README: fix a typo"]
    assert git(kit.workdir, "symbolic-ref", "--short", "HEAD") == "glm53-series"
    assert "TP_CHOICES = (1, 2, 4)" in (kit.workdir / "src/tensorfold/cli_args.py").read_text()
    assert git(kit.workdir, "status", "--porcelain") == ""


def test_rerun_is_up_to_date_and_commit_ids_are_reproducible(kit: Kit, tmp_path: Path) -> None:
    run(["--upstream", "v0.6.0", *kit.args()])          # the default command
    first = head(kit)
    out = run(kit.args("apply", "--upstream", "v0.6.0")).output
    assert "up to date: 3 patches applied on v0.6.0" in out
    assert head(kit) == first
    other = tmp_path / "other"
    run(kit.args("apply") + ["--workdir", str(other)])
    assert git(other, "rev-parse", "HEAD") == first    # same patches, same pin: same commits


def test_apply_continues_after_a_patch_is_appended(kit: Kit, upstream: Upstream) -> None:
    kit.series.write_text(kit.series.read_text().replace(NAMES[2] + "\n", ""))
    run(kit.args("apply"))
    kit.series.write_text(kit.series.read_text() + NAMES[2] + "\n")
    out = run(kit.args("apply")).output
    assert "applied 1 of 3 patches" in out
    assert len(subjects(kit, upstream.a)) == 3


def test_upstream_option_must_name_the_pinned_tag(kit: Kit) -> None:
    err = run(kit.args("apply", "--upstream", "v0.7.0"), ExitCode.PIN_MISMATCH).stderr
    assert "pins v0.6.0" in err and "rebase --onto v0.7.0" in err


def test_moved_annotated_tag_is_refused(kit: Kit, upstream: Upstream, tmp_path: Path) -> None:
    run(kit.args("apply"))
    moved = copy_upstream(upstream, tmp_path / "moved")
    git(moved, "tag", "-f", "-a", "v0.6.0", "-m", "re-tagged", upstream.a2)
    err = run(kit.args("apply", repo=moved), ExitCode.PIN_MISMATCH).stderr
    assert f"resolves to {upstream.a2}" in err and f"pins {upstream.a}" in err
    assert "annotated" in err and "moved" in err
    fresh = run(kit.args("apply", repo=moved) + ["--workdir", str(tmp_path / "fresh")],
                ExitCode.PIN_MISMATCH).stderr
    assert "pin mismatch" in fresh


def test_lightweight_tag_pin_applies_and_moved_lightweight_tag_is_refused(
        tmp_path: Path, upstream: Upstream) -> None:
    kit = make_kit(tmp_path / "kit", upstream, names=[NAMES[0]], tag="v0.6.1", commit=upstream.a2)
    run(kit.args("apply"))
    assert git(kit.workdir, "rev-parse", "HEAD~1") == upstream.a2
    moved = copy_upstream(upstream, tmp_path / "moved")
    git(moved, "tag", "-f", "v0.6.1", upstream.b)
    err = run(kit.args("apply", repo=moved), ExitCode.PIN_MISMATCH).stderr
    assert "(lightweight) resolves to " + upstream.b in err


def test_missing_tag_is_a_pin_error(tmp_path: Path, upstream: Upstream) -> None:
    kit = make_kit(tmp_path / "kit", upstream, names=[], tag="v9.9.9")
    err = run(kit.args("apply"), ExitCode.PIN_MISMATCH).stderr
    assert "tag v9.9.9 does not exist" in err


def test_dirty_workdir_is_refused(kit: Kit) -> None:
    run(kit.args("apply"))
    (kit.workdir / "src/tensorfold/server.py").write_text("# local edit\n")
    for args in (kit.args("apply"), kit.args("rebase", "--onto", "v0.7.0"), kit.args("export")):
        err = run(args, ExitCode.BAD_STATE).stderr
        assert "uncommitted changes" in err and "src/tensorfold/server.py" in err
    assert (kit.workdir / "src/tensorfold/server.py").read_text() == "# local edit\n"


def test_foreign_commits_on_the_series_branch_are_not_overwritten(kit: Kit) -> None:
    kit.series.write_text(kit.series.read_text().replace(NAMES[2] + "\n", ""))
    run(kit.args("apply"))
    write(kit.workdir, "NOTES", "mine\n")
    git(kit.workdir, "add", "NOTES")
    git(kit.workdir, "commit", "-qm", "my work")
    kit.series.write_text(kit.series.read_text() + NAMES[2] + "\n")
    for args in (kit.args("apply"), kit.args("rebase", "--onto", "v0.7.0")):
        err = run(args, ExitCode.BAD_STATE).stderr
        assert "did not make" in err and "export" in err
    assert subjects(kit, "HEAD~1") == ["my work"]


def test_patch_that_does_not_apply_reports_and_keeps_what_applied(kit: Kit, upstream: Upstream) -> None:
    path = kit.patches / NAMES[1]
    path.write_bytes(path.read_bytes().replace(b" # option block 7\n", b" # option block seven\n"))
    res = run(kit.args("apply"), ExitCode.PATCH_FAILED)
    err = res.stderr
    assert "patch 2 of 3, 0002-lift-two-rank-limit.patch, does not apply" in err
    assert "files: src/tensorfold/cli_args.py" in err
    assert "failing hunk in src/tensorfold/cli_args.py: @@" in err and "-TP_CHOICES = (1, 2)" in err
    assert "error: patch failed: src/tensorfold/cli_args.py" in err             # git's own message
    assert f"applied: {NAMES[0]}" in err and f"not applied: {NAMES[1]}, {NAMES[2]}" in err
    for command in ("rebase --onto v0.6.0", "rebase --continue", "rebase --skip", "rebase --abort"):
        assert command in err
    assert subjects(kit, upstream.a) == ["families: register the glm53 family"]
    assert not (kit.workdir / ".git" / "rebase-apply").exists()


def test_malformed_patch_file_is_named_before_anything_runs(kit: Kit) -> None:
    (kit.patches / "0004-bad.patch").write_text("this is not a patch\n")
    good = kit.patches / NAMES[0]
    (kit.patches / "0005-nodiff.patch").write_bytes(good.read_bytes().split(b"\ndiff --git")[0] + b"\n")
    kit.series.write_text(kit.series.read_text() + "0004-bad.patch\n0005-nodiff.patch\n")
    err = run(kit.args("apply"), ExitCode.SERIES_INVALID).stderr
    assert "0004-bad.patch: malformed patch: does not start with a git format-patch" in err
    assert "0005-nodiff.patch: malformed patch: contains no `diff --git` section" in err
    assert not kit.workdir.exists()


def test_series_naming_a_missing_file(kit: Kit) -> None:
    kit.series.write_text(kit.series.read_text() + "0009-missing.patch\n")
    err = run(kit.args("apply"), ExitCode.SERIES_INVALID).stderr
    assert f"{kit.series}:6: names 0009-missing.patch" in err and "does not exist" in err
    assert not kit.workdir.exists()


@pytest.mark.parametrize("line, problem", [
    ("upstream http://example.invalid/x v1 " + "a" * 40, "must be an https:// URL"),
    ("upstream ext::sh%20-c%20id v1 " + "a" * 40, "must be an https:// URL"),
    ("upstream https://example.invalid/x v1 abc123", "full 40-hex commit"),
    ("upstream https://example.invalid/x v1", "`upstream URL TAG COMMIT`"),
])
def test_malformed_pin_line(tmp_path: Path, upstream: Upstream, line: str, problem: str) -> None:
    kit = make_kit(tmp_path / "kit", upstream, names=[])
    kit.series.write_text(f"# c\n{line}\n")
    err = run(kit.args("check"), ExitCode.SERIES_INVALID).stderr
    assert f"{kit.series}:2:" in err and problem in err


# ---- transport --------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    "ext::sh -c touch% {marker}", "fd::17", "-uhack", "--upload-pack=touch {marker}",
    "ssh://example.invalid/x", "git://example.invalid/x", "http://example.invalid/x",
    "example.invalid:x/y", "https://",
])
def test_transport_tricks_are_refused(kit: Kit, tmp_path: Path, spec: str) -> None:
    marker = tmp_path / "pwned"
    err = run(kit.args("apply", repo=spec.format(marker=marker)), ExitCode.USAGE).stderr
    assert "refusing upstream" in err
    assert not marker.exists() and not kit.workdir.exists()


def test_file_url_allowed_only_explicitly(kit: Kit, upstream: Upstream, tmp_path: Path) -> None:
    run(kit.args("apply", repo=f"file://{upstream.path}"))
    bad = make_kit(tmp_path / "bad", upstream, names=[], url=f"file://{upstream.path}")
    assert "must be an https:// URL" in run(["check", "--series", str(bad.series)],
                                            ExitCode.SERIES_INVALID).stderr


# ---- check ---------------------------------------------------------------------------------

def test_check_passes_against_a_reachable_upstream(kit: Kit) -> None:
    out = run(kit.args("check")).output
    assert "lint: ok: 3 patch(es)" in out
    assert "all 3 patch(es) apply and equal a fresh export byte for byte" in out


def test_check_catches_a_stale_patch(kit: Kit, upstream: Upstream) -> None:
    (kit.patches / NAMES[0]).write_bytes(upstream.raw_patch_0001)   # diffstat + signature
    err = run(kit.args("check"), ExitCode.STALE).stderr
    assert f"1 patches are stale (their bytes differ from a fresh normalized export): {NAMES[0]}" in err
    assert "export" in err
    # the refresh it prints works
    run(kit.args("apply"))
    run(kit.args("export"))
    assert (kit.patches / NAMES[0]).read_bytes() == upstream.patches[NAMES[0]]
    run(kit.args("check"))


@pytest.mark.parametrize("names", [[], NAMES])
@pytest.mark.parametrize("url", ["https://127.0.0.1:9/TensorFold", "https://no-such-host.invalid/TF"])
def test_check_with_unreachable_upstream_says_what_was_not_checked(
        tmp_path: Path, upstream: Upstream, names: list[str], url: str) -> None:
    kit = make_kit(tmp_path / "kit", upstream, names=names, url=url)
    started = time.monotonic()
    out = run(["check", "--series", str(kit.series)]).output
    assert time.monotonic() - started < 6
    assert "is unreachable" in out
    assert f"NOT checked against upstream: that v0.6.0 still resolves to {upstream.a[:12]}" in out
    err = run(["check", "--require-upstream", "--series", str(kit.series)], ExitCode.UNREACHABLE).stderr
    assert "--require-upstream" in err


def test_check_lint_problems(kit: Kit, upstream: Upstream) -> None:
    (kit.patches / "0007-orphan.patch").write_bytes(upstream.patches[NAMES[0]])
    kit.series.write_text(kit.series.read_text() + NAMES[0] + "\n")
    bad = kit.patches / NAMES[2]
    bad.write_bytes(bad.read_bytes().replace(b"Not verified: nothing on a GPU.\n", b"")
                    .replace(b"tests/test_guard.py::test_guard", b"tests/test_guard.py::test_gone"))
    err = run(kit.args("check"), ExitCode.SERIES_INVALID).stderr
    assert "0007-orphan.patch: not listed" in err
    assert f"{NAMES[0]} is listed twice" in err
    assert "header incomplete: message lacks a `Not verified:` line" in err
    assert "has no test named test_gone" in err


def test_real_series_check_is_fast_and_clear() -> None:
    """The README's main job: `python apply.py check` on the kit's own series."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "apply.py"), "check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lint: ok" in out.stdout
    assert "NOT checked against upstream" in out.stdout or "equal a fresh export" in out.stdout
    assert time.monotonic() - started < 30


# ---- export ------------------------------------------------------------------------------

def test_export_is_byte_identical_across_runs_and_user_config(kit: Kit, upstream: Upstream,
                                                           tmp_path: Path, monkeypatch) -> None:
    hostile = tmp_path / "gitconfig"
    hostile.write_text("[format]\n\tsignature = evil\n\tnumbered = true\n\tsubjectPrefix = HACK\n"
                       "[diff]\n\tnoprefix = true\n\tcontext = 7\n\talgorithm = histogram\n"
                       "[core]\n\tabbrev = 7\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(hostile))
    monkeypatch.setenv("HOME", str(tmp_path))
    run(kit.args("apply"))
    git(kit.workdir, "config", "diff.noprefix", "true")
    git(kit.workdir, "config", "format.signature", "local")
    before = kit.snapshot()
    out = run(kit.args("export")).output
    assert "series unchanged; 3 patch file(s) already up to date" in out
    mtimes = {p.name: p.stat().st_mtime_ns for p in kit.patches.iterdir()}
    run(kit.args("export"))
    assert kit.snapshot() == before
    assert {p.name: p.stat().st_mtime_ns for p in kit.patches.iterdir()} == mtimes
    data = (kit.patches / NAMES[1]).read_bytes()
    assert data.startswith(b"From 0000000000000000000000000000000000000000 Mon Sep 17")
    assert b"Subject: [PATCH] cli: lift" in data and b"\n-- \n" not in data and b"changed," not in data
    assert b"\nindex " + git(kit.workdir, "rev-parse", f"{upstream.a}:src/tensorfold/cli_args.py").encode() in data


def test_export_keeps_names_and_picks_up_an_amended_commit(kit: Kit) -> None:
    run(kit.args("apply"))
    write(kit.workdir, "README.md", "TensorFold\n\nThe fast the engine!\n\nSee docs.\n")
    git(kit.workdir, "commit", "-q", "--amend", "-a", "--no-edit")
    run(kit.args("export"))
    assert sorted(p.name for p in kit.patches.iterdir()) == sorted(NAMES)
    assert b"+The fast the engine!" in (kit.patches / NAMES[2]).read_bytes()
    out = run(kit.args("apply")).output
    assert "up to date" in out
    run(kit.args("check"))


# ---- new ---------------------------------------------------------------------------------

def test_new_turns_staged_changes_into_the_next_patch(kit: Kit, upstream: Upstream, tmp_path: Path) -> None:
    run(kit.args("apply"))
    write(kit.workdir, "src/tensorfold/server.py", "def serve():\n    return 'ready'\n")
    git(kit.workdir, "add", "src/tensorfold/server.py")
    msg = tmp_path / "msg"
    msg.write_text("server: say ready\n\nWhat: a clearer reply.\nWhy: the kit waits for it.\n"
                   "Verified: fixture.\nNot verified: GPU.\nGuarded-By: tests/test_guard.py::test_guard\n")
    run(kit.args("new", "server-ready", "-F", str(msg), "--author", "Ann Maintainer <ann@example.invalid>"))
    new = kit.patches / "0004-server-ready.patch"
    assert b"From: Ann Maintainer <ann@example.invalid>" in new.read_bytes()
    assert kit.series.read_text().splitlines()[-1] == "0004-server-ready.patch"
    assert "up to date: 4 patches" in run(kit.args("apply")).output
    run(kit.args("check"))
    assert "nothing staged" in run(kit.args("new", "again"), ExitCode.BAD_STATE).stderr


# ---- rebase ------------------------------------------------------------------------------

def start_conflict(kit: Kit) -> dict[str, bytes]:
    run(kit.args("apply"))
    before = kit.snapshot()
    res = run(kit.args("rebase", "--onto", "v0.7.0"), ExitCode.PATCH_FAILED)
    assert "CONFLICT: rebase stopped at 0002-lift-two-rank-limit.patch" in res.stderr
    assert "0001-register-glm53-family.patch: applied" in res.stdout
    assert "rebase --continue" in res.stderr and "rebase --skip" in res.stderr
    assert kit.snapshot() == before
    assert "stopped at 0002-lift-two-rank-limit.patch" in run(kit.args("status")).output
    assert "rebase is in progress" in run(kit.args("apply"), ExitCode.BAD_STATE).stderr
    return before


def test_rebase_conflict_continue_absorbed_and_new_pin(kit: Kit, upstream: Upstream) -> None:
    start_conflict(kit)
    assert "still not resolved" in run(kit.args("rebase", "--continue"), ExitCode.PATCH_FAILED).stderr
    text = (kit.workdir / "src/tensorfold/cli_args.py").read_text()
    assert "<<<<<<<" in text
    write(kit.workdir, "src/tensorfold/cli_args.py", CLI_RESOLVED)
    git(kit.workdir, "add", "src/tensorfold/cli_args.py")
    out = run(kit.args("rebase", "--continue")).output
    assert "0002-lift-two-rank-limit.patch: applied after resolving a conflict" in out
    assert "absorbed upstream (dropped from the series): 0003-fix-readme-typo.patch" in out
    assert re.search(r"1: +[0-9a-f]+ = 1: +[0-9a-f]+ families: register", out)
    assert f"upstream https://example.invalid/TensorFold v0.7.0 {upstream.b}" in kit.series.read_text()
    assert sorted(p.name for p in kit.patches.iterdir()) == NAMES[:2]
    assert b"+TP_CHOICES = (1, 2, 4, 8)" in (kit.patches / NAMES[1]).read_bytes()
    assert "up to date: 2 patches applied on v0.7.0" in run(kit.args("apply")).output
    run(kit.args("check"))


CLI_RESOLVED = "".join(f"# option block {i}\n" for i in range(8)) + \
    "TP_CHOICES = (1, 2, 4, 8)\nRANK_CHOICES = (0, 1, 2, 3)\n" + "".join(f"# tail {i}\n" for i in range(8))


def test_rebase_conflict_skip_drops_the_patch(kit: Kit, upstream: Upstream) -> None:
    start_conflict(kit)
    out = run(kit.args("rebase", "--skip")).output
    assert "0002-lift-two-rank-limit.patch: skipped" in out
    assert kit.series.read_text().splitlines()[-1] == NAMES[0]
    assert sorted(p.name for p in kit.patches.iterdir()) == NAMES[:1]
    assert f"v0.7.0 {upstream.b}" in kit.series.read_text()


def test_rebase_abort_leaves_series_and_patches_untouched(kit: Kit) -> None:
    before = start_conflict(kit)
    tip = git(kit.workdir, "rev-parse", "glm53-series")
    out = run(kit.args("rebase", "--abort")).output
    assert "series and patches/ were not touched" in out
    assert kit.snapshot() == before
    assert head(kit) == tip and git(kit.workdir, "symbolic-ref", "--short", "HEAD") == "glm53-series"
    assert git(kit.workdir, "status", "--porcelain") == ""
    assert "no series rebase in progress" in run(kit.args("rebase", "--continue"), ExitCode.BAD_STATE).stderr
    assert "up to date" in run(kit.args("apply")).output


def test_rebase_onto_tag_that_absorbed_a_patch(kit: Kit, upstream: Upstream) -> None:
    out = run(kit.args("rebase", "--onto", "v0.6.1")).output     # lightweight tag, no conflict
    assert "0003-fix-readme-typo.patch: absorbed upstream" in out
    assert "range-diff: skipped" in out                          # no prior apply in this workdir
    assert f"v0.6.1 {upstream.a2}" in kit.series.read_text()
    assert kit.series.read_text().splitlines()[-2:] == NAMES[:2]
    assert not (kit.patches / NAMES[2]).exists()
    run(kit.args("check"))


def test_rebase_in_a_shallow_clone_that_lacks_blobs(kit: Kit, upstream: Upstream) -> None:
    before = kit.snapshot()
    err = run(kit.args("rebase", "--onto", "v0.7.0", "--shallow", repo=f"file://{upstream.path}"),
              ExitCode.BAD_STATE).stderr
    assert "0002-lift-two-rank-limit.patch needs a 3-way merge" in err
    assert "shallow clone that lacks the blobs" in err and "fetch --unshallow" in err
    assert "lacks necessary blobs" in err                             # git's own words
    assert kit.snapshot() == before
    assert not (kit.workdir / ".git" / "rebase-apply").exists()
    assert not (kit.workdir / ".git" / "glm53-kit-rebase.json").exists()


def test_rebase_usage_errors(kit: Kit) -> None:
    assert "exactly one of" in run(kit.args("rebase"), ExitCode.USAGE).output
    assert "exactly one of" in run(kit.args("rebase", "--onto", "v0.7.0", "--abort"), ExitCode.USAGE).output


def test_status_reports_pin_patches_and_dirt(kit: Kit) -> None:
    assert "does not exist yet" in run(kit.args("status")).output
    run(kit.args("apply"))
    (kit.workdir / "README.md").write_text("edited\n")
    out = run(kit.args("status")).output
    assert "tag:     v0.6.0 -> " in out and "matches the pin" in out
    assert f"  {NAMES[2]}: applied" in out
    assert "dirty: README.md" in out


def test_apply_fails_fast_when_the_upstream_is_unreachable_and_no_fetch_works_offline(
        tmp_path: Path, upstream: Upstream) -> None:
    kit = make_kit(tmp_path / "kit", upstream, url="https://127.0.0.1:9/TensorFold")
    started = time.monotonic()
    err = run(["apply", "--series", str(kit.series)], ExitCode.UNREACHABLE).stderr
    assert time.monotonic() - started < 6
    assert "is unreachable" in err and "--repo PATH" in err
    assert not kit.workdir.exists()                               # nothing created
    run(kit.args("apply"))                                        # from the local mirror
    out = run(["apply", "--no-fetch", "--series", str(kit.series)]).output
    assert "up to date: 3 patches" in out


def test_continue_with_upstreams_side_reports_the_patch_absorbed(kit: Kit, upstream: Upstream) -> None:
    start_conflict(kit)
    git(kit.workdir, "checkout", "HEAD", "--", "src/tensorfold/cli_args.py")   # keep upstream's version
    out = run(kit.args("rebase", "--continue")).output
    assert "0002-lift-two-rank-limit.patch: absorbed upstream (resolved to nothing)" in out
    assert kit.series.read_text().splitlines()[-1] == NAMES[0]
    assert not (kit.patches / NAMES[1]).exists()


def test_rebase_onto_the_same_tag_repairs_a_patch_apply_rejects(kit: Kit, upstream: Upstream) -> None:
    """The recovery apply prints: a patch whose context drifted is carried by a 3-way merge and
    re-exported; the pin stays."""
    path = kit.patches / NAMES[1]
    path.write_bytes(path.read_bytes().replace(b" # option block 7\n", b" # option block seven\n"))
    run(kit.args("apply"), ExitCode.PATCH_FAILED)
    err = run(kit.args("rebase", "--onto", "v0.6.0"), ExitCode.PATCH_FAILED).stderr
    assert "Did you hand edit your patch?" in err and "no conflict markers" in err
    write(kit.workdir, "src/tensorfold/cli_args.py", CLI_RESOLVED.replace("4, 8)", "4)"))
    git(kit.workdir, "add", "src/tensorfold/cli_args.py")
    out = run(kit.args("rebase", "--continue")).output
    assert f"{NAMES[1]}: applied after resolving a conflict" in out
    assert path.read_bytes() == upstream.patches[NAMES[1]]
    assert f"v0.6.0 {upstream.a}" in kit.series.read_text()
    run(kit.args("check"))


def test_bare_mirror_works_as_repo(kit: Kit, upstream: Upstream, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror.git"
    git(tmp_path, "clone", "-q", "--mirror", str(upstream.path), str(mirror))
    run(kit.args("apply", repo=mirror))
    assert git(kit.workdir, "rev-parse", "HEAD~3") == upstream.a


def test_interrupted_git_am_is_refused(kit: Kit) -> None:
    run(kit.args("apply"))
    git(kit.workdir, "checkout", "-q", "--detach", "HEAD~2")
    result = subprocess.run(["git", "am", str(kit.patches / NAMES[0])], cwd=kit.workdir,
                            capture_output=True, text=True)
    assert result.returncode != 0                                  # already applied there: stops
    err = run(kit.args("apply"), ExitCode.BAD_STATE).stderr
    assert "git am or rebase is in progress" in err and "am --abort" in err
    assert "in progress: git am" in run(kit.args("status")).output


def test_new_without_message_leaves_a_template_that_check_rejects(kit: Kit) -> None:
    run(kit.args("apply"))
    write(kit.workdir, "src/tensorfold/server.py", "def serve():\n    return 'x'\n")
    git(kit.workdir, "add", "-A")
    out = run(kit.args("new", "draft")).output
    assert "fill in What/Why/Verified/Not verified/Guarded-By" in out
    err = run(kit.args("check"), ExitCode.SERIES_INVALID).stderr
    assert "0004-draft.patch: header incomplete: `What:` is empty or TODO" in err
    assert "bad name" not in err
    assert "use lowercase" in run(kit.args("new", "Bad_Name"), ExitCode.USAGE).stderr


def test_continue_after_a_hand_run_am_abort_is_refused_then_abort_restores(kit: Kit) -> None:
    before = start_conflict(kit)
    git(kit.workdir, "am", "--abort")
    err = run(kit.args("rebase", "--continue"), ExitCode.BAD_STATE).stderr
    assert "no longer in progress" in err
    run(kit.args("rebase", "--abort"))
    assert kit.snapshot() == before
    assert "up to date" in run(kit.args("apply")).output
