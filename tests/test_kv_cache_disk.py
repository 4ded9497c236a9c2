"""Disk tier: survives a real process restart (tails included); corrupt, truncated, foreign,
old-format and half-written files are misses (never wrong rows); dominated tails are replaced;
LRU by mtime under a byte budget; a full filesystem."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_cache import CacheKey, DiskTier, Node, PrefixCache, block_hash, chain_hashes, diskfile
from kv_cache.disk import QUARANTINE, SUFFIX, TMP_PREFIX
from kv_cache.keys import root_hash

REPO = Path(__file__).resolve().parents[1]
C = 16

# Shared with the child processes: position p's rows are a function of tokens[:p + 1] (what a
# prefill writes), so any span's rows can be recomputed anywhere.
ROWS_SRC = textwrap.dedent("""
    import zlib
    import numpy as np
    import torch

    def rows_for_prompt(tokens, width=8):
        def rows_for(a, b):
            lat, idx, sc = [], [], []
            for p in range(a, b):
                g = torch.Generator().manual_seed(zlib.crc32(np.asarray(tokens[:p + 1], dtype="<i8").tobytes()))
                lat.append(torch.randn(width, generator=g))
                idx.append(torch.randn(4, generator=g))
                sc.append(torch.rand(1, generator=g))
            return {"latent.0": torch.stack(lat).to(torch.bfloat16),
                    "index.0": torch.stack(idx).to(torch.float8_e4m3fn), "scale.0": torch.cat(sc)}
        return rows_for

    def rows_bytes(rows):
        return b"".join(rows[n].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(rows))
""")
exec(ROWS_SRC)  # defines rows_for_prompt, rows_bytes here


def key(**kw) -> CacheKey:
    base = dict(model_revision="rev", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                dcp=False, chunk_size=C, device_kind="cpu", kit_version="t")
    base.update(kw)
    return CacheKey(**base)


PROMPT = [(i * 31337) % 50000 for i in range(5 * C + 3)]  # 5 blocks + a 3-token tail


def tail_hash(k: CacheKey, prompt=PROMPT) -> bytes:
    full = len(prompt) // C
    parent = chain_hashes(k, prompt)[-1] if full else root_hash(k)
    return block_hash(parent, prompt[full * C:])


def restore_all(hit) -> tuple[int, list[tuple[int, int, dict]]]:
    """Restore the hit (disk files are read here): where it ends, and each piece's rows (copied:
    a disk piece's rows are valid during the call only)."""
    got = []
    end = hit.restore(lambda start, n, rows: got.append((start, n, {k: v.clone() for k, v in rows.items()})))
    return end, got


def exact(hit, prompt=PROMPT) -> int:
    """Restore the hit, check every piece's rows (the whole node) are the prompt's, and return
    where the restored rows end."""
    end, got = restore_all(hit)
    rows_for = rows_for_prompt(prompt)
    for start, n, rows in got:
        assert rows_bytes(rows) == rows_bytes(rows_for(start, start + rows["scale.0"].shape[0])), start
    assert end == (got[-1][0] + got[-1][1] if got else hit.live_tokens if hit.pieces else hit.reused_tokens)
    return end


# runs after ROWS_SRC in the child
CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from glm53.settings import Settings
    from kv_cache import CacheKey, PrefixCache
    key = CacheKey.from_json({key!r})
    prompt = json.loads({prompt!r})
    cache = PrefixCache.from_settings(key, Settings.from_env())  # the child's knobs, as a rank's
    if sys.argv[1] == "write":  # no flush: the background writer must finish at exit
        cache.store(prompt, len(prompt), rows_for_prompt(prompt))
        print(json.dumps(cache.stats_dict()))
    elif sys.argv[1] == "write-and-exit":  # not even stats: a background store still pending at exit
        cache.store(prompt, len(prompt), rows_for_prompt(prompt))
        print(json.dumps({{"pending": cache._pending is not None}}))
    else:
        hit = cache.lookup(prompt + [7])
        got = []
        hit.restore(lambda start, n, rows: got.append([start, n, rows_bytes(rows).hex()]))
        print(json.dumps({{"reused": hit.reused_tokens, "sources": hit.sources, "pieces": got,
                          "stats": cache.stats_dict()}}))
