"""The facade the engine uses: lookup, restore, store, stats.

    cache = PrefixCache.from_settings(key, settings, agree=..., boundary=engine.reuse_boundary)
    hit = cache.lookup(prompt, live_tokens=state.tokens, live_frontier=state.frontier)
    state.truncate(hit.live_tokens)
    hit.restore(lambda start, n, rows: state.import_rows(start, rows, prompt[start:start + n]))
    ... prefill [hit.reused_tokens, len(prompt)) ...
    cache.store(prompt, state.frontier, lambda a, b: state.export_rows(a, b))

Reuse is token-granular and comes from two places: the live conversation's rows still in the
engine's buffers (no copy) and stored nodes (host tier, then disk): the chain of full blocks
of B = key.chunk_size tokens, then, where the chain ends, the stored sibling (a block that
differs inside, or a tail) sharing the longest prefix with the prompt. Under DCP every rank
looks up its own rows and `agree` (a min over ranks that the caller supplies) makes the hit the
length every rank can serve.
"""
from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .disk import DiskTier
from .hit import Hit, Piece
from .keys import CacheKey, Tokens, block_hash, chain_hashes, common_prefix, root_hash, token_array
from .node import Node
from .restore import Restorer, node_bytes
from .rows import Rows, rows_to_host
from .staging import Staging, default_capacity
from .store import HostStore
from .writer import BackgroundWriter

if TYPE_CHECKING:
    from glm53.settings import Settings

log = logging.getLogger("kv_cache")

DEFAULT_HOST_BYTES = 8 << 30  # as Settings.host_cache_bytes's


class CacheConfigError(ValueError):
    """Cache settings the kit cannot use (the ranks' differ); the message names them and the remedy."""


@dataclass
class Stats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # tokens reused, summed over lookups
    live_tokens: int = 0  # of which kept from the live rows in place
    host_tokens: int = 0  # of which restored from the host tier
    disk_tokens: int = 0  # of which restored from the disk tier
    stored_chunks: int = 0  # nodes newly kept in the host tier
    disk_written_chunks: int = 0


@dataclass
class _Step:
    """One node of a lookup's path: it serves positions [start, start + usable) of the prompt."""

    start: int
    usable: int
    node: Node  # a host node, or (source "disk") a fresh Node whose rows are loaded later
    source: str


def _end(path: list[_Step]) -> int:
    return path[-1].start + path[-1].usable


