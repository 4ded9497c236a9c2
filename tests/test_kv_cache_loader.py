"""The disk tier's streamed read path (restore.py) and file format: every byte written comes back
exactly (any dtype and shape, views aligned in one buffer per file), across threads, through a
bounded ring of buffers; a corrupt or vanished file is a miss at its own node and ends a restore
there; the header pads the payload to alignment."""
from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
import torch

from kv_cache import CacheKey, DiskTier, Node, Piece, block_hash
from kv_cache import diskfile
from kv_cache.disk import SUFFIX
from kv_cache.keys import root_hash
from kv_cache.restore import Restorer

B = 32


def key() -> CacheKey:
    return CacheKey("rev", "bfloat16", "bfloat16", 1, 0, False, B, "cpu", "t")


def varied_rows(i: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"latent.0": torch.randn(n, 5, generator=g).to(torch.bfloat16),  # 10-byte rows: odd sizes
            "latent_scale.0": torch.rand(n, generator=g),
            "index.0": torch.randn(n, 3, 7, generator=g).to(torch.float8_e4m3fn),
            "pos.0": torch.randint(-2**62, 2**62, (n, 1), generator=g),
            "empty.0": torch.empty(n, 0, dtype=torch.float16)}


def chain(k: CacheKey, count: int, tail: int = 0) -> list[Node]:
    """`count` full blocks and optionally a tail of `tail` tokens, with rows."""
    nodes, parent = [], root_hash(k)
    for i in range(count + (1 if tail else 0)):
        n = B if i < count else tail
        toks = np.arange(i * B, i * B + n, dtype=np.int64) * 7 % 1001
        h = block_hash(parent, toks)
        nodes.append(Node(h, parent, toks, varied_rows(i, n)))
        parent = h
    return nodes


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and raw(a[n]) == raw(b[n]) for n in a)


def pieces_of(nodes: list[Node]) -> list[Piece]:
    out, start = [], 0
    for n in nodes:
        out.append(Piece(start, len(n.tokens), None, "disk", n.hash))
        start += len(n.tokens)
    return out


def restore_all(restorer: Restorer, pieces: list[Piece]) -> tuple[int, list[tuple[int, int, dict]]]:
    got = []
    end = restorer.restore(pieces, lambda a, n, rows: got.append((a, n, {k: v.clone() for k, v in rows.items()})),
                           None)
    return end, got


@pytest.mark.parametrize("threads", [1, 4])
def test_streamed_restore_returns_exactly_the_bytes_written(tmp_path, threads):
    k = key()
    nodes = chain(k, 12, tail=5)
    assert DiskTier(tmp_path, k, 1 << 30).put_chain(root_hash(k), nodes) == 13
    tier = DiskTier(tmp_path, k, 1 << 30, threads=threads)  # a restart
    restorer = Restorer(tier, pinned=False)
    for _ in range(2):  # the second time through the same ring
        end, got = restore_all(restorer, pieces_of(nodes))
        assert end == 12 * B + 5 and [(a, n) for a, n, _ in got] == [(p.start, p.length) for p in pieces_of(nodes)]
        assert all(same(rows, n.rows) for (_, _, rows), n in zip(got, nodes))
    # 13 files through a ring of 2 x threads buffers, each of one file's size: memory stays the ring's
    buffers = [b for b in restorer._buffers if b is not None]
    assert len(buffers) == min(2 * threads, 13) and restorer.files_read == 26
    assert all(b.numel() == max(f.stat().st_size for f in (tmp_path / k.digest().hex()).iterdir()) for b in buffers)
    rows = tier.load(nodes[3].hash)  # one file on its own: zero-copy views, aligned for their dtype
    assert same(rows, nodes[3].rows) and all(t.data_ptr() % diskfile.ALIGN == 0 for t in rows.values() if t.numel())
    assert tier.quarantined == 0
    restorer.close()


