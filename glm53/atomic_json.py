"""One way to write a JSON file that readers see whole or not at all (manifests, reports, lane state,
drafter locks, bench results): a temp file in the same folder, fsync, rename; the temp file is
removed on any failure, so a full disk or a kill leaves the old file intact and no debris."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, doc: Any, *, indent: int = 2, sort_keys: bool = False) -> Path:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=indent, sort_keys=sort_keys)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
