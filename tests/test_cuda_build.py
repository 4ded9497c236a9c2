"""The kit's CUDA sources (glm53/ops/cuda/) build with nvcc for the H200 (sm_90) and GB10 (sm_121) into a
library that exports the launch functions glm53/ops/cuda_exl3.py binds, without spilling registers; and
the build's failures name the source and the remedy. No GPU needed: nvcc compiles for any architecture.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm53.ops import cuda_build

NVCC = cuda_build.nvcc_path()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here (the CUDA toolkit's compiler)")


@needs_nvcc
@pytest.mark.parametrize("capability", [(9, 0), (12, 1)], ids=["h200-sm90", "gb10-sm121"])
def test_exl3_parts_builds_exports_its_launcher_and_does_not_spill(capability, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cuda_build.build("exl3_parts", capability)
    assert path.parent == tmp_path / "glm53" / "cuda" and f"sm{capability[0]}{capability[1]}" in path.name
    lib = ctypes.CDLL(str(path))  # loads without a GPU: the CUDA runtime is linked in statically
    assert lib.exl3_parts_launch and lib.exl3_error_string
    assert cuda_build.build("exl3_parts", capability) == path, "a second build must come from the cache"
    # the kernels' resource use, as ptxas reported it in the build: a spill would put the decoded fragments in
    # local memory
    said = cuda_build.build_log(path).read_text()
    reports = [line for line in said.splitlines() if "spill" in line]
    assert len(reports) == 3 and all("0 bytes spill stores, 0 bytes spill loads" in r for r in reports), said


def test_a_missing_nvcc_is_named_with_its_remedy(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(cuda_build.CudaBuildError, match="nvcc not found.*CUDA_HOME"):
        cuda_build.build("exl3_parts", (9, 0), nvcc=None if NVCC is None else str(tmp_path / "no-nvcc-here"))


@needs_nvcc
def test_a_source_nvcc_refuses_names_the_file_and_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "broken.cu").write_text("extern \"C\" __global__ void k() { this is not C++; }\n")
    monkeypatch.setattr(cuda_build, "SOURCES", sources)
    with pytest.raises(cuda_build.CudaBuildError, match=r"broken\.cu: nvcc failed"):
        cuda_build.build("broken", (9, 0))
    built = tmp_path / "cache" / "glm53" / "cuda"
    assert not built.exists() or not any(built.iterdir()), "a failed build left a file in the cache"


@needs_nvcc
def test_ranks_building_at_once_share_one_library(tmp_path) -> None:
    """Every rank of a lane builds at first use, often at the same moment: each writes its own temporary
    file and renames it into place, so all of them load a whole library and nothing else is left."""
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "tiny.cu").write_text('extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }\n'
                                     'extern "C" int answer() { return 42; }\n')
    script = ("import ctypes, sys; from pathlib import Path; from glm53.ops import cuda_build; "
              f"cuda_build.SOURCES = Path({str(sources)!r}); path = cuda_build.build('tiny', (9, 0)); "
              "assert ctypes.CDLL(str(path)).answer() == 42; print(path)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    built = sorted(f.name for f in (tmp_path / "cache" / "glm53" / "cuda").iterdir())
    library = Path(paths.pop())
    assert built == sorted([library.name, cuda_build.build_log(library).name]), built
