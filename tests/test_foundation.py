"""The foundation: the gpu marker is registered and skipped without CUDA."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_marker_skips_with_reason_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the skip path is not exercised here")
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n@pytest.mark.gpu\ndef test_needs_gpu():\n    assert False\n"
    )
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-q", "-p", "no:cacheprovider", str(tmp_path),
         "-o", "markers=gpu: gpu"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout
    assert "no CUDA device" in out.stdout
