"""The prefix cache of a glm53 engine: its key (everything besides the tokens that decides a row's
bits) and the cache built from the engine's settings. The composition root (glm53/serving/compose.py)
passes it into the engine, which sees it as glm53.runtime.features.PrefixCache and calls, per request,
`lookup(prompt, live_tokens=state.tokens, live_frontier=state.frontier)`, truncates its state to
`hit.live_tokens`, `Hit.restore` into `KVState.import_rows` (disk files are read there; it
returns the reused length, less where a file failed verification), prefills from that length,
then `store(prompt, frontier, rows_for)` with `KVState.export_rows(start, stop)`. This module
builds that cache with the engine's cache block size (`engine.cache_block`) and reuse boundary
(`engine.reuse_boundary`: None where the kernels are row-invariant) and the right key:

    engine = Glm53Engine(model_dir, ...)
    cache = attach_prefix_cache(engine)     # engine.settings: prefix_cache, disk_cache, ... (glm53/settings.py)
                                            # (prefix_cache_for(engine) builds one without plugging it in)
    engine.generate(prompt, max_tokens)     # engine.last_stats["cached_tokens"] = reused rows
    cache.stats_dict()

Over several ranks every rank keeps its own PrefixCache (its key names the rank and the rank count;
under DCP a node's rows are the rank's own local slots) and the agreement is a minimum over ranks:
`min_over_comm(comm)` through glm53.dist's guarded all-gather (a dead or stuck peer ends in the
guard's named error, never a hang), or `min_over_ranks(group)` over plain torch.distributed.
"""
from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from glm53 import ops
from glm53.settings import Settings

from .cache import CacheConfigError, PrefixCache
from .keys import CacheKey, model_revision


def device_kind(device: torch.device | str) -> str:
    """What decides kernel choice, hence bits: the GPU's name, or the CPU's ISA level."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "unknown"
    return f"cpu/{cap}"


def numerics_source(root: Path | None = None) -> str:
    """A digest of the engine's Python source (every .py under glm53/, `root`): what computes a row
    (ops, model, KV storage, weight decoding, the ranks' arithmetic). A kit upgrade that touches any
    of it changes the key, so rows from the old code are never reused by the new one even where the
    manual numerics tag was not bumped (a miss costs one prefill; reuse of other bits breaks
    contract 1). Any edit counts, comments too: over-invalidation is the safe side."""
    root = Path(ops.__file__).resolve().parents[1] if root is None else Path(root)  # the glm53 package
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def kernel_stack(device: torch.device | str) -> tuple[tuple[str, str], ...]:
    """What else decides a row's bits on `device`: on CUDA the kernels in use (Triton or the torch
    debugging path, TF_GLM53_KERNELS), Triton's version and its FP-contraction default (an upgrade or
    TRITON_DEFAULT_FP_FUSION can change the compiled arithmetic while torch's version stays); on the
    CPU the MKL code path and reproducibility mode chosen by the environment (MKL_ENABLE_INSTRUCTIONS,
    MKL_CBWR: other kernels, other bits, on the same CPU)."""
    if torch.device(device).type != "cuda":
        return tuple((name.lower(), os.environ.get(name, "default")) for name in ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR"))
    if ops.kernel_choice() == "torch":
        return (("kernels", "torch"),)
    version = "none"
    for dist_name in ("triton", "pytorch-triton"):
        try:
            version = metadata.version(dist_name)
            break
        except metadata.PackageNotFoundError:
            continue
    return (("kernels", "triton"), ("triton", version),
            ("triton_fp_fusion", os.environ.get("TRITON_DEFAULT_FP_FUSION", "default")))


class CachedEngine(Protocol):
    """What the cache reads of the engine it serves (glm53.runtime.engine.Glm53Engine)."""

    model_dir: Path
    plan: Any  # world, rank and (over several ranks) dcp
    chunk: int
    cache_block: int
    reuse_boundary: int | None
    device: torch.device
    kv_dtype: str
    dtype_name: str
    settings: Settings
    model: Any  # new_state(kv_dtype).position_bytes(): one position's bytes
    prefix_cache: Any


def cache_key_for(engine: CachedEngine, revision: str | None = None) -> CacheKey:
    """The key of everything in `engine` that changes its KV bits besides the tokens."""
    plan = engine.plan
    # "numerics": the arithmetic that writes a KV row (row-invariant kernels, sparse prefill past
    # index_topk): bump it whenever a change alters the bits a row gets, so older rows never match.
    # "prefill_grid": the engine's prefill chunking, which decides the bits where kernels are not
    # row-invariant (the block size B is the key's chunk_size).
    extra = (("numerics", "row-invariant-1"), ("prefill_grid", str(engine.chunk)), ("torch", torch.__version__),
             ("mkldnn", str(bool(torch.backends.mkldnn.enabled))),
             ("numerics_source", numerics_source())) + kernel_stack(engine.device)
    return CacheKey(
        model_revision=revision or model_revision(engine.model_dir),
        kv_dtype=str(engine.kv_dtype),
        compute_dtype=str(engine.dtype_name),
        ranks=int(plan.world),
        rank=int(plan.rank),
        dcp=bool(getattr(plan, "dcp", int(plan.world) > 1)),  # DistRankPlan says; TF_GLM53_DCP=0 turns it off
        chunk_size=int(engine.cache_block),
        device_kind=device_kind(engine.device),
        extra=extra,
    )


def min_over_ranks(group: Any = None) -> Callable[[int], int]:
    """A MIN all-reduce of one integer over torch.distributed (identity where not initialized
    or world 1). Every rank must call lookup for the same request, in the same order."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return lambda n: n

    def agree(n: int) -> int:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    return agree


