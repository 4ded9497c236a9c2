"""Per-layer cost of the GLM-5.3 forward (glm53.model) at real dimensions, against a bytes floor.

    python -m bench.bench_layer_decode_prefill --out bench/results/layer_decode_prefill.json      # GPU
    python -m bench.bench_layer_decode_prefill --small --out /tmp/layer_small.json                 # CPU check

Builds one dense layer and a few MoE layers (default 3) at GLM-5.3's dimensions with random
weights; routed experts are random EXL3 groups of mixed widths (K = 2, 3, 4 bits, per expert and
projection; random trellis bits are valid EXL3), decoded once with glm53.exl3 into bf16 matrices,
as the engine does today (decode at load, then matmul). Decoding all 3 x 256 groups of a layer
with the reference decoder is slow, so `--distinct-experts D` decodes D experts and gives every
other expert its own copy of one of them: timing and bytes moved do not depend on weight values.

Measured per layer (CUDA events, warm-up discarded, --reps samples each):
  decode   one token at position --context (rows [0, context) filled with random cache rows);
  prefill  2k and 8k tokens from position 0 in grid chunks of --chunk (2048): the layer's share of
           a cold prefill (every chunk of the prompt through this layer).
Floor: bytes the step must read at least (weights it touches + cache rows) / HBM copy bandwidth
measured in the same run (a device-to-device copy of --copy-gib GiB: read + write bytes / time).
Two weight floors are reported: `exl3` counts routed experts at their packed EXL3 size (the
target of the kernel work), `bf16` at the decoded size this implementation reads. ratio = time /
floor. Prefill is compute bound; its FLOP count and achieved TFLOP/s are reported beside.

Prints a table last; writes full JSON (git commit, device, versions, settings, every sample,
median/min/max). Exit 0 on success, 2 on bad arguments, 3 when the device is missing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import device_description, summary, write_json
from bench.lib.timing import call_timer
from glm53.config import Glm53Config
from glm53.runtime.engine import prefill_pieces
from glm53.model.kv_state import KVState
from glm53.model.indexer import IndexerWeights
from glm53.model.mla import AttentionWeights
from glm53.model.moe import DecodedExperts, MLPWeights, MoEWeights, RouterWeights
from glm53.model.rope import rope_angles
from glm53.model.transformer import Glm53Model, LayerWeights, ModelWeights, Span

SMALL = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8,
             n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, index_topk=128, index_head_dim=64, index_n_heads=8)


# ---- random weights ------------------------------------------------------------------------------
class Rand:
    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device, self.dtype = device, dtype
        self.g = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, *shape: int, std: float = 0.02, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, device=self.device, dtype=dtype or self.dtype) * std


def exl3_group(in_f: int, out_f: int, bits: int, seed: int) -> dict[str, torch.Tensor]:
    """Random but valid EXL3 tensors for one linear (3inst codebook, no marker)."""
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (in_f // 16, out_f // 16, 16 * bits), generator=g, dtype=torch.int32)
    sign = lambda n: (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(torch.float16)  # noqa: E731
    return {"trellis": trellis.to(torch.int16), "suh": sign(in_f), "svh": sign(out_f)}


def exl3_bytes(in_f: int, out_f: int, bits: int) -> int:
    return in_f * out_f * bits // 8 + 2 * (in_f + out_f)


def expert_bits(layer: int, expert: int, proj: int) -> int:
    return 2 + (layer * 7 + expert * 3 + proj) % 3  # mixed 2/3/4 bits, as a mixed-width pack


def build_experts(cfg: Glm53Config, layer: int, distinct: int, device: torch.device, dtype: torch.dtype,
                  say) -> tuple[DecodedExperts, list[list[int]]]:  # noqa: ANN001
    from glm53.exl3.decode import decode_weight
    from glm53.exl3.format import read_group

    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    shapes = ((H, I), (H, I), (I, H))  # (in, out) of gate, up, down
    decoded: list[list[torch.Tensor]] = []
    bits_table: list[list[int]] = []
    t0 = time.perf_counter()
    for e in range(min(distinct, E)):
        mats = []
        for p, (in_f, out_f) in enumerate(shapes):
            parts = exl3_group(in_f, out_f, expert_bits(layer, e, p), seed=layer * 100003 + e * 7 + p)
            group = read_group(lambda name, parts=parts: parts.get(name.rsplit(".", 1)[-1]), f"bench.l{layer}.e{e}.p{p}")
            mats.append(decode_weight(group, device).T.to(dtype).contiguous())  # [out, in]
        decoded.append(mats)
    say(f"layer {layer}: decoded {len(decoded)} experts x 3 EXL3 groups in {time.perf_counter() - t0:.1f}s")
    gate_up = torch.empty(E, 2 * I, H, device=device, dtype=dtype)
    down = torch.empty(E, H, I, device=device, dtype=dtype)
    for e in range(E):
        src = decoded[e % len(decoded)]
        gate_up[e, :I].copy_(src[0])
        gate_up[e, I:].copy_(src[1])
        down[e].copy_(src[2])
        bits_table.append([expert_bits(layer, e % len(decoded), p) for p in range(3)])
    return DecodedExperts(gate_up, down), bits_table


def build_layer(cfg: Glm53Config, index: int, moe: bool, r: Rand, distinct: int, say) -> tuple[LayerWeights, dict]:  # noqa: ANN001
    c = cfg
    H = c.num_attention_heads
    attn = AttentionWeights(
        q_a=r(c.q_lora_rank, c.hidden_size), q_a_norm=1 + r(c.q_lora_rank), q_b=r(H * c.qk_head_dim, c.q_lora_rank),
        kv_a=r(c.latent_dim, c.hidden_size), kv_a_norm=1 + r(c.kv_lora_rank),
        kv_b=r(H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), o=r(c.hidden_size, H * c.v_head_dim),
        n_heads=H, nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim, v_dim=c.v_head_dim, kv_rank=c.kv_lora_rank,
        scale=c.qk_head_dim ** -0.5)
    ix = IndexerWeights(wq_b=r(c.index_n_heads * c.index_head_dim, c.q_lora_rank), wk=r(c.index_head_dim, c.hidden_size),
                        k_norm_weight=1 + r(c.index_head_dim), k_norm_bias=r(c.index_head_dim),
                        weights_proj=r(c.index_n_heads, c.hidden_size, dtype=torch.float32),
                        n_heads=c.index_n_heads, head_dim=c.index_head_dim, rope_dim=c.qk_rope_head_dim)
    bits = None
    if moe:
        experts, bits = build_experts(c, index, distinct, r.device, r.dtype, say)
        w = c.moe_intermediate_size * c.n_shared_experts
        ffn = MoEWeights(
            router=RouterWeights(weight=r(c.n_routed_experts, c.hidden_size, std=0.05, dtype=torch.float32),
                                 bias=r(c.n_routed_experts, std=0.1, dtype=torch.float32), top_k=c.num_experts_per_tok,
                                 n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                                 scaling=c.routed_scaling_factor),
            experts=experts, shared=MLPWeights(r(w, c.hidden_size), r(w, c.hidden_size), r(c.hidden_size, w)))
    else:
        I = c.intermediate_size
        ffn = MLPWeights(r(I, c.hidden_size), r(I, c.hidden_size), r(c.hidden_size, I))
    layer = LayerWeights(index=index, input_norm=1 + r(c.hidden_size), post_norm=1 + r(c.hidden_size),
                         attn=attn, indexer=ix, ffn=ffn)
    return layer, {"moe": moe, "expert_bits": bits}


# ---- bytes and flops -----------------------------------------------------------------------------
def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def dense_part_bytes(layer: LayerWeights) -> int:
    a, ix = layer.attn, layer.indexer
    n = _nbytes(a.q_a, a.q_a_norm, a.q_b, a.kv_a, a.kv_a_norm, a.kv_b, a.o, layer.input_norm, layer.post_norm)
    n += _nbytes(ix.wq_b, ix.wk, ix.k_norm_weight, ix.k_norm_bias, ix.weights_proj)
    if isinstance(layer.ffn, MLPWeights):
        n += _nbytes(layer.ffn.gate, layer.ffn.up, layer.ffn.down)
    else:
        s = layer.ffn.shared
        n += _nbytes(layer.ffn.router.weight, layer.ffn.router.bias, s.gate, s.up, s.down)
    return n


def expert_bytes(cfg: Glm53Config, bits: list[list[int]], experts: list[int], element_size: int) -> tuple[int, int]:
    """(packed EXL3 bytes, decoded bytes) of the given experts' three projections."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = ((H, I), (H, I), (I, H))
    packed = sum(exl3_bytes(i, o, bits[e][p]) for e in experts for p, (i, o) in enumerate(shapes))
    return packed, len(experts) * 3 * H * I * element_size


