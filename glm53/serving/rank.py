"""One rank of the lane: load the glm53 engine; rank 0 serves HTTP, every other rank follows.

`python -m glm53.serving.rank --model DIR --rank R --ranks N [...]`. Progress goes to stdout as
`@state {json}` lines (the launcher shows them); errors go to stderr. On SIGTERM/SIGINT rank 0
drains: new requests get 503 with Retry-After, those in flight finish (up to --drain-timeout s).
The TF_GLM53_* knobs are parsed once at start (glm53.settings.Settings; `args.settings`, which the
engine factory passes on); a bad value ends the rank at once with exit 2 and the variable named.
Exit codes: 0 stopped by SIGTERM/SIGINT; 2 bad arguments or settings; 70 the engine failed; 75 the memory
guard stopped the lane (glm53.serving.memory_guard.EXIT_MEMORY_GUARD); 98 the HTTP port is taken. glm53.dist's guard may end a
rank with 3 (a peer died), 4 (a collective timed out) or 5 (rank 0's store unreachable).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from glm53.config import Glm53Config
from glm53.runtime.heap import freeze_startup_heap
from glm53.runtime.sampling import SamplingParams
from glm53.serving.compose import build_engine
from glm53.serving.lane import API_KEYS_ENV, DRAIN_TIMEOUT_S
from glm53.serving.meminfo import MIB, PROC_MEMINFO, available_bytes
from glm53.serving.memory_guard import MemoryGuard
from glm53.settings import Settings, SettingsError

EXIT_PORT_IN_USE = 98
EXIT_ENGINE_FAILED = 70


class Progress(threading.Thread):
    """Prints this rank's state, available memory and elapsed time every `interval` seconds."""

    def __init__(self, rank: int, interval: float, meminfo: str = PROC_MEMINFO) -> None:
        super().__init__(name="progress", daemon=True)
        self.rank, self.interval, self.state, self.t0 = rank, interval, "starting", time.monotonic()
        self.meminfo = Path(meminfo)
        self._wake = threading.Event()

    def set(self, state: str) -> None:
        self.state = state
        self.emit()

    def emit(self) -> None:
        try:
            avail = available_bytes(self.meminfo) // MIB
        except (OSError, RuntimeError):
            avail = -1
        line = {"rank": self.rank, "state": self.state, "available_mib": avail,
                "elapsed_s": round(time.monotonic() - self.t0, 1), "pid": os.getpid()}
        print("@state " + json.dumps(line), flush=True)

    def run(self) -> None:
        while not self._wake.wait(self.interval):
            self.emit()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glm53.serving.rank", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="tensor-parallel ranks in the lane")
    p.add_argument("--master", default="127.0.0.1", help="rank 0's fabric address (rendezvous)")
    p.add_argument("--master-port", type=int, default=29551)
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (rank 0)")
    p.add_argument("--port", type=int, default=8300, help="HTTP port (rank 0)")
    p.add_argument("--served-model-name", default="glm-5.3-exl3")
    p.add_argument("--context", type=int, default=0, help="tokens per request (0: the checkpoint's maximum)")
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory")
    p.add_argument("--no-drafts", action="store_true")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine option passed to the engine (JSON value or string)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"a key clients must send to /v1 (Authorization: Bearer KEY or x-api-key: KEY); repeatable, "
                        f"added to {API_KEYS_ENV} (comma-separated). None: no key needed")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="seconds a stopping rank 0 waits for the requests in flight")
    p.add_argument("--progress-interval", type=float, default=2.0)
    args = p.parse_args(argv)
    if not 0 <= args.rank < args.ranks:
        p.error(f"--rank {args.rank} is outside 0..{args.ranks - 1}")
    if args.context < 0:
        p.error(f"--context {args.context}: a number of tokens >= 1, or 0 for the model's maximum")
    limit = model_context(Path(args.model))
    if limit is not None and args.context > limit:
        # a larger context would pass the front's check and fail in the engine, stopping the lane
        p.error(f"--context {args.context}: the model at {args.model} holds at most {limit} positions "
                f"(config.json max_position_embeddings); serve at most --context {limit}, or 0 for that")
    return args


def model_context(model: Path) -> int | None:
    """The checkpoint's max_position_embeddings (glm53's default where config.json leaves it out),
    or None where config.json cannot be read (the engine's load then reports the problem)."""
    try:
        raw = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if "max_position_embeddings" not in raw:
        return Glm53Config.max_position_embeddings
    try:
        return int(raw["max_position_embeddings"])
    except (TypeError, ValueError):
        return None


def engine_options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"glm53.serving.rank: --option {pair!r} must be KEY=VALUE")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


def glm53_engine(args: argparse.Namespace) -> Any:
    return build_engine(args.model, drafter=args.drafter, tp=args.ranks, rank=args.rank, master=args.master,
                        master_port=args.master_port, no_drafts=args.no_drafts, mtp_drafts=None,
                        settings=getattr(args, "settings", None), **engine_options(args.option))


