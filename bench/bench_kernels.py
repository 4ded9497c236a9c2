"""The row-invariant Triton kernels (glm53/ops/triton_*.py) on the GPU: an invariance probe, then timings vs torch.

    python -m bench.bench_kernels                                   # probe + timings -> bench/results/kernels.json
    python -m bench.bench_kernels --only probe --out /tmp/probe.json
    python -m bench.bench_kernels --dry-run                         # list the cases (no GPU needed)

(1) probe (bf16 linear, (N, K) in (2048, 2048), (6144, 2048), (2048, 6144), M in 1, 7, 64, 2048): the
same rows through tile configs that differ in BLOCK_M (16: mma.sync; 64, 128: wgmma on Hopper),
BLOCK_N and num_warps with the same BLOCK_K. Answers whether every config gives bitwise-identical rows (then
triton_linear.CONFIG_BY_ROWS = True would stay row-invariant), whether the default config is
row-invariant over M and offsets (it must be), and, for the record, whether torch.matmul (cuBLAS)
is (rows of M=2048 against the same rows at M=1 and M=7).
(2) timings at GLM-5.3 shapes, each kernel against its torch equivalent (cuBLAS for the matmuls, the
torch path glm53/ops/torch_ops.py for the rest): triton.testing.do_bench, median of its reps (it
also flushes L2 before each), inputs rotated over >= 64 MiB of copies so L2 cannot serve them;
cases under GRAPH_BELOW_MS also as CUDA-graph replays (do_bench_cudagraph), which leave out the host
launch time that can dominate a few-us kernel (Triton's Python launcher; slower on some hosts).

Prints a table last; writes JSON (bench/lib/meta.py header, probe results, timings). Exit 0 on
success, 2 on bad arguments, 3 when CUDA or Triton is missing.
On the GPU machine (no .git there): GLM53_KIT_COMMIT=<commit> python -m bench.bench_kernels
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any, Callable

import torch

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json

ROTATE_BYTES = 64 << 20  # more than the H200's 50-60 MB L2
MAX_COPIES = 32
GRAPH_BELOW_MS = 0.1  # cases faster than this are also timed as CUDA-graph replays

PROBE_SHAPES = [(2048, 2048), (6144, 2048), (2048, 6144)]  # (N, K)
PROBE_ROWS = [1, 7, 64, 2048]
PROBE_OFFSETS = [0, 1000]  # where the M rows start inside the 2048-row reference
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): same BLOCK_K, the rest varied
PROBE_CONFIGS = [(16, 32, 64, 4, 4), (16, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
                 (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3)]

LINEAR_SHAPES = [(2048, 6144), (16384, 2048), (6144, 16384), (12288, 6144)]  # (N, K)
LINEAR_ROWS = [1, 16, 2048]
HEAD_SHAPES = [(512, 192), (256, 512)]  # (N, K) per head
HEAD_ROWS = [1, 2048]
HEADS = 64
NORM_ROWS = [1, 2048]
HIDDEN = 6144
INDEX = dict(t=2048, heads=32, d=128, keys=[4096, 16384, 65536])
ATTN = dict(t=[1, 2048], heads=64, k=2048, d=576, value_dim=512, history=65536)


def cases() -> list[dict[str, Any]]:
    """Every timed case as plain data: op, shape dims, FLOPs and bytes moved (for the rates)."""
    out = []
    for n, k in LINEAR_SHAPES:
        for m in LINEAR_ROWS:
            out.append(dict(op="linear", m=m, n=n, k=k, flops=2 * m * n * k, bytes=2 * (m * k + n * k + m * n)))
    for n, k in HEAD_SHAPES:
        for t in HEAD_ROWS:
            out.append(dict(op="head_linear", t=t, h=HEADS, n=n, k=k, flops=2 * t * HEADS * n * k,
                            bytes=2 * HEADS * (t * k + n * k + t * n)))
    for rows in NORM_ROWS:
        out.append(dict(op="rms_norm", rows=rows, d=HIDDEN, flops=3 * rows * HIDDEN, bytes=2 * (2 * rows + 1) * HIDDEN))
    for n in INDEX["keys"]:
        t, h, d = INDEX["t"], INDEX["heads"], INDEX["d"]
        out.append(dict(op="index_scores", t=t, h=h, d=d, n=n, flops=2 * t * h * d * n,
                        bytes=2 * (t * h * d + n * d) + 4 * (t * h + t * n)))
    for t in ATTN["t"]:
        h, k, d, dv = ATTN["heads"], ATTN["k"], ATTN["d"], ATTN["value_dim"]
        out.append(dict(op="latent_attention", t=t, h=h, k=k, d=d, value_dim=dv, history=ATTN["history"],
                        flops=2 * t * h * k * (d + dv), bytes=2 * t * k * d + 9 * t * k + 2 * t * h * (d + dv)))
    return out


def case_label(c: dict[str, Any]) -> str:
    dims = {"linear": ("m", "n", "k"), "head_linear": ("t", "h", "n", "k"), "rms_norm": ("rows", "d"),
            "index_scores": ("t", "h", "d", "n"), "latent_attention": ("t", "h", "k", "d")}[c["op"]]
    return " ".join(f"{key}={c[key]}" for key in dims)


# --------------------------------------------------------------------------------------------- probe

def probe(device: torch.device) -> dict[str, Any]:
    from glm53.ops import triton_linear

    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    shapes = []
    for n, k in PROBE_SHAPES:
        x = (torch.randn(2048, k, generator=g, device=device) / math.sqrt(k)).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g, device=device).to(torch.bfloat16)
        configs = [triton_linear.LinearConfig(*c) for c in PROBE_CONFIGS]
        ref = triton_linear.linear(x, w, config=configs[-1])  # all 2048 rows, the widest tile
        per_config = []
        for raw, cfg in zip(PROBE_CONFIGS, configs):
            checks = []
            for m in PROBE_ROWS:
                for start in PROBE_OFFSETS:
                    if start + m > 2048:
                        continue
                    rows = slice(start, start + m)
                    got = triton_linear.linear(x[rows], w, config=cfg)
                    checks.append({"m": m, "start": start, "bitwise": bool(torch.equal(got, ref[rows])),
                                   "max_abs_diff": float((got.float() - ref[rows].float()).abs().max())})
            per_config.append({"config": list(raw),
                               "bitwise_all": all(c["bitwise"] for c in checks), "checks": checks})
        default_checks = []
        full = triton_linear.linear(x, w)
        for m in PROBE_ROWS:
            for start in PROBE_OFFSETS:
                if start + m <= 2048:
                    got = triton_linear.linear(x[start:start + m], w)
                    same = bool(torch.equal(got, full[start:start + m]))
                    default_checks.append({"m": m, "start": start, "bitwise": same})
        cublas_full = torch.matmul(x, w.T)
        cublas = []
        for m in (1, 7):
            for start in PROBE_OFFSETS:
                got = torch.matmul(x[start:start + m], w.T)
                cublas.append({"m": m, "start": start, "bitwise": bool(torch.equal(got, cublas_full[start:start + m])),
                               "max_abs_diff": float((got.float() - cublas_full[start:start + m].float()).abs().max())})
        # for the record: the same K order of bf16 tensor-core steps may give cuBLAS's very bits;
        # the control (fp32 products rounded once) should differ, showing a comparison can fail
        same_as_cublas = bool(torch.equal(full, cublas_full))
        control = bool(torch.equal(full, (x.float() @ w.float().T).to(torch.bfloat16)))
        shapes.append({"n": n, "k": k, "configs": per_config, "triton_equals_cublas_bitwise": same_as_cublas,
                       "control_equals_fp32_sgemm_bitwise": control,
                       "every_config_identical": all(c["bitwise_all"] for c in per_config),
                       "default_config_m2048": dataclasses.asdict(triton_linear.linear_config(2048, n, k, bf16)),
                       "default_row_invariant": all(c["bitwise"] for c in default_checks),
                       "default_checks": default_checks,
                       "cublas_row_invariant": all(c["bitwise"] for c in cublas), "cublas_checks": cublas})
    return {"config_fields": ["block_m", "block_n", "block_k", "num_warps", "num_stages"],
            "every_config_identical": all(s["every_config_identical"] for s in shapes),
            "default_row_invariant": all(s["default_row_invariant"] for s in shapes),
            "cublas_row_invariant": all(s["cublas_row_invariant"] for s in shapes),
            "config_by_rows_now": triton_linear.CONFIG_BY_ROWS, "shapes": shapes}


# -------------------------------------------------------------------------------------------- timing

def _copies(bytes_per_set: int) -> int:
    return max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(1, bytes_per_set))))


def _inputs(c: dict[str, Any], device: torch.device, g: torch.Generator) -> Callable[[], tuple]:
    """A function returning one input set per call, rotating over enough copies to exceed L2."""
    bf16 = torch.bfloat16

    def rand(*shape: int, std: float = 1.0, dtype: torch.dtype = bf16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    op = c["op"]
    if op == "linear":
        make = lambda: (rand(c["m"], c["k"], std=c["k"] ** -0.5), rand(c["n"], c["k"]))  # noqa: E731
    elif op == "head_linear":
        def make():  # x as the model passes it: q[..., :nope] of [T, H, nope + rope]
            return rand(c["t"], c["h"], c["k"] + 64, std=c["k"] ** -0.5)[..., :c["k"]], rand(c["h"], c["n"], c["k"])
    elif op == "rms_norm":
        make = lambda: (rand(c["rows"], c["d"]), rand(c["d"]))  # noqa: E731
    elif op == "index_scores":
        def make():
            return (rand(c["t"], c["h"], c["d"]), rand(c["t"], c["h"], dtype=torch.float32),
                    rand(c["n"], c["d"]))
    else:
        rows = rand(c["history"], c["d"])  # one cache (> L2); queries and selections rotate

        def make():
            idx = torch.randint(0, c["history"], (c["t"], c["k"]), generator=g, device=device)
            return rand(c["t"], c["h"], c["d"]), rows, idx, torch.ones(c["t"], c["k"], dtype=torch.bool, device=device)
    sets = [make() for _ in range(_copies(c["bytes"]))]  # bytes one call reads/writes (gathered rows too)
    turn = [0]

    def next_set() -> tuple:
        turn[0] += 1
        return sets[turn[0] % len(sets)]

    next_set.copies = len(sets)  # type: ignore[attr-defined]
    return next_set


def _fns(c: dict[str, Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(triton, torch) callables of one input set."""
    from glm53.ops import torch_ops, triton_attention, triton_indexer, triton_linear, triton_norm

    op = c["op"]
    if op == "linear":
        return triton_linear.linear, lambda x, w: torch.matmul(x, w.T)
    if op == "head_linear":
        return (triton_linear.head_linear,
                lambda x, w: torch.matmul(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1))
    if op == "rms_norm":
        return (lambda x, w: triton_norm.rms_norm(x, w, 1e-6)), (lambda x, w: torch_ops.rms_norm(x, w, 1e-6))
    scale = c["d"] ** -0.5
    if op == "index_scores":
        return ((lambda q, hw, k: triton_indexer.index_scores(q, hw, k, scale)),
                (lambda q, hw, k: torch_ops.index_scores(q, hw, k, scale)))
    dv = c["value_dim"]
    return ((lambda q, r, i, v: triton_attention.latent_attention(q, r, i, v, scale, dv)),
            (lambda q, r, i, v: torch_ops.latent_attention(q, r, i, v, scale, dv)))