def kv_bytes(cfg: Glm53Config, rows: int, element_size: int) -> int:
    return rows * (cfg.latent_dim + cfg.index_head_dim) * element_size


def layer_flops(cfg: Glm53Config, moe: bool, tokens: int, context_end: int) -> float:
    """Multiply-adds x 2 of one layer over `tokens` queries ending at context_end (expanded prefill)."""
    c, H = cfg, cfg.num_attention_heads
    proj = c.hidden_size * (c.q_lora_rank + c.latent_dim + c.index_head_dim + c.index_n_heads)
    proj += c.q_lora_rank * (H * c.qk_head_dim + c.index_n_heads * c.index_head_dim) + H * c.v_head_dim * c.hidden_size
    ffn = 3 * c.hidden_size * (c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts) if moe
                               else c.intermediate_size)
    attn = context_end * (H * (c.qk_head_dim + c.v_head_dim) + c.index_n_heads * c.index_head_dim)
    expand = context_end * c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim) / max(tokens, 1)
    return 2.0 * tokens * (proj + ffn + attn + expand)


# ---- timing --------------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, gib: float, reps: int) -> dict:
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    timed = call_timer(device)
    for _ in range(2):
        timed(lambda: dst.copy_(src))
    samples = [timed(lambda: dst.copy_(src)) for _ in range(reps)]
    moved = 2 * n * 2
    return {"bytes_per_copy": moved, "samples_s": samples, "bandwidth_Bps": moved / statistics.median(samples)}


