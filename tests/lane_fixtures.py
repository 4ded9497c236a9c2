"""Helpers for the front and launcher tests: a real tokenizer built offline, a stand-in engine for the
front's own HTTP behaviour, free ports, and starting, waiting on and stopping serve.sh lanes."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


def write_tokenizer(model_dir: Path) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, with GLM-style chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "GLM serves long conversations exactly", "naïve café — üñïçødé ☃ text"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))


ROOT = Path(__file__).resolve().parents[1]
LANES_DIR = ROOT / ".work" / "lanes"
_ports_used: list[int] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return track_port(s.getsockname()[1])


def track_port(port: int) -> int:
    """Remember a lane port so that cleanup_lanes removes its lane dir at the end."""
    _ports_used.append(port)
    return port


# the lanes' ranks share the host's cores with each other and with this process: one torch thread
# each (as tests/dist_workers.py's ranks), unless the caller's environment chose a count
RANK_ENV = {"OMP_NUM_THREADS": "1"}


def run_kit_script(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`bash <args>` in the kit's root (serve.sh, verify.sh), env added to this process' environment."""
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**RANK_ENV, **os.environ, **(env or {})})


def rank_pids(port: int, ranks: int) -> list[int]:
    """The pids of ranks 0..ranks-1 of the lane on `port`, from their pid files."""
    return [int((LANES_DIR / str(port) / f"rank{r}.pid").read_text()) for r in range(ranks)]


def lane_state(port: int) -> dict[str, Any]:
    """The lane's lane.json ({} before the supervisor wrote it)."""
    from launcher.state import read_json

    return read_json(LANES_DIR / str(port) / "lane.json") or {}


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def running_lane(*serve_args: str, env: dict[str, str] | None = None,
                 timeout: float = 180) -> Iterator[tuple[int, subprocess.CompletedProcess]]:
    """`serve.sh <serve_args> --port <a free port>`, asserted to start; yields (port, the start's
    result) and stops the lane on the way out, whatever happened."""
    port = free_port()
    up = run_kit_script("serve.sh", *serve_args, "--port", str(port), env=env, timeout=timeout)
    try:
        assert up.returncode == 0, up.stderr
        yield port, up
    finally:
        run_kit_script("serve.sh", "stop", "--port", str(port), env=env, timeout=timeout)


