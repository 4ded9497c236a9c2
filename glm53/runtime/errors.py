"""What the engine refuses: a request or option it cannot take (EngineError), a request field it
cannot sample with (SamplingError). Each message names the field and the remedy."""
from __future__ import annotations


class EngineError(ValueError):
    """A request or option the engine cannot take; the message names the field and the remedy."""


class SamplingError(ValueError):
    """A request field that cannot be used for sampling; the message names the field, `param` holds it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