def random_state(model: Glm53Model, layer: LayerWeights, rows: int, kv_dtype: str, r: Rand) -> KVState:
    state = KVState(n_layers=layer.index + 1, latent_dim=model.cfg.latent_dim, index_dim=model.cfg.index_head_dim,
                    indexed_layers=frozenset({layer.index}), kv_dtype=kv_dtype, device=model.device)
    state.reserve(rows + 1)
    if rows:
        state.write_latent(layer.index, 0, r(rows, model.cfg.latent_dim, std=1.0))
        state.write_index(layer.index, 0, r(rows, model.cfg.index_head_dim, std=1.0))
    return state


def bench_decode(model: Glm53Model, layer: LayerWeights, context: int, kv_dtype: str, reps: int, warmup: int,
                 r: Rand) -> list[float]:
    state = random_state(model, layer, context, kv_dtype, r)
    pos = torch.tensor([context], device=model.device)
    cos, sin = rope_angles(model.inv_freq, pos, model.dtype)
    xs = [r(1, model.cfg.hidden_size, std=1.0) for _ in range(4)]  # rotated inputs
    timed = call_timer(model.device)
    span = Span(pos, context, context + 1)
    run = lambda i: model._layer(state, layer, xs[i % len(xs)], span, cos, sin, None)  # noqa: E731
    for i in range(warmup):
        run(i)
    return [timed(lambda i=i: run(i)) for i in range(reps)]


