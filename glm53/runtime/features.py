"""What the engine asks of its features, as protocols on the engine's side: the prefix cache, the
drafts, the ranks' draft windows, and the builder that hands them to an engine's constructor.

The engine imports none of their implementations; the composition root (glm53/serving/compose.py)
builds them (kv_cache.PrefixCache, drafter.glm53_target.DraftPlan, glm53.dist.window_channel.
WindowChannel) and passes them in."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol


if TYPE_CHECKING:
    from glm53.runtime.engine import Glm53Engine

# (start, n, rows): rows [start, start + n) of a cache entry, into the sequence's KV state
ImportRows = Callable[[int, int, Any], None]
ExportRows = Callable[[int, int], Any]  # (start, stop) -> the state's rows, in the prefix cache's form


class CacheHit(Protocol):
    """A lookup's answer: how much of the live conversation stays, and the rows to restore."""

    live_tokens: int

    def restore(self, write_rows: ImportRows, device: Any = None) -> int: ...


class PrefixCache(Protocol):
    """Reuse of KV rows across requests (kv_cache.PrefixCache): looked up before a prefill, stored
    after a reply, up to the canonical prefill frontier."""

    enabled: bool

    def lookup(self, token_ids: Sequence[int], live_tokens: Sequence[int] = (), live_frontier: int = 0) -> CacheHit: ...

    def store(self, token_ids: Sequence[int], frontier: int, rows_for: ExportRows) -> int: ...

    def close(self) -> None: ...


class Drafting(Protocol):
    """Drafts for drafted decoding, handed as they are to drafter.decode_loop.drafted_decode: a plan
    with `new_source(target)` per request (drafter.glm53_target.DraftPlan) or one DraftSource. The
    engine itself reads only the layers whose outputs the drafts tap."""

    taps: tuple[int, ...]


class DraftWindows(Protocol):
    """Drafted decoding over several ranks (glm53.dist.window_channel.WindowChannel): rank 0 leads
    the drafter's loop and announces its calls; the other ranks replay them on their target."""

    @property
    def leader(self) -> bool: ...

    def lead(self, target: Any) -> Any: ...

    def follow_windows(self, target: Any) -> None: ...


class EngineFeatures(Protocol):
    """What a composition root hands an engine's constructor: it builds the engine's drafts and prefix
    cache once the model is loaded (both depend on the model and the engine's settings). Either may
    be None (no drafting, no prefix cache)."""

    def drafting(self, engine: Glm53Engine) -> Drafting | None: ...

    def prefix_cache(self, engine: Glm53Engine) -> PrefixCache | None: ...


