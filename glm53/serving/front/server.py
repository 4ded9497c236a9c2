"""The front's HTTP server: uvicorn (h11) on a socket bound at once, serving glm53.serving.front.app in a thread.

A taken port fails at construction, before any loading; until a Service is attached every
generation route answers 503 "loading". `drain` stops taking new work (503 with Retry-After) and
waits for the requests in flight; `shutdown` stops the server.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from glm53.serving.front.app import create_app
from glm53.serving.front.state import FrontState
from glm53.serving.front.errors import JsonErrorH11Protocol
from glm53.serving.front.service import Service
from glm53.serving.front.settings import DEFAULT_PORT


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (raises OSError when the address is taken or not ours)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a lane restarted at once may rebind
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class FrontServer:
    """The bound socket, the uvicorn server over glm53.serving.front.app, and the state its routes read."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, api_keys: tuple[str, ...] = ()) -> None:
        self.socket = bind(host, port)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.state = FrontState(api_keys)
        config = uvicorn.Config(create_app(self.state), http=JsonErrorH11Protocol, loop="asyncio", lifespan="off",
                                log_config=None, access_log=False, server_header=False, timeout_keep_alive=30,
                                timeout_graceful_shutdown=2)
        self.uvicorn = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where this machine reaches the server (loopback for a wildcard address)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> "FrontServer":
        """Serve in a daemon thread; returns once the server accepts connections."""
        self.thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve(sockets=[self.socket])),
                                       name="http", daemon=True)
        self.thread.start()
        while not self.uvicorn.started and self.thread.is_alive():
            time.sleep(0.005)
        if not self.uvicorn.started:
            raise RuntimeError(f"the HTTP server on {self.url} did not start (see the log)")
        return self

    def attach(self, service: Service) -> None:
        self.state.service = service

    def drain(self, timeout: float) -> bool:
        """Refuse new generations (503, Retry-After) and wait up to `timeout` s for the requests in
        flight; True when none is left."""
        self.state.draining = True
        deadline = time.monotonic() + timeout
        while self.state.inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.state.inflight

    def shutdown(self) -> None:
        """Stop serving: uvicorn closes the socket and its connections (requests still running past
        its grace are cancelled, which cancels their jobs)."""
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.socket.close()


def serve(service: Service, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          api_keys: tuple[str, ...] = ()) -> FrontServer:
    """Bind (raises OSError if the port is taken), attach `service` and start serving it."""
    server = FrontServer(host, port, api_keys)
    server.attach(service)
    return server.start()
