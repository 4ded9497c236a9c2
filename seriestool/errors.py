"""Exit codes of apply.py and the one exception type that carries them.

Codes are part of the tool's interface (docs/MAINTAINERS.md has the table); never renumber.
"""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    # 1 is left to Python/click for unexpected crashes and Ctrl-C.
    USAGE = 2            # bad command line (click's own code), refused transport
    PATCH_FAILED = 3     # a patch does not apply / a conflict stopped the rebase
    STALE = 4            # check: committed patches differ from a fresh normalized export
    PIN_MISMATCH = 5     # the tag does not resolve to the pinned commit (moved tag), or is missing
    BAD_STATE = 6        # workdir dirty, am/rebase in progress, foreign commits, shallow lacks blobs
    SERIES_INVALID = 7   # series file or a patch file malformed, missing, unused, duplicated, header incomplete
    UNREACHABLE = 8      # the upstream could not be reached (apply/rebase need it; check says what it skipped)
    FAMILY_CLASH = 9     # after applying: two model families claim one model_type, or a family file does not parse


class SeriesToolError(Exception):
    """An error with a message for the user (already says what to do) and an exit code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
