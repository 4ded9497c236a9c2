"""API keys: a request to /v1 carries one as `Authorization: Bearer KEY` or `x-api-key: KEY`.

Keys come from `--api-key` (glm53.serving.rank) and TF_GLM53_API_KEYS (comma-separated; Settings.api_keys);
none configured means none needed. /health and /metrics stay open (probes and scrapers carry no key).
"""
from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from glm53.serving.front.errors import ApiError
from glm53.settings import Settings


def configured_keys(flags: Iterable[str] = (), settings: Settings | None = None) -> tuple[str, ...]:
    """The keys from the flags and the settings (TF_GLM53_API_KEYS), blanks dropped, each once."""
    keys = [k.strip() for k in flags] + list(settings.api_keys if settings is not None else ())
    return tuple(dict.fromkeys(k for k in keys if k))


def presented_key(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def check_key(headers: Mapping[str, str], keys: tuple[str, ...]) -> None:
    """Raises a 401 in OpenAI's shape unless `keys` is empty or the request carries one of them."""
    if not keys:
        return
    key = presented_key(headers)
    # every key compared, in constant time: the answer's timing says nothing about a key's prefix
    if key is not None and sum(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        return
    message = ("no API key: send Authorization: Bearer KEY or x-api-key: KEY" if key is None else
               "the API key is not valid for this server")
    raise ApiError(401, message, code="invalid_api_key", kind="invalid_request_error",
                   headers={"WWW-Authenticate": "Bearer"})
