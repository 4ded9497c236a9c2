"""The verifier and the layout plan on the kit's tiny checkpoint (real EXL3 mixed-width experts).

The strongest check of the EXL3 slicing: a rank's slice (trellis tiles, the sliced sign vector, the
whole other one) decodes to exactly the columns (gate/up) or rows (down) of the full decoded weight
that the rank owns, bit for bit: the Hadamard transforms work on 128-blocks, and blocks are whole.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from glm53.exl3.decode import decode_weight
from glm53.exl3.format import read_group
from glm53.layout.plan import plan_layout
from glm53.loading.slices import SliceReader, read_rank_tensors
from glm53.checkpoints.report import build_report
from glm53.checkpoints.verify import verify_checkpoint
from tests.fixtures_tiny import tiny_dirs  # noqa: F401  (the session's one tiny checkpoint)


def test_tiny_checkpoint_verifies_clean(tiny_dirs) -> None:  # noqa: F811
    result = verify_checkpoint(tiny_dirs.model)
    assert [f for f in result.findings if f.level != "warning"] == []
    report = build_report(result)
    assert report["exit_code"] == 0
    ex = report["summary"]["exl3"]
    assert set(ex["codebooks"]) == {"3inst", "mcg", "mul1"}  # the tiny pack uses all three
    widths = {k for hist in ex["routed_expert_width_histogram"].values() for k in hist}
    assert {"2", "2.5", "3", "3.5", "4"} <= widths
    assert set(report["summary"]["bytes_per_rank"]) == {"3", "4"}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_tiny_plan_covers_everything(tiny_dirs, ranks: int) -> None:  # noqa: F811
    plan = plan_layout(tiny_dirs.model, ranks)
    assert plan.unclassified == []
    for module, rule in plan.rules.items():
        owned = sorted(plan.features(r)[module].own for r in range(ranks))
        assert owned[0][0] == 0 and owned[-1][1] == plan.extents[module], module
        assert all(a[1] == b[0] for a, b in zip(owned, owned[1:])), module


def _expert_groups(plan, want: int) -> list[str]:
    """A few expert projections spanning the codebooks and half-integer widths."""
    picked, seen = [], set()
    for name, info in plan.tensors.items():
        if ".mlp.experts." in name and name.endswith(".trellis"):
            prefix = name[: -len(".trellis")]
            book = "mcg" if f"{prefix}.mcg" in plan.tensors else "mul1" if f"{prefix}.mul1" in plan.tensors else "3inst"
            key = (prefix.rsplit(".", 1)[1], book, info.shape[-1])
            if key not in seen:
                seen.add(key)
                picked.append(prefix)
    return picked[:want]


@pytest.mark.parametrize("ranks", [3, 4])
def test_exl3_rank_slices_decode_to_owned_columns(tiny_dirs, ranks: int) -> None:  # noqa: F811
    model = Path(tiny_dirs.model)
    plan = plan_layout(model, ranks)
    prefixes = _expert_groups(plan, 8)
    assert any(p.endswith("down_proj") for p in prefixes) and any(p.endswith("gate_proj") for p in prefixes)
    full = {}
    for prefix in prefixes:
        names = [n for n in plan.tensors if n.startswith(prefix + ".")]
        tensors = {}
        for n in names:
            with safe_open(plan.locations[n].file, "pt") as f:
                tensors[n] = f.get_tensor(n)
        full[prefix] = decode_weight(read_group(tensors, prefix))  # [in, out]
    for r in range(ranks):
        feats = plan.features(r)
        for prefix in prefixes:
            names = [n for n in plan.tensors if n.startswith(prefix + ".")]
            reader = SliceReader()
            part = read_rank_tensors(model, plan, r, names, reader=reader)
            got = decode_weight(read_group(part, prefix))
            a, b = feats[prefix].own
            want = full[prefix][:, a:b] if feats[prefix].axis == "out" else full[prefix][a:b, :]
            assert torch.equal(got, want), (prefix, r)
            whole = sum(plan.tensors[n].nbytes for n in names)
            assert reader.bytes_read < whole  # never the whole group
            reader.close()
