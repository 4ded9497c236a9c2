"""ASGI middleware around every HTTP request: its id (x-request-id), the count of requests in flight
(what a drain waits for), the glm53_requests_total counter, the duration histogram of the generation
routes, and one access-log line: client, request line, status, duration, id. The log's formatter
adds the timestamp (glm53.serving.rank.configure_logging)."""
from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from glm53.serving.front.state import FrontState

log = logging.getLogger("front.access")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a client's own x-request-id, kept when it is this tame


@dataclass
class AccessRecord:
    """One request as the middleware sees it; a route may set `outcome` (499: the client left mid-stream)."""

    rid: str
    start: float = field(default_factory=time.perf_counter)
    status: int = 0
    outcome: int | None = None


def request_id(scope: Scope) -> str:
    sent = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
    return sent if CLIENT_ID.fullmatch(sent) else uuid.uuid4().hex


def record_of(scope: Scope) -> AccessRecord:
    return scope["state"]["access"]


class AccessLog:
    def __init__(self, app: ASGIApp, front: "FrontState") -> None:
        self.app, self.front = app, front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(request_id(scope))
        scope.setdefault("state", {})["access"] = record

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", record.rid.encode())]
            await send(message)

        self.front.inflight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.front.inflight -= 1
            self.finish(scope, record)

    def finish(self, scope: Scope, record: AccessRecord) -> None:
        seconds = time.perf_counter() - record.start
        status = record.outcome or record.status or 500  # no response at all: the app failed
        route = getattr(scope.get("route"), "path_format", None) or "other"  # the route's template, not the path
        self.front.metrics.request(route, status)
        if route in GENERATION_ROUTES:
            self.front.metrics.duration.observe(seconds)
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        log.info('%s "%s %s HTTP/%s" %d %.1fms id=%s', who, scope["method"], scope["path"],
                 scope.get("http_version", "1.1"), status, 1e3 * seconds, record.rid)
