"""The disk tier's file format: one node per file, verified in full before any byte is used.

    magic "GLM53KVC" | u32 format version | u32 header length N | 16-byte digest of the header
    | N bytes of JSON header, space-padded so the payload starts 64-byte aligned | payload

The header holds the full key, the node's chain hash, its parent hash and token ids, the tensors
as runs (names of consecutive tensors of one dtype and shape, that dtype and shape, the first's
offset, 64-byte aligned, so decoded tensors are views into the read buffer, no copy, and each
one's size), the payload length and the payload's XXH3-128. The header's own digest
is SHA-256 (it is small); the payload's is XXH3 because a resume verifies every byte it reads:
SHA-256 ran at 1.26 GB/s a core on the H200 host, XXH3-128 at 7.7 (77 at 16 threads,
docs/decisions/host-copies-and-disk-reads.md), and at GLM-5.3's depth a 94k-token resume is 8.7 GiB. The checksum
guards against torn, truncated or rotted files, not against someone who can write the cache
folder (they could write a consistent file under any digest). xxhash releases the GIL, so
reader threads verify in parallel.

Version 3 (this one) changed the payload digest from SHA-256 to XXH3-128 and lists tensors as
runs; version 2 added the tokens and the alignment. Files of any other version are refused (the
tier quarantines them), never misread.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from dataclasses import dataclass
from math import prod
from typing import BinaryIO, Sequence

import numpy as np
import torch
import xxhash

from .keys import block_hash
from .node import Node
from .rows import Rows, StackedRows

MAGIC = b"GLM53KVC"
FORMAT_VERSION = 3
PREAMBLE = struct.Struct("<8sII16s")  # magic, version, header length, header digest
ALIGN = 64
MAX_HEADER = 4 << 20  # tokens of a 64k block fit with room to spare


class CorruptEntry(Exception):
    """A file that must not be used; the message says why."""


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def header_digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()[:16]


@dataclass(frozen=True)
class Header:
    key: dict
    hash: bytes
    parent: bytes
    tokens: np.ndarray
    runs: tuple[dict, ...]  # {names, dtype, shape, offset of the first, nbytes of each}
    payload_start: int  # absolute offset in the file
    payload_bytes: int
    payload_xxh3: str
    preamble: bytes  # the file's first PREAMBLE.size bytes (its digest covers the header)

    @property
    def file_size(self) -> int:
        return self.payload_start + self.payload_bytes


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def layer_order(name: str) -> tuple[str, int]:
    """Sort key: "latent.10" after "latent.9" (kind, then layer number), so a run of one kind's
    layers is in the engine's layer order and lands in its cache as one strided copy."""
    kind, _, layer = name.rpartition(".")
    return (kind, int(layer)) if layer.isdigit() else (name, -1)


def plan(rows: Rows) -> tuple[list["Run"], int]:
    """Where each tensor of `rows` goes in a payload (or a restore buffer), in layer_order: at a
    64-byte aligned offset (relative to the payload's start), consecutive tensors of one dtype and
    shape that lie back to back forming one run. Returns the runs and the payload's size. (Files
    written before the order changed list their runs by plain sorted name; they read the same,
    their names being in the header.)"""
    runs: list[Run] = []
    offset = 0
    for name in sorted(rows, key=layer_order):
        t = rows[name]
        n, shape = t.numel() * t.element_size(), tuple(t.shape)
        offset += -offset % ALIGN
        last = runs[-1] if runs else None
        if (last is not None and (last.dtype, last.shape) == (t.dtype, shape)
                and offset == last.start + len(last.names) * n):
            runs[-1] = Run(last.names + (name,), last.start, n, t.dtype, shape)
        else:
            runs.append(Run((name,), offset, n, t.dtype, shape))
        offset += n
    return runs, offset


