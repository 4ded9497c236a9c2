"""exllamav3 1.6.5's own CUDA kernels as the reference for the kit's Triton EXL3 kernels (GPU only).

A library, no CLI. Everything that touches exllamav3 or CUDA imports lazily, so this module imports on a
CPU-only machine without exllamav3; its planning helpers are pure and tested there
(tests/test_exllamav3_ref.py). Import it as `exllamav3_ref` with tests/gpu on sys.path (pytest puts it
there for the files beside it), never as `tests.gpu.exllamav3_ref`: one module, one cached import.

Getting exllamav3 onto the GPU machine (it has no internet):
- tests/gpu/prepare_wheels.sh, run where PyPI is reachable, fills the git-ignored .whl/ with WHEELS
  (exllamav3 and the one third-party package its import graph needs that the GPU image lacks: pydantic,
  for `from pydantic import PydanticUserError` in exllamav3/util/memory.py); name `.whl` in `carry`.
- import_exllamav3() installs them once with pip --no-deps into SITE, a fixed folder, so every process
  imports the same files, and imports exllamav3.ext. That import JIT-compiles the CUDA extension through
  torch.utils.cpp_extension.load into $TORCH_EXTENSIONS_DIR/exllamav3_ext (set here to BUILD_ROOT when
  unset): a later process hashes the same sources and flags, takes the build lock, finds every object up
  to date and loads the .so; one that comes while the build runs waits on the lock. About 4.5 min on an
  H200 with TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 (the defaults set here).
- build_in_background(log) runs that in a separate process (its own session); wait_built(proc, s) waits.
  SITE and the build live under BASE ($TF_GLM53_EXLLAMAV3_DIR, default /tmp/glm53-exllamav3); an absolute
  path under the repo's ignored .work/ keeps them across run calls on a warm machine.

On the GPU (carry .whl), e.g.:
    proc = build_in_background(f"{os.environ['OUT']}/exllamav3_build.log")  # returns at once
    ...                                                                       # the kit's own work meanwhile
    wait_built(proc, 480); ext, LinearEXL3 = import_exllamav3()               # then seconds
    moe = MoeReference(gate, up, down, shared); y = moe(x, ids, w)
    t = graph_time_us(moe, 50, [(x_i, *moe.routing(ids_i, w_i)) for x_i, ids_i, w_i in sets])  # > 60 MB
smoke() runs every piece once on random tensors and prints what it saw.

What exllamav3 runs (read from the 1.6.5 sources; file:line in the docstrings below):
- linear_forward / ExlLinear: LinearEXL3.forward (modules/quant/exl3.py:119), kernel by rows (LINEAR_PATHS).
- MoeReference: BlockSparseMLP.forward's fused decode path (modules/block_sparse_mlp.py:1427,
  BC_BlockSparseMLP::run_bszN, libtorch/blocksparse_mlp.cpp:70) through its Python entry ext.exl3_moe_coop
  (quant/exl3_moe_coop.cu:333: exl3_moe_coop_prepare + exl3_moe_coop_run, the same launcher
  exl3_moe_coop_launch that run_bszN calls with its prepared parameters) at <= 8 rows, and the path
  forward takes above 8 rows (ext.exl3_moe + ext.exl3_moe_gather, block_sparse_mlp.py:1150-1333).

Settings exllamav3 reads from the environment once per process, before its first call (recorded by
reference_info()): EXL3_INT8_GEMV (default 2: at 1..2 rows a mul1 tensor of K <= 6 goes through an
int8-activation GEMV, by exllamav3's own comment about 0.9% output RMS deviation from fp16 arithmetic;
0 keeps fp16 activations), EXL3_GEMV, EXL3_MOE_COOP_KSPLIT, EXL3_MOE_COOP_WIDE, EXL3_HGEMM_F16ACC.
EXL3_EXPANDABLE_SEGMENTS is set to 0 here unless given, so importing exllamav3 leaves torch's caching
allocator as the kit's own code has it (exllamav3/__init__.py turns on expandable segments otherwise).
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EXLLAMAV3_VERSION = "1.6.5"
# distribution -> version: what prepare_wheels.sh downloads and import_exllamav3 installs. pydantic 2.10 is
# the newest whose floor on typing-extensions (>= 4.12.2) an older image still meets (2.14 needs 4.16), and
# it needs no typing-inspection; exllamav3 only imports PydanticUserError from it
WHEELS = {"exllamav3": EXLLAMAV3_VERSION, "pydantic": "2.10.6", "pydantic_core": "2.27.2", "annotated_types": "0.7.0"}
BASE = Path(os.environ.get("TF_GLM53_EXLLAMAV3_DIR", "/tmp/glm53-exllamav3"))
SITE = BASE / "site"              # the installed wheels, one copy for every process
BUILD_ROOT = BASE / "torch_extensions"  # TORCH_EXTENSIONS_DIR default: the JIT build, shared by processes
EXT_NAME = "exllamav3_ext"
ENV_KNOBS = ("EXL3_INT8_GEMV", "EXL3_GEMV", "EXL3_GEMV_SMEM", "EXL3_MOE_COOP_KSPLIT", "EXL3_MOE_COOP_WIDE",
             "EXL3_MOE_FUSED_ROWS", "EXL3_MOE_FUSED_ROWS_WIDE", "EXL3_MOE_MTILE", "EXL3_MOE_TILE_N",
             "EXL3_MOE_SHARED_COOP", "EXL3_HGEMM_F16ACC", "EXL3_NO_FUSED_RECONSTRUCT", "EXL3_EXPANDABLE_SEGMENTS",
             "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "MAX_JOBS")

# exllamav3's kernel for one EXL3 linear by rows M (LinearEXL3.forward, modules/quant/exl3.py:140-190;
# BC_LinearEXL3::run_gr, libtorch/linear.cpp:34; exl3_gemm_gr, quant/exl3_gemm.cu:118)
LINEAR_PATHS = (
    (2, "mul1 and K <= 6 (Hopper) with EXL3_INT8_GEMV != 0: exl3_gemv_int8_sq (int8 activations); "
        "otherwise as for M <= 8"),
    (8, "exl3_gemv (QTIP GEMV; K 2..4, mcg/mul1, or K 4 with 3inst) where its shape heuristic takes it "
        "(exl3_gemv.cu:44), else the autotuned cooperative exl3_gemm kernel"),
    (144, "the autotuned cooperative exl3_gemm kernel (AUTO_RECONSTRUCT_THRESHOLD = 144)"),
    (1023, "had_r_128(x * suh) + reconstruct (rotated W) + hgemm_recon (cuBLAS on an H200) + had_r_128(* svh)"),
    (1 << 62, "reconstruct_had_slice (W with both Hadamards folded in) + hgemm_recon (cuBLAS on an H200)"),
)

_EXL: tuple[Any, Any] | None = None  # (ext, LinearEXL3) once imported
_BUILD_LOGS: dict[int, Path] = {}    # pid of a background build -> its log


# ---------------------------------------------------------------------------------------------------------
# Getting exllamav3: install once, compile once, import


def _set_env_defaults() -> None:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", "16")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(BUILD_ROOT))
    os.environ.setdefault("EXL3_EXPANDABLE_SEGMENTS", "0")


def build_dir() -> Path:
    """Where torch.utils.cpp_extension.load builds exllamav3_ext: $TORCH_EXTENSIONS_DIR/exllamav3_ext (set)."""
    _set_env_defaults()
    return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / EXT_NAME


def carried_wheels(whl_dir: Path | None = None) -> list[Path]:
    """The pinned wheels to install (from REPO/.whl); a dependency the environment already imports may be absent."""
    whl_dir = whl_dir or REPO / ".whl"
    found = []
    for dist, version in WHEELS.items():
        if dist == "exllamav3" and os.environ.get("TF_GLM53_EXLLAMAV3_WHEEL"):
            found.append(Path(os.environ["TF_GLM53_EXLLAMAV3_WHEEL"]))
            continue
        hits = sorted(whl_dir.glob(f"{dist}-{version}-*.whl"))
        if hits:
            found.append(hits[0])
        elif dist == "exllamav3" or importlib.util.find_spec(dist) is None:
            there = sorted(p.name for p in whl_dir.glob(f"{dist}-*.whl"))
            raise RuntimeError(
                f"{dist}=={version}: no wheel in {whl_dir} (found: {there or 'none'}) and not importable here; "
                "run tests/gpu/prepare_wheels.sh where PyPI is reachable and name .whl in carry")
    return found


def _install_site() -> Path:
    """pip-install the carried wheels into SITE unless the same wheels are there (a stamp names them)."""
    wheels = carried_wheels()
    stamp_text = "".join(f"{w.name} {w.stat().st_size}\n" for w in wheels)
    BASE.mkdir(parents=True, exist_ok=True)
    with open(BASE / "install.lock", "w") as lock:  # a second process waits for the first's install
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = SITE / ".glm53-installed"
        if stamp.exists() and stamp.read_text() == stamp_text:
            return SITE  # reinstalling would touch the sources' mtimes and make ninja rebuild everything
        tmp = SITE.with_name(SITE.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
               "--no-cache-dir", "--target", str(tmp), *map(str, wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"installing {[w.name for w in wheels]} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
        (tmp / stamp.name).write_text(stamp_text)
        shutil.rmtree(SITE, ignore_errors=True)
        tmp.rename(SITE)
    return SITE


def _import_diagnostics() -> str:
    from importlib import metadata

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}, sys.path[:3] {sys.path[:3]}"]
    for dist in ("typing_extensions", "pydantic", "pydantic_core", "annotated_types", "exllamav3"):
        try:
            lines.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{dist} not installed")
    return "; ".join(lines)


def import_exllamav3() -> tuple[Any, Any]:
    """(ext, LinearEXL3): exllamav3's compiled extension and its EXL3 linear, installing the carried wheels
    into SITE if exllamav3 is not importable already. Compiles the extension at the first import anywhere
    (or waits for a build another process runs: the build lock); later calls return the cached pair."""
    global _EXL
    if _EXL is not None:
        return _EXL
    _set_env_defaults()
    t0 = time.monotonic()
    if importlib.util.find_spec("exllamav3") is None:
        _install_site()
        sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
    try:
        import exllamav3
        from exllamav3.ext import exllamav3_ext as ext
        from exllamav3.modules.quant.exl3 import LinearEXL3
    except ImportError as exc:
        raise RuntimeError(f"importing exllamav3 failed: {type(exc).__name__}: {exc}\n{_import_diagnostics()}") from exc
    from exllamav3.version import __version__ as version  # the package itself does not export it

    if version != EXLLAMAV3_VERSION:
        # The MoE entry points are called with 1.6.5's positional argument lists
        raise RuntimeError(f"exllamav3 {version} at {exllamav3.__file__}; this reference is written for "
                           f"{EXLLAMAV3_VERSION}")
    print(f"exllamav3_ref: exllamav3 {version} from {Path(exllamav3.__file__).parent}, extension ready in "
          f"{time.monotonic() - t0:.1f} s (build dir {build_dir()})", file=sys.stderr, flush=True)
    _EXL = (ext, LinearEXL3)
    return _EXL


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def build_in_background(log_path: str | Path) -> subprocess.Popen:
    """Start a process that installs and compiles exllamav3 (import_exllamav3) and exits; its own session,
    so it runs on while this one works. Wait for it with wait_built(proc, timeout_s); a later
    import_exllamav3() here then loads the same build in seconds."""
    _set_env_defaults()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import exllamav3_ref as r; r.import_exllamav3(); "
            "print('exllamav3_ref: build done', flush=True)")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO), env=dict(os.environ),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _BUILD_LOGS[proc.pid] = log_path
    return proc


def _log_tail(pid: int, chars: int = 6000) -> str:
    path = _BUILD_LOGS.get(pid)
    if path is None or not path.exists():
        return "(no log)"
    return path.read_text(errors="replace")[-chars:]


def _clear_stale_lock() -> None:
    """load() waits forever on a lock file its builder left; ours is dead when this runs."""
    lock = build_dir() / "lock"
    if lock.exists():
        print(f"exllamav3_ref: removing the dead build's lock {lock}", file=sys.stderr)
        lock.unlink(missing_ok=True)


def wait_built(proc: subprocess.Popen, timeout_s: float) -> float:
    """Wait for build_in_background's process; seconds waited. Raises with the log's tail when it failed,
    TimeoutError (the build left running) when it is not done in timeout_s."""
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"exllamav3 build (pid {proc.pid}) still running after {timeout_s:.0f} s; log tail:\n"
                           f"{_log_tail(proc.pid)}") from None
    if rc != 0:
        _clear_stale_lock()
        raise RuntimeError(f"exllamav3 build (pid {proc.pid}) exited {rc}; log tail:\n{_log_tail(proc.pid)}")
    return time.monotonic() - t0


def stop_build(proc: subprocess.Popen) -> None:
    """End build_in_background's process group (it is its own session) and clear the lock it may leave."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _clear_stale_lock()


