"""DFlash2: a block drafter conditioned on the target's hidden states, in plain torch.

Written from the description of exllamav3's `dflash2` architecture (read for facts only):

- Context: the outputs of target layers `target_layer_ids` at every committed position are
  concatenated, projected by `fc` (in: H * len(taps), out: H) and RMS-normed (`hidden_norm`).
  Each draft layer turns these rows into its context keys/values (k_proj / v_proj, per-head
  k_norm, RoPE at the rows' absolute positions).
- Block: [anchor (the pending token), mask_token_id x (block_size - 1)] at positions
  [L, L + block_size), embedded by the TARGET's embedding. Block rows are the queries; they attend
  to the context rows and to the block rows themselves (bidirectionally on full-attention layers
  unless the checkpoint says `is_causal`; sliding-window layers are windowed, causal by default).
- Layer: grouped dynamic convolutions wrap both sublayers:
      r = x; y = attn_norm(x); y, k = attn_conv.prepare(y); y = attn(y); x = r + attn_conv.finish(y, k)
      r = x; y = mlp_norm(y);  y, k = mlp_conv.prepare(y);  y = mlp(y);  x = r + mlp_conv.finish(y, k)
  A conv's `kernel_projection` (H -> 2 * kernel_size * groups) gives per-row dynamic taps for the
  prepare and finish halves; `base_kernel` [2, kernel_size, H] the static ones;
  out[t] = sum_tap (base[tap] + dyn[t, tap] per group) * x[t - tap], causal within the block.
- Head: final `norm`, then the TARGET's LM head over block rows 1..; a candidate selector then
  takes each row's top-k and walks greedily from the anchor:
      score_t(a, b) = logit_t(b) + <pred_codebook[a] * hidden_projection(h_t), succ_codebook[b]>
  with a the previous token on the path. The path (block_size - 1 tokens) is the draft.

Tensor names follow the checkpoint (an optional leading "model." is accepted). What is not
implemented: attention sinks, a learned mask embedding, value scale, softcapping (the loader
refuses checkpoints that need them rather than drafting from a wrong model).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ..target import TargetHeads, WindowOutput
from .base import Sampler


@dataclass
class Dflash2Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 2048
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0

    @classmethod
    def from_dict(cls, raw: dict, *, source: str = "config.json") -> "Dflash2Config":
        inner = raw.get("dflash_config") or {}

        def get(name: str, default=...):
            for where in (inner, raw):
                if name in where:
                    return where[name]
            if default is ...:
                raise ValueError(f"{source}: DFlash2 config lacks '{name}' (top level or under dflash_config)")
            return default

        if get("final_logit_softcapping", 0.0):
            raise ValueError(f"{source}: final_logit_softcapping is not supported by this DFlash2 port")
        if get("attention_sink_bias", False) or get("add_swa_attention_sink_bias", False):
            raise ValueError(f"{source}: attention sinks are not supported by this DFlash2 port")
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        layers = int(get("num_hidden_layers"))
        cfg = cls(
            vocab_size=int(get("vocab_size")), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", None) or hidden // heads),
            intermediate_size=int(get("intermediate_size")), rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(get("rope_theta", 10000.0)), block_size=int(get("block_size")),
            mask_token_id=int(get("mask_token_id")),
            # ids name layer OUTPUTS (DFlash2's convention); a checkpoint may pin an offset ("tap_shift")
            target_layer_ids=[int(i) + int(get("tap_shift", 0)) for i in get("target_layer_ids")],
            conv_kernel_size=int(get("conv_kernel_size", 2)), conv_group_size=int(get("conv_group_size", 16)),
            selector_rank=int(get("selector_rank")), selector_top_k=int(get("selector_top_k")),
            layer_types=list(get("layer_types", None) or ["full_attention"] * layers),
            sliding_window=int(get("sliding_window", 2048)), is_causal=get("is_causal", None),
            output_multiplier=float(get("output_multiplier", 1.0)),
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        problems = []
        if not 0 < self.conv_kernel_size <= self.block_size:
            problems.append("conv_kernel_size must be in 1..block_size")
        if self.hidden_size % self.conv_group_size:
            problems.append("hidden_size must be divisible by conv_group_size")
        if not 0 < self.selector_top_k <= self.vocab_size:
            problems.append("selector_top_k must be in 1..vocab_size")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            problems.append("target_layer_ids must be unique")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append("layer_types must list one type per layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append("mask_token_id must be inside the vocabulary")
        if problems:
            raise ValueError(f"{source}: invalid DFlash2 config: " + "; ".join(problems))

    def window(self, layer: int) -> tuple[int, int]:
        """(keys visible behind, keys visible ahead) of a block row on this layer; -1 = unbounded."""
        if self.layer_types[layer] == "sliding_attention":
            causal = True if self.is_causal is None else bool(self.is_causal)
            return self.sliding_window - 1, 0 if causal else self.sliding_window - 1
        return -1, (0 if self.is_causal is True else self.block_size)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d, hq, hk = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        groups = h // self.conv_group_size
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, h * len(self.target_layer_ids)),
            "hidden_norm.weight": (h,),
            "norm.weight": (h,),
            "candidate_selector.predecessor_codebook": (self.vocab_size, self.selector_rank),
            "candidate_selector.successor_codebook": (self.vocab_size, self.selector_rank),
            "candidate_selector.hidden_projection.weight": (self.selector_rank, h),
        }
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (hq * d, h), p + "self_attn.k_proj.weight": (hk * d, h),
                p + "self_attn.v_proj.weight": (hk * d, h), p + "self_attn.o_proj.weight": (h, hq * d),
                p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
            })
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = (2, self.conv_kernel_size, h)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * self.conv_kernel_size * groups, h)
        return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, d] rotated by absolute positions [n] (rotate-half layout)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [n, H]; dynamic [n, taps, groups]; base [taps, H] -> out[t] = sum_tap (base + dyn) * x[t - tap]."""
    n, h = x.shape
    groups = h // group_size
    xs = x.view(n, groups, group_size)
    out = torch.zeros_like(xs)
    for tap in range(min(base.shape[0], n)):
        weights = base[tap].view(1, groups, group_size) + dynamic[tap:, tap].unsqueeze(-1)
        out[tap:] += weights * xs[:n - tap]
    return out.view(n, h)


