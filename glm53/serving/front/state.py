"""What the front's routes read: the service (None while the engine loads), the API keys, whether the
lane drains, the requests in flight, the front's metrics."""
from __future__ import annotations

from glm53.runtime.heap import collector_pauses
from glm53.serving.front.errors import ApiError
from glm53.serving.front.metrics import Metrics
from glm53.serving.front.service import Service


class FrontState:
    """What the routes read: the service (None while the engine loads), the API keys, whether the lane
    drains, the requests in flight, and the front's metrics."""

    def __init__(self, api_keys: tuple[str, ...] = (), retry_after_s: int = 5) -> None:
        self.service: Service | None = None
        self.api_keys = api_keys
        self.retry_after_s = retry_after_s
        self.draining = False
        self.inflight = 0
        self.metrics = Metrics(lambda: self.service.worker.depth() if self.service else 0,
                               lambda: self.service.worker.runtime_stats() if self.service else None,
                               collector_pauses().snapshot)

    def serving(self) -> Service:
        """The service, or the 503 that says why there is none to take new work."""
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.service is None:
            raise ApiError(503, "the engine is still loading", code="loading", headers=retry)
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining",
                           headers=retry)
        self.service.refuse_if_failed()
        return self.service
