"""Evicting a prefix cache's files from the OS page cache, so that a resume reads the disk."""
from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache(folder: Path) -> int:
    """Evict the cache files' pages from the OS page cache (clean after fsync), so the resume reads
    the disk. Returns the bytes advised."""
    n = 0
    for p in folder.rglob("*.kvc"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return n
