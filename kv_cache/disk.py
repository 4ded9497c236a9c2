"""Disk tier: one file per node (full block or tail), named by its chain hash, surviving a restart.

Layout: DIR/<key digest>/<chain hash>.kvc, so each (model, settings, rank, kit version) has its
own folder; the format is diskfile.py's. The budget bounds this key's folder, and at start the
folders of other keys (an older kit version, other settings) are removed, least recently used
first, while DIR as a whole is over it: never one a running tier holds (each holds a shared
flock on its folder's LIVE_LOCK while open), nor one touched within STALE_FOLDER_S. A full
filesystem lowers the budget to what this folder holds, so later stores replace its oldest
files instead of failing. Files are written to a temporary name,
fsynced, renamed and the directory fsynced, so a reader sees a whole file or none. At start the
index is rebuilt from the headers (parent and tokens kept in memory: children are found without
file I/O); stale temp files of dead writers are deleted. Anything that does not verify (magic,
version, header digest, key, chain hash vs. name, parent and tokens, sizes, payload checksum on
load) is a miss and is moved to DIR/<key digest>/quarantine/, never returned.

Reads: `read` reads one file with one readinto into a buffer the caller gives (restore.py's ring)
or one of its size, and verifies it there (diskfile.py; a header verified at start-up is not
parsed again, only matched); `load` returns its rows as views.
Which files stay, which a new one replaces and which go for room is tree.py's policy, shared with
the host tier. Its LRU order survives a restart in the files' mtimes (loads and stores set them
explicitly, tip of a chain first, so parents stay newer than children; the index is rebuilt in mtime
order).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from . import diskfile
from .diskfile import CorruptEntry
from .keys import CacheKey, Tokens
from .node import Node
from .rows import Rows
from .tree import CacheTree, Entry

log = logging.getLogger("kv_cache")

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp."
QUARANTINE = "quarantine"
_KEEP_QUARANTINED = 16
STALE_TMP_S = 3600  # a temp file this old is a dead writer's even if its pid now runs something else
STALE_FOLDER_S = 3600  # another key's folder untouched this long belongs to no running server
_FULL = (errno.ENOSPC, errno.EDQUOT)
LIVE_LOCK = ".live"  # flock'ed (shared) by every tier open on its folder; another key's trim skips it
_WRITTEN, _FAILED, _RETRY = "written", "failed", "retry"  # DiskTier._write's outcomes


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class NodeFile:
    """A node's file, the disk tier's payload in the tree (which holds its parent, tokens and size)."""

    path: Path
    mtime_ns: int
    known: diskfile.Known | None = None  # the header as verified at start-up or at the first read


class DiskTier:
    def __init__(self, root: str | os.PathLike, key: CacheKey, budget_bytes: int, threads: int | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"TF_GLM53_DISK_CACHE_BYTES must be >= 0, got {budget_bytes}")
        if threads is not None and threads < 1:
            raise ValueError(f"TF_GLM53_DISK_CACHE_THREADS must be >= 1, got {threads}")
        self.key = key
        self._key_json = json.loads(key.to_json())
        self.budget_bytes = budget_bytes
        self.threads = threads or default_threads()
        self.dir = Path(root) / key.digest().hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"TF_GLM53_DISK_CACHE={root}: cannot create {self.dir}: {e.strerror}; "
                          "point it at a writable directory or unset it") from e
        self._live = _hold_live_lock(self.dir)  # kept open: the lock lasts as long as this process
        self._tree: CacheTree[NodeFile] = CacheTree()
        self._names: dict[tuple[str, ...], tuple[str, ...]] = {}  # one copy of each run's names for all entries
        self._lock = threading.RLock()  # the tree; file I/O runs outside it
        self.evictions = 0
        self.replaced = 0  # removed because a sibling dominates them
        self.quarantined = 0
        self.write_errors = 0
        self._warned_size = False  # a node over the whole budget: said once
        self._warned_touch = False  # file times that cannot be set (a read-only folder): said once
        self._lowered_by_full = False  # a full filesystem lowered the budget (the advice changes)
        self._scan()
        with self._lock:
            self._trim_other_keys()
            self._make_room(0, set())  # a restart with a smaller budget

    # ---- start-up -------------------------------------------------------------------------
    def _scan(self) -> None:
        found: list[tuple[bytes, Entry[NodeFile]]] = []
        for p in self.dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                self._remove_stale_tmp(p)
            elif p.suffix == SUFFIX and p.is_file():
                try:
                    st = p.stat()
                    with p.open("rb") as f:
                        hdr = diskfile.read_header(f, st.st_size)
                    diskfile.check_identity(hdr, self._key_json, _name_hash(p), self.key.chunk_size)
                    known = diskfile.Known.of(hdr, self._names)  # the tensor list checked too
                except CorruptEntry as e:
                    self._quarantine(p, str(e))
                    continue
                except OSError as e:
                    log.warning("kv_cache disk: cannot read %s (%s); ignored", p, e)
                    continue
                found.append((hdr.hash, Entry(hdr.parent, hdr.tokens, st.st_size,
                                              NodeFile(p, st.st_mtime_ns, known))))
        for h, entry in sorted(found, key=lambda item: item[1].payload.mtime_ns):  # the LRU order of the last run
            self._tree.add(h, entry)
        log.info("kv_cache disk: %d chunks, %d bytes in %s", len(self._tree), self.used_bytes, self.dir)

    def _remove_stale_tmp(self, p: Path) -> None:
        """A temp file of a writer that is gone (killed mid-write): never an entry, delete it."""
        try:
            pid = int(p.name[len(TMP_PREFIX):].split(".", 1)[0])
        except ValueError:
            pid = -1
        try:
            age_s = time.time() - p.stat().st_mtime
        except OSError:
            return
        if pid > 0 and pid != os.getpid() and _alive(pid) and age_s < STALE_TMP_S:
            return  # a live writer's (a write takes seconds); an old one's pid was reused
        try:
            p.unlink()
            log.info("kv_cache disk: removed unfinished write %s", p.name)
        except OSError:
            pass

    def _quarantine(self, p: Path, why: str) -> None:
        self.quarantined += 1
        log.warning("kv_cache disk: %s is unusable (%s); moved to %s/, treated as a miss", p, why, QUARANTINE)
        qdir = self.dir / QUARANTINE
        try:
            qdir.mkdir(exist_ok=True)
            moved = qdir / f"{p.name}.{uuid.uuid4().hex[:8]}"
            os.replace(p, moved)
            os.utime(moved)  # quarantined now: the newest, whatever its last use was
            old = sorted(qdir.iterdir(), key=lambda q: q.stat().st_mtime_ns)  # keep the newest few
            for q in old[:-_KEEP_QUARANTINED]:
                q.unlink(missing_ok=True)
        except OSError:
            p.unlink(missing_ok=True)

    def _trim_other_keys(self) -> None:
        """Remove other keys' folders (their files, then the folder), least recently used first,
        while DIR's total is over the budget; skip any touched within STALE_FOLDER_S, and the
        folders of this server's other ranks (a key equal to ours but for its rank: they hold
        their own budgets and count apart)."""
        others = []
        for d in self.dir.parent.iterdir():
            try:  # a folder another user's, or one another tier removes meanwhile: left alone
                if d != self.dir and _is_key_folder(d, len(self.dir.name)) and not self._sibling_rank(d):
                    size, newest = _folder_usage(d)
                    others.append((newest, size, d))
            except OSError:
                continue
        total = self.used_bytes + sum(size for _, size, _ in others)
        stale_before = time.time_ns() - STALE_FOLDER_S * 1_000_000_000
        for newest, size, d in sorted(others):
            if total <= self.budget_bytes:
                break
            if newest > stale_before or not _remove_key_folder(d):
                continue
            total -= size
            log.info("kv_cache disk: removed %s (%d bytes, another key's, unused for %.0f h) to keep %s within "
                     "TF_GLM53_DISK_CACHE_BYTES=%d", d.name, size, (time.time_ns() - newest) / 3.6e12,
                     self.dir.parent, self.budget_bytes)

    def _sibling_rank(self, d: Path) -> bool:
        """Whether folder d holds another rank's files of our key (read from one file's header)."""
        ours = {k: v for k, v in self._key_json.items() if k != "rank"}
        for p in d.glob("*" + SUFFIX):
            try:
                with p.open("rb") as f:
                    theirs = diskfile.read_header(f, p.stat().st_size).key
            except (OSError, CorruptEntry):
                continue
            return isinstance(theirs, dict) and {k: v for k, v in theirs.items() if k != "rank"} == ours
        return False

    def close(self) -> None:
        """Release the folder's live lock (the tier's files stay; a closed tier is not used again)."""
        if self._live is not None:
            self._live.close()
            self._live = None

    # ---- index ----------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._tree.used_bytes

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._tree

    def __len__(self) -> int:
        with self._lock:
            return len(self._tree)

    def children(self, parent: bytes) -> list[tuple[bytes, Tokens]]:
        """(hash, tokens) of the nodes under `parent`, from memory."""
        with self._lock:
            return [(c, e.tokens) for c, e in self._tree.children(parent)]

    def entry(self, h: bytes) -> Entry[NodeFile] | None:
        with self._lock:
            return self._tree.get(h)

    def largest_file(self) -> int:
        """The size of the largest file in the index (0 when empty): what a read buffer must hold
        (a full block's node; tails are smaller)."""
        with self._lock:
            return max((e.size for _, e in self._tree.items()), default=0)

    def dominated(self, parent: bytes, tokens: Tokens) -> bool:
        with self._lock:
            return self._tree.dominated(parent, tokens)

    def _drop(self, h: bytes) -> None:
        """Forget one node whose file is gone or bad (its subtree stays reachable only through it:
        a lookup stops there, and eviction or replacement removes the rest)."""
        self._tree.discard(h)

    # ---- reads ----------------------------------------------------------------------------
    def load(self, h: bytes) -> Rows | None:
        """The node's rows, fully verified, as views of a buffer of their own, or None (a miss)."""
        got = self.read(h)
        return None if got is None else diskfile.views(got[2], got[1])

    def read(self, h: bytes, buf: torch.Tensor | None = None) -> tuple[int, torch.Tensor, tuple[diskfile.Run, ...]] | None:
        """Read node h's file with one readinto into `buf` (uint8, at least the file's size; None:
        a new buffer of its size) and verify it there: (file size, buffer, the tensors' layout), or
        None (a miss: the file is gone, or it failed verification and was quarantined). A header
        verified before (the index scan at start-up, or an earlier read) is not parsed again: its
        preamble, which carries the header's digest, must be byte for byte the one verified, and the
        payload is checked against that header's checksum. Safe on any thread."""
        e = self.entry(h)
        if e is None:
            return None
        try:
            return self._read(h, e, buf)
        except (FileNotFoundError, CorruptEntry) as err:
            with self._lock:
                if self._tree.get(h) is not e:
                    pass  # rewritten meanwhile: the new file is not the one that failed
                elif isinstance(err, FileNotFoundError):  # evicted meanwhile
                    self._drop(h)
                else:
                    self._drop(h)
                    self._quarantine(e.payload.path, str(err))
        except OSError as err:
            log.warning("kv_cache disk: cannot read %s (%s); a miss", e.payload.path, err)
        return None

    def _read(self, h: bytes, entry: Entry[NodeFile], buf: torch.Tensor | None
              ) -> tuple[int, torch.Tensor, tuple[diskfile.Run, ...]]:
        e = entry.payload
        with open(e.path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size < diskfile.PREAMBLE.size:
                raise CorruptEntry("short file: preamble cut off")
            if buf is None:
                buf = torch.empty(size, dtype=torch.uint8)
            elif buf.numel() < size:
                raise CorruptEntry(f"file is {size} bytes, larger than the index said")
            view = memoryview(buf.numpy())[:size]
            got = 0
            while got < size:  # one call in practice; a loop in case the kernel returns short
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        if got != size:
            raise CorruptEntry("short read: the file shrank while it was read")
        known = e.known
        if known is None or not known.same_header(view, size):
            # not seen yet in this process (written here), or changed since: verified in full
            hdr = diskfile.parse(view, size)
            diskfile.check_identity(hdr, self._key_json, h, self.key.chunk_size)
            known = e.known = diskfile.Known.of(hdr, self._names)
        known.verify(view)
        return size, buf, known.runs

    def touch_chain(self, hashes: Sequence[bytes]) -> None:
        """Mark a chain used, root newest: the index at once, the files' mtimes (what a restart's
        LRU order comes from) outside the lock, which lookups take."""
        with self._lock:
            now = time.time_ns()
            touched = self._tree.touch_chain(hashes)
            for i, (_, entry) in enumerate(touched):
                entry.payload.mtime_ns = now + i
        for h, entry in touched:
            try:
                os.utime(entry.payload.path, ns=(entry.payload.mtime_ns, entry.payload.mtime_ns))
            except FileNotFoundError:  # gone: evicted by another process, or deleted
                with self._lock:
                    if self._tree.get(h) is entry:  # not rewritten meanwhile
                        self._drop(h)
            except OSError as err:  # a read-only folder still serves its files: only their LRU order is lost
                if not self._warned_touch:
                    self._warned_touch = True
                    log.warning("kv_cache disk: cannot mark %s used (%s); its files are still read, "
                                "their last-use order is kept in memory only", self.dir, err.strerror)

    # ---- writes ---------------------------------------------------------------------------
    def put_chain(self, root: bytes, nodes: Sequence[Node]) -> int:
        """Write the chain's nodes that are not on disk, in order (a node's rows None = not
        available: stop). Returns the number written. A tail an existing sibling dominates is
        skipped; a written node replaces the siblings it dominates. A failed write (full disk,
        I/O error) is logged and ends the chain; the cache keeps working without those entries."""
        written = 0
        with self._lock:
            new, protect = self._tree.new_nodes(root, nodes), self._tree.protected(nodes)
        for node in new:
            with self._lock:
                if self._tree.dominated(node.parent, node.tokens):
                    continue  # a tail a sibling already covers (a tail is last in its chain)
                victims = self._tree.replaced_by(node.parent, node.tokens)
            pieces = diskfile.encode(self._key_json, node)
            size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
            if not self._room_for(size, victims, protect):
                break
            outcome = self._write(node, pieces)
            if outcome == _RETRY:  # the filesystem was full: once more, in room made by evicting our oldest
                outcome = self._write(node, pieces) if self._room_for(size, victims, protect) else _FAILED
            if outcome != _WRITTEN:
                break
            with self._lock:  # only once the new file is durable: a crash leaves both, harmless
                for v in victims:
                    self.replaced += self._evict(v)
            written += 1
        self.touch_chain([n.hash for n in nodes])
        return written

    def _room_for(self, size: int, victims: list[bytes], protect: set[bytes]) -> bool:
        """Whether a node of `size` bytes fits the budget, evicting least recently used nodes
        (never `protect` or the siblings it replaces, whose bytes count as freed)."""
        with self._lock:
            if size > self.budget_bytes:
                if not self._warned_size:
                    self._warned_size = True
                    remedy = ("the filesystem filled and lowered it: free space there and restart"
                              if self._lowered_by_full else "raise TF_GLM53_DISK_CACHE_BYTES")
                    log.warning("kv_cache disk: a %d-byte node is larger than the budget (%d bytes) of %s: "
                                "nothing is written; %s", size, self.budget_bytes, self.dir, remedy)
                return False
            freed = sum(self._tree.get(v).size for v in victims if v in self._tree)
            return self._make_room(size - freed, protect | set(victims))

    def _write(self, node: Node, pieces: list) -> str:
        """Write a node's file (temp name, fsync, rename): _WRITTEN (on disk and indexed), _FAILED,
        or _RETRY: the filesystem was full, the budget is now the bytes this tier holds, and
        evicting some of them makes room for another try."""
        final = self.dir / (node.hash.hex() + SUFFIX)
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}.{uuid.uuid4().hex}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)  # removed under us (by hand, say): made again
            with tmp.open("wb") as f:
                for piece in pieces:
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:
            self.write_errors += 1
            with contextlib.suppress(OSError):  # a read-only folder refuses the unlink too
                tmp.unlink(missing_ok=True)
            if e.errno in _FULL:
                return _RETRY if self._on_full() else _FAILED
            why = "the process's file size limit (EFBIG)" if e.errno == errno.EFBIG else e.strerror
            log.warning("kv_cache disk: write of %s in %s failed (%s); entry skipped", final.name, self.dir, why)
            return _FAILED
        try:
            _fsync_dir(self.dir)
        except OSError as e:  # the file is whole under its name; only the rename's durability is unsure
            log.warning("kv_cache disk: fsync of %s failed (%s); %s kept", self.dir, e.strerror, final.name)
        st = final.stat()
        with self._lock:
            self._tree.add(node.hash, Entry(node.parent, node.tokens, st.st_size, NodeFile(final, st.st_mtime_ns)))
        return _WRITTEN

    def _on_full(self) -> bool:
        """The filesystem is full: hold the tier at what it has (its files then turn over, LRU).
        Whether a retry may find room (the budget was lowered just now, over files to evict)."""
        with self._lock:
            if self.used_bytes == 0 or self.used_bytes >= self.budget_bytes:  # nothing of ours to turn over
                log.warning("kv_cache disk: disk full at %s; write skipped (free space there)", self.dir.parent)
                return False
            log.warning("kv_cache disk: disk full at %s; the disk tier's budget is lowered from %d to the %d bytes "
                        "it holds for this run (free space there, then restart to raise it again)",
                        self.dir.parent, self.budget_bytes, self.used_bytes)
            self.budget_bytes, self._lowered_by_full = self.used_bytes, True
            return True

    def _make_room(self, need: int, protect: set[bytes]) -> bool:
        if self.used_bytes + need <= self.budget_bytes:
            return True
        before = self.used_bytes
        nodes = self._tree.make_room(need, self.budget_bytes, protect, free=_unlink)
        if nodes:
            log.info("kv_cache disk evict: %d chunks, %d bytes (budget %d)", nodes, before - self.used_bytes,
                     self.budget_bytes)
            self.evictions += nodes
        return self.used_bytes + need <= self.budget_bytes

    def evict(self, h: bytes) -> int:
        """Delete a node and its descendants (unreachable without it)."""
        with self._lock:
            removed = self._evict(h)
            self.evictions += removed
            return removed

    def _evict(self, h: bytes) -> int:
        removed = self._tree.remove_subtree(h)
        _unlink(removed)
        return len(removed)


