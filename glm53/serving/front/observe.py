"""What the front sees of the engine's prefix cache and drafter: the per-request log line and the
glm53_prefix_cache_* / glm53_draft_* families of /metrics.

Found on the engine by attribute, never imported (the front also runs stand-in engines):
  engine.last_stats          dict of the last request (glm53: prompt/cached/prefill/completion tokens,
                             "drafted", "draft" = that request's drafter counters)
  engine.prefix_cache        an object with stats_dict(settle=False) (kv_cache.PrefixCache)
  engine.drafter.stats       cumulative acceptance counters (drafter.policy.AcceptanceStats on a
                             drafter.glm53_target.DraftPlan): steps, proposed, accepted, committed,
                             lossy_steps, histogram[n] (verify steps that kept n drafts), per_source
A multi-rank engine (glm53.dist RankEngine) keeps these on its inner `engine`; `holder` finds them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("front.requests")

# stats_dict keys that are sizes now (gauges); every other known key only grows (a counter)
CACHE_GAUGES = {"host_bytes": "Bytes of prefix-cache rows in host memory.",
                "host_chunks": "Prefix-cache chunks in host memory.",
                "disk_bytes": "Bytes of prefix-cache files in the disk tier.",
                "disk_chunks": "Prefix-cache chunks in the disk tier."}
CACHE_COUNTERS = {"lookups": "Prefix-cache lookups (one per request).",
                  "hits": "Lookups that reused at least one prompt token.",
                  "misses": "Lookups that reused nothing.",
                  "cached_tokens": "Prompt tokens reused from the prefix cache.",
                  "live_tokens": "Reused tokens taken in place from the live conversation.",
                  "host_tokens": "Reused tokens restored from host memory.",
                  "disk_tokens": "Reused tokens restored from the disk tier.",
                  "stored_chunks": "Chunks newly kept in host memory.",
                  "disk_written_chunks": "Chunks written to the disk tier.",
                  "evictions": "Chunks evicted, host and disk tiers together.",
                  "host_evictions": "Chunks evicted from host memory.",
                  "disk_evictions": "Chunks evicted from the disk tier.",
                  "disk_quarantined": "Disk-tier files found corrupt, short or foreign (treated as misses)."}
DRAFT_COUNTERS = {"steps": ("verify_steps", "Verify forwards (a serial step counts as a 0-draft window)."),
                  "proposed": ("proposed", "Draft tokens proposed."),
                  "accepted": ("accepted", "Draft tokens accepted by verification."),
                  "committed": ("committed", "Tokens committed by verify steps (accepted + one per step)."),
                  "lossy_steps": ("lossy_steps", "Steps decided by LOSSY relaxed top-2 acceptance.")}


def holder(engine: Any) -> Any:
    """The object that carries last_stats / prefix_cache / drafter: the engine, or the engine it wraps."""
    seen = 0
    while not hasattr(engine, "last_stats") and hasattr(engine, "engine") and seen < 4:
        engine, seen = engine.engine, seen + 1
    return engine


def cache_stats(engine: Any) -> dict[str, float] | None:
    """The prefix cache's stats_dict() (numbers only), or None when no cache is attached. Read
    without waiting for a background store still copying (kv_cache's settle=False): around every
    request and at each scrape, a wait would hold the reply and the next lookup; such a store is
    counted by a later read."""
    cache = getattr(holder(engine), "prefix_cache", None)
    stats_dict = getattr(cache, "stats_dict", None)
    if not callable(stats_dict):
        return None
    return {k: v for k, v in stats_dict(settle=False).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def draft_stats(engine: Any) -> Any | None:
    """The drafter's cumulative acceptance counters, or None when the engine does not draft."""
    stats = getattr(getattr(holder(engine), "drafter", None), "stats", None)
    return stats if stats is not None and hasattr(stats, "proposed") and hasattr(stats, "accepted") else None


@dataclass
class Snapshot:
    """Counters read just before a request runs; the request's share is `after - before`."""

    cache: dict[str, float] | None
    draft: tuple[int, int, int] | None  # (steps, proposed, accepted)

    @classmethod
    def take(cls, engine: Any) -> "Snapshot":
        d = draft_stats(engine)
        return cls(cache_stats(engine), (int(d.steps), int(d.proposed), int(d.accepted)) if d is not None else None)


def request_drafts(engine: Any, before: Snapshot, after: Snapshot, stats: dict[str, Any]) -> tuple[int, int] | None:
    """(accepted, proposed) for the request just run: the change in the drafter's counters, else the
    engine's per-request "draft" dict (names ending _accepted_total / _proposed_total); None if not drafted."""
    if not stats.get("drafted"):
        return None
    if before.draft is not None and after.draft is not None:
        return after.draft[2] - before.draft[2], after.draft[1] - before.draft[1]
    per_request = stats.get("draft") or {}
    accepted = [v for k, v in per_request.items() if k.endswith("_accepted_total") and "{" not in k]
    proposed = [v for k, v in per_request.items() if k.endswith("_proposed_total") and "{" not in k]
    return (int(accepted[0]), int(proposed[0])) if accepted and proposed else None


@dataclass
class Timing:
    """Wall-clock marks of one job (time.perf_counter seconds); NaN where the job never got."""

    submitted: float  # queued for the engine
    arrived: float = math.nan  # the HTTP request arrived (validation, template and tokenizer since); else submitted
    started: float = math.nan  # the worker called engine.generate
    first_token: float = math.nan
    last_token: float = math.nan

    def __post_init__(self) -> None:
        if math.isnan(self.arrived):
            self.arrived = self.submitted

    @property
    def queue_wait(self) -> float:
        return self.started - self.submitted

    @property
    def ttft(self) -> float:
        """From arrival, so that queueing and preparing count."""
        return self.first_token - self.arrived

    def decode_rate(self, n_completion: int) -> float:
        """Tokens a second after the first: completion - 1 tokens over first-to-last token time."""
        span = self.last_token - self.first_token
        return (n_completion - 1) / span if n_completion > 1 and span > 0 else math.nan


def request_line(rid: str, n_prompt: int, n_completion: int, stats: dict[str, Any], timing: Timing,
                 drafts: tuple[int, int] | None, before: Snapshot, after: Snapshot, outcome: str) -> str:
    """One line per request: tokens, TTFT (from arrival, so queueing counts), decode speed
    (completion - 1 tokens over first-to-last token time), drafts and the cache's counters."""
    cached = int(stats.get("cached_tokens", 0) or 0)
    prefill = int(stats.get("prefill_tokens", n_prompt - cached) or 0)
    parts = [f"request {rid} {outcome}: prompt={n_prompt} cached={cached} prefill={prefill} completion={n_completion}"]
    if shared := int(stats.get("shared_tokens", 0) or 0):  # of cached: pages of a running sequence, in place
        parts.append(f"shared={shared}")
    if not math.isnan(timing.first_token):
        parts.append(f"queue_ms={1e3 * timing.queue_wait:.1f} ttft_ms={1e3 * timing.ttft:.1f}")
    if not math.isnan(rate := timing.decode_rate(n_completion)):
        parts.append(f"decode_tok_s={rate:.1f}")
    if drafts is not None:
        accepted, proposed = drafts
        parts.append(f"draft_accepted={accepted}/{proposed}")
    if before.cache is not None and after.cache is not None:
        for name in ("hits", "misses", "evictions"):
            total = int(after.cache.get(name, 0))
            parts.append(f"cache_{name}=+{total - int(before.cache.get(name, 0))}/{total}")
    return " ".join(parts)


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_cache(stats: dict[str, float]) -> list[str]:
    """glm53_prefix_cache_<key>_total for counters, glm53_prefix_cache_<key> for gauges; a key this
    front does not know yet is shown as a gauge (always a valid claim)."""
    lines: list[str] = []
    for key in sorted(stats):
        if key in CACHE_COUNTERS:
            _family(lines, f"glm53_prefix_cache_{key}_total", "counter", CACHE_COUNTERS[key], [("", stats[key])])
        else:
            help_text = CACHE_GAUGES.get(key, f"Prefix-cache statistic {key!r} (kv_cache stats_dict).")
            _family(lines, f"glm53_prefix_cache_{key}", "gauge", help_text, [("", stats[key])])
    return lines


def render_draft(stats: Any) -> list[str]:
    """glm53_draft_*: totals, per-source counters, and the accepted-length histogram (le = drafts kept
    in one verify step; _count = verify steps, _sum = accepted drafts)."""
    lines: list[str] = []
    for attr, (name, help_text) in DRAFT_COUNTERS.items():
        if hasattr(stats, attr):
            _family(lines, f"glm53_draft_{name}_total", "counter", help_text, [("", getattr(stats, attr))])
    per_source = sorted((getattr(stats, "per_source", None) or {}).items())
    for attr, help_text in (("steps", "Verify steps by draft source."), ("proposed", "Drafts proposed by source."),
                            ("accepted", "Drafts accepted by source.")):
        _family(lines, f"glm53_draft_source_{attr}_total", "counter", help_text,
                [(f'{{source="{src}"}}', getattr(s, attr)) for src, s in per_source])
    histogram = list(getattr(stats, "histogram", None) or [])
    if histogram:
        # the last slot also holds anything longer (drafter.policy clamps), so it is only under +Inf
        samples, running = [], 0
        for n, count in enumerate(histogram[:-1]):
            running += count
            samples.append((f'_bucket{{le="{n}"}}', running))
        samples += [('_bucket{le="+Inf"}', sum(histogram)), ("_sum", stats.accepted), ("_count", sum(histogram))]
        _family(lines, "glm53_draft_accepted_length", "histogram",
                "Drafts accepted per verify step.", samples)
    return lines


def render(engine: Any) -> str:
    """The cache and drafter families for /metrics ("" when the engine has neither)."""
    lines: list[str] = []
    cache = cache_stats(engine)
    if cache is not None:
        lines += render_cache(cache)
    draft = draft_stats(engine)
    if draft is not None:
        lines += render_draft(draft)
    return "".join(line + "\n" for line in lines)
