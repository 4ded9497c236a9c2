"""The lane's settings: the cluster file, then the environment, then flags (each overrides the last).

A lane is N nodes, one rank each. Without a cluster file (or with --local) the lane runs on this
machine: R local ranks, the tiny checkpoint unless a model is named. See cluster.example.yaml for
every field, line by line.
"""
from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from glm53.kv_format import SERVING_KV_DTYPES
from glm53.settings import PREFIX, Settings, SettingsError, env_name

KIT_DIR = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 8300
DEFAULT_MODEL_ID = "glm-5.3-exl3"
DEFAULT_MASTER_PORT = 29551
FORWARDED_PREFIXES = (PREFIX, "TENSORFOLD_")
KV_DTYPES = SERVING_KV_DTYPES

# Environment variables that override the cluster file (flags override both).
ENV_OVERRIDES = {
    "TENSORFOLD_MODEL": "model", "TENSORFOLD_PORT": "port", "TENSORFOLD_HOST": "listen",
    "TENSORFOLD_SERVED_MODEL_NAME": "served_model", "TENSORFOLD_CONTEXT": "context",
    "TENSORFOLD_KV_DTYPE": "kv_dtype", "TENSORFOLD_DRAFTING": "drafting",
    "TENSORFOLD_MASTER_PORT": "master_port",
}


class ConfigError(ValueError):
    """A cluster file or setting the launcher cannot use; the message names the file and field."""


@dataclass(frozen=True)
class Node:
    host: str  # ssh destination ("local" runs on this machine without ssh)
    rank: int
    user: str | None = None
    fabric: str | None = None  # address the ranks use to reach this node (rendezvous); default host
    ssh_port: int = 22
    identity: str | None = None  # ssh private key file

    @property
    def is_local(self) -> bool:
        return self.host == "local"

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.host})"

    @property
    def fabric_address(self) -> str:
        return self.fabric or ("127.0.0.1" if self.is_local else self.host)


@dataclass(frozen=True)
class Runtime:
    venv: str | None = None  # a virtual environment path on every node
    image: str | None = None  # or a container image (CUDA PyTorch base + the kit)
    base: str | None = None  # the CUDA PyTorch base image `prepare` builds `image` from

    def python(self) -> str:
        return f"{self.venv}/bin/python" if self.venv else "python"


@dataclass(frozen=True)
class MemorySettings:
    floor_gib: float = 4.0  # never leave a node with less available than this
    overhead_fraction: float = 0.05  # of weights + KV: allocator slack, fragmentation
    overhead_gib: float = 1.5  # CUDA context, kernels, the Python process
    workspace_gib: float = 2.0  # activations of one prefill chunk, sampling, buffers
    unified: str = "auto"  # "auto" (detect), "yes" or "no": unified memory (DGX Spark)


@dataclass(frozen=True)
class LaneConfig:
    nodes: tuple[Node, ...]
    model: str | None = None  # checkpoint directory (same path on every node); None: the tiny one
    drafter: str | None = None
    runtime: Runtime = field(default_factory=Runtime)
    kit_dir: str = str(KIT_DIR)  # the kit checkout on every node
    workdir: str | None = None  # apply.py's patched TensorFold checkout on every node
    port: int = DEFAULT_PORT
    listen: str = "127.0.0.1"  # HTTP address of rank 0; loopback unless told otherwise
    served_model: str = DEFAULT_MODEL_ID
    context: int = 0  # tokens per request; 0: the checkpoint's maximum
    kv_dtype: str = "bf16"
    drafting: bool = True
    dcp: bool = True
    master_port: int = DEFAULT_MASTER_PORT
    env: dict[str, str] = field(default_factory=dict)  # forwarded to every rank
    memory: MemorySettings = field(default_factory=MemorySettings)
    device: str = "cuda"  # "cuda": every node must show a GPU; "cpu": gloo ranks (tests, the tiny model)
    ssh_options: tuple[str, ...] = ()  # extra ssh arguments, e.g. ["-F", "/path/ssh_config"]
    source: str = "--local"

    @property
    def ranks(self) -> int:
        return len(self.nodes)

    @property
    def local(self) -> bool:
        return all(n.is_local for n in self.nodes)

    def master(self) -> str:
        return self.nodes[0].fabric_address


def local_lane(ranks: int = 1, **settings: Any) -> LaneConfig:
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks}: a lane needs at least one rank")
    nodes = tuple(Node(host="local", rank=r) for r in range(ranks))
    # a free rendezvous port, so that lanes (and other jobs) on this machine never collide on 29551
    settings.setdefault("master_port", free_port())
    if settings.get("device") == "cpu":  # CPU ranks: no CUDA context, small activations
        settings.setdefault("memory", MemorySettings(floor_gib=2.0, overhead_gib=1.0, workspace_gib=0.5))
    return _validated(LaneConfig(nodes=nodes, runtime=Runtime(venv=str(Path(os.sys.executable).parents[1])),
                                 **settings))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _field(raw: dict[str, Any], name: str, kinds: type | tuple[type, ...], source: str, where: str = "") -> Any:
    value = raw.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,))):
        want = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{source}: {where}{name} must be {want}, got {value!r}")
    return value


