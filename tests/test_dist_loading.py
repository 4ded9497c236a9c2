"""What one rank of R loads and caches, in one process (no collectives needed):

- the weights loader at R > 1 reads exactly the bytes glm53.layout plans for the rank
  (`ModelWeights.bytes_read == plan.bytes_per_rank()[rank]`), EXL3 experts included, and what it
  builds equals the matching slice of the world-1 load (the rank's heads, 128-column expert blocks
  with the rotation over 3 ranks, vocabulary rows);
- DcpKVState stores and reads back only the rank's positions, and glm53.layout.kv counts exactly
  the bytes KVState allocates, bf16 and fp8 (KVState is the truth).
"""
from __future__ import annotations

import pytest
import torch

from glm53.config import Glm53Config
from glm53.dist import dcp, tp
from glm53.dist.dcp_state import DcpKVState
from glm53.dist.rank_plan import DistRankPlan
from glm53.model.kv_state import KVState
from glm53.layout.kv import kv_bytes_per_rank, kv_token_bytes
from glm53.layout.plan import plan_layout
from glm53.loading.loader import load_weights
from tests.fixtures_tiny import tiny_dirs  # noqa: F401


@pytest.fixture(scope="module")
def world_one_weights(tiny_dirs):  # noqa: F811
    cfg = Glm53Config.from_dir(tiny_dirs.model)
    return cfg, load_weights(tiny_dirs.model, cfg, dtype=torch.float32, progress=lambda m: None)


@pytest.mark.parametrize("R", [2, 3, 4])
def test_each_rank_reads_only_its_planned_slices(tiny_dirs, world_one_weights, R: int) -> None:  # noqa: F811
    cfg, full = world_one_weights
    planned = plan_layout(tiny_dirs.model, R, cfg).bytes_per_rank()
    assert full.bytes_read is None  # world 1 reads whole tensors (not counted)
    moe_layer = next(i for i, layer in enumerate(full.layers) if hasattr(layer.ffn, "experts"))
    for rank in range(R):
        plan = DistRankPlan(world=R, rank=rank, vocab_size=cfg.vocab_size)  # slicing needs no Comm
        w = load_weights(tiny_dirs.model, cfg, plan=plan, dtype=torch.float32, progress=lambda m: None)
        assert w.bytes_read == planned[rank], f"R={R} rank {rank}: read {w.bytes_read}, plan says {planned[rank]}"
        assert w.bytes_read < sum(planned) / R * 1.5  # and that is a share, not the checkpoint
        h0, h1 = tp.head_ranges(cfg.num_attention_heads, R)[rank]
        q = cfg.qk_head_dim
        assert torch.equal(w.layers[0].attn.q_b, full.layers[0].attn.q_b[h0 * q:h1 * q])
        assert torch.equal(w.layers[0].attn.o, full.layers[0].attn.o[:, h0 * cfg.v_head_dim:h1 * cfg.v_head_dim])
        v0, v1 = tp.vocab_ranges(cfg.vocab_size, R)[rank]
        assert torch.equal(w.embed, full.embed[v0:v1])
        c0, c1 = tp.column_ranges(cfg.moe_intermediate_size, R, moe_layer)[rank]
        got, ref = w.layers[moe_layer].ffn.experts, full.layers[moe_layer].ffn.experts
        # the rank's packed experts are the whole experts' tiles and sign vectors of its 128-column blocks
        for e in range(cfg.n_routed_experts):
            for m0, down in ((got.mats.gate0, False), (got.mats.up0, False), (got.mats.down0, True)):
                r0 = {got.mats.gate0: ref.mats.gate0, got.mats.up0: ref.mats.up0, got.mats.down0: ref.mats.down0}[m0]
                mine, whole = got.bank.trellis(m0 + e), ref.bank.trellis(r0 + e)
                (suh, svh), (ref_suh, ref_svh) = got.bank.sign_vectors(m0 + e), ref.bank.sign_vectors(r0 + e)
                if down:
                    assert torch.equal(mine, whole[c0 // 16:c1 // 16]) and torch.equal(suh, ref_suh[c0:c1])
                    assert torch.equal(svh, ref_svh)
                else:
                    assert torch.equal(mine, whole[:, c0 // 16:c1 // 16]) and torch.equal(svh, ref_svh[c0:c1])
                    assert torch.equal(suh, ref_suh)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp32"])
def test_dcp_state_holds_and_reads_only_owned_rows(kv_dtype: str) -> None:
    R, n, dim = 3, 10, 8
    rows = torch.randn(n, dim)
    whole = KVState(n_layers=1, latent_dim=dim, index_dim=4, indexed_layers=frozenset(), kv_dtype=kv_dtype)
    whole.reserve(n)
    whole.write_latent(0, 0, rows[:4])
    whole.write_latent(0, 4, rows[4:])
    for r in range(R):
        s = DcpKVState(n_layers=1, latent_dim=dim, index_dim=4, indexed_layers=frozenset(), kv_dtype=kv_dtype,
                       own=dcp.Ownership(r, R))
        s.reserve(n)
        s.write_latent(0, 0, rows[:4])  # a chunk start that is not a multiple of R next
        s.write_latent(0, 4, rows[4:])
        positions = s.owned_positions(n)
        assert torch.equal(positions, torch.arange(r, n, R))
        got = s.read_latent(0, n, torch.float32)
        assert got.shape == (positions.numel(), dim)  # owned rows only, never a full-length tensor
        assert torch.equal(got, whole.read_latent(0, n, torch.float32)[positions])


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp32"])
def test_layout_kv_bytes_equal_what_kv_state_allocates(tiny_dirs, kv_dtype: str) -> None:  # noqa: F811
    cfg = Glm53Config.from_dir(tiny_dirs.model)
    indexed = frozenset(i for i in range(cfg.num_hidden_layers) if cfg.indexer_is_full(i))
    tokens, R = 1031, 4
    # fp32 caches (the CPU tests') are no serving format: the plan refuses them, the KV pool counts them
    formula = kv_bytes_per_rank(cfg, tokens, R, kv_dtype=kv_dtype, include_mtp=False) if kv_dtype != "fp32" else None
    for rank in range(R):
        own = dcp.Ownership(rank, R)
        state = KVState(n_layers=cfg.num_hidden_layers, latent_dim=cfg.latent_dim, index_dim=cfg.index_head_dim,
                        indexed_layers=indexed, kv_dtype=kv_dtype)
        state.reserve(own.count(tokens))
        tensors = [*state.latent, *state.latent_scale, *state.index_keys.values(), *state.index_scale.values()]
        allocated = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        assert allocated == own.count(tokens) * state.bytes_per_position()
        assert formula is None or allocated == formula[rank]
    if formula is not None:
        assert kv_token_bytes(cfg, kv_dtype, include_mtp=False).latent == (
            cfg.latent_dim * (2 if kv_dtype == "bf16" else 1) + (4 if kv_dtype == "fp8" else 0))