def reference_info() -> dict[str, Any]:
    """What a result should record about the reference: version, where it came from, the knobs it read."""
    info: dict[str, Any] = {"exllamav3": _dist_version("exllamav3"), "site": str(SITE), "build_dir": str(build_dir()),
                            "env": {k: os.environ.get(k) for k in ENV_KNOBS}}
    if _EXL is not None:
        import exllamav3
        from exllamav3.version import __version__

        info["exllamav3"] = __version__
        info["location"] = str(Path(exllamav3.__file__).parent)
    return info


# ---------------------------------------------------------------------------------------------------------
# Pure helpers (no CUDA, no exllamav3): tested on the CPU


@dataclass(frozen=True)
class PartsInfo:
    in_features: int
    out_features: int
    bits: float       # K: trellis words per 16x16 tile / 16 (2.5 and 3.5 only with mul1)
    codebook: str     # "3inst", "mcg" or "mul1"


def parts_info(parts: Mapping[str, torch.Tensor], name: str = "parts") -> PartsInfo:
    """Shape, K and codebook of one EXL3 linear's tensors (trellis int16 [in/16, out/16, 16K], suh fp16 [in],
    svh fp16 [out], optional scalar mcg / mul1 marker); ValueError naming what is wrong."""
    for key in ("trellis", "suh", "svh"):
        if key not in parts:
            extra = " (packed su/sv: unpack to fp16 suh/svh first)" if key[:2] in parts else ""
            raise ValueError(f"{name}: no {key!r}{extra}; keys {sorted(parts)}")
    trellis, suh, svh = parts["trellis"], parts["suh"], parts["svh"]
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"{name}: trellis must be int16 [in/16, out/16, 16K], got {trellis.dtype} "
                         f"{tuple(trellis.shape)}")
    tiles_in, tiles_out, words = trellis.shape
    in_f, out_f = tiles_in * 16, tiles_out * 16
    for key, t, n in (("suh", suh, in_f), ("svh", svh, out_f)):
        if t.dtype != torch.half or tuple(t.shape) != (n,):
            raise ValueError(f"{name}: {key} must be fp16 [{n}], got {t.dtype} {tuple(t.shape)}")
    if "mcg" in parts and "mul1" in parts:
        raise ValueError(f"{name}: both mcg and mul1 markers")
    codebook = "mcg" if "mcg" in parts else "mul1" if "mul1" in parts else "3inst"
    bits = words / 16
    if not (bits.is_integer() and 1 <= bits <= 8) and not (codebook == "mul1" and bits in (1.5, 2.5, 3.5)):
        raise ValueError(f"{name}: {words} trellis words per tile is no EXL3 width for {codebook}")
    return PartsInfo(in_f, out_f, int(bits) if bits.is_integer() else bits, codebook)