def load_cluster(path: str | Path) -> LaneConfig:
    """Read a cluster file; every error names the file and the field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such cluster file (copy cluster.example.yaml and edit it)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping (see cluster.example.yaml)")
    src = str(path)
    known = {"nodes", "model", "drafter", "runtime", "kit_dir", "workdir", "port", "listen", "served_model",
             "context", "kv_dtype", "drafting", "dcp", "master_port", "env", "memory", "ssh_user", "device",
             "ssh_options"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{src}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    raw_nodes = raw.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError(f"{src}: nodes must be a non-empty list of {{host, rank, ...}}")
    default_user = _field(raw, "ssh_user", str, src)
    nodes = []
    for i, item in enumerate(raw_nodes):
        where = f"nodes[{i}]."
        if not isinstance(item, dict) or "host" not in item:
            raise ConfigError(f"{src}: nodes[{i}] must be a mapping with at least host and rank")
        extra = sorted(set(item) - {"host", "rank", "user", "fabric", "ssh_port", "identity"})
        if extra:
            raise ConfigError(f"{src}: {where}{extra[0]} is not a node field (host, rank, user, fabric, ssh_port, identity)")
        nodes.append(Node(host=_field(item, "host", str, src, where), rank=_field(item, "rank", int, src, where),
                          user=_field(item, "user", str, src, where) or default_user,
                          fabric=_field(item, "fabric", str, src, where),
                          ssh_port=_field(item, "ssh_port", int, src, where) or 22,
                          identity=_field(item, "identity", str, src, where)))
    runtime_raw = raw.get("runtime") or {}
    if not isinstance(runtime_raw, dict) or bool(runtime_raw.get("venv")) == bool(runtime_raw.get("image")):
        raise ConfigError(f"{src}: runtime must name exactly one of venv (a path) or image (a container image)")
    unknown_runtime = sorted(set(runtime_raw) - {"venv", "image", "base"})
    if unknown_runtime:
        raise ConfigError(f"{src}: runtime.{unknown_runtime[0]} is not a runtime field (venv, image, base)")
    if runtime_raw.get("base") is not None and not (runtime_raw.get("image") and isinstance(runtime_raw["base"], str)):
        raise ConfigError(f"{src}: runtime.base (the CUDA PyTorch base image, e.g. nvcr.io/nvidia/pytorch:TAG) "
                          f"is a string and goes with runtime.image")
    memory_raw = raw.get("memory") or {}
    if not isinstance(memory_raw, dict):
        raise ConfigError(f"{src}: memory must be a mapping")
    if isinstance(memory_raw.get("unified"), bool):  # YAML reads yes/no as booleans
        memory_raw = {**memory_raw, "unified": "yes" if memory_raw["unified"] else "no"}
    if memory_raw.get("unified", "auto") not in ("auto", "yes", "no"):
        raise ConfigError(f"{src}: memory.unified must be auto, yes or no, got {memory_raw['unified']!r}")
    try:
        memory = MemorySettings(**memory_raw)
    except TypeError as exc:
        raise ConfigError(f"{src}: memory: {exc}") from None
    env = raw.get("env") or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{src}: env must be a mapping of NAME: value")
    config = LaneConfig(
        nodes=tuple(sorted(nodes, key=lambda n: n.rank)),
        model=_field(raw, "model", str, src), drafter=_field(raw, "drafter", str, src),
        runtime=Runtime(venv=runtime_raw.get("venv"), image=runtime_raw.get("image"), base=runtime_raw.get("base")),
        kit_dir=_field(raw, "kit_dir", str, src) or str(KIT_DIR), workdir=_field(raw, "workdir", str, src),
        port=_field(raw, "port", int, src) or DEFAULT_PORT, listen=_field(raw, "listen", str, src) or "127.0.0.1",
        served_model=_field(raw, "served_model", str, src) or DEFAULT_MODEL_ID,
        context=_field(raw, "context", int, src) or 0, kv_dtype=_field(raw, "kv_dtype", str, src) or "bf16",
        drafting=raw.get("drafting", True) is not False, dcp=raw.get("dcp", True) is not False,
        master_port=_field(raw, "master_port", int, src) or DEFAULT_MASTER_PORT,
        env={str(k): str(v) for k, v in env.items()}, memory=memory,
        device=_field(raw, "device", str, src) or "cuda",
        ssh_options=tuple(str(o) for o in (raw.get("ssh_options") or ())), source=src)
    if config.model is None:
        raise ConfigError(f"{src}: model (the checkpoint directory on every node) is required")
    return _validated(config)


def _validated(config: LaneConfig) -> LaneConfig:
    src = config.source
    ranks = sorted(n.rank for n in config.nodes)
    if ranks != list(range(len(ranks))):
        raise ConfigError(f"{src}: node ranks must be 0..{len(ranks) - 1} once each, got {ranks}")
    if config.kv_dtype not in KV_DTYPES:
        raise ConfigError(f"{src}: kv_dtype must be one of {', '.join(KV_DTYPES)}, got {config.kv_dtype!r}")
    if config.device not in ("cuda", "cpu"):
        raise ConfigError(f"{src}: device must be cuda or cpu, got {config.device!r}")
    if not 0 < config.port < 65536:
        raise ConfigError(f"{src}: port must be 1..65535, got {config.port}")
    if config.context < 0:
        raise ConfigError(f"{src}: context must be >= 0 (0: the checkpoint's maximum), got {config.context}")
    for name in config.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{src}: env name {name!r} is not a valid variable name")
    return config


def check_knobs(config: LaneConfig, environ: Mapping[str, str] | None = None) -> None:
    """The TF_GLM53_* variables the ranks will get (this environment's, then the cluster file's env),
    parsed as every rank will parse them (glm53.settings): a bad value or an unknown name stops a
    start here, before any node is touched, naming where it came from."""
    environ = os.environ if environ is None else environ
    forwarded = {k: v for k, v in environ.items() if k.startswith(PREFIX)}
    own = {k: v for k, v in config.env.items() if k not in forwarded}
    for env, where in ((forwarded, "environment"), (own, f"{config.source}: env")):
        try:
            Settings.from_env(env)
        except SettingsError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _coerce(name: str, value: str, current: Any) -> Any:
    if isinstance(current, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"environment: {name}={value!r} must be on/off (1/0)")
    if isinstance(current, int):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"environment: {name}={value!r} must be an integer") from None
    return value


def api_keys(environ: Mapping[str, str]) -> list[str]:
    """The keys in TF_GLM53_API_KEYS of `environ` (a lane's env, or a command's environment), as the
    ranks parse them (glm53.settings)."""
    return list(Settings.from_env(environ).api_keys)


def with_environment(config: LaneConfig, environ: dict[str, str] | None = None) -> LaneConfig:
    """Apply TENSORFOLD_* overrides and collect the TF_GLM53_*/TENSORFOLD_* variables to forward."""
    environ = dict(os.environ if environ is None else environ)
    changes: dict[str, Any] = {}
    for name, attr in ENV_OVERRIDES.items():
        if environ.get(name):
            changes[attr] = _coerce(name, environ[name], getattr(config, attr))
    forwarded = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    changes["env"] = {**config.env, **forwarded}
    changes.update(_cache_layout(config, changes))
    return _validated(replace(config, **changes))


def _cache_layout(config: LaneConfig, changes: dict[str, Any]) -> dict[str, Any]:
    """kv_dtype and dcp as the ranks will run them: a TF_GLM53_KV_DTYPE / TF_GLM53_DCP they get wins
    over the cluster file's field, so the memory plan describes the cache the ranks allocate. One that
    contradicts TENSORFOLD_KV_DTYPE is refused (two answers to one question)."""
    env = changes["env"]
    knobs = {k: v for k, v in env.items() if k.startswith(PREFIX)}
    try:
        ranks_see = Settings.from_env(knobs)
    except SettingsError:
        return {}  # check_knobs reports it, naming where it came from
    out = {f: getattr(ranks_see, f) for f in ("kv_dtype", "dcp") if (env.get(env_name(f)) or "").strip()}
    if "kv_dtype" in out and "kv_dtype" in changes and changes["kv_dtype"] != out["kv_dtype"]:
        name = env_name("kv_dtype")
        raise ConfigError(f"environment: {name}={env[name]!r} and TENSORFOLD_KV_DTYPE="
                          f"{env.get('TENSORFOLD_KV_DTYPE')!r} disagree; unset one of them")
    return out


def with_flags(config: LaneConfig, **flags: Any) -> LaneConfig:
    """Flags override the file and the environment; None means not given."""
    given = {k: v for k, v in flags.items() if v is not None}
    return _validated(replace(config, **given))


def to_dict(config: LaneConfig) -> dict[str, Any]:
    return asdict(config)


def from_dict(raw: dict[str, Any]) -> LaneConfig:
    """Inverse of to_dict (the supervisor reads the lane's resolved config this way)."""
    return LaneConfig(**{**raw, "nodes": tuple(Node(**n) for n in raw["nodes"]), "runtime": Runtime(**raw["runtime"]),
                         "memory": MemorySettings(**raw["memory"]), "ssh_options": tuple(raw["ssh_options"])})
