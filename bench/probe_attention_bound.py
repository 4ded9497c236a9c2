"""What bounds latent_attention's prefill kernel: its time with one part of each slot block's work
left out (GLM-5.3: 64 heads x 576, value 512, bf16, 2048 selected slots of a 16k-row cache).

    python bench/probe_attention_bound.py --out bench/results/attention_bound_h200.json      # GPU
    python bench/probe_attention_bound.py --ncu-target      # one launch of the kernel in use, for ncu

'in use' is glm53.ops.triton_attention._latent_attention_kernel as the engine runs it (validity a
prefix of the slots); 'loaded_valid' the same kernel loading validity from the mask (the same bits).
The other forms are its loop with one change; the first six do not compute attention: they are
timing arms, and the differences between their times place the kernel's time in its parts:
  * no_pv: the values product left out (the scores, the softmax and the gather stay);
  * no_qk: the scores product left out (scores 0 at valid slots; the rope columns are not gathered);
  * no_softmax: the scores go to the values product as they are (no max, exp, rescale or sums);
  * contiguous: each block gathers 64 consecutive rows (the same bytes, as whole cache lines in a row);
  * hot_rows: every index taken modulo 256, so the gathered rows stay in L2 (and L1);
  * dots_only: no_softmax over hot rows;
  * exp2_lazy: the running max moved only when a score passes it by 2^8 (new bits);
  * transposed: the slots as the products' M (128 a block, unpipelined), so that no warpgroup
    computes the other's scores (new bits; `_transposed_kernel`). Compiled here for sm_90 (Triton
    3.9) its loop is 17.5 instructions a warp per slot against 24.9, but on the H200 (Triton 3.6)
    it took 1.22x the kernel's time, with 124 registers spilled (attention_bound_h200_d.json).
At 30beb74 (bench/results/attention_bound_h200_b.json) the kernel before validity became a
prefix compare and the masks on p were dropped was the baseline; those two forms, now in the
kernel, were 0.91x and 0.95x of its time, both 0.88x, bitwise the same. At fd25b13
(attention_bound_h200_d.json) an exp2_ftz form (scores in log2 units, 2^x as one ex2.approx.ftz)
took 0.84x of the kernel's time; the kernel has run that way since the twentieth session.
Time: a CUDA graph of 4 calls on rotating queries, replayed, CUDA events (probe_decode_tiles).
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
from bench.probe_prefill_attention import _program_start, asm_stats, inputs  # noqa: E402
from glm53.ops import triton_attention as ta  # noqa: E402
from glm53.ops.triton_launch import OPTIONS  # noqa: E402

HEADS, D, DV, SLOTS, T = 64, 576, 512, 2048, 2048
FORMS = {"in use": 0, "loaded_valid": 0, "no_pv": 1, "no_qk": 2, "no_softmax": 3, "contiguous": 4, "hot_rows": 5,
         "dots_only": 6, "exp2_lazy": 10, "transposed": -1}
TRANSPOSED = (128, 8, 1)  # BLOCK_N (the products' M), warps, stages: 221 KB for sm_90 unpipelined


@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _ablation_kernel(q_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, out_ptr, lse_ptr, T, K_SLOTS, H, scale,
                     stride_qt, stride_qh, stride_r, stride_it, stride_vt, stride_ot, stride_oh, stride_lt,
                     DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, FORM: tl.constexpr):
    t, offs_h, offs_v, offs_r, h_mask, v_mask, r_mask, q_v, q_r, m, l, acc, end = _program_start(
        q_ptr, end_ptr, H, stride_qt, stride_qh, DV, DR, BLOCK_H, BLOCK_DV, BLOCK_DR)
    for jb in range(0, tl.cdiv(end, BLOCK_N)):
        idx, ok = ta._block_slots(idx_ptr, valid_ptr, end, t, jb, K_SLOTS, stride_it, stride_vt, BLOCK_N, True)
        if FORM == 4:
            idx = (t * 131 + jb * BLOCK_N + tl.arange(0, BLOCK_N)) % 16384
        if FORM == 5 or FORM == 6:
            idx = idx % 256
        row = rows_ptr + idx[:, None] * stride_r
        kv_v = tl.load(row + offs_v[None, :], mask=ok[:, None] & v_mask[None, :], other=0.0)
        if FORM == 2:
            s = tl.where(ok[None, :], tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32), float("-inf"))
        else:
            s = tl.dot(q_v, tl.trans(kv_v))
            kv_r = tl.load(row + DV + offs_r[None, :], mask=ok[:, None] & r_mask[None, :], other=0.0)
            s = tl.dot(q_r, tl.trans(kv_r), s)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
        if FORM == 3 or FORM == 6:
            acc = tl.dot(s.to(kv_v.dtype), kv_v, acc)
            l = l + 1.0  # else l stays 0, the output is 0 and the compiler drops the loop
        elif FORM == 10:  # the running max moves only when a score passes it by 2^8: rescales are rare
            m_blk = tl.max(s, axis=1)
            if tl.max((m_blk > m + 8.0).to(tl.int32)) > 0:
                m_new = tl.maximum(m, m_blk)
                alpha = tl.where(m_new > float("-inf"), ta._exp2(m - m_new), 1.0)
                acc = acc * alpha[:, None]
                l = l * alpha
                m = m_new
            p = ta._exp2(s - tl.where(m > float("-inf"), m, 0.0)[:, None])
            l = l + tl.sum(p, axis=1)
            acc = tl.dot(p.to(kv_v.dtype), kv_v, acc)
        elif FORM == 1:
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = ta._exp2(s - m_new[:, None])
            l = l * ta._exp2(m - m_new) + tl.sum(p, axis=1)
            m = m_new
        else:
            m, l, acc = ta._softmax_step(m, l, acc, s, ok, kv_v, False)
    ta._store_result(out_ptr, lse_ptr, t, stride_ot, stride_oh, stride_lt, acc, l, m, offs_h, h_mask, offs_v, v_mask,
                     True)


@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _transposed_kernel(q_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, out_ptr, lse_ptr, T, K_SLOTS, H, scale,
                       stride_qt, stride_qh, stride_r, stride_it, stride_vt, stride_ot, stride_oh, stride_lt,
                       DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr):
    """Attention with the slots as the products' M: S^T = K Q^T [BLOCK_N, BLOCK_H], the softmax down
    its columns, O^T += V^T P^T [BLOCK_DV, BLOCK_H] (P^T through shared memory, a B operand). Nothing
    chains one product's registers into the next, so Triton need not lay S over all 8 warps along M
    and compute it in both warpgroups. Other bits than the kernel in use (other sums)."""
    t, offs_h, offs_v, offs_r, h_mask, v_mask, r_mask, q_v, q_r, m, l, acc0, end = _program_start(
        q_ptr, end_ptr, H, stride_qt, stride_qh, DV, DR, BLOCK_H, BLOCK_DV, BLOCK_DR)
    acc = tl.zeros((BLOCK_DV, BLOCK_H), dtype=tl.float32)
    for jb in range(0, tl.cdiv(end, BLOCK_N)):
        idx, ok = ta._block_slots(idx_ptr, valid_ptr, end, t, jb, K_SLOTS, stride_it, stride_vt, BLOCK_N, True)
        row = rows_ptr + idx[:, None] * stride_r
        kv_v = tl.load(row + offs_v[None, :], mask=ok[:, None] & v_mask[None, :], other=0.0)
        kv_r = tl.load(row + DV + offs_r[None, :], mask=ok[:, None] & r_mask[None, :], other=0.0)
        st = tl.dot(kv_v, tl.trans(q_v))
        st = tl.dot(kv_r, tl.trans(q_r), st)
        st = tl.where(ok[:, None], st * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(st, axis=0))
        seen = m_new > float("-inf")
        alpha = tl.where(seen, tl.exp(m - m_new), 1.0)
        p = tl.where(ok[:, None] & seen[None, :], tl.exp(st - tl.where(seen, m_new, 0.0)[None, :]), 0.0)
        l = l * alpha + tl.sum(p, axis=0)
        acc = tl.dot(tl.trans(kv_v), p.to(kv_v.dtype), acc * alpha[None, :])
        m = m_new
    has = l > 0.0
    out = tl.where(has[None, :], acc / tl.where(has, l, 1.0)[None, :], 0.0)
    tl.store(out_ptr + t * stride_ot + offs_h[None, :] * stride_oh + offs_v[:, None], out.to(out_ptr.dtype.element_ty),
             mask=h_mask[None, :] & v_mask[:, None])
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * stride_lt + offs_h, lse, mask=h_mask)


ASM: dict[str, dict] = {}


def launch(form: str, q, rows, indices, valid, end, out, lse, scale: float) -> None:
    t, heads, d = q.shape
    block_h, block_n, warps, stages = ta.attention_config(heads, d, DV, q.dtype)
    grid = (t, triton.cdiv(heads, block_h))
    # the kernel in use takes the scale in log2 units (its softmax is 2^x); the other forms their own
    kernel_scale = float(scale) if form == "transposed" else ta._kernel_scale(scale)
    args = (q, rows, indices, valid, end, out, lse, t, indices.shape[1], heads, kernel_scale,
            q.stride(0), q.stride(1), rows.stride(0), indices.stride(0), valid.stride(0), out.stride(0),
            out.stride(1), lse.stride(0))
    if form == "transposed":
        block_n, warps, stages = TRANSPOSED
        k = _transposed_kernel[grid](*args, **ta._query_blocks(d, DV), BLOCK_H=block_h, BLOCK_N=block_n,
                                     num_warps=warps, num_stages=stages, **OPTIONS)
    elif form in ("in use", "loaded_valid"):
        k = ta._latent_attention_kernel[grid](*args, **ta._query_blocks(d, DV), BLOCK_H=block_h, BLOCK_N=block_n,
                                              IEEE=False, PREFIX=form == "in use", num_warps=warps, num_stages=stages,
                                              **OPTIONS)
    else:
        k = _ablation_kernel[grid](*args, **ta._query_blocks(d, DV), BLOCK_H=block_h, BLOCK_N=block_n,
                                   FORM=FORMS[form], num_warps=warps, num_stages=stages, **OPTIONS)
    if form not in ASM:
        ASM[form] = asm_stats(k)


def probe(dev: torch.device) -> list[dict[str, Any]]:
    scale = D ** -0.5
    qs, rows, idx, valid = inputs(16384, False, dev)
    q0, rows_p, idx64, valid_p, end = ta._prepared(qs[0], rows, idx, valid)
    lse = torch.empty(T, HEADS, dtype=torch.float32, device=dev)
    results, base, ref = [], None, None
    for form in FORMS:
        outs = [torch.empty(T, HEADS, DV, dtype=torch.bfloat16, device=dev) for _ in qs]
        launch(form, q0, rows_p, idx64, valid_p, end, outs[0], lse, scale)
        torch.cuda.synchronize()
        if ref is None:
            ref = (outs[0].clone(), lse.clone())
        same = bool(torch.equal(outs[0], ref[0]) and torch.equal(lse, ref[1]))
        out_diff = (outs[0].float() - ref[0].float()).abs().max().item()
        lse_diff = (lse - ref[1]).abs().max().item()
        us = graph_time_us([lambda q=q, o=o: launch(form, q, rows_p, idx64, valid_p, end, o, lse, scale)
                            for q, o in zip(qs, outs)], replays=5)
        base = base or us
        # per slot block of one program (132 SMs, one program an SM)
        per_block_us = us * torch.cuda.get_device_properties(dev).multi_processor_count / (T * SLOTS / 64)
        row = {"form": form, "us": round(us, 1), "of_in_use": round(us / base, 3),
               "us_per_block_per_sm": round(per_block_us, 3), "bitwise_as_in_use": same,
               "max_abs_diff_out": out_diff, "max_abs_diff_lse": lse_diff, "asm": ASM.get(form)}
        results.append(row)
        print(f"{form:>12}: {us / 1e3:7.3f} ms  {us / base:5.2f} of in use  {per_block_us:6.2f} us a block an SM  "
              f"bitwise {same}  diff out {out_diff:.3g} lse {lse_diff:.3g}  {ASM.get(form)}", flush=True)
    # the two exact forms on a first piece's fill-up (query t: its first min(t + 1, 2048) slots valid)
    qs, rows, idx, valid = inputs(16384, True, dev, copies=1)
    q0, rows_p, idx64, valid_p, end = ta._prepared(qs[0], rows, idx, valid)
    outs = {}
    for form in ("in use", "loaded_valid"):
        out = torch.empty(T, HEADS, DV, dtype=torch.bfloat16, device=dev)
        lse_f = torch.empty(T, HEADS, dtype=torch.float32, device=dev)
        launch(form, q0, rows_p, idx64, valid_p, end, out, lse_f, scale)
        outs[form] = (out, lse_f)
    torch.cuda.synchronize()
    for form in ("loaded_valid",):
        same = bool(torch.equal(outs[form][0], outs["in use"][0]) and torch.equal(outs[form][1], outs["in use"][1]))
        results.append({"form": form, "fill": True, "bitwise_as_in_use": same})
        print(f"{form:>12} (fill-up): bitwise {same}", flush=True)
    return results


def ncu_target(dev: torch.device) -> None:
    """Three launches of the kernel in use (ncu: --launch-skip 2 --launch-count 1)."""
    qs, rows, idx, valid = inputs(16384, False, dev, copies=1)
    q0, rows_p, idx64, valid_p, end = ta._prepared(qs[0], rows, idx, valid)
    out = torch.empty(T, HEADS, DV, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, HEADS, dtype=torch.float32, device=dev)
    for _ in range(3):
        launch("in use", q0, rows_p, idx64, valid_p, end, out, lse, D ** -0.5)
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "attention_bound.json")
    ap.add_argument("--ncu-target", action="store_true", help="only launch the kernel in use three times")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_attention_bound: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if args.ncu_target:
        ncu_target(dev)
        return 0
    result = result_header("probe_attention_bound", {"heads": HEADS, "d": D, "value_dim": DV, "slots": SLOTS,
                                                     "queries": T, "history": 16384}, dev)
    result["rows"] = probe(dev)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
