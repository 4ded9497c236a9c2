"""The engine's options over its settings."""
from __future__ import annotations

from typing import Any

from glm53.runtime.errors import EngineError
from glm53.settings import Settings, SettingsError


def with_options(settings: Settings, **options: Any) -> Settings:
    """`settings` with the options given (not None) in place of their fields; a bad option is an
    EngineError naming the field's variable (the environment's bad values are SettingsErrors)."""
    try:
        return settings.override(**options)
    except SettingsError as exc:
        raise EngineError(str(exc)) from None
