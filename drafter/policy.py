"""Draft depth policy and acceptance statistics.

Depth adapts to recent acceptance: an exponentially weighted mean of accepted drafts per verify
step; the next window drafts round(headroom * mean) + 1 tokens (more than recently landed, so depth
climbs quickly while drafts land; verifying a few extra rows costs little in weight-bound decode),
clamped to [1, max_depth]. A request with `draft: false` decodes serially (depth 0).

Knobs (glm53/settings.py; PolicyConfig.from_settings):
  TF_GLM53_DRAFT_MAX_DEPTH      deepest window, 1..13 (default 13)
  TF_GLM53_DRAFT_EWMA           weight of the newest step in the mean (default 0.3)
  TF_GLM53_DRAFT_RELAXED_TOP2   1 = LOSSY relaxed top-2 acceptance (default 0; changes outputs)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glm53.settings import Settings

MAX_DEPTH = 13


@dataclass(frozen=True)
class PolicyConfig:
    max_depth: int = MAX_DEPTH
    ewma_weight: float = 0.3
    initial_mean: float = 2.0
    headroom: float = 1.5
    relaxed_top2: bool = False     # LOSSY: never the default

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"TF_GLM53_DRAFT_MAX_DEPTH must be in 1..{MAX_DEPTH}, got {self.max_depth}")
        if not 0.0 < self.ewma_weight <= 1.0:
            raise ValueError(f"TF_GLM53_DRAFT_EWMA must be in (0, 1], got {self.ewma_weight}")

    @classmethod
    def from_settings(cls, settings: "Settings") -> "PolicyConfig":
        """The knobs' values (already checked by Settings against the same ranges)."""
        return cls(max_depth=settings.draft_max_depth, ewma_weight=settings.draft_ewma,
                   relaxed_top2=settings.draft_relaxed_top2)


@dataclass
class SourceStats:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class AcceptanceStats:
    """Counters for logs and metrics. histogram[n] = verify steps that kept n drafts."""

    steps: int = 0                 # verify forwards (serial steps included as 0-draft windows)
    proposed: int = 0
    accepted: int = 0
    committed: int = 0             # tokens committed by verify steps (accepted + one per step)
    lossy_steps: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * (MAX_DEPTH + 2))
    per_source: dict[str, SourceStats] = field(default_factory=dict)

    def record(self, source: str, proposed: int, accepted: int, lossy: bool = False) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.committed += accepted + 1
        self.lossy_steps += int(lossy)
        self.histogram[min(accepted, len(self.histogram) - 1)] += 1
        s = self.per_source.setdefault(source, SourceStats())
        s.steps += 1
        s.proposed += proposed
        s.accepted += accepted

    def merge(self, other: "AcceptanceStats") -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.committed += other.committed
        self.lossy_steps += other.lossy_steps
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram)]
        for name, s in other.per_source.items():
            mine = self.per_source.setdefault(name, SourceStats())
            mine.steps += s.steps
            mine.proposed += s.proposed
            mine.accepted += s.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    def metrics(self, prefix: str = "tf_glm53_draft") -> dict[str, float]:
        """Flat name -> value, Prometheus-style names."""
        m: dict[str, float] = {
            f"{prefix}_verify_steps_total": self.steps,
            f"{prefix}_proposed_total": self.proposed,
            f"{prefix}_accepted_total": self.accepted,
            f"{prefix}_committed_total": self.committed,
            f"{prefix}_lossy_steps_total": self.lossy_steps,
        }
        for n, count in enumerate(self.histogram):
            m[f'{prefix}_accepted_length_bucket{{accepted="{n}"}}'] = count
        for name, s in sorted(self.per_source.items()):
            m[f'{prefix}_source_proposed_total{{source="{name}"}}'] = s.proposed
            m[f'{prefix}_source_accepted_total{{source="{name}"}}'] = s.accepted
            m[f'{prefix}_source_steps_total{{source="{name}"}}'] = s.steps
        return m

    def log_line(self) -> str:
        sources = " ".join(f"{n}={s.accepted}/{s.proposed}" for n, s in sorted(self.per_source.items()))
        lossy = f" LOSSY_steps={self.lossy_steps}" if self.lossy_steps else ""
        return (f"drafts: steps={self.steps} accepted={self.accepted}/{self.proposed} "
                f"({100 * self.acceptance_rate:.1f}%) tokens/step={self.tokens_per_step:.2f} "
                f"[{sources}] hist={self.histogram}{lossy}")


class AdaptiveDepth:
    """Per-request depth from the EWMA of accepted drafts per step."""

    def __init__(self, config: PolicyConfig | None = None, *, enabled: bool = True) -> None:
        self.config = config or PolicyConfig()
        self.enabled = enabled          # False: the request asked for "draft": false
        self.mean = self.config.initial_mean

    def depth(self, source_max: int = MAX_DEPTH) -> int:
        if not self.enabled:
            return 0
        want = int(self.config.headroom * self.mean + 0.5) + 1
        return max(1, min(want, self.config.max_depth, source_max))

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return                      # the source had nothing: no evidence about acceptance
        w = self.config.ewma_weight
        self.mean = (1 - w) * self.mean + w * accepted
