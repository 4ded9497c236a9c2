"""Disk tier: survives a real process restart; corrupt, truncated, foreign and half-written
files are misses (never wrong rows); LRU by mtime under a byte budget; a full filesystem."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from kv_cache import CacheKey, DiskTier, PrefixCache, chain_hashes
from kv_cache.disk import QUARANTINE, SUFFIX, TMP_PREFIX
from kv_cache.keys import root_hash

REPO = Path(__file__).resolve().parents[1]
C = 16


def key(**kw) -> CacheKey:
    base = dict(model_revision="rev", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                dcp=False, chunk_size=C, device_kind="cpu", kit_version="t")
    base.update(kw)
    return CacheKey(**base)


def rows_for_prompt(tokens: list[int], width: int = 8):
    def rows_for(k: int):
        g = torch.Generator().manual_seed(hash(tuple(tokens[:(k + 1) * C])) & 0xFFFFFFFF)
        return {"latent.0": torch.randn(C, width, generator=g).to(torch.bfloat16),
                "index.0": torch.randn(C, 4, generator=g).to(torch.float8_e4m3fn),
                "scale.0": torch.rand(C, generator=g)}
    return rows_for


def rows_bytes(rows) -> bytes:
    return b"".join(rows[n].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(rows))


PROMPT = [(i * 31337) % 50000 for i in range(5 * C + 3)]

CHILD = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {repo!r})
    from kv_cache import CacheKey, PrefixCache
    key = CacheKey.from_json({key!r})
    prompt = json.loads({prompt!r})
    C = key.chunk_size
    def rows_for(k):
        g = torch.Generator().manual_seed(hash(tuple(prompt[:(k + 1) * C])) & 0xFFFFFFFF)
        return {{"latent.0": torch.randn(C, 8, generator=g).to(torch.bfloat16),
                "index.0": torch.randn(C, 4, generator=g).to(torch.float8_e4m3fn),
                "scale.0": torch.rand(C, generator=g)}}
    cache = PrefixCache.from_env(key)
    if sys.argv[1] == "write":  # no flush: the background writer must finish at exit
        cache.store(prompt, len(prompt), rows_for)
        print(json.dumps(cache.stats_dict()))
    else:
        hit = cache.lookup(prompt + [7])
        got = []
        hit.restore(lambda k, rows: got.append(b"".join(
            rows[n].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(rows)).hex()))
        print(json.dumps({{"reused": hit.reused_tokens, "sources": hit.sources, "rows": got,
                          "stats": cache.stats_dict()}}))
""")


def run_child(mode: str, disk: Path, k: CacheKey, prompt=PROMPT, budget="1G") -> dict:
    env = dict(os.environ, TF_GLM53_DISK_CACHE=str(disk), TF_GLM53_DISK_CACHE_BYTES=budget,
               PYTHONHASHSEED="0")
    code = CHILD.format(repo=str(REPO), key=k.to_json(), prompt=json.dumps(prompt))
    out = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected_rows(prompt=PROMPT) -> list[str]:
    # the child derives rows from hash(tuple); PYTHONHASHSEED=0 makes that stable across processes
    code = ("import json,sys;p=json.loads(sys.argv[1]);"
            f"print(json.dumps([hash(tuple(p[:(k+1)*{C}])) & 0xFFFFFFFF for k in range(len(p)//{C})]))")
    seeds = json.loads(subprocess.run([sys.executable, "-c", code, json.dumps(prompt)], capture_output=True,
                                      text=True, env=dict(os.environ, PYTHONHASHSEED="0"), check=True).stdout)
    out = []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        rows = {"latent.0": torch.randn(C, 8, generator=g).to(torch.bfloat16),
                "index.0": torch.randn(C, 4, generator=g).to(torch.float8_e4m3fn),
                "scale.0": torch.rand(C, generator=g)}
        out.append(rows_bytes(rows).hex())
    return out


def entry_files(disk: Path, k: CacheKey) -> list[Path]:
    return sorted((disk / k.digest().hex()).glob("*" + SUFFIX))


@pytest.mark.slow
def test_disk_tier_survives_a_real_process_restart(tmp_path):
    k = key()
    wrote = run_child("write", tmp_path, k)
    assert wrote["stored_chunks"] == 5
    got = run_child("read", tmp_path, k)  # a fresh process: index rebuilt from the files
    assert got["reused"] == 5 * C and got["sources"] == ["disk"] * 5
    assert got["rows"] == expected_rows()[:5]
    # another key (here: another model revision) never matches the same files
    other = run_child("read", tmp_path, key(model_revision="rev2"))
    assert other["reused"] == 0 and other["stats"]["disk_quarantined"] == 0
    assert len(entry_files(tmp_path, k)) == 5  # and it did not touch them


def _store(tier_dir: Path, k: CacheKey, prompt=PROMPT, budget=1 << 30) -> PrefixCache:
    cache = PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(tier_dir, k, budget))
    cache.store(prompt, len(prompt), rows_for_prompt(prompt))
    return cache


def _fresh(tier_dir: Path, k: CacheKey, budget=1 << 30) -> PrefixCache:
    return PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(tier_dir, k, budget))


