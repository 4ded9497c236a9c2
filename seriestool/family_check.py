"""The family-clash check run after the series is applied (apply, check, rebase), and the
message that names the clashing families and the exact way out.

For a clash involving one of the kit's own families (a family folder or module that a series
patch touches) there are three choices: drop the kit's registration patch (upstream's family
serves the model type), replace upstream's registration (the patch also takes the type away from
upstream's family), or rename the model type the kit's family claims (and have the kit map the
checkpoint to it). Only `rebase` can change patches on the new base, so apply and check point
to `rebase --onto <the pinned tag>`, which stops at the same clash with the commands.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath

from .context import Invocation, say
from .errors import ExitCode, SeriesToolError
from .families import FamilyScan, family_of_path, scan_families
from .patchfile import read_patch
from .series import Series

REBASE, APPLY, CHECK = "rebase", "apply", "check"


def kit_families(series: Series, names: list[str]) -> dict[str, str]:
    """family name -> the first series patch that touches it (the kit's registration patch)."""
    owners: dict[str, str] = {}
    for name in names:
        path = series.patch_path(name)
        if not path.is_file():
            continue
        for file in read_patch(path).files:
            family = family_of_path(file)
            if family is not None:
                owners.setdefault(family, name)
    return owners


def print_families(scan: FamilyScan, kit: dict[str, str], indent: str = "  ") -> None:
    """The families found, kit's marked with their patch; clashes and unreadable ones flagged."""
    for family in scan.families:
        origin = f"kit, {kit[family.name]}" if family.name in kit else "upstream"
        types = ", ".join(family.model_types) or "-"
        say(f"{indent}{family.name}: {types}  ({origin}; {family.declared_in or family.file})")
        if family.problem:
            say(f"{indent}  {'BROKEN' if family.fatal else 'not read statically'}: {family.problem}")
    for clash in scan.clashes:
        say(f"{indent}CLASH: {clash.model_type!r} claimed by "
            + ", ".join(f.name for f in clash.families))


def _describe_clashes(scan: FamilyScan, kit: dict[str, str], base: str) -> list[str]:
    lines: list[str] = []
    for clash in scan.clashes:
        lines.append(f"FAMILY CLASH: model_type {clash.model_type!r} is claimed by "
                     f"{len(clash.families)} families (TensorFold refuses to start):")
        for family in clash.families:
            origin = f"the kit's, from {kit[family.name]}" if family.name in kit else f"upstream {base}"
            lines.append(f"  {family.name:<20} {family.declared_in or family.file}  ({origin})")
    for family in scan.broken:
        lines.append(f"BROKEN FAMILY FILE: {family.problem} (family {family.name}; TensorFold cannot "
                     "import it, and its MODEL_TYPES cannot be checked)")
    return lines


def _choices(scan: FamilyScan, kit: dict[str, str], inv: Invocation, tag: str, workdir: Path,
             dropped: tuple[str, ...]) -> list[str]:
    lines: list[str] = []
    for clash in scan.clashes:
        ours = [f for f in clash.families if f.name in kit]
        theirs = [f for f in clash.families if f.name not in kit]
        if not ours:
            lines += [f"No series patch registers a family claiming {clash.model_type!r}: upstream {tag} "
                      "clashes by itself. Pick another tag, or report it upstream."]
            continue
        mine = ours[0]
        patch = kit[mine.name]
        lines.append(f"Choose how the kit's family {mine.name} (patch {patch}) and "
                     f"{', '.join(f.name for f in theirs) or 'the other kit family'} share "
                     f"{clash.model_type!r}:")
        lines += [f"  1. drop the registration patch (upstream's family serves {clash.model_type!r}; "
                  "the kit's engine is no longer used for it):",
                  f"       {inv.command('rebase', '--abort')}",
                  f"       {inv.command('rebase', '--onto', tag, *_drops((*dropped, patch)))}"]
        for other in theirs:
            other_dir = str(PurePosixPath(other.file).parent) if other.file.endswith("/__init__.py") \
                else other.file
            only_this = set(other.model_types) <= {c.model_type for c in scan.clashes}
            how = (inv.git_command("rm", "-r", "-q", other_dir) if only_this else
                   f"edit {workdir / other.file}: remove {clash.model_type!r} from MODEL_TYPES, then "
                   f"{inv.git_command('add', other.file)}")
            lines += [f"  2. replace upstream's registration: {patch} also takes {clash.model_type!r} "
                      f"away from {other.name} (the kit's family stays the one TensorFold uses):",
                      f"       {how}",
                      f"       {inv.command('rebase', '--continue')}   # folds the staged change into {patch}"]
        lines += [f"  3. rename the kit's model type mapping: in {workdir / mine.file} claim a type "
                  f"of its own (e.g. '{clash.model_type}_glm53kit') instead of {clash.model_type!r}, "
                  "and have the kit's launcher map the checkpoint's model_type to it:",
                  f"       {inv.git_command('add', mine.file)}",
                  f"       {inv.command('rebase', '--continue')}   # folds the staged change into {patch}"]
    lines += ["Or stop: " + inv.command("rebase", "--abort") + "   # series and patches/ untouched"]
    return lines


def _drops(names: tuple[str, ...]) -> list[str]:
    return [word for name in dict.fromkeys(names) for word in ("--drop", name)]


def require_no_clash(tree: Path, series: Series, names: list[str], inv: Invocation, *, mode: str,
                     tag: str, dropped: tuple[str, ...] = ()) -> FamilyScan:
    """Scan the applied tree; raise FAMILY_CLASH (exit 9) with the full explanation on a clash
    or a family file that does not parse. Unreadable-but-valid MODEL_TYPES only warn."""
    scan = scan_families(tree)
    kit = kit_families(series, names)
    for family in scan.unreadable:
        say(f"warning: family {family.name}: {family.problem}; its model types were not checked, "
            "check them by hand")
    if scan.ok:
        types = sum(len(f.model_types) for f in scan.families)
        say(f"families: {len(scan.families)} found, {types} model type(s), no clash")
        return scan
    lines = _describe_clashes(scan, kit, tag)
    if mode == REBASE:
        lines += ["The rebase stopped before writing anything: series and patches/ are untouched, "
                  f"and {inv.workdir} holds the rebased tree to look at.", *_choices(
                      scan, kit, inv, tag, inv.workdir, dropped)]
    else:
        where = "the applied tree in " + str(inv.workdir) if mode == APPLY else "a fresh apply"
        lines += [f"Found in {where} on the pinned {tag}. To resolve it, carry the series onto the "
                  f"same tag; it stops at this clash and prints the choices (drop the registration "
                  f"patch, replace upstream's registration, or rename the kit's model type):",
                  f"  {inv.command('rebase', '--onto', tag)}"]
    raise SeriesToolError(ExitCode.FAMILY_CLASH, "\n".join(lines))
