"""The KV cache part: what a decode step keeps of the cache (eviction), how few bits it stores it
in (quantization), and how its pages are allocated and shared (allocator)."""
