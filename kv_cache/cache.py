"""The facade the engine uses: lookup, restore, store, stats.

    cache = PrefixCache.from_env(key)
    hit = cache.lookup(prompt, live_tokens=..., live_frontier=...)
    hit.restore(write_rows)            # write_rows(chunk_index, rows) into the engine's cache
    ... prefill grid.resume_plan(hit.reused_tokens, len(prompt)).chunks ...
    cache.store(prompt, frontier, rows_for)   # rows_for(chunk_index) -> this rank's rows

Reuse comes from two places: the live conversation's rows still in the engine's buffers (token
granularity, no copy) and the chain of stored chunks (host, then disk). Under DCP every rank
looks up its own rows and `agree` (a min-reduction over ranks that the caller supplies) makes
the hit the length every rank holds.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .disk import BackgroundWriter, DiskTier
from .grid import Grid
from .keys import CacheKey, chain_hashes, common_prefix, root_hash
from .rows import Rows, rows_to_host
from .store import HostStore

log = logging.getLogger("kv_cache")

DEFAULT_HOST_BYTES = 8 << 30
DEFAULT_DISK_BYTES = 64 << 30


class CacheConfigError(ValueError):
    """A TF_GLM53_* cache variable the kit cannot use; the message names it and the remedy."""


def parse_bytes(name: str, text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise CacheConfigError(f"{name}={text!r}: expected a byte count like 8G, 512M or 1048576")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(m.group(1)) * scale


def env_flag(name: str, default: bool, environ: dict | None = None) -> bool:
    env = os.environ if environ is None else environ
    text = env.get(name)
    if text is None or text == "":
        return default
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise CacheConfigError(f"{name}={text!r}: expected 1 or 0")


@dataclass
class Stats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # tokens reused, summed over lookups
    live_tokens: int = 0  # of which taken from the live rows in place
    host_tokens: int = 0
    disk_tokens: int = 0
    stored_chunks: int = 0
    disk_written_chunks: int = 0


@dataclass
class Hit:
    """What a prompt may reuse. Rows [0, live_tokens) are already in the engine's buffers;
    `chunks` (starting at chunk index `first_chunk`) must be written back with `restore`."""

    reused_tokens: int = 0
    live_tokens: int = 0
    first_chunk: int = 0
    chunks: list[Rows] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def restore(self, write_rows: Callable[[int, Rows], None]) -> None:
        for i, rows in enumerate(self.chunks):
            write_rows(self.first_chunk + i, rows)


class PrefixCache:
    def __init__(self, key: CacheKey, *, enabled: bool = True, host_bytes: int = DEFAULT_HOST_BYTES,
                 disk: DiskTier | None = None, boundary_only: bool = True,
                 agree: Callable[[int], int] | None = None, disk_async: bool = False) -> None:
        self.key = key
        self.grid = Grid(key.chunk_size)
        self.enabled = enabled
        self.host = HostStore(host_bytes)
        self.disk = disk
        self.boundary_only = boundary_only
        self.agree = agree or (lambda n: n)
        self.stats = Stats()
        self._root = root_hash(key)
        # serving writes the disk tier on a background thread (flushed at exit); tests may write inline
        self._writer = BackgroundWriter(disk) if disk is not None and disk_async else None
        if self._writer is not None:
            atexit.register(self._writer.flush)

    @classmethod
    def from_env(cls, key: CacheKey, agree: Callable[[int], int] | None = None,
                 environ: dict | None = None) -> "PrefixCache":
        """TF_GLM53_PREFIX_CACHE (1/0), TF_GLM53_HOST_CACHE_BYTES, TF_GLM53_DISK_CACHE (a
        directory; unset = no disk tier), TF_GLM53_DISK_CACHE_BYTES, and
        TF_GLM53_PREFIX_REUSE_BOUNDARY (1 = reuse only up to a grid boundary, the default)."""
        env = os.environ if environ is None else environ
        enabled = env_flag("TF_GLM53_PREFIX_CACHE", True, env)
        host_bytes = parse_bytes("TF_GLM53_HOST_CACHE_BYTES", env.get("TF_GLM53_HOST_CACHE_BYTES") or str(DEFAULT_HOST_BYTES))
        disk = None
        disk_dir = env.get("TF_GLM53_DISK_CACHE")
        if enabled and disk_dir:
            disk_bytes = parse_bytes("TF_GLM53_DISK_CACHE_BYTES", env.get("TF_GLM53_DISK_CACHE_BYTES") or str(DEFAULT_DISK_BYTES))
            disk = DiskTier(disk_dir, key, disk_bytes)
        boundary = env_flag("TF_GLM53_PREFIX_REUSE_BOUNDARY", True, env)
        return cls(key, enabled=enabled, host_bytes=host_bytes, disk=disk, boundary_only=boundary, agree=agree,
                   disk_async=True)

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], live_tokens: Sequence[int] = (), live_frontier: int = 0) -> Hit:
        """The longest reusable prefix of `token_ids`: the live rows (whose canonical prefill
        reached `live_frontier`) and stored chunks, agreed across ranks."""
        if not self.enabled:
            return Hit()
        self.stats.lookups += 1
        n = len(token_ids)
        live = self.grid.reuse_length(common_prefix(token_ids, live_tokens), live_frontier, n,
                                      self.boundary_only) if live_tokens else 0
        # stored chunks: whole chunks only, and at least one token left to prefill. A chunk's
        # hash commits to the whole prefix, so chunks below the live extent need not be stored.
        max_chunks = self.grid.full_chunks(max(n - 1, 0))
        hashes = chain_hashes(self.key, token_ids, max_chunks)
        first = self.grid.full_chunks(live)
        chunks: list[Rows] = []
        sources: list[str] = []
        for h in hashes[first:]:
            rows = self.host.get(h)
            src = "host"
            if rows is None and self.disk is not None:
                rows = self.disk.load(h)
                src = "disk"
            if rows is None:
                break
            chunks.append(rows)
            sources.append(src)
        stored = (first + len(chunks)) * self.grid.chunk_size if chunks else 0

        def achievable(x: int) -> int:
            """The largest reuse <= x this rank can serve: any length within the live rows, or
            a chunk boundary within the stored chunks."""
            if x <= live:
                return x
            return max(live, min(self.grid.floor(x), stored))

        # Two rounds make the result servable on every rank (ranks share the live tokens).
        agreed = self.agree(achievable(self.agree(max(live, stored))))
        if achievable(agreed) != agreed:
            raise RuntimeError(f"kv_cache: ranks disagree on reusable rows (agreed {agreed}, this rank "
                               f"can serve {achievable(agreed)}); agree() must be a min over all ranks")
        if agreed <= live:
            hit = Hit(agreed, agreed)
        else:
            keep = self.grid.full_chunks(agreed) - first
            hit = Hit(agreed, live, first, chunks[:keep], sources[:keep])
        self._promote(hashes[:self.grid.full_chunks(hit.reused_tokens)], first, hit)
        self._count(hit, n)
        return hit

    def _promote(self, hashes: list[bytes], first: int, hit: Hit) -> None:
        """Disk hits move into the host tier; the used chain becomes most recent in both."""
        rows: list[Rows | None] = [None] * len(hashes)
        for i, (rws, src) in enumerate(zip(hit.chunks, hit.sources)):
            if src == "disk":
                rows[first + i] = rws
        if any(r is not None for r in rows):
            self.host.put_chain(self._root, hashes, rows)
        else:
            self.host.touch_chain(hashes)
        if self.disk is not None:
            self.disk.touch_chain(hashes)

    def _count(self, hit: Hit, n: int) -> None:
        s = self.stats
        if hit.reused_tokens:
            s.hits += 1
            s.cached_tokens += hit.reused_tokens
            s.live_tokens += min(hit.live_tokens, hit.reused_tokens)
            C = self.grid.chunk_size
            s.host_tokens += C * sum(1 for x in hit.sources if x == "host")
            s.disk_tokens += C * sum(1 for x in hit.sources if x == "disk")
            log.info("kv_cache hit: %d of %d prompt tokens reused (live %d, host %d, disk %d chunks)",
                     hit.reused_tokens, n, hit.live_tokens, hit.sources.count("host"), hit.sources.count("disk"))
        else:
            s.misses += 1
            log.info("kv_cache miss: %d prompt tokens", n)

    # ---- store ----------------------------------------------------------------------------
    def store(self, token_ids: Sequence[int], frontier: int, rows_for: Callable[[int], Rows]) -> int:
        """Keep the whole chunks of [0, frontier) that are not stored yet. `frontier` is how far
        canonical prefill wrote this sequence's rows (never rows written by decode or draft
        verification). `rows_for(k)` returns this rank's rows of chunk k (copied here).
        Returns the number of chunks newly kept in the host tier."""
        if not self.enabled:
            return 0
        frontier = min(frontier, len(token_ids))
        hashes = chain_hashes(self.key, token_ids, self.grid.full_chunks(frontier))
        if not hashes:
            return 0
        on_disk = self.disk is not None
        rows: list[Rows | None] = []
        for k, h in enumerate(hashes):
            need = h not in self.host or (on_disk and h not in self.disk)
            if not need:
                rows.append(None)
                continue
            r = self.host.get(h)
            rows.append(r if r is not None else rows_to_host(rows_for(k)))
        inserted = self.host.put_chain(self._root, hashes, rows)
        if on_disk and self._writer is not None:
            self._writer.submit(self._root, hashes, rows)
        elif on_disk:
            self.stats.disk_written_chunks += self.disk.put_chain(self._root, hashes, rows)
        self.stats.stored_chunks += inserted
        if inserted:
            log.debug("kv_cache store: %d new chunks (frontier %d)", inserted, frontier)
        return inserted

    def flush(self) -> None:
        """Wait for pending disk writes (a no-op without a background writer)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            atexit.unregister(self._writer.flush)
            self._writer = None

    @property
    def evictions(self) -> int:
        return self.host.evictions + (self.disk.evictions if self.disk is not None else 0)

    def stats_dict(self) -> dict:
        d = dict(self.stats.__dict__)
        if self._writer is not None:
            d["disk_written_chunks"] = self._writer.written
        d.update(host_bytes=self.host.used_bytes, host_chunks=len(self.host),
                 host_evictions=self.host.evictions,
                 disk_bytes=self.disk.used_bytes if self.disk else 0,
                 disk_chunks=len(self.disk.index) if self.disk else 0,
                 disk_evictions=self.disk.evictions if self.disk else 0,
                 disk_quarantined=self.disk.quarantined if self.disk else 0,
                 evictions=self.evictions)
        return d
