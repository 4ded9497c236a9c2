"""Every shell command the launcher runs on a node, built in one place so DRY_RUN prints exactly
what a real start would run."""
from __future__ import annotations

import hashlib
import os
import shlex
from importlib import metadata
from pathlib import Path

from glm53.settings import env_name
from launcher.config import KIT_DIR, LaneConfig, Node

RUNTIME_STAMP = ".glm53-runtime-key"


def q(value: str) -> str:
    return shlex.quote(value)


def run_dir(config: LaneConfig) -> str:
    """Per-lane directory on every node (pid files) and here (logs, state): keyed by the port."""
    return f"{config.kit_dir}/.work/lanes/{config.port}"


def pid_file(config: LaneConfig, node: Node) -> str:
    return f"{run_dir(config)}/rank{node.rank}.pid"


def runtime_key(kit_dir: Path = KIT_DIR) -> str:
    """Identifies a prepared runtime: the series pin, every patch's bytes and the kit version."""
    h = hashlib.sha256()
    series = kit_dir / "series"
    h.update(series.read_bytes() if series.is_file() else b"no-series")
    for patch in sorted((kit_dir / "patches").glob("*.patch")):
        h.update(patch.name.encode() + b"\0" + patch.read_bytes())
    try:
        version = metadata.version("glm53-kit")
    except metadata.PackageNotFoundError:
        version = "unknown"
    h.update(b"kit " + version.encode())
    return h.hexdigest()[:32]


def python_of(config: LaneConfig) -> str:
    return config.runtime.python()


def rank_module() -> str:
    """The rank entry point. GLM53_RANK_MODULE replaces it only in the launcher's own tests (a
    stand-in engine for multi-rank lanes while the glm53 engine serves one rank)."""
    return os.environ.get("GLM53_RANK_MODULE", "glm53.serving.rank")


def rank_argv(config: LaneConfig, node: Node, model: str) -> list[str]:
    argv = [python_of(config) if not config.runtime.image else "python", "-m", rank_module(),
            "--model", model, "--rank", str(node.rank), "--ranks", str(config.ranks),
            "--master", config.master(), "--master-port", str(config.master_port),
            "--served-model-name", config.served_model, "--context", str(config.context)]
    if node.rank == 0:
        argv += ["--host", config.listen, "--port", str(config.port)]
    if config.drafter:
        argv += ["--drafter", config.drafter]
    if not config.drafting:
        argv.append("--no-drafts")
    if config.kv_dtype != "bf16":
        argv += ["--option", f"kv_dtype={config.kv_dtype}"]
    return argv


