"""Row-invariant operations: every output row depends on its own input row only.

Why: the prefix cache reuses KV rows computed in one prefill and continues in another whose pieces
start elsewhere, hold other rows and end elsewhere; speculative decoding verifies k tokens in one
forward where serial decoding runs one. Both are exact (contracts 1 and 3, docs/ARCHITECTURE.md) exactly when a
row's bits do not depend on how many rows share its forward, where it sits among them, or how many
keys lie past it. Library kernels do not promise that: a GEMM picks its tiling and split-K by shape
(measured: MKL fp32 rows change with M below 16 and with the thread count; cuBLAS on the H200 too),
a CUDA reduction spreads a few rows over more threads than many rows.

So every op of the forward with a reduction goes through here:

    linear(x, w)              x [..., K] @ w[N, K]^T, fp32 accumulation, out in x's dtype
    exl3_linear, exl3_mlp     EXL3 linears and MLPs from the packed trellis (exl3_torch / triton_exl3)
    expert_linear(x, w, ids)  row r times its own matrix w[ids[r]] (routed experts, short windows)
    grouped_expert_linear     rows grouped by expert times their experts' matrices (CUDA prefill)
    head_linear(x, w)         per-head projection: x [T, H, K], w [H, N, K] -> [T, H, N]
    rms_norm / layer_norm     over the last dim
    sigmoid / silu            elementwise, but torch's CPU kernels give a value other bits in a
                              vector lane than in the scalar tail (which lane depends on the size)
    index_scores(...)         the DSA indexer's score of every key for every query
    index_scores_spans(...)   the same for several sequences' queries, each over its own keys
    latent_attention(...)     absorbed MLA of each query over its own selected latent rows

The indexer's top-k selection is not a reduction but has a kernel too: a prefill piece's on CUDA
runs glm53/ops/triton_topk.py (`triton_topk_for` says where), the same rule as the torch form in
glm53/model/indexer.py, one program per query row.

On CUDA the Triton kernels (glm53/ops/triton_*.py) are row-invariant by construction: a fixed tile
configuration per op and shape, a sequential reduction over K in fixed blocks, no split-K, no
atomics, each (row, column) computed by the same instructions whatever M. Two places use another
tile or kernel for few rows, where the H200 measured the same bits: linear's M <= 256 tiles
(CONFIG_BY_ROWS) and latent_attention's split kernels for T <= 16, both checked again on every
device at first use of a shape, falling back to the prefill tile or kernel where the bits differ.
Every launch passes glm53/ops/triton_launch.py's options (FP fusion on, whatever Triton's default).
Which config latent_attention's prefill kernel runs is the device's too: the first candidate whose
compiled kernel fits its shared memory a block (GB10, the DGX Spark's GPU, has 99 KB; the H200 227).
On the CPU the torch path (glm53/ops/torch_ops.py) runs each row of a projection as its own one-row
product, each indexer query as its own product of its heads by the keys (keys padded to 16), and
computes sigmoid/silu through exp (measured on MKL, AVX2 and AVX-512 + AMX, 1 or 2 threads, and on
the latter with MKL held to its AVX2 and SSE4.2 kernels: tests/test_row_invariance.py; batched
products run in fp32 and never as a batch of one, torch_ops._matmul32; MKL's vector math is
initialised from one thread at import, torch_ops._settle_mkl_vml); torch's last-dim reductions on
the CPU are sequential per row.
TF_GLM53_KERNELS=torch forces the torch path on CUDA (debugging); it is not row-invariant there, so
the engine then reuses only at prefill-grid boundaries. The choice is the process's (the ops see no
engine): the engine sets it from its settings (`use_kernels`) when it is built.
"""
from __future__ import annotations

import torch

from glm53.ops import torch_ops
from glm53.settings import KERNEL_CHOICES

_kernels = "auto"


