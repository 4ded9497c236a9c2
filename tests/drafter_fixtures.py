"""Setup the drafter tests share: one torch thread per test module, and the tiny DFlash2 drafter
sized for drafter.reference_lm."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from drafter.reference_lm import ReferenceLM
from drafter.tiny_dflash import write_tiny_dflash2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add contention on the shared CI cores. (Autouse in every
    module that imports it.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_dflash2(folder: Path, model: ReferenceLM, block_size: int) -> Path:
    """A tiny DFlash2 drafter matched to the reference LM's vocabulary and width, tapping its layers 0 and 1."""
    return write_tiny_dflash2(folder, vocab_size=model.config.vocab_size, hidden_size=model.config.dim,
                              target_layer_ids=[0, 1], block_size=block_size)


class OracleDrafts:
    """A draft plan (new_source per request) that proposes the serial reply, set in `truth` before each
    request, padded with `pad` past its end, with one token corrupted in a `corrupt` share of windows:
    deep acceptances and rejections on demand."""

    def __init__(self, max_depth: int = 13, corrupt: float = 0.3, pad: int = 5, seed: int = 0) -> None:
        self.truth: list[int] = []
        self.max_depth, self.corrupt, self.pad = max_depth, corrupt, pad
        self.rng = random.Random(seed)

    def new_source(self, target):  # noqa: ANN001, ANN201 - drafter's DraftSource protocol
        plan = self

        class Oracle:
            name, taps, needs_hidden, max_depth = "oracle", (), False, plan.max_depth

            def commit(self, tokens, out, kept_rows):  # noqa: ANN001
                pass

            def propose(self, tokens, depth, sample_fn=None):  # noqa: ANN001
                at = len(tokens)
                drafts = (list(plan.truth[at:at + depth]) + [plan.pad] * depth)[:depth]
                if drafts and plan.rng.random() < plan.corrupt:
                    i = plan.rng.randrange(len(drafts))
                    drafts[i] = (drafts[i] + 1) % 2000
                return drafts
        return Oracle()
