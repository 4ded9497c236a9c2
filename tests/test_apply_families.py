"""The model family clash check of apply.py: the static scan, and apply/check/rebase/status
against real git repositories whose newer tags gain upstream's own glm_moe_dsa family."""
from __future__ import annotations

from pathlib import Path

import pytest

from seriestool.errors import ExitCode
from seriestool.families import family_of_path, scan_families
from series_fixtures import (FAMILIES, FULL_FAMILY, KIT_FAMILY, NAMES, Kit, Upstream, build_upstream,
                             copy_upstream, git, make_kit, write)
from test_apply import CLI_RESOLVED, run


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Upstream:
    return build_upstream(tmp_path_factory.mktemp("families-upstream"))


@pytest.fixture
def kit(tmp_path: Path, upstream: Upstream) -> Kit:
    return make_kit(tmp_path / "kit", upstream)


# ---- the static scan ---------------------------------------------------------------------

def test_scan_reads_lists_tuples_constants_imports_and_modules(tmp_path: Path) -> None:
    write(tmp_path, f"{FAMILIES}/__init__.py", "")
    write(tmp_path, f"{FAMILIES}/a_list/__init__.py", "MODEL_TYPES = ['x1', 'x2']\n")
    write(tmp_path, f"{FAMILIES}/b_tuple/__init__.py", "MODEL_TYPES: tuple[str, ...] = ('y',)\n")
    write(tmp_path, f"{FAMILIES}/c_const/__init__.py",
          "import os\nNAME = 'z'\nOLD = ('z_old',)\nMODEL_TYPES = frozenset((NAME,) + OLD)\n")
    write(tmp_path, f"{FAMILIES}/d_import/__init__.py", "from .meta.names import TYPES as MODEL_TYPES\n")
    write(tmp_path, f"{FAMILIES}/d_import/meta/__init__.py", "")
    write(tmp_path, f"{FAMILIES}/d_import/meta/names.py", "from ..base import BASE\nTYPES = [BASE]\n")
    write(tmp_path, f"{FAMILIES}/d_import/base.py", "BASE = 'x1'\n")   # not followed: `..` leaves meta
    write(tmp_path, f"{FAMILIES}/e_abs/__init__.py",
          "from tensorfold.families.e_abs.cfg import MODEL_TYPES\n")
    write(tmp_path, f"{FAMILIES}/e_abs/cfg.py", "MODEL_TYPES = 'w'\n")
    write(tmp_path, f"{FAMILIES}/f_module.py", "MODEL_TYPES = ('y', 'v')\n")
    write(tmp_path, f"{FAMILIES}/not_a_package/notes.txt", "no __init__.py: not a family\n")
    write(tmp_path, f"{FAMILIES}/_private/__init__.py", "MODEL_TYPES = ('x1',)\n")
    scan = scan_families(tmp_path)
    got = {f.name: f.model_types for f in scan.families}
    assert got == {"a_list": ("x1", "x2"), "b_tuple": ("y",), "c_const": ("z", "z_old"),
                   "d_import": (), "e_abs": ("w",), "f_module": ("y", "v")}
    by_name = {f.name: f for f in scan.families}
    assert by_name["c_const"].declared_in == f"{FAMILIES}/c_const/__init__.py:4"
    assert by_name["e_abs"].declared_in == f"{FAMILIES}/e_abs/cfg.py:1"
    assert "outside the family's package" in by_name["d_import"].problem    # relative level 2
    assert not by_name["d_import"].fatal
    assert [(c.model_type, [f.name for f in c.families]) for c in scan.clashes] == \
        [("y", ["b_tuple", "f_module"])]
    assert family_of_path(f"{FAMILIES}/f_module.py") == "f_module"
    assert family_of_path(f"{FAMILIES}/glm53/__init__.py") == "glm53"
    assert family_of_path(f"{FAMILIES}/__init__.py") is None and family_of_path("src/x.py") is None


def test_scan_reports_syntax_errors_and_dynamic_values_without_crashing(tmp_path: Path) -> None:
    write(tmp_path, f"{FAMILIES}/broken/__init__.py", "# ok\nMODEL_TYPES = (\n")
    write(tmp_path, f"{FAMILIES}/broken_sub/__init__.py", "from .cfg import MODEL_TYPES\n")
    write(tmp_path, f"{FAMILIES}/broken_sub/cfg.py", "def f(:\n")
    write(tmp_path, f"{FAMILIES}/dynamic/__init__.py", "MODEL_TYPES = tuple(load_types())\n")
    write(tmp_path, f"{FAMILIES}/none/__init__.py", "if True:\n    MODEL_TYPES = ('q',)\n")
    by_name = {f.name: f for f in scan_families(tmp_path).families}
    assert by_name["broken"].fatal and by_name["broken"].problem.startswith(
        f"{FAMILIES}/broken/__init__.py:2: syntax error")
    assert by_name["broken_sub"].fatal and f"{FAMILIES}/broken_sub/cfg.py:1: syntax error" in \
        by_name["broken_sub"].problem
    assert not by_name["dynamic"].fatal and "`load_types()` is not a literal" in by_name["dynamic"].problem
    assert "declares no MODEL_TYPES" in by_name["none"].problem
    assert scan_families(tmp_path / "nowhere").families == []


