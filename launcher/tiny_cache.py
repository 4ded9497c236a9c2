"""The tiny checkpoint the embedded default serves, generated on first use into a cache dir.

Keyed by the generator's sources, so a changed generator gives a new checkpoint, never a stale one.
Concurrent first uses wait on a lock; the generator itself writes to a temp dir and renames.
"""
from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
import time
from pathlib import Path

from launcher.config import KIT_DIR

GENERATOR_SOURCES = ("glm53/synthetic/tiny.py", "glm53/synthetic/tiny_tokenizer.py", "glm53/exl3/encode.py", "glm53/exl3/format.py")


def cache_root() -> Path:
    return KIT_DIR / ".work" / "tiny"


def tiny_key() -> str:
    h = hashlib.sha256()
    for rel in GENERATOR_SOURCES:
        path = KIT_DIR / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b""))
    return h.hexdigest()[:12]


def tiny_dir() -> Path:
    return cache_root() / f"seed0-{tiny_key()}"


def ensure_tiny(quiet: bool = False) -> Path:
    target = tiny_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # another process made it while we waited
            return target
        if not quiet:
            print(f"serve: generating the tiny checkpoint into {target} (first use only; a minute or two)",
                  file=sys.stderr, flush=True)
        from glm53.synthetic.tiny import write_tiny_checkpoint  # torch (~3 s): only when generating

        t0 = time.monotonic()
        write_tiny_checkpoint(target, seed=0)
        if not quiet:
            print(f"serve: tiny checkpoint ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        for stale in target.parent.glob("seed0-*"):  # made by an older generator: never used again
            if stale != target:
                shutil.rmtree(stale, ignore_errors=True)
    return target
