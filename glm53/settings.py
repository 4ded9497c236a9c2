"""Every TF_GLM53_* variable, parsed and validated once into a frozen `Settings`, then passed down.

    settings = Settings.from_env()                  # a process entry point, once, at start
    engine = glm53.cuda_engine(model_dir, settings=settings)
    settings.override(max_seqs=4)                   # explicit arguments win; None leaves a field as it is

The entry points (glm53.serving.rank, glm53.serving.compose.build_engine (glm53.cuda_engine),
Glm53Engine and RankEngine when built without settings, the launcher's commands) call
`Settings.from_env()`; what they build takes the Settings or
the fields it needs, so nothing reads these variables again. Rules of the parse:
- a value that is empty or blank counts as unset (the default), as in a shell's `TF_GLM53_MAX_SEQS= cmd`;
- a bad value raises SettingsError naming the variable, the value and what is accepted;
- a TF_GLM53_* name the kit does not know raises SettingsError naming the closest known one
  (a misspelt knob must not be silently ignored);
- defaults that depend on the device or on another knob are None (or "auto") here and resolved
  where that is known; each description says how.

Not product knobs, and no fields here: TF_GLM53_EXLLAMAV3_DIR and TF_GLM53_EXLLAMAV3_WHEEL are read
by tests/gpu/exllamav3_ref.py alone (where the exllamav3 reference is built); they are listed in
TEST_ONLY so that a GPU test run does not report them as unknown.

`python -m glm53.settings --markdown` prints README.md's knob table (tests/test_settings.py fails when
the two differ; `--update-readme` rewrites it); `--check` validates the current environment.
This module imports nothing beyond the standard library: the launcher uses it on hosts without torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm53.kv_format import KV_DTYPE_BYTES

PREFIX = "TF_GLM53_"
TEST_ONLY = {
    "TF_GLM53_EXLLAMAV3_DIR": "tests/gpu/exllamav3_ref.py: where the exllamav3 reference is built",
    "TF_GLM53_EXLLAMAV3_WHEEL": "tests/gpu/exllamav3_ref.py: an exllamav3 wheel to install instead of building",
}
DEVICES = ("cuda", "cpu")
DTYPES = ("bf16", "fp32")
KV_DTYPES = tuple(KV_DTYPE_BYTES)
TRISTATE = ("auto", "1", "0")
KERNEL_CHOICES = ("auto", "triton", "torch")
DIST_BACKENDS = ("nccl", "gloo")
DRAFT_SOURCES = ("auto", "off", "copy", "mtp", "dflash2")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_SEQS_LIMIT = 64
MAX_DRAFT_DEPTH = 13
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class SettingsError(ValueError):
    """A TF_GLM53_* value (or name) the kit cannot use; the message names the variable, the value
    and what is accepted."""


def parse_bytes(text: str) -> int:
    """A byte count: digits with an optional K/M/G/T suffix (powers of 1024; "8G", "512MiB", "4kb")."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a byte count")
    return int(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]


def format_bytes(n: int) -> str:
    for unit in "TGMK":
        scale = _BYTE_UNITS[unit.lower()]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# ---- kinds of value: each parses the environment's text and checks a value given explicitly ----
@dataclass(frozen=True)
class Kind:
    accepted: str  # "an integer in 1..64": the messages' and the table's words

    def parse(self, text: str) -> Any:
        raise NotImplementedError

    def check(self, value: Any) -> Any:
        """A value given as an argument: text is parsed as the environment's would be."""
        return self.parse(value) if isinstance(value, str) else self._check(value)

    def _check(self, value: Any) -> Any:
        raise ValueError


@dataclass(frozen=True)
class Int(Kind):
    low: int = 1
    high: int | None = None

    def parse(self, text: str) -> int:
        if not re.fullmatch(r"\s*[+-]?\d+\s*", text):
            raise ValueError
        return self._check(int(text))

    def _check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.low or (
                self.high is not None and value > self.high):
            raise ValueError
        return value


