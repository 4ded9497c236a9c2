"""One GLM-5.3 MoE layer from its packed EXL3 weights on CUDA: decode (1, 4, 16 tokens) and prefill,
against the bytes floor, and exllamav3 1.6.5's own kernels on the same tensors, side by side.

    python -m bench.bench_exl3_moe --out bench/results/exl3_moe_h200.json [--exllamav3] [--forms ...]

The layer: 256 routed experts (6144 -> 2048 -> 6144, top 8), their widths a deterministic 2/3/4-bit
mix per projection (10/50/40 %, glm53.synthetic.checkpoints.default_expert_bits: ~3.3 bits, like the
3.38 bpw pack), one codebook (mcg), a shared expert (4/4/3 bits); random trellis bits, packed as the
loader packs them (glm53.exl3.packing, block-major) into one bank. Measured:
- decode: the kit's MLP (rotation, gate/up, down with each token's sum: three launches) over T tokens
  with random routing (distinct experts) and with every token on the same 8 experts (a drafting
  window's best case), captured in a CUDA graph; input sets rotated (--sets, each on other experts, so
  weights come from HBM, not L2). Bytes: the trellis of every expert the call touches (+ shared); the
  floor: bytes / the device-to-device copy bandwidth measured in the same run.
- prefill: --prefill tokens through the expert-sorted form (CUDA events, eager; the sort included); the
  default form stages the matrices with stage_rows rows or more (each decoded once into the stage,
  --stage-mb its bound, read by every row tile); --prefill-forms others, each checked bitwise.
- --forms: other tilings of the decode form side by side (BM,warps,stages,lanes,subk,...), each checked
  bitwise against the default.
- one linear (6144 -> 2048, K 3) at 1 and 2048 rows (at 1: the Triton decode form beside the default; at
  2048: staged, and unstaged beside it).
- --kernel-times: each decode form's device time launch by launch (torch.profiler, eager).
- --exllamav3: the same layer (and linear) through exllamav3's MoE kernels (tests/gpu/exllamav3_ref.py:
  its mixed-width layer runs one launch per width group, which exllamav3 itself cannot load: labelled),
  and a uniform 3-bit layer both ways (exllamav3's own path); outputs compared (fp16 activations).
Memory: the bank's bytes against torch's allocation for it, and the workspace (kernels' scratch).
Prints a table last; the JSON holds every sample.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language  # noqa: F401  (constexpr for --split-steps)

from bench.lib.exllamav3 import exllamav3_reference
from bench.lib.meta import result_header
from glm53.measurement import write_json
from glm53.exl3.bank import BankBuilder
from glm53.exl3.format import read_group
from glm53.exl3.packing import pack_layer_experts
from glm53.synthetic.checkpoints import default_expert_bits

MARKERS = {"mcg": 0xCBAC1FED - (1 << 32), "mul1": 0x83DCD12D - (1 << 32)}
PROJ = ("gate_proj", "up_proj", "down_proj")


def random_parts(gen: torch.Generator, in_f: int, out_f: int, bits: float, codebook: str) -> dict[str, torch.Tensor]:
    """One EXL3 linear's tensors with random trellis bits, made on gen's device (a 256-expert layer is
    4 GB of trellis: seconds to make and pack on the GPU, minutes on its host's CPU)."""
    dev, words = gen.device, int(16 * bits)
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, words), generator=gen, device=dev,
                            dtype=torch.int32).to(torch.int16)

    def signs(n: int, scale: float) -> torch.Tensor:
        sign = torch.randint(0, 2, (n,), generator=gen, device=dev) * 2 - 1
        return ((torch.rand(n, generator=gen, device=dev) + 0.5) * scale * sign).half()

    parts = {"trellis": trellis, "suh": signs(in_f, 1.0), "svh": signs(out_f, in_f ** -0.5)}
    if codebook in MARKERS:
        parts[codebook] = torch.tensor(MARKERS[codebook], dtype=torch.int32)
    return parts