def linear_path(rows: int) -> str:
    """The kernel exllamav3's LinearEXL3.forward runs at `rows` rows (LINEAR_PATHS)."""
    return next(text for limit, text in LINEAR_PATHS if rows <= limit)


Bits3 = tuple[float, float, float]  # (K gate, K up, K down) of one expert
Parts = Mapping[str, torch.Tensor]  # one EXL3 linear's tensors (parts_info)


def plan_width_groups(bits: Sequence[Bits3]) -> list[tuple[Bits3, list[int]]]:
    """Experts grouped by their (gate, up, down) widths, groups in key order, experts ascending: exllamav3's
    MoE kernels take one K per projection for all the experts of a launch."""
    groups: dict[Bits3, list[int]] = {}
    for expert, key in enumerate(bits):
        groups.setdefault(tuple(key), []).append(expert)
    return sorted(groups.items())


def local_index_table(groups: Sequence[tuple[Bits3, list[int]]], num_experts: int) -> torch.Tensor:
    """[G, E] int64: expert e's index inside group g, or len(group g) where e is not in g. Index a routing
    with it to get a group's launch: the kernels take [0, n_g) as the group's experts, and an index of n_g
    is outside that range, so the pick contributes exact zeros (exl3_moe_coop's [min_expert, max_expert)
    mask, exl3_moe's sentinel bin)."""
    table = torch.empty((len(groups), num_experts), dtype=torch.long)
    for g, (_, experts) in enumerate(groups):
        table[g].fill_(len(experts))
        table[g, torch.tensor(experts, dtype=torch.long)] = torch.arange(len(experts))
    return table


COOP, FUSED_MOE, LINEARS = "exl3_moe_coop", "exl3_moe", "LinearEXL3 per projection"


def moe_kernel(rows: int, bits: Bits3, codebook: str, max_bszn: int = 8, fused_rows: int = 128,
               top_k: int = 8) -> str:
    """Which exllamav3 kernel takes one width group at `rows` tokens; NotImplementedError where 1.6.5 has
    none. <= max_bszn rows: exl3_moe_coop (BC_BlockSparseMLP::run_bszN), which needs gate K == up K
    (blocksparse_mlp.cpp:284). Above, or for a group whose gate and up widths differ: exl3_moe, forward's
    tier above MAX_BSZN (mcg or mul1 only, exl3_moe.cu:361; every row fused while rows * top_k <=
    fused_rows, block_sparse_mlp.py:1198); exllamav3 itself never loads such a mixed expert (MultiLinear
    asserts one K, multilinear.py:26), so for it exl3_moe is the closest kernel of its own, not its path."""
    kg, ku, _ = bits
    if rows <= max_bszn and kg == ku:
        return COOP
    why = (f"{rows} rows is above exllamav3's fused decode kernel (MAX_BSZN {max_bszn})" if rows > max_bszn
           else f"exl3_moe_coop needs gate K == up K, the group has {kg} and {ku}")
    if codebook not in ("mcg", "mul1"):
        raise NotImplementedError(f"{why}; exl3_moe takes mcg or mul1 only, not {codebook}")
    if rows * top_k > fused_rows:
        raise NotImplementedError(f"{why}; above {fused_rows // top_k} rows exllamav3 reads the expert counts "
                                  "back to the host and splits the experts into tiers, which is not mirrored here")
    return FUSED_MOE