def kill_rank_while_loading(*serve_args: str, rank: int, timeout: float) -> subprocess.CompletedProcess:
    """Start `serve.sh <serve_args> --port <free port>`, SIGKILL `rank` as soon as its log shows it
    loading, and return how the start ended (returncode, stdout, stderr); the lane is stopped after.
    The log, not lane.json: the supervisor rewrites lane.json between /health polls, which a loading
    rank 0 answers slowly, so a tiny model's load can pass between two writes."""
    port = free_port()
    proc = subprocess.Popen(["bash", "serve.sh", *serve_args, "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**RANK_ENV, **os.environ})
    try:
        log = LANES_DIR / str(port) / f"rank{rank}.log"

        def loading() -> bool:
            return log.exists() and '"state": "loading"' in log.read_text(errors="replace")

        wait_for(lambda: loading() or proc.poll() is not None, 60, f"rank {rank} to report loading")
        assert proc.poll() is None, f"serve.sh ended before rank {rank} loaded: {proc.communicate()}"
        os.kill(rank_pids(port, rank + 1)[rank], signal.SIGKILL)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        run_kit_script("serve.sh", "stop", "--port", str(port), timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_mid_stream(port: int, pid: int, max_tokens: int) -> list[str]:
    """Start a streamed chat completion on the lane, SIGKILL `pid` once the first line arrived, and
    return the lines that still came (none when the connection broke with an error)."""
    import httpx

    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(pid, signal.SIGKILL)
        try:
            return list(lines)
        except httpx.HTTPError:
            return []


class StandInEngine:
    """Only for the front's HTTP behaviour (queueing, SSE, disconnects, errors): deterministic tokens
    from the prompt, the seed and the position; hands them over in bursts like a drafting engine.
    `progress` counts the tokens the running call has handed over (a burst is one decode step)."""

    def __init__(self, vocab: int, eos: int, delay: float = 0.0, stop_after: int | None = None,
                 fail: bool = False) -> None:
        self.vocab, self.eos, self.delay, self.stop_after, self.fail = vocab, [eos], delay, stop_after, fail
        self.calls: list[dict[str, Any]] = []
        self.progress = 0
        self.active = 0
        self.max_active = 0
        self.last_stats: dict[str, int] = {}
        self._lock = threading.Lock()
        self._seen: list[list[int]] = []

    def generate(self, prompt: list[int], max_tokens: int, sampling: Any,
                 on_tokens: Callable[[list[int]], bool]) -> list[int]:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.progress = 0
        try:
            if self.fail:
                raise RuntimeError("collective timed out waiting for rank 1")
            seed = sampling.get("seed") or 0
            out: list[int] = []
            stopped = False
            while len(out) < max_tokens and not stopped:
                burst = []
                for _ in range(min(3, max_tokens - len(out))):  # bursts of up to 3, like accepted drafts
                    pos = len(prompt) + len(out) + len(burst)
                    token = self.eos[0] if self.stop_after is not None and len(out) + len(burst) == self.stop_after \
                        else 10 + (sum(prompt) * 31 + pos * 7 + seed) % (self.vocab - 10)
                    burst.append(token)
                    if token in self.eos and not sampling.get("ignore_eos"):
                        stopped = True
                        break
                out += burst
                if self.delay:
                    time.sleep(self.delay)
                self.progress = len(out)
                if not on_tokens(burst):
                    break
            cached = max((_common(prompt, p) for p in self._seen), default=0)
            self._seen.append(list(prompt))
            self.last_stats = {"prompt_tokens": len(prompt), "cached_tokens": cached, "completion_tokens": len(out)}
            self.calls.append({"prompt": prompt, "max_tokens": max_tokens, "sampling": sampling, "generated": len(out)})
            return out
        finally:
            with self._lock:
                self.active -= 1


def standin_for(model_dir: Path, **options: Any) -> StandInEngine:
    """A stand-in engine over the tokenizer in model_dir (its vocabulary; <|endoftext|> ends a reply)."""
    from glm53.serving.front.chat import ChatText

    tokenizer = ChatText(model_dir).tokenizer
    return StandInEngine(vocab=tokenizer.get_vocab_size(), eos=tokenizer.token_to_id("<|endoftext|>"), **options)


@contextlib.contextmanager
def front_server(model_dir: Path, engine: Any, api_keys: tuple[str, ...] = (),
                 sampling_factory: Callable[[dict[str, Any]], Any] = dict, **settings: Any) -> Iterator[Any]:
    """The real front (uvicorn on a free loopback port, in this process) over `engine`; yields the
    FrontServer (its .url, .state.service) and stops it after."""
    from glm53.serving.front.chat import ChatText
    from glm53.serving.front.server import serve
    from glm53.serving.front.service import Service
    from glm53.serving.front.settings import FrontSettings

    settings = {"context": 256, "default_max_tokens": 16, **settings}
    service = Service(engine, ChatText(model_dir), FrontSettings(**settings), sampling_factory)
    server = serve(service, "127.0.0.1", 0, api_keys)
    try:
        yield server
    finally:
        server.shutdown()
        service.close()


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


import pytest  # noqa: E402


from tests.fixtures_tiny import tiny_dirs  # noqa: E402,F401  (the suite's one tiny checkpoint)


@pytest.fixture(scope="session")
def tiny_model(tiny_dirs) -> Path:  # noqa: F811
    """The tiny checkpoint (glm53.synthetic.tiny, seed 0), shared with the model's tests: one generation per
    run. serve.sh's own first-use path (launcher.tiny_cache) writes the same checkpoint to .work/tiny."""
    return tiny_dirs.model


@pytest.fixture(scope="session", autouse=True)
def cleanup_lanes():
    """Remove the lane dirs (logs, state) of the ports these tests used, at the end of the session."""
    yield
    import shutil

    for port in _ports_used:
        shutil.rmtree(LANES_DIR / str(port), ignore_errors=True)
