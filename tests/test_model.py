"""Units of the forward, each against an independent statement of what it must compute."""
from __future__ import annotations

import pytest
import torch

from glm53.config import Glm53Config
from glm53.model.kv_state import KVState, quantize_rows
from glm53.model.indexer import Selection, select_topk
from glm53.model.mla import AttentionWeights, attend, attend_expanded
from glm53.model.moe import RouterWeights, route
from glm53.model.rope import apply_rope, inverse_frequencies, rope_angles
from tests.fixtures_tiny import tiny_dirs  # noqa: F401


def test_rope_matches_reference_interleaved_rotation() -> None:
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    cfg = Glm53Config(qk_rope_head_dim=16, rope_theta=10000.0)
    positions = torch.tensor([0, 1, 7, 1000, 65535])
    cos, sin = rope_angles(inverse_frequencies(cfg), positions, torch.float32)
    q = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    ref, _ = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], q.transpose(0, 1)[None], full_cos[None], full_sin[None])
    assert torch.equal(apply_rope(q, cos, sin), ref[0].transpose(0, 1))
    # the rotation is a rotation: pair norms are kept, and position 0 is the identity (in our layout)
    assert torch.allclose(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_topk_selection_breaks_ties_toward_lower_positions() -> None:
    inf = float("inf")
    scores = torch.tensor([
        [0.5, 0.0, 0.0, 0.0, 0.9, -inf],  # k=3: 0.9, 0.5, then the first of the tied zeros
        [0.1, 0.2, -inf, -inf, -inf, -inf],  # fewer finite than k: all finite ones, no future ones
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all tied: the three lowest positions
    ])
    got = select_topk(scores, 3).mask(6)
    assert got.tolist() == [
        [True, True, False, False, True, False],
        [True, True, False, False, False, False],
        [True, True, True, False, False, False],
    ]


def _attention_weights(seed: int) -> AttentionWeights:
    g = torch.Generator().manual_seed(seed)
    H, nope, rope, v, r, hidden = 4, 8, 4, 6, 10, 12
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return AttentionWeights(q_a=randn(5, hidden), q_a_norm=randn(5), q_b=randn(H * (nope + rope), 5),
                            kv_a=randn(r + rope, hidden), kv_a_norm=randn(r), kv_b=randn(H * (nope + v), r),
                            o=randn(hidden, H * v), n_heads=H, nope=nope, rope=rope, v_dim=v, kv_rank=r,
                            scale=(nope + rope) ** -0.5)


def test_absorbed_attention_equals_expanded_attention() -> None:
    w = _attention_weights(1)
    g = torch.Generator().manual_seed(2)
    q_nope = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    q_rot = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    cached = torch.randn(9, 14, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 9, generator=g) > 0.4
    mask[2] = False  # a query with nothing to attend (a context-parallel rank without positions)
    out_e, lse_e = attend_expanded(w, q_nope, q_rot, cached, mask)
    out_a, lse_a = attend(w, q_nope, q_rot, cached, Selection.from_mask(mask, 9))
    assert torch.allclose(out_e, out_a, atol=1e-10) and torch.allclose(lse_e[:2], lse_a[:2], atol=1e-10)
    assert torch.equal(out_e[2], torch.zeros_like(out_e[2])) and torch.isneginf(lse_a[2]).all()
    assert not torch.isnan(out_a).any()


def test_router_matches_reference_with_groups() -> None:
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    hf = GlmMoeDsaConfig(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=1)
    ref = GlmMoeDsaTopkRouter(hf)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 16, generator=g))
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    x = torch.randn(7, 16, generator=g)
    _, ref_w, ref_ids = ref(x)
    ours = RouterWeights(weight=ref.weight.detach(), bias=ref.e_score_correction_bias, top_k=4, n_group=4,
                         topk_group=2, norm_topk_prob=True, scaling=2.5)
    ids, w = route(ours, x)
    for t in range(7):  # same experts with the same weights (topk order is unspecified)
        mine = dict(zip(ids[t].tolist(), w[t].tolist()))
        theirs = dict(zip(ref_ids[t].tolist(), ref_w[t].detach().tolist()))
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[e] - theirs[e]) < 1e-6 for e in mine)


