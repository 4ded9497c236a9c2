"""The composition root: an engine with its prefix cache and drafting, at one rank or several.

    engine = build_engine(model_dir, tp=1)                # Glm53Engine
    engine = build_engine(model_dir, tp=R, rank=r, ...)   # RankEngine (rank 0 serves, others follow())

The one module that imports the engine, the prefix cache and the drafter together: the engine sees
its features only as glm53.runtime.features' protocols, kv_cache and drafter see no engine. TensorFold's
family contract (glm53.cuda_engine), the lane's ranks (glm53/serving/rank.py), the tiny embedded lane
and the tests build engines here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafter.glm53_target import DraftPlan
from glm53.dist.rank_engine import RankEngine
from glm53.runtime.engine import Glm53Engine
from glm53.runtime.features import Drafting, PrefixCache
from glm53.runtime.errors import EngineError
from glm53.settings import Settings
from kv_cache.engine_adapter import prefix_cache_for


@dataclass(frozen=True)
class ServeFeatures:
    """glm53.runtime.features.EngineFeatures as a lane serves: the draft plan (copy / MTP / DFlash2,
    or none: drafter's choice, drafter/glm53_target.py) and the prefix cache, both from the engine's
    settings (TF_GLM53_DRAFT_SOURCE, TF_GLM53_PREFIX_CACHE=0 turns the cache off). Over several ranks
    every rank builds both: its own cache, agreeing with the others through the rank's comm."""

    drafter: Any = None  # the contract's `drafter`: a DFlash2 directory, or a ready source or factory
    no_drafts: bool = False
    mtp_drafts: int | None = None

    def drafting(self, engine: Glm53Engine) -> Drafting | None:
        return DraftPlan.from_contract(engine, drafter=self.drafter or None, no_drafts=self.no_drafts,
                                       mtp_drafts=self.mtp_drafts, world=engine.plan.world)

    def prefix_cache(self, engine: Glm53Engine) -> PrefixCache:
        return prefix_cache_for(engine, comm=getattr(engine.plan, "comm", None))


def build_engine(model_dir: str | Path, *, drafter: Any = None, tp: int = 1, rank: int = 0,
                 master: str = "127.0.0.1", master_port: int = 29551, no_drafts: bool = False,
                 mtp_drafts: int | None = None, settings: Settings | None = None,
                 **options: Any) -> Glm53Engine | RankEngine:
    """The engine TensorFold's CLI starts on every rank (rank 0 serves; others call follow()), with the
    lane's features (ServeFeatures). One rank: a Glm53Engine. Several: a RankEngine (rendezvous at
    master:master_port, then every rank runs the same Glm53Engine under a DistRankPlan). `settings`:
    a glm53.settings.Settings (default: the environment's, parsed here); `options` win over it."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or not isinstance(rank, int) or not 0 <= rank < tp:
        raise EngineError(f"--tp {tp} --rank {rank}: ranks run 0..tp-1")
    settings = Settings.from_env() if settings is None else settings
    features = ServeFeatures(drafter=drafter, no_drafts=no_drafts, mtp_drafts=mtp_drafts)
    if tp > 1:
        return RankEngine(str(model_dir), tp=tp, rank=rank, master=master or "127.0.0.1", master_port=master_port,
                          no_drafts=no_drafts, mtp_drafts=mtp_drafts, features=features, settings=settings, **options)
    return Glm53Engine(model_dir, tp=tp, rank=rank, master=master, master_port=master_port, no_drafts=no_drafts,
                       mtp_drafts=mtp_drafts, features=features, settings=settings, **options)
