"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every status the
front answers: its own refusals (ApiError), Starlette's routing errors (404, 405), anything unexpected
(500), and malformed HTTP that never reaches the app (uvicorn's h11 protocol, see JsonErrorH11Protocol).
Under /v1/messages (Anthropic's Messages API) the same errors take Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`: the handlers pick the shape by the request's path."""
from __future__ import annotations

import json
import logging
from typing import Any

import h11
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("front.errors")

# OpenAI's error type for a status; "invalid_request_error" for any other 4xx
TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error"}


# Anthropic's error type for a status; "invalid_request_error" for any other 4xx, "api_error" for 5xx
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               kind: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or error_type(status), "param": param, "code": code}}


class ApiError(Exception):
    """A refusal the client should see: its HTTP status, message, the offending field (`param`), an
    OpenAI-style `code` where one exists, and extra response headers (Retry-After, WWW-Authenticate)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers, self.kind = headers or {}, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code, self.kind)

    def anthropic_body(self) -> dict[str, Any]:
        return anthropic_body(self.status, self.message)

    def response(self, request: Request | None = None) -> JSONResponse:
        """In the shape of the API the request's path belongs to (OpenAI's unless /v1/messages)."""
        anthropic = request is not None and anthropic_path(request.url.path)
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response(request)


async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no route, wrong method) in OpenAI's shape, its headers (Allow) kept."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; the routes are /v1/chat/completions, " \
                  "/v1/completions, /v1/messages, /v1/models, /health and /metrics"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow")
        message = f"{request.method} is not allowed on {request.url.path}" + (f"; allowed: {allowed}" if allowed else "")
    else:
        message = str(exc.detail)
    return ApiError(exc.status_code, message, headers=dict(exc.headers or {})).response(request)


def param_of(loc: tuple[int | str, ...], at: str = "") -> str | None:
    """A field's path as OpenAI's `param`: ('messages', 0, 'role') -> 'messages[0].role'."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc) + at
    return text.lstrip(".") or None


async def on_request_validation(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own validation (path and query parameters) as a 400 naming the parameter, not its 422."""
    assert isinstance(exc, RequestValidationError)
    error = exc.errors()[0]
    param = param_of(tuple(error["loc"][1:]))  # the first part says where: path, query, body
    return ApiError(400, f"'{param}': {error['msg']}", param).response(request)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug in the front: the client gets a 500 in OpenAI's shape; the traceback goes to the log."""
    log.error("unexpected error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return ApiError(500, f"internal error in the front: {type(exc).__name__}").response(request)


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed HTTP (a bad Content-Length, a broken request line)
    with a JSON 400 in OpenAI's shape. The message framing is unknown then, so the connection closes
    (RFC 9112 section 6.3); a new connection is served as usual."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, "malformed HTTP request (a request line, header or Content-Length h11 "
                                          "cannot read); the connection is closed", code="malformed_http")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