def glm53_sampling(request: dict[str, Any]) -> Any:
    return SamplingParams.from_request(request)


def configure_logging(level: str = "INFO") -> None:
    """Log records (the front's per-request line, kv_cache hits/misses/evictions, drafter acceptance)
    go to stderr at `level` (Settings.log_level: TF_GLM53_LOG_LEVEL, default INFO; DEBUG adds cache stores)."""
    logging.basicConfig(level=logging.getLevelName(level), stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")


def freeze_heap(rank: int) -> None:
    """Loaded and about to serve: the startup heap leaves the collector's walk (glm53.runtime.heap)."""
    frozen = freeze_startup_heap()
    logging.getLogger("glm53.rank").info("rank %d: %d startup objects frozen out of the garbage collector's walk",
                                         rank, frozen)


def main(argv: list[str] | None = None, engine_factory: Callable[[argparse.Namespace], Any] = glm53_engine,
         sampling_factory: Callable[[dict[str, Any]], Any] = glm53_sampling) -> int:
    args = parse_args(argv)
    try:  # once, before anything starts: a bad value ends the rank here, naming the variable
        settings = args.settings = Settings.from_env()
    except SettingsError as exc:
        print(f"rank {args.rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    configure_logging(settings.log_level)
    progress = Progress(args.rank, args.progress_interval, settings.meminfo)
    progress.start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if progress.state in ("starting", "loading"):  # nothing to close yet: leave at once
            print(f"rank {args.rank}: stopped during load ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    MemoryGuard(args.rank, settings.mem_floor_mb * MIB, meminfo=settings.meminfo).start()

    server = None
    if args.rank == 0:  # bind first: a taken port fails in a second, not after the load
        # rank 0 alone serves HTTP: the followers never import the front (FastAPI, uvicorn, pydantic)
        from glm53.serving.front.auth import configured_keys
        from glm53.serving.front.server import FrontServer

        try:
            server = FrontServer(args.host, args.port, configured_keys(args.api_key, settings))
        except OSError as exc:
            print(f"rank 0: cannot listen on {args.host}:{args.port} ({exc.strerror}); stop what holds the port "
                  f"(bash serve.sh stop --port {args.port}) or choose another --port", file=sys.stderr, flush=True)
            return EXIT_PORT_IN_USE
        server.start()

    progress.set("loading")
    try:
        engine = engine_factory(args)
    except Exception as exc:
        print(f"rank {args.rank}: loading {args.model} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED

    if args.rank > 0:
        freeze_heap(args.rank)
        progress.set("following")
        outcome: dict[str, BaseException] = {}

        def follow() -> None:
            try:
                engine.follow()
            except BaseException as exc:  # a peer died or a collective timed out
                outcome["error"] = exc
            stop.set()

        threading.Thread(target=follow, name="follow", daemon=True).start()
        stop.wait()
        if "error" in outcome:
            print(f"rank {args.rank}: follow() failed: {type(outcome['error']).__name__}: {outcome['error']}",
                  file=sys.stderr, flush=True)
            return EXIT_ENGINE_FAILED
        progress.set("stopped")
        return 0

    # rank 0 alone serves HTTP: the followers never import the front (FastAPI, uvicorn, pydantic)
    from glm53.serving.front.chat import ChatText
    from glm53.serving.front.service import Service
    from glm53.serving.front.settings import FrontSettings, drafting_state, prefix_cache_state

    context = args.context or model_context(Path(args.model))
    if not context:
        print(f"rank 0: cannot read max_position_embeddings from {args.model}/config.json; pass --context",
              file=sys.stderr, flush=True)
        return 2
    front = FrontSettings(served_model=args.served_model_name, context=context,
                          default_max_tokens=args.default_max_tokens, ranks=args.ranks,
                          prefix_cache=prefix_cache_state(engine, settings), drafting=drafting_state(engine),
                          prefill_chunk=getattr(engine, "chunk", None), max_waiting=settings.max_waiting)
    service = Service(engine, ChatText(args.model), front, sampling_factory)
    assert server is not None
    freeze_heap(0)  # before requests reach the engine: the collection holds the interpreter a moment
    server.attach(service)
    progress.set("serving")
    print(f"rank 0: serving {front.served_model} on http://{args.host}:{args.port} "
          f"(context {context}, ranks {args.ranks}{', API keys required' if server.state.api_keys else ''})",
          flush=True)
    while not stop.wait(0.1):
        if service.fatal is not None:
            print(f"rank 0: the engine failed: {type(service.fatal).__name__}: {service.fatal}", file=sys.stderr,
                  flush=True)
            return EXIT_ENGINE_FAILED
    progress.set("draining")
    if not server.drain(args.drain_timeout):
        print(f"rank 0: {server.state.inflight} request(s) still running after {args.drain_timeout:g} s of drain; "
              f"cancelling them", file=sys.stderr, flush=True)
    server.shutdown()
    service.close()
    close = getattr(engine, "close", None)
    if callable(close):  # the orderly leave: followers see "bye" and return from follow()
        close()
    progress.set("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
