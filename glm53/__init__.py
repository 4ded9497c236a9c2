"""glm53: the full GLM-5.3 (`model_type` glm_moe_dsa) as a TensorFold model family.

The family contract (TensorFold v0.6.0 families/<name>/):
    MODEL_TYPES = ("glm_moe_dsa",)
    check(model_dir) -> None            raises, naming file and field/tensor, for what cannot be served
    cuda_engine(model_dir, *, drafter=None, tp=1, rank=0, master="127.0.0.1", master_port=29551,
                no_drafts=False, mtp_drafts=None, **options) -> engine with eos, generate(), follow()
It also runs on the CPU (options device="cpu" or TF_GLM53_DEVICE=cpu). See docs/engine.md.
cuda_engine is the composition root's build_engine (glm53/serving/compose.py); the TF_GLM53_* knobs
are glm53.settings.Settings, parsed once there unless given `settings`.

Every import of a glm53 module runs this file first, so at its top it imports only the config (for
MODEL_TYPE): `import glm53.settings` stays light and `python -m glm53.<module>` runs that module
once. The contract's two functions import their homes when called.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from glm53.config import MODEL_TYPE

MODEL_TYPES = (MODEL_TYPE,)
TITLE = "GLM-5.3 (glm53 kit: EXL3 mixed-width, TP/DCP up to 4 ranks)"
QUANT_METHODS = ("exl3",)  # config.json quantization_config.quant_method values served (plain bf16 too)


def check(model_dir: str | Path) -> None:
    """None when this family can serve `model_dir`; otherwise raises ValueError (ConfigError,
    CheckpointError) whose message names the file and the field or tensor."""
    from glm53.loading.loader import check_checkpoint  # on call: see the module docstring

    check_checkpoint(model_dir)


def cuda_engine(model_dir: str | Path, **contract: Any) -> Any:
    """The engine TensorFold's CLI starts on every rank: glm53.serving.compose.build_engine (the
    contract's keyword arguments and engine options, as documented there)."""
    from glm53.serving.compose import build_engine  # on call: see the module docstring

    return build_engine(model_dir, **contract)


__all__ = ["MODEL_TYPES", "QUANT_METHODS", "TITLE", "check", "cuda_engine"]
