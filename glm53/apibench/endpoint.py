"""One OpenAI-compatible server: its base URL, the official `openai` client for it, what its API
says about itself (GET /v1/models, GET /health where it has one), and every client-side failure
turned into a BenchError that names the URL."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai

from glm53.apibench.schema import ServerInfo


class BenchError(Exception):
    """A failure the run reports and stops on: the message names the server's URL and what failed."""


class NoAnswer(BenchError):
    """Nothing answered at the URL (refused, reset, timed out): the server is not there or went away."""


def api_base(url: str) -> str:
    """The base URL the client needs, ending in /v1, from a URL given with or without it."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"{url!r} is not an http(s) URL (e.g. http://127.0.0.1:8300)")
    return base if base.endswith("/v1") else base + "/v1"


@contextlib.contextmanager
def named_failures(url: str, what: str) -> Iterator[None]:
    """Re-raise what the client or the server got wrong during `what` as a BenchError naming `url`."""
    try:
        yield
    except BenchError:
        raise
    except openai.APITimeoutError as exc:
        raise NoAnswer(f"{url} did not answer {what} in time ({exc})") from exc
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc
        raise NoAnswer(f"no answer from {url} to {what}: {type(cause).__name__}: {cause}") from exc
    except httpx.TransportError as exc:  # raised as it is from inside a stream the SDK is reading
        raise NoAnswer(f"no answer from {url} to the rest of {what}: the connection broke "
                       f"({type(exc).__name__}: {exc})") from exc
    except openai.APIStatusError as exc:
        body = exc.response.text[:300] if exc.response is not None else ""
        raise BenchError(f"{url} answered {what} with HTTP {exc.status_code}: {body}") from exc
    except (openai.OpenAIError, httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # a body that is not the JSON the API defines: the SDK or our reading of it failed
        raise BenchError(f"{url} answered {what} badly: {type(exc).__name__}: {exc}") from exc


class Endpoint:
    """A server under test. `model` is the id sent with every request (the first of /v1/models
    when not given). The client never retries: a benchmark must see every failure."""

    def __init__(self, url: str, api_key: str | None, model: str | None, timeout: float) -> None:
        self.base = api_base(url)
        self.root = self.base[:-len("/v1")]
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        # the SDK insists on a key; servers without auth ignore the header
        self.client = openai.OpenAI(base_url=self.base, api_key=api_key or "none", max_retries=0, timeout=timeout)

    def describe(self) -> ServerInfo:
        """What the API tells about the server; picks the model when none was given. Raises
        BenchError when nothing answers or /v1/models is not what the API defines (and no model
        was given)."""
        models: list[dict[str, Any]] | None = None
        error: str | None = None
        try:
            with named_failures(self.base, "GET /v1/models"):
                models = [m.model_dump() for m in self.client.models.list().data]
                for m in models:
                    if not isinstance(m.get("id"), str):
                        raise ValueError(f"a model without an id: {m!r}")
        except NoAnswer:
            raise
        except BenchError as exc:
            if self.model is None:
                raise
            error = str(exc)  # the server may lack the route: the given model is used
        if self.model is None:
            if not models:
                raise BenchError(f"{self.base} lists no models at GET /v1/models; name one with --model")
            self.model = models[0]["id"]
        entry = next((m for m in models or [] if m.get("id") == self.model), {})
        health = self._health() or {}
        context = entry.get("max_model_len") or health.get("context")
        drafting = health.get("drafting")
        return ServerInfo(base_url=self.base, model=self.model, models=models, models_error=error,
                          health=health or None, context=context if isinstance(context, int) else None,
                          drafting=drafting if isinstance(drafting, bool) else None,
                          prefix_cache=str(health["prefix_cache"]) if "prefix_cache" in health else None)

    def _health(self) -> dict[str, Any] | None:
        """GET /health as JSON, None where the server has no such route or it is not a JSON object
        (not every OpenAI-compatible server has one)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.get(self.root + "/health", headers=headers, timeout=min(self.timeout, 30.0))
            body = r.json()
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None