# ---- apply, status, check ------------------------------------------------------------------

def test_apply_on_the_old_tag_is_clean_and_status_lists_the_families(kit: Kit) -> None:
    out = run(kit.args("apply")).output
    assert "families: 3 found, 4 model type(s), no clash" in out
    status = run(kit.args("status")).output
    assert f"  glm53: glm_moe_dsa  (kit, {NAMES[0]}; {KIT_FAMILY}:1)" in status
    assert f"  glm5_next: glm5_next  (upstream; {FAMILIES}/glm5_next/__init__.py:1)" in status
    assert f"  llama: llama, llama3  (upstream; {FAMILIES}/llama/config.py:2)" in status
    assert "CLASH" not in status


def test_check_and_apply_report_a_clash_on_the_pinned_tag(tmp_path: Path, upstream: Upstream) -> None:
    kit = make_kit(tmp_path / "kit", upstream, names=[NAMES[0]], tag="v0.6.6", commit=upstream.d)
    err = run(kit.args("check"), ExitCode.FAMILY_CLASH).stderr
    assert "FAMILY CLASH: model_type 'glm_moe_dsa' is claimed by 2 families" in err
    assert f"glm53                {KIT_FAMILY}:1  (the kit's, from {NAMES[0]})" in err
    assert f"glm_moe_dsa_full     {FULL_FAMILY}:2  (upstream v0.6.6)" in err
    assert "found in a fresh apply" in err.lower() and "rebase --onto v0.6.6" in err
    err = run(kit.args("apply"), ExitCode.FAMILY_CLASH).stderr
    assert "FAMILY CLASH" in err and f"the applied tree in {kit.workdir}" in err
    assert "CLASH: 'glm_moe_dsa' claimed by glm53, glm_moe_dsa_full" in run(kit.args("status")).output


def test_syntax_error_in_an_upstream_family_is_reported(tmp_path: Path, upstream: Upstream) -> None:
    mirror = copy_upstream(upstream, tmp_path / "mirror")
    git(mirror, "checkout", "-q", "--detach", upstream.a)
    write(mirror, f"{FAMILIES}/broken/__init__.py", "MODEL_TYPES = (\n")
    git(mirror, "add", "-A")
    git(mirror, "commit", "-qm", "broken family")
    git(mirror, "tag", "v0.6.9")
    kit = make_kit(tmp_path / "kit", upstream, names=[NAMES[0]], tag="v0.6.9",
                   commit=git(mirror, "rev-parse", "HEAD"))
    result = run(kit.args("apply", repo=mirror), ExitCode.FAMILY_CLASH)
    assert f"BROKEN FAMILY FILE: {FAMILIES}/broken/__init__.py:1: syntax error" in result.stderr
    assert "Traceback" not in result.output
    assert "BROKEN: " in run(kit.args("status", repo=mirror)).output


# ---- rebase ------------------------------------------------------------------------------

def stop_at_clash(kit: Kit, tag: str = "v0.6.6", *extra: str) -> str:
    res = run(kit.args("rebase", "--onto", tag, *extra), ExitCode.FAMILY_CLASH)
    assert "FAMILY CLASH: model_type 'glm_moe_dsa' is claimed by 2 families" in res.stderr
    assert "series and patches/ are untouched" in res.stderr
    return res.stderr


def test_rebase_onto_a_tag_with_upstreams_family_stops_then_drop(kit: Kit, upstream: Upstream) -> None:
    run(kit.args("apply"))
    before = kit.snapshot()
    err = stop_at_clash(kit)
    for expected in (f"rebase --onto v0.6.6 --drop {NAMES[0]}", f"rm -r -q {FAMILIES}/glm_moe_dsa_full",
                     f"add {KIT_FAMILY}", "rebase --continue", "rebase --abort",
                     f"(the kit's, from {NAMES[0]})", f"{FULL_FAMILY}:2  (upstream v0.6.6)"):
        assert expected in err, expected
    assert kit.snapshot() == before                                   # no new pin, no patch written
    assert (kit.workdir / FULL_FAMILY).is_file() and (kit.workdir / KIT_FAMILY).is_file()
    assert "stopped at a model family clash" in run(kit.args("status")).output
    assert "no patch to skip" in run(kit.args("rebase", "--skip"), ExitCode.USAGE).stderr
    stop_at_clash_again = run(kit.args("rebase", "--continue"), ExitCode.FAMILY_CLASH).stderr
    assert "FAMILY CLASH" in stop_at_clash_again                       # nothing changed: same stop
    run(kit.args("rebase", "--abort"))
    assert kit.snapshot() == before
    assert "up to date" in run(kit.args("apply")).output
    out = run(kit.args("rebase", "--onto", "v0.6.6", "--drop", NAMES[0])).output
    assert f"{NAMES[0]}: dropped (--drop)" in out and "no clash" in out
    assert kit.series.read_text().splitlines()[-1] == NAMES[1]         # 0003 absorbed, 0001 dropped
    assert f"v0.6.6 {upstream.d}" in kit.series.read_text()
    assert not (kit.patches / NAMES[0]).exists()
    assert "not in" in run(kit.args("rebase", "--onto", "v0.6.6", "--drop", "0009-x.patch"),
                           ExitCode.USAGE).stderr