def test_reads_run_on_several_threads(tmp_path, monkeypatch):
    k = key()
    nodes = chain(k, 8)
    DiskTier(tmp_path, k, 1 << 30).put_chain(root_hash(k), nodes)
    tier = DiskTier(tmp_path, k, 1 << 30, threads=4)
    seen, lock, gate = set(), threading.Lock(), threading.Barrier(2, timeout=10)
    real = DiskTier._read

    def spy(self, h, entry, buf):
        with lock:
            seen.add(threading.current_thread().name)
        if entry.payload.path.name == nodes[0].hash.hex() + SUFFIX or entry.payload.path.name == nodes[1].hash.hex() + SUFFIX:
            gate.wait()  # blocks 0 and 1 must be read at the same time
        return real(self, h, entry, buf)
    monkeypatch.setattr(DiskTier, "_read", spy)
    restorer = Restorer(tier, pinned=False)
    end, got = restore_all(restorer, pieces_of(nodes))
    assert end == 8 * B and all(same(rows, n.rows) for (_, _, rows), n in zip(got, nodes))
    assert len(seen) >= 2 and all(name.startswith("kv_cache-restore") for name in seen)
    restorer.close()


def test_a_bad_file_is_a_miss_at_its_own_node_and_ends_a_restore_there(tmp_path):
    k = key()
    nodes = chain(k, 6)
    DiskTier(tmp_path, k, 1 << 30).put_chain(root_hash(k), nodes)
    d = tmp_path / k.digest().hex()
    bad = d / (nodes[2].hash.hex() + SUFFIX)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2 + 40] ^= 0x10  # inside the payload
    bad.write_bytes(bytes(data))
    tier = DiskTier(tmp_path, k, 1 << 30, threads=3)
    (d / (nodes[4].hash.hex() + SUFFIX)).unlink()  # evicted by another process meanwhile
    restorer = Restorer(tier, pinned=False)
    end, got = restore_all(restorer, pieces_of(nodes))
    assert end == 2 * B and len(got) == 2  # blocks 0 and 1; nothing past the bad file is written
    assert tier.quarantined == 1 and not bad.exists() and nodes[2].hash not in tier
    end, got = restore_all(restorer, pieces_of(nodes)[3:])  # from block 3: ends at the vanished file
    assert end == 4 * B and len(got) == 1 and same(got[0][2], nodes[3].rows)
    assert nodes[4].hash not in tier  # dropped from the index
    assert [tier.read(n.hash) is None for n in nodes] == [False, False, True, False, True, False]
    assert tier.read(b"\0" * 16) is None
    # a file cut short after the index was read (a disk error, an outside hand): a miss there too
    victim = d / (nodes[1].hash.hex() + SUFFIX)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    end, got = restore_all(restorer, pieces_of(nodes))
    assert end == B and len(got) == 1 and same(got[0][2], nodes[0].rows)
    assert tier.quarantined == 2 and nodes[1].hash not in tier
    restorer.close()


def verified_rows(hdr: diskfile.Header, buf: torch.Tensor) -> dict:
    """A whole file in `buf`, its payload checked and its rows as views, as a disk read does."""
    known = diskfile.Known.of(hdr, {})
    known.verify(memoryview(buf.numpy()))
    return diskfile.views(known.runs, buf)


def test_file_layout_aligns_the_payload_and_records_tokens():
    k = key()
    node = chain(k, 0, tail=3)[0]
    pieces = diskfile.encode(json.loads(k.to_json()), node)
    blob = b"".join(bytes(p) for p in pieces)
    hdr = diskfile.parse(memoryview(blob), len(blob))
    assert hdr.payload_start % diskfile.ALIGN == 0 and hdr.file_size == len(blob)
    assert hdr.tokens.tolist() == node.tokens.tolist() and hdr.parent == node.parent
    assert all(r["offset"] % diskfile.ALIGN == 0 for r in hdr.runs)
    # the five tensors differ in dtype or shape: five runs; views of them are exact
    assert [r["names"] for r in hdr.runs] == [[n] for n in sorted(node.rows)]
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    assert same(verified_rows(hdr, buf), node.rows)
    # a header that lies about its tokens fails the identity check (the hash is recomputed)
    diskfile.check_identity(hdr, json.loads(k.to_json()), node.hash, B)
    liar = dataclasses.replace(hdr, tokens=hdr.tokens + 1)
    with pytest.raises(diskfile.CorruptEntry, match="does not match the parent and tokens"):
        diskfile.check_identity(liar, json.loads(k.to_json()), node.hash, B)
    with pytest.raises(diskfile.CorruptEntry, match="file name does not match"):
        diskfile.check_identity(hdr, json.loads(k.to_json()), b"\1" * 16, B)


