"""What the drafter's Target protocol (drafter/target.py) reads of one sequence's KV state and the
model. The one-request engine's Glm53Target adds `forward`; the batched runtime (glm53.runtime.drafted)
uses it as it is, since there the drafter's loop yields its windows to the scheduler instead."""
from __future__ import annotations

from typing import Any

import torch


class StateTarget:
    def __init__(self, engine: Any, state: Any) -> None:
        self.engine, self.state = engine, state
        self.vocab_size = engine.cfg.vocab_size

    def length(self) -> int:
        return self.state.length

    def canonical_frontier(self) -> int:
        return self.state.frontier

    def truncate(self, length: int) -> None:
        self.state.truncate(length)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.engine.model.plan.embed(self.engine.model.w.embed, token_ids.to(self.engine.device)).float()

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.engine.model.logits(hidden.to(self.engine.model.dtype))