def bench_prefill(model: Glm53Model, layer: LayerWeights, tokens: int, chunk: int, kv_dtype: str, reps: int,
                  warmup: int, r: Rand) -> list[float]:
    state = random_state(model, layer, 0, kv_dtype, r)
    state.reserve(tokens)
    x = r(tokens, model.cfg.hidden_size, std=1.0)
    pieces = prefill_pieces(0, tokens, chunk)
    angles = {a: rope_angles(model.inv_freq, torch.arange(a, b, device=model.device), model.dtype) for a, b in pieces}

    def run() -> None:
        for a, b in pieces:
            cos, sin = angles[a]
            model._layer(state, layer, x[a:b], Span(torch.arange(a, b, device=model.device), a, b), cos, sin, None)

    timed = call_timer(model.device)
    for _ in range(warmup):
        run()
    return [timed(run) for _ in range(reps)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="small dimensions (CPU check of the script)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--moe-layers", type=int, default=3)
    ap.add_argument("--distinct-experts", type=int, default=32, help="EXL3-decoded experts per layer (rest copies)")
    ap.add_argument("--context", type=int, default=None, help="decode position (default 8192; small: 512)")
    ap.add_argument("--prefill", type=int, nargs="+", default=None, help="prefill lengths (default 2048 8192)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill grid C (default 2048; small: 128)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--copy-gib", type=float, default=None)
    ap.add_argument("--out", default=str(RESULTS / "layer_decode_prefill.json"))
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_layer_decode_prefill: --device cuda but CUDA is not available", file=sys.stderr)
        return 3
    cfg = Glm53Config()
    if args.small:
        cfg = replace(cfg, **SMALL)
    context = args.context or (512 if args.small else 8192)
    prefills = args.prefill or ([128, 512] if args.small else [2048, 8192])
    chunk = args.chunk or (128 if args.small else 2048)
    reps = args.reps or (3 if args.small else 10)
    copy_gib = args.copy_gib or (0.0625 if args.small else 2.0)
    if min([context, chunk, reps, args.moe_layers, args.distinct_experts, *prefills]) <= 0:
        print("bench_layer_decode_prefill: sizes and counts must be positive", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    torch.manual_seed(0)
    r = Rand(device, dtype, seed=0)

    say(f"device {device_description(device)}, dtype {dtype}, kv {args.kv_dtype}")
    bw = copy_bandwidth(device, copy_gib, reps=max(reps, 5))
    say(f"copy bandwidth {bw['bandwidth_Bps'] / 1e12:.3f} TB/s")
    specs = [(0, False)] + [(1 + i, True) for i in range(args.moe_layers)]
    layers, infos = [], []
    for index, moe in specs:
        layer, info = build_layer(cfg, index, moe, r, args.distinct_experts, say)
        layers.append(layer)
        infos.append(info)
    model = Glm53Model(cfg, ModelWeights(embed=torch.empty(1, cfg.hidden_size, device=device, dtype=dtype),
                                         layers=layers, final_norm=torch.ones(cfg.hidden_size, device=device, dtype=dtype),
                                         head=torch.empty(1, cfg.hidden_size, device=device, dtype=dtype)),
                       dtype=dtype, device=device)
    kv_size = 1 if args.kv_dtype == "fp8" else 2
    elt = torch.empty((), dtype=dtype).element_size()
    results = []
    for layer, info in zip(layers, infos):
        name = f"L{layer.index} {'moe' if info['moe'] else 'dense'}"
        dense_b = dense_part_bytes(layer)
        # decode: the 8 routed experts a token picks (bytes of the experts actually routed to)
        with torch.inference_mode():
            samples = bench_decode(model, layer, context, args.kv_dtype, reps, args.warmup, r)
        picked = list(range(cfg.num_experts_per_tok))  # widths are mixed evenly; any 8 are representative
        packed, decoded = expert_bytes(cfg, info["expert_bits"], picked, elt) if info["moe"] else (0, 0)
        rows = min(context, cfg.index_topk)
        # the indexer reads every cached key; attention reads only the selected latent rows
        floor_exl3 = dense_b + packed + context * cfg.index_head_dim * kv_size + rows * cfg.latent_dim * kv_size
        floor_bf16 = floor_exl3 - packed + decoded
        case = {"layer": name, "step": f"decode@{context}", "tokens": 1, "samples_s": samples, **summary(samples, unit="s"),
                "bytes_floor_exl3": floor_exl3, "bytes_floor_bf16": floor_bf16,
                "floor_exl3_s": floor_exl3 / bw["bandwidth_Bps"], "floor_bf16_s": floor_bf16 / bw["bandwidth_Bps"],
                "flops": layer_flops(cfg, info["moe"], 1, context)}
        results.append(case)
        say(f"{name} decode: {case['median_s'] * 1e6:.0f} us")
        for n in prefills:
            with torch.inference_mode():
                samples = bench_prefill(model, layer, n, chunk, args.kv_dtype, max(2, reps // 2), 1, r)
            all_experts = list(range(cfg.n_routed_experts))
            packed, decoded = expert_bytes(cfg, info["expert_bits"], all_experts, elt) if info["moe"] else (0, 0)
            n_chunks = len(prefill_pieces(0, n, chunk))
            kv_read = sum(kv_bytes(cfg, b, kv_size) for _, b in prefill_pieces(0, n, chunk))
            floor_exl3 = n_chunks * (dense_b + packed) + kv_read + kv_bytes(cfg, n, kv_size)
            floor_bf16 = floor_exl3 + n_chunks * (decoded - packed)
            flops = sum(layer_flops(cfg, info["moe"], b - a, b) for a, b in prefill_pieces(0, n, chunk))
            case = {"layer": name, "step": f"prefill {n}", "tokens": n, "samples_s": samples, **summary(samples, unit="s"),
                    "bytes_floor_exl3": floor_exl3, "bytes_floor_bf16": floor_bf16,
                    "floor_exl3_s": floor_exl3 / bw["bandwidth_Bps"], "floor_bf16_s": floor_bf16 / bw["bandwidth_Bps"],
                    "flops": flops, "tflops_per_s": flops / case_median(samples) / 1e12}
            results.append(case)
            say(f"{name} prefill {n}: {case['median_s'] * 1e3:.1f} ms")

    settings = {"small": args.small, "dtype": str(dtype), "kv_dtype": args.kv_dtype, "ranks": 1, "dcp": False,
                "chunk": chunk, "context": context, "prefill": prefills, "moe_layers": args.moe_layers,
                "distinct_experts": args.distinct_experts, "reps": reps, "warmup": args.warmup,
                "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "kv_lora_rank",
                                                       "q_lora_rank", "n_routed_experts", "num_experts_per_tok",
                                                       "moe_intermediate_size", "intermediate_size", "index_topk")},
                "cuda_graphs": False}
    report = {**result_header("layer_decode_prefill", settings, device=device), "copy_bandwidth": bw,
              "results": results}
    out = write_json(args.out, report)

    print(f"\ncopy bandwidth {bw['bandwidth_Bps'] / 1e12:.3f} TB/s on {report['device']}; JSON: {out}")
    print(f"{'layer':<10} {'step':<14} {'median':>10} {'min':>10} {'max':>10} {'floor exl3':>11} {'ratio':>7} "
          f"{'floor bf16':>11} {'ratio':>7} {'TFLOP/s':>8}")
    for c in results:
        tf = f"{c['flops'] / c['median_s'] / 1e12:8.2f}"
        print(f"{c['layer']:<10} {c['step']:<14} {_t(c['median_s']):>10} {_t(c['min_s']):>10} {_t(c['max_s']):>10} "
              f"{_t(c['floor_exl3_s']):>11} {c['median_s'] / c['floor_exl3_s']:7.1f} {_t(c['floor_bf16_s']):>11} "
              f"{c['median_s'] / c['floor_bf16_s']:7.1f} {tf}")
    return 0


def case_median(samples: list[float]) -> float:
    return statistics.median(samples)


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f}us"


if __name__ == "__main__":
    sys.exit(main())
