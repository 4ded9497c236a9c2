"""Incremental prefix cache: fixed position grid, chunk hash chain, host tier, disk tier.

See kv_cache/DESIGN.md for why reuse is bitwise exact."""
from .cache import CacheConfigError, Hit, PrefixCache, Stats
from .disk import DiskTier
from .grid import Grid, ResumePlan
from .keys import CacheKey, chain_hashes, common_prefix, model_revision
from .rows import Rows, rows_equal
from .store import HostStore

__all__ = ["CacheConfigError", "CacheKey", "DiskTier", "Grid", "Hit", "HostStore", "PrefixCache",
           "ResumePlan", "Rows", "Stats", "chain_hashes", "common_prefix", "model_revision", "rows_equal"]