@dataclass(frozen=True)
class Float(Kind):
    high: float | None = None  # inclusive; the low end is 0, exclusive

    def parse(self, text: str) -> float:
        try:
            return self._check(float(text))
        except (TypeError, OverflowError):
            raise ValueError from None

    def _check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 or (
                self.high is not None and value > self.high):
            raise ValueError
        return float(value)


@dataclass(frozen=True)
class Bytes(Int):
    def parse(self, text: str) -> int:
        return self._check(parse_bytes(text))


@dataclass(frozen=True)
class Choice(Kind):
    values: tuple[str, ...] = ()
    fold: Callable[[str], str] = str.lower

    def parse(self, text: str) -> str:
        value = self.fold(text.strip())
        if value not in self.values:
            raise ValueError
        return value

    def _check(self, value: Any) -> str:
        raise ValueError


@dataclass(frozen=True)
class Flag(Kind):
    true: tuple[str, ...] = _TRUE
    false: tuple[str, ...] = _FALSE

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in self.true or word in self.false:
            return word in self.true
        raise ValueError

    def _check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError
        return value


@dataclass(frozen=True)
class Text(Kind):
    def parse(self, text: str) -> str:
        if not text.strip():
            raise ValueError
        return text.strip()


@dataclass(frozen=True)
class Keys(Kind):
    def parse(self, text: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))

    def _check(self, value: Any) -> tuple[str, ...]:
        if not isinstance(value, (tuple, list)) or not all(isinstance(k, str) for k in value):
            raise ValueError
        return tuple(dict.fromkeys(k.strip() for k in value if k.strip()))


@dataclass(frozen=True)
class Knob:
    env: str
    kind: Kind
    help: str
    default_text: str | None = None  # how an unset (None / "auto") default resolves, for the table

    def error(self, value: Any) -> SettingsError:
        return SettingsError(f"{self.env}={value!r}: expected {self.kind.accepted}")


def knob(env: str, kind: Kind, default: Any, help: str, default_text: str | None = None, secret: bool = False) -> Any:
    return field(default=default, repr=not secret, metadata={"knob": Knob(PREFIX + env, kind, help, default_text)})


def _positive() -> Int:
    return Int("a positive integer", 1)


def _choice(values: tuple[str, ...], fold: Callable[[str], str] = str.lower) -> Choice:
    return Choice("one of " + ", ".join(values), values, fold)


_FLAG = Flag("1 or 0 (also true/false, yes/no, on/off)")
_SECONDS = Float("a positive number of seconds")
_BYTES = Bytes("a byte count like 8G, 512M or 1048576", low=0)


