"""Disk tier: one file per chunk, named by its chain hash, surviving a restart.

Layout: DIR/<key digest>/<chain hash>.kvc, so each (model, settings, rank, kit version) has its
own folder and budget. A file is

    magic "GLM53KVC" | u32 format version | u32 header length N | 16-byte blake2b of the header
    | N bytes of JSON header | payload

and the header holds the full key, the chain hash, the parent hash, each tensor's name, dtype,
shape, offset and size, the payload length and the payload's blake2b. Files are written to a
temporary name, fsynced and renamed, so a reader sees a whole file or none. Anything that does
not verify (magic, version, header digest, key, hash vs. name, sizes, payload checksum) is a
miss and is moved to DIR/<key digest>/quarantine/, never returned. The index is rebuilt from the
headers at start; payload checksums are verified on every load. Eviction is LRU by mtime (loads
and stores set it explicitly, tip of a chain first, so parents stay newer than children).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .keys import HASH_BYTES, CacheKey
from .rows import Rows, rows_nbytes

log = logging.getLogger("kv_cache")

MAGIC = b"GLM53KVC"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sII16s")  # magic, version, header length, header digest
SUFFIX = ".kvc"
TMP_PREFIX = ".tmp."
QUARANTINE = "quarantine"
_MAX_HEADER = 1 << 20


class CorruptEntry(Exception):
    """A file that must not be used; the message says why."""


@dataclass
class _Entry:
    path: Path
    parent: bytes
    size: int
    mtime_ns: int


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CorruptEntry(f"unknown dtype {name!r}")
    return dt


def encode(key: CacheKey, h: bytes, parent: bytes, rows: Rows) -> list[bytes | memoryview]:
    """The file's bytes as a list of pieces (payload pieces are views, not copies)."""
    tensors, pieces, offset = [], [], 0
    payload_hash = hashlib.blake2b(digest_size=HASH_BYTES)
    for name in sorted(rows):
        t = rows[name].detach().to("cpu").contiguous()
        raw = memoryview(t.view(torch.uint8).reshape(-1).numpy())
        tensors.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "offset": offset, "nbytes": raw.nbytes})
        payload_hash.update(raw)
        pieces.append(raw)
        offset += raw.nbytes
    header = json.dumps({"key": json.loads(key.to_json()), "hash": h.hex(), "parent": parent.hex(),
                         "tensors": tensors, "payload_bytes": offset,
                         "payload_blake2b": payload_hash.hexdigest()},
                        sort_keys=True, separators=(",", ":")).encode()
    pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header), _digest(header))
    return [pre, header, *pieces]


def read_header(f, file_size: int) -> dict:
    pre = f.read(_PREAMBLE.size)
    if len(pre) < _PREAMBLE.size:
        raise CorruptEntry("short file: preamble cut off")
    magic, version, hlen, hdigest = _PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, this kit reads {FORMAT_VERSION}")
    if hlen > _MAX_HEADER:
        raise CorruptEntry(f"header length {hlen} too large")
    header = f.read(hlen)
    if len(header) < hlen:
        raise CorruptEntry("short file: header cut off")
    if _digest(header) != hdigest:
        raise CorruptEntry("header checksum mismatch")
    meta = json.loads(header)
    expected = _PREAMBLE.size + hlen + int(meta["payload_bytes"])
    if file_size != expected:
        raise CorruptEntry(f"file is {file_size} bytes, header says {expected}")
    return meta


