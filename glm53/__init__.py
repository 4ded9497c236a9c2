"""glm53: the full GLM-5.3 (`model_type` glm_moe_dsa) as a TensorFold model family.

The family contract (TensorFold v0.6.0 families/<name>/):
    MODEL_TYPES = ("glm_moe_dsa",)
    check(model_dir) -> None            raises, naming file and field/tensor, for what cannot be served
    cuda_engine(model_dir, *, drafter=None, tp=1, rank=0, master="127.0.0.1", master_port=29551,
                no_drafts=False, mtp_drafts=None, **options) -> engine with eos, generate(), follow()
It also runs on the CPU (options device="cpu" or TF_GLM53_DEVICE=cpu). See docs/engine.md.
The TF_GLM53_* knobs are glm53.settings.Settings; cuda_engine parses them once unless given `settings`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from glm53.config import MODEL_TYPE

if TYPE_CHECKING:  # imported where used: `python -m glm53.settings` runs that module as __main__
    from glm53.settings import Settings

MODEL_TYPES = (MODEL_TYPE,)
TITLE = "GLM-5.3 (glm53 kit: EXL3 mixed-width, TP/DCP up to 4 ranks)"
QUANT_METHODS = ("exl3",)  # config.json quantization_config.quant_method values served (plain bf16 too)


def check(model_dir: str | Path) -> None:
    """None when this family can serve `model_dir`; otherwise raises ValueError (ConfigError,
    CheckpointError) whose message names the file and the field or tensor."""
    from glm53.loading.loader import check_checkpoint

    check_checkpoint(model_dir)


def cuda_engine(model_dir: str | Path, *, drafter: Any = None, tp: int = 1, rank: int = 0,
                master: str = "127.0.0.1", master_port: int = 29551, no_drafts: bool = False,
                mtp_drafts: int | None = None, settings: Settings | None = None, **options: Any):
    """The engine TensorFold's CLI starts on every rank (rank 0 serves; others call follow()).
    One rank: a Glm53Engine. Several: glm53.dist's RankEngine (rendezvous at master:master_port,
    then every rank runs the same Glm53Engine under a DistRankPlan). `settings`: a
    glm53.settings.Settings (default: the environment's, parsed here); `options` win over it."""
    from glm53.runtime.engine import EngineError
    from glm53.settings import Settings

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or not isinstance(rank, int) or not 0 <= rank < tp:
        raise EngineError(f"--tp {tp} --rank {rank}: ranks run 0..tp-1")
    settings = Settings.from_env() if settings is None else settings
    if tp > 1:
        from glm53.dist.rank_engine import RankEngine

        # every rank: its own prefix cache (agreeing on the minimum) and the draft plan (copy drafts:
        # rank 0 drafts, the others replay its verification windows)
        return RankEngine(str(model_dir), tp=tp, rank=rank, master=master or "127.0.0.1", master_port=master_port,
                          drafter=drafter, no_drafts=no_drafts, mtp_drafts=mtp_drafts, serve_features=True,
                          settings=settings, **options)
    from glm53.runtime.engine import Glm53Engine

    engine = Glm53Engine(model_dir, drafter=None, tp=tp, rank=rank, master=master, master_port=master_port,
                         no_drafts=no_drafts, mtp_drafts=mtp_drafts, settings=settings, **options)
    # the draft source per request (copy / MTP / DFlash2, or none) is drafter's decision (drafter/glm53_target.py)
    from drafter.glm53_target import DraftPlan

    engine.drafter = DraftPlan.from_contract(engine, drafter=drafter or None, no_drafts=no_drafts, mtp_drafts=mtp_drafts)
    # the prefix cache, from the engine's settings (TF_GLM53_PREFIX_CACHE=0 turns it off)
    from kv_cache.engine_adapter import attach_prefix_cache

    attach_prefix_cache(engine)
    return engine


__all__ = ["MODEL_TYPES", "QUANT_METHODS", "TITLE", "check", "cuda_engine"]