@dataclass(frozen=True)
class Settings:
    """One field per TF_GLM53_* knob; the field's metadata holds its variable, kind and description."""

    # ---- the engine (glm53/runtime/engine.py) ---------------------------------------------------------
    device: str | None = knob("DEVICE", _choice(DEVICES), None, "the device the engine runs on",
                              "cuda when available, else cpu")
    dtype: str | None = knob("DTYPE", _choice(DTYPES), None, "compute dtype", "bf16 on cuda, fp32 on cpu")
    kv_dtype: str = knob("KV_DTYPE", _choice(KV_DTYPES), "bf16",
                         "latent cache dtype: fp8 is e4m3 with one scale per row (about half the bytes); "
                         "fp32 for reference tests")
    prefill_chunk: int | None = knob(
        "PREFILL_CHUNK", _positive(), None,
        "the prefill piece size C; bounds a piece's memory. Pieces run from where prefill starts; where reuse "
        "is floored to the grid they follow it: chunk k covers positions [kC, (k+1)C)", "2048 on cuda, 256 on cpu")
    prefill_wave: int | None = knob(
        "PREFILL_WAVE", _positive(), None,
        "tokens of consecutive prefill pieces run as one wave: each piece's attention as alone, each layer's "
        "feed-forward block over the wave's rows at once, so a MoE layer reads its experts once a wave, not once "
        "a piece (same bits; only where the ops are row-invariant, else one piece a wave)", "4C")
    cache_block: int = knob("CACHE_BLOCK", _positive(), 256,
                            "prefix-cache block B: the hash chain's granularity; a stored prefix also keeps its "
                            "partial last block")
    prefix_reuse_boundary: str = knob(
        "PREFIX_REUSE_BOUNDARY", _choice(TRISTATE), "auto",
        "where reuse may resume. auto: at any token where the ops are row-invariant (CPU, Triton on CUDA), "
        "else floored to the prefill grid; 1 always floors; 0 never")
    cuda_graphs: str = knob(
        "CUDA_GRAPHS", _choice(TRISTATE), "auto",
        "auto: windows of up to 16 tokens (decode steps, verification, short extensions) replay CUDA graphs on "
        "CUDA at one rank where exact; 1 requires it (an error where a decode step cannot be captured); 0 eager")
    kernels: str = knob(
        "KERNELS", _choice(KERNEL_CHOICES), "auto",
        "the kernels on CUDA. auto or triton: Triton; torch: plain torch (debugging; not row-invariant, so reuse "
        "floors to the grid). The CPU always runs the row-invariant torch path")
    # ---- the prefix cache (kv_cache/) ---------------------------------------------------------
    prefix_cache: bool = knob("PREFIX_CACHE", _FLAG, True,
                              "the prefix cache on every rank; 0 turns reuse off (byte-identical replies)")
    host_cache_bytes: int = knob("HOST_CACHE_BYTES", _BYTES, 8 << 30, "host tier budget")
    disk_cache: str | None = knob(
        "DISK_CACHE", Text("a folder"), None,
        "the disk tier's folder. Other keys' folders in it (e.g. an older kit version's) are removed when it is "
        "over budget and they went unused for an hour", "unset: no disk tier")
    disk_cache_bytes: int = knob("DISK_CACHE_BYTES", _BYTES, 64 << 30,
                                 "disk tier budget, enforced from start-up; a full filesystem shrinks it to what fits")
    disk_cache_threads: int | None = knob(
        "DISK_CACHE_THREADS", _positive(), None,
        "disk tier read threads; they also pack host-tier nodes for a restore, through a ring of 2 x threads node "
        "buffers (pinned on a GPU at start-up, ~25 MB each at 78 layers)", "min(8, CPUs)")
    store_staging_bytes: int | None = knob(
        "STORE_STAGING_BYTES", _BYTES, None,
        "pinned buffer for storing a request's rows off its path; larger stores go through it in rounds; "
        "0: copy inside the request", "on a GPU 8192 positions of the rank's rows, within 128M..2G; on a CPU 0")
    # ---- several ranks (glm53/dist/) ----------------------------------------------------------
    dcp: bool = knob("DCP", Flag("1 or 0", ("1",), ("0",)), True,
                     "decode context parallelism over the TP ranks (several ranks): positions spread over them; 0: "
                     "every rank holds every position")
    dist_backend: str | None = knob("DIST_BACKEND", _choice(DIST_BACKENDS), None,
                                    "torch.distributed backend between the ranks", "nccl on cuda, gloo on cpu")
    heartbeat_s: float = knob("HEARTBEAT_S", _SECONDS, 0.5,
                              "failure detection across ranks: seconds between a rank's heartbeats")
    dead_after_s: float = knob("DEAD_AFTER_S", _SECONDS, 4.0,
                               "failure detection across ranks: a peer silent this long stops the group (exit 3)")
    collective_timeout_s: float = knob(
        "COLLECTIVE_TIMEOUT_S", _SECONDS, 120.0,
        "failure detection across ranks: a collective unfinished this long stops the group (exit 4)")
    # ---- drafted decoding (drafter/) ----------------------------------------------------------
    draft_source: str = knob(
        "DRAFT_SOURCE", _choice(DRAFT_SOURCES), "auto",
        "draft source. auto: DFlash2 if a drafter is given, else MTP if the checkpoint has it, else copy (prompt "
        "lookup); off: serial decoding; copy, mtp, dflash2: that source (an error where unavailable)")
    draft_max_depth: int = knob("DRAFT_MAX_DEPTH", Int(f"an integer in 1..{MAX_DRAFT_DEPTH}", 1, MAX_DRAFT_DEPTH),
                                MAX_DRAFT_DEPTH, "depth cap: the deepest draft window")
    draft_ewma: float = knob("DRAFT_EWMA", Float("a number in (0, 1]", 1.0), 0.3,
                             "acceptance smoothing: the newest verify step's weight in the mean that sets the depth")
    draft_relaxed_top2: bool = knob(
        "DRAFT_RELAXED_TOP2", _FLAG, False,
        "opt-in relaxed top-2 acceptance: **lossy** (drafted replies may differ from serial ones), never the "
        "default; off for requests that process logits or ask for logprobs")
    # ---- the batched runtime at one rank (glm53/runtime/) -------------------------------------
    max_seqs: int = knob("MAX_SEQS", Int(f"an integer in 1..{MAX_SEQS_LIMIT}", 1, MAX_SEQS_LIMIT), 8,
                         "batched runtime at one rank: running sequences decoded together")
    max_waiting: int = knob("MAX_WAITING", _positive(), 64,
                            "batched runtime: requests queued behind the running sequences; past it the front "
                            "answers 429 with Retry-After")
    step_tokens: int | None = knob(
        "STEP_TOKENS", _positive(), None,
        "batched runtime: rows a step while sequences decode (their windows first, then prefill pieces): the "
        "streams wait for a long prompt's piece beside them, fewer rows lengthen its time to first token "
        "(docs/decisions/step-budget.md); with none decoding, prefill takes a wave",
        "128 where the pieces replay CUDA graphs (one rank on a GPU), else 256")
    kv_pool_bytes: int | None = knob("KV_POOL_BYTES", Bytes("a positive byte count like 8G or 1048576", low=1), None,
                                     "batched runtime: the KV pool's budget (serve.sh sets it to the memory plan's KV of the tightest rank)",
                                     "90% of free GPU memory (unified memory: less the host tier and the "
                                     "memory floor first); 256M on a CPU")
    # ---- serving (glm53/serving/front/, launcher/) ----------------------------------------------------------
    log_level: str = knob("LOG_LEVEL", _choice(LOG_LEVELS, str.upper), "INFO",
                          "log level of the ranks' stderr (the per-request line, kv_cache hits, misses and "
                          "evictions, drafter acceptance); DEBUG adds cache stores")
    api_keys: tuple[str, ...] = knob(
        "API_KEYS", Keys("comma-separated keys"), (),
        "keys rank 0's front asks of /v1 clients (`Authorization: Bearer` or `x-api-key`), besides --api-key's; "
        "/health and /metrics stay open", "unset: none", secret=True)
    mem_floor_mb: int = knob("MEM_FLOOR_MB", Int("an integer >= 0", 0), 4096,
                             "memory guard floor on every node: a rank whose node's available memory falls below "
                             "it stops the lane (exit 75); the launcher sets it from the cluster file's "
                             "memory.floor_gib")
    meminfo: str = knob("MEMINFO", Text("a file"), "/proc/meminfo",
                        "tests: a file in /proc/meminfo's format that the memory guard, progress lines and probes "
                        "read instead")

    def __post_init__(self) -> None:
        for name, k in knobs().items():
            value = getattr(self, name)
            if value is None and _default(name) is None:  # unset: resolved where the device is known
                continue
            try:
                object.__setattr__(self, name, k.kind.check(value))
            except ValueError:
                raise k.error(value) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Every TF_GLM53_* variable of `environ` (default: the process environment), parsed and
        checked; one SettingsError lists every bad value and unknown name."""
        env = os.environ if environ is None else environ
        by_env = {k.env: name for name, k in knobs().items()}
        values: dict[str, Any] = {}
        problems: list[str] = []
        for var in sorted(v for v in env if v.startswith(PREFIX)):
            name = by_env.get(var)
            if name is None:
                if var not in TEST_ONLY:
                    problems.append(unknown_message(var))
                continue
            text = env[var]
            if not text.strip():
                continue
            k = knobs()[name]
            try:
                values[name] = k.kind.parse(text)
            except ValueError:
                problems.append(str(k.error(text)))
        if problems:
            raise SettingsError("; ".join(problems))
        return cls(**values)

    def override(self, **values: Any) -> "Settings":
        """These settings with the given fields replaced (explicit arguments win over the environment);
        None leaves a field as it is. A bad value raises SettingsError naming the field's variable."""
        given = {k: v for k, v in values.items() if v is not None}
        unknown = sorted(set(given) - set(knobs()))
        if unknown:
            raise TypeError(f"Settings has no field(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **given) if given else self


@functools.cache
def knobs() -> dict[str, Knob]:
    """Field name -> its Knob, in declaration order."""
    return {f.name: f.metadata["knob"] for f in dataclasses.fields(Settings)}


def _default(name: str) -> Any:
    return _defaults()[name]


@functools.cache
def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(Settings)}


