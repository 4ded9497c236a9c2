"""What every benchmark result carries (bench/results/README.md, "Method"): the kit's commit, the device, the
versions, the settings, and median/min/max over the samples (glm53.measurement); written atomically as JSON.

    from bench.lib.meta import result_header
    from glm53.measurement import summary, write_json
    result = {**result_header("my_bench", {"dtype": "bf16", "ranks": 1}, device="cuda"), "results": rows}
    write_json(out, result)

On the GPU machine the repo arrives without .git: run the bench there with
GLM53_KIT_COMMIT=<the commit the copy was made from> so the result still names it.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterable

from glm53 import measurement
from glm53.measurement import cpu_model, device_description, versions

KIT_ROOT = Path(__file__).resolve().parents[2]
RESULTS = KIT_ROOT / "bench" / "results"


def git_commit(repo: Path | str = KIT_ROOT) -> str:
    """The commit of the checkout these benches run from (a copy of bench/ without .git: GLM53_KIT_COMMIT,
    else "unknown"); glm53.measurement.git_commit says how."""
    return measurement.git_commit(repo)


def result_header(bench_name: str, settings: dict[str, Any], device: Any = "cpu",
                  extra_versions: Iterable[str] = ()) -> dict[str, Any]:
    """The fields every result starts with: bench, git_commit, device, cpu_cores, torch_threads (None
    when the bench does not use torch), versions, settings."""
    torch = sys.modules.get("torch")  # only a bench that uses torch has threads worth recording
    threads = torch.get_num_threads() if torch is not None else None
    return {"bench": bench_name, "git_commit": git_commit(), "device": device_description(device),
            "cpu_cores": os.cpu_count(), "torch_threads": threads, "versions": versions(extra_versions),
            "settings": settings}


def cpu_environment(header: dict[str, Any]) -> dict[str, object]:
    """The `environment` block the header-verification and deep-hash results carry beside the header
    (their readers look for it there); header is result_header(..., extra_versions=("huggingface_hub",))."""
    return {"git_commit": header["git_commit"], "device": f"CPU: {cpu_model()}", "cpu_cores": header["cpu_cores"],
            "python": header["versions"]["python"], "huggingface_hub": header["versions"]["huggingface_hub"],
            "platform": platform.platform()}