def test_replace_upstreams_registration_is_folded_into_the_kit_patch(kit: Kit, upstream: Upstream) -> None:
    stop_at_clash(kit)
    git(kit.workdir, "rm", "-r", "-q", f"{FAMILIES}/glm_moe_dsa_full")
    out = run(kit.args("rebase", "--continue")).output
    assert f"{NAMES[0]}: staged change folded in ({FULL_FAMILY})" in out
    assert f"{NAMES[0]}: applied; amended at the family clash" in out
    assert f"v0.6.6 {upstream.d}" in kit.series.read_text()
    patch = (kit.patches / NAMES[0]).read_bytes()
    assert f"deleted file mode 100644".encode() in patch and FULL_FAMILY.encode() in patch
    assert b"+TP_CHOICES = (1, 2, 4)" in (kit.patches / NAMES[1]).read_bytes()   # later patch kept
    assert git(kit.workdir, "log", "--format=%s", f"{upstream.d}..HEAD").splitlines() == \
        ["cli: lift the two-rank limit", "families: register the glm53 family"]
    run(kit.args("check"))                                             # fresh apply: no clash, same bytes


def test_clash_after_conflict_continue_then_rename_the_kit_type(kit: Kit, upstream: Upstream) -> None:
    run(kit.args("apply"))
    before = kit.snapshot()
    run(kit.args("rebase", "--onto", "v0.8.0"), ExitCode.PATCH_FAILED)
    write(kit.workdir, "src/tensorfold/cli_args.py", CLI_RESOLVED)
    git(kit.workdir, "add", "src/tensorfold/cli_args.py")
    res = run(kit.args("rebase", "--continue"), ExitCode.FAMILY_CLASH)
    assert "applied after resolving a conflict" in res.stdout and "FAMILY CLASH" in res.stderr
    assert kit.snapshot() == before
    (kit.workdir / KIT_FAMILY).write_text("MODEL_TYPES = ('glm_moe_dsa_glm53kit',)\n")
    assert "unstaged changes" in run(kit.args("rebase", "--continue"), ExitCode.BAD_STATE).stderr
    git(kit.workdir, "add", KIT_FAMILY)
    out = run(kit.args("rebase", "--continue")).output
    assert "no clash" in out and f"v0.8.0 {upstream.c}" in kit.series.read_text()
    assert b"+MODEL_TYPES = ('glm_moe_dsa_glm53kit',)" in (kit.patches / NAMES[0]).read_bytes()
    assert b"+TP_CHOICES = (1, 2, 4, 8)" in (kit.patches / NAMES[1]).read_bytes()
    run(kit.args("check"))


def test_a_fix_that_cannot_be_folded_is_staged_again(kit: Kit, upstream: Upstream) -> None:
    """A staged change outside any family is folded into the kit's patch in the clash (0001);
    here it edits a line only 0002 creates, so the fold conflicts: nothing is lost or moved."""
    stop_at_clash(kit)
    stopped_at = git(kit.workdir, "rev-parse", "HEAD")
    before = kit.snapshot()
    cli = kit.workdir / "src/tensorfold/cli_args.py"
    cli.write_text(cli.read_text().replace("(1, 2, 4)", "(1, 2, 4, 16)"))
    git(kit.workdir, "add", "src/tensorfold/cli_args.py")
    err = run(kit.args("rebase", "--continue"), ExitCode.BAD_STATE).stderr
    assert f"could not fold the staged change into {NAMES[0]}" in err and "staged again" in err
    assert git(kit.workdir, "rev-parse", "HEAD") == stopped_at
    assert git(kit.workdir, "diff", "--cached", "--name-only") == "src/tensorfold/cli_args.py"
    assert "(1, 2, 4, 16)" in cli.read_text() and kit.snapshot() == before
    git(kit.workdir, "commit", "-qm", "by hand")
    assert "reset --soft" in run(kit.args("rebase", "--continue"), ExitCode.BAD_STATE).stderr
    run(kit.args("rebase", "--abort"))
    assert kit.snapshot() == before
