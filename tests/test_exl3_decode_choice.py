"""Which EXL3 decode form runs, decided without a GPU: the CUDA split sums (glm53/ops/cuda_exl3.py) only
where they can run and only as the parallel form's 16-row tile; their launcher refuses inputs it cannot
take, naming them, before it loads anything. Their bits: tests/gpu/test_exl3_cuda.py."""
from __future__ import annotations

import pytest
import torch

from glm53.exl3.bank import BankBuilder
from glm53.exl3.format import read_group
from glm53.ops import cuda_exl3

tx = pytest.importorskip("glm53.ops.triton_exl3")


def _bank(codebooks: tuple[str, ...]):
    markers = {"mcg": 0xCBAC1FED - (1 << 32), "mul1": 0x83DCD12D - (1 << 32)}
    b = BankBuilder()
    for n, codebook in enumerate(codebooks):
        parts = {"trellis": torch.zeros(8, 8, 48, dtype=torch.int16), "suh": torch.ones(128, dtype=torch.float16),
                 "svh": torch.ones(128, dtype=torch.float16)}
        if codebook in markers:
            parts[codebook] = torch.tensor(markers[codebook], dtype=torch.int32)
        b.add_group(read_group({f"g{n}.{k}": v for k, v in parts.items()}, f"g{n}"))
    return b.build("cpu")


def test_the_cuda_form_is_the_parallel_16_row_tile_only() -> None:
    assert tx.DECODE_CUDA.cuda and tx.DECODE_CUDA.parallel and tx.DECODE_CUDA.bm == 16
    with pytest.raises(ValueError, match="parallel form's, 16 rows"):
        tx.Form(64, 4, 1, True, 32, cuda=True)
    with pytest.raises(ValueError, match="parallel form's, 16 rows"):
        tx.Form(16, 4, 1, False, 32, parallel=False, cuda=True)


def test_off_cuda_the_triton_decode_form_runs() -> None:
    bank = _bank(("mcg",))
    assert tx.decode_form(bank, torch.bfloat16) == tx.DECODE
    assert "not a CUDA device" in cuda_exl3.unavailable(torch.device("cpu"))


def test_the_launcher_names_what_it_cannot_take() -> None:
    xr = torch.zeros(1, 128, dtype=torch.float16)
    common = dict(groups=1, n_blocks=1, n_splits=1, mats=(0,), in_width=128, out_stride=128, rows=1)
    with pytest.raises(ValueError, match=r"one codebook \(this one mixes \[1, 2\]\)"):
        cuda_exl3.split_parts(_bank(("mcg", "mul1")), xr, torch.zeros(128), **common)
    with pytest.raises(ValueError, match="fp16 rotated inputs, got torch.bfloat16"):
        cuda_exl3.split_parts(_bank(("mcg",)), xr.bfloat16(), torch.zeros(128), **common)
    with pytest.raises(ValueError, match="ids must be int64 rows, got torch.int32"):
        cuda_exl3.split_parts(_bank(("mcg",)), xr, torch.zeros(128), **common,
                              ids=torch.zeros(1, 8, dtype=torch.int32))
