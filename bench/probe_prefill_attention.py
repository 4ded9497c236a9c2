"""latent_attention's prefill kernel: ways to schedule its gathers, their bits against the kernel in
use, and their speed against it (GLM-5.3: 64 heads x 576, value 512, bf16, 2048 selected slots).

    python bench/probe_prefill_attention.py --out bench/results/prefill_attention_h200.json     # GPU

The kernel in use loads a slot block's indices and then gathers its rows in the same loop
iteration, the gather masked by the slots' validity (a load of that iteration). Variants:
'unmasked' gathers row 0 for invalid slots instead of masking the load (their scores are -inf and
probabilities 0 either way), so the gather can go straight to shared memory; BLOCK_N 32 (other
bits: the online softmax steps differ) with deeper pipelines; 1-4 stages. The 64-slot forms do the
kernel's arithmetic (its dots and glm53.ops.triton_attention._softmax_step). Each variant runs T =
2048 queries of one prefill piece over a 16k-row and a 94k-row cache, every slot valid ('full') and
a first piece's fill-up (query t sees min(t + 1, 2048) slots: 'fill'); bits against the kernel in
use (torch.equal, out and lse), the split kernels' agreement with the variant at T = 16, and what
the compiler made of it (async copies, wgmma, pipelined waits, shared memory, registers; Triton 3.9
on this CPU compiles the kernel in use with no async copy at any stage count). Time: a CUDA graph
of 4 calls on rotating queries, replayed, CUDA events. Prints a table; JSON with every row. (A form
that loaded the next block's indices one iteration ahead was 0.46-0.66x: this script at 91cdc63,
bench/results/prefill_attention_h200.json. Sixteen warps, where a thread needs half the accumulator's
registers, kept the bits but spilled at 128 registers a thread: 0.29-0.47x,
bench/results/prefill_attention_warps_h200.json. `--specialized`: the slot loop as
tl.range(warp_specialize=True); Triton 3.6 on the H200 emits the same code at 8 warps (no setmaxnreg,
the same time and bits) and fails its warp-specialization pass at 4 (a producer for a gathered load,
not a TMA one), bench/results/prefill_attention_ws_h200.json.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402
from bench.probe_decode_tiles import graph_time_us  # noqa: E402
from glm53.ops import triton_attention as ta  # noqa: E402

HEADS, D, DV, SLOTS, T = 64, 576, 512, 2048, 2048


@triton.jit
def _program_start(q_ptr, end_ptr, H, stride_qt, stride_qh, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """What the prefill kernel holds before its slot loop (the probes' variants start the same way):
    the query, head and column offsets and masks, the queries, the softmax state and the row's end."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    h_mask, v_mask, r_mask = offs_h < H, offs_v < DV, offs_r < DR
    q_v, q_r = ta._load_queries(q_ptr, t, stride_qt, stride_qh, offs_h, h_mask, offs_v, v_mask, offs_r, r_mask,
                                DV, DR, BLOCK_H, BLOCK_DR)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    return t, offs_h, offs_v, offs_r, h_mask, v_mask, r_mask, q_v, q_r, m, l, acc, tl.load(end_ptr + t)


@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _variant_kernel(q_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, out_ptr, lse_ptr, T, K_SLOTS, H, scale,
                    stride_qt, stride_qh, stride_r, stride_it, stride_vt, stride_ot, stride_oh, stride_lt,
                    DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UNMASKED: tl.constexpr,
                    SPECIALIZE: tl.constexpr):
    """The kernel in use's arithmetic, scheduled otherwise. UNMASKED: the gather without a mask from
    loaded values (an invalid slot reads row 0; its score is -inf and its probability 0 either way),
    so the gather can go straight to shared memory. SPECIALIZE: the slot loop as
    tl.range(warp_specialize=True), whether Triton splits it into producer and consumer warps (the
    overlap the kernel lacks)."""
    t, offs_h, offs_v, offs_r, h_mask, v_mask, r_mask, q_v, q_r, m, l, acc, end = _program_start(
        q_ptr, end_ptr, H, stride_qt, stride_qh, DV, DR, BLOCK_H, BLOCK_DV, BLOCK_DR)
    for jb in tl.range(0, tl.cdiv(end, BLOCK_N), warp_specialize=SPECIALIZE):
        if UNMASKED:
            idx, ok = ta._block_slots(idx_ptr, valid_ptr, end, t, jb, K_SLOTS, stride_it, stride_vt, BLOCK_N, False)
            row = rows_ptr + tl.where(ok, idx, 0).to(tl.int64)[:, None] * stride_r
            kv_v = tl.load(row + offs_v[None, :]).to(q_v.dtype)
            s = tl.dot(q_v, tl.trans(kv_v))
            kv_r = tl.load(row + DV + offs_r[None, :]).to(q_v.dtype)
            s = tl.dot(q_r, tl.trans(kv_r), s)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
        else:
            s, ok, kv_v = ta._block_scores(q_v, q_r, rows_ptr, idx_ptr, valid_ptr, end, t, jb, K_SLOTS, scale,
                                           stride_r, stride_it, stride_vt, offs_v, v_mask, offs_r, r_mask, DV, DR,
                                           BLOCK_N, IEEE, False)
        m, l, acc = ta._softmax_step(m, l, acc, s, ok, kv_v, IEEE)
    ta._store_result(out_ptr, lse_ptr, t, stride_ot, stride_oh, stride_lt, acc, l, m, offs_h, h_mask, offs_v, v_mask,
                     True)


# form -> (kernel, its extra constexprs)
KERNELS = {"in use": (ta._latent_attention_kernel, {}),
           "unmasked": (_variant_kernel, {"UNMASKED": True, "SPECIALIZE": False}),
           "specialized": (_variant_kernel, {"UNMASKED": False, "SPECIALIZE": True})}
ASM: dict[str, dict] = {}


def asm_stats(k) -> dict:
    """What the compiler made of a variant: async copies, tensor-core dots, pipelined waits, memory."""
    import re

    asm = getattr(k, "asm", {}) or {}
    ptx, ttgir = asm.get("ptx", ""), asm.get("ttgir", "")
    meta = getattr(k, "metadata", None)
    return {"cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "wgmma": ptx.count("wgmma.mma_async"),
            "st_shared": ptx.count("st.shared"), "waits_pending": len(re.findall(r"pendings = [1-9]", ttgir)),
            "shared": getattr(meta, "shared", None), "regs": getattr(k, "n_regs", None),
            "spills": getattr(k, "n_spills", None), "setmaxnreg": ptx.count("setmaxnreg")}


def run_variant(form: str, stages: int, q, rows, indices, valid, end, out, lse, scale: float,
                block_n: int | None = None, warps: int | None = None) -> None:
    t, heads, d = q.shape
    block_h, default_n, default_warps, _ = ta.attention_config(heads, d, DV, q.dtype)
    block_n, warps = block_n or default_n, warps or default_warps
    kernel, flags = KERNELS[form]
    k = kernel[(t, triton.cdiv(heads, block_h))](
        q, rows, indices, valid, end, out, lse, t, indices.shape[1], heads, float(scale),
        q.stride(0), q.stride(1), rows.stride(0), indices.stride(0), valid.stride(0), out.stride(0), out.stride(1),
        lse.stride(0), **ta._query_blocks(d, DV), **flags, BLOCK_H=block_h, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages)
    key = variant_key(form, stages, block_n, warps)
    if key not in ASM:
        ASM[key] = asm_stats(k)


def variant_key(form: str, stages: int, block_n: int, warps: int) -> str:
    return f"{form} s{stages} n{block_n} w{warps}"


def inputs(history: int, fill: bool, dev: torch.device, copies: int = 4):
    """`copies` query sets (rotated in the timed graph) over one cache and selection."""
    g = torch.Generator(device=dev).manual_seed(11)
    rows = torch.randn(history, D, generator=g, device=dev).to(torch.bfloat16)
    qs = [(torch.randn(T, HEADS, D, generator=g, device=dev) * D ** -0.5).to(torch.bfloat16) for _ in range(copies)]
    # each query's selection: SLOTS distinct rows, ascending (the indexer's order)
    idx = torch.rand(T, history, generator=g, device=dev).topk(SLOTS, dim=1).indices.sort(dim=1).values
    valid = torch.ones(T, SLOTS, dtype=torch.bool, device=dev)
    if fill:  # query t of a first piece sees positions [0, t]: its first min(t + 1, SLOTS) slots
        seen = torch.arange(1, T + 1, device=dev).clamp(max=SLOTS)
        valid = torch.arange(SLOTS, device=dev)[None, :] < seen[:, None]
        idx = torch.where(valid, torch.arange(SLOTS, device=dev)[None, :].expand(T, SLOTS), 0)
    return qs, rows, idx, valid


def probe(dev: torch.device, specialized: bool = False) -> list[dict[str, Any]]:
    # (form, stages, BLOCK_N, warps): the kernel in use first (8 warps: two warpgroups, 255 registers,
    # 221 KB of shared memory, one program an SM); 16 warps halve the registers a thread needs for
    # the accumulator, other bits (the row sums' order follows the layout)
    variants = [("in use", 2, 64, 8), ("specialized", 2, 64, 8), ("specialized", 2, 64, 4)] if specialized else [
        ("in use", 2, 64, 8), ("in use", 2, 64, 16), ("in use", 1, 64, 16), ("unmasked", 2, 64, 16),
        ("in use", 1, 128, 16), ("in use", 2, 32, 16), ("in use", 3, 32, 16)]
    scale = D ** -0.5
    rows_out = []
    for history, fill in ((16384, False), (94000, False), (16384, True)):
        qs, rows, idx, valid = inputs(history, fill, dev)
        q0, rows_p, idx64, valid_p, end = ta._prepared(qs[0], rows, idx, valid)
        ref = None
        base_us = None
        for form, stages, block_n, warps in variants:
            indices = idx64
            out = torch.empty(T, HEADS, DV, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(T, HEADS, dtype=torch.float32, device=dev)
            try:
                run_variant(form, stages, q0, rows_p, indices, valid_p, end, out, lse, scale, block_n, warps)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                rows_out.append({"history": history, "fill": fill, "form": form, "stages": stages, "warps": warps,
                                 "block_n": block_n, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"{history:>6} {'fill' if fill else 'full':>4} {variant_key(form, stages, block_n, warps)}: "
                      f"{exc}"[:200])
                continue
            torch.cuda.synchronize()
            if ref is None:
                ref = (out.clone(), lse.clone())
            same = bool(torch.equal(out, ref[0]) and torch.equal(lse, ref[1]))
            split_same = None
            if (form, warps) != ("in use", 8) and block_n == 64 and history == 16384 and not fill:
                o16, l16 = ta.latent_attention(q0[:16], rows_p, idx64[:16], valid[:16], scale, DV, split=True)
                split_same = bool(torch.equal(o16, out[:16]) and torch.equal(l16, lse[:16]))
            outs = [torch.empty_like(out) for _ in qs]
            us = graph_time_us([lambda q=q, o=o: run_variant(form, stages, q, rows_p, indices, valid_p, end, o, lse,
                                                             scale, block_n, warps) for q, o in zip(qs, outs)],
                               replays=5)
            base_us = base_us or us
            key = variant_key(form, stages, block_n, warps)
            row = {"history": history, "fill": fill, "form": form, "stages": stages, "block_n": block_n,
                   "warps": warps, "asm": ASM.get(key),
                   "bitwise_as_in_use": same, "split_agrees": split_same, "us": round(us, 1),
                   "speedup": round(base_us / us, 3)}
            rows_out.append(row)
            print(f"{history:>6} {'fill' if fill else 'full':>4} {key:>22}: "
                  f"{us / 1e3:7.3f} ms  x{base_us / us:5.2f}  bitwise {same}  split {split_same}  "
                  f"{ASM.get(key)}", flush=True)
    return rows_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "prefill_attention.json")
    ap.add_argument("--specialized", action="store_true",
                    help="the slot loop as tl.range(warp_specialize=True) against the kernel in use")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_prefill_attention: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    result = result_header("probe_prefill_attention", {"heads": HEADS, "d": D, "value_dim": DV, "slots": SLOTS,
                                                       "queries": T}, dev)
    result["rows"] = probe(dev, args.specialized)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
