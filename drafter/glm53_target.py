"""The drafter over the real GLM-5.3 engine: the MTP adapter, and the draft plan built from the
family contract's `drafter`, `no_drafts` and `mtp_drafts` arguments.

The Target itself is `glm53.runtime.engine.Glm53Target` (the engine's own rows, prefill pieces and frontier
bookkeeping, written to drafter/target.py's protocol). This module adds what the engine needs to
*choose* and *build* a draft source per request:

    plan = DraftPlan.from_contract(engine, drafter=..., no_drafts=..., mtp_drafts=...)
    Glm53Engine(..., drafter=plan)   # drafter.decode_loop.drafted_decode calls plan.new_source(target)

Choice (first that applies; the source is Settings.draft_source, TF_GLM53_DRAFT_SOURCE):
    no_drafts=True, or TF_GLM53_DRAFT_SOURCE=off          -> None (serial decoding)
    TF_GLM53_DRAFT_SOURCE=copy|mtp|dflash2                -> that source (an error if unavailable)
    `drafter` is a DFlash2 directory (config.json + *.safetensors) -> DFlash2 drafts
    mtp_drafts > 0 (or None) and the checkpoint has an MTP layer    -> MTP drafts, depth <= mtp_drafts
    otherwise                                                       -> copy drafts (prompt lookup)
`drafter` may also be a DraftSource or factory object already (tests, embedders): used as is.

Over several ranks (`world` > 1, glm53.dist's RankEngine) the choice is the same as at one rank.
Rank 0 drafts, verifies and samples; the followers replay every call that meets in collectives,
through glm53.dist.window_channel.WindowChannel: the target's windows and truncations, each MTP
layer call on every rank's own (TP-sharded) MTP cache (new_source wraps the adapter with the
target's `lead_mtp`), and the embedding / LM head lookups DFlash2 borrows. DFlash2's own small model
runs on rank 0 alone, on the tap layers' outputs of rank 0's forwards (replicated after TP's
reductions). `world` is accepted for the callers' sake; it changes nothing.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from glm53.settings import Settings

from .policy import MAX_DEPTH, AcceptanceStats
from .sources import CopySource, MtpSource
from .sources.dflash2 import Dflash2Model, Dflash2Source
from .target import Target

log = logging.getLogger("drafter.glm53")


class Glm53MtpAdapter:
    """drafter.sources.mtp.MtpAdapter over Glm53Model.mtp_forward with the MTP layer's own cache."""

    def __init__(self, model: Any, kv_dtype: str = "bf16") -> None:
        self.model = model
        self.state = model.new_mtp_state(kv_dtype)
        self.padded_rows = 0

    def forward(self, hidden: torch.Tensor, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start > self.state.length:
            self._pad_to(start)
        with torch.inference_mode():
            return self.model.mtp_forward(self.state, hidden, list(tokens), start)

    def truncate(self, length: int) -> None:
        self.state.truncate(min(length, self.state.length))

    def _pad_to(self, length: int) -> None:
        # Rows the MTP layer never saw (the prefix came from a cache, or the prompt's hidden states were
        # not shown to it): zero rows keep positions aligned. They only dilute the MTP layer's attention
        # (weaker drafts); verification keeps the output exact regardless.
        gap = length - self.state.length
        st = self.state
        st.reserve(length)
        st.write_latent(0, st.length, torch.zeros(gap, st.latent_dim, device=self.model.device))
        if 0 in st.indexed_layers:
            st.write_index(0, st.length, torch.zeros(gap, st.index_dim, device=self.model.device))
        st.tokens.extend([0] * gap)
        self.padded_rows += gap


class DraftPlan:
    """Per-request draft sources of one kind, plus the acceptance statistics of all requests."""

    def __init__(self, kind: str, *, model: Any = None, kv_dtype: str = "bf16", max_depth: int = MAX_DEPTH,
                 dflash: Dflash2Model | None = None) -> None:
        if kind not in ("copy", "mtp", "dflash2"):
            raise ValueError(f"draft source {kind!r}: one of copy, mtp, dflash2")
        self.kind, self.model, self.kv_dtype, self.dflash = kind, model, kv_dtype, dflash
        self.max_depth = max(1, min(max_depth, MAX_DEPTH))
        self.stats = AcceptanceStats()

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose outputs the sources need (ask the prefill for them: `prefilled=`)."""
        return tuple(self.dflash.config.target_layer_ids) if self.kind == "dflash2" else ()

    @property
    def needs_hidden(self) -> bool:
        return self.kind == "mtp"

    def new_source(self, target: Target):
        if self.kind == "copy":
            return CopySource(max_depth=self.max_depth)
        if self.kind == "mtp":
            adapter = Glm53MtpAdapter(self.model, self.kv_dtype)
            lead = getattr(target, "lead_mtp", None)          # over R ranks: replayed on every rank
            return MtpSource(lead(adapter) if lead is not None else adapter, max_depth=self.max_depth)
        return Dflash2Source(self.dflash, target)        # the target shares its embedding and head

    def finish(self, stats: AcceptanceStats) -> None:
        self.stats.merge(stats)

    @classmethod
    def from_contract(cls, engine: Any, *, drafter: Any = None, no_drafts: bool = False,
                      mtp_drafts: int | None = None, settings: Settings | None = None,
                      world: int = 1) -> "DraftPlan | Any | None":
        """`settings`: default the engine's (`engine.settings`; the defaults where it has none)."""
        settings = settings if settings is not None else getattr(engine, "settings", None) or Settings()
        choice = settings.draft_source
        if no_drafts or choice == "off":
            return None
        if settings.draft_relaxed_top2:
            log.warning("TF_GLM53_DRAFT_RELAXED_TOP2 is on: relaxed top-2 acceptance is LOSSY; "
                        "drafted replies may differ from serial ones")
        if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
            return drafter                                  # a ready source or factory
        if mtp_drafts is not None and (isinstance(mtp_drafts, bool) or not isinstance(mtp_drafts, int) or mtp_drafts < 0):
            raise ValueError(f"mtp_drafts must be a non-negative integer, got {mtp_drafts!r}")
        depth = MAX_DEPTH if not mtp_drafts else min(mtp_drafts, MAX_DEPTH)
        if choice == "copy":
            return cls("copy", max_depth=depth)             # needs no model
        model = engine.model
        has_mtp = getattr(model.w, "mtp", None) is not None
        kv_dtype = getattr(engine, "kv_dtype", "bf16")

        def dflash_plan(path: Any) -> "DraftPlan":
            if path is None:
                raise ValueError("TF_GLM53_DRAFT_SOURCE=dflash2 needs the drafter directory "
                                 "(--drafter PATH; fetch it with fetch_weights.sh --drafter)")
            dflash = Dflash2Model.load(Path(path), device=engine.device)
            if dflash.config.vocab_size != engine.cfg.vocab_size or dflash.config.hidden_size != engine.cfg.hidden_size:
                raise ValueError(f"{path}: DFlash2 drafter (vocab {dflash.config.vocab_size}, hidden "
                                 f"{dflash.config.hidden_size}) does not match the model (vocab {engine.cfg.vocab_size}, "
                                 f"hidden {engine.cfg.hidden_size})")
            bad = [i for i in dflash.config.target_layer_ids if not 0 <= i < engine.cfg.num_hidden_layers]
            if bad:
                raise ValueError(f"{path}: target_layer_ids {bad} are not layers of the model")
            return cls("dflash2", model=model, dflash=dflash, max_depth=min(depth, dflash.config.block_size - 1))

        def mtp_plan() -> "DraftPlan":
            if not has_mtp:
                raise ValueError("MTP drafts asked for, but the checkpoint has no MTP layer "
                                 "(num_nextn_predict_layers = 0); use copy drafts or the DFlash2 drafter")
            return cls("mtp", model=model, kv_dtype=kv_dtype, max_depth=depth)

        if choice == "mtp":
            return mtp_plan()
        if choice == "dflash2" or drafter is not None:
            return dflash_plan(drafter)
        if has_mtp and mtp_drafts != 0:
            return mtp_plan()
        return cls("copy", max_depth=depth)
