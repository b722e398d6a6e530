"""The KV cache part: what a decode step keeps of the cache (eviction)."""