def use_kernels(choice: str) -> None:
    """The kernels every op runs from now on (Settings.kernels: auto, triton or torch)."""
    global _kernels
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels {choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    _kernels = choice


def kernel_choice() -> str:
    return _kernels


def _triton_for(t: torch.Tensor) -> bool:
    return t.is_cuda and kernel_choice() != "torch"


def triton_topk_for(scores: torch.Tensor) -> bool:
    """Whether the indexer's selection over these scores [T, N] runs as the Triton kernel
    (glm53/ops/triton_topk.py): on CUDA, for rows of up to its MAX_KEYS keys."""
    return triton_topk_keys(scores.shape[-1], scores.device)


def triton_topk_keys(n_keys: int, device: torch.device) -> bool:
    """triton_topk_for over rows of n_keys keys on `device` (decided before the scores exist)."""
    if device.type != "cuda" or kernel_choice() == "torch":
        return False
    from glm53.ops import triton_topk

    return n_keys <= triton_topk.MAX_KEYS


def row_invariant(device: torch.device | str) -> bool:
    """Whether this module's ops are row-invariant on `device` (so reuse may resume at any token)."""
    device = torch.device(device)
    return device.type == "cpu" or kernel_choice() != "torch"


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in x's dtype (fp32 accumulation); row-invariant."""
    if _triton_for(x):
        from glm53.ops import triton_linear

        return triton_linear.linear(x, w)
    return torch_ops.linear(x, w)


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in fp32: the router's and the indexer's head weights, whose
    reference computes in fp32. Where x and w are both bf16 (a bf16 model's activations and a bf16
    checkpoint's weights) every product is exact in fp32, so the tensor cores' bf16 dot with fp32
    sums and an fp32 output computes the same quantity as fp32 operands, in a product's time
    instead of a chain of K dependent FMAs (H200, M = 1, [32, 6144]: the fp32 FMA form ~118 us);
    otherwise the operands go to fp32. Row-invariant either way; the CPU always takes fp32 operands."""
    if _triton_for(x):
        from glm53.ops import triton_linear

        if x.dtype == w.dtype == torch.bfloat16:
            return triton_linear.linear(x, w, out_dtype=torch.float32)
        return triton_linear.linear(x.to(torch.float32), w.to(torch.float32))
    return torch_ops.linear(x.to(torch.float32), w.to(torch.float32))


def expert_linear(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[ids[r]]^T: x [R, K], w [E, N, K], ids [R] int64 on x's device -> [R, N];
    each row gets the bits linear(x[r:r+1], w[ids[r]]) gives it, and ids are never read on the host
    (the routed experts of a short window without a sync: glm53.model.moe)."""
    if _triton_for(x):
        from glm53.ops import triton_linear

        return triton_linear.expert_linear(x, w, ids)
    return torch_ops.expert_linear(x, w, ids)


def grouped_experts_for(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether routed experts over many rows of x run as one grouped product per expert bank
    (`grouped_expert_linear`): on CUDA, where the device gives each expert's rows linear's bits for
    these banks' shapes (triton_linear.grouped_agrees, checked once per shape)."""
    if not _triton_for(x):
        return False
    from glm53.ops import triton_linear

    return all(triton_linear.grouped_agrees(w) for w in weights)


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots of each expert among ids (any shape, values in [0, n_experts)) as [n_experts] int64 on ids'
    device, without a host read: torch.bincount reads the ids' maximum back to size its output, which a
    CUDA graph cannot hold (glm53.runtime.cuda_graphs captures prefill pieces' MoE)."""
    flat = ids.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))


def grouped_expert_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [S, K] with its rows grouped by expert in ascending order, counts [E] device ints (never
    read on the host), w [E, N, K] -> [S, N]: each expert's rows times its matrix, in one launch,
    each row with the bits linear gives it. CUDA only: callers ask `grouped_experts_for` first."""
    from glm53.ops import triton_linear

    return triton_linear.grouped_expert_linear(x, w, counts)


def exl3_linear(x: torch.Tensor, bank, m: int, in_start: int = 0, out_start: int = 0,  # noqa: ANN001
                out_features: int | None = None) -> torch.Tensor:
    """x [..., n] @ W of EXL3 matrix m of `bank` (glm53.exl3.bank.Exl3Bank), from its packed trellis: x is
    input columns [in_start, in_start + n) of the matrix (zeros elsewhere), the result its output columns
    [out_start, out_start + out_features), in x's dtype; row-invariant (glm53/ops/exl3_torch.py: the
    arithmetic; on CUDA the Triton kernels of glm53/ops/triton_exl3.py, whose forms give a row one set of bits)."""
    lead, n = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, n)
    if _triton_for(x):
        from glm53.ops import triton_exl3

        y = triton_exl3.linear(flat, bank, m, in_start, out_start, out_features)
    else:
        from glm53.ops import exl3_torch

        y = exl3_torch.linear(flat, bank, m, in_start, out_start, out_features)
    return y.reshape(*lead, y.shape[-1])


def exl3_mlp(x: torch.Tensor, bank, mats, ids: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
    """An EXL3 MLP from its packed trellis (glm53.exl3.bank.MlpMatrices): routed experts (ids/weights
    [T, K]) plus the shared expert, or the dense MLP (K = 0); x [T, hidden] -> [T, hidden]."""
    if _triton_for(x):
        from glm53.ops import triton_exl3

        return triton_exl3.mlp(x, bank, mats, ids, weights)
    from glm53.ops import exl3_torch

    return exl3_torch.mlp(x, bank, mats, ids, weights)


def project(x: torch.Tensor, w) -> torch.Tensor:  # noqa: ANN001
    """A linear layer's weight, whatever its storage: a dense [N, K] tensor (linear) or an EXL3
    linear (glm53.model.exl3_layers.Exl3Linear, called with x)."""
    return linear(x, w) if isinstance(w, torch.Tensor) else w(x)


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[t, h] = w[h] @ x[t, h]: x [T, H, K], w [H, N, K] -> [T, H, N] in x's dtype; row-invariant."""
    if _triton_for(x):
        from glm53.ops import triton_linear

        return triton_linear.head_linear(x, w)
    return torch_ops.head_linear(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), statistics in fp32 (the reference's rounding)."""
    if _triton_for(x):
        from glm53.ops import triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return torch_ops.rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with weight and bias (statistics in fp32)."""
    if _triton_for(x):
        from glm53.ops import triton_norm

        return triton_norm.layer_norm(x, weight, bias, eps)
    return torch_ops.layer_norm(x, weight, bias, eps)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), the same bits for an element wherever it sits (the router's scores)."""
    return torch.sigmoid(x) if x.is_cuda else torch_ops.sigmoid(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), the same bits for an element wherever it sits (the MLPs' activation)."""
    return torch.nn.functional.silu(x) if x.is_cuda else torch_ops.silu(x)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float,
                 q_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                 key_rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [T, N]: sum over heads h = 0..H-1, in that order, of head_weights[t, h] * relu(scale * q[t, h] . keys[n]).
    q [T, H, D], head_weights [T, H] fp32, keys [N, D]. Given q_positions [T], -inf where the key lies in
    the query's future (key n at key_positions[n], default n); on CUDA inside the kernel. key_rows [N]
    (int64): key n is keys[key_rows[n]] instead (a paged cache's slots; the kernel reads them in place)."""
    if _triton_for(q):
        from glm53.ops import triton_indexer

        return triton_indexer.index_scores(q, head_weights, keys, scale, q_positions, key_positions, key_rows)
    if key_rows is not None:
        keys = keys.index_select(0, key_rows)
    return torch_ops.index_scores(q, head_weights, keys, scale, q_positions, key_positions)


def index_scores_spans(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float,
                       q_positions: torch.Tensor, key_table: torch.Tensor,
                       key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """index_scores of B sequences at once -> fp32 [B * T, N]: q [B * T, H, D] and head_weights
    [B * T, H] hold T rows a sequence, in sequence order, at q_positions [B * T]; sequence b's key n
    is keys[key_table[b, n]] and lies at position key_positions[n] (one row for every sequence;
    default n), -inf past each query. Each row's scores are the ones index_scores gives its sequence
    alone over the same keys (on CUDA one launch; on the CPU a product a sequence)."""
    if _triton_for(q):
        from glm53.ops import triton_indexer

        return triton_indexer.index_scores_spans(q, head_weights, keys, scale, q_positions, key_table, key_positions)
    b, n = key_table.shape
    if b == 0 or q.shape[0] % b:
        raise ValueError(f"index_scores_spans: {q.shape[0]} query rows do not split into {b} sequences: pass T "
                         f"rows a sequence, in the order of key_table's rows")
    rows = q.shape[0] // b
    out = torch.empty(q.shape[0], n, dtype=torch.float32, device=q.device)
    for i in range(b):
        part = slice(i * rows, (i + 1) * rows)
        out[part] = torch_ops.index_scores(q[part], head_weights[part], keys.index_select(0, key_table[i]), scale,
                                           q_positions[part], key_positions)
    return out


def latent_attention(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor,
                     scale: float, value_dim: int, valid_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query over its own selected rows: q [T, H, D], rows [N, D], indices [T, k] (int64 into rows),
    valid [T, k] bool. s_j = scale * q[t, h] . rows[indices[t, j]] over valid j; returns
    (sum_j softmax(s)_j * rows[indices[t, j], :value_dim] as [T, H, value_dim] in q's dtype,
    lse [T, H] fp32 natural-log); a query with no valid slot gets out 0 and lse -inf (never NaN).
    valid_prefix: each row's valid slots come first (a Selection's form): the CUDA kernels then skip
    loading validity where the device's check allows it (the same result; a mask of another form
    gives a wrong one)."""
    if _triton_for(q):
        from glm53.ops import triton_attention

        return triton_attention.latent_attention(q, rows, indices, valid, scale, value_dim,
                                                 valid_prefix=valid_prefix)
    return torch_ops.latent_attention(q, rows, indices, valid, scale, value_dim)