def test_corrupted_payload_is_a_miss_and_quarantined(tmp_path):
    k = key()
    _store(tmp_path, k)
    h = chain_hashes(k, PROMPT)
    victim = tmp_path / k.digest().hex() / (h[2].hex() + SUFFIX)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # one bit in the payload: header and size still look fine
    victim.write_bytes(bytes(data))
    cache = _fresh(tmp_path, k)
    assert len(cache.disk.index) == 5  # the header verifies; the payload is checked on load
    hit = cache.lookup(PROMPT + [1])
    assert hit.reused_tokens == 2 * C  # chunks 0 and 1 only
    want = rows_for_prompt(PROMPT)
    assert [rows_bytes(r) for r in hit.chunks] == [rows_bytes(want(0)), rows_bytes(want(1))]
    assert not victim.exists() and cache.disk.quarantined == 1
    assert len(list((tmp_path / k.digest().hex() / QUARANTINE).iterdir())) == 1


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
    assert cache.disk.quarantined == 2 and len(cache.disk.index) == 3
    hit = cache.lookup(PROMPT + [1])
    assert hit.reused_tokens == C
    assert rows_bytes(hit.chunks[0]) == rows_bytes(rows_for_prompt(PROMPT)(0))


def test_foreign_file_is_a_miss(tmp_path):
    k, other = key(), key(kv_dtype="float8_e4m3fn")
    _store(tmp_path, other)
    # copy another key's chunk 0 into our folder under our chunk-0 name: it must not be used
    h_ours = chain_hashes(k, PROMPT)[0]
    src = entry_files(tmp_path, other)[0]
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
    assert cache.lookup(PROMPT + [1]).reused_tokens == 3 * C


def test_disk_budget_evicts_least_recently_used_chains(tmp_path):
    k = key()
    one = len(entry_files_after_store(tmp_path / "probe", k))
    assert one == 5
    size = entry_files(tmp_path / "probe", k)[0].stat().st_size
    budget = 7 * size
    a = PROMPT
    b = [t + 1 for t in PROMPT]
    cache = _store(tmp_path, k, a, budget)
    time.sleep(0.01)
    cache.store(b, len(b), rows_for_prompt(b))  # 5 more chunks: 3 of a's must go, tip first
    assert cache.disk.used_bytes <= budget and cache.disk.evictions == 3
    fresh = _fresh(tmp_path, k, budget)
    assert fresh.lookup(b + [1]).reused_tokens == 5 * C
    assert fresh.lookup(a + [1]).reused_tokens == 2 * C  # a's chain kept from its root


def entry_files_after_store(d: Path, k: CacheKey) -> list[Path]:
    _store(d, k)
    return entry_files(d, k)


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from kv_cache import CacheKey, DiskTier
    from kv_cache.keys import root_hash
    key = CacheKey.from_json({key!r})
    tier = DiskTier({disk!r}, key, 1 << 40)
    rows = {{"latent.%d" % i: torch.full((1 << 20,), float(i), dtype=torch.bfloat16) for i in range(96)}}
    print("ready", flush=True)
    tier.put_chain(root_hash(key), [bytes.fromhex({h!r})], [rows])
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
                                                                      disk=str(tmp_path), h=h.hex())],
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
    import json, logging, resource, sys, torch
    sys.path.insert(0, {repo!r})
    logging.basicConfig(level=logging.WARNING)
    from kv_cache import CacheKey, DiskTier
    from kv_cache.keys import root_hash, chain_hashes
    if {limit}:
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    key = CacheKey.from_json({key!r})
    tier = DiskTier({disk!r}, key, 1 << 40)
    toks = list(range(8 * key.chunk_size))
    hs = chain_hashes(key, toks)
    rows = [{{"latent.0": torch.full((key.chunk_size, 4096), float(i), dtype=torch.bfloat16)}} for i in range(8)]
    n = tier.put_chain(root_hash(key), hs, rows)
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
    try:
        target = mnt if mounted else tmp_path / "limited"
        limit = 0 if mounted else 100 * 1024
        code = FULL_DISK_WRITER.format(repo=str(REPO), key=k.to_json(), disk=str(target), limit=limit)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert (1 <= res["written"] < 8) if mounted else res["written"] == 0
        assert res["errors"] == 1
        assert "disk full" in out.stderr
        d = target / k.digest().hex()
        assert not any(p.name.startswith(TMP_PREFIX) for p in d.iterdir())
        tier = DiskTier(target, k, 1 << 40)  # what was written is whole and verifies
        assert len(tier.index) == res["written"] and tier.quarantined == 0
        hs = chain_hashes(k, list(range(8 * C)))
        for i in range(res["written"]):
            assert torch.equal(tier.load(hs[i])["latent.0"], torch.full((C, 4096), float(i), dtype=torch.bfloat16))
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], timeout=10)


def test_background_writer_keeps_disk_io_off_the_store_call(tmp_path):
    k = key()
    cache = PrefixCache(k, host_bytes=1 << 20, disk=DiskTier(tmp_path, k, 1 << 30), disk_async=True)
    cache.store(PROMPT, len(PROMPT), rows_for_prompt(PROMPT))
    assert cache.stats.stored_chunks == 5  # host tier filled synchronously
    cache.flush()
    assert cache.stats_dict()["disk_written_chunks"] == 5 and len(entry_files(tmp_path, k)) == 5
    cache.close()
    fresh = _fresh(tmp_path, k)
    hit = fresh.lookup(PROMPT + [1])
    assert hit.reused_tokens == 5 * C and hit.sources == ["disk"] * 5