def test_tensors_of_one_dtype_and_shape_are_one_run_and_a_bad_run_is_refused():
    k = key()
    g = torch.Generator().manual_seed(2)
    rows = {f"latent.{i}": torch.randn(4, 6, generator=g).to(torch.bfloat16) for i in range(12)}  # 48 bytes: padded
    rows |= {f"index.{i}": torch.randn(4, 16, generator=g).to(torch.bfloat16) for i in range(5)}  # 128 bytes
    toks = np.arange(4, dtype=np.int64)
    node = Node(block_hash(root_hash(k), toks), root_hash(k), toks, rows)
    blob = b"".join(bytes(p) for p in diskfile.encode(json.loads(k.to_json()), node))
    hdr = diskfile.parse(memoryview(blob), len(blob))
    # the 128-byte index rows lie back to back: one run; the 48-byte latents need padding: one each
    assert [len(r["names"]) for r in hdr.runs] == [5] + [1] * 12
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    assert same(verified_rows(hdr, buf), rows)
    for i, change, why in [
        (0, {"names": hdr.runs[0]["names"] + ["index.9"] * 40}, "outside the payload"),
        (0, {"shape": [4, 15]}, "does not fit"),
        (0, {"offset": 8}, "outside the payload"),
        (1, {"names": ["index.0"]}, "appears twice"),
        (0, {"dtype": "nonsense"}, "unknown dtype"),
    ]:
        runs = list(hdr.runs)
        runs[i] = {**runs[i], **change}
        with pytest.raises(diskfile.CorruptEntry, match=why):
            diskfile.layout(dataclasses.replace(hdr, runs=tuple(runs)))


def test_host_and_disk_pieces_share_the_ring_exactly(tmp_path):
    """Host-tier nodes take the ring too (packed by a reader: one transfer a node on a GPU):
    any dtype, empty tensors, a node of zero rows (a DCP rank may own no slot of a short tail),
    mixed with disk nodes, more nodes than buffers."""
    k = key()
    nodes = chain(k, 5, tail=3)
    DiskTier(tmp_path, k, 1 << 30).put_chain(root_hash(k), nodes[:3])  # blocks 0-2 on disk
    tier = DiskTier(tmp_path, k, 1 << 30, threads=1)
    empty = {name: t[:0] for name, t in nodes[4].rows.items()}
    pieces = pieces_of(nodes[:3]) + [Piece(3 * B, B, nodes[3].rows, "host"), Piece(4 * B, 0, empty, "host"),
                                     Piece(4 * B, 3, nodes[5].rows, "host")]
    for restorer in (Restorer(tier, pinned=False), Restorer(None, pinned=False, threads=1)):
        todo = pieces if restorer.disk is not None else pieces[3:]
        end, got = restore_all(restorer, todo)
        assert end == 4 * B + 3 and len(got) == len(todo)
        for (a, n, rows), piece, node in zip(got, todo, [*nodes[:3], nodes[3], None, nodes[5]][-len(todo):]):
            assert (a, n) == (piece.start, piece.length)
            assert same(rows, node.rows if node is not None else empty)
        assert restorer.nodes_packed == 3 and restorer.files_read == (3 if restorer.disk is not None else 0)
        restorer.close()
