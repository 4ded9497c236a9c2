"""Header verification time against shard count, on real-size GLM-5.3 checkpoints of sparse files.

    python -m bench.bench_verify_headers [--shards 8,16,29,58] [--repeats 5] [--out bench/results/verify_headers.json]

For each shard count a checkpoint with GLM-5.3's real tensor list (78 layers, 256 experts, EXL3
mixed 2/3/4-bit experts: ~292 GiB apparent) is written as sparse files: real headers, the data a
hole, so it takes a few MiB of disk (checked: the run stops if a shard allocates more than its
header). Then, repeated: `verify_checkpoint` (index, every header, model-level tensor check) and
the report summary (EXL3 histogram + layout plan for 3 and 4 ranks), timed separately. Headers
are in the page cache (just written): warm numbers. Each checkpoint is deleted after its runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.meta import RESULTS, cpu_environment, result_header
from glm53.measurement import summary, write_json
from glm53.config import Glm53Config
from glm53.checkpoints.report import build_report
from glm53.synthetic.checkpoints import apparent_and_allocated, glm53_tensor_specs, real_config, write_checkpoint
from glm53.checkpoints.verify import verify_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default="8,16,29,58")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where the sparse checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "verify_headers.json"))
    args = ap.parse_args()
    counts = [int(x) for x in args.shards.split(",")]
    raw = real_config()
    cfg = Glm53Config.from_dict(raw)
    specs = list(glm53_tensor_specs(cfg))
    apparent_total = sum(s.nbytes for s in specs)
    rows = []
    base = Path(tempfile.mkdtemp(prefix="bench_verify_", dir=args.workdir))
    try:
        for n in counts:
            folder = base / f"ckpt_{n}"
            t0 = time.perf_counter()
            write_checkpoint(folder, raw, n_shards=n, sparse=True, specs=specs)
            write_s = time.perf_counter() - t0
            apparent = allocated = header_bytes = 0
            for shard in folder.glob("*.safetensors"):
                a, b = apparent_and_allocated(shard)
                with open(shard, "rb") as f:
                    h = 8 + int.from_bytes(f.read(8), "little")
                if b > h + (1 << 20):
                    raise SystemExit(f"{shard}: {b} bytes allocated for a {h}-byte header: this filesystem does not keep holes; "
                                     "pass --workdir on one that does (ext4, xfs, tmpfs)")
                apparent, allocated, header_bytes = apparent + a, allocated + b, header_bytes + h
            verify_s, summary_s, verify_cpu, summary_cpu = [], [], [], []
            for _ in range(args.repeats):
                c0, t0 = time.process_time(), time.perf_counter()
                result = verify_checkpoint(folder)
                c1, t1 = time.process_time(), time.perf_counter()
                report = build_report(result)
                c2, t2 = time.process_time(), time.perf_counter()
                verify_cpu.append(c1 - c0)
                summary_cpu.append(c2 - c1)
                if report["exit_code"] != 0:
                    raise SystemExit(f"verification of the synthetic checkpoint failed: {report['findings'][:3]}")
                verify_s.append(t1 - t0)
                summary_s.append(t2 - t1)
            rows.append({"shards": n, "tensors": len(specs), "apparent_bytes": apparent, "allocated_bytes": allocated,
                         "header_bytes": header_bytes, "write_seconds": write_s, "verify_seconds": verify_s,
                         "summary_seconds": summary_s, "verify": summary(verify_s), "summary": summary(summary_s),
                         "verify_cpu_seconds": verify_cpu, "summary_cpu_seconds": summary_cpu,
                         "verify_cpu": summary(verify_cpu), "summary_cpu": summary(summary_cpu),
                         "load_average_1m": os.getloadavg()[0],
                         "bytes_per_rank": report["summary"]["bytes_per_rank"]})
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    settings = {"repeats": args.repeats, "shard_counts": counts, "page_cache": "warm (headers just written)",
                "checkpoint": "GLM-5.3 real tensor list, EXL3 experts 2/3/4 bits (10/50/40%), sparse data",
                "apparent_bytes": apparent_total}
    header = result_header("verify_headers", settings, extra_versions=("huggingface_hub",))
    doc = {**header, "environment": cpu_environment(header), "rows": rows}
    out = write_json(args.out, doc, indent=2)
    print(f"\nheader verification, GLM-5.3 tensor list ({len(specs):,} tensors, {apparent_total / 2**30:.1f} GiB apparent), "
          f"{args.repeats} runs each, warm page cache; JSON: {out}")
    print("wall = elapsed; cpu = this process' CPU time (the machine is shared: wall includes waiting for a core)")
    print(f"{'shards':>6} {'on disk MiB':>11} {'headers MiB':>11} {'verify wall s med [min-max]':>28} {'cpu s':>6} "
          f"{'summary+plan wall s med [min-max]':>34} {'cpu s':>6} {'load':>5}")
    for r in rows:
        v, s, vc, sc = r["verify"], r["summary"], r["verify_cpu"], r["summary_cpu"]
        print(f"{r['shards']:>6} {r['allocated_bytes'] / 2**20:>11.1f} {r['header_bytes'] / 2**20:>11.1f} "
              f"{v['median']:>12.2f} [{v['min']:.2f}-{v['max']:.2f}] {vc['median']:>6.2f} "
              f"{s['median']:>18.2f} [{s['min']:.2f}-{s['max']:.2f}] {sc['median']:>6.2f} {r['load_average_1m']:>5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
