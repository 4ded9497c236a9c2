"""The front's routes on FastAPI: POST /v1/chat/completions and /v1/completions (JSON or SSE),
POST /v1/messages (Anthropic's Messages API, glm53/serving/front/anthropic.py), GET /v1/models and /v1/models/{id}, GET /health and /v1/health, GET /metrics.

A generation request goes: API key, lane state (503 while loading, draining or failed), body under
its limit, then on the service's thread pool the validation and the prompt (template, tokenizer,
bounds), then a job on the engine's worker; its events come back to this loop. A client that
disconnects, streaming or not, cancels its job: the engine stops at its next decode step.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from glm53.serving.front import anthropic, observe
from glm53.serving.front.access import AccessLog, record_of
from glm53.serving.front.auth import check_key
from glm53.serving.front.errors import ApiError, error_body, on_api_error, on_http_exception, on_request_validation, on_unexpected
from glm53.serving.front.generation import read_body, start_generation, unknown_model
from glm53.serving.front.metrics import CONTENT_TYPE
from glm53.serving.front.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, parse
from glm53.serving.front.service import Service
from glm53.serving.front.state import FrontState

def create_app(front: FrontState) -> FastAPI:
    app = FastAPI(title="glm53-front", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(AccessLog, front=front)

    async def authorized(request: Request) -> None:  # async: FastAPI would run a plain def on a thread
        check_key(request.headers, front.api_keys)

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        if front.service is None:
            return JSONResponse({"status": "loading", **error_body(503, "the engine is still loading", code="loading")},
                                503)
        body = front.service.health()
        if front.draining and body["status"] == "ok":
            body["status"] = "draining"
        return JSONResponse(body, 200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = front.metrics.render()
        if front.service is not None:  # the cache's and drafter's counters: read off the loop, not behind prompts
            text += await asyncio.get_running_loop().run_in_executor(None, observe.render, front.service.engine)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(front.serving())]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str) -> dict[str, Any]:
        service = front.serving()
        if model_id != service.settings.served_model:
            raise unknown_model(model_id, service, "model")
        return model_card(service)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        return await generate(front, request, ChatCompletionRequest)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        return await generate(front, request, CompletionRequest)

    @app.post("/v1/messages", dependencies=[Depends(authorized)])
    async def anthropic_messages(request: Request) -> Response:
        return await anthropic.messages(front, request)

    return app


def model_card(service: Service) -> dict[str, Any]:
    return {"id": service.settings.served_model, "object": "model", "created": 0, "owned_by": "glm53-kit",
            "max_model_len": service.settings.context}


async def generate(front: FrontState, request: Request,
                   model: type[ChatCompletionRequest] | type[CompletionRequest]) -> Response:
    service = front.serving()
    raw = await read_body(request, service.settings.max_body_bytes)
    body: GenerationRequest = await asyncio.get_running_loop().run_in_executor(service.pool, parse, raw, model)
    chat = isinstance(body, ChatCompletionRequest)
    record = record_of(request.scope)
    run = await start_generation(front, service, body, record, ("chatcmpl-" if chat else "cmpl-") + record.rid,
                                 "call_" + record.rid)
    if body.stream:
        return StreamingResponse(run.stream(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await run.complete(request)
