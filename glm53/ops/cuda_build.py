"""Build a CUDA source of glm53/ops/cuda/ into a shared library with nvcc, once per (source, compiler, GPU
architecture), and load it with ctypes.

The kit's CUDA kernels need no PyTorch headers: each library exports plain C launch functions that take
device pointers and the caller's stream (torch's current stream, so CUDA graphs capture the launches).
That keeps a build to seconds (the PyTorch-header extensions of torch.utils.cpp_extension take a minute
or more a machine) and the library free of PyTorch's ABI. Built files live under
$XDG_CACHE_HOME/glm53/cuda (default ~/.cache/glm53/cuda), named by a hash of what they were built from; a
build writes a temporary file and renames it, so concurrent ranks never load half a library.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "cuda"
FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-Xptxas", "-v")  # -v: each kernel's resources


class CudaBuildError(RuntimeError):
    """nvcc is missing or refused a source; the message names the source and the remedy."""


def nvcc_path() -> str | None:
    """nvcc from $CUDA_HOME/bin, else PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """Code for exactly this GPU: sm_90 (H100/H200), sm_121 (GB10), ..."""
    sm = f"{capability[0]}{capability[1]}"
    return ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "glm53" / "cuda"


def build(name: str, capability: tuple[int, int], nvcc: str | None = None) -> Path:
    """glm53/ops/cuda/<name>.cu compiled for `capability`: the library's path (built if not cached)."""
    source = SOURCES / f"{name}.cu"
    nvcc = nvcc or nvcc_path()
    if nvcc is None or shutil.which(nvcc) is None:
        raise CudaBuildError(f"{source.name}: nvcc not found{f' at {nvcc}' if nvcc else ''} (set CUDA_HOME or put the "
                             "CUDA toolkit's bin on PATH)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    flags = [*FLAGS, *arch_flags(capability)]
    key = hashlib.sha256("\0".join([source.read_text(), version, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-sm{capability[0]}{capability[1]}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([nvcc, *flags, "-o", tmp, str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise CudaBuildError(f"{source}: nvcc failed ({' '.join(flags)}); a CUDA toolkit that knows this GPU's "
                                 f"architecture is needed (meanwhile the Triton kernels serve):\n{done.stderr[-4000:]}")
        build_log(target).write_text(done.stderr)  # ptxas: registers, shared memory and spills of each kernel
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_log(library: Path) -> Path:
    """What nvcc said while building `library` (ptxas' resource lines), beside it."""
    return library.with_suffix(".log")


def load(name: str, capability: tuple[int, int]) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(name, capability)))
