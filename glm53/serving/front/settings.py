"""What the front serves and its limits (FrontSettings), and what it reads of the engine for /health.

The HTTP front's own limits, apart from glm53.settings.Settings (the TF_GLM53_* knobs): glm53.serving.rank
builds FrontSettings from its flags and takes max_waiting from those knobs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm53.settings import Settings

DEFAULT_PORT = 8300
DEFAULT_MODEL_ID = "glm-5.3-exl3"
DEFAULT_MAX_WAITING = Settings().max_waiting


@dataclass
class FrontSettings:
    served_model: str = DEFAULT_MODEL_ID
    context: int = 16384  # prompt + completion tokens per request
    default_max_tokens: int = 1024  # when a request names no max_tokens
    ranks: int = 1
    prefix_cache: str = "absent"  # "on", "off" or "absent" (the engine has none): shown by /health
    drafting: bool = False  # the engine drafts (speculative decoding) unless a request says "draft": false
    prefill_chunk: int | None = None  # the engine's prefill grid: reuse happens in whole chunks
    max_waiting: int = DEFAULT_MAX_WAITING  # queued jobs before 429 (batched; Settings.max_waiting)
    max_body_bytes: int = 32 << 20  # a larger body is refused (413), unread past the limit
    # Prompt text above context x this many UTF-8 bytes cannot fit the context (a token of real text
    # is 3-5 bytes): refused before the template and the tokenizer run on it.
    prompt_bytes_per_token: int = 16

    @property
    def max_prompt_bytes(self) -> int:
        return self.context * self.prompt_bytes_per_token


def prefix_cache_state(engine: Any, settings: Settings | None = None) -> str:
    """What /health reports about reuse: "off" when the settings turn the cache off
    (TF_GLM53_PREFIX_CACHE; default the engine's `settings`, if it has any); else the engine's
    `prefix_cache_enabled` flag if it has one; else its prefix cache object's own `enabled`; else
    "on" when it reuses the live conversation (glm53's `reuse_live`); "absent" otherwise."""
    settings = settings if settings is not None else getattr(engine, "settings", None)
    if isinstance(settings, Settings) and not settings.prefix_cache:
        return "off"
    flag = getattr(engine, "prefix_cache_enabled", None)
    cache = getattr(engine, "prefix_cache", None)
    if flag is None and cache is not None and isinstance(getattr(cache, "enabled", None), bool):
        flag = cache.enabled
    if flag is None and (hasattr(engine, "prefix_cache") or hasattr(engine, "reuse_live")):
        flag = getattr(engine, "prefix_cache", None) is not None or bool(getattr(engine, "reuse_live", False))
    if flag is None:
        return "absent"
    return "on" if flag else "off"


def drafting_state(engine: Any) -> bool:
    """Whether requests are drafted unless they send "draft": false: the engine's own
    `drafting_enabled` when it has one, else a drafter present and drafts not turned off."""
    flag = getattr(engine, "drafting_enabled", None)
    if flag is not None:
        return bool(flag)
    return getattr(engine, "drafter", None) is not None and not getattr(engine, "no_drafts", False)