""")


def run_child(mode: str, disk: Path, k: CacheKey, prompt=PROMPT, budget="1G", **extra_env: str) -> dict:
    env = dict(os.environ, TF_GLM53_DISK_CACHE=str(disk), TF_GLM53_DISK_CACHE_BYTES=budget, **extra_env)
    code = ROWS_SRC + CHILD.format(repo=str(REPO), key=k.to_json(), prompt=json.dumps(prompt))
    out = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def entry_files(disk: Path, k: CacheKey) -> list[Path]:
    return sorted((disk / k.digest().hex()).glob("*" + SUFFIX))


@pytest.mark.slow
def test_disk_tier_survives_a_real_process_restart(tmp_path):
    k = key()
    wrote = run_child("write", tmp_path, k)
    assert wrote["stored_chunks"] == 6  # 5 blocks and the tail
    got = run_child("read", tmp_path, k)  # a fresh process: index rebuilt from the files
    assert got["reused"] == 5 * C + 3 and got["sources"] == ["disk"] * 6
    rows_for = rows_for_prompt(PROMPT)
    assert [(s, n) for s, n, _ in got["pieces"]] == [(i * C, C) for i in range(5)] + [(5 * C, 3)]
    assert [h for _, _, h in got["pieces"]] == [rows_bytes(rows_for(s, s + n)).hex() for s, n, _ in got["pieces"]]
    assert got["stats"]["disk_tokens"] == 5 * C + 3
    # another key (here: another model revision) never matches the same files
    other = run_child("read", tmp_path, key(model_revision="rev2"))
    assert other["reused"] == 0 and other["stats"]["disk_quarantined"] == 0
    assert len(entry_files(tmp_path, k)) == 6  # and it did not touch them


@pytest.mark.slow
def test_a_background_store_pending_at_exit_still_reaches_the_disk(tmp_path):
    k = key()
    wrote = run_child("write-and-exit", tmp_path, k, TF_GLM53_STORE_STAGING_BYTES="1M")
    assert wrote["pending"], "the store landed before exit: this test would prove nothing"
    got = run_child("read", tmp_path, k)
    assert got["reused"] == 5 * C + 3 and got["sources"] == ["disk"] * 6
    rows_for = rows_for_prompt(PROMPT)
    assert [h for _, _, h in got["pieces"]] == [rows_bytes(rows_for(s, s + n)).hex() for s, n, _ in got["pieces"]]


def _store(tier_dir: Path, k: CacheKey, prompt=PROMPT, budget=1 << 30) -> PrefixCache:
    cache = PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(tier_dir, k, budget))
    cache.store(prompt, len(prompt), rows_for_prompt(prompt))
    return cache


def _fresh(tier_dir: Path, k: CacheKey, budget=1 << 30) -> PrefixCache:
    return PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(tier_dir, k, budget))


def test_restart_with_tails_partial_matches_and_no_copy_back(tmp_path):
    k = key()
    _store(tmp_path, k)
    cache = _fresh(tmp_path, k)  # a new DiskTier over the same folder
    assert len(cache.disk) == 6 and len(cache.host) == 0
    e = cache.disk.entry(tail_hash(k))
    assert e.tokens.tolist() == PROMPT[5 * C:] and e.parent == chain_hashes(k, PROMPT)[-1]
    for p, want in ((PROMPT + [1], 83), (PROMPT[:82] + [1, 2], 82), (PROMPT[:37] + [0] * 9, 37)):
        hit = _fresh(tmp_path, k).lookup(p)
        assert hit.reused_tokens == want and set(hit.sources) == {"disk"}, p[-5:]
        assert all(piece.rows is None for piece in hit.pieces)  # found by the index: read by restore
        assert exact(hit) == want
    hit = cache.lookup(PROMPT + [1])
    assert hit.sources == ["disk"] * 6 and exact(hit) == 83
    # the rows stay on disk: not copied into host memory by the lookup, nor by the store after the
    # prefill, which exports only the new tail [80, 84) (for the disk: its parent is not in host)
    exported = []
    cache.store(PROMPT + [1], 84, lambda a, b: exported.append((a, b)) or rows_for_prompt(PROMPT + [1])(a, b))
    cache.flush()
    assert len(cache.host) == 0 and exported == [(80, 84)]
    hit = cache.lookup(PROMPT + [1, 2])
    assert hit.sources == ["disk"] * 6 and exact(hit, PROMPT + [1]) == 84  # the longer tail, from disk
    s = cache.stats_dict()
    assert (s["disk_tokens"], s["host_tokens"]) == (83 + 84, 0)


def test_restore_times_split_the_copying_thread_and_the_readers(tmp_path):
    """restore_times: the copying thread's and the readers' seconds since the last call, for a
    restore from the disk and one from the host tier (both go through the readers), then zeroed."""
    k = key()
    _store(tmp_path, k).flush()
    for cache, source in ((_fresh(tmp_path, k), "disk"), (_store(tmp_path / "host", k), "host")):
        cache.flush()
        hit = cache.lookup(PROMPT + [1])
        assert set(hit.sources) == {source} and exact(hit) == 83
        times = cache.restore_times()
        assert set(times) == {"waited", "copying", "ring_waited", "reading"}
        assert times["reading"] > 0 and times["copying"] > 0 and min(times.values()) >= 0, times
        assert set(cache.restore_times().values()) == {0.0}


def test_live_rows_that_serve_as_much_read_no_file(tmp_path, monkeypatch):
    k = key()
    _store(tmp_path, k)
    cache = _fresh(tmp_path, k)
    reads: list[bytes] = []
    real = DiskTier.read
    monkeypatch.setattr(DiskTier, "read", lambda self, h, buf=None: reads.append(h) or real(self, h, buf))
    hit = cache.lookup(PROMPT + [1], live_tokens=PROMPT, live_frontier=len(PROMPT))
    assert (hit.reused_tokens, hit.pieces, exact(hit), reads) == (83, [], 83, [])
    hit = cache.lookup(PROMPT + [1], live_tokens=PROMPT[:70], live_frontier=70)
    assert hit.live_tokens == 64 and exact(hit) == 83 and len(reads) == 2  # block 4, tail


def test_a_dominated_tail_file_is_replaced_and_not_written_again(tmp_path):
    k = key()
    cache = _store(tmp_path, k)  # tail [80, 83)
    longer = PROMPT + [5, 6, 7, 8, 9]  # tail [80, 88) dominates it
    cache.store(longer, len(longer), rows_for_prompt(longer))
    names = {p.name for p in entry_files(tmp_path, k)}
    assert tail_hash(k).hex() + SUFFIX not in names and tail_hash(k, longer).hex() + SUFFIX in names
    assert len(names) == 6 and cache.disk.replaced == 1 and cache.disk.evictions == 0
    before = cache.stats.disk_written_chunks
    fresh = _fresh(tmp_path, k)
    fresh.store(PROMPT, len(PROMPT), rows_for_prompt(PROMPT))  # the shorter tail again: dominated
    assert len(entry_files(tmp_path, k)) == 6 and fresh.stats.disk_written_chunks == 0 and before == 7
    hit = _fresh(tmp_path, k).lookup(PROMPT + [0])
    assert hit.reused_tokens == 83 and exact(hit, longer) == 83  # its rows are the longer tail's


def test_corrupted_payload_is_a_miss_and_ends_the_chain_there(tmp_path):
    k = key()
    _store(tmp_path, k)
    h = chain_hashes(k, PROMPT)
    victim = tmp_path / k.digest().hex() / (h[2].hex() + SUFFIX)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # one bit in the payload: header and size still look fine
    victim.write_bytes(bytes(data))
    cache = _fresh(tmp_path, k)
    assert len(cache.disk) == 6  # the header verifies; the payload is checked when it is read
    hit = cache.lookup(PROMPT + [1])
    assert hit.reused_tokens == 83  # the index's view: the payloads are read by the restore
    assert exact(hit) == 2 * C  # blocks 0 and 1 only: the rest hangs off block 2
    s = cache.stats_dict()
    assert (s["cached_tokens"], s["disk_tokens"]) == (2 * C, 2 * C)  # counted as restored
    assert not victim.exists() and cache.disk.quarantined == 1
    assert cache.lookup(PROMPT + [1]).reused_tokens == 2 * C  # and the next lookup knows it
    assert len(list((tmp_path / k.digest().hex() / QUARANTINE).iterdir())) == 1


def test_headers_verified_at_start_are_matched_not_reparsed_and_payloads_checked_in_full(tmp_path, monkeypatch):
    """A header verified by the index scan is not parsed again when its file is read (only its
    preamble matched); a flipped bit anywhere in a payload, or a file replaced after the scan
    (another key's), is still a miss."""
    k = key()
    _store(tmp_path, k)
    parsed = []
    real_parse = diskfile.parse
    monkeypatch.setattr(diskfile, "parse", lambda *a: parsed.append(1) or real_parse(*a))
    fresh = _fresh(tmp_path, k)
    assert len(parsed) == 6  # the scan
    assert exact(fresh.lookup(PROMPT + [1])) == 83 and len(parsed) == 6  # the reads parsed nothing
    h = chain_hashes(k, PROMPT)
    d = tmp_path / k.digest().hex()
    cache = _fresh(tmp_path, k)  # the index is built now; the files change under it below
    for n, (i, where) in enumerate(((3, "first"), (2, "last"), (1, "middle")), 1):  # from the chain's end
        f = d / (h[i].hex() + SUFFIX)
        data = bytearray(f.read_bytes())
        start = len(data) - diskfile.parse(bytes(data), len(data)).payload_bytes
        at = {"first": start, "last": len(data) - 1, "middle": (start + len(data)) // 2}[where]
        data[at] ^= 0x10
        f.write_bytes(bytes(data))
        hit = cache.lookup(PROMPT + [1])
        assert exact(hit) == i * C, where  # the chain ends at the bad file
        assert not f.exists() and cache.disk.quarantined == n
    # block 0 replaced by another key's file after the index was built: refused when read
    other = key(kv_dtype="float8_e4m3fn")
    _store(tmp_path / "other", other)
    theirs = tmp_path / "other" / other.digest().hex() / (chain_hashes(other, PROMPT)[0].hex() + SUFFIX)
    os.replace(theirs, d / (h[0].hex() + SUFFIX))
    assert exact(cache.lookup(PROMPT + [1])) == 0 and cache.disk.quarantined == 4


def test_corrupted_header_and_truncated_file_are_misses(tmp_path):
    k = key()
    _store(tmp_path, k)
    h = chain_hashes(k, PROMPT)
    d = tmp_path / k.digest().hex()
    f1, f3 = d / (h[1].hex() + SUFFIX), d / (h[3].hex() + SUFFIX)
    data = bytearray(f1.read_bytes())
    data[40] ^= 0x01  # inside the JSON header
    f1.write_bytes(bytes(data))
    with f3.open("r+b") as f:
        f.truncate(f3.stat().st_size - 7)
    cache = _fresh(tmp_path, k)
    assert cache.disk.quarantined == 2 and len(cache.disk) == 4
    hit = cache.lookup(PROMPT + [1])
    assert hit.reused_tokens == C and exact(hit) == C
    # block 1 gone: a prompt diverging inside block 1 finds no child of block 0 either
    assert cache.lookup(PROMPT[:20] + [0] * 20).reused_tokens == C


def test_foreign_and_renamed_files_are_misses(tmp_path):
    k, other = key(), key(kv_dtype="float8_e4m3fn")
    _store(tmp_path, other)
    # copy another key's block 0 into our folder under our block-0 name: it must not be used
    h_ours = chain_hashes(k, PROMPT)[0]
    h_theirs = chain_hashes(other, PROMPT)[0]
    src = tmp_path / other.digest().hex() / (h_theirs.hex() + SUFFIX)
    (tmp_path / k.digest().hex()).mkdir()
    (tmp_path / k.digest().hex() / (h_ours.hex() + SUFFIX)).write_bytes(src.read_bytes())
    cache = _fresh(tmp_path, k)
    assert cache.disk.quarantined == 1 and cache.lookup(PROMPT + [1]).reused_tokens == 0
    # a file renamed to another chain hash of the right key is refused too
    _store(tmp_path, k)
    d = tmp_path / k.digest().hex()
    hs = chain_hashes(k, PROMPT)
    os.replace(d / (hs[4].hex() + SUFFIX), d / (hs[3].hex() + SUFFIX))
    cache = _fresh(tmp_path, k)
    assert cache.disk.quarantined == 1
    assert cache.lookup(PROMPT + [1]).reused_tokens == 3 * C


def _v1_file(k: CacheKey, h: bytes, parent: bytes, rows) -> bytes:
    """A file as the previous kit version wrote it (format 1: blake2b, no tokens, unaligned)."""
    tensors, payload, off = [], b"", 0
    for name in sorted(rows):
        raw = rows[name].contiguous().view(torch.uint8).numpy().tobytes()
        tensors.append({"name": name, "dtype": str(rows[name].dtype).removeprefix("torch."),
                        "shape": list(rows[name].shape), "offset": off, "nbytes": len(raw)})
        payload += raw
        off += len(raw)
    header = json.dumps({"key": json.loads(k.to_json()), "hash": h.hex(), "parent": parent.hex(),
                         "tensors": tensors, "payload_bytes": off,
                         "payload_blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()},
                        sort_keys=True, separators=(",", ":")).encode()
    pre = struct.pack("<8sII16s", b"GLM53KVC", 1, len(header), hashlib.blake2b(header, digest_size=16).digest())
    return pre + header + payload


def test_old_format_files_are_quarantined_never_misread(tmp_path, caplog):
    k = key()
    d = tmp_path / k.digest().hex()
    d.mkdir()
    hs = chain_hashes(k, PROMPT)
    rows_for = rows_for_prompt(PROMPT)
    parent = root_hash(k)
    for i, h in enumerate(hs):
        (d / (h.hex() + SUFFIX)).write_bytes(_v1_file(k, h, parent, rows_for(i * C, (i + 1) * C)))
        parent = h
    with caplog.at_level("WARNING", logger="kv_cache"):
        cache = _fresh(tmp_path, k)
    assert cache.disk.quarantined == 5 and len(cache.disk) == 0
    assert any("format version 1" in r.message for r in caplog.records)
    assert cache.lookup(PROMPT + [1]).reused_tokens == 0
    # the new kit writes its own files over the same names, and those are used
    cache.store(PROMPT, len(PROMPT), rows_for)
    hit = _fresh(tmp_path, k).lookup(PROMPT + [1])
    assert hit.reused_tokens == 83 and exact(hit) == 83
    # format 2 (SHA-256 payloads) is refused the same way: its version, not its digest, says so
    d2 = tmp_path / "v2"
    _store(d2, k)
    for f in entry_files(d2, k):
        data = bytearray(f.read_bytes())
        data[8:12] = struct.pack("<I", 2)
        f.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="kv_cache"):
        cache = _fresh(d2, k)
    assert cache.disk.quarantined == 6 and len(cache.disk) == 0
    assert any("format version 2" in r.message for r in caplog.records)


def test_disk_budget_evicts_least_recently_used_chains(tmp_path):
    k = key()
    a = PROMPT[:5 * C]  # 5 blocks, no tail
    b = [t + 1 for t in a]
    _store(tmp_path / "probe", k, a)
    size = entry_files(tmp_path / "probe", k)[0].stat().st_size
    budget = 7 * size
    cache = _store(tmp_path, k, a, budget)
    time.sleep(0.01)
    cache.store(b, len(b), rows_for_prompt(b))  # 5 more blocks: 3 of a's must go, tip first
    assert cache.disk.used_bytes <= budget and cache.disk.evictions == 3
    fresh = _fresh(tmp_path, k, budget)
    assert fresh.lookup(b + [1]).reused_tokens == 5 * C
    assert fresh.lookup(a + [1]).reused_tokens == 2 * C  # a's chain kept from its root


def test_disk_budget_with_tails_evicts_the_tail_first(tmp_path):
    k = key()
    _store(tmp_path, k)  # 5 blocks + tail, the tail the oldest (tip of the chain)
    files = {p.name: p.stat().st_size for p in entry_files(tmp_path, k)}
    tail_name = tail_hash(k).hex() + SUFFIX
    block = max(files.values())
    fresh = _fresh(tmp_path, k, budget=sum(files.values()) + block - files[tail_name] // 2)
    other = [t + 3 for t in PROMPT[:C]]  # one unrelated block: only the tail has to go
    fresh.store(other, len(other), rows_for_prompt(other))
    names = {p.name for p in entry_files(tmp_path, k)}
    assert tail_name not in names and len(names) == 6 and fresh.disk.evictions == 1
    assert _fresh(tmp_path, k).lookup(PROMPT + [1]).reused_tokens == 5 * C


WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {repo!r})
    from kv_cache import CacheKey, DiskTier, Node
    from kv_cache.keys import root_hash
    key = CacheKey.from_json({key!r})
    tier = DiskTier({disk!r}, key, 1 << 40)
    rows = {{"latent.%d" % i: torch.full((1 << 20,), float(i), dtype=torch.bfloat16) for i in range(96)}}
    print("ready", flush=True)
    root = root_hash(key)
    tier.put_chain(root, [Node(bytes.fromhex({h!r}), root, np.array({tokens!r}, dtype=np.int64), rows)])
    print("done", flush=True)
""")


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_write_never_leaves_a_hit(tmp_path):
    k = key()
    h = chain_hashes(k, PROMPT)[0]
    d = tmp_path / k.digest().hex()
    final = d / (h.hex() + SUFFIX)
    caught = False
    for _attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=str(REPO), key=k.to_json(),
                                                                      disk=str(tmp_path), h=h.hex(),
                                                                      tokens=PROMPT[:C])],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(p.name.startswith(TMP_PREFIX) for p in d.iterdir()):
            time.sleep(0.0005)
        tmp_seen = [p for p in d.iterdir() if p.name.startswith(TMP_PREFIX)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if tmp_seen and not final.exists():
            caught = True
            break
        final.unlink(missing_ok=True)  # the write finished before the kill; try again
    assert caught, "could not kill the writer mid-write in 5 attempts"
    assert tmp_seen[0].exists() and tmp_seen[0].stat().st_size < 192 << 20  # really half-written
    tier = DiskTier(tmp_path, k, 1 << 40)  # restart: the unfinished temp file is removed
    assert h not in tier and tier.load(h) is None
    assert not any(p.name.startswith(TMP_PREFIX) for p in d.iterdir())
    cache = PrefixCache(k, host_bytes=1 << 20, disk=tier)
    assert cache.lookup(PROMPT + [1]).reused_tokens == 0


FULL_DISK_WRITER = textwrap.dedent("""
    import json, logging, resource, sys, numpy as np, torch
    sys.path.insert(0, {repo!r})
    logging.basicConfig(level=logging.WARNING)
    from kv_cache import CacheKey, DiskTier, Node
    from kv_cache.keys import root_hash, chain_hashes
    if {limit}:
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    key = CacheKey.from_json({key!r})
    tier = DiskTier({disk!r}, key, 1 << 40)
    B = key.chunk_size
    toks = list(range(8 * B))
    hs = chain_hashes(key, toks)
    parents = [root_hash(key)] + hs[:-1]
    nodes = [Node(hs[i], parents[i], np.array(toks[i * B:(i + 1) * B], dtype=np.int64),
                  {{"latent.0": torch.full((B, 4096), float(i), dtype=torch.bfloat16)}}) for i in range(8)]
    n = tier.put_chain(root_hash(key), nodes)
    print(json.dumps({{"written": n, "errors": tier.write_errors}}))
""")


def _try_small_tmpfs(mnt: Path) -> bool:
    if os.geteuid() != 0:
        return False
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], capture_output=True, timeout=10)
    return r.returncode == 0


def test_full_filesystem_is_logged_and_leaves_no_partial_entry(tmp_path):
    """A real out-of-space: a 600 KiB tmpfs where we may mount one (root), else a real file
    size limit (RLIMIT_FSIZE -> EFBIG, per file, so below one entry) on the writer process.
    Each entry is ~128 KiB."""
    k = key()
    mnt = tmp_path / "small"
    mounted = _try_small_tmpfs(mnt)
    tier = None
    try:
        target = mnt if mounted else tmp_path / "limited"
        limit = 0 if mounted else 100 * 1024
        code = FULL_DISK_WRITER.format(repo=str(REPO), key=k.to_json(), disk=str(target), limit=limit)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert (1 <= res["written"] < 8) if mounted else res["written"] == 0
        assert res["errors"] == 1
        assert ("disk full" if mounted else "file size limit (EFBIG)") in out.stderr
        d = target / k.digest().hex()
        assert not any(p.name.startswith(TMP_PREFIX) for p in d.iterdir())
        tier = DiskTier(target, k, 1 << 40)  # what was written is whole and verifies
        assert len(tier) == res["written"] and tier.quarantined == 0
        hs = chain_hashes(k, list(range(8 * C)))
        for i in range(res["written"]):
            assert torch.equal(tier.load(hs[i])["latent.0"], torch.full((C, 4096), float(i), dtype=torch.bfloat16))
        if mounted:
            # the disk is still full: another chain's store lowers the budget to what the tier
            # holds and replaces its least recently used files instead of failing from now on
            other = [100_000 + t for t in range(8 * C)]
            ho = chain_hashes(k, other)
            parents = [root_hash(k)] + ho[:-1]
            nodes = [Node(ho[i], parents[i], np.array(other[i * C:(i + 1) * C], dtype=np.int64),
                          {"latent.0": torch.full((C, 4096), 50.0 + i, dtype=torch.bfloat16)}) for i in range(8)]
            held = tier.used_bytes
            written = tier.put_chain(root_hash(k), nodes)
            assert written >= 1 and tier.budget_bytes == held and tier.used_bytes <= held
            assert tier.evictions >= written
            for i in range(written):
                assert torch.equal(tier.load(ho[i])["latent.0"], torch.full((C, 4096), 50.0 + i, dtype=torch.bfloat16))
            assert not any(p.name.startswith(TMP_PREFIX) for p in d.iterdir())
    finally:
        if tier is not None:
            tier.close()  # its live lock is a file open on the mount
        if mounted:
            assert subprocess.run(["umount", str(mnt)], timeout=10).returncode == 0


def test_background_writer_keeps_disk_io_off_the_store_call(tmp_path):
    k = key()
    cache = PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(tmp_path, k, 1 << 30), disk_async=True)
    cache.store(PROMPT, len(PROMPT), rows_for_prompt(PROMPT))
    assert cache.stats.stored_chunks == 6  # host tier filled synchronously
    cache.flush()
    assert cache.stats_dict()["disk_written_chunks"] == 6 and len(entry_files(tmp_path, k)) == 6
    cache.close()
    fresh = _fresh(tmp_path, k)
    hit = fresh.lookup(PROMPT + [1])
    assert hit.reused_tokens == 5 * C + 3 and hit.sources == ["disk"] * 6


# ---- bad states a serving process must survive as misses, and the disk's budget ------------------
def _rewrite_header(path: Path, mutate) -> None:
    """Re-encode a file's header after mutate(meta), correctly signed and aligned: a file that
    passes the header digest but says something wrong."""
    data = path.read_bytes()
    _, version, hlen, _ = diskfile.PREAMBLE.unpack(data[:diskfile.PREAMBLE.size])
    meta = json.loads(data[diskfile.PREAMBLE.size:diskfile.PREAMBLE.size + hlen])
    payload = data[diskfile.PREAMBLE.size + hlen:]
    mutate(meta)
    header = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-(diskfile.PREAMBLE.size + len(header)) % diskfile.ALIGN)
    pre = diskfile.PREAMBLE.pack(diskfile.MAGIC, version, len(header), diskfile.header_digest(header))
    path.write_bytes(pre + header + payload)


def test_signed_headers_with_a_bad_tensor_list_or_tokens_are_misses_not_a_failed_start(tmp_path):
    """A header whose digest verifies but whose content is wrong (a buggy writer of this format):
    an unknown dtype, scalar tokens, negative dimensions. Start-up quarantines each, never raises;
    lookups reuse up to the first bad block."""
    k = key()
    _store(tmp_path, k)
    d, hs = tmp_path / k.digest().hex(), chain_hashes(k, PROMPT)

    def dtype(meta):
        meta["runs"][0]["dtype"] = "notatype"

    def scalar_tokens(meta):
        meta["tokens"], meta["length"] = 5, 1

    def negative(meta):
        run = meta["runs"][0]
        run["shape"] = [-x for x in run["shape"][:2]] + run["shape"][2:]

    for i, mutate in ((2, dtype), (3, scalar_tokens), (4, negative)):
        _rewrite_header(d / (hs[i].hex() + SUFFIX), mutate)
        assert len(list(d.glob("*" + SUFFIX))) == 6
    cache = _fresh(tmp_path, k)
    assert cache.disk.quarantined == 3 and len(cache.disk) == 3  # blocks 0, 1 and the tail
    hit = cache.lookup(PROMPT + [1])
    assert hit.reused_tokens == 2 * C and exact(hit) == 2 * C


def test_a_failed_directory_fsync_keeps_the_written_file_indexed(tmp_path, monkeypatch, caplog):
    """The rename happened; only its durability is unsure: the entry is indexed and counted (it
    was dropped from the index while its file stayed, outside the budget)."""
    import errno

    from kv_cache import disk as disk_mod

    def failing(d):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_mod, "_fsync_dir", failing)
    cache = _store(tmp_path, key())
    files = list((tmp_path / key().digest().hex()).glob("*" + SUFFIX))
    assert len(files) == 6 and len(cache.disk) == 6 and cache.disk.write_errors == 0
    assert cache.disk.used_bytes == sum(f.stat().st_size for f in files)
    assert "fsync" in caplog.text


def test_the_budget_holds_from_start_and_a_node_over_it_is_said_once(tmp_path, caplog):
    k = key()
    _store(tmp_path, k)
    d = tmp_path / k.digest().hex()
    sizes = sorted(f.stat().st_size for f in d.glob("*" + SUFFIX))
    budget = sum(sizes) // 2
    tier = DiskTier(tmp_path, k, budget)  # a restart with a smaller budget: evicted at once
    assert 0 < tier.used_bytes <= budget and tier.evictions > 0
    assert tier.used_bytes == sum(f.stat().st_size for f in d.glob("*" + SUFFIX))
    tiny = DiskTier(tmp_path / "tiny", k, 100)
    toks = list(range(C))
    h = chain_hashes(k, toks)[0]
    rows = rows_for_prompt(toks)(0, C)
    for _ in range(2):
        assert tiny.put_chain(root_hash(k), [Node(h, root_hash(k), np.array(toks, dtype=np.int64), rows)]) == 0
    assert caplog.text.count("larger than the budget") == 1 and "TF_GLM53_DISK_CACHE_BYTES" in caplog.text


def test_stale_temp_files_go_even_when_their_pid_is_reused_and_quarantine_keeps_the_newest(tmp_path):
    k = key()
    _store(tmp_path, k)
    d = tmp_path / k.digest().hex()
    old_tmp, new_tmp = d / f"{TMP_PREFIX}1.old", d / f"{TMP_PREFIX}1.new"  # pid 1 runs: init, not a writer
    for p in (old_tmp, new_tmp):
        p.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old_tmp, (two_hours_ago, two_hours_ago))
    # a full quarantine of recent files, then a bad entry whose last use was long ago
    q = d / QUARANTINE
    q.mkdir()
    for i in range(16):
        (q / f"earlier.{i}").write_bytes(b"x")
    victim = d / (chain_hashes(k, PROMPT)[2].hex() + SUFFIX)
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x20
    victim.write_bytes(bytes(data))
    os.utime(victim, (two_hours_ago, two_hours_ago))
    tier = DiskTier(tmp_path, k, 1 << 30)
    assert not old_tmp.exists() and new_tmp.exists()
    assert tier.load(chain_hashes(k, PROMPT)[2]) is None and tier.quarantined == 1
    kept = sorted(p.name for p in q.iterdir())
    assert len(kept) == 16 and any(name.startswith(victim.name) for name in kept)


def test_other_keys_folders_are_trimmed_at_start_but_not_other_ranks_live_or_recent_ones(tmp_path, caplog):
    """The budget covers DIR: an older kit's folder, unused for hours, goes (only its own files),
    while this server's other rank (same key but the rank), a folder a running tier holds (its
    live lock) and a folder touched lately stay."""
    caplog.set_level(logging.INFO, logger="kv_cache")
    ours, sibling = key(ranks=2, rank=0), key(ranks=2, rank=1)
    old_kit, recent = key(ranks=2, rank=0, kit_version="old"), key(ranks=2, rank=0, model_revision="other")
    live = key(ranks=2, rank=0, device_kind="another GPU")
    for k in (ours, sibling, old_kit, recent, live):
        _store(tmp_path, k)
    running = DiskTier(tmp_path, live, 1 << 30)  # open while ours starts: another server, idle for hours
    stray = tmp_path / ("f" * len(ours.digest().hex()))  # named like a key folder, holding a user's file
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    long_ago = time.time() - 3 * 3600
    for k in (sibling, old_kit, live):
        d = tmp_path / k.digest().hex()
        for f in [*d.iterdir(), d]:
            os.utime(f, (long_ago, long_ago))
    for f in (stray / "notes.txt", stray):
        os.utime(f, (long_ago, long_ago))
    size = sum(f.stat().st_size for f in (tmp_path / ours.digest().hex()).iterdir())
    tier = DiskTier(tmp_path, ours, 2 * size)  # ours + any one other fits, not more
    assert not (tmp_path / old_kit.digest().hex()).exists()
    for k in (sibling, recent, live):
        assert len(list((tmp_path / k.digest().hex()).glob("*" + SUFFIX))) == 6, k
    assert (stray / "notes.txt").read_text() == "mine"
    assert len(tier) == 6 and len(running) == 6 and "another key's" in caplog.text


def _read_only_view(src: Path, dst: Path) -> bool:
    """dst as a read-only bind mount of src (root), for a real read-only filesystem."""
    if os.geteuid() != 0:
        return False
    dst.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, timeout=10).returncode:
        return False
    if subprocess.run(["mount", "-o", "remount,ro,bind", str(dst)], capture_output=True, timeout=10).returncode:
        subprocess.run(["umount", str(dst)], timeout=10)
        return False
    return True


def test_a_read_only_folder_still_serves_its_files(tmp_path, monkeypatch, caplog):
    """A disk tier on a read-only filesystem (or files another user owns) cannot set file times:
    the lookup's touch dropped the very nodes it had just found, so nothing was ever restored.
    Now they are read; writes fail with one warning each, never an exception."""
    import errno

    k = key()
    _store(tmp_path / "src", k)
    ro = tmp_path / "ro"
    mounted = _read_only_view(tmp_path / "src", ro)
    if not mounted:  # not root: files another user owns refuse new times with EPERM
        ro = tmp_path / "src"

        def refused(*args, **kwargs):
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "utime", refused)
    try:
        cache = _fresh(ro, k)
        for _ in range(2):
            hit = cache.lookup(PROMPT + [1])
            assert hit.reused_tokens == len(PROMPT) and exact(hit) == len(PROMPT)
        assert len(cache.disk) == 6 and caplog.text.count("cannot mark") == 1
        other = [t + 7 for t in PROMPT]
        cache.store(other, len(other), rows_for_prompt(other))
        if mounted:
            assert cache.disk.write_errors == 1 and "Read-only file system" in caplog.text
    finally:
        if mounted:
            assert subprocess.run(["umount", str(ro)], timeout=10).returncode == 0


def _chain(k: CacheKey, base: int, blocks: int, fill: float) -> list:
    toks = [base + t for t in range(blocks * C)]
    hs = chain_hashes(k, toks)
    parents = [root_hash(k)] + hs[:-1]
    return [Node(hs[i], parents[i], np.array(toks[i * C:(i + 1) * C], dtype=np.int64),
                 {"latent.0": torch.full((C, 4096), fill + i, dtype=torch.bfloat16)}) for i in range(blocks)]


def test_a_full_filesystem_before_any_write_keeps_the_budget_and_a_removed_folder_is_made_again(
        tmp_path, monkeypatch, caplog):
    """With nothing of its own to turn over, a full filesystem must not lower the budget to 0
    (that turned the tier off for the run); once space is back, writes go through. A folder
    removed under a running tier is made again by its next write."""
    import errno

    k = key()
    mnt = tmp_path / "small"
    mounted = _try_small_tmpfs(mnt)
    target = mnt if mounted else tmp_path / "plain"
    tier = DiskTier(target, k, 1 << 30)
    try:
        if mounted:
            filler = mnt / "filler"
            with filler.open("wb") as f:  # the filesystem full before the tier writes anything
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
        else:  # not root: the kernel's answer to a full disk, from fsync
            real_fsync = os.fsync

            def full(fd):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(os, "fsync", full)
        assert tier.put_chain(root_hash(k), _chain(k, 0, 2, 1.0)) == 0
        assert tier.budget_bytes == 1 << 30 and "disk full" in caplog.text
        if mounted:
            filler.unlink()
        else:
            monkeypatch.setattr(os, "fsync", real_fsync)
        assert tier.put_chain(root_hash(k), _chain(k, 0, 2, 1.0)) == 2
        for p in tier.dir.iterdir():
            p.unlink()
        tier.dir.rmdir()
        nodes = _chain(k, 500, 1, 9.0)
        assert tier.put_chain(root_hash(k), nodes) == 1
        assert torch.equal(tier.load(nodes[0].hash)["latent.0"], nodes[0].rows["latent.0"])
    finally:
        tier.close()
        if mounted:
            assert subprocess.run(["umount", str(mnt)], timeout=10).returncode == 0