def _bench(fn: Callable[[], Any], rep_ms: int) -> dict[str, float]:
    """do_bench's median (plus min, max, n) in ms; it clears L2 before every timed call."""
    import triton.testing

    try:
        samples = triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="all")
        return summary(list(samples), unit="ms")
    except AssertionError:  # an older triton without return_mode="all"
        med, lo, hi = triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.0, 1.0])
        return {"median_ms": med, "min_ms": lo, "max_ms": hi, "n": 0}


def _bench_graph(fn: Callable[[], Any], rep_ms: int) -> float:
    """Median ms per call replayed from a CUDA graph: no host launch cost (Triton's Python launcher
    costs tens of us, more on some hosts), no L2 flush (the rotation over >= 64 MiB stands in)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=max(20, rep_ms // 4), return_mode="median"))


def time_case(c: dict[str, Any], device: torch.device, g: torch.Generator, rep_ms: int) -> dict[str, Any]:
    next_set = _inputs(c, device, g)
    tri, ref = _fns(c)
    row: dict[str, Any] = {**c, "label": case_label(c), "copies": next_set.copies}
    for name, fn in (("triton", tri), ("torch", ref)):
        stats = _bench(lambda: fn(*next_set()), rep_ms)
        med_s = stats["median_ms"] / 1e3
        row[name] = {**stats, "tflops": c["flops"] / med_s / 1e12, "gb_per_s": c["bytes"] / med_s / 1e9}
        if stats["median_ms"] < GRAPH_BELOW_MS:  # small enough that host launch time may be what was timed
            try:
                row[name]["graph_median_ms"] = _bench_graph(lambda: fn(*next_set()), rep_ms)
            except Exception as exc:  # noqa: BLE001 - recorded; the eager number stands
                row[name]["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["speedup_vs_torch"] = row["torch"]["median_ms"] / row["triton"]["median_ms"]
    del next_set
    torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------------------ main

def print_probe(p: dict[str, Any]) -> None:
    print(f"probe: every linear config bitwise identical: {p['every_config_identical']}; default config row-invariant: "
          f"{p['default_row_invariant']}; cuBLAS row-invariant: {p['cublas_row_invariant']}")
    for s in p["shapes"]:
        bad = [c["config"] for c in s["configs"] if not c["bitwise_all"]]
        print(f"  N={s['n']} K={s['k']}: configs differing from {list(PROBE_CONFIGS[-1])} at some M/offset: "
              f"{bad or 'none'}; cuBLAS M=1/7 rows equal M=2048 rows: {s['cublas_row_invariant']}; "
              f"Triton == cuBLAS bitwise: {s['triton_equals_cublas_bitwise']}; (control, expect False) "
              f"Triton == fp32 sgemm rounded: {s['control_equals_fp32_sgemm_bitwise']}")


def print_table(rows: list[dict[str, Any]]) -> None:
    def graph(r: dict[str, Any], name: str) -> str:
        ms = r[name].get("graph_median_ms")
        return f"{ms:>10.4f}" if ms is not None else f"{'-':>10}"

    head = (f"{'op':<17}{'shape':<26}{'triton ms':>10}{'torch ms':>10}{'speedup':>9}{'tri TF/s':>10}{'tri GB/s':>10}"
            f"{'tri graph':>10}{'tch graph':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['op']:<17}{r['label']:<26}{r['triton']['median_ms']:>10.4f}{r['torch']['median_ms']:>10.4f}"
              f"{r['speedup_vs_torch']:>9.2f}{r['triton']['tflops']:>10.1f}{r['triton']['gb_per_s']:>10.0f}"
              f"{graph(r, 'triton')}{graph(r, 'torch')}")
    print("(ms: do_bench medians, L2 flushed per call; graph: CUDA-graph replay medians, only for cases under "
          f"{GRAPH_BELOW_MS} ms, free of host launch time)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("probe", "timing"), default=None, help="run one section (default: both)")
    ap.add_argument("--ops", nargs="+", default=None,
                    choices=("linear", "head_linear", "rms_norm", "index_scores", "latent_attention"),
                    help="time only these ops")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench's rep time per measurement (ms)")
    ap.add_argument("--dry-run", action="store_true", help="list the probe and timed cases; run nothing")
    ap.add_argument("--out", default=str(RESULTS / "kernels.json"))
    args = ap.parse_args(argv)
    if args.rep_ms <= 0:
        ap.error("--rep-ms must be positive")

    todo = [c for c in cases() if args.ops is None or c["op"] in args.ops]
    if args.dry_run:
        if args.only != "timing":
            print(f"probe: N,K {PROBE_SHAPES} x M {PROBE_ROWS} x offsets {PROBE_OFFSETS} "
                  f"x {len(PROBE_CONFIGS)} configs")
        if args.only != "probe":
            for c in todo:
                print(f"time: {c['op']:<17}{case_label(c)}")
        return 0
    if not torch.cuda.is_available():
        print("error: CUDA is not available here; run on the GPU machine (or --dry-run)", file=sys.stderr)
        return 3
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        print(f"error: triton is not importable ({exc})", file=sys.stderr)
        return 3
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 torch references stay fp32

    result: dict[str, Any] = {}
    if args.only != "timing":
        print("probe: linear tile configs vs bitwise row invariance ...", file=sys.stderr, flush=True)
        result["probe"] = probe(device)
    timings = []
    if args.only != "probe":
        g = torch.Generator(device=device).manual_seed(1)
        for c in todo:
            print(f"timing {c['op']} {case_label(c)} ...", file=sys.stderr, flush=True)
            timings.append(time_case(c, device, g, args.rep_ms))
    result["timings"] = timings
    settings = {"dtype": "bf16 (index head weights fp32)", "rotate_bytes": ROTATE_BYTES, "rep_ms": args.rep_ms,
                "timer": "triton.testing.do_bench, median", "only": args.only, "ops": args.ops}
    from glm53.ops import triton_linear

    settings["config_by_rows"] = triton_linear.CONFIG_BY_ROWS
    report = {**result_header("kernels", settings, device=device), **result}
    out = write_json(args.out, report)
    print(f"wrote {out}", file=sys.stderr)
    if "probe" in result:
        print_probe(result["probe"])
    if timings:
        print_table(timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
