"""The series file: `#` comments, `upstream URL TAG COMMIT`, then one patch file name per line.

Parsing keeps every original line so that a rewrite (new pin, patches added or dropped) changes
only what it must; writing is atomic (temp file + rename).
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ExitCode, SeriesToolError

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
TAG_RE = re.compile(r"^(?!-)(?!.*\.\.)[A-Za-z0-9._/+-]+$")
PATCH_NAME_RE = re.compile(r"^(\d{4})-[A-Za-z0-9][A-Za-z0-9._-]*\.patch$")


@dataclass
class Pin:
    url: str
    tag: str
    commit: str


@dataclass
class PatchEntry:
    name: str
    line: int  # 1-based line in the series file


@dataclass
class Series:
    path: Path
    pin: Pin
    patches: list[PatchEntry]
    header_lines: list[str] = field(default_factory=list)  # comments/blank lines before the pin

    @property
    def patch_dir(self) -> Path:
        return self.path.parent / "patches"

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.patches]

    def patch_path(self, name: str) -> Path:
        return self.patch_dir / name


def _invalid(path: Path, line: int, what: str) -> SeriesToolError:
    return SeriesToolError(ExitCode.SERIES_INVALID, f"{path}:{line}: {what}")


def parse_series(path: Path) -> Series:
    """Read and validate the series' syntax (patch files themselves are checked by lint)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SeriesToolError(ExitCode.SERIES_INVALID,
                              f"{path}: series file not found (give another with --series FILE)")
    header: list[str] = []
    pin: Pin | None = None
    patches: list[PatchEntry] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if pin is None and (not line or line.startswith("#")):
            header.append(raw)
            continue
        if not line or line.startswith("#"):
            continue
        if pin is None:
            fields = line.split()
            if len(fields) != 4 or fields[0] != "upstream":
                raise _invalid(path, number, "the first non-comment line must be "
                               "`upstream URL TAG COMMIT` (https URL, tag name, full 40-hex commit)")
            _, url, tag, commit = fields
            if not url.startswith("https://") or "::" in url:
                raise _invalid(path, number, f"upstream URL {url!r} must be an https:// URL")
            if not TAG_RE.match(tag):
                raise _invalid(path, number, f"tag {tag!r} is not a valid tag name")
            if not COMMIT_RE.match(commit):
                raise _invalid(path, number, f"commit {commit!r} must be the full 40-hex commit id "
                               "(lowercase); a tag name or short id is not a pin")
            pin = Pin(url, tag, commit)
            continue
        if len(line.split()) != 1 or "/" in line or "\\" in line:
            raise _invalid(path, number, f"{line!r}: one patch file name per line (a name in "
                           "patches/, no directories)")
        patches.append(PatchEntry(line, number))
    if pin is None:
        raise _invalid(path, 1, "no `upstream URL TAG COMMIT` line")
    return Series(path=path, pin=pin, patches=patches, header_lines=header)


def render_series(series: Series, pin: Pin, names: list[str]) -> str:
    """The series text with a (possibly new) pin and patch list; header comments are kept."""
    lines = list(series.header_lines)
    lines.append(f"upstream {pin.url} {pin.tag} {pin.commit}")
    lines.extend(names)
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, data: bytes) -> bool:
    """Write `data` to `path` via a temp file + rename; skip (return False) when unchanged."""
    path = Path(path)
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.chmod(tmp, path.stat().st_mode & 0o777)
        except FileNotFoundError:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def write_series(series: Series, pin: Pin, names: list[str]) -> bool:
    return write_atomic(series.path, render_series(series, pin, names).encode("utf-8"))