def env_name(name: str) -> str:
    """The variable of a Settings field ("dcp" -> "TF_GLM53_DCP"): for code that writes a child's environment."""
    return knobs()[name].env


def unknown_message(var: str) -> str:
    # compared without the prefix every name shares, which would make any two names look alike
    known = [k.env.removeprefix(PREFIX) for k in knobs().values()]
    close = difflib.get_close_matches(var.removeprefix(PREFIX), known, n=1, cutoff=0.6)
    hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
    return f"{var} is not a variable the kit reads{hint}; `python -m glm53.settings --markdown` lists them"


# ---- README.md's knob table ------------------------------------------------------------------------
BEGIN, END = "<!-- knobs:begin -->", "<!-- knobs:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _values(kind: Kind) -> str:
    if isinstance(kind, Choice):
        return ", ".join(f"`{v}`" for v in kind.values)
    if isinstance(kind, Flag):
        return " or ".join(f"`{v}`" for v in (kind.true[0], kind.false[0])) + (
            " (also true/false, yes/no, on/off)" if len(kind.true) > 1 else "")
    return kind.accepted


def _default_cell(name: str, k: Knob) -> str:
    if k.default_text is not None:
        return k.default_text
    value = _default(name)
    if isinstance(value, bool):
        value = int(value)
    elif isinstance(k.kind, Bytes):
        value = format_bytes(value)
    return f"`{value}`"


