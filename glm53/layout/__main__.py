"""`python -m glm53.layout MODEL_DIR --ranks R [--json]`: the TP layout plan and bytes per rank.

Exit codes: 0 plan printed; 1 the checkpoint cannot be read or split (message on stderr); 2 usage.
"""
from __future__ import annotations

import json
import sys

import click

from glm53.config import ConfigError
from glm53.formats.safetensors_header import ShardError
from .kv import kv_bytes_per_rank
from .plan import PlanError, plan_layout

GIB = 1 << 30


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--ranks", "-r", type=click.IntRange(1, 8), required=True, help="Tensor-parallel ranks (1..8).")
@click.option("--context", type=click.IntRange(0), default=1 << 20, show_default=True, help="Context length for the KV estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan summary as JSON.")
def main(model_dir: str, ranks: int, context: int, as_json: bool) -> None:
    """Print how MODEL_DIR's weights split over RANKS ranks, and the bytes each rank holds."""
    try:
        plan = plan_layout(model_dir, ranks)
    except (PlanError, ShardError, ConfigError, OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    summary = plan.summary()
    kv = {f"dcp_{'on' if dcp else 'off'}_{dt}": kv_bytes_per_rank(plan.config, context, ranks, dcp=dcp, kv_dtype=dt)
          for dcp in (True, False) for dt in ("bf16", "fp8")}
    summary["kv_context_tokens"] = context
    summary["kv_bytes_per_rank"] = kv
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"{model_dir}: {len(plan.tensors):,} tensors, {_human(plan.total_bytes)}, {ranks} rank(s)")
    click.echo(f"attention heads per rank: {summary['heads_per_rank']}")
    click.echo("expert 128-blocks per rank, by layer % R: " + " ".join(str(x) for x in summary["expert_blocks_per_rank_by_layer_mod_ranks"]))
    for rule, n in sorted(summary["tensors_by_rule"].items()):
        click.echo(f"  {rule:<16} {n:>8,} tensors  {_human(summary['bytes_by_rule'][rule]):>12}")
    if summary["widened_exl3_modules"]:
        click.echo(f"EXL3 modules read widened to 128-blocks (extra rows computed and dropped): {len(summary['widened_exl3_modules'])}")
    if summary["unclassified"]:
        click.echo(f"replicated for want of a rule ({len(summary['unclassified'])}): {', '.join(summary['unclassified'][:5])} ...")
    click.echo(f"KV cache at {context:,} tokens per rank (GiB):")
    for key, values in kv.items():
        click.echo(f"  {key:<14} " + " ".join(f"{v / GIB:8.2f}" for v in values))
    click.echo("rank  weights")
    for r, b in enumerate(summary["bytes_per_rank"]):
        click.echo(f"{r:>4}  {_human(b):>12}  ({b:,} bytes)")


if __name__ == "__main__":
    main()
