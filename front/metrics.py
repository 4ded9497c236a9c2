"""Prometheus text counters for the front (requests, tokens, cached tokens, errors)."""
from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status) -> count
        self.totals: Counter[str] = Counter()

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            if status >= 400:
                self.totals["errors"] += 1

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self.totals[name] += amount

    def render(self, queue_depth: int) -> str:
        with self._lock:
            lines = ["# HELP glm53_requests_total HTTP requests by route and status.",
                     "# TYPE glm53_requests_total counter"]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'glm53_requests_total{{route="{route}",status="{status}"}} {n}')
            for name, help_text in (("prompt_tokens", "Prompt tokens of finished generations."),
                                    ("completion_tokens", "Tokens generated."),
                                    ("cached_tokens", "Prompt tokens served from the prefix cache."),
                                    ("errors", "Requests answered with an error status."),
                                    ("cancelled", "Generations stopped because the client disconnected.")):
                lines += [f"# HELP glm53_{name}_total {help_text}", f"# TYPE glm53_{name}_total counter",
                          f"glm53_{name}_total {self.totals[name]}"]
            lines += ["# HELP glm53_queue_depth Requests waiting or running on the engine.",
                      "# TYPE glm53_queue_depth gauge", f"glm53_queue_depth {queue_depth}"]
            return "\n".join(lines) + "\n"
