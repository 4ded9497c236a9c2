"""Load a GLM-5.3 checkpoint (safetensors shards) into `ModelWeights` for one rank.

Tensor names are the Hugging Face ones (`model.layers.{i}.self_attn.q_a_proj.weight`, ...). Routed
experts are either plain (`...experts.{e}.gate_proj.weight`) or EXL3 (`...experts.{e}.gate_proj.trellis`
+ suh/svh/...), each expert and projection with its own width; EXL3 ones are decoded once here, with
glm53.exl3, into dense matrices in the compute dtype. Every slice a rank owns comes from its
`RankPlan` (heads, intermediate columns, vocabulary rows), read with safetensors' lazy slices.
The MTP layer, when present, is stored as layer `num_hidden_layers`.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from glm53.config import Glm53Config
from glm53.model.indexer import IndexerWeights
from glm53.model.mla import AttentionWeights
from glm53.model.moe import DecodedExperts, MLPWeights, MoEWeights, RouterWeights
from glm53.model.parallel import RankPlan
from glm53.model.transformer import LayerWeights, ModelWeights, MtpWeights


class CheckpointError(ValueError):
    """A checkpoint the kit cannot load; the message names the file or tensor and the remedy."""


class TensorFiles:
    """Name -> (file) map over a folder's safetensors shards, opened lazily, read by slices."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.where: dict[str, Path] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc}); re-download it") from None
            for name, file in weight_map.items():
                self.where[name] = self.dir / file
            missing = sorted({p for p in self.where.values() if not p.exists()})
            if missing:
                raise CheckpointError(f"{index}: names shard {missing[0].name}, which is not in {self.dir}; fetch it")
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            for shard in shards:
                for name in self._open(shard).keys():
                    self.where[name] = shard
        self._handles: dict[Path, object] = {}
        self._stack = ExitStack()

    def _open(self, path: Path):  # noqa: ANN202 - safetensors' handle type is private
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read as safetensors ({exc}); the shard may be truncated or an LFS pointer") from None

    def handle(self, name: str):  # noqa: ANN201
        path = self.where[name]
        if path not in self._handles:
            self._handles[path] = self._open(path)
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> list[int]:
        return list(self.handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self.where:
            return None
        return self.handle(name).get_tensor(name)

    def need(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise CheckpointError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return t

    def rows(self, name: str, rows: range) -> torch.Tensor:
        """Rows [rows.start, rows.stop) of a 2-D tensor (or the whole tensor when it is all of them)."""
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return self.handle(name).get_slice(name)[rows.start:rows.stop]

    def cols(self, name: str, cols: range) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return self.handle(name).get_slice(name)[:, cols.start:cols.stop]


class RankTensorFiles(TensorFiles):
    """TensorFiles for one rank of R: every read returns the rank's slice as glm53.layout plans it,
    read with positioned reads of exactly those bytes (`bytes_read` counts them), EXL3 experts
    included (their tiles, sign vectors and codebook markers of the rank's 128-column blocks).

    `rows` / `cols` check that the slice the model asks for (from its RankPlan) is the plan's."""

    def __init__(self, model_dir: str | Path, cfg: Glm53Config, ranks: int, rank: int) -> None:
        super().__init__(model_dir)
        from glm53.layout.plan import plan_layout
        from glm53.layout.slices import SliceReader

        self.layout = plan_layout(model_dir, ranks, cfg)
        self.slices = self.layout.slices(rank)
        self.reader = SliceReader()
        self.rank = rank

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self.where:
            return None
        return self.reader.read(self.layout.tensors[name], self.layout.locations[name], self.slices[name])

    def rows(self, name: str, rows: range) -> torch.Tensor:
        return self._planned(name, 0, rows)

    def cols(self, name: str, cols: range) -> torch.Tensor:
        return self._planned(name, 1, cols)

    def _planned(self, name: str, dim: int, want: range) -> torch.Tensor:
        t = self.need(name)
        spec = self.slices[name]
        got = range(0, t.shape[dim]) if spec is None else range(spec.start, spec.stop)
        if spec is not None and spec.dim != dim or (got.start, got.stop) != (want.start, want.stop):
            raise CheckpointError(f"{self.where[name]}: {name}: rank {self.rank} needs [{want.start}, {want.stop}) of dim "
                                  f"{dim} but the layout plan reads {spec}; glm53.layout and the RankPlan disagree")
        return t

    def close(self) -> None:
        self.reader.close()


def _head_rows(heads: range, per_head: int) -> range:
    return range(heads.start * per_head, heads.stop * per_head)


class _Loader:
    def __init__(self, cfg: Glm53Config, files: TensorFiles, plan: RankPlan, dtype: torch.dtype,
                 device: torch.device, progress: Callable[[str], None] | None) -> None:
        self.cfg, self.f, self.plan, self.dtype, self.device = cfg, files, plan, dtype, device
        self.progress = progress

    def t(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return x.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def fp32_product_weight(self, x: torch.Tensor) -> torch.Tensor:
        """A weight of an fp32 product (router, indexer head weights): bf16 as stored when the model
        computes in bf16 (every value exact in fp32, and ops.linear_fp32 then runs on the tensor
        cores), else fp32 (what an fp32 model's product takes: converted once here, not per call)."""
        keep = x.dtype == torch.bfloat16 and self.dtype == torch.bfloat16
        return self.t(x, torch.bfloat16 if keep else torch.float32)

    def attention(self, p: str) -> AttentionWeights:
        c, f = self.cfg, self.f
        heads = self.plan.head_range(c.num_attention_heads)
        return AttentionWeights(
            q_a=self.t(f.need(f"{p}.q_a_proj.weight")), q_a_norm=self.t(f.need(f"{p}.q_a_layernorm.weight")),
            q_b=self.t(f.rows(f"{p}.q_b_proj.weight", _head_rows(heads, c.qk_head_dim))),
            kv_a=self.t(f.need(f"{p}.kv_a_proj_with_mqa.weight")),
            kv_a_norm=self.t(f.need(f"{p}.kv_a_layernorm.weight")),
            kv_b=self.t(f.rows(f"{p}.kv_b_proj.weight", _head_rows(heads, c.qk_nope_head_dim + c.v_head_dim))),
            o=self.t(f.cols(f"{p}.o_proj.weight", _head_rows(heads, c.v_head_dim))),
            n_heads=len(heads), nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim, v_dim=c.v_head_dim,
            kv_rank=c.kv_lora_rank, scale=c.qk_head_dim ** -0.5,
        )

    def indexer(self, p: str) -> IndexerWeights:
        c, f = self.cfg, self.f
        return IndexerWeights(
            wq_b=self.t(f.need(f"{p}.wq_b.weight")), wk=self.t(f.need(f"{p}.wk.weight")),
            k_norm_weight=self.t(f.need(f"{p}.k_norm.weight")), k_norm_bias=self.t(f.need(f"{p}.k_norm.bias")),
            weights_proj=self.fp32_product_weight(f.need(f"{p}.weights_proj.weight")),
            n_heads=c.index_n_heads, head_dim=c.index_head_dim, rope_dim=c.qk_rope_head_dim,
        )

    def mlp(self, p: str, layer: int, width: int) -> MLPWeights:
        cols = self.plan.ffn_columns(layer, width)
        return MLPWeights(gate=self.t(self.f.rows(f"{p}.gate_proj.weight", cols)),
                          up=self.t(self.f.rows(f"{p}.up_proj.weight", cols)),
                          down=self.t(self.f.cols(f"{p}.down_proj.weight", cols)))

    def expert_part(self, p: str, cols: range, down: bool) -> torch.Tensor:
        """This rank's part of one expert projection, [out, in] in the compute dtype: rows `cols` of
        gate/up, columns `cols` of down. Plain weights are read sliced; an EXL3 group is decoded from
        what the files give (the whole group at world 1, the rank's 128-column blocks at R > 1)."""
        if f"{p}.weight" in self.f:
            return self.t(self.f.cols(f"{p}.weight", cols) if down else self.f.rows(f"{p}.weight", cols))
        w = self.expert_matrix(p)
        if down and w.shape[1] != len(cols):
            w = w[:, cols.start:cols.stop]
        elif not down and w.shape[0] != len(cols):
            w = w[cols.start:cols.stop]
        return w

    def expert_matrix(self, p: str) -> torch.Tensor:
        """One expert projection as [out, in] in the compute dtype, whatever its storage."""
        if f"{p}.weight" in self.f:
            return self.t(self.f.need(f"{p}.weight"))
        if f"{p}.trellis" in self.f:
            from glm53.exl3.decode import decode_weight
            from glm53.exl3.format import Exl3Error, read_group

            try:
                group = read_group(self.f.get, p)
                if group.bias is not None:
                    raise Exl3Error(f"{p}.bias: GLM-5.3 experts carry no bias; this pack is not a GLM-5.3 pack")
                w = decode_weight(group, self.device)
            except Exl3Error as exc:
                raise CheckpointError(str(exc)) from None
            return w.T.to(self.dtype).contiguous()
        raise CheckpointError(f"{self.f.dir}: expert projection {p} has neither .weight nor .trellis")

    def moe(self, p: str, layer: int) -> MoEWeights:
        c = self.cfg
        cols = self.plan.ffn_columns(layer, c.moe_intermediate_size)
        gate_up, down = [], []
        for e in range(c.n_routed_experts):
            ep = f"{p}.experts.{e}"
            g = self.expert_part(f"{ep}.gate_proj", cols, down=False)
            u = self.expert_part(f"{ep}.up_proj", cols, down=False)
            gate_up.append(torch.cat([g, u], 0))
            down.append(self.expert_part(f"{ep}.down_proj", cols, down=True))
        router = RouterWeights(
            weight=self.fp32_product_weight(self.f.need(f"{p}.gate.weight")),
            bias=self.t(self.f.need(f"{p}.gate.e_score_correction_bias"), torch.float32),
            top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor,
        )
        shared = None
        if c.n_shared_experts > 0:
            shared = self.mlp(f"{p}.shared_experts", layer, c.moe_intermediate_size * c.n_shared_experts)
        return MoEWeights(router=router, experts=DecodedExperts(torch.stack(gate_up), torch.stack(down)), shared=shared)

    def layer(self, i: int, sparse: bool, indexed: bool) -> LayerWeights:
        p = f"model.layers.{i}"
        ffn = self.moe(f"{p}.mlp", i) if sparse else self.mlp(f"{p}.mlp", i, self.cfg.intermediate_size)
        return LayerWeights(
            index=i, input_norm=self.t(self.f.need(f"{p}.input_layernorm.weight")),
            post_norm=self.t(self.f.need(f"{p}.post_attention_layernorm.weight")),
            attn=self.attention(f"{p}.self_attn"),
            indexer=self.indexer(f"{p}.self_attn.indexer") if indexed else None, ffn=ffn,
        )

    def vocab(self, name: str) -> torch.Tensor:
        return self.t(self.f.rows(name, self.plan.vocab_range(self.cfg.vocab_size)))


def mtp_present(cfg: Glm53Config, names: set[str]) -> bool:
    return cfg.num_nextn_predict_layers > 0 and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in names


def load_weights(model_dir: str | Path, cfg: Glm53Config | None = None, *, plan: RankPlan | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", with_mtp: bool = True,
                 progress: Callable[[str], None] | None = None) -> ModelWeights:
    cfg = cfg or Glm53Config.from_dir(model_dir)
    plan = plan or RankPlan()
    # R > 1: read only this rank's slices (glm53.layout), counted; world 1 reads whole tensors
    files = TensorFiles(model_dir) if plan.world == 1 else RankTensorFiles(model_dir, cfg, plan.world, plan.rank)
    try:
        weights = _load(cfg, files, plan, dtype, torch.device(device), with_mtp, progress)
    finally:
        if isinstance(files, RankTensorFiles):
            files.close()
    weights.bytes_read = files.bytes_read if isinstance(files, RankTensorFiles) else None
    return weights


def _load(cfg: Glm53Config, files: TensorFiles, plan: RankPlan, dtype: torch.dtype, device: torch.device,
          with_mtp: bool, progress: Callable[[str], None] | None) -> ModelWeights:
    ld = _Loader(cfg, files, plan, dtype, device, progress)
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    layers = []
    for i in range(cfg.num_hidden_layers):
        layers.append(ld.layer(i, cfg.is_moe_layer(i), cfg.indexer_is_full(i)))
        say(f"glm53: loaded layer {i + 1}/{cfg.num_hidden_layers}")
    head_name = "lm_head.weight" if not cfg.tie_word_embeddings else "model.embed_tokens.weight"
    weights = ModelWeights(embed=ld.vocab("model.embed_tokens.weight"), layers=layers,
                           final_norm=ld.t(files.need("model.norm.weight")), head=ld.vocab(head_name))
    names = files.names()
    if with_mtp and mtp_present(cfg, names):
        n = cfg.num_hidden_layers
        p = f"model.layers.{n}"
        layer = ld.layer(n, f"{p}.mlp.gate.weight" in names, f"{p}.self_attn.indexer.wk.weight" in names)
        layer.index = 0  # its own one-layer cache
        weights.mtp = MtpWeights(
            enorm=ld.t(files.need(f"{p}.enorm.weight")), hnorm=ld.t(files.need(f"{p}.hnorm.weight")),
            eh_proj=ld.t(files.need(f"{p}.eh_proj.weight")), layer=layer,
            head_norm=ld.t(files.need(f"{p}.shared_head.norm.weight")),
            head=ld.vocab(f"{p}.shared_head.head.weight") if f"{p}.shared_head.head.weight" in names else None,
            embed=ld.vocab(f"{p}.embed_tokens.weight") if f"{p}.embed_tokens.weight" in names else None,
        )
        say("glm53: loaded the MTP layer")
    return weights


# ---- check: refuse what cannot be served, from headers only (no tensor data is read) -----------
def check_checkpoint(model_dir: str | Path) -> None:
    """Raise ConfigError / CheckpointError naming the file and field or tensor for anything this
    family cannot serve; return None when the checkpoint looks servable. Reads headers only; the
    rule is glm53/checkpoint_rules.py, the one fetch_weights.sh applies too."""
    from glm53.checkpoint_rules import first_refusal

    cfg = Glm53Config.from_dir(model_dir)
    files = TensorFiles(model_dir)  # the loader's own reading of the index: the same refusals
    refusal = first_refusal(cfg, files.where, files.dir)
    if refusal is not None:
        raise CheckpointError(refusal)
