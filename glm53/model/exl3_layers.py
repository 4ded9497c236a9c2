"""EXL3 weights as the model holds them: references into a layer's Exl3Bank (glm53/exl3/bank.py),
the packed trellis resident on the device, computed by glm53.ops.exl3_linear / exl3_mlp.

- Exl3Linear: one linear (attention projections, the indexer's wq_b, MTP's eh_proj), used wherever the
  model takes a dense weight through ops.project. It knows which input columns the rank's x fills
  (in_start: a TP-widened or padded input is zero elsewhere) and which outputs it keeps (out_start,
  out_features: padded outputs and a TP-widened head range are trimmed).
- Exl3Mlp: the dense MLP, or the shared expert on its own.
- Exl3Experts: a MoE layer's routed experts (an ExpertBank), the shared expert folded in when it is
  EXL3 too: each token's experts summed in ascending order, the shared one last.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm53 import ops
from glm53.exl3.bank import Exl3Bank, MlpMatrices


@dataclass
class Exl3Linear:
    m: int  # matrix index in the bank
    in_start: int
    out_start: int
    out_features: int
    bank: Exl3Bank | None = field(default=None, repr=False)  # set once the layer's bank is built

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.exl3_linear(x, self.bank, self.m, self.in_start, self.out_start, self.out_features)


@dataclass
class Exl3Mlp:
    mats: MlpMatrices  # n_experts 0, shared: the MLP's three matrices
    bank: Exl3Bank | None = field(default=None, repr=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        none = torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
        return ops.exl3_mlp(x, self.bank, self.mats, none, None)


@dataclass
class Exl3Experts:
    """Routed EXL3 experts (glm53.model.moe.ExpertBank), with the shared expert when mats.shared is set."""

    mats: MlpMatrices
    bank: Exl3Bank | None = field(default=None, repr=False)

    def capturable(self, rows: int) -> bool:
        """Either form (parallel for a short window, sorted by expert past it) reads nothing back to the
        host: graph-capturable at any row count."""
        return True

    @property
    def n_experts(self) -> int:
        return self.mats.n_experts

    @property
    def has_shared(self) -> bool:
        return self.mats.shared is not None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.exl3_mlp(x, self.bank, self.mats, ids, weights)


def _linears_of(layer) -> list:  # noqa: ANN001 - a LayerWeights
    attn = layer.attn
    found = [attn.q_a, attn.q_b, attn.kv_a, attn.o]
    if layer.indexer is not None:
        found.append(layer.indexer.wq_b)
    return [w for w in found if isinstance(w, Exl3Linear)]


def _exl3_modules(weights) -> tuple[list[Exl3Linear], list[Exl3Mlp | Exl3Experts]]:  # noqa: ANN001
    """Every EXL3 linear and every EXL3 MLP (dense, shared or routed) of `weights`
    (glm53.model.transformer.ModelWeights)."""
    layers = list(weights.layers) + ([weights.mtp.layer] if weights.mtp is not None else [])
    linears, mlps = [], []
    for layer in layers:
        linears += _linears_of(layer)
        ffn = layer.ffn
        if isinstance(ffn, Exl3Mlp):
            mlps.append(ffn)
        experts = getattr(ffn, "experts", None)
        if isinstance(experts, Exl3Experts):
            mlps.append(experts)
        if isinstance(getattr(ffn, "shared", None), Exl3Mlp):
            mlps.append(ffn.shared)
    if weights.mtp is not None and isinstance(weights.mtp.eh_proj, Exl3Linear):
        linears.append(weights.mtp.eh_proj)
    return linears, mlps


def choose_decode_forms(weights, dtype: torch.dtype) -> str:  # noqa: ANN001
    """Settle the EXL3 forms of every linear and MLP shape of `weights` at load, before any CUDA graph is
    captured and before the first request pays for the checks (glm53.ops.triton_exl3: decode_form, the CUDA
    split sums where they give the Triton decode form's bits on this device; prefill_form, the prefill tiles
    where they give the decode form's bits); a line for the load log."""
    from glm53.ops.triton_exl3 import decode_form, prefill_form  # Triton: CUDA only

    linears, mlps = _exl3_modules(weights)
    for bank in {id(mod.bank): mod.bank for mod in [*linears, *mlps]}.values():
        prefill_form(bank, dtype)
    forms = [decode_form(lin.bank, dtype, m=lin.m).cuda for lin in linears]
    forms += [decode_form(mod.bank, dtype, mats=mod.mats).cuda for mod in mlps]
    if not forms:
        return "EXL3 decode: no EXL3 weights"
    cuda = sum(forms)
    return f"EXL3 decode: CUDA split sums for {cuda} of {len(forms)} linears and MLPs, the Triton form for the rest"


def decode_scratch_needs(weights, window: int, top_k: int) -> list[dict[str, int]]:  # noqa: ANN001
    """What the CUDA kernels need for every EXL3 linear and MLP of `weights`
    (glm53.model.transformer.ModelWeights): the parallel form's scratch for windows of up to `window`
    tokens and the prefill stage; reserved at load, before any CUDA graph is captured
    (glm53.ops.triton_exl3.reserve)."""
    from glm53.ops.triton_exl3 import linear_scratch, mlp_scratch  # Triton: CUDA only

    linears, mlps = _exl3_modules(weights)
    needs = []
    for lin in linears:
        lay = lin.bank.layouts[lin.m]
        needs.append(linear_scratch(lay.in_read, lay.out_read, window))
    for mod in mlps:  # slots a token fills: the routed experts' top-k and the shared one; a dense MLP's one
        slots = top_k + int(mod.has_shared) if isinstance(mod, Exl3Experts) else 1
        needs.append(mlp_scratch(mod.mats, window, slots))
    return needs