def coop_ctr_len(slots_max: int, rows_max: int, inter: int, out_f: int) -> int:
    """Int32 counters + run table of exl3_moe_coop (exl3_moe_coop_ctr_len, quant/exl3_moe_coop.cuh)."""
    return slots_max * (inter // 128) + rows_max * (out_f // 128) + 2 + (slots_max + 1) + slots_max


def error_stats(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """max |ours - ref|, that over max |ref|, the RMS ratio, and where the largest difference is."""
    a, b = ours.detach().float(), ref.detach().float()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a - b).abs()
    finite = torch.isfinite(a) & torch.isfinite(b)
    worst = int(diff.nan_to_num(float("inf")).argmax()) if diff.numel() else 0
    scale = float(b.abs().max()) if b.numel() else 0.0
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rms_ref = float(b.square().mean().sqrt()) if b.numel() else 0.0
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale else max_abs,
        "rms_rel": float(diff.square().mean().sqrt()) / rms_ref if rms_ref else 0.0,
        "worst_at": [int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)] if a.dim() else [],
        "nonfinite_ours": int((~torch.isfinite(a)).sum()), "nonfinite_ref": int((~torch.isfinite(b)).sum()),
        "all_finite": bool(finite.all()),
    }


# ---------------------------------------------------------------------------------------------------------
# One EXL3 linear


class ExlLinear:
    """One EXL3 linear as exllamav3's LinearEXL3 (build once, call many times: for timing)."""

    def __init__(self, parts: Mapping[str, torch.Tensor], out_dtype: torch.dtype = torch.half,
                 device: str | torch.device | None = None, name: str = "linear") -> None:
        self.info = parts_info(parts, name)
        _, linear_cls = import_exllamav3()
        if device is None:  # where the tensors are, if that is a GPU
            device = parts["trellis"].device if parts["trellis"].is_cuda else "cuda"
        self.parts = _on(parts, torch.device(device))
        p = self.parts
        self.inner = linear_cls(None, self.info.in_features, self.info.out_features, suh=p["suh"], svh=p["svh"],
                                trellis=p["trellis"], mcg=p.get("mcg"), mul1=p.get("mul1"), out_dtype=out_dtype,
                                key=name)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.dtype != torch.half or not x.is_contiguous() or x.shape[-1] != self.info.in_features:
            raise ValueError(f"x must be contiguous fp16 [M, {self.info.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)} contiguous={x.is_contiguous()}")
        return self.inner.forward(x, {}, out_dtype=out_dtype)


def linear_forward(parts: Mapping[str, torch.Tensor], x: torch.Tensor,
                   out_dtype: torch.dtype = torch.half) -> torch.Tensor:
    """y [M, out] = x [M, in] through exllamav3's LinearEXL3.forward(x, {}): its kernel by M (linear_path):
    M <= 2 with mul1 (K <= 6): exl3_gemv_int8_sq, int8 activations (EXL3_INT8_GEMV=0 turns it off);
    M <= 8: exl3_gemv (QTIP GEMV) where its heuristic takes the shape, else exl3_gemm;
    M <= 144: the autotuned cooperative exl3_gemm kernel (1..16 rows: one of these three);
    145..1023: had_r_128 + reconstruct + cuBLAS hgemm + had_r_128;
    >= 1024 (2048): reconstruct_had_slice (Hadamards and sign vectors folded into W) + cuBLAS hgemm.
    Builds the LinearEXL3 each call: for timing build an ExlLinear once."""
    return ExlLinear(parts, out_dtype)(x)


# ---------------------------------------------------------------------------------------------------------
# One MoE layer's experts


@dataclass
class _Group:
    bits: Bits3
    experts: list[int]
    tables: list[torch.Tensor]  # int64 pointer tables: gate trellis, suh, svh, up ..., down ... (local index)
    whole: bool                 # the group is every expert: the launch takes global ids, no range mask
    ctr: torch.Tensor | None = None  # exl3_moe_coop counters: zero once, the kernels reset them for the next call
    out: torch.Tensor | None = None  # exl3_moe_coop output rows [max_bszn, hidden] fp32


def _exllamav3_sizes() -> dict[str, int]:
    """BlockSparseMLP's row limits, read from exllamav3 itself (block_sparse_mlp.py:30-47) so a drift shows."""
    from exllamav3.modules import block_sparse_mlp as bsm

    return {k: int(getattr(bsm, k)) for k in ("MAX_BSZN", "TEMP_ROWS_FUSED", "FUSED_ROWS_WIDE", "MTILE")}


def _ptr_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.long, device=device)


def _on(parts: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device).contiguous() for k, v in parts.items()}


