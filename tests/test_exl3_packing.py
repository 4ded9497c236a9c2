"""Mixed-width expert packing: table, width groups, sizes, rank block subsets, reference expert matmul."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.exl3.decode import decode_weight
from glm53.exl3.encode import encode_weights
from glm53.exl3.format import Exl3Error, read_group
from glm53.exl3.packing import BLOCK, PROJECTIONS, expert_forward, experts_forward, pack_layer_experts

HIDDEN, WIDTH, N_EXPERTS, LAYER = 128, 512, 4, 5
# (expert, projection) -> (K, codebook): widths 2..4 with half-integer, one width across two codebooks
QUANT = {
    (0, "gate_proj"): (2.0, "mcg"), (0, "up_proj"): (4.0, "3inst"), (0, "down_proj"): (3.0, "mul1"),
    (1, "gate_proj"): (3.0, "3inst"), (1, "up_proj"): (2.5, "mul1"), (1, "down_proj"): (3.0, "mcg"),
    (2, "gate_proj"): (2.0, "3inst"), (2, "up_proj"): (4.0, "3inst"), (2, "down_proj"): (3.5, "mul1"),
    (3, "gate_proj"): (2.0, "mcg"), (3, "up_proj"): (2.0, "mcg"), (3, "down_proj"): (3.0, "mul1"),
}


def prefix(e: int, p: str) -> str:
    return f"model.layers.{LAYER}.mlp.experts.{e}.{p}"


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    jobs: dict[tuple[float, str], list[tuple[int, str]]] = {}
    for key, q in QUANT.items():
        jobs.setdefault(q, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for (bits, cb), keys in sorted(jobs.items()):
        ws = []
        for e, p in keys:
            shape = (HIDDEN, WIDTH) if p != "down_proj" else (WIDTH, HIDDEN)
            ws.append(torch.randn(shape, generator=torch.Generator().manual_seed(e * 3 + PROJECTIONS.index(p))) * 0.05)
        for (e, p), parts in zip(keys, encode_weights(ws, bits, cb, seed=e)):
            out.update({f"{prefix(e, p)}.{k}": v for k, v in parts.items()})
    return out


@pytest.fixture(scope="module")
def packed(tensors):
    return pack_layer_experts(tensors, LAYER, N_EXPERTS)


_FULL: dict[tuple[int, int, str], torch.Tensor] = {}


def full(tensors, e: int, p: str) -> torch.Tensor:
    """The whole group's decode (memoized per tensors mapping)."""
    key = (id(tensors), e, p)
    if key not in _FULL:
        _FULL[key] = decode_weight(read_group(tensors, prefix(e, p)))
    return _FULL[key]


