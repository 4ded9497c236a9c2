"""Progress lines for a bench: on stderr, so that stdout carries only the table a bench prints."""
from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
