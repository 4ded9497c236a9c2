"""One forward over a step's work: every sequence's rows through the projections and experts at
once, each sequence's attention over its own KV (Glm53Model.forward_batch; captured CUDA graphs
for a step's short windows and the prefill pieces beside them, glm53/runtime/cuda_graphs.py), and the head over
the rows whose logits are read, in one product. Row invariance makes each row's bits those of the
sequence run alone."""
from __future__ import annotations

import torch

from glm53.model.transformer import ForwardOutput
from glm53.runtime.scheduler import Work


class ModelRunner:
    def __init__(self, engine) -> None:  # noqa: ANN001 (glm53.runtime.engine.Glm53Engine)
        self.engine = engine
        self.model = engine.model

    @torch.inference_mode()
    def forward(self, work: list[Work], taps: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """The step's forward; prefill pieces contiguous with a state's frontier advance it."""
        if len(work) == 1:  # a batch of one: the engine's forward (a captured graph where one applies)
            w = work[0]
            outs = [self.engine.forward(w.seq.state, w.tokens, w.start, taps)]
        else:  # captured graphs for the short windows and the pieces beside them, else eager
            outs = self.engine.forward_batch([(w.seq.state, w.tokens) for w in work], taps)
        for w in work:
            state = w.seq.state
            if w.prefill and w.end <= len(w.seq.prompt) and state.frontier == w.start:
                state.frontier = w.end
        return outs

    @torch.inference_mode()
    def logits(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 logits of each group of hidden rows, through one head product."""
        if not rows:
            return []
        sizes = [r.shape[0] for r in rows]
        return list(self.model.logits(torch.cat(rows)).split(sizes))
