"""kv_cache package."""
