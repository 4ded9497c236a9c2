"""Setup the drafter tests share: one torch thread per test module, and the tiny DFlash2 drafter
sized for drafter.reference_lm."""
from __future__ import annotations

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
