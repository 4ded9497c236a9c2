"""The front's Prometheus families, through prometheus_client: requests by route and status, token
counters, the queue depth, and histograms of queue wait, time to first token, decode speed and
request duration; the garbage collector's pauses; with the batched runtime also running / waiting
sequences, preemptions, the KV pool's bytes and the histograms of sequences a step and of a step's
seconds. One registry per front (several fronts share a test process)."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

disable_created_metrics()  # no *_created series: one family per name, as the existing scrapers read them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def labelled_histogram(name: str, documentation: str, label: str,
                       snapshots: dict[Any, dict[str, Any]]) -> HistogramMetricFamily:
    """One histogram family, a series a label value, from glm53.runtime.durations snapshots."""
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, snap in snapshots.items():
        family.add_metric([str(value)], buckets=snap["buckets"], sum_value=snap["sum"])
    return family


class PauseCollector:
    """The garbage collector's pauses in the serving process (glm53.runtime.heap.collector_pauses)."""

    def __init__(self, pauses: Callable[[], dict[int, dict[str, Any]]]) -> None:
        self.pauses = pauses

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield labelled_histogram("glm53_gc_pause_seconds", "Seconds the garbage collector held rank 0's process "
                                 "(every stream waits), by the oldest generation collected.", "generation",
                                 self.pauses())


class RuntimeCollector:
    """The batched runtime's families, read from its stats at each scrape (glm53.runtime
    BatchEngine.stats through EngineWorker.runtime_stats; None: jobs run one at a time, no families)."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []  # families appear only where a runtime reports them

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if not s:
            return
        yield GaugeMetricFamily("glm53_running_sequences", "Sequences decoding or prefilling together.",
                                value=s["running"])
        yield GaugeMetricFamily("glm53_waiting_sequences", "Requests queued for admission (KV memory or the "
                                "running limit).", value=s["waiting"])
        yield CounterMetricFamily("glm53_preempted", "Running sequences preempted (rows released, recomputed "
                                  "on resumption) because running sequences outgrew the KV pool.",
                                  value=s["preempted_total"])
        yield GaugeMetricFamily("glm53_kv_pool_used_bytes", "KV pool bytes granted to running sequences.",
                                value=s["pool_used_bytes"])
        yield GaugeMetricFamily("glm53_kv_pool_free_bytes", "KV pool bytes free.", value=s["pool_free_bytes"])
        yield GaugeMetricFamily("glm53_kv_pool_used_blocks", "KV pool blocks (pages) held by running sequences, "
                                "a shared one once.", value=s["pool_used_blocks"])
        yield GaugeMetricFamily("glm53_kv_pool_free_blocks", "KV pool blocks (pages) free.", value=s["pool_free_blocks"])
        yield GaugeMetricFamily("glm53_kv_pool_shared_blocks", "KV pool pages held by several sequences (a prompt "
                                "prefix shared in place).", value=s["pool_shared_blocks"])
        sizes = s.get("batch_sizes", {})  # sequences in a step -> steps
        buckets = [(str(bound), sum(n for size, n in sizes.items() if size <= bound)) for bound in BATCH_BUCKETS]
        buckets.append(("+Inf", sum(sizes.values())))
        yield HistogramMetricFamily("glm53_batch_size", "Sequences in one step of the batched runtime.",
                                    buckets=buckets, sum_value=sum(size * n for size, n in sizes.items()))
        yield labelled_histogram("glm53_step_seconds", "Wall seconds of a batched runtime step, a running stream's "
                                 "gap between tokens, by what it carried: decode (windows only), mixed (a prompt's "
                                 "piece beside them), prefill (prompt rows only).", "kind", s["step_seconds"])


class Metrics:
    def __init__(self, queue_depth: Callable[[], int],
                 runtime: Callable[[], dict[str, Any] | None] | None = None,
                 pauses: Callable[[], dict[int, dict[str, Any]]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if runtime is not None:
            r.register(RuntimeCollector(runtime))
        if pauses is not None:
            r.register(PauseCollector(pauses))
        self.requests = Counter("glm53_requests", "HTTP requests by route and status.", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("glm53_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        self.completion_tokens = Counter("glm53_completion_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = Counter("glm53_cached_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.errors = Counter("glm53_errors", "Requests answered with an error status.", registry=r)
        self.cancelled = Counter("glm53_cancelled", "Generations stopped because the client disconnected.",
                                 registry=r)
        Gauge("glm53_queue_depth", "Requests waiting or running on the engine.", registry=r).set_function(queue_depth)
        self.queue_wait = Histogram("glm53_queue_wait_seconds", "Seconds a request waited in the engine's queue.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("glm53_time_to_first_token_seconds", "Seconds from arrival to the first generated "
                              "token (queueing and prefill).", buckets=LATENCY_BUCKETS, registry=r)
        self.decode_rate = Histogram("glm53_decode_tokens_per_second", "Tokens a second after the first, per "
                                     "request of two tokens or more.", buckets=RATE_BUCKETS, registry=r)
        self.duration = Histogram("glm53_request_duration_seconds", "Seconds from arrival to the end of the "
                                  "response, generation routes.", buckets=DURATION_BUCKETS, registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        if status >= 400:
            self.errors.inc()

    def generation(self, n_prompt: int, n_completion: int, stats: dict[str, Any], cancelled: bool,
                   queue_wait: float, ttft: float, decode_rate: float) -> None:
        """One finished engine job (NaN for a time the job never reached)."""
        self.prompt_tokens.inc(n_prompt)
        self.completion_tokens.inc(n_completion)
        self.cached_tokens.inc(int(stats.get("cached_tokens", 0) or 0))
        if cancelled:
            self.cancelled.inc()
        for histogram, value in ((self.queue_wait, queue_wait), (self.ttft, ttft), (self.decode_rate, decode_rate)):
            if not math.isnan(value):
                histogram.observe(value)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
