"""Reading and validating a safetensors file's header without touching its data.

Layout: an 8-byte little-endian u64 N, N bytes of UTF-8 JSON (an object, possibly space-padded),
then the data buffer. Each tensor entry gives `dtype`, `shape` and `data_offsets` [begin, end)
relative to the buffer; the buffer must be covered exactly (no holes, no overlaps), so a complete
file has size 8 + N + max(end). A Git LFS pointer (a small text file) read as safetensors has a
length field of about 2.3e18; it is recognised by its first line and named as such.

`read_header(path)` returns a `ShardHeader` or raises `ShardError`, whose `kind` is one of
`SHARD_ERROR_KINDS` and whose message names the file, the problem and the remedy.
"""
from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own cap
LFS_MAGIC = b"version https://git-lfs.github.com/spec/v1"
_LFS_PROBE_BYTES = 1024  # an LFS pointer is ~130 bytes; read a little more to parse it

# Bits per element. Sub-byte types (F4, F6_*) pack elements; a tensor's bits must fill whole bytes.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

SHARD_ERROR_KINDS = (
    "missing", "unreadable", "lfs_pointer", "too_short", "header_length", "header_json",
    "header_schema", "dtype", "shape_span", "overlap", "hole", "truncated",
    "trailing_bytes", "size_mismatch",
)

REDOWNLOAD = "re-download it: bash fetch_weights.sh (resumes and replaces damaged files)"


class ShardError(Exception):
    """A file that is not a complete, valid safetensors shard."""

    def __init__(self, kind: str, path: str | Path, detail: str, remedy: str = REDOWNLOAD) -> None:
        assert kind in SHARD_ERROR_KINDS, kind
        self.kind = kind
        self.path = str(path)
        self.detail = detail
        self.remedy = remedy
        super().__init__(f"{self.path}: {detail}; {remedy}")


