"""git, run through GitPython with an isolated environment.

Every command ignores the user's global/system git configuration and runs in the C locale with a
fixed committer, so results (commit ids, exported bytes, parsed messages) are the same for every
maintainer. Commands are argument lists (GitPython never uses a shell).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import git

from .errors import ExitCode, SeriesToolError
from .series import write_atomic
from .transport import Source

BRANCH = "glm53-series"            # the applied series lives here in the workdir
REBASE_BRANCH = "glm53-series-rebase"
REMOTE = "upstream"
STAMP_FILE = "glm53-kit-applied.json"
KIT_NAME = "glm53-kit series"
KIT_EMAIL = "series@glm53-kit.invalid"

ISOLATED_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_ATTR_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_ASKPASS": "",
    "SSH_ASKPASS": "",
    "GIT_EDITOR": "true",
    "LC_ALL": "C",
    "LANGUAGE": "C",
    "GIT_COMMITTER_NAME": KIT_NAME,
    "GIT_COMMITTER_EMAIL": KIT_EMAIL,
    "GIT_AUTHOR_NAME": KIT_NAME,
    "GIT_AUTHOR_EMAIL": KIT_EMAIL,
    # A stalled transfer is abandoned after 30 s below 1 kB/s instead of hanging.
    "GIT_HTTP_LOW_SPEED_LIMIT": "1000",
    "GIT_HTTP_LOW_SPEED_TIME": "30",
}

# Options for `git am`: exact application (no fuzz: git apply never reduces context), the
# message kept as written, commit ids reproducible (committer date = author date).
AM_OPTIONS = ["--keep-non-patch", "--no-message-id", "--no-scissors", "--no-keep-cr",
              "--committer-date-is-author-date", "--whitespace=nowarn"]

# Normalized export: every setting that changes format-patch's bytes is pinned here, so the
# workdir's own .git/config cannot change them either.
EXPORT_CONFIG = ["diff.noprefix=false", "diff.mnemonicPrefix=false", "diff.algorithm=myers",
                 "diff.context=3", "diff.interHunkContext=0", "diff.suppressBlankEmpty=false",
                 "diff.indentHeuristic=true", "diff.relative=false",
                 "core.quotePath=true", "core.abbrev=40", "color.ui=false",
                 "format.numbered=false", "format.signature=",
                 "format.headers=", "format.coverLetter=false", "format.thread=false",
                 "format.subjectPrefix=PATCH", "format.suffix=.patch", "format.useAutoBase=false",
                 "format.encodeEmailHeaders=true", "format.notes=false", "format.from=false",
                 "format.signOff=false", "log.showSignature=false", "i18n.logOutputEncoding=UTF-8",
                 "i18n.commitEncoding=UTF-8"]
EXPORT_OPTIONS = ["--stdout", "--zero-commit", "--no-signature", "--no-stat", "--full-index",
                  "--binary", "--no-numbered", "--subject-prefix=PATCH", "--no-thread",
                  "--no-cover-letter", "--no-notes", "--no-base", "--find-renames",
                  "--diff-algorithm=myers", "-U3", "--inter-hunk-context=0", "--no-relative",
                  "--src-prefix=a/", "--dst-prefix=b/", "--no-color", "--encode-email-headers", f"-O{os.devnull}"]


@dataclass
class GitResult:
    status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def output(self) -> str:
        return "\n".join(part for part in (self.stdout.strip(), self.stderr.strip()) if part)


class StderrProgress(git.RemoteProgress):
    """Clone/fetch progress on stderr: one updating line per stage, throttled."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    STAGES = {git.RemoteProgress.COUNTING: "counting objects",
              git.RemoteProgress.COMPRESSING: "compressing objects",
              git.RemoteProgress.RECEIVING: "receiving objects",
              git.RemoteProgress.RESOLVING: "resolving deltas",
              git.RemoteProgress.FINDING_SOURCES: "finding sources",
              git.RemoteProgress.CHECKING_OUT: "checking out",
              git.RemoteProgress.WRITING: "writing objects"}

    def update(self, op_code: int, cur_count, max_count=None, message: str = "") -> None:
        stage_end = bool(op_code & self.END)
        now = time.monotonic()
        if not stage_end and now - self.last < 0.5:
            return
        self.last = now
        stage = self.STAGES.get(op_code & self.OP_MASK, "working")
        count = f"{int(cur_count or 0)}/{int(max_count)}" if max_count else f"{int(cur_count or 0)}"
        line = f"{self.label}: {stage} {count} {message or ''}".rstrip()
        if self.tty:
            print(f"\r{line}\x1b[K", end="\n" if stage_end else "", file=sys.stderr, flush=True)
        elif stage_end:
            print(line, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Workdir:
    """The upstream checkout the series is applied in."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.repo = git.Repo(self.path)
        self.repo.git.update_environment(**ISOLATED_ENV)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def open_or_init(cls, path: Path) -> "Workdir":
        path = Path(path)
        if path.exists() and not (path / ".git").exists():
            if any(path.iterdir()):
                raise SeriesToolError(ExitCode.BAD_STATE, f"workdir {path} exists, is not empty and "
                                      "is not a git checkout; choose another --workdir or remove it")
        if not (path / ".git").exists():
            path.mkdir(parents=True, exist_ok=True)
            with git.Git().custom_environment(**ISOLATED_ENV):
                git.Repo.init(path, initial_branch="glm53-empty")
        return cls(path)

    @classmethod
    def open_existing(cls, path: Path) -> "Workdir":
        if not (Path(path) / ".git").exists():
            raise SeriesToolError(ExitCode.BAD_STATE, f"no workdir at {path}: run `apply.py` first "
                                  "(or give --workdir)")
        return cls(path)

    # ---- running git -----------------------------------------------------------------------
    def run(self, *args: str, config: list[str] | None = None, env: dict[str, str] | None = None
            ) -> GitResult:
        command = ["git"]
        for item in config or []:
            command += ["-c", item]
        command += list(args)
        status, out, err = self.repo.git.execute(command, with_extended_output=True,
                                                 with_exceptions=False, env=env or None,
                                                 strip_newline_in_stdout=False)
        return GitResult(status, out, err)

    def must(self, *args: str, config: list[str] | None = None) -> str:
        result = self.run(*args, config=config)
        if not result.ok:
            raise SeriesToolError(ExitCode.BAD_STATE, f"git {' '.join(args)} failed in "
                                  f"{self.path}:\n{result.output}")
        return result.stdout.strip()

    def raw(self, *args: str, config: list[str] | None = None) -> bytes:
        command = ["git"]
        for item in config or []:
            command += ["-c", item]
        command += list(args)
        status, out, err = self.repo.git.execute(command, with_extended_output=True,
                                                 with_exceptions=False, stdout_as_string=False,
                                                 strip_newline_in_stdout=False)
        if status != 0:
            raise SeriesToolError(ExitCode.BAD_STATE, f"git {' '.join(args)} failed in "
                                  f"{self.path}:\n{err}")
        return out

    # ---- state ----------------------------------------------------------------------------
    @property
    def git_dir(self) -> Path:
        return Path(self.repo.git_dir)

    def head(self) -> str | None:
        result = self.run("rev-parse", "--verify", "-q", "HEAD^{commit}")
        return result.stdout.strip() if result.ok else None

    def current_branch(self) -> str | None:
        result = self.run("symbolic-ref", "-q", "--short", "HEAD")
        return result.stdout.strip() if result.ok else None

    def resolve(self, rev: str) -> str | None:
        result = self.run("rev-parse", "--verify", "-q", f"{rev}^{{commit}}")
        return result.stdout.strip() if result.ok else None

    def has_object(self, oid: str) -> bool:
        return self.run("cat-file", "-e", oid).ok

    def am_in_progress(self) -> bool:
        return (self.git_dir / "rebase-apply").exists()

    def git_rebase_in_progress(self) -> bool:
        return (self.git_dir / "rebase-merge").exists() or (
            (self.git_dir / "rebase-apply").exists() and not (self.git_dir / "rebase-apply" / "applying").exists())

    def dirty_files(self) -> list[str]:
        """Tracked files with staged or unstaged changes (untracked files are left alone)."""
        result = self.run("status", "--porcelain", "--untracked-files=no")
        if not result.ok:
            return []
        return [line[3:] for line in result.stdout.splitlines() if line.strip()]

    def conflicted_files(self) -> list[str]:
        return self.run("diff", "--name-only", "--diff-filter=U").stdout.split()

    def is_shallow(self) -> bool:
        return self.run("rev-parse", "--is-shallow-repository").stdout.strip() == "true"

    def commits_since(self, base: str, tip: str = "HEAD") -> list[str]:
        out = self.must("rev-list", "--reverse", "--topo-order", f"{base}..{tip}")
        return out.split()

    def is_ancestor(self, ancestor: str, rev: str = "HEAD") -> bool:
        return self.run("merge-base", "--is-ancestor", ancestor, rev).ok

    # ---- fetching -------------------------------------------------------------------------
    def fetch_tag(self, source: Source, tag: str, *, shallow: bool) -> None:
        """Fetch exactly refs/tags/<tag> (forced, so a moved tag is seen as moved)."""
        names = [remote.name for remote in self.repo.remotes]
        if REMOTE in names:
            self.must("remote", "set-url", REMOTE, source.spec)
        else:
            self.must("remote", "add", REMOTE, source.spec)
        remote = self.repo.remote(REMOTE)
        allowed = "https" if source.is_remote else "file"
        kwargs = {"no_tags": True, "force": True}
        if shallow:
            kwargs["depth"] = 1
        print(f"fetching tag {tag} from {source.spec}", file=sys.stderr)
        with self.repo.git.custom_environment(GIT_ALLOW_PROTOCOL=allowed):
            try:
                remote.fetch(f"+refs/tags/{tag}:refs/tags/{tag}",
                             progress=StderrProgress(f"fetch {tag}"), **kwargs)
            except git.GitCommandError as exc:
                stderr = (exc.stderr or "").strip()
                if "couldn't find remote ref" in stderr or "not our ref" in stderr:
                    raise SeriesToolError(ExitCode.PIN_MISMATCH, f"tag {tag} does not exist at "
                                          f"{source.spec}; the pin cannot be verified.\n{stderr}")
                raise SeriesToolError(ExitCode.UNREACHABLE, f"could not fetch tag {tag} from "
                                      f"{source.spec}:\n{stderr}")

    def tag_kind(self, tag: str) -> str:
        kind = self.run("cat-file", "-t", f"refs/tags/{tag}").stdout.strip()
        return "annotated" if kind == "tag" else "lightweight"

    # ---- applying -------------------------------------------------------------------------
    def am(self, patch: Path, *, three_way: bool) -> GitResult:
        mode = "--3way" if three_way else "--no-3way"
        return self.run("am", mode, *AM_OPTIONS, str(Path(patch).resolve()))

    def am_control(self, action: str) -> GitResult:
        return self.run("am", f"--{action}")

    # ---- exporting ------------------------------------------------------------------------
    def format_patch(self, commit: str) -> bytes:
        return self.raw("format-patch", *EXPORT_OPTIONS, "-1", commit, config=EXPORT_CONFIG)

    # ---- stamp: what this tool applied here ---------------------------------------------
    @property
    def stamp_path(self) -> Path:
        return self.git_dir / STAMP_FILE

    def read_stamp(self) -> dict | None:
        try:
            return json.loads(self.stamp_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def write_stamp(self, stamp: dict) -> None:
        write_atomic(self.stamp_path, (json.dumps(stamp, indent=1, sort_keys=True) + "\n").encode())