class MoeReference:
    """One MoE layer's routed experts (+ optionally the shared expert) through exllamav3 1.6.5's own MoE
    kernels, for E experts of hidden -> inter -> hidden (GLM-5.3: 256 x 6144 -> 2048, top 8).

    gate[e], up[e], down[e]: parts dicts (parts_info); each expert and projection may have its own K
    (2, 3, 4, ...), one codebook for all (exllamav3's MoE kernels decode gate, up and down with one codebook
    instance). shared: {"gate": parts, "up": parts, "down": parts} or None.

    __call__(x, ids, weights) -> [T, hidden] fp32 (a view of a buffer the next call overwrites):
    - T <= 8: per width group one ext.exl3_moe_coop launch pair (rotation + gate/up + activation, then down
      + the weighted sum over the token's slots), the kernel of BlockSparseMLP.forward's decode path
      (run_bszN, blocksparse_mlp.cpp:70). A layer of one width (every expert the same (gate, up, down) K)
      is exactly run_bszN's call: pointer tables over all E experts, global ids, no expert-range mask, the
      same scratch sizes (64 slots, 8 rows), the shared expert first as a one-expert exl3_moe_coop launch
      at its own width whose fp32 output the routed launch adds (run_bszN's sh_coop, blocksparse_mlp.cpp:95).
      Mixed widths: exl3_moe_coop takes one K per projection (gate_K/up_K/down_K floats in
      BC_BlockSparseMLP, blocksparse_mlp.h:43-57) and exllamav3 cannot load such a layer (MultiLinear
      asserts one K, multilinear.py:26), so the closest equivalent is one launch per width group with
      group-local pointer tables and ids remapped by local_index_table (picks of other groups fall outside
      [0, n_g): zero contribution), each launch adding the previous one's output as its "shared" term.
      A group whose gate and up K differ cannot take exl3_moe_coop (blocksparse_mlp.cpp:284): it runs
      through exl3_moe (below) at any T, for mcg/mul1 only.
    - 8 < T <= fused_rows / 8 (16; 32 with mul1): ext.exl3_moe + ext.exl3_moe_gather per width group, as
      forward's all-fused tier with deterministic slots (block_sparse_mlp.py:1150-1333; mcg/mul1 only). One
      difference: the per-expert counts come from scatter_add_ instead of torch.bincount, whose host read
      (nbins from max().item()) would stop graph capture; the counts are the same. The shared expert there
      runs as three LinearEXL3 calls and silu_mul (exllamav3's GatedMLP takes exl3_mgemm for gate+up at
      9..32 rows: not mirrored).
    ids int64 / weights fp16 skip two conversion kernels; exllamav3's kernels read fp16 routing weights, so
    fp32 weights are rounded to fp16 here (composed() rounds them the same way). Graph-capturable: yes at
    every T it takes (no host reads; ids are checked on the host only outside capture).
    """

    def __init__(self, gate: Sequence[Parts], up: Sequence[Parts], down: Sequence[Parts],
                 shared: Mapping[str, Parts] | None = None, top_k: int = 8,
                 device: str | torch.device = "cuda") -> None:
        self.ext, _ = import_exllamav3()
        sizes = _exllamav3_sizes()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not (len(gate) == len(up) == len(down)) or not gate:
            raise ValueError(f"gate/up/down expert counts differ or are zero: {len(gate)}, {len(up)}, {len(down)}")
        self.num_experts, self.top_k = len(gate), top_k
        infos = [(parts_info(g, f"gate[{e}]"), parts_info(u, f"up[{e}]"), parts_info(d, f"down[{e}]"))
                 for e, (g, u, d) in enumerate(zip(gate, up, down, strict=True))]
        self.hidden, self.inter = infos[0][0].in_features, infos[0][0].out_features
        codebooks = {i.codebook for trio in infos for i in trio}
        for e, (gi, ui, di) in enumerate(infos):
            shapes = ((gi.in_features, gi.out_features), (ui.in_features, ui.out_features),
                      (di.in_features, di.out_features))
            if shapes != ((self.hidden, self.inter),) * 2 + ((self.inter, self.hidden),):
                raise ValueError(f"expert {e}: gate/up/down shapes {shapes}, expected "
                                 f"gate/up {self.hidden}->{self.inter}, down {self.inter}->{self.hidden}")
        self.shared_info = None
        if shared is not None:
            self.shared_info = tuple(parts_info(shared[k], f"shared.{k}") for k in ("gate", "up", "down"))
            codebooks |= {i.codebook for i in self.shared_info}
            if (self.shared_info[0].in_features != self.hidden or self.shared_info[2].out_features != self.hidden
                    or self.shared_info[1].out_features != self.shared_info[0].out_features):
                raise ValueError(f"shared expert shapes {self.shared_info} do not fit hidden {self.hidden}")
        if len(codebooks) != 1:
            raise ValueError(f"one codebook for every projection (exllamav3's MoE kernels), got {sorted(codebooks)}")
        self.codebook = codebooks.pop()
        self.mcg, self.mul1 = self.codebook == "mcg", self.codebook == "mul1"
        if self.hidden % 128 or self.inter % 128:
            raise ValueError(f"exl3_moe_coop needs widths that are multiples of 128: {self.hidden}, {self.inter}")

        dev = self.device
        self.gate, self.up, self.down = ([_on(p, dev) for p in ps] for ps in (gate, up, down))
        self.shared = {k: _on(shared[k], dev) for k in ("gate", "up", "down")} if shared is not None else None
        self.bits = [(gi.bits, ui.bits, di.bits) for gi, ui, di in infos]

        # exllamav3's sizes (block_sparse_mlp.py:586-603 scratch, 742-744 fused rows)
        self.max_bszn = sizes["MAX_BSZN"]
        self.fused_rows = sizes["FUSED_ROWS_WIDE"] if (sizes["MTILE"] and self.mul1) else sizes["TEMP_ROWS_FUSED"]
        slots, rows, H, inter = self.max_bszn * top_k, self.max_bszn, self.hidden, self.inter
        half, f32 = dict(dtype=torch.half, device=dev), dict(dtype=torch.float, device=dev)
        self._coop_scratch = [torch.empty((slots, H), **half), torch.empty((slots, H), **half),  # had_g, had_u
                              torch.empty((slots, inter), **half), torch.empty((slots, inter), **half),  # gu_g, gu_u
                              torch.empty((slots, inter), **half), torch.empty((slots, H), **f32)]  # act_out, d_out

        self.groups: list[_Group] = []
        for key, experts in plan_width_groups(self.bits):
            tables = [_ptr_table([parts[e][k] for e in experts], dev)
                      for parts in (self.gate, self.up, self.down) for k in ("trellis", "suh", "svh")]
            group = _Group(key, experts, tables, whole=len(experts) == self.num_experts)
            if key[0] == key[1]:
                group.ctr = torch.zeros(coop_ctr_len(slots, rows, inter, H), dtype=torch.int, device=dev)
                group.out = torch.empty((rows, H), **f32)
            self.groups.append(group)
        self._local = local_index_table([(g.bits, g.experts) for g in self.groups], self.num_experts).to(dev)

        if self.shared is not None:  # one-expert exl3_moe_coop at its own width, scratch as run_bszN's (8 slots)
            s, si = self.shared, self.shared_info
            self._sh_tables = [_ptr_table([s[p][k]], dev)
                               for p in ("gate", "up", "down") for k in ("trellis", "suh", "svh")]
            sh_inter = si[0].out_features
            self._sh_scratch = [torch.empty((rows, H), **half), torch.empty((rows, H), **half),
                                torch.empty((rows, sh_inter), **half), torch.empty((rows, sh_inter), **half),
                                torch.empty((rows, sh_inter), **half), torch.empty((rows, H), **f32)]
            self._sh_ctr = torch.zeros(coop_ctr_len(rows, rows, sh_inter, H), dtype=torch.int, device=dev)
            self._sh_out = torch.empty((rows, H), **f32)
            self._sh_sel = torch.zeros((rows, 1), dtype=torch.long, device=dev)  # expert 0, weight 1
            self._sh_rw = torch.ones((rows, 1), **half)

        self._moe_ready = False
        self._lin: dict[int | str, tuple[ExlLinear, ExlLinear, ExlLinear]] = {}

    # -- planning --------------------------------------------------------------------------------------

    def plan(self, rows: int) -> dict[str, Any]:
        """Per width group the kernel that runs it at `rows` tokens (NotImplementedError where none does)."""
        groups = [{"bits": g.bits, "experts": len(g.experts),
                   "kernel": moe_kernel(rows, g.bits, self.codebook, self.max_bszn, self.fused_rows, self.top_k)}
                  for g in self.groups]
        shared = None
        if self.shared_info is not None:
            kg, ku = self.shared_info[0].bits, self.shared_info[1].bits
            shared = COOP if rows <= self.max_bszn and kg == ku else LINEARS
        # exllamav3's own path: one width (a layer it can load); at > max_bszn rows its shared expert differs
        exact = len(self.groups) == 1 and (
            (groups[0]["kernel"] == COOP and shared in (None, COOP)) or (rows > self.max_bszn and shared is None))
        return {"rows": rows, "codebook": self.codebook, "groups": groups, "shared": shared,
                "as_exllamav3_runs_it": exact}

    # -- the fused path ----------------------------------------------------------------------------------

    def routing(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids as contiguous int64 and weights as contiguous fp16 (what the kernels read)."""
        return ids.to(torch.long).contiguous(), weights.to(torch.half).contiguous()

    def check_routing(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Shapes, dtypes, and (host read) ids in range and distinct per token: a bad id would make the kernel
        read a wild pointer and take the CUDA context down with it."""
        T = x.shape[0]
        if x.dtype != torch.half or x.dim() != 2 or x.shape[1] != self.hidden or x.stride(1) != 1:
            raise ValueError(f"x must be fp16 [T, {self.hidden}] with unit column stride, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if tuple(ids.shape) != (T, self.top_k) or tuple(weights.shape) != (T, self.top_k):
            raise ValueError(f"ids and weights must be [{T}, {self.top_k}], got {tuple(ids.shape)}, "
                             f"{tuple(weights.shape)}")
        if x.device != self.device or ids.device != self.device or weights.device != self.device:
            raise ValueError(f"x, ids, weights must be on {self.device}: {x.device}, {ids.device}, {weights.device}")
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.num_experts:
            raise ValueError(f"expert ids span [{lo}, {hi}], outside [0, {self.num_experts})")
        if self.top_k > 1 and bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError("an expert picked twice by one token (top-k picks are distinct)")

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.check_routing(x, ids, weights)
        T = x.shape[0]
        plan = self.plan(T)
        ids, rw = self.routing(ids, weights)
        kernels = [g["kernel"] for g in plan["groups"]]
        local = self._local[:, ids] if any(not g.whole for g in self.groups) else None  # [G, T, top_k]
        acc: torch.Tensor | None = None
        if plan["shared"] == COOP:
            acc = self._coop_shared(x, T)
        for g, group in enumerate(self.groups):
            if kernels[g] == COOP:
                acc = self._coop(group, x, ids if group.whole else local[g], rw, acc)
        if FUSED_MOE in kernels:
            if acc is None:
                acc = self._moe_buffers()["fhs"][:T]
                acc.zero_()  # exl3_moe_gather adds into it
            for g, group in enumerate(self.groups):
                if kernels[g] == FUSED_MOE:
                    self._exl3_moe(group, x, ids if group.whole else local[g], rw, acc)
        if plan["shared"] == LINEARS:
            acc = acc + self._shared_linears(x)
        return acc

    def _coop(self, group: _Group, x: torch.Tensor, sel: torch.Tensor, rw: torch.Tensor,
              prev: torch.Tensor | None) -> torch.Tensor:
        """One exl3_moe_coop call (bindings.cpp:318; arguments as exl3_moe_coop, quant/exl3_moe_coop.cu:333,
        filled as BC_BlockSparseMLP's constructor fills exl3_moe_coop_prepare, blocksparse_mlp.cpp:309-330)."""
        T = x.shape[0]
        lo, hi = (-1, -1) if group.whole else (0, len(group.experts))
        kg, ku, kd = (float(k) for k in group.bits)
        self.ext.exl3_moe_coop(
            x, sel, rw, lo, hi, self.hidden,  # Hi: gate/up in_features (yh.size(-1) in run_bszN)
            *group.tables, None, None, None,  # 9 pointer tables; no expert biases
            kg, ku, kd, self.mcg, self.mul1,
            0, 0.0, True,                     # MOE_COOP_ACT_SILU, act_limit 0 (no clamp), gated
            *self._coop_scratch, group.ctr, group.out,
            prev, None)                       # sh_out: added into every row (no sigmoid gate weight)
        return group.out[:T]

    def _coop_shared(self, x: torch.Tensor, T: int) -> torch.Tensor:
        si = self.shared_info
        self.ext.exl3_moe_coop(
            x, self._sh_sel[:T], self._sh_rw[:T], -1, -1, self.hidden, *self._sh_tables, None, None, None,
            float(si[0].bits), float(si[1].bits), float(si[2].bits), self.mcg, self.mul1, 0, 0.0, True,
            *self._sh_scratch, self._sh_ctr, self._sh_out, None, None)
        return self._sh_out[:T]

    def _moe_buffers(self) -> dict[str, torch.Tensor]:
        """exl3_moe's per-group temp state (concurrency x fused_rows rows, block_sparse_mlp.py:738-746) and the
        sync-free bookkeeping tensors; made on first use above max_bszn rows."""
        if not self._moe_ready:
            dev, H, inter = self.device, self.hidden, self.inter
            C, R = self.ext.exl3_moe_max_concurrency(dev.index), self.fused_rows
            A = R  # assignments: rows * top_k <= fused_rows
            self._moe = {
                "state_g": torch.empty((C, R, H), dtype=torch.half, device=dev),
                "state_u": torch.empty((C, R, H), dtype=torch.half, device=dev),
                "interm_g": torch.empty((C, R, inter), dtype=torch.half, device=dev),
                "interm_u": torch.empty((C, R, inter), dtype=torch.half, device=dev),
                "scratch": torch.empty((A, H), dtype=torch.float, device=dev),
                "fhs": torch.empty((R, H), dtype=torch.float, device=dev),
                "token": torch.arange(R // self.top_k, device=dev).repeat_interleave(self.top_k),
                "arange": torch.arange(A, device=dev),
                "ones": torch.ones(A, dtype=torch.long, device=dev),
            }
            self._moe_ready = True
        return self._moe

    def _exl3_moe(self, group: _Group, x: torch.Tensor, sel: torch.Tensor, rw: torch.Tensor,
                  acc: torch.Tensor) -> None:
        """One group through forward's all-fused tier: sort the picks by (local) expert, ext.exl3_moe into one
        fp32 slot per pick (weighted), ext.exl3_moe_gather adds each token's slots into acc in k order."""
        b = self._moe_buffers()
        T, n = x.shape[0], len(group.experts)
        A = T * self.top_k
        flat = sel.reshape(-1)  # local expert per pick, n = not in this group (sentinel bin)
        order = flat.argsort()
        token_sorted = b["token"][:A][order]
        weight_sorted = rw.reshape(-1)[order]
        count = torch.zeros(n + 1, dtype=torch.long, device=self.device).scatter_add_(0, flat, b["ones"][:A])
        start = count.cumsum(0) - count  # slot base of each expert = its first sorted position
        inv_order = torch.empty_like(order).scatter_(0, order, b["arange"][:A])
        kind = (count[:n] > 0).long()    # 1: fused slots, already weighted
        kg, ku, kd = (float(k) for k in group.bits)
        self.ext.exl3_moe(
            x, acc, count, token_sorted, weight_sorted,
            b["state_g"], b["state_u"], b["interm_g"], b["interm_u"],
            0, kg, ku, kd, *group.tables,                      # MOE_ACT_SILU
            self.mcg, self.mul1, self.mcg, self.mul1, self.mcg, self.mul1,
            0.0, -1, b["scratch"][:A], start, 1, self.fused_rows, 16)  # num_active -1: all fused; m_tile 16
        self.ext.exl3_moe_gather(acc, b["scratch"][:A], flat, inv_order, start[:n], start[:n], kind, weight_sorted)

    def _shared_linears(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert as GatedMLP's unfused path: LinearEXL3 gate and up (fp16), silu_mul, down (fp32)."""
        g_lin, u_lin, d_lin = self._linears("shared")
        g, u = g_lin(x), u_lin(x)
        a = torch.empty_like(u)
        self.ext.silu_mul(g, u, a, 0.0)
        return d_lin(a)

    # -- the composed reference --------------------------------------------------------------------------

    def _linears(self, e: int | str) -> tuple[ExlLinear, ExlLinear, ExlLinear]:
        """Expert e's (or "shared") gate, up (fp16 out) and down (fp32 out) as LinearEXL3, made on first use."""
        if e not in self._lin:
            g, u, d = ((self.shared[k] for k in ("gate", "up", "down")) if e == "shared"
                       else (self.gate[e], self.up[e], self.down[e]))
            dev = self.device
            self._lin[e] = (ExlLinear(g, device=dev, name=f"{e}.gate"), ExlLinear(u, device=dev, name=f"{e}.up"),
                            ExlLinear(d, torch.float, dev, name=f"{e}.down"))
        return self._lin[e]

    def composed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same math from exllamav3's LinearEXL3 per projection: per expert (ascending id) over the rows
        that picked it, silu(gate) * up in fp16 (fp32 activation), down in fp32, times the fp16-rounded
        weight, added to the token's row, so each row sums its experts in ascending id; the shared expert
        added last. Host loop with syncs: a cross-check, not for timing. LinearEXL3 picks its kernel by the
        expert's row count (linear_path): with mul1 at 1..2 rows that is the int8-activation GEMV unless
        EXL3_INT8_GEMV=0, which alone puts about 1% RMS between this and the fused kernels."""
        self.check_routing(x, ids, weights)
        rw = weights.to(torch.half).float()
        out = torch.zeros((x.shape[0], self.hidden), dtype=torch.float, device=x.device)
        ids_host = ids.cpu()
        for e in sorted(set(ids_host.flatten().tolist())):
            rows, slots = (ids_host == e).nonzero(as_tuple=True)
            rows_dev, slots_dev = rows.to(x.device), slots.to(x.device)
            g_lin, u_lin, d_lin = self._linears(e)
            xr = x.index_select(0, rows_dev).contiguous()
            a = (torch.nn.functional.silu(g_lin(xr).float()) * u_lin(xr).float()).half()
            out.index_add_(0, rows_dev, d_lin(a) * rw[rows_dev, slots_dev].unsqueeze(1))
        if self.shared is not None:
            g_lin, u_lin, d_lin = self._linears("shared")
            a = (torch.nn.functional.silu(g_lin(x).float()) * u_lin(x).float()).half()
            out += d_lin(a)
        return out


# ---------------------------------------------------------------------------------------------------------
# Timing


def graph_time_us(fn: Callable[..., Any], reps: int = 20, inputs: Sequence[Sequence[Any]] | None = None,
                  warmup: int = 2) -> dict[str, Any]:
    """GPU time of one call of fn, in us: fn(*args) for every args in inputs (rotate over more memory than
    the 60 MB L2 by passing enough sets), or fn() once, captured together in one CUDA graph, the graph
    replayed `reps` times, each replay timed by CUDA events, per-call time = replay time / calls; median,
    min, max over the replays. Warm-up first (eager, on the capture stream): exllamav3 autotunes its GEMM
    and sets kernel attributes at first use, with host syncs a capture would refuse. Where capture fails
    (a host sync inside fn) the same loop runs eagerly, and the result says so ("mode": "eager", host
    launch time then included)."""
    calls: list[Callable[[], Any]] = [lambda a=a: fn(*a) for a in inputs] if inputs else [fn]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for call in calls:
                call()
    stream.synchronize()
    mode, note = "graph", None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
        graph.replay()
        torch.cuda.synchronize()

        def run() -> None:
            graph.replay()
    except Exception as exc:  # noqa: BLE001 - timed eagerly instead, with the reason recorded
        mode, note = "eager", f"capture failed: {type(exc).__name__}: {str(exc)[:500]}"
        torch.cuda.synchronize()

        def run() -> None:
            for call in calls:
                call()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples),
            "samples_us": samples, "calls_per_replay": len(calls), "reps": reps, "mode": mode, "note": note}


# ---------------------------------------------------------------------------------------------------------
# A first look on the GPU


def random_parts(in_f: int, out_f: int, bits: float, codebook: str, seed: int,
                 device: str | torch.device = "cuda") -> dict[str, torch.Tensor]:
    """Random trellis bits with sign/scale vectors scaled by 1/sqrt(in) so a random MLP stays in fp16 range."""
    gen = torch.Generator(device=device).manual_seed(seed)
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, int(16 * bits)), generator=gen,
                            device=device, dtype=torch.int32).to(torch.int16)

    def signs(n: int, scale: float) -> torch.Tensor:
        mag = torch.rand(n, generator=gen, device=device) * 0.5 + 0.75
        return (mag * scale * (torch.randint(0, 2, (n,), generator=gen, device=device) * 2 - 1)).half()

    parts = {"trellis": trellis, "suh": signs(in_f, 1.0), "svh": signs(out_f, in_f ** -0.5)}
    if codebook == "mcg":
        parts["mcg"] = torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32, device=device)
    elif codebook == "mul1":
        parts["mul1"] = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32, device=device)
    return parts


def smoke(experts: int = 16, codebook: str = "mcg", rows: Sequence[int] = (1, 2, 8, 12, 16),
          hidden: int = 6144, inter: int = 2048, seed: int = 0) -> dict[str, Any]:
    """Import exllamav3, then on random tensors of GLM-5.3's shapes: linear_forward against the dequantized
    weight (get_weight_tensor) at 1, 8, 16 and 2048 rows, and a mixed-width MoE layer (widths 2..4 per
    projection, one group with gate K != up K, a shared expert) fused against composed() at each of `rows`,
    both graph-timed. Prints one line per case; returns the numbers."""
    ext, linear_cls = import_exllamav3()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    report: dict[str, Any] = {"info": reference_info(), "linear": [], "moe": []}
    lin_parts = random_parts(hidden, inter, 3, codebook, seed)
    lin = ExlLinear(lin_parts)
    w = lin.inner.get_weight_tensor().float()
    for m in (1, 8, 16, 2048):
        x = torch.randn((m, hidden), generator=gen, device=dev).half()
        st = error_stats(lin(x), x.float() @ w)
        t = graph_time_us(lin, 10, [(x,)])
        report["linear"].append({"rows": m, **st, "us": t["median_us"], "mode": t["mode"], "path": linear_path(m)})
        print(f"linear {hidden}x{inter} K3 {codebook} M={m}: max_rel {st['max_rel']:.2e} rms_rel {st['rms_rel']:.2e} "
              f"{t['median_us']:.1f} us ({t['mode']})", flush=True)
    widths = (2, 3, 4)
    gates, ups, downs = [], [], []
    for e in range(experts):
        kg = widths[e % 3]
        ku = kg if e % 5 else widths[(e + 1) % 3]  # every fifth expert: gate K != up K
        kd = widths[(e // 3) % 3]
        gates.append(random_parts(hidden, inter, kg, codebook, seed * 1000 + 3 * e))
        ups.append(random_parts(hidden, inter, ku, codebook, seed * 1000 + 3 * e + 1))
        downs.append(random_parts(inter, hidden, kd, codebook, seed * 1000 + 3 * e + 2))
    shared = {"gate": random_parts(hidden, inter, 4, codebook, 7), "up": random_parts(hidden, inter, 4, codebook, 8),
              "down": random_parts(inter, hidden, 3, codebook, 9)}
    moe = MoeReference(gates, ups, downs, shared)
    for t_rows in rows:
        x = torch.randn((t_rows, hidden), generator=gen, device=dev).half()
        ids = torch.stack([torch.randperm(experts, generator=gen, device=dev)[:8] for _ in range(t_rows)])
        wts = torch.rand((t_rows, 8), generator=gen, device=dev) * 0.4
        try:
            plan = moe.plan(t_rows)
            fused = moe(x, ids, wts).clone()
        except NotImplementedError as exc:
            print(f"moe T={t_rows}: {exc}", flush=True)
            continue
        st = error_stats(fused, moe.composed(x, ids, wts))
        sel, rw = moe.routing(ids, wts)
        t = graph_time_us(moe, 10, [(x, sel, rw)])
        report["moe"].append({"rows": t_rows, **st, "us": t["median_us"], "mode": t["mode"], "plan": plan})
        print(f"moe E={experts} {codebook} T={t_rows}: fused vs composed max_rel {st['max_rel']:.2e} "
              f"rms_rel {st['rms_rel']:.2e}; fused {t['median_us']:.1f} us ({t['mode']}); kernels "
              f"{sorted({g['kernel'] for g in plan['groups']})} shared {plan['shared']}", flush=True)
    return report