def pack(rows: Rows, runs: list["Run"], buf: torch.Tensor) -> None:
    """Copy `rows` into the host buffer `buf` where `plan(rows)` put them: a run that is one of
    StackedRows' stacks (a host-tier node after a store, staging.py) as one memcpy, any other run
    as one grouped copy.

    Why a memcpy: restore.py's readers pack in parallel, and a torch copy runs as an intra-op
    parallel loop with its own thread team in each reader. On the H200 host (docs/decisions/host-copies-and-disk-reads.md:
    8 readers, a 94k resume at 78 layers from the host tier, 256-position nodes): a torch copy
    per tensor 0.92-1.19 s, a memmove per tensor 0.78-0.80 s (the copying thread slowed: the
    GIL taken back ~117 times a node), a memmove per stack 0.35-0.39 s."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(f"pack: the buffer must be contiguous host memory, got {buf.device} strides {buf.stride()}")
    stacks = dict(getattr(rows, "stacks", ()))
    for r in runs:
        if not r.nbytes:
            continue
        block = _block(r, buf)
        stack = stacks.get(r.names)
        if (stack is not None and stack.device.type == "cpu" and stack.is_contiguous()
                and stack.dtype == block.dtype and stack.shape == block.shape):
            ctypes.memmove(block.data_ptr(), stack.data_ptr(), block.numel() * block.element_size())
        else:
            torch._foreach_copy_(list(block.unbind(0)), [rows[name] for name in r.names])


def encode(key_json: dict, node: Node) -> list[bytes | memoryview]:
    """The file's bytes as a list of pieces (tensor pieces are views, not copies)."""
    assert node.rows is not None
    runs, size = plan(node.rows)
    pieces: list[bytes | memoryview] = []
    payload = xxhash.xxh3_128()
    offset = 0
    for r in runs:
        for i, name in enumerate(r.names):
            pad = r.start + i * r.nbytes - offset
            if pad:
                pieces.append(bytes(pad))
                payload.update(bytes(pad))
            raw = _raw(node.rows[name])
            payload.update(raw)
            pieces.append(raw)
            offset = r.start + (i + 1) * r.nbytes
    assert offset == size
    header = json.dumps({"key": key_json, "hash": node.hash.hex(), "parent": node.parent.hex(),
                         "length": int(node.length), "tokens": [int(x) for x in node.tokens],
                         "runs": [{"names": list(r.names), "offset": r.start, "nbytes": r.nbytes,
                                   "dtype": str(r.dtype).removeprefix("torch."), "shape": list(r.shape)}
                                  for r in runs],
                         "payload_bytes": size, "payload_xxh3": payload.hexdigest()},
                        sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-(PREAMBLE.size + len(header)) % ALIGN)
    pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header), header_digest(header))
    return [pre, header, *pieces]


def read_preamble(pre: bytes | memoryview) -> tuple[int, bytes]:
    """(header length, header digest) of a file's first PREAMBLE.size bytes."""
    if len(pre) < PREAMBLE.size:
        raise CorruptEntry("short file: preamble cut off")
    magic, version, hlen, digest = PREAMBLE.unpack(pre[:PREAMBLE.size])
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, this kit reads {FORMAT_VERSION}")
    if hlen > MAX_HEADER:
        raise CorruptEntry(f"header length {hlen} too large")
    return hlen, digest


def read_header(f: BinaryIO, file_size: int) -> Header:
    """The verified header of an open file (two small reads: the index scan's path)."""
    pre = f.read(PREAMBLE.size)
    hlen, _ = read_preamble(pre)
    return parse(pre + f.read(hlen), file_size)


def parse(head: bytes | memoryview, file_size: int) -> Header:
    """The verified header from a file's first bytes (`head` may hold the whole file)."""
    hlen, digest = read_preamble(head)
    raw = head[PREAMBLE.size:PREAMBLE.size + hlen]
    if len(raw) < hlen:
        raise CorruptEntry("short file: header cut off")
    if header_digest(raw) != digest:
        raise CorruptEntry("header checksum mismatch")
    try:
        meta = json.loads(bytes(raw))
        tokens = np.asarray(meta["tokens"], dtype=np.int64)
        h = Header(key=meta["key"], hash=bytes.fromhex(meta["hash"]), parent=bytes.fromhex(meta["parent"]),
                   tokens=tokens, runs=tuple(meta["runs"]), payload_start=PREAMBLE.size + len(raw),
                   payload_bytes=int(meta["payload_bytes"]), payload_xxh3=str(meta["payload_xxh3"]),
                   preamble=bytes(head[:PREAMBLE.size]))
        length = int(meta["length"])
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CorruptEntry(f"malformed header ({e})") from e
    if tokens.ndim != 1 or length != len(tokens):
        raise CorruptEntry("header's length and tokens disagree")
    if h.payload_start % ALIGN:
        raise CorruptEntry("payload not aligned")
    if file_size != h.file_size:
        raise CorruptEntry(f"file is {file_size} bytes, header says {h.file_size}")
    return h