def rank_env(config: LaneConfig) -> dict[str, str]:
    env = dict(config.env)
    env.setdefault(env_name("dcp"), "1" if config.dcp else "0")
    env.setdefault(env_name("mem_floor_mb"), str(int(config.memory.floor_gib * 1024)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def local_rank(config: LaneConfig, node: Node) -> int:
    """Which of its host's GPUs a rank uses: its index among the ranks on that host (LOCAL_RANK)."""
    return sorted(n.rank for n in config.nodes if n.host == node.host).index(node.rank)


def rank_command(config: LaneConfig, node: Node, model: str) -> str:
    """Starts one rank in the foreground of its ssh session (so the session ends when the rank
    does), its pid in a file on the node so `stop` can reach it."""
    rd = run_dir(config)
    env = rank_env(config)
    env["LOCAL_RANK"] = str(local_rank(config, node))
    argv = rank_argv(config, node, model)
    prologue = f"mkdir -p {q(rd)} && cd {q(config.kit_dir)} && echo $$ > {q(pid_file(config, node))} && "
    if config.runtime.image:
        name = f"glm53-rank{node.rank}-{config.port}"
        flags = " ".join(f"-e {q(k + '=' + v)}" for k, v in sorted(env.items()))
        mounts = " ".join(f"-v {q(p)}:{q(p)}" for p in sorted({model, config.kit_dir}))
        return (prologue + f"exec docker run --rm --name {name} --gpus all --network host --ipc host {mounts} "
                f"-w {q(config.kit_dir)} {flags} {q(config.runtime.image)} " + " ".join(q(a) for a in argv))
    assigns = " ".join(q(f"{k}={v}") for k, v in sorted(env.items()))
    return prologue + f"exec env {assigns} " + " ".join(q(a) for a in argv)


def stop_command(config: LaneConfig, node: Node, signal: str = "TERM", grace_s: float = 10.0) -> str:
    """Signals the rank; a container is given `grace_s` to stop before docker kills it."""
    pf = q(pid_file(config, node))
    # only a process that is still this rank (a pid can be reused after the rank is gone)
    cmd = (f"if [ -f {pf} ]; then p=$(cat {pf}); if tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null "
           f"| grep -q -- '--rank {node.rank} '; then kill -{signal} $p 2>/dev/null; fi; fi; true")
    if config.runtime.image:
        cmd = f"docker stop -t {int(grace_s)} glm53-rank{node.rank}-{config.port} >/dev/null 2>&1; " + cmd
    return cmd


def alive_command(config: LaneConfig, node: Node) -> str:
    pf = q(pid_file(config, node))
    return f"[ -f {pf} ] && kill -0 $(cat {pf}) 2>/dev/null && echo alive || echo gone"


def probe_command(config: LaneConfig, model: str) -> str:
    """Runs launcher.probe with the lane's runtime: the venv's python, or inside the image (with
    the GPUs, the checkpoint and the kit checkout mounted as the ranks will have them)."""
    argv = ["-m", "launcher.probe", "--model", model, "--kit-dir", config.kit_dir]
    if config.workdir:
        argv += ["--workdir", config.workdir]
    if config.runtime.venv:
        argv += ["--runtime-stamp", f"{config.runtime.venv}/{RUNTIME_STAMP}"]
    if config.runtime.image:
        mounts = " ".join(f"-v {q(p)}:{q(p)}" for p in sorted({model, config.kit_dir}))
        return (f"docker run --rm --gpus all --network host {mounts} -w {q(config.kit_dir)} {q(config.runtime.image)} "
                "python " + " ".join(q(a) for a in argv))
    return f"cd {q(config.kit_dir)} && " + " ".join(q(a) for a in [python_of(config), *argv])


def prepare_command(config: LaneConfig, key: str) -> str:
    """Idempotent: a runtime whose stamp matches `key` is left alone; otherwise (re)install the kit
    and the patched TensorFold checkout into it, then write the stamp (temp file + rename).
    For an image this only checks the key on one node: launcher/prepare.py builds and sends images."""
    if config.runtime.image:
        image = q(config.runtime.image)
        return (f"docker image inspect {image} --format '{{{{index .Config.Labels \"glm53.runtime-key\"}}}}' "
                f"| grep -qx {q(key)} || {{ echo {q(f'image {config.runtime.image} lacks runtime key {key}: run python -m launcher prepare --cluster {config.source} (builds it on rank 0 and sends it to the other nodes)')} >&2; exit 3; }}")
    venv = config.runtime.venv
    stamp = f"{venv}/{RUNTIME_STAMP}"
    pip = f"{q(venv + '/bin/python')} -m pip install -q --disable-pip-version-check"
    steps = [f"if [ -f {q(stamp)} ] && [ \"$(cat {q(stamp)})\" = {q(key)} ]; then echo up-to-date; exit 0; fi",
             f"[ -x {q(venv + '/bin/python')} ] || python3 -m venv --system-site-packages {q(venv)}",
             f"{pip} --no-deps -e {q(config.kit_dir)}"]
    if config.workdir:
        steps.append(f"{pip} --no-deps -e {q(config.workdir)}")
    steps += [f"echo {q(key)} > {q(stamp + '.tmp')}", f"mv {q(stamp + '.tmp')} {q(stamp)}", "echo prepared"]
    return "set -e; " + "; ".join(steps)