def min_over_comm(comm: Any) -> Callable[[int], int]:
    """The minimum of one integer over a glm53.dist Comm's ranks, through its guarded all-gather."""
    if comm.world_size == 1:
        return lambda n: n

    def agree(n: int) -> int:
        parts = comm.all_gather(torch.tensor([n], dtype=torch.int64, device=comm.device), name="prefix_cache_agree")
        return int(parts.min().item())

    return agree


def same_settings_over_comm(comm: Any, enabled: bool, disk: bool, boundary: int | None = None) -> None:
    """Every rank must run the cache the same way: each lookup agrees over the ranks, and with a
    disk tier each restore agrees once more, so a rank with the cache off or without a disk tier
    would pair its collectives with another request's; a rank flooring reuse to another boundary
    would fail the agreement. One all-gather at start-up; a mismatch raises on every rank, naming
    each rank's settings."""
    if comm.world_size == 1:
        return
    mine = torch.tensor([int(enabled), int(disk), boundary or 0], dtype=torch.int64, device=comm.device)
    every = comm.all_gather(mine, name="prefix_cache_settings").tolist()
    if any(row != every[0] for row in every):
        said = "; ".join(f"rank {r}: TF_GLM53_PREFIX_CACHE={on}, disk tier {'on' if d else 'off'}, "
                         f"reuse boundary {b or 'any token'}" for r, (on, d, b) in enumerate(every))
        raise CacheConfigError(f"the ranks' prefix cache settings differ ({said}): set the same TF_GLM53_PREFIX_CACHE, "
                               "TF_GLM53_DISK_CACHE and TF_GLM53_PREFIX_REUSE_BOUNDARY for every rank (the cluster "
                               "file's env)")


def prefix_cache_for(engine: CachedEngine, *, revision: str | None = None, group: Any = None, comm: Any = None,
                     settings: Settings | None = None) -> PrefixCache:
    """The cache for `engine` from `settings` (default the engine's, `engine.settings`). Over several
    ranks build it on every rank with the rank's `comm` (every rank then looks up every request)."""
    agree = min_over_comm(comm) if comm is not None else min_over_ranks(group)
    settings = engine.settings if settings is None else settings
    cache = PrefixCache.from_settings(cache_key_for(engine, revision), settings, agree=agree,
                                      boundary=engine.reuse_boundary, on_gpu=torch.device(engine.device).type == "cuda",
                                      position_bytes=engine.model.new_state(engine.kv_dtype).position_bytes())
    if comm is not None:
        try:
            same_settings_over_comm(comm, cache.enabled, cache.disk is not None, cache.boundary)
        except CacheConfigError:
            cache.close()
            raise
    return cache


def attach_prefix_cache(engine: CachedEngine, *, revision: str | None = None, group: Any = None, comm: Any = None,
                        settings: Settings | None = None) -> PrefixCache:
    """A new cache for `engine` (prefix_cache_for) in place of the one it has: tests and benches that
    switch an engine's cache settings."""
    previous = getattr(engine, "prefix_cache", None)
    if previous is not None:  # its stores land and its writer thread ends, not at process exit
        engine.prefix_cache = None
        previous.close()
    engine.prefix_cache = prefix_cache_for(engine, revision=revision, group=group, comm=comm, settings=settings)
    return engine.prefix_cache
