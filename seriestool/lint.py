"""Lint of the series and its patch files: present, used, unique, well formed, headers complete."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import ExitCode, SeriesToolError
from .patchfile import PatchFile, read_patch
from .series import PATCH_NAME_RE, Series


def structural_problems(series: Series) -> tuple[list[str], dict[str, PatchFile]]:
    """Problems that make applying impossible: missing or malformed patch files."""
    problems: list[str] = []
    parsed: dict[str, PatchFile] = {}
    first_line: dict[str, int] = {}
    for entry in series.patches:
        if entry.name in first_line:
            problems.append(f"{series.path}:{entry.line}: {entry.name} is listed twice "
                            f"(first on line {first_line[entry.name]})")
            continue
        first_line[entry.name] = entry.line
        path = series.patch_path(entry.name)
        if not path.is_file():
            problems.append(f"{series.path}:{entry.line}: names {entry.name}, but "
                            f"{path} does not exist (add the file or remove the line)")
            continue
        info = read_patch(path)
        parsed[entry.name] = info
        for problem in info.problems:
            problems.append(f"{path}: malformed patch: {problem}")
    return problems, parsed


def require_structure(series: Series) -> dict[str, PatchFile]:
    problems, parsed = structural_problems(series)
    if problems:
        raise SeriesToolError(ExitCode.SERIES_INVALID, "\n".join(problems))
    return parsed


def full_lint(series: Series) -> list[str]:
    problems, parsed = structural_problems(series)
    seen: dict[str, int] = {}
    numbers: dict[str, str] = {}
    for entry in series.patches:
        if entry.name in seen:
            continue  # reported by structural_problems
        seen[entry.name] = entry.line
        match = PATCH_NAME_RE.match(entry.name)
        if not match:
            problems.append(f"{series.path}:{entry.line}: {entry.name}: names must look like "
                            "NNNN-short-name.patch")
        elif match.group(1) in numbers:
            problems.append(f"{series.path}:{entry.line}: {entry.name} reuses number "
                            f"{match.group(1)} of {numbers[match.group(1)]}")
        else:
            numbers[match.group(1)] = entry.name
    if series.patch_dir.is_dir():
        for path in sorted(series.patch_dir.glob("*.patch")):
            if path.name not in seen:
                problems.append(f"{path}: not listed in {series.path.name} (unused: add it to the "
                                "series or delete it)")
    for name, info in parsed.items():
        if not info.well_formed:
            continue
        for gap in info.header_gaps:
            problems.append(f"{info.path}: header incomplete: {gap}")
        for guard in info.guards:
            problem = _guard_problem(series.path.parent, guard)
            if problem:
                problems.append(f"{info.path}: Guarded-By {guard!r}: {problem}")
    return problems


def _guard_problem(root: Path, guard: str) -> str | None:
    """A guard names a test file under the kit root, optionally ::Class::test_name."""
    file_part, _, test_part = guard.partition("::")
    path = root / file_part
    if not file_part.startswith("tests/") or not path.is_file():
        return f"no test file {file_part} under {root}"
    if test_part:
        name = test_part.split("::")[-1].split("[", 1)[0]
        if not re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(|^\s*class {re.escape(name)}\b",
                         path.read_text(encoding="utf-8", errors="replace"), re.M):
            return f"{file_part} has no test named {name}"
    return None
