"""Serving: a small inference engine for the course's tiny GPT.

allocator (pages of KV cache with reference counts), engine (paged forward of a mixed batch; speculative
decoding with a drafter from kernels.speculative.serving),
scheduler (continuous batching, chunked prefill, preemption), radix_cache (prefix reuse),
rolling_cache (sliding-window ring buffer), simulate (event simulation of the policies),
server (an OpenAI-compatible HTTP endpoint), loadtest (requests/s and time to first token),
cuda_graphs (the decode step's launches counted, padded to batch-size buckets, captured on a GPU).
"""
