"""`python -m launcher prepare`: put the patched TensorFold checkout and the kit into the runtime on
every node, keyed by the series pin, the patches and the kit version (commands.runtime_key), and
leave every node with the same key.

venv: each node, in parallel, creates/fills its venv unless its stamp already holds the key.
image: read every node's image key; when any lacks it, build on rank 0 (unless rank 0 has it), then
send rank 0's image to each node still without the key; finally check every node carries the key.
Exit codes: 0 every node carries the key; 3 a node failed (named, with the fix or its stderr).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

from launcher import commands, image
from launcher.config import LaneConfig, Node
from launcher.nodes import Result, display, node_argv, run, ssh_failure

EXIT_OK = 0
EXIT_FAILED = 3
BUILD_TIMEOUT_S = 3 * 3600  # a first pull of a CUDA PyTorch base is many GB
TRANSFER_TIMEOUT_S = 3 * 3600


def prepare(config: LaneConfig, dry_run: bool = False, out: TextIO = sys.stderr,
            key: str | None = None) -> int:
    key = key or commands.runtime_key()
    if config.runtime.image:
        return _prepare_image(config, key, dry_run, out)
    return _prepare_venv(config, key, dry_run, out)


def _say(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)


def _failure(r: Result, what: str) -> str:
    return ssh_failure(r) or (f"{r.node.label}: {what} failed (exit {r.returncode}): "
                              f"{' | '.join(r.stderr.strip().splitlines()[-5:]) or 'no output'}")


def _on_every_node(config: LaneConfig, command: str, timeout: float) -> list[Result]:
    with ThreadPoolExecutor(max_workers=config.ranks) as pool:
        return list(pool.map(lambda n: run(n, config, command, timeout=timeout), config.nodes))


def _prepare_venv(config: LaneConfig, key: str, dry_run: bool, out: TextIO) -> int:
    command = commands.prepare_command(config, key)
    if dry_run:
        for node in config.nodes:
            _say(out, f"{node.label}: {display(node_argv(node, config, command))}")
        return EXIT_OK
    failed = False
    for r in _on_every_node(config, command, BUILD_TIMEOUT_S):
        if ssh_failure(r) or r.returncode != 0:
            failed = True
            _say(out, _failure(r, "prepare"))
        else:
            _say(out, f"{r.node.label}: {r.stdout.strip().splitlines()[-1] if r.stdout.strip() else 'done'} (key {key})")
    return EXIT_FAILED if failed else EXIT_OK


# -- image runtime ---------------------------------------------------------------------------------

def image_keys(config: LaneConfig) -> tuple[dict[int, str | None], list[str]]:
    """Each node's image key by rank (None: no such image, or no key label), and the failures
    (ssh, or docker itself) that left a node's answer unknown."""
    keys: dict[int, str | None] = {}
    problems = []
    for r in _on_every_node(config, image.inspect_command(config), 120):
        if ssh_failure(r):
            problems.append(ssh_failure(r))
        elif r.returncode == 0:
            value = r.stdout.strip()
            keys[r.node.rank] = None if value in ("", "<no value>") else value
        elif "No such image" in r.stderr or "No such object" in r.stderr:
            keys[r.node.rank] = None
        else:
            problems.append(_failure(r, f"docker image inspect {config.runtime.image}") +
                            " Fix: install docker on that node and let this user run it")
    return keys, problems


def _describe(config: LaneConfig, node: Node, have: str | None, key: str) -> str:
    if have is None:
        return f"{node.label}: image {config.runtime.image} absent or without a runtime key (want {key})"
    return f"{node.label}: image {config.runtime.image} carries runtime key {have}, want {key}"


def _transfer(config: LaneConfig, source: Node, target: Node) -> str | None:
    """`docker save` on source piped into `docker load` on target through this machine. Both sides
    are reported when both fail (a failed load breaks the pipe of the save)."""
    with tempfile.TemporaryFile() as save_err:
        save = subprocess.Popen(node_argv(source, config, image.save_command(config)), stdout=subprocess.PIPE,
                                stderr=save_err, stdin=subprocess.DEVNULL)
        try:
            load = subprocess.run(node_argv(target, config, image.load_command(config)), stdin=save.stdout,
                                  capture_output=True, text=True, timeout=TRANSFER_TIMEOUT_S)
        finally:
            save.stdout.close()
            save.wait()
        save_err.seek(0)
        save_stderr = save_err.read().decode(errors="replace")
    problems = []
    if load.returncode != 0:
        problems.append(_failure(Result(target, load.returncode, load.stdout, load.stderr), "docker load"))
    if save.returncode != 0:
        problems.append(_failure(Result(source, save.returncode, "", save_stderr), f"docker save {config.runtime.image}"))
    return "; ".join(problems) or None


def _prepare_image(config: LaneConfig, key: str, dry_run: bool, out: TextIO) -> int:
    first = config.nodes[0]
    if dry_run:
        _say(out, f"prepare: image {config.runtime.image} from {image.base_image(config)}, key {key}; "
                  f"built on {first.label}, sent to every node whose image lacks the key")
        for node in config.nodes:
            _say(out, f"{node.label}: inspect: {display(node_argv(node, config, image.inspect_command(config)))}")
        _say(out, f"{first.label}: build (when it lacks the key): "
                  f"{display(node_argv(first, config, image.build_command(config, key)))}")
        for node in config.nodes[1:]:
            _say(out, f"{node.label}: send (when it lacks the key): "
                      f"{display(node_argv(first, config, image.save_command(config)))} | "
                      f"{display(node_argv(node, config, image.load_command(config)))}")
        return EXIT_OK

    keys, problems = image_keys(config)
    if problems:
        for p in problems:
            _say(out, p)
        return EXIT_FAILED
    stale = [n for n in config.nodes if keys[n.rank] != key]
    if not stale:
        for node in config.nodes:
            _say(out, f"{node.label}: up-to-date (image {config.runtime.image}, key {key})")
        return EXIT_OK
    for node in stale:
        _say(out, _describe(config, node, keys[node.rank], key))

    if keys[first.rank] != key:
        _say(out, f"{first.label}: building {config.runtime.image} from {image.base_image(config)} "
                  f"(this can take a long while on a first pull)")
        r = run(first, config, image.build_command(config, key), timeout=BUILD_TIMEOUT_S)
        if ssh_failure(r) or r.returncode != 0:
            _say(out, _failure(r, f"docker build {config.runtime.image}"))
            return EXIT_FAILED
        # nodes that share rank 0's docker engine have the image now; ask again
        keys, problems = image_keys(config)
        if problems or keys[first.rank] != key:
            for p in problems or [f"{first.label}: the image built there does not carry key {key}"]:
                _say(out, p)
            return EXIT_FAILED
        _say(out, f"{first.label}: built (key {key})")

    for node in [n for n in config.nodes[1:] if keys[n.rank] != key]:
        _say(out, f"{node.label}: sending {config.runtime.image} from {first.label}")
        problem = _transfer(config, first, node)
        if problem:
            _say(out, problem)
            return EXIT_FAILED

    keys, problems = image_keys(config)
    wrong = [_describe(config, n, keys.get(n.rank), key) for n in config.nodes if keys.get(n.rank) != key]
    for p in problems + wrong:
        _say(out, p)
    if problems or wrong:
        return EXIT_FAILED
    _say(out, f"prepare: every node carries {config.runtime.image} with key {key}")
    return EXIT_OK
