"""The embedded default on a GPU machine: serve.sh --local runs the glm53 engine on CUDA under the
kit's front, verify.sh passes. Run there with:
    python -m pytest -q -m gpu tests/test_serve_gpu.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lane_fixtures import cleanup_lanes, free_port, tiny_dirs, tiny_model  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_local_lane_on_cuda_passes_verify(tiny_model: Path) -> None:
    env = {**os.environ, "GLM53_PYTHON": sys.executable}
    port = free_port()
    up = subprocess.run(["bash", "serve.sh", "--local", "--model", str(tiny_model), "--port", str(port)],
                        cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    try:
        assert up.returncode == 0, up.stderr
        assert "preflight: rank 0 (local): ok (NVIDIA" in up.stderr  # the GPU was seen
        assert "device memory" in up.stderr  # planned against the GPU's free memory
        checked = subprocess.run(["bash", "verify.sh", "--url", f"http://127.0.0.1:{port}"], cwd=ROOT,
                                 capture_output=True, text=True, env=env, timeout=900)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        for name in ("completion", "repeat", "cached", "stream"):
            assert f"PASS     {name}:" in checked.stdout, checked.stdout
    finally:
        subprocess.run(["bash", "serve.sh", "stop", "--port", str(port)], cwd=ROOT, env=env, timeout=120)
