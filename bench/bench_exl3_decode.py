"""Reference EXL3 decoder throughput: GB/s of fp16 weights produced, on the CPU and on CUDA.

    python -m bench.bench_exl3_decode --out results/exl3_decode.json [--device cpu|cuda|all] [--reps N]

Shapes are GLM-5.3 expert projections (gate/up: in 6144 -> out 2048; down: 2048 -> 6144), on random
trellis bits, for each K and codebook. Measured per tensor:
  decode_weight   the kit's full decode (trellis -> fp16 W incl. Hadamards and sign vectors)
  decode_rotated  the kit's trellis decode alone
and, where exllamav3 is importable on CUDA, side by side in the same loop (interleaved):
  exl3_reconstruct  exllamav3's ext.reconstruct (rotated only; its CUDA kernel)
  exl3_full         exllamav3's LinearEXL3.get_weight_tensor()
GB/s counts the fp16 weights written (in*out*2 bytes); trellis bytes read are listed too.
CUDA timing: CUDA events around each call after warm-up, inputs rotated over > 500 MB (L2 is 60 MB).
CPU timing: wall clock, fewer reps. Prints a table last; the JSON holds every sample.
Exit 0 on success; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.lib.exllamav3 import exllamav3_reference
from bench.lib.meta import result_header
from glm53.measurement import device_description, installed_version, summary, write_json
from glm53.exl3.decode import decode_rotated, decode_weight
from glm53.exl3.format import read_group

SHAPES = {"gate_up": (6144, 2048), "down": (2048, 6144)}
CASES = [("3inst", 2.0), ("3inst", 3.0), ("3inst", 4.0), ("mcg", 3.0), ("mul1", 3.0), ("mul1", 3.5)]


def _random_parts(codebook: str, bits: float, in_f: int, out_f: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, int(16 * bits)), generator=gen).to(torch.int16)
    parts = {
        "trellis": trellis,
        "suh": (torch.randint(0, 2, (in_f,), generator=gen) * 2 - 1).half(),
        "svh": (torch.randint(0, 2, (out_f,), generator=gen) * 2 - 1).half(),
    }
    if codebook == "mcg":
        parts["mcg"] = torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32)
    if codebook == "mul1":
        parts["mul1"] = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)
    return parts


def _try_exllamav3():
    try:
        return exllamav3_reference().import_exllamav3()
    except Exception as exc:  # noqa: BLE001 - the bench runs without exllamav3, saying why
        print(f"exllamav3 not available ({type(exc).__name__}: {exc}); its columns are left out", file=sys.stderr)
        return None


def _time_cuda(fn, inputs: list, reps: int) -> list[float]:
    for i in range(2):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    samples = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        x = inputs[r % len(inputs)]
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return samples


def _time_cpu(fn, inputs: list, reps: int) -> list[float]:
    fn(inputs[0])
    samples = []
    for r in range(reps):
        t = time.perf_counter()
        fn(inputs[r % len(inputs)])
        samples.append(time.perf_counter() - t)
    return samples


def bench_device(device: str, reps: int, exl) -> list[dict]:
    rows = []
    for shape_name, (in_f, out_f) in SHAPES.items():
        for codebook, bits in CASES:
            weight_bytes = in_f * out_f * 2
            trellis_bytes = in_f * out_f * bits / 8
            n_inputs = max(1, int(-(-500e6 // (weight_bytes + trellis_bytes)))) if device == "cuda" else 1
            groups = []
            for i in range(n_inputs):
                parts = {k: v.to(device) for k, v in _random_parts(codebook, bits, in_f, out_f, seed=i).items()}
                groups.append((read_group({f"g.{k}": v for k, v in parts.items()}, "g"), parts))
            timer = _time_cuda if device == "cuda" else _time_cpu
            fns = {
                "decode_weight": lambda g: decode_weight(g[0], device),
                "decode_rotated": lambda g: decode_rotated(g[0].trellis, g[0].bits, g[0].codebook),
            }
            if exl is not None and device == "cuda":
                ext, LinearEXL3 = exl
                k_arg = int(bits) if float(bits).is_integer() else bits
                lins = {
                    id(g[0]): LinearEXL3(None, in_f, out_f, suh=g[1]["suh"], svh=g[1]["svh"], trellis=g[1]["trellis"],
                                         mcg=g[1].get("mcg"), mul1=g[1].get("mul1"), out_dtype=torch.half, key="bench")
                    for g in groups
                }
                out_buf = torch.empty((in_f, out_f), dtype=torch.half, device=device)

                def exl_recon(g, k_arg=k_arg, out_buf=out_buf):
                    ext.reconstruct(out_buf, g[1]["trellis"], k_arg, "mcg" in g[1], "mul1" in g[1])

                fns["exl3_reconstruct"] = exl_recon
                fns["exl3_full"] = lambda g, lins=lins: lins[id(g[0])].get_weight_tensor()
            samples: dict[str, list[float]] = {name: [] for name in fns}
            # interleave the variants round by round so drift hits all alike
            rounds = 3
            for _ in range(rounds):
                for name, fn in fns.items():
                    samples[name] += timer(fn, groups, max(1, reps // rounds))
            for name, s in samples.items():
                stats = summary(s, unit="s")
                rows.append({
                    "device": device, "shape": shape_name, "in_features": in_f, "out_features": out_f,
                    "codebook": codebook, "bits": bits, "variant": name, "weight_bytes": weight_bytes,
                    "trellis_bytes": trellis_bytes, "samples_s": s, "median_s": stats["median_s"],
                    "min_s": stats["min_s"], "max_s": stats["max_s"],
                    "gbps_weights_median": weight_bytes / stats["median_s"] / 1e9,
                })
            print(f"  {device} {shape_name} {codebook} K={bits:g} done", file=sys.stderr)
            del groups
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    ap.add_argument("--commit", default=None, help="kit commit to record where the copy has no .git (default: git rev-parse HEAD, else $GLM53_KIT_COMMIT)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per variant on CUDA (CPU uses a third)")
    args = ap.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        if args.device == "cuda":
            print("--device cuda: no CUDA device here", file=sys.stderr)
            return 2
        devices.remove("cuda")
    exl = _try_exllamav3() if "cuda" in devices else None
    if "cuda" in devices:
        torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for device in devices:
        rows += bench_device(device, args.reps if device == "cuda" else max(3, args.reps // 10), exl)
    settings = {"reps_cuda": args.reps, "reps_cpu": max(3, args.reps // 10), "tf32": False,
                "timing": "CUDA events per call, inputs rotated over >500 MB; CPU wall clock"}
    header = result_header("exl3_decode", settings, device=devices[-1],
                           extra_versions=("exllamav3",) if exl is not None else ())
    if args.commit:  # an explicit --commit wins over git / GLM53_KIT_COMMIT
        header["git_commit"] = args.commit
    result = {
        **header,
        "devices": {d: device_description(d) for d in devices},
        "torch": torch.__version__,
        "triton": installed_version("triton"),
        "exllamav3": installed_version("exllamav3") if exl is not None else None,
        "results": rows,
    }
    write_json(args.out, result)
    print(f"{'device':6} {'shape':8} {'cb':6} {'K':>4} {'variant':17} {'median ms':>10} {'GB/s':>8}")
    for r in rows:
        print(f"{r['device']:6} {r['shape']:8} {r['codebook']:6} {r['bits']:4g} {r['variant']:17} "
              f"{r['median_s'] * 1e3:10.3f} {r['gbps_weights_median']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
