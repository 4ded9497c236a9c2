"""Load a GLM-5.3 checkpoint (safetensors shards) into `ModelWeights` for one rank.

Tensor names are the Hugging Face ones (`model.layers.{i}.self_attn.q_a_proj.weight`, ...). Every
linear glm53/formats/checkpoint_rules.py lets be EXL3 may be (`P.trellis` + suh/svh/..., each with its own
width): such linears stay packed, one Exl3Bank a layer on the device (glm53/exl3/bank.py), computed
from the trellis by glm53.ops; kv_b_proj alone is decoded (the absorbed attention reads it per head).
Plain weights load in the compute dtype. Every slice a rank owns comes from its `RankPlan` (heads,
intermediate columns, vocabulary rows) and, at R > 1, the layout plan (glm53.layout: EXL3 ranges
widened to 128-blocks), read with safetensors' lazy slices. The MTP layer, when present, is stored
as layer `num_hidden_layers`. What the rule refuses is refused before anything is read.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from glm53.config import Glm53Config
from glm53.exl3.bank import BankBuilder, MlpMatrices
from glm53.exl3.decode import dequantize_exact
from glm53.exl3.format import Exl3Error, Exl3Group, read_group
from glm53.exl3.packing import PROJECTIONS, pack_layer_experts
from glm53.formats.checkpoint_rules import first_refusal
from glm53.layout.plan import plan_layout
from glm53.loading.slices import SliceReader
from glm53.model.exl3_layers import Exl3Linear, Exl3Mlp, Exl3Experts
from glm53.model.indexer import IndexerWeights
from glm53.model.mla import AttentionWeights
from glm53.model.moe import DecodedExperts, ExpertBank, MLPWeights, MoEWeights, RouterWeights
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

    def split_of(self, module: str):  # noqa: ANN201 - FeatureSplit | None
        """How this rank splits a linear module (glm53.layout's FeatureSplit); None: it holds it whole."""
        return None

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
        self.layout = plan_layout(model_dir, ranks, cfg)
        self.slices = self.layout.slices(rank)
        self.features = self.layout.features(rank)
        self.reader = SliceReader()
        self.rank = rank

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def split_of(self, module: str):  # noqa: ANN201
        return self.features.get(module)

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
    """Reads one rank's weights. EXL3 linears stay packed: each layer's groups go into one Exl3Bank
    (glm53/exl3/bank.py) on the device, referenced by the layer's Exl3Linear / Exl3Mlp /
    Exl3Experts; only kv_b_proj, which the absorbed attention reads per head, is decoded (small:
    `dense_from_exl3` names each such tensor and its bytes)."""

    def __init__(self, cfg: Glm53Config, files: TensorFiles, plan: RankPlan, dtype: torch.dtype,
                 device: torch.device, progress: Callable[[str], None] | None) -> None:
        self.cfg, self.f, self.plan, self.dtype, self.device = cfg, files, plan, dtype, device
        self.progress = progress
        self.builder: BankBuilder | None = None
        self.users: list = []  # this bank's Exl3Linear / Exl3Mlp / Exl3Experts, given the bank when built
        self.exl3_bytes = 0
        self.dense_from_exl3: dict[str, int] = {}

    def t(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return x.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def fp32_product_weight(self, x: torch.Tensor) -> torch.Tensor:
        """A weight of an fp32 product (router, indexer head weights): bf16 as stored when the model
        computes in bf16 (every value exact in fp32, and ops.linear_fp32 then runs on the tensor
        cores), else fp32 (what an fp32 model's product takes: converted once here, not per call)."""
        keep = x.dtype == torch.bfloat16 and self.dtype == torch.bfloat16
        return self.t(x, torch.bfloat16 if keep else torch.float32)

    # ---- EXL3: one bank a layer ------------------------------------------------------------------
    @contextmanager
    def bank(self) -> Iterator[None]:
        """EXL3 groups read inside go into one bank, moved to the device at the end."""
        self.builder, self.users = BankBuilder(), []
        yield
        if self.users:
            bank = self.builder.build(self.device)
            self.exl3_bytes += bank.nbytes
            for user in self.users:
                user.bank = bank
        self.builder, self.users = None, []

    def is_exl3(self, p: str) -> bool:
        return f"{p}.trellis" in self.f

    def group(self, p: str) -> Exl3Group:
        try:
            group = read_group(self.f.get, p)
        except Exl3Error as exc:
            raise CheckpointError(f"{self.f.where.get(p + '.trellis', self.f.dir)}: {exc}") from None
        if group.bias is not None:
            raise CheckpointError(f"{self.f.where[p + '.bias']}: {p}.bias: GLM-5.3's linears carry no bias; "
                                  "this is not a GLM-5.3 pack")
        return group

    def exl3_linear(self, p: str, out_f: int) -> Exl3Linear:
        """An EXL3 linear as this rank holds it: the group the files give (whole, or the rank's slice
        widened to 128-blocks), which input columns the rank's x fills and which outputs it keeps."""
        assert self.builder is not None, "EXL3 linears are read inside _Loader.bank()"
        group = self.group(p)
        in_start, out_start, out_n = 0, 0, out_f
        split = self.f.split_of(p)
        if split is not None and split.axis == "out":
            out_start, out_n = split.own[0] - split.read[0], split.own[1] - split.own[0]
        elif split is not None:
            in_start = split.own[0] - split.read[0]
        lin = Exl3Linear(self.builder.add_group(group), in_start, out_start, out_n)
        self.users.append(lin)
        return lin

    def linear(self, p: str, out_f: int, rows: range | None = None, cols: range | None = None):  # noqa: ANN201
        """A linear's weight as the model takes it (ops.project): EXL3 stays packed; a plain one is
        [out, in] in the compute dtype, rows (output features) or columns (inputs) this rank owns."""
        if self.is_exl3(p):
            return self.exl3_linear(p, out_f)
        name = f"{p}.weight"
        if rows is not None:
            return self.t(self.f.rows(name, rows))
        if cols is not None:
            return self.t(self.f.cols(name, cols))
        return self.t(self.f.need(name))

    def dense(self, p: str, in_f: int, rows: range) -> torch.Tensor:
        """A linear the model reads as a matrix ([out, in], this rank's output rows): an EXL3 group is
        dequantized here (the matrix the format defines, as the packed products compute it: decode's
        dequantize_exact), padding and widening trimmed."""
        if not self.is_exl3(p):
            return self.t(self.f.rows(f"{p}.weight", rows))
        w = dequantize_exact(self.group(p)).T  # [out read, in read], fp64
        split = self.f.split_of(p)
        start = split.own[0] - split.read[0] if split is not None else rows.start
        w = self.t(w[start:start + len(rows), :in_f])
        self.dense_from_exl3[p] = w.numel() * w.element_size()
        return w

    # ---- modules -------------------------------------------------------------------------------------
    def attention(self, p: str) -> AttentionWeights:
        c, f = self.cfg, self.f
        heads = self.plan.head_range(c.num_attention_heads)
        return AttentionWeights(
            q_a=self.linear(f"{p}.q_a_proj", c.q_lora_rank), q_a_norm=self.t(f.need(f"{p}.q_a_layernorm.weight")),
            q_b=self.linear(f"{p}.q_b_proj", len(heads) * c.qk_head_dim, rows=_head_rows(heads, c.qk_head_dim)),
            kv_a=self.linear(f"{p}.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim),
            kv_a_norm=self.t(f.need(f"{p}.kv_a_layernorm.weight")),
            kv_b=self.dense(f"{p}.kv_b_proj", c.kv_lora_rank, _head_rows(heads, c.qk_nope_head_dim + c.v_head_dim)),
            o=self.linear(f"{p}.o_proj", c.hidden_size, cols=_head_rows(heads, c.v_head_dim)),
            n_heads=len(heads), nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim, v_dim=c.v_head_dim,
            kv_rank=c.kv_lora_rank, scale=c.qk_head_dim ** -0.5,
        )

    def indexer(self, p: str) -> IndexerWeights:
        c, f = self.cfg, self.f
        return IndexerWeights(
            wq_b=self.linear(f"{p}.wq_b", c.index_n_heads * c.index_head_dim), wk=self.t(f.need(f"{p}.wk.weight")),
            k_norm_weight=self.t(f.need(f"{p}.k_norm.weight")), k_norm_bias=self.t(f.need(f"{p}.k_norm.bias")),
            weights_proj=self.fp32_product_weight(f.need(f"{p}.weights_proj.weight")),
            n_heads=c.index_n_heads, head_dim=c.index_head_dim, rope_dim=c.qk_rope_head_dim,
        )

    def mlp_matrices(self, p: str, layer: int, width: int) -> tuple[int, int, int] | None:
        """An EXL3 MLP's three matrices in the bank (None when it is plain)."""
        names = [f"{p}.{proj}" for proj in PROJECTIONS]
        kinds = {self.is_exl3(n) for n in names}
        if kinds == {False}:
            return None
        if len(kinds) > 1:
            raise CheckpointError(f"{self.f.dir}: {p}: gate/up/down are partly EXL3 and partly plain; "
                                  "the kit serves an MLP stored one way")
        assert self.builder is not None
        return tuple(self.builder.add_group(self.group(n)) for n in names)  # type: ignore[return-value]

    def mlp(self, p: str, layer: int, width: int) -> MLPWeights | Exl3Mlp:
        cols = self.plan.ffn_columns(layer, width)
        mats = self.mlp_matrices(p, layer, width)
        if mats is not None:
            mlp = Exl3Mlp(MlpMatrices(0, 0, 0, 0, mats, len(cols), self.cfg.hidden_size))
            self.users.append(mlp)
            return mlp
        return MLPWeights(gate=self.t(self.f.rows(f"{p}.gate_proj.weight", cols)),
                          up=self.t(self.f.rows(f"{p}.up_proj.weight", cols)),
                          down=self.t(self.f.cols(f"{p}.down_proj.weight", cols)))

    def expert_part(self, p: str, cols: range, down: bool) -> torch.Tensor:
        """This rank's part of one plain expert projection, [out, in] in the compute dtype: rows
        `cols` of gate/up, columns `cols` of down."""
        if f"{p}.weight" not in self.f:
            raise CheckpointError(f"{self.f.dir}: expert projection {p} has neither .weight nor .trellis; "
                                  "a layer's experts are all EXL3 or all plain")
        return self.t(self.f.cols(f"{p}.weight", cols) if down else self.f.rows(f"{p}.weight", cols))

    def routed(self, p: str, layer: int, shared: tuple[int, int, int] | None) -> ExpertBank:
        """The routed experts: packed (pack_layer_experts' block-major layout, the shared expert folded
        in when it is EXL3 too) or, for a plain checkpoint, dense (DecodedExperts)."""
        c = self.cfg
        if self.is_exl3(f"{p}.experts.0.gate_proj"):
            try:
                packed = pack_layer_experts(self.f.get, layer, c.n_routed_experts)
            except Exl3Error as exc:
                raise CheckpointError(f"{self.f.dir}: layer {layer}: {exc}") from None
            assert self.builder is not None
            index = self.builder.add_experts(packed)
            mats = MlpMatrices(index["gate_proj"][0], index["up_proj"][0], index["down_proj"][0],
                               c.n_routed_experts, shared, packed.intermediate, c.hidden_size)
            experts = Exl3Experts(mats)
            self.users.append(experts)
            return experts
        cols = self.plan.ffn_columns(layer, c.moe_intermediate_size)
        gate_up, down = [], []
        for e in range(c.n_routed_experts):
            ep = f"{p}.experts.{e}"
            g = self.expert_part(f"{ep}.gate_proj", cols, down=False)
            u = self.expert_part(f"{ep}.up_proj", cols, down=False)
            gate_up.append(torch.cat([g, u], 0))
            down.append(self.expert_part(f"{ep}.down_proj", cols, down=True))
        return DecodedExperts(torch.stack(gate_up), torch.stack(down))

    def moe(self, p: str, layer: int) -> MoEWeights:
        c = self.cfg
        router = RouterWeights(
            weight=self.fp32_product_weight(self.f.need(f"{p}.gate.weight")),
            bias=self.t(self.f.need(f"{p}.gate.e_score_correction_bias"), torch.float32),
            top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor,
        )
        shared: MLPWeights | Exl3Mlp | None = None
        if c.n_shared_experts > 0:
            shared = self.mlp(f"{p}.shared_experts", layer, c.moe_intermediate_size * c.n_shared_experts)
        folded = isinstance(shared, Exl3Mlp) and self.is_exl3(f"{p}.experts.0.gate_proj")
        if folded:
            self.users.remove(shared)
        experts = self.routed(p, layer, shared.mats.shared if folded else None)
        return MoEWeights(router=router, experts=experts, shared=None if folded else shared)

    def layer(self, i: int, sparse: bool, indexed: bool) -> LayerWeights:
        p = f"model.layers.{i}"
        with self.bank():
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
    p = f"model.layers.{cfg.num_hidden_layers}.eh_proj"
    return cfg.num_nextn_predict_layers > 0 and (f"{p}.weight" in names or f"{p}.trellis" in names)


def load_weights(model_dir: str | Path, cfg: Glm53Config | None = None, *, plan: RankPlan | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", with_mtp: bool = True,
                 progress: Callable[[str], None] | None = None) -> ModelWeights:
    cfg = cfg or Glm53Config.from_dir(model_dir)
    plan = plan or RankPlan()
    # R > 1: read only this rank's slices (glm53.layout), counted; world 1 reads whole tensors
    files = TensorFiles(model_dir) if plan.world == 1 else RankTensorFiles(model_dir, cfg, plan.world, plan.rank)
    refuse_unservable(cfg, files)
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
        with ld.bank():
            eh_proj = ld.linear(f"{p}.eh_proj", cfg.hidden_size)
        weights.mtp = MtpWeights(
            enorm=ld.t(files.need(f"{p}.enorm.weight")), hnorm=ld.t(files.need(f"{p}.hnorm.weight")),
            eh_proj=eh_proj, layer=layer,
            head_norm=ld.t(files.need(f"{p}.shared_head.norm.weight")),
            head=ld.vocab(f"{p}.shared_head.head.weight") if f"{p}.shared_head.head.weight" in names else None,
            embed=ld.vocab(f"{p}.embed_tokens.weight") if f"{p}.embed_tokens.weight" in names else None,
        )
        say("glm53: loaded the MTP layer")
    weights.exl3_bytes, weights.dense_from_exl3 = ld.exl3_bytes, dict(ld.dense_from_exl3)
    return weights


# ---- check: refuse what cannot be served, from headers only (no tensor data is read) -----------
def refuse_unservable(cfg: Glm53Config, files: TensorFiles) -> None:
    """Raise CheckpointError for what glm53/formats/checkpoint_rules.py refuses (headers only): the loader serves
    exactly what check() and fetch_weights.sh accept."""
    refusal = first_refusal(cfg, files.where, files.dir)
    if refusal is not None:
        raise CheckpointError(refusal)


def check_checkpoint(model_dir: str | Path) -> None:
    """Raise ConfigError / CheckpointError naming the file and field or tensor for anything this
    family cannot serve; return None when the checkpoint looks servable. Reads headers only; the
    rule is glm53/formats/checkpoint_rules.py, the one fetch_weights.sh applies too."""
    refuse_unservable(Glm53Config.from_dir(model_dir), TensorFiles(model_dir))