def _locked(method):
    """One caller at a time: the engine's thread looks up and stores while a server's metrics
    thread reads stats, and reading stats lands a background store (it changes the tiers)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


def _settle_at_exit(ref: "weakref.ref[PrefixCache]") -> None:
    cache = ref()
    if cache is not None:
        cache.flush()


@dataclass
class _Pending:
    """A store whose rows are still on their way to host memory (staging.py)."""

    held: list[bytes]  # the hashes of the blocks before the nodes (every tier holds them)
    nodes: list[Node]
    tokens: np.ndarray  # the prefix [0, stop) the nodes cover
    done: Future


class PrefixCache:
    def __init__(self, key: CacheKey, *, enabled: bool = True, host_bytes: int = DEFAULT_HOST_BYTES,
                 disk: DiskTier | None = None, boundary: int | None = None,
                 agree: Callable[[int], int] | None = None, disk_async: bool = False,
                 staging_bytes: int = 0, staging_pinned: bool = False, ring_bytes: int = 0) -> None:
        if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 1):
            raise ValueError(f"reuse boundary must be a positive int or None, got {boundary!r}")
        self._lock = threading.RLock()
        self.key = key
        self.block = key.chunk_size
        self.boundary = boundary  # None: reuse may end at any token (row-invariant kernels)
        self.enabled = enabled
        self.host = HostStore(host_bytes)
        self.disk = disk
        self.agree = agree or (lambda n: n)
        self.stats = Stats()
        self._root = root_hash(key)
        self._last_chain: tuple[np.ndarray, list[bytes]] | None = None  # the last lookup's tokens, hashes
        self._memo_buf = np.empty(0, dtype=np.int64)
        # stores copy device rows in the background (staging.py); 0: synchronously, inside store()
        self._staging = Staging(staging_bytes, pinned=staging_pinned) if staging_bytes > 0 else None
        self._pending: _Pending | None = None
        # serving writes the disk tier on a background thread (flushed at exit); tests may write inline
        self._writer = BackgroundWriter(disk) if disk is not None and disk_async else None
        # disk nodes are read when the engine restores them (restore.py); disk and host nodes go to
        # a GPU through a ring of pinned buffers, one transfer a node
        self._restorer = Restorer(disk, pinned=staging_pinned, ring_bytes=ring_bytes)
        # a stopping server lands its last store, then finishes its disk writes (atexit runs these
        # in reverse order). The cache itself is held weakly: one dropped without close() (a test,
        # a re-attached engine) is freed with its pinned buffer instead of living until exit
        if self._writer is not None:
            atexit.register(self._writer.flush)
        self._at_exit = functools.partial(_settle_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    @classmethod
    def from_settings(cls, key: CacheKey, settings: "Settings", agree: Callable[[int], int] | None = None, *,
                      boundary: int | None = None, on_gpu: bool = False, position_bytes: int = 0) -> "PrefixCache":
        """The cache glm53.settings describes: prefix_cache (on/off), host_cache_bytes, disk_cache (a
        folder; None: no disk tier), disk_cache_bytes, disk_cache_threads (None: disk.default_threads),
        store_staging_bytes (the background store's buffer; None: where the rows live on a GPU
        (`on_gpu`) staging.default_capacity of the engine's `position_bytes`, else 0: stores copy
        inside the call). `boundary` is the engine's decision."""
        enabled = settings.prefix_cache
        host_bytes = settings.host_cache_bytes
        staging = settings.store_staging_bytes
        if staging is None:
            staging = default_capacity(position_bytes) if on_gpu else 0
        disk = None
        if enabled and settings.disk_cache:
            disk = DiskTier(settings.disk_cache, key, settings.disk_cache_bytes, threads=settings.disk_cache_threads)
        # the restore ring, pinned at start-up where a restore can happen (rows on a GPU, a host or disk tier)
        restores = enabled and on_gpu and position_bytes > 0 and (host_bytes > 0 or disk is not None)
        ring = node_bytes(key.chunk_size, position_bytes, key.ranks, key.dcp) if restores else 0
        return cls(key, enabled=enabled, host_bytes=host_bytes, disk=disk, boundary=boundary, agree=agree,
                   disk_async=True, staging_bytes=staging if enabled else 0, staging_pinned=on_gpu, ring_bytes=ring)

    def _floor(self, n: int) -> int:
        return n if self.boundary is None else n // self.boundary * self.boundary

    # ---- lookup ---------------------------------------------------------------------------
    @_locked
    def lookup(self, token_ids: Sequence[int], live_tokens: Sequence[int] = (), live_frontier: int = 0) -> Hit:
        """The longest reusable prefix of `token_ids`: the live rows (whose canonical prefill
        reached `live_frontier`) or stored nodes, agreed across ranks. At least one token is
        always left to prefill (the last position's logits must be computed)."""
        if not self.enabled:
            return Hit()
        self.stats.lookups += 1
        toks = token_array(token_ids)
        n = len(toks)
        live = max(0, min(common_prefix(toks, live_tokens), live_frontier, n - 1)) if len(live_tokens) else 0
        live = self._floor(live)
        # a store still copying is waited for only when its nodes could serve more than the live
        # rows do (another conversation's prompt); the live conversation's next turn never waits
        pending = self._pending
        self._settle(wait=pending is not None
                     and self._floor(min(common_prefix(toks, pending.tokens), n - 1)) > live)
        hashes = self._chain(toks)
        self._remember(toks, hashes)  # the engine stores the same prompt after the reply
        # blocks below the live extent need not be stored: a block's hash commits to its prefix
        path = self._walk(toks, hashes, live // self.block)
        if not path or self._floor(min(_end(path), n - 1)) <= live:
            path = []  # live serves at least as much: read nothing
        stored = min(_end(path), n - 1) if path else 0
        # any length up to max(live, stored) is servable here, so one round of agreement is enough
        reuse = self._floor(max(live, stored))
        agreed = self.agree(reuse)
        if not 0 <= agreed <= reuse or self._floor(agreed) != agreed:
            raise RuntimeError(f"kv_cache: ranks disagree on reusable rows (agreed {agreed}, this rank "
                               f"can serve {reuse}); agree() must be a min over all ranks")
        used = [s for s in path if s.start < agreed] if agreed > live else []
        pieces = [Piece(s.start, min(s.start + s.usable, agreed) - s.start, s.node.rows, s.source, s.node.hash)
                  for s in used]
        hit = Hit(agreed, used[0].start if used else agreed, pieces)
        if pieces:
            hit.reader = self._restorer.restore
        if self.disk is not None:  # disk pieces are read by restore, which may end early
            hit.settle = self._restored
        self._touch(hashes[:used[0].start // self.block] + [s.node.hash for s in used] if used
                    else hashes[:agreed // self.block])
        self._count(hit, n)
        return hit

    def _restored(self, hit: Hit, end: int) -> int:
        """After a restore: the length every rank restored (a rank whose disk file failed
        verification restored less), with the stats corrected. Called on every rank whenever the
        agreed hit is not empty (a disk tier is configured on all ranks or none), so the extra
        agreement is collective."""
        if not hit.reused_tokens:
            return 0
        agreed = self.agree(end)
        if not 0 <= agreed <= end:
            raise RuntimeError(f"kv_cache: ranks disagree on restored rows (agreed {agreed}, this rank restored "
                               f"{end}); agree() must be a min over all ranks")
        short = hit.reused_tokens - agreed
        if short:
            def lost(source: str) -> int:  # the source's tokens past what was kept
                return sum(max(0, p.start + p.length - max(p.start, agreed)) for p in hit.pieces if p.source == source)
            with self._lock:
                s = self.stats
                s.cached_tokens -= short
                s.disk_tokens -= lost("disk")
                s.host_tokens -= lost("host")
                s.live_tokens -= max(0, hit.live_tokens - agreed)
            log.info("kv_cache restore: %d of %d reused tokens restored (a disk file was a miss here or "
                     "on another rank); the rest is prefilled", agreed, hit.reused_tokens)
        return agreed

    def _remember(self, toks: Tokens, hashes: list[bytes]) -> None:
        """Keep a copy of the prompt and its hashes, in a buffer reused across lookups (a fresh
        8 MB copy of a 1M-token prompt would cost its page faults on every request)."""
        buf = self._memo_buf
        if buf.shape[0] < len(toks):
            buf = self._memo_buf = np.empty(max(len(toks), 2 * buf.shape[0]), dtype=np.int64)
        buf[:len(toks)] = toks
        self._last_chain = (buf[:len(toks)], hashes)

    def _chain(self, toks: Tokens) -> list[bytes]:
        """The full blocks' chain hashes of `toks`, hashing only the blocks past its common prefix
        with the last lookup's prompt (a conversation's next turn hashes its new blocks only)."""
        memo = self._last_chain
        if memo is None:
            return chain_hashes(self.key, toks)
        same = common_prefix(toks, memo[0]) // self.block
        return chain_hashes(self.key, toks, known=memo[1][:same])

    def _walk(self, toks: Tokens, hashes: list[bytes], k0: int) -> list[_Step]:
        """Full blocks from block k0 while present, then the best stored child where they end."""
        b = self.block
        path: list[_Step] = []
        k = k0
        while k < len(hashes):
            node, source = self._find(hashes[k])
            if node is None:
                break
            path.append(_Step(k * b, b, node, source))
            k += 1
        best = self._best_child(hashes[k - 1] if k else self._root, toks[k * b:(k + 1) * b])
        if best is not None:
            path.append(_Step(k * b, *best))
        return path

    def _find(self, h: bytes) -> tuple[Node | None, str]:
        node = self.host.get(h)
        if node is not None:
            return node, "host"
        e = self.disk.entry(h) if self.disk is not None else None
        return (Node(h, e.parent, e.tokens), "disk") if e is not None else (None, "")

    def _best_child(self, parent: bytes, want: Tokens) -> tuple[int, Node, str] | None:
        """(LCP, node, source) of the child of `parent` sharing the longest prefix with `want`
        (host preferred on a tie), or None when none shares a token."""
        if not len(want):
            return None
        cands = [(n, "host") for n in self.host.children(parent)]
        if self.disk is not None:
            cands += [(Node(h, parent, t), "disk") for h, t in self.disk.children(parent) if h not in self.host]
        best: tuple[int, Node, str] | None = None
        for node, source in cands:
            lcp = common_prefix(node.tokens, want)
            if lcp and (best is None or (lcp, source == "host") > (best[0], best[2] == "host")):
                best = (lcp, node, source)
        return best

    def _count(self, hit: Hit, n: int) -> None:
        if hit.reused_tokens:
            host, disk = self._add_hit(hit, +1)
            hit.abandon = self._abandoned
            log.info("kv_cache hit: %d of %d prompt tokens reused (live %d, host %d, disk %d tokens)",
                     hit.reused_tokens, n, hit.live_tokens, host, disk)
        else:
            self.stats.misses += 1
            log.info("kv_cache miss: %d prompt tokens", n)

    def _add_hit(self, hit: Hit, sign: int) -> tuple[int, int]:
        """Count a hit into the stats (sign +1) or take it out again (-1); (host, disk) tokens."""
        s = self.stats
        host = sum(p.length for p in hit.pieces if p.source == "host")
        disk = sum(p.length for p in hit.pieces if p.source == "disk")
        s.hits += sign
        s.cached_tokens += sign * hit.reused_tokens
        s.live_tokens += sign * hit.live_tokens
        s.host_tokens += sign * host
        s.disk_tokens += sign * disk
        return host, disk

    def _abandoned(self, hit: Hit) -> None:
        """A hit whose restore raised (the request fails; nothing was reused): out of the stats. The
        lookup still counts; its hit does not."""
        with self._lock:
            self._add_hit(hit, -1)
        log.warning("kv_cache: restoring a hit of %d tokens failed; not counted as a hit", hit.reused_tokens)

    # ---- store ----------------------------------------------------------------------------
    @_locked
    def store(self, token_ids: Sequence[int], frontier: int, rows_for: Callable[[int, int], Rows]) -> int:
        """Keep the absent whole blocks of [0, frontier) and its tail [floor(frontier / B) * B,
        frontier). `frontier` is how far canonical prefill wrote this sequence's rows (never rows
        written by decode or draft verification); with a reuse boundary it is floored to it, so
        nothing past a boundary is stored. `rows_for(start, stop)` returns this rank's rows of
        positions [start, stop), read before the engine writes again: copied here, or with
        staging queued on the device's stream and finished in the background (the tiers take the
        nodes at the next call that needs them). Returns the number of nodes newly kept in the
        host tier by this call (0 for a store still copying: stats count it when it lands)."""
        if not self.enabled:
            return 0
        self._settle(wait=True)
        toks = token_array(token_ids)
        stop = self._floor(max(0, min(frontier, len(toks))))
        held, nodes, todo = self._nodes_of(toks, stop)
        if not nodes:
            self._touch(held)
            return 0
        try:
            done = self._staging.copy(todo, rows_for) if todo and self._staging is not None else None
            if done is not None:
                self._pending = _Pending(held, nodes, toks[:stop].copy(), done)
                return 0
            for node, a, b in todo:
                node.rows = rows_to_host(rows_for(a, b))
            return self._keep(held, nodes, frontier)
        except Exception:  # the reply is decoded: a failed copy (host memory, say) drops this store only
            log.exception("kv_cache store of %d nodes failed; not kept (the reply stands)", len(nodes))
            return 0

    def _keep(self, held: list[bytes], nodes: list[Node], frontier: int) -> int:
        """Hand a store's nodes (rows at hand) to the tiers; `held`: the hashes of the blocks
        before them, which every tier holds already (touched after the nodes: root newest)."""
        inserted = self.host.put_chain(self._root, nodes)
        self.host.touch_chain(held)
        if self._writer is not None:
            self._writer.submit(self._root, nodes, held)
        elif self.disk is not None:
            self.stats.disk_written_chunks += self.disk.put_chain(self._root, nodes)
            self.disk.touch_chain(held)
        self.stats.stored_chunks += inserted
        if inserted:
            log.debug("kv_cache store: %d new nodes (frontier %d)", inserted, frontier)
        return inserted

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain used in both tiers (the disk's touches, file times, on the writer's thread
        when there is one: they are syscalls per node)."""
        self.host.touch_chain(chain)
        if self._writer is not None:
            self._writer.touch(chain)
        elif self.disk is not None:
            self.disk.touch_chain(chain)

    def _settle(self, wait: bool) -> None:
        """Hand a finished background store to the tiers (waiting for it when `wait`). A store
        that failed is logged and dropped: a cache write must never fail a request."""
        p = self._pending
        if p is None or (not wait and not p.done.done()):
            return
        self._pending = None
        try:
            p.done.result()
        except Exception:
            log.exception("kv_cache store: copying rows to host memory failed; %d nodes not kept", len(p.nodes))
            return
        self._keep(p.held, p.nodes, len(p.tokens))

    def _nodes_of(self, toks: Tokens, stop: int) -> tuple[list[bytes], list[Node], list[tuple[Node, int, int]]]:
        """The chain of [0, stop) in two parts: the hashes of its leading full blocks already
        held (on disk where there is a disk tier, else in host: no node made, so a long
        conversation's store costs its new blocks), then nodes
        from the first block a tier lacks: full blocks, then the tail. And the (node, start, stop)
        whose rows must be exported (nodes a tier lacks and that no stored sibling dominates); the
        other nodes carry None or the host's rows."""
        hashes = self._chain(toks[:stop])
        disk = self.disk
        k0 = 0  # held: on disk where there is a disk tier (the host tier takes only new nodes), else in host
        while k0 < len(hashes) and (hashes[k0] in disk if disk is not None else hashes[k0] in self.host):
            k0 += 1
        nodes: list[Node] = []
        todo: list[tuple[Node, int, int]] = []
        parent = hashes[k0 - 1] if k0 else self._root
        for a in range(k0 * self.block, stop, self.block):
            b = min(a + self.block, stop)
            t = np.array(toks[a:b])  # its own copy: the node outlives the prompt
            tail = b - a < self.block
            h = block_hash(parent, t) if tail else hashes[a // self.block]
            on_disk = disk is not None and (h in disk or (tail and disk.dominated(parent, t)))
            # rows a tier already holds are not copied again: a node on disk stays there (a resumed
            # chain is not copied back into host memory after its prefill)
            want_host = not on_disk and h not in self.host and not (tail and self.host.dominated(parent, t))
            want_disk = disk is not None and not on_disk
            node = Node(h, parent, t)
            if want_host or want_disk:
                held = self.host.get(h)
                if held is not None:
                    node.rows = held.rows
                else:
                    todo.append((node, a, b))
            nodes.append(node)
            parent = h
        return hashes[:k0], nodes, todo

    @_locked
    def flush(self) -> None:
        """Wait for a store still copying and for pending disk writes."""
        self._settle(wait=True)
        if self._writer is not None:
            self._writer.flush()

    @_locked
    def close(self) -> None:
        self._settle(wait=True)
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._writer is not None:
            self._writer.close()
            atexit.unregister(self._writer.flush)
            self._writer = None
        atexit.unregister(self._at_exit)
        self._restorer.close()
        if self.disk is not None:
            self.disk.close()

    @property
    @_locked
    def evictions(self) -> int:
        self._settle(wait=True)
        return self._evictions()

    def _evictions(self) -> int:
        return self.host.evictions + (self.disk.evictions if self.disk is not None else 0)

    @_locked
    def restore_times(self) -> dict[str, float]:
        """Seconds since the last call: the restore's copying thread blocked on the readers
        (`waited`) and working (`copying`), the readers blocked on their ring buffer (`ring_waited`)
        and working (`reading`, summed over readers). Which is larger says what bounds a resume;
        the benches print it (restore.Restorer.take_times)."""
        return self._restorer.take_times()

    @_locked
    def stats_dict(self, settle: bool = True) -> dict:
        """Counters and sizes. settle: first wait for a background store still copying (so it is
        counted); settle=False counts one only if it has finished, never waiting (a server reads
        stats around every request: waiting there would hold each reply, and the next lookup,
        until the store after it landed)."""
        self._settle(wait=settle)
        d = dict(self.stats.__dict__)
        if self._writer is not None:
            d["disk_written_chunks"] = self._writer.written
        disk = self.disk
        d.update(host_bytes=self.host.used_bytes, host_chunks=len(self.host),
                 host_evictions=self.host.evictions,
                 disk_bytes=disk.used_bytes if disk is not None else 0,
                 disk_chunks=len(disk) if disk is not None else 0,
                 disk_evictions=disk.evictions if disk is not None else 0,
                 disk_quarantined=disk.quarantined if disk is not None else 0,
                 evictions=self._evictions())
        return d
