"""`python -m launcher` (and serve.sh): start, stop, restart and check a lane.

Exit codes: 0 done (READY, stopped, checks passed); 1 the lane failed to start (the failing rank's
log tail is printed); 2 bad usage or settings; 3 preflight failed; 4 the memory plan refused the
start; 5 the port is taken or a lane already runs there.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from launcher import serve as lane
from launcher.config import KIT_DIR, ConfigError, LaneConfig, check_knobs, from_dict, load_cluster, local_lane, \
    with_environment, with_flags
from launcher.prepare import prepare
from launcher.state import read_json
from launcher.supervisor import Supervisor


def lane_options(f):
    for option in reversed([
        click.option("--cluster", type=click.Path(dir_okay=False), default=None,
                     help="cluster file (YAML; see cluster.example.yaml). Default: $GLM53_CLUSTER, else the local lane"),
        click.option("--local", is_flag=True, help="run on this machine (the embedded default), ignoring any cluster file"),
        click.option("--model", default=None, help="checkpoint directory (default: the tiny checkpoint, generated on first use)"),
        click.option("--ranks", type=int, default=None, help="local ranks (the local lane; default 1)"),
        click.option("--port", type=int, default=None, help="HTTP port of rank 0 (default 8300)"),
        click.option("--host", "listen", default=None, help="HTTP listen address (default 127.0.0.1, loopback)"),
        click.option("--context", type=int, default=None, help="tokens per request (default: the most that fits)"),
        click.option("--served-model-name", "served_model", default=None, help="model id (default glm-5.3-exl3)"),
        click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default=None,
                     help="latent cache dtype (default bf16; fp8 about halves KV bytes)"),
        click.option("--drafting/--no-drafting", default=None, help="speculative decoding (default on)"),
        click.option("--ready-timeout", type=float, default=1800.0, show_default=True,
                     help="seconds to wait for READY"),
    ]):
        f = option(f)
    return f


def resolve(cluster: str | None, local: bool, ranks: int | None, knobs: bool = True, **flags: Any) -> LaneConfig:
    """The lane's config; `knobs`: also check the TF_GLM53_* variables the ranks will get (not for
    stop, which starts nothing and must work whatever the environment holds)."""
    cluster = None if local else (cluster or os.environ.get("GLM53_CLUSTER") or None)
    try:
        if cluster:
            if ranks is not None:
                raise ConfigError("--ranks is for the local lane; a cluster file lists its nodes")
            config = load_cluster(cluster)
        else:
            config = local_lane(1 if ranks is None else ranks, device=lane.local_device())
        config = with_environment(config)
        if knobs:
            check_knobs(config)
        return with_flags(config, **flags)
    except ConfigError as exc:
        click.echo(f"serve: {exc}", err=True)
        sys.exit(lane.EXIT_USAGE)


def _fail(exc: Exception) -> None:
    click.echo(str(exc), err=True)
    sys.exit(getattr(exc, "code", 1))


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__)
def main() -> None:
    pass


EXIT_CODES = ("Exit codes: 0 READY; 1 the lane failed to start (the failing rank's log tail is printed); "
              "2 bad usage or settings; 3 preflight failed; 4 the memory plan refused the start; "
              "5 the port is taken or a lane already runs there.")


@main.command("serve", epilog=EXIT_CODES)
@lane_options
def serve_cmd(ready_timeout: float, **opts: Any) -> None:
    """Start the lane in the background; return when READY (DRY_RUN=1: print the plan and commands)."""
    config = resolve(**opts)
    try:
        sys.exit(lane.start(config, dry_run=os.environ.get("DRY_RUN", "0") not in ("", "0"),
                            ready_timeout=ready_timeout))
    except lane.LaneError as exc:
        _fail(exc)


@main.command("restart", epilog=EXIT_CODES)
@lane_options
def restart_cmd(ready_timeout: float, **opts: Any) -> None:
    """Check the new settings, then stop the running lane on that port and start the new one."""
    config = resolve(**opts)
    sys.exit(lane.restart(config, ready_timeout=ready_timeout))


@main.command("stop")
@click.option("--port", type=int, default=None, help="the lane's port (default: from --cluster, else 8300)")
@click.option("--cluster", type=click.Path(dir_okay=False), default=None)
def stop_cmd(port: int | None, cluster: str | None) -> None:
    """Stop every rank of the lane on PORT; logs are kept."""
    config = resolve(cluster, local=cluster is None and not os.environ.get("GLM53_CLUSTER"), ranks=None, knobs=False,
                     port=port)
    sys.exit(lane.stop(lane.lane_dir(config)))


@main.command("status")
@click.option("--port", type=int, default=8300, show_default=True)
def status_cmd(port: int) -> None:
    """Print the lane's state (exit 0 when READY)."""
    sys.exit(lane.status(KIT_DIR / ".work" / "lanes" / str(port)))


@main.command("check")
@lane_options
def check_cmd(ready_timeout: float, **opts: Any) -> None:
    """Preflight and memory plan only: start nothing."""
    config = resolve(**opts)
    model = lane.model_path(config, dry_run=True)
    _, _, problems = lane.check(config, model, sys.stderr, dry_run=True)
    for p in problems:
        click.echo(p, err=True)
    sys.exit(lane.EXIT_PREFLIGHT if problems else 0)


@main.command("prepare", epilog="Exit codes: 0 every node carries the runtime key; 2 bad settings; 3 a node failed "
                                "(named, with the fix).")
@click.option("--cluster", type=click.Path(dir_okay=False), required=True)
def prepare_cmd(cluster: str) -> None:
    """Install the patched TensorFold checkout and the kit into the runtime on every node (idempotent,
    keyed by the series pin, the patches and the kit version), then check every node has the same key.
    A venv is filled on each node; an image is built on rank 0 and sent to the others
    (DRY_RUN=1: print every command, change nothing)."""
    config = resolve(cluster, local=False, ranks=None)
    sys.exit(prepare(config, dry_run=os.environ.get("DRY_RUN", "0") not in ("", "0")))


@main.command("supervise", hidden=True)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
def supervise_cmd(run_dir: Path) -> None:
    """(internal) The detached supervisor that serve starts."""
    saved = read_json(run_dir / "config.json")
    supervisor = Supervisor(from_dict(saved["config"]), saved["model"], run_dir, saved["ready_timeout"])
    sys.exit(supervisor.serve())