def test_fp32_products_keep_bf16_weights_as_stored_with_the_fp32_values(tiny_dirs) -> None:  # noqa: F811
    """The router's and the indexer's head weights stay bf16 when the checkpoint stores bf16 and the
    model computes in bf16 (so that CUDA runs their fp32 products on the tensor cores:
    ops.linear_fp32), fp32 in an fp32 model; the CPU's product is the fp32 one of the same values,
    whatever the activations' dtype."""
    from glm53 import ops
    from glm53.runtime.engine import Glm53Engine
    from glm53.ops import torch_ops

    engine = Glm53Engine(tiny_dirs.model, device="cpu", dtype="bf16", kv_dtype="bf16")
    layers = engine.model.w.layers
    indexers = [layer.indexer for layer in layers if layer.indexer is not None]
    routers = [layer.ffn.router for layer in layers if hasattr(layer.ffn, "router")]
    assert indexers and routers, "the tiny checkpoint has indexer and MoE layers"
    assert {i.weights_proj.dtype for i in indexers} == {r.weight.dtype for r in routers} == {torch.bfloat16}
    fp32_layers = Glm53Engine(tiny_dirs.model, device="cpu", dtype="fp32", kv_dtype="fp32").model.w.layers
    assert {layer.indexer.weights_proj.dtype for layer in fp32_layers if layer.indexer is not None} == {torch.float32}
    g = torch.Generator().manual_seed(4)
    w = indexers[0].weights_proj
    for x in (torch.randn(5, w.shape[1], generator=g).to(torch.bfloat16), torch.randn(5, w.shape[1], generator=g)):
        got = ops.linear_fp32(x, w)
        assert got.dtype == torch.float32
        assert torch.equal(got, torch_ops.linear(x.float(), w.float()))