def test_table_slots_tile_each_block_without_gaps(packed) -> None:
    assert packed.blocks == (0, 1, 2, 3) and packed.hidden == HIDDEN and packed.intermediate == WIDTH
    slots = sorted(packed.table.values(), key=lambda s: s.offset)
    assert len(slots) == N_EXPERTS * 3
    pos = 0
    for s in slots:
        assert (s.bits, s.codebook) == QUANT[(s.expert, s.projection)]
        assert s.offset == pos and s.words == (HIDDEN // 16) * 8 * int(16 * s.bits)
        pos += s.words
    assert pos == packed.block_words
    # projection-major, then (K, codebook, expert) inside a projection
    order = [(PROJECTIONS.index(s.projection), s.bits, s.codebook, s.expert) for s in slots]
    assert order == sorted(order)


def test_width_groups_are_runs_of_equal_slots(packed) -> None:
    seen = set()
    for g in packed.groups:
        for i, e in enumerate(g.experts):
            slot = packed.table[(e, g.projection)]
            assert (slot.bits, slot.codebook, slot.words) == (g.bits, g.codebook, g.words)
            assert slot.offset == g.offset + i * g.words
            seen.add((e, g.projection))
    assert seen == set(QUANT)
    gate_groups = [(g.bits, g.codebook, g.experts) for g in packed.groups if g.projection == "gate_proj"]
    assert gate_groups == [(2.0, "3inst", (2,)), (2.0, "mcg", (0, 3)), (3.0, "3inst", (1,))]
    assert packed.experts_by_bits("gate_proj") == {2.0: (2, 0, 3), 3.0: (1,)}
    assert packed.experts_by_bits("down_proj") == {3.0: (1, 0, 3), 3.5: (2,)}


def test_sizes(packed, tensors) -> None:
    trellis_bytes = sum(t.numel() * 2 for k, t in tensors.items() if k.endswith(".trellis"))
    assert packed.trellis.numel() * 2 == trellis_bytes  # no padding
    assert sum(packed.bytes_by_bits().values()) == trellis_bytes
    assert packed.bytes_by_bits()[2.0] == sum(
        tensors[f"{prefix(e, p)}.trellis"].numel() * 2 for (e, p), (k, _) in QUANT.items() if k == 2.0
    )
    sign_bytes = sum(t.numel() * 2 for k, t in tensors.items() if k.endswith((".suh", ".svh")))
    assert packed.nbytes == trellis_bytes + sign_bytes
    assert packed.block_scales.numel() == 4 * BLOCK * N_EXPERTS * 3
    assert packed.shared_scales.numel() == HIDDEN * N_EXPERTS * 3


def test_packed_decode_equals_the_original_groups_bitwise(packed, tensors) -> None:
    for e, p in QUANT:
        assert torch.equal(packed.weight(e, p, torch.float16).view(torch.int16), full(tensors, e, p).view(torch.int16))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_rank_block_subsets(packed, tensors, ranks: int) -> None:
    n = packed.n_blocks_total
    splits = [list(range(r * n // ranks, (r + 1) * n // ranks)) for r in range(ranks)]
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(ranks))
    total = torch.zeros(3, HIDDEN)
    for blocks in splits:
        sub = packed.take_blocks(blocks)
        assert sub.blocks == tuple(blocks)
        assert sub.trellis.numel() == len(blocks) * packed.block_words
        # consecutive blocks are one slice of the layer's buffer
        start = packed.trellis.data_ptr() + blocks[0] * packed.block_words * 2
        assert sub.trellis.data_ptr() == start
        cols = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks])
        for e, p in QUANT:
            w = sub.weight(e, p, torch.float16)
            ref = full(tensors, e, p)
            ref = ref[:, cols] if p != "down_proj" else ref[cols]
            assert torch.equal(w.view(torch.int16), ref.view(torch.int16)), (blocks, e, p)
        total += expert_forward(sub, 1, x)
    torch.testing.assert_close(total, expert_forward(packed, 1, x), rtol=1e-5, atol=1e-6)


def test_packing_only_some_blocks_equals_taking_them(tensors, packed) -> None:
    direct = pack_layer_experts(tensors, LAYER, N_EXPERTS, blocks=[3, 1])
    taken = packed.take_blocks([1, 3])
    assert direct.blocks == taken.blocks == (1, 3)
    assert torch.equal(direct.trellis, taken.trellis) and torch.equal(direct.block_scales, taken.block_scales)


def test_expert_forward_is_decode_then_matmul(packed, tensors) -> None:
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    g, u, d = (full(tensors, 2, p).float() for p in PROJECTIONS)
    assert torch.equal(expert_forward(packed, 2, x), (F.silu(x @ g) * (x @ u)) @ d)
    assert packed.weight(2, "gate_proj", torch.float32) is packed.weight(2, "gate_proj", torch.float32)  # cached


def test_experts_forward_routes_and_weights(packed) -> None:
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 2], [1, 0]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    out = experts_forward(packed, x, ids, w)
    for t in range(5):
        ref = sum(w[t, k] * expert_forward(packed, int(ids[t, k]), x[t : t + 1])[0] for k in range(2))
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-6)


def test_refusals(tensors, packed) -> None:
    bad = dict(tensors)
    bad[f"{prefix(1, 'gate_proj')}.trellis"] = bad[f"{prefix(1, 'gate_proj')}.trellis"][:, :16]
    bad[f"{prefix(1, 'gate_proj')}.svh"] = bad[f"{prefix(1, 'gate_proj')}.svh"][:256]
    with pytest.raises(Exl3Error, match=r"experts\.1\.gate_proj: shape \[128, 256\] differs"):
        pack_layer_experts(bad, LAYER, N_EXPERTS)
    with pytest.raises(ValueError, match="outside"):
        pack_layer_experts(tensors, LAYER, N_EXPERTS, blocks=[4])
    with pytest.raises(ValueError, match="not held"):
        packed.take_blocks([0]).take_blocks([1])
    with pytest.raises(Exl3Error, match="missing"):
        pack_layer_experts(tensors, LAYER, N_EXPERTS + 1)