def build_layer(experts: int, hidden: int, width: int, codebook: str, uniform: float | None, seed: int):
    """(bank, mats, parts) of one layer: parts[proj][e] the per-expert tensors (for exllamav3)."""
    from glm53.ops.triton_exl3 import MlpMatrices

    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, list[dict[str, torch.Tensor]]] = {p: [] for p in PROJ}
    for e in range(experts):
        for p in PROJ:
            bits = uniform or default_expert_bits(3, e, p)
            i, o = (hidden, width) if p != "down_proj" else (width, hidden)
            one = random_parts(gen, i, o, bits, codebook)
            parts[p].append(one)
            for k, v in one.items():
                tensors[f"model.layers.3.mlp.experts.{e}.{p}.{k}"] = v
    packed = pack_layer_experts(tensors, 3, experts)
    shared = {p: random_parts(gen, *((hidden, width) if p != "down_proj" else (width, hidden)), b, codebook)
              for p, b in zip(PROJ, (4.0, 4.0, 3.0))}
    builder = BankBuilder()
    index = builder.add_experts(packed)
    shared_idx = tuple(builder.add_group(read_group({f"s.{k}": v for k, v in shared[p].items()}, "s")) for p in PROJ)
    before = torch.cuda.memory_allocated()
    bank = builder.build("cuda")
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    mats = MlpMatrices(index["gate_proj"][0], index["up_proj"][0], index["down_proj"][0], experts, shared_idx, width,
                       hidden)
    return bank, mats, parts, shared, allocated


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written a second (2 GB, median of 5)."""
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * (1 << 31) / statistics.median(times[1:])


def routing_sets(t: int, experts: int, sets: int, same: bool, seed: int, hidden: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(sets):
        if same:
            ids = torch.randperm(experts, generator=g, device="cuda")[:8].repeat(t, 1)
        else:
            ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:8] for _ in range(t)])
        w = torch.rand(t, 8, generator=g, device="cuda") * 0.3
        x = torch.randn(t, hidden, generator=g, device="cuda").to(dtype)
        out.append((x, ids, w))
    return out


def touched_bytes(bank, mats, ids: torch.Tensor) -> int:
    lay = bank.layouts
    total = sum(lay[m].trellis_bytes for m in mats.shared)
    for e in torch.unique(ids).tolist():
        total += sum(lay[m0 + e].trellis_bytes for m0 in (mats.gate0, mats.up0, mats.down0))
    return total


def event_time_ms(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def stats(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def error_stats(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = (ours.float() - ref.float()).abs()
    return {"max_rel": float(err.max() / ref.float().abs().max()),
            "rms_rel": float(err.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())}


def decode_rows(tx, bank, mats, tokens: list[int], sets: int, reps: int, bw: float, dtype, forms) -> list[dict]:
    graph_time_us = exllamav3_reference().graph_time_us

    rows = []
    for t in tokens:
        for same in ((False, True) if t > 1 else (False,)):
            inputs = routing_sets(t, mats.n_experts, sets, same, 100 + t, mats.hidden, dtype)
            want = [tx.mlp(x, bank, mats, ids, w) for x, ids, w in inputs]
            nbytes = statistics.mean(touched_bytes(bank, mats, ids) for _, ids, _ in inputs)
            for form in forms:
                same_bits = all(torch.equal(tx.mlp(x, bank, mats, ids, w, form=form), ref)
                                for (x, ids, w), ref in zip(inputs, want))
                timing = graph_time_us(lambda x, ids, w, f=form: tx.mlp(x, bank, mats, ids, w, form=f), reps,
                                       inputs)
                floor = nbytes / bw * 1e6
                rows.append({"kind": "decode", "tokens": t, "routing": "same 8 experts" if same else "random",
                             "form": dataclasses.asdict(form), "bits_equal_default": same_bits, "bytes": nbytes,
                             "floor_us": floor, "us": timing["median_us"], "min_us": timing["min_us"],
                             "max_us": timing["max_us"], "x_floor": timing["median_us"] / floor, "mode": timing["mode"],
                             "samples_us": timing["samples_us"]})
                print(f"decode T={t} {'same' if same else 'random'} {form}: {timing['median_us']:.1f} us "
                      f"({rows[-1]['x_floor']:.2f}x floor {floor:.1f} us), bits equal {same_bits}", flush=True)
    return rows


def prefill_rows(tx, bank, mats, tokens: list[int], reps: int, dtype, forms) -> list[dict]:
    rows = []
    for t in tokens:
        (x, ids, w), = routing_sets(t, mats.n_experts, 1, False, 7, mats.hidden, dtype)
        want = None
        for form in forms:
            got = tx.mlp(x, bank, mats, ids, w, form=form)
            want = got if want is None else want
            samples = event_time_ms(lambda f=form: tx.mlp(x, bank, mats, ids, w, form=f), reps)
            rows.append({"kind": "prefill", "tokens": t, "form": dataclasses.asdict(form), "ms": stats(samples),
                         "bits_equal_first": bool(torch.equal(got, want)), "samples_ms": samples})
            print(f"prefill T={t} {form}: {statistics.median(samples):.2f} ms (min {min(samples):.2f})", flush=True)
    return rows


def linear_rows(tx, reps: int, bw: float, exl, forms) -> list[dict]:
    ref = exllamav3_reference()
    ExlLinear, graph_time_us = ref.ExlLinear, ref.graph_time_us

    gen = torch.Generator(device="cuda").manual_seed(5)
    sets = []
    for _ in range(8):  # 8 matrices: 42 MB of trellis, rotated
        parts = random_parts(gen, 6144, 2048, 3.0, "mcg")
        group = read_group({f"g.{k}": v for k, v in parts.items()}, "g")
        b = BankBuilder()
        m = b.add_group(group)
        sets.append((b.build("cuda"), m, {k: v.cuda() for k, v in parts.items()}))
    rows = []
    for rows_m in (1, 2048):
        g = torch.Generator(device="cuda").manual_seed(rows_m)
        xs = [torch.randn(rows_m, 6144, generator=g, device="cuda") for _ in sets]
        ours = graph_time_us(lambda x, bank, m: tx.linear(x, bank, m), reps,
                             [(x.to(torch.bfloat16), bank, m) for x, (bank, m, _) in zip(xs, sets)])
        row = {"kind": "linear", "rows": rows_m, "shape": [6144, 2048], "bits": 3, "us": ours["median_us"],
               "floor_us": sets[0][0].layouts[0].trellis_bytes / bw * 1e6, "mode": ours["mode"]}
        if rows_m <= tx.DECODE_ROWS:  # the Triton decode form beside the default (the CUDA split sums)
            x0, (bank0, m0, _) = xs[0].to(torch.bfloat16), sets[0]
            triton_form = graph_time_us(lambda x, bank, m: tx.linear(x, bank, m, form=tx.DECODE), reps,
                                        [(x.to(torch.bfloat16), bank, m) for x, (bank, m, _) in zip(xs, sets)])
            row.update(default_form=dataclasses.asdict(tx.decode_form(bank0, torch.bfloat16, m=m0)),
                       triton_decode_us=triton_form["median_us"],
                       triton_decode_bits_equal=bool(torch.equal(tx.linear(x0, bank0, m0),
                                                                 tx.linear(x0, bank0, m0, form=tx.DECODE))))
        full = tx.prefill_form(sets[0][0], torch.bfloat16)
        if 0 < full.stage_rows <= rows_m:  # the same rows with each row tile decoding the matrix itself
            plain = dataclasses.replace(full, stage_rows=0)
            unstaged = graph_time_us(lambda x, bank, m: tx.linear(x, bank, m, form=plain), reps,
                                     [(x.to(torch.bfloat16), bank, m) for x, (bank, m, _) in zip(xs, sets)])
            x0, (bank0, m0, _) = xs[0].to(torch.bfloat16), sets[0]
            row.update(unstaged_us=unstaged["median_us"], staged_bits_equal=bool(
                torch.equal(tx.linear(x0, bank0, m0), tx.linear(x0, bank0, m0, form=plain))))
            row["forms"] = []
            for form in forms:  # --prefill-forms on the same rows
                timing = graph_time_us(lambda x, bank, m, f=form: tx.linear(x, bank, m, form=f), reps,
                                       [(x.to(torch.bfloat16), bank, m) for x, (bank, m, _) in zip(xs, sets)])
                same = bool(torch.equal(tx.linear(x0, bank0, m0), tx.linear(x0, bank0, m0, form=form)))
                row["forms"].append({"form": dataclasses.asdict(form), "us": timing["median_us"], "bits_equal": same})
                print(f"linear 6144x2048 K3 M={rows_m} {form}: {timing['median_us']:.1f} us, bits equal {same}",
                      flush=True)
        if exl is not None:
            lins = [ExlLinear(p) for _, _, p in sets]
            theirs = graph_time_us(lambda x, lin: lin(x), reps, [(x.half(), lin) for x, lin in zip(xs, lins)])
            ref = lins[0](xs[0].half())
            row.update(exllamav3_us=theirs["median_us"], exllamav3_mode=theirs["mode"],
                       error_vs_exllamav3=error_stats(tx.linear(xs[0].half(), sets[0][0], sets[0][1]), ref))
        rows.append(row)
        print(f"linear 6144x2048 K3 M={rows_m}: {row['us']:.1f} us (floor {row['floor_us']:.1f})"
              + (f", unstaged {row['unstaged_us']:.1f} us (bits equal {row['staged_bits_equal']})"
                 if "unstaged_us" in row else "")
              + (f", exllamav3 {row['exllamav3_us']:.1f} us" if "exllamav3_us" in row else "")
              + (f", the Triton decode form {row['triton_decode_us']:.1f} us (bits equal "
                 f"{row['triton_decode_bits_equal']})" if "triton_decode_us" in row else ""), flush=True)
    return rows


def exllamav3_rows(tx, bank, mats, parts, shared, tokens: list[int], sets: int, reps: int, label: str) -> list[dict]:
    ref = exllamav3_reference()
    MoeReference, graph_time_us = ref.MoeReference, ref.graph_time_us

    moe = MoeReference(parts["gate_proj"], parts["up_proj"], parts["down_proj"],
                       {"gate": shared["gate_proj"], "up": shared["up_proj"], "down": shared["down_proj"]})
    rows = []
    for t in tokens:
        inputs = routing_sets(t, mats.n_experts, sets, False, 200 + t, mats.hidden, torch.float16)
        try:
            plan = moe.plan(t)
            theirs = graph_time_us(moe, reps, [(x, *moe.routing(ids, w)) for x, ids, w in inputs])
            ours = graph_time_us(lambda x, ids, w: tx.mlp(x, bank, mats, ids, w), reps, inputs)
            x, ids, w = inputs[0]
            err = error_stats(tx.mlp(x, bank, mats, ids, w), moe(x, ids, w))
        except NotImplementedError as exc:
            rows.append({"kind": "exllamav3", "layer": label, "tokens": t, "skipped": str(exc)})
            print(f"exllamav3 {label} T={t}: {exc}", flush=True)
            continue
        rows.append({"kind": "exllamav3", "layer": label, "tokens": t, "exllamav3_us": theirs["median_us"],
                     "exllamav3_mode": theirs["mode"], "ours_us": ours["median_us"], "error_vs_exllamav3": err,
                     "plan": plan})
        print(f"exllamav3 {label} T={t}: exllamav3 {theirs['median_us']:.1f} us ({theirs['mode']}, exact path "
              f"{plan['as_exllamav3_runs_it']}), ours {ours['median_us']:.1f} us; ours vs theirs {err}", flush=True)
    del moe
    return rows


def kernel_time_rows(tx, bank, mats, tokens: list[int], sets: int, dtype, forms) -> list[dict]:
    """Each decode form's device time per kernel (torch.profiler, eager, 3 passes over the input sets): where
    a call's time goes, launch by launch."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for t in tokens:
        inputs = routing_sets(t, mats.n_experts, sets, False, 100 + t, mats.hidden, dtype)
        for form in forms:
            for x, ids, w in inputs:  # compiled and warm before the profile
                tx.mlp(x, bank, mats, ids, w, form=form)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    for x, ids, w in inputs:
                        tx.mlp(x, bank, mats, ids, w, form=form)
                torch.cuda.synchronize()
            calls = 3 * len(inputs)
            kernels = {}
            for ev in prof.key_averages():
                total = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
                if total > 0:
                    kernels[ev.key] = {"us_per_call": total / calls, "launches_per_call": ev.count / calls}
            rows.append({"kind": "kernel_times", "tokens": t, "form": dataclasses.asdict(form), "kernels": kernels,
                         "us_per_call": sum(k["us_per_call"] for k in kernels.values())})
            top = sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_call"])[:6]
            print(f"kernel times T={t} {form_label(dataclasses.asdict(form))}: {rows[-1]['us_per_call']:.1f} us: "
                  + "; ".join(f"{name[:40]} {k['us_per_call']:.1f}" for name, k in top), flush=True)
    return rows