class Dflash2Model:
    """The drafter's weights and forward (float32 compute on the weights' device)."""

    def __init__(self, config: Dflash2Config, tensors: dict[str, torch.Tensor], *, source: str = "weights") -> None:
        self.config = config
        expected = config.expected_shapes()
        w: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            name = key[len("model."):] if key.startswith("model.") else key
            if name.endswith("_codebook.weight"):
                name = name[: -len(".weight")]     # older trainers suffix the bare codebook keys
            w[name] = tensor.float()
        missing = [k for k in expected if k not in w]
        if missing:
            raise ValueError(f"{source}: DFlash2 weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        for key, shape in expected.items():
            if tuple(w[key].shape) != shape:
                raise ValueError(f"{source}: tensor {key} has shape {tuple(w[key].shape)}, expected {shape}")
        for unsupported in ("mask_embedding",):
            if unsupported in w:
                raise ValueError(f"{source}: '{unsupported}' is not supported by this DFlash2 port")
        self.w = w
        self.device = w["fc.weight"].device

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> "Dflash2Model":
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: no DFlash2 config.json (fetch it: fetch_weights.sh --drafter)")
        config = Dflash2Config.from_dict(json.loads(config_path.read_text()), source=str(config_path))
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no .safetensors files (fetch them: fetch_weights.sh --drafter)")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f), device=str(device)))
        return cls(config, tensors, source=str(directory))

    # --- context (target hidden states -> per-layer keys/values) ---

    def context_rows(self, taps: Sequence[torch.Tensor], positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps: one [n, H] per target layer, in target_layer_ids order -> per layer (k, v) [n, kv_heads, d]."""
        c = self.config
        positions = positions.to(self.device)
        x = torch.cat([t.to(self.device, torch.float32) for t in taps], -1) @ self.w["fc.weight"].T
        x = rms_norm(x, self.w["hidden_norm.weight"], c.rms_norm_eps)
        return [self._kv(i, x, positions) for i in range(c.num_hidden_layers)]

    def _kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, p = self.config, f"layers.{layer}.self_attn."
        k = (x @ self.w[p + "k_proj.weight"].T).view(-1, c.num_key_value_heads, c.head_dim)
        v = (x @ self.w[p + "v_proj.weight"].T).view(-1, c.num_key_value_heads, c.head_dim)
        k = rope_neox(rms_norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        return k, v

    # --- block forward ---

    def block_hidden(self, block_embeds: torch.Tensor, start: int,
                     context: list[tuple[torch.Tensor, torch.Tensor]], *, context_start: int = 0) -> torch.Tensor:
        """block_embeds [B, H] at positions [start, start + B); context per layer (k, v) for
        positions [context_start, start). Returns the post-norm block states [B, H]."""
        c = self.config
        x = block_embeds.to(self.device, torch.float32) * c.input_embedding_scale
        b = x.shape[0]
        positions = torch.arange(start, start + b, device=x.device)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            y = rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            y, finish = self._conv_prepare(p + "attention_conv", y)
            y = self._attention(i, y, positions, context[i], context_start)
            x = x + self._conv_finish(p + "attention_conv", y, finish)
            y = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            y, finish = self._conv_prepare(p + "mlp_conv", y)
            y = (F.silu(y @ self.w[p + "mlp.gate_proj.weight"].T) * (y @ self.w[p + "mlp.up_proj.weight"].T)) \
                @ self.w[p + "mlp.down_proj.weight"].T
            x = x + self._conv_finish(p + "mlp_conv", y, finish)
        return rms_norm(x, self.w["norm.weight"], c.rms_norm_eps)

    def _conv_prepare(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        groups = c.hidden_size // c.conv_group_size
        dyn = (x @ self.w[key + ".kernel_projection.weight"].T).view(-1, 2, c.conv_kernel_size, groups)
        y = grouped_dynamic_conv(x, dyn[:, 0], self.w[key + ".base_kernel"][0], c.conv_group_size)
        return y, dyn[:, 1]

    def _conv_finish(self, key: str, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(x, dynamic, self.w[key + ".base_kernel"][1], self.config.conv_group_size)

    def _attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                   context: tuple[torch.Tensor, torch.Tensor], context_start: int) -> torch.Tensor:
        c, p = self.config, f"layers.{layer}.self_attn."
        b = x.shape[0]
        q = (x @ self.w[p + "q_proj.weight"].T).view(b, c.num_attention_heads, c.head_dim)
        q = rope_neox(rms_norm(q, self.w[p + "q_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        kb, vb = self._kv(layer, x, positions)
        k = torch.cat([context[0], kb], 0)
        v = torch.cat([context[1], vb], 0)
        key_pos = torch.cat([torch.arange(context_start, context_start + k.shape[0] - b, device=x.device), positions])
        behind, ahead = c.window(layer)
        delta = positions[:, None] - key_pos[None, :]          # query - key
        allowed = delta >= -ahead
        if behind >= 0:
            allowed &= delta <= behind
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b, -1)
        return out @ self.w[p + "o_proj.weight"].T

    # --- selector ---

    def select(self, states: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
        """Greedy walk over each row's top-k candidates, conditioned on the previous path token."""
        c = self.config
        states, logits = states.to(self.device, torch.float32), logits.to(self.device, torch.float32)
        gate = states @ self.w["candidate_selector.hidden_projection.weight"].T     # [rows, rank]
        unary, cands = torch.topk(logits * c.output_multiplier, c.selector_top_k, dim=-1)
        pred_book = self.w["candidate_selector.predecessor_codebook"]
        succ_book = self.w["candidate_selector.successor_codebook"]
        prev, path = int(anchor), []
        for t in range(unary.shape[0]):
            scores = unary[t] + (succ_book[cands[t]] @ (pred_book[prev] * gate[t]))
            prev = int(cands[t, int(scores.argmax())])
            path.append(prev)
        return path


class Dflash2Source:
    """Draft source around a Dflash2Model and a target that shares its embedding and LM head."""

    name = "dflash2"
    needs_hidden = False

    def __init__(self, model: Dflash2Model, heads: TargetHeads) -> None:
        self.model = model
        self.heads = heads
        self.taps = tuple(model.config.target_layer_ids)
        self.max_depth = model.config.block_size - 1
        self._ctx_k: list[torch.Tensor] = []
        self._ctx_v: list[torch.Tensor] = []
        self._ctx_len = 0
        self._ctx_start = 0     # position of the first context row

    def reset(self) -> None:
        self._ctx_k, self._ctx_v, self._ctx_len, self._ctx_start = [], [], 0, 0

    def commit(self, tokens: Sequence[int], out: WindowOutput, kept_rows: int) -> None:
        missing = [i for i in self.taps if i not in out.taps]
        if missing:
            raise ValueError(f"DFlash2 drafts need target layer outputs {missing}; the target did not return them")
        if out.start != self._ctx_len or not self._ctx_k:
            # A new sequence, or rows the drafter never saw (reused from a prefix cache, or a prefill
            # it was not shown): its context restarts here. Drafts get weaker, never wrong.
            self.reset()
            self._ctx_start = self._ctx_len = out.start
        positions = torch.arange(out.start, out.start + kept_rows)
        rows = self.model.context_rows([out.taps[i][:kept_rows] for i in self.taps], positions)
        if not self._ctx_k:
            self._ctx_k = [k for k, _ in rows]
            self._ctx_v = [v for _, v in rows]
        else:
            self._ctx_k = [torch.cat([old, k]) for old, (k, _) in zip(self._ctx_k, rows)]
            self._ctx_v = [torch.cat([old, v]) for old, (_, v) in zip(self._ctx_v, rows)]
        self._ctx_len = out.start + kept_rows

    def propose(self, tokens: Sequence[int], depth: int, sample: Sampler | None = None) -> list[int]:
        c = self.model.config
        if self._ctx_len != len(tokens) - 1 or depth <= 0:
            return []
        anchor = int(tokens[-1])
        ids = torch.tensor([anchor] + [c.mask_token_id] * (c.block_size - 1))
        embeds = self.heads.embed(ids)      # the target's device; the model moves what it reads
        states = self.model.block_hidden(embeds, self._ctx_len, list(zip(self._ctx_k, self._ctx_v)),
                                         context_start=self._ctx_start)
        logits = self.heads.lm_head(states[1:])
        return self.model.select(states[1:], logits, anchor)[:min(depth, self.max_depth)]