def markdown_table() -> str:
    lines = ["| variable | accepted | default | meaning |", "| --- | --- | --- | --- |"]
    for name, k in knobs().items():
        lines.append(f"| `{k.env}` | {_cell(_values(k.kind))} | {_cell(_default_cell(name, k))} | {_cell(k.help)} |")
    return "\n".join(lines) + "\n"


def with_table(readme: str) -> str:
    """`readme` with the text between the knob markers replaced by the generated table."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the markers {BEGIN} and {END}")
    return readme[:start + len(BEGIN)] + "\n" + markdown_table() + readme[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53.settings", description="The TF_GLM53_* knobs.")
    p.add_argument("--markdown", action="store_true", help="print README.md's knob table")
    p.add_argument("--update-readme", metavar="PATH", nargs="?", const="README.md",
                   help="rewrite the table between the knob markers of PATH (default README.md)")
    p.add_argument("--check", action="store_true", help="validate this environment's TF_GLM53_* variables")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    if args.update_readme:
        path = Path(args.update_readme)
        path.write_text(with_table(path.read_text()))
    if args.check or not (args.markdown or args.update_readme):
        try:
            Settings.from_env()
        except SettingsError as exc:
            print(exc, file=sys.stderr)
            return 2
        print("TF_GLM53_* settings: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