def check_identity(h: Header, key_json: dict, expected: bytes, block: int) -> None:
    """The file is the node it claims to be, under our key: the chain hash is recomputed from
    the parent and tokens, so a renamed or foreign file can never be taken for another node."""
    if h.key != key_json:
        raise CorruptEntry("foreign entry: written under another key (model, settings or kit)")
    if h.hash != expected:
        raise CorruptEntry(f"file name does not match its chain hash {h.hash.hex()}")
    if not 0 < len(h.tokens) <= block:
        raise CorruptEntry(f"{len(h.tokens)} tokens in a node of a {block}-token block")
    if block_hash(h.parent, h.tokens) != h.hash:
        raise CorruptEntry("chain hash does not match the parent and tokens")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CorruptEntry(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True)
class Run:
    """Tensors of one dtype and shape that lie back to back in a file: one view, split by unbind."""

    names: tuple[str, ...]
    start: int  # offset of the first tensor (in a file: from its start; in a plan: from the payload's)
    nbytes: int  # of each tensor
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Known:
    """What reading a file needs of a header verified once (parsed, identity checked): a later read
    of the file whose preamble is byte for byte this one (magic, version, header length and the
    header's SHA-256 digest) has this header, so it is not parsed again; its payload is still
    checked in full. At GLM-5.3's depth a resume reads ~370 files on 8 threads, and each header's
    JSON, digest and identity check held the GIL that the thread copying to the GPU needs. (Header
    bytes that rot after the scan go unnoticed until the next start's scan: the rows returned are
    still exactly the verified header's layout over a payload that matches its checksum.)"""

    preamble: bytes
    file_size: int
    payload_start: int
    payload_xxh3: str
    runs: tuple[Run, ...]

    @classmethod
    def of(cls, h: Header, names: dict[tuple[str, ...], tuple[str, ...]]) -> "Known":
        """`names` keeps one copy of each run's names across a tier's entries (memory per entry)."""
        runs = tuple(Run(names.setdefault(r.names, r.names), r.start, r.nbytes, r.dtype, r.shape) for r in layout(h))
        return cls(h.preamble, h.file_size, h.payload_start, h.payload_xxh3, runs)

    def same_header(self, view: memoryview, size: int) -> bool:
        return size == self.file_size and view[:PREAMBLE.size] == self.preamble

    def verify(self, view: memoryview) -> None:
        """The payload of the whole file in `view` against the checksum."""
        if checksum(view[self.payload_start:self.file_size]) != self.payload_xxh3:
            raise CorruptEntry("payload checksum mismatch")


def layout(h: Header) -> list[Run]:
    """The header's runs, checked against the payload (a 78-layer node's ~117 tensors are two
    runs: every layer's latents, every indexer's keys; its header parses in a fraction of the
    time one entry per tensor took, and its views are two unbinds instead of ~350 calls)."""
    runs: list[Run] = []
    try:
        for r in h.runs:
            names, off, n = tuple(str(x) for x in r["names"]), int(r["offset"]), int(r["nbytes"])
            dt, shape = _dtype(r["dtype"]), tuple(int(s) for s in r["shape"])
            if not names or off < 0 or n < 0 or off % ALIGN or off + len(names) * n > h.payload_bytes:
                raise CorruptEntry(f"tensors {names[:1]} outside the payload")
            if any(d < 0 for d in shape):
                raise CorruptEntry(f"tensor {names[0]}: negative dimension in {shape}")
            if prod(shape) * dt.itemsize != n:
                raise CorruptEntry(f"tensor {names[0]}: shape {shape} does not fit {n} bytes")
            runs.append(Run(names, h.payload_start + off, n, dt, shape))
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CorruptEntry(f"malformed tensor list ({e})") from e
    if len({name for r in runs for name in r.names}) != sum(len(r.names) for r in runs):
        raise CorruptEntry("a tensor name appears twice")
    return runs


def views(runs: Sequence[Run], buf: torch.Tensor) -> StackedRows:
    """The rows laid out by `runs` (layout() of a file, plan() of rows) in `buf`, a uint8 tensor on
    any device, as views; each run is also one stack of them."""
    rows, stacks = StackedRows(), []
    for r in runs:
        if r.nbytes == 0:
            rows.update((name, torch.empty(r.shape, dtype=r.dtype, device=buf.device)) for name in r.names)
            continue
        block = _block(r, buf)
        rows.update(zip(r.names, block.unbind(0)))
        stacks.append((r.names, block))
    rows.stacks = tuple(stacks)
    return rows


def _block(r: Run, buf: torch.Tensor) -> torch.Tensor:
    """Run r's bytes in `buf` as one [count, *shape] tensor of its dtype."""
    return buf[r.start:r.start + len(r.names) * r.nbytes].view(r.dtype).reshape((len(r.names),) + r.shape)
