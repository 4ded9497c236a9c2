"""The block hash chain (tails included), LCP matching and key separation."""
from __future__ import annotations

import dataclasses
import random

import pytest

from kv_cache import CacheKey, block_hash, chain_hashes, common_prefix
from kv_cache.keys import root_hash


def key(**kw) -> CacheKey:
    base = dict(model_revision="rev-a", kv_dtype="bfloat16", compute_dtype="bfloat16", ranks=1, rank=0,
                dcp=False, chunk_size=16, device_kind="cpu", kit_version="0.1.0")
    base.update(kw)
    return CacheKey(**base)


# ---- hash chain and LCP ---------------------------------------------------------------------
def test_chain_extension_patterns():
    k = key(chunk_size=8)
    rng = random.Random(3)
    base = [rng.randrange(50000) for _ in range(100)]  # 12 whole chunks
    h = chain_hashes(k, base)
    assert len(h) == 12 and len(set(h)) == 12
    # append: the old chain is a prefix of the new one
    assert chain_hashes(k, base + [1, 2, 3] * 10)[:12] == h
    # identical resend
    assert chain_hashes(k, list(base)) == h
    # one-word extension
    assert chain_hashes(k, base + [42])[:12] == h
    # an edit in the middle (position 50, chunk 6): chunks 0..5 match, 6 and later never do
    edited = list(base)
    edited[50] += 1
    he = chain_hashes(k, edited)
    assert he[:6] == h[:6] and all(a != b for a, b in zip(he[6:], h[6:]))
    assert common_prefix(base, edited) == 50
    # the same chunk content at another position never matches (the hash commits to the prefix)
    shifted = base[8:]
    assert not set(chain_hashes(k, shifted)) & set(h)
    assert chain_hashes(k, base, chunks=3) == h[:3]


def test_tail_hashes_commit_to_the_prefix_and_never_equal_a_block():
    k = key(chunk_size=8)
    base = list(range(1000, 1020))  # 2 blocks + a 4-token tail
    h = chain_hashes(k, base)
    assert h[0] == block_hash(root_hash(k), base[:8]) and h[1] == block_hash(h[0], base[8:16])
    tail = block_hash(h[1], base[16:20])
    assert tail not in h and tail != block_hash(h[1], base[16:20] + [0] * 4)
    assert tail != block_hash(h[0], base[16:20])  # the same tokens under another parent
    assert block_hash(h[1], base[16:19]) != tail  # a shorter tail is another node
    # extending the tail into a full block gives the chain's next hash, not the tail's
    assert chain_hashes(k, base + [5] * 4)[2] == block_hash(h[1], base[16:] + [5] * 4) != tail


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([5], [6]) == 0


@pytest.mark.parametrize("field,value", [
    ("model_revision", "rev-b"), ("kv_dtype", "float8_e4m3fn"), ("compute_dtype", "float32"),
    ("ranks", 4), ("dcp", True), ("chunk_size", 32), ("device_kind", "NVIDIA H200"),
    ("kit_version", "0.2.0"), ("extra", (("indexer", "v2"),)),
])
def test_other_key_never_matches(field, value):
    a = key(chunk_size=16)
    b = dataclasses.replace(a, **{field: value})
    tokens = list(range(256))
    ha, hb = chain_hashes(a, tokens), chain_hashes(b, tokens)
    assert a.digest() != b.digest()
    assert not set(ha) & set(hb)


def test_rank_is_part_of_the_key_and_checked():
    assert key(ranks=4, rank=1).digest() != key(ranks=4, rank=2).digest()
    with pytest.raises(ValueError, match="rank 4 outside"):
        key(ranks=4, rank=4)


def test_key_roundtrips_through_json():
    k = key(extra=(("a", "b"),))
    assert CacheKey.from_json(k.to_json()) == k