class DiskTier:
    def __init__(self, root: str | os.PathLike, key: CacheKey, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"TF_GLM53_DISK_CACHE_BYTES must be >= 0, got {budget_bytes}")
        self.key = key
        self._key_json = json.loads(key.to_json())
        self.budget_bytes = budget_bytes
        self.dir = Path(root) / key.digest().hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"TF_GLM53_DISK_CACHE={root}: cannot create {self.dir}: {e.strerror}; "
                          "point it at a writable directory or unset it") from e
        self.index: dict[bytes, _Entry] = {}
        self._lock = threading.RLock()  # index and byte count; file I/O runs outside it
        self.used_bytes = 0
        self.evictions = 0
        self.quarantined = 0
        self.write_errors = 0
        self._scan()

    # ---- start-up -------------------------------------------------------------------------
    def _scan(self) -> None:
        for p in self.dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                self._remove_stale_tmp(p)
            elif p.suffix == SUFFIX and p.is_file():
                try:
                    st = p.stat()
                    with p.open("rb") as f:
                        meta = read_header(f, st.st_size)
                    h, parent = self._check_meta(meta, p)
                except (CorruptEntry, ValueError, KeyError, TypeError) as e:
                    self._quarantine(p, str(e))
                    continue
                except OSError as e:
                    log.warning("kv_cache disk: cannot read %s (%s); ignored", p, e)
                    continue
                self.index[h] = _Entry(p, parent, st.st_size, st.st_mtime_ns)
                self.used_bytes += st.st_size
        log.info("kv_cache disk: %d chunks, %d bytes in %s", len(self.index), self.used_bytes, self.dir)

    def _remove_stale_tmp(self, p: Path) -> None:
        """A temp file of a writer that is gone (killed mid-write): never an entry, delete it."""
        try:
            pid = int(p.name[len(TMP_PREFIX):].split(".", 1)[0])
        except ValueError:
            pid = -1
        if pid > 0 and pid != os.getpid() and _alive(pid):
            return
        try:
            p.unlink()
            log.info("kv_cache disk: removed unfinished write %s", p.name)
        except OSError:
            pass

    def _check_meta(self, meta: dict, p: Path) -> tuple[bytes, bytes]:
        if meta["key"] != self._key_json:
            raise CorruptEntry("foreign entry: written under another key (model, settings or kit)")
        h = bytes.fromhex(meta["hash"])
        if p.name != h.hex() + SUFFIX:
            raise CorruptEntry(f"file name does not match its chain hash {meta['hash']}")
        return h, bytes.fromhex(meta["parent"])

    def _quarantine(self, p: Path, why: str) -> None:
        self.quarantined += 1
        log.warning("kv_cache disk: %s is unusable (%s); moved to %s/, treated as a miss", p, why, QUARANTINE)
        qdir = self.dir / QUARANTINE
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(p, qdir / f"{p.name}.{uuid.uuid4().hex[:8]}")
            # keep only the newest few for inspection
            old = sorted(qdir.iterdir(), key=lambda q: q.stat().st_mtime_ns)
            for q in old[:-16]:
                q.unlink(missing_ok=True)
        except OSError:
            p.unlink(missing_ok=True)

    # ---- reads ----------------------------------------------------------------------------
    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self.index

    def load(self, h: bytes) -> Rows | None:
        """The chunk's rows, fully verified, or None (a miss)."""
        with self._lock:
            e = self.index.get(h)
        if e is None:
            return None
        try:
            with e.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                meta = read_header(f, size)
                got_h, _ = self._check_meta(meta, e.path)
                if got_h != h:
                    raise CorruptEntry("chain hash mismatch")
                payload = bytearray(int(meta["payload_bytes"]))
                if f.readinto(payload) != len(payload):
                    raise CorruptEntry("short file: payload cut off")
            if hashlib.blake2b(payload, digest_size=HASH_BYTES).hexdigest() != meta["payload_blake2b"]:
                raise CorruptEntry("payload checksum mismatch")
            rows = _decode(meta, payload)
        except FileNotFoundError:
            with self._lock:
                self._drop(h)
            return None
        except (CorruptEntry, ValueError, KeyError, TypeError, RuntimeError) as err:
            with self._lock:
                self._drop(h)
                self._quarantine(e.path, str(err))
            return None
        return rows

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            self._touch_chain(hashes)

    def _touch_chain(self, hashes: Sequence[bytes]) -> None:
        now = time.time_ns()
        for i, h in enumerate(reversed(hashes)):  # root newest
            e = self.index.get(h)
            if e is None:
                continue
            e.mtime_ns = now + i
            try:
                os.utime(e.path, ns=(e.mtime_ns, e.mtime_ns))
            except OSError:
                self._drop(h)

    # ---- writes ---------------------------------------------------------------------------
    def put_chain(self, root: bytes, hashes: Sequence[bytes], rows: Sequence[Rows | None]) -> int:
        """Write the chain's chunks that are not on disk (rows[i] None = not available, stop).
        Returns the number written. A failed write (full disk, I/O error) is logged and ends
        the chain; the cache keeps working without those entries."""
        written = 0
        parent = root
        protect = set(hashes)
        for h, r in zip(hashes, rows):
            if h not in self:
                if r is None or (parent != root and parent not in self):
                    break
                pieces = encode(self.key, h, parent, r)
                size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
                with self._lock:
                    fits = size <= self.budget_bytes and self._make_room(size, protect)
                if not fits or not self._write(h, pieces, size, parent):
                    break
                written += 1
            parent = h
        self.touch_chain(hashes)
        return written

    def _write(self, h: bytes, pieces: list, size: int, parent: bytes) -> bool:
        final = self.dir / (h.hex() + SUFFIX)
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}.{uuid.uuid4().hex}"
        try:
            with tmp.open("wb") as f:
                for piece in pieces:
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except OSError as e:
            self.write_errors += 1
            tmp.unlink(missing_ok=True)
            level = logging.WARNING
            why = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else e.strerror
            log.log(level, "kv_cache disk: write of %s failed (%s); entry skipped", final.name, why)
            return False
        st = final.stat()
        with self._lock:
            self.index[h] = _Entry(final, parent, st.st_size, st.st_mtime_ns)
            self.used_bytes += st.st_size
        return True

    def _make_room(self, need: int, protect: set[bytes]) -> bool:
        if self.used_bytes + need <= self.budget_bytes:
            return True
        before, chunks = self.used_bytes, 0
        for h in sorted(self.index, key=lambda x: self.index[x].mtime_ns):
            if self.used_bytes + need <= self.budget_bytes:
                break
            if h in protect or h not in self.index:
                continue
            chunks += self._evict(h)
        if chunks:
            log.info("kv_cache disk evict: %d chunks, %d bytes (budget %d)", chunks, before - self.used_bytes,
                     self.budget_bytes)
        return self.used_bytes + need <= self.budget_bytes

    def evict(self, h: bytes) -> int:
        """Delete a chunk and its descendants (unreachable without it)."""
        with self._lock:
            return self._evict(h)

    def _evict(self, h: bytes) -> int:
        e = self.index.get(h)
        if e is None:
            return 0
        self._drop(h)
        e.path.unlink(missing_ok=True)
        self.evictions += 1
        removed = 1
        for child in [c for c, ce in self.index.items() if ce.parent == h]:
            removed += self._evict(child)
        return removed

    def _drop(self, h: bytes) -> None:
        e = self.index.pop(h, None)
        if e is not None:
            self.used_bytes -= e.size


class BackgroundWriter:
    """Writes chains to a DiskTier on one thread, so disk I/O stays off the request's path.
    The rows handed over are the host tier's copies, never modified afterwards."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.written = 0
        self._jobs: "queue.Queue[tuple[bytes, list[bytes], list[Rows | None]] | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv_cache-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, root: bytes, hashes: Sequence[bytes], rows: Sequence[Rows | None]) -> None:
        self._jobs.put((root, list(hashes), list(rows)))

    def flush(self) -> None:
        """Wait until every submitted chain is on disk (or failed and was logged)."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self.written += self.tier.put_chain(*job)
            except Exception:  # a cache write must never take the server down
                log.exception("kv_cache disk: background write failed; entry skipped")
            finally:
                self._jobs.task_done()


def _decode(meta: dict, payload: bytearray) -> Rows:
    buf = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    rows: Rows = {}
    for t in meta["tensors"]:
        off, n = int(t["offset"]), int(t["nbytes"])
        if off < 0 or off + n > len(payload):
            raise CorruptEntry(f"tensor {t['name']} outside the payload")
        dt, shape = _dtype(t["dtype"]), [int(s) for s in t["shape"]]
        part = buf[off:off + n]
        rows[t["name"]] = part.view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)
    return rows


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