class TensorInfo(NamedTuple):
    """One header entry. A NamedTuple: a real checkpoint has ~230k of them, made in a hot loop."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data buffer
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype]


@dataclass(frozen=True)
class ShardHeader:
    path: str
    header_len: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_offset(self) -> int:
        """File offset of the data buffer (tensor offsets are relative to it)."""
        return 8 + self.header_len

    @property
    def data_bytes(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)


@dataclass(frozen=True)
class LfsPointer:
    oid: str | None  # "sha256:<hex>"
    size: int | None


def parse_lfs_pointer(head: bytes) -> LfsPointer | None:
    """The oid and size of a Git LFS pointer, or None when `head` is not one."""
    if not head.startswith(LFS_MAGIC):
        return None
    text = head.decode("utf-8", errors="replace")
    oid = re.search(r"^oid (\S+)$", text, re.MULTILINE)
    size = re.search(r"^size (\d+)$", text, re.MULTILINE)
    return LfsPointer(oid.group(1) if oid else None, int(size.group(1)) if size else None)


def lfs_pointer_error(path: str | Path, pointer: LfsPointer, file_size: int, expected_size: int | None) -> ShardError:
    real = expected_size if expected_size is not None else pointer.size
    size_text = f"{real:,} bytes" if real is not None else "an unknown size"
    return ShardError(
        "lfs_pointer", path,
        f"is a Git LFS pointer ({file_size} bytes, {pointer.oid or 'no oid'}), not the weights; the real file has {size_text}",
        "the checkout was made without git-lfs: fetch with bash fetch_weights.sh (huggingface_hub) or run `git lfs pull`",
    )


def read_header(path: str | Path, *, expected_size: int | None = None) -> ShardHeader:
    """Parse and validate `path`'s header (reads at most 8 + N bytes). Raises ShardError."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ShardError("missing", path, "is missing", REDOWNLOAD) from None
    except OSError as exc:
        raise ShardError("unreadable", path, f"cannot be examined ({exc.strerror})", "check the path and its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ShardError("unreadable", path, f"is {what}", "remove it and re-download: bash fetch_weights.sh")
    try:
        with open(path, "rb") as f:
            head = f.read(_LFS_PROBE_BYTES)
            pointer = parse_lfs_pointer(head)
            if pointer is not None:
                raise lfs_pointer_error(path, pointer, st.st_size, expected_size)
            if len(head) < 8:
                raise ShardError("too_short", path, f"is {st.st_size} bytes, too short to hold a safetensors header (8-byte length + JSON)")
            (n,) = struct.unpack("<Q", head[:8])
            if n > MAX_HEADER_BYTES:
                raise ShardError("header_length", path, f"header length field is {n:,}, over the {MAX_HEADER_BYTES:,}-byte cap (corrupt, or not a safetensors file)")
            if 8 + n > st.st_size:
                raise ShardError("header_length", path, f"header length {n:,} runs past the end of the file ({st.st_size:,} bytes): truncated or corrupt")
            raw = head[8:8 + n]
            if len(raw) < n:
                raw += f.read(n - len(raw))
    except ShardError:
        raise
    except OSError as exc:
        raise ShardError("unreadable", path, f"cannot be read ({exc.strerror})", "check the file's permissions and the disk") from None
    return parse_header_bytes(raw, path=path, file_size=st.st_size, expected_size=expected_size)


def parse_header_bytes(raw: bytes, *, path: str | Path, file_size: int, expected_size: int | None = None) -> ShardHeader:
    """Validate the JSON header `raw` (the N bytes after the length field) of a file of `file_size` bytes."""
    n = len(raw)
    if not raw.startswith(b"{"):
        raise ShardError("header_json", path, "header does not start with '{': not a safetensors JSON header")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError("header_json", path, f"header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ShardError("header_json", path, "header JSON is not an object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ShardError("header_schema", path, "__metadata__ must map strings to strings")
    tensors = {name: _tensor_entry(path, name, entry) for name, entry in doc.items()}
    _check_coverage(path, tensors)
    data_end = max((t.end for t in tensors.values()), default=0)
    want = 8 + n + data_end
    if file_size < want:
        raise ShardError("truncated", path, f"is truncated: {file_size:,} bytes, the header describes {want:,} ({want - file_size:,} missing)")
    if file_size > want:
        raise ShardError("trailing_bytes", path, f"has {file_size - want:,} bytes after the last tensor (size {file_size:,}, header describes {want:,})")
    if expected_size is not None and file_size != expected_size:
        raise ShardError("size_mismatch", path, f"is {file_size:,} bytes but the hub recorded {expected_size:,}: a different or damaged file")
    return ShardHeader(str(path), n, file_size, tensors, dict(metadata))


def _tensor_entry(path: str | Path, name: str, entry: Any) -> TensorInfo:
    where = f"tensor '{name}'"
    if not isinstance(entry, dict):
        raise ShardError("header_schema", path, f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise ShardError("dtype", path, f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    # type(x) is int: JSON gives exact ints, and this excludes bools (hot loop: 230k tensors)
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ShardError("header_schema", path, f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1]):
        raise ShardError("header_schema", path, f"{where}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end")
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != info.nbytes:
        raise ShardError("shape_span", path, f"{where}: shape {list(shape)} x {dtype} is {bits / 8:g} bytes but data_offsets span {info.nbytes:,}")
    return info


def _check_coverage(path: str | Path, tensors: dict[str, TensorInfo]) -> None:
    """The spans must tile [0, max end) exactly: sorted by begin, each starts where the last ended."""
    cursor = 0
    previous: TensorInfo | None = None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < cursor:
            assert previous is not None
            raise ShardError("overlap", path, f"tensors '{previous.name}' [{previous.begin}, {previous.end}) and '{t.name}' [{t.begin}, {t.end}) overlap")
        if t.begin > cursor:
            raise ShardError("hole", path, f"bytes [{cursor}, {t.begin}) of the data buffer belong to no tensor (before '{t.name}')")
        cursor = t.end
        previous = t