def parse_form(text: str):
    from glm53.ops.triton_exl3 import Form

    bm, warps, stages, lanes, subk, parallel, *rest = (int(v) for v in text.split(","))
    ptx, stage_rows, prefetch, cuda = (rest + [0, 0, 0, 0])[:4]
    return Form(bm, warps, stages, bool(lanes), subk, bool(parallel), bool(ptx), stage_rows, prefetch=bool(prefetch),
                cuda=bool(cuda))


def form_label(form: dict) -> str:
    if form.get("cuda"):
        return f"bm{form['bm']} CUDA split sums"
    decoder = "lanes" if form["lanes"] else "elements ptx" if form.get("ptx") else "elements"
    decoder += " prefetch" if form.get("prefetch") else ""
    staged = f" staged>={form['stage_rows']}" if form.get("stage_rows") else ""
    return f"bm{form['bm']} w{form['warps']} s{form['stages']} {decoder} k{form['subk']}{staged}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--codebook", default="mcg", choices=("3inst", "mcg", "mul1"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048])
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    fields = "BM,warps,stages,lanes,subk,parallel[,ptx[,stage_rows[,prefetch[,cuda]]]]"
    ap.add_argument("--forms", nargs="*", default=[], help=f"extra decode tilings {fields}")
    ap.add_argument("--prefill-forms", nargs="*", default=[], help=f"extra prefill tilings {fields}")
    ap.add_argument("--exllamav3", action="store_true", help="compare with exllamav3 1.6.5 (carried in .whl)")
    ap.add_argument("--stage-mb", type=int, default=None,
                    help="the prefill stage's bound in MiB (default triton_exl3.STAGE_BYTES)")
    ap.add_argument("--split-steps", type=int, default=None,
                    help="128-row steps a split (default triton_exl3.SPLIT_STEPS): another summation grouping, "
                         "every form alike")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also each decode form's device time per kernel (torch.profiler) at --tokens <= 16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_exl3_moe: needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    from glm53.ops import triton_exl3 as tx

    if args.split_steps is not None:  # before any kernel compiles: the kernels read it as a constant
        tx.SPLIT_STEPS, tx._SPLIT = args.split_steps, triton.language.constexpr(args.split_steps)
    if args.stage_mb is not None:
        tx.STAGE_BYTES = args.stage_mb << 20

    dtype = torch.bfloat16
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    bank, mats, parts, shared, allocated = build_layer(args.experts, args.hidden, args.width, args.codebook, None,
                                                       args.seed)
    print(f"layer built in {time.perf_counter() - t0:.0f} s: bank {bank.nbytes / 2**30:.3f} GiB, allocated "
          f"{allocated / 2**30:.3f} GiB", flush=True)
    decode_forms = [tx.DECODE, tx.DECODE_CUDA] + [parse_form(f) for f in args.forms]
    prefill_forms = [tx.prefill_form(bank, dtype)] + [parse_form(f) for f in args.prefill_forms]
    header = result_header("bench_exl3_moe", {"experts": args.experts, "hidden": args.hidden, "width": args.width,
                                             "top_k": 8, "codebook": args.codebook, "dtype": "bf16",
                                             "split_steps": tx.SPLIT_STEPS, "stage_bytes": tx.STAGE_BYTES,
                                             "mix": "default_expert_bits (2/3/4: 10/50/40 %)"}, device="cuda")
    result: dict[str, Any] = {**header, "copy_bandwidth_Bps": bw, "bank_bytes": bank.nbytes, "allocated_bytes": allocated,
                              "results": []}
    rows = result["results"]

    def section(name: str, fn) -> None:  # noqa: ANN001 - a failed part is recorded; what was measured is kept
        try:
            rows.extend(fn())
        except Exception as exc:  # noqa: BLE001
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"kind": name, "failed": f"{type(exc).__name__}: {exc}"})
        result["scratch_bytes"] = tx.SCRATCH.nbytes
        write_json(args.out, result)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    section("decode", lambda: decode_rows(tx, bank, mats, args.tokens, args.sets, args.reps, bw, dtype, decode_forms))
    result["decode_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    if args.kernel_times:
        section("kernel_times", lambda: kernel_time_rows(tx, bank, mats, [t for t in args.tokens if t <= 16],
                                                         args.sets, dtype, decode_forms))
    section("prefill", lambda: prefill_rows(tx, bank, mats, args.prefill, max(3, args.reps // 4), dtype, prefill_forms))
    exl = None
    if args.exllamav3:
        try:
            ref = exllamav3_reference()

            exl = ref.import_exllamav3()  # waits on the build lock when a background build is running
        except Exception as exc:  # noqa: BLE001 - the kit's own numbers still stand; the JSON says why
            print(f"exllamav3 unavailable: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"kind": "exllamav3", "skipped": f"{type(exc).__name__}: {exc}"})
    section("linear", lambda: linear_rows(tx, args.reps, bw, exl, prefill_forms[1:]))
    if exl is not None:
        section("exllamav3", lambda: exllamav3_rows(
            tx, bank, mats, parts, shared, [t for t in args.tokens if t <= 16], args.sets, args.reps,
            "mixed 2/3/4-bit (exllamav3: one launch per width group)"))
        del bank, parts
        torch.cuda.empty_cache()
        bank3, mats3, parts3, shared3, _ = build_layer(args.experts, args.hidden, args.width, args.codebook, 3.0,
                                                       args.seed + 1)
        section("exllamav3", lambda: exllamav3_rows(
            tx, bank3, mats3, parts3, shared3, [t for t in args.tokens if t <= 8], args.sets, args.reps,
            "uniform 3-bit (exllamav3's own path)"))
    print("\n| kind | tokens | routing / form | us or ms | floor | x floor |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "failed" in r or "skipped" in r:
            print(f"| {r['kind']} | | {r.get('failed') or r.get('skipped')} | | | |")
        elif r.get("kind") == "decode":
            print(f"| decode | {r['tokens']} | {r['routing']} {form_label(r['form'])} | "
                  f"{r['us']:.1f} us | {r['floor_us']:.1f} us | {r['x_floor']:.2f} |")
        elif r.get("kind") == "kernel_times":
            print(f"| kernel times | {r['tokens']} | {form_label(r['form'])} | {r['us_per_call']:.1f} us (eager) | | |")
        elif r.get("kind") == "prefill":
            print(f"| prefill | {r['tokens']} | {form_label(r['form'])} | {r['ms']['median']:.2f} ms | | |")
        elif r.get("kind") == "linear":
            print(f"| linear | {r['rows']} | 6144x2048 K3 | {r['us']:.1f} us | {r['floor_us']:.1f} us | "
                  f"{r['us'] / r['floor_us']:.2f} |")
            if "triton_decode_us" in r:
                print(f"| linear | {r['rows']} | 6144x2048 K3 Triton decode form | {r['triton_decode_us']:.1f} us | | |")
            if "unstaged_us" in r:
                print(f"| linear | {r['rows']} | 6144x2048 K3 unstaged | {r['unstaged_us']:.1f} us | | |")
        elif r.get("kind") == "exllamav3" and "ours_us" in r:
            print(f"| vs exllamav3 | {r['tokens']} | {r['layer']} | ours {r['ours_us']:.1f} / theirs "
                  f"{r['exllamav3_us']:.1f} us | | |")


if __name__ == "__main__":
    main()
