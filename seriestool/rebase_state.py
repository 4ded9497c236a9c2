"""The state of a series rebase in flight, kept in the workdir's git dir: which patch is next, which
stopped, what each became. `apply`, `status` and every command that refuses to start while a rebase
is in flight read it."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .git_ops import Workdir
from .series import write_atomic

STATE_FILE = "glm53-kit-rebase.json"


@dataclass
class RebaseState:
    series_path: str
    onto_tag: str
    onto_commit: str
    old_pin: str
    old_tip: str | None          # the applied series branch before, for range-diff
    orig_ref: str                # branch name or commit to return to on --abort
    names: list[str]
    fingerprint: dict[str, str]  # series + patch file hashes at the start
    index: int = 0               # next patch to apply
    current: str | None = None   # the patch git am stopped at
    head_before: str | None = None
    outcomes: dict[str, str] = field(default_factory=dict)
    commits: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)   # --drop NAME: left out from the start
    clash: bool = False          # stopped after the last patch: a model family clash (exit 9)
    fold_into: str | None = None  # at a clash: the kit's registration patch staged fixes go into

    @staticmethod
    def path(wd: Workdir) -> Path:
        return wd.git_dir / STATE_FILE

    @classmethod
    def exists(cls, wd: Workdir) -> bool:
        return cls.path(wd).exists()

    @classmethod
    def load(cls, wd: Workdir) -> "RebaseState":
        return cls(**json.loads(cls.path(wd).read_text()))

    def save(self, wd: Workdir) -> None:
        write_atomic(self.path(wd), (json.dumps(asdict(self), indent=1) + "\n").encode())
