"""The lane's state file (run dir/lane.json), written by the supervisor, read by serve/stop."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from glm53.atomic_json import write_json_atomic


def write_json(path: Path, data: Any) -> None:
    """A reader (serve/stop/status) never sees half a file."""
    write_json_atomic(path, data, indent=1)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