def _unlink(removed: list[tuple[bytes, Entry[NodeFile]]]) -> None:
    for _, entry in removed:
        entry.payload.path.unlink(missing_ok=True)


def _name_hash(p: Path) -> bytes:
    try:
        return bytes.fromhex(p.name[:-len(SUFFIX)])
    except ValueError:
        return b""


def _is_key_folder(d: Path, name_len: int) -> bool:
    """A folder named like a key digest (hex of this key's length): a disk tier's, not the user's."""
    return d.is_dir() and len(d.name) == name_len and all(c in "0123456789abcdef" for c in d.name)


def _hold_live_lock(d: Path):  # noqa: ANN202 - an open file or None
    """A shared flock on d's LIVE_LOCK, held while the returned file stays open (None where the
    folder is read-only or flock is not supported: the age rule alone protects it then)."""
    try:
        f = open(d / LIVE_LOCK, "a+b")  # noqa: SIM115 - kept open on purpose
    except OSError:
        return None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # another process holds it exclusively (a trim in progress): it will skip us
        pass
    return f


def _folder_usage(d: Path) -> tuple[int, int]:
    """(bytes, newest mtime in ns) of a key folder's files, its quarantine and the folder itself
    included (a folder just made, still empty, is recent)."""
    size, newest = 0, d.stat().st_mtime_ns
    for p in [*d.iterdir(), *((d / QUARANTINE).iterdir() if (d / QUARANTINE).is_dir() else ())]:
        try:
            st = p.stat()
        except OSError:
            continue
        if p.is_file():
            size += st.st_size
            newest = max(newest, st.st_mtime_ns)
    return size, newest


def _remove_key_folder(d: Path) -> bool:
    """Only what a disk tier writes (entries, temp files, the quarantine, its live lock), then the
    folder if empty; never while a tier holds its live lock. Whether it was removed."""
    try:
        lock = open(d / LIVE_LOCK, "a+b")  # noqa: SIM115
    except OSError:
        return False
    with lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a running tier holds it
            return False
        try:
            for p in [*((d / QUARANTINE).iterdir() if (d / QUARANTINE).is_dir() else ()), *d.iterdir()]:
                if p.is_file() and (p.suffix == SUFFIX or p.name.startswith(TMP_PREFIX) or p.name == LIVE_LOCK
                                    or p.parent.name == QUARANTINE):
                    with contextlib.suppress(OSError):
                        p.unlink()
        except OSError:
            return False
    for folder in (d / QUARANTINE, d):
        with contextlib.suppress(OSError):
            folder.rmdir()
    return True


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
