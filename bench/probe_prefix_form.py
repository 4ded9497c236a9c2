"""Where latent_attention's prefix form (validity a compare with the row's end) differs in its bits
from the loaded form: which kernel, which queries, by how much.

    python bench/probe_prefix_form.py --out bench/results/prefix_form_h200.json     # GPU

`prefix_choice` runs `prefix_agreement`'s case (16 queries over 2053 slots, half of them full, the
rest a random count of valid slots first) and says yes or no per shape. This probe runs the same
case at GLM-5.3's 64 heads, a TP4 rank's 16 and the tiny model's 4, every way a call can go: the
prefill kernel with the mask loaded (the reference), the prefill kernel comparing, and the split
kernels (each candidate config) both ways. For each way against the reference: equal or not, the
queries that differ with their valid counts, and the largest difference in out and lse.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402
from glm53.ops import triton_attention as ta  # noqa: E402

# GLM-5.3's 64 heads (DCP too: a rank gathers every head), a TP4 rank's 16 without DCP, the tiny model's 4
# (bench/results/prefix_form_h200.json calls the 16-head shape dcp_16)
SHAPES = {"glm53_64": (64, 576, 512), "tp4_rank_16": (16, 576, 512), "tiny_4": (4, 80, 64)}


def compare(ref: tuple, got: tuple, counts: torch.Tensor) -> dict[str, Any]:
    out_eq = (ref[0] == got[0]).flatten(1).all(1)
    lse_eq = ((ref[1] == got[1]) | (ref[1].isinf() & got[1].isinf())).all(1)
    bad = (~(out_eq & lse_eq)).nonzero().flatten().tolist()
    finite = ref[1].isfinite() & got[1].isfinite()
    return {"bitwise": not bad, "queries_differing": bad, "their_valid_counts": counts[bad].tolist(),
            "max_abs_diff_out": (ref[0].float() - got[0].float()).abs().max().item(),
            "max_abs_diff_lse": (ref[1] - got[1]).abs()[finite].max().item() if finite.any() else 0.0}


def probe_shape(name: str, heads: int, d: int, dv: int, dev: torch.device) -> list[dict[str, Any]]:
    args, counts = ta.prefix_case(heads, d, torch.bfloat16, torch.bfloat16, dev)
    ways: dict[str, Callable] = {"prefill prefix": lambda *a: ta._run_prefill(*a, prefix=True)}
    fitted = ta._fit_for(heads, d, dv, torch.bfloat16, torch.bfloat16, dev)
    for cfg in ta.split_candidates(heads, d, dv, torch.bfloat16, fitted):
        for prefix in (False, True):
            ways[f"split {cfg} {'prefix' if prefix else 'loaded'}"] = (
                lambda *a, cfg=cfg, prefix=prefix: ta._run_split(*a, config=cfg, prefix=prefix))
    ref = ta.run_outputs(ta._run_prefill, args, heads, d, dv, torch.bfloat16)
    rows = []
    for way, run in ways.items():
        got = ta.run_outputs(run, args, heads, d, dv, torch.bfloat16)
        row = {"shape": name, "heads": heads, "way": way, **compare(ref, got, counts)}
        rows.append(row)
        print(f"{name:>9} {way:>34}: bitwise {row['bitwise']}  queries {row['queries_differing']} "
              f"(valid {row['their_valid_counts']})  diff out {row['max_abs_diff_out']:.3g} "
              f"lse {row['max_abs_diff_lse']:.3g}", flush=True)
    config = ta.attention_config(heads, d, dv, torch.bfloat16, fitted)
    choice = {"shape": name, "prefill_config": list(config),
              "split_choice": ta.split_choice(heads, d, dv, torch.bfloat16, torch.bfloat16, dev),
              "prefix_choice": ta.prefix_choice(heads, d, dv, torch.bfloat16, torch.bfloat16, dev)}
    print(f"{name:>9} prefill config {config}, split_choice {choice['split_choice']}, "
          f"prefix_choice {choice['prefix_choice']}", flush=True)
    return rows + [choice]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "prefix_form.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_prefix_form: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    result = result_header("probe_prefix_form", {"queries": ta.CHECK_QUERIES, "slots": ta.CHECK_SLOTS,
                                                 "rows": ta.CHECK_ROWS, "dtype": "bfloat16"}, dev)
    result["rows"] = [r for name, shape in SHAPES.items() for r in probe_shape(name, *shape, dev)]
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
