"""One patch file (git format-patch mbox): structure, message sections, files and hunks.

The message must say what the patch changes, why upstream needs it, what was verified and what
could not be, and name its guard tests:

    What: ...            Why: ...            Verified: ...            Not verified: ...
    Guarded-By: tests/test_x.py::test_name   (one or more)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MBOX_FROM_RE = re.compile(rb"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$", re.M)
SECTIONS = {"what": "What:", "why": "Why:", "verified": "Verified:", "not verified": "Not verified:"}
SECTION_RE = re.compile(r"^(what|why|verified|not[ -]verified)\s*:\s*(.*)$", re.I)
GUARD_RE = re.compile(r"^Guarded-By:\s*(.*)$", re.I)
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    file: str
    header: str          # the @@ line
    old_start: int
    old_len: int
    lines: list[str]


@dataclass
class PatchFile:
    path: Path
    subject: str = ""
    body: str = ""
    files: list[str] = field(default_factory=list)
    hunks: list[Hunk] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)     # structural: cannot be applied
    header_gaps: list[str] = field(default_factory=list)  # message lacks a required part
    guards: list[str] = field(default_factory=list)

    @property
    def well_formed(self) -> bool:
        return not self.problems


def read_patch(path: Path) -> PatchFile:
    """Parse without raising; problems are collected so lint can report them all."""
    info = PatchFile(path=Path(path))
    try:
        data = info.path.read_bytes()
    except FileNotFoundError:
        info.problems.append("file not found")
        return info
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        info.problems.append(f"not UTF-8 ({exc.reason} at byte {exc.start})")
        return info
    first = text.split("\n", 1)[0].encode()
    if not MBOX_FROM_RE.match(first):
        info.problems.append("does not start with a git format-patch `From <40-hex> Mon Sep 17 "
                             "00:00:00 2001` line (export it with `apply.py export`)")
        return info
    if len(MBOX_FROM_RE.findall(data)) != 1:
        info.problems.append("holds more than one patch; one commit per file")
    head, sep, rest = text.partition("\n\n")
    if not sep:
        info.problems.append("no blank line after the mail headers")
        return info
    headers = _unfold(head.split("\n")[1:])
    for needed in ("From", "Date", "Subject"):
        if needed not in headers:
            info.problems.append(f"mail header `{needed}:` missing")
    info.subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers.get("Subject", ""))
    # The message ends at a `---` line (diffstat form) or at the first diff (--no-stat form).
    ends = [at for at in (rest.find("\n---\n"), rest.find("\ndiff --git ")) if at >= 0]
    if rest.startswith("diff --git "):
        ends.append(-1)
    if not ends:
        info.problems.append("contains no `diff --git` section")
        return info
    message, diff = rest[:max(min(ends), 0)], rest[min(ends) + 1:]
    info.body = message
    _parse_diff(info, diff)
    if not info.files:
        info.problems.append("contains no `diff --git` section")
    _check_message(info)
    return info


def _unfold(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    last = ""
    for line in lines:
        if line[:1] in (" ", "\t") and last:
            headers[last] += " " + line.strip()
        elif ":" in line:
            last, _, value = line.partition(":")
            headers[last] = value.strip()
    return headers


def _parse_diff(info: PatchFile, diff: str) -> None:
    current = ""
    hunk: Hunk | None = None
    for line in diff.split("\n"):
        if line.startswith("diff --git "):
            parts = line.split(" b/", 1)
            current = parts[1] if len(parts) == 2 else line[len("diff --git "):]
            info.files.append(current)
            hunk = None
        elif line.startswith("@@ ") and current:
            match = HUNK_RE.match(line)
            if not match:
                info.problems.append(f"{current}: malformed hunk header {line!r}")
                continue
            hunk = Hunk(current, line, int(match.group(1)), int(match.group(2) or 1), [])
            info.hunks.append(hunk)
        elif hunk is not None and line[:1] in (" ", "+", "-"):
            hunk.lines.append(line)


def _check_message(info: PatchFile) -> None:
    found: dict[str, str] = {}
    for line in info.body.split("\n"):
        match = SECTION_RE.match(line.strip())
        if match:
            key = match.group(1).lower().replace("-", " ")
            found.setdefault(key, match.group(2).strip())
        guard = GUARD_RE.match(line.strip())
        if guard and guard.group(1).strip():
            info.guards.append(guard.group(1).strip())
    for key, label in SECTIONS.items():
        value = found.get(key)
        if value is None:
            info.header_gaps.append(f"message lacks a `{label}` line")
        elif not value or value.upper().startswith("TODO"):
            info.header_gaps.append(f"`{label}` is empty or TODO")
    if not info.guards:
        info.header_gaps.append("message names no guard test (`Guarded-By: tests/test_x.py::test_name`)")


def hunk_at(info: PatchFile, file: str, line: int) -> Hunk | None:
    """The hunk of `file` that covers old-file line `line` (git reports where it failed)."""
    best = None
    for hunk in info.hunks:
        if hunk.file != file:
            continue
        if hunk.old_start <= line <= hunk.old_start + max(hunk.old_len, 1):
            return hunk
        if best is None:
            best = hunk
    return best