def test_fp8_rows_have_one_scale_per_row_and_round_trip() -> None:
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(5, 576, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    q, scale = quantize_rows(rows)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    back = q.to(torch.float32) * scale[:, None]
    assert torch.equal(back[3], torch.zeros(576))
    rel = (back - rows).abs().amax(dim=1) / rows.abs().amax(dim=1).clamp_min(1e-30)
    assert (rel[[0, 1, 2, 4]] <= 2 ** -4).all()  # e4m3: 3 mantissa bits


def test_kv_state_export_import_is_bitwise_and_checked() -> None:
    def state() -> KVState:
        return KVState(n_layers=2, latent_dim=8, index_dim=4, indexed_layers=frozenset({0}), kv_dtype="fp8")

    a = state()
    a.reserve(10)
    g = torch.Generator().manual_seed(5)
    for layer in (0, 1):
        a.write_latent(layer, 0, torch.randn(10, 8, generator=g))
    a.write_index(0, 0, torch.randn(10, 4, generator=g))
    a.tokens.extend(range(10))
    a.frontier = 10
    b = state()
    b.import_rows(0, {k: v.clone() for k, v in a.export_rows(0, 6).items()}, list(range(6)))
    assert b.length == 6 and b.frontier == 6
    for name, t in b.export_rows(0, 6).items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           a.export_rows(0, 6)[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else a.export_rows(0, 6)[name])
    bad = a.export_rows(6, 10)
    bad.pop("index.0")
    try:
        b.import_rows(6, bad, list(range(6, 10)))
    except ValueError as exc:
        assert "index.0" in str(exc)
    else:
        raise AssertionError("import_rows accepted rows missing index.0")
    a.truncate(4)
    assert a.length == 4 and a.frontier == 4


def test_position_bytes_are_what_export_rows_gives_a_position() -> None:
    for kv_dtype in ("fp8", "bf16", "fp32"):
        s = KVState(n_layers=3, latent_dim=8, index_dim=4, indexed_layers=frozenset({0, 2}), kv_dtype=kv_dtype)
        s.reserve(5)
        for layer in range(3):
            s.write_latent(layer, 0, torch.randn(5, 8))
        for layer in (0, 2):
            s.write_index(layer, 0, torch.randn(5, 4))
        s.tokens.extend(range(5))
        rows = s.export_rows(1, 4)
        assert s.position_bytes() * 3 == sum(t.numel() * t.element_size() for t in rows.values()), kv_dtype


@pytest.mark.parametrize("kv_dtype,dcp", [("bf16", False), ("fp8", False), ("fp32", True)])
def test_stacked_rows_land_in_one_copy_per_kind_exactly_as_tensor_by_tensor(monkeypatch, kv_dtype, dcp) -> None:
    """A node read into one buffer (diskfile.plan / pack / views: StackedRows) is imported as one
    strided copy per kind; the result equals importing the same rows tensor by tensor, bit for
    bit. A stack in another order (a file written before layer_order: "latent.10" before
    "latent.2") takes the tensor-by-tensor path; a bad stack is refused with nothing written."""
    from glm53.dist.dcp import Ownership
    from glm53.dist.dcp_state import DcpKVState
    from kv_cache import diskfile
    from kv_cache.rows import StackedRows

    def state() -> KVState:
        kw = dict(n_layers=12, latent_dim=8, index_dim=4, indexed_layers=frozenset({0, 3, 10, 11}), kv_dtype=kv_dtype)
        return DcpKVState(**kw, own=Ownership(1, 2)) if dcp else KVState(**kw)

    src = state()
    src.reserve(64)
    g = torch.Generator().manual_seed(9)
    for layer in range(12):
        src.write_latent(layer, 0, torch.randn(64, 8, generator=g))
    for layer in src.index_keys:
        src.write_index(layer, 0, torch.randn(64, 4, generator=g))
    src.tokens.extend(range(64))
    first, block = src.export_rows(0, 16), src.export_rows(16, 48)  # import [16, 40): the block is longer
    runs, size = diskfile.plan(block)
    buf = torch.empty(size, dtype=torch.uint8)
    diskfile.pack(block, runs, buf)
    stacked = diskfile.views(runs, buf)
    assert {len(names) for names, _ in stacked.stacks} == {12, 4}  # one run per kind, layers in order
    lexical = StackedRows(stacked)  # the latents stacked in plain sorted-name order
    names = tuple(sorted(n for n in block if n.startswith("latent.")))
    lexical.stacks = ((names, torch.stack([block[n] for n in names])),)

    copies: list[int] = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, s: copies.append(len(dst)) or real(dst, s))
    got = {}
    for arm, rows in (("stacked", stacked), ("plain", {k: v.clone() for k, v in block.items()}), ("lexical", lexical)):
        s = state()
        s.import_rows(0, {k: v.clone() for k, v in first.items()}, list(range(16)))
        s.import_rows(16, rows, list(range(16, 40)))
        got[arm] = s.export_rows(0, 40)
    kinds = 4 if kv_dtype == "fp8" else 2
    tensors = len(block)
    assert copies == [tensors, kinds, tensors, tensors, tensors, tensors]  # lexical: no stack matches
    want = src.export_rows(0, 40)
    for arm, rows in got.items():
        assert all(torch.equal(rows[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want), arm
    s = state()
    s.import_rows(0, {k: v.clone() for k, v in first.items()}, list(range(16)))
    before = s.stacks["latent"].clone()
    bad = StackedRows(stacked)
    bad.stacks = tuple((n, t.view(torch.uint8) if n[0].startswith("latent.") else t) for n, t in stacked.stacks)
    with pytest.raises(ValueError, match="latent.0..latent.11"):
        s.import_rows(16, bad, list(range(16, 40)))
    assert s.length == 16 and torch.equal(s.stacks["latent"], before)
    assert all(s.latent[i].data_ptr() == s.stacks["latent"][i].data_ptr() for i in range(12))
