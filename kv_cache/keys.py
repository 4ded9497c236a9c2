"""Cache keys and the chain of block hashes.

A `CacheKey` names everything that decides the bits of a KV row besides the tokens: model
revision, KV and compute dtypes, rank count and this rank, DCP on/off, cache block size, device
kind and kit version. Its digest seeds the hash chain, so rows computed under another model,
setting or kit version can never match: their chain hashes differ from the first block on.

Block k's hash is H(hash of block k-1, token ids of block k): equal hashes mean equal keys and
equal token ids over [0, (k+1)B), i.e. the whole prefix, not just the block. A tail (the last,
partial block of a stored prefix) is hashed the same way over its own, fewer, tokens (a shorter
message, so it never collides with a full block).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Sequence

import numpy as np

HASH_BYTES = 16  # 128-bit blake2b: collisions are not a practical concern at cache sizes


def kit_version() -> str:
    try:
        return metadata.version("glm53-kit")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class CacheKey:
    model_revision: str
    kv_dtype: str  # "bfloat16" or "float8_e4m3fn" (rows + per-row scale)
    compute_dtype: str
    ranks: int
    rank: int
    dcp: bool
    chunk_size: int  # the cache block size B (independent of the engine's prefill grid)
    device_kind: str  # e.g. "cpu", "NVIDIA H200"
    kit_version: str = field(default_factory=kit_version)
    extra: tuple[tuple[str, str], ...] = ()  # anything else that changes the bits

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"CacheKey: rank {self.rank} outside [0, {self.ranks})")
        if self.chunk_size <= 0:
            raise ValueError(f"CacheKey: chunk_size must be positive, got {self.chunk_size}")

    def to_json(self) -> str:
        d = asdict(self)
        d["extra"] = [list(p) for p in self.extra]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "CacheKey":
        d = json.loads(text)
        d["extra"] = tuple(tuple(p) for p in d.get("extra", ()))
        return cls(**d)

    def digest(self) -> bytes:
        return _digest(self)


@functools.lru_cache(maxsize=64)
def _digest(key: CacheKey) -> bytes:
    # once per key: every lookup and store seeds its chain with it (asdict + json: ~10 us each)
    return hashlib.blake2b(key.to_json().encode(), digest_size=HASH_BYTES).digest()


Tokens = np.ndarray  # int64 token ids, one per position


def token_array(tokens: Sequence[int] | np.ndarray) -> Tokens:
    return np.asarray(tokens, dtype=np.int64)


def block_hash(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The chain hash of a node (a full block or a tail) whose parent hash is `parent`."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(np.ascontiguousarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def chain_hashes(key: CacheKey, token_ids: Sequence[int] | np.ndarray, chunks: int | None = None,
                 known: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of the whole blocks of `token_ids` (at most `chunks` of them), in order. `known`:
    the hashes of its first blocks, already computed (they are taken as they are)."""
    b = key.chunk_size
    toks = token_array(token_ids)
    n = len(toks) // b if chunks is None else min(chunks, len(toks) // b)
    out: list[bytes] = list(known[:n])
    parent = out[-1] if out else key.digest()
    for k in range(len(out), n):
        parent = block_hash(parent, toks[k * b:(k + 1) * b])
        out.append(parent)
    return out


def root_hash(key: CacheKey) -> bytes:
    """The parent of block 0."""
    return key.digest()


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def model_revision(model_dir: str | os.PathLike) -> str:
    """A cheap fingerprint of a checkpoint: config.json and the weight index in full, and for
    every weight file its name, size and a hash of its first and last MiB (safetensors headers
    and data at both ends). Hashing a 300 GB pack in full at start-up is not affordable; a
    checkpoint that differs only in the middle of a file and nowhere else is not a realistic
    case. Callers with a published revision (a hub commit) should pass that instead."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for name in ("config.json", "model.safetensors.index.json", "quantization_config.json"):
        p = root / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    mib = 1 << 20
    for p in sorted(root.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with p.open("rb") as f:
            h.update(f.read(mib))
            if size > mib:
                f.seek(max(mib, size - mib))
                h.update(f.read(mib))
    return h.hexdigest()
