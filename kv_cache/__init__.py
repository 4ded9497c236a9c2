"""Incremental prefix cache: token-granular exact reuse over a block hash chain, host tier,
disk tier.

See docs/prefix-cache.md for the storage and lookup design and for why reuse is bitwise exact."""
from .cache import CacheConfigError, PrefixCache, Stats
from .disk import DiskTier
from .hit import Hit, Piece
from .keys import CacheKey, block_hash, chain_hashes, common_prefix, model_revision
from .node import Node
from .rows import Rows, rows_equal
from .store import HostStore

__all__ = ["CacheConfigError", "CacheKey", "DiskTier", "Hit", "HostStore", "Node", "Piece", "PrefixCache",
           "Rows", "Stats", "block_hash", "chain_hashes", "common_prefix", "model_revision",
           "rows_equal"]
