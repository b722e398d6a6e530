"""Grouped-query and multi-query attention: KV cache sizes, and converting a checkpoint's K/V heads.

With Hq query heads and Hkv key/value heads, query head h reads K/V head h // (Hq / Hkv)
(``kernels.attention.flash_attention`` and ``decode_attention`` take the Hkv heads as they are, never
repeated in memory). Hkv = Hq is MHA, Hkv = 1 is MQA (Shazeer 2019), anything between is GQA
(Ainslie et al. 2023).

The KV cache of a decoder holds, per layer, K and V for every cached position:

    bytes = 2 (K and V) * n_layer * Hkv * head_dim * positions * batch * bytes per element

so it shrinks by Hq / Hkv against MHA. Ainslie et al. convert an MHA checkpoint to GQA by
**mean-pooling** the key and value projection heads of each group, then continue training briefly
("uptraining"). :func:`mean_pool_kv_heads` does the pooling on a projection weight; the surgery on a
whole tiny GPT (pooling, or repeating heads to go back to MHA) is in :mod:`kernels.model.surgery`.
"""
from __future__ import annotations

import torch


def kv_cache_bytes(n_layer: int, n_kv_head: int, head_dim: int, positions: int, batch: int = 1,
                   bytes_per_element: int = 2) -> int:
    """Bytes of a KV cache: 2 * n_layer * n_kv_head * head_dim * positions * batch * bytes_per_element."""
    for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                      ("bytes_per_element", bytes_per_element)):
        if val < 1:
            raise ValueError(f"kv_cache_bytes: {name} must be >= 1, got {val}")
    if positions < 0 or batch < 0:
        raise ValueError(f"kv_cache_bytes: positions and batch must be >= 0, got {positions}, {batch}")
    return 2 * n_layer * n_kv_head * head_dim * positions * batch * bytes_per_element


def mean_pool_kv_heads(weight: torch.Tensor, n_kv_head: int, new_kv_head: int) -> torch.Tensor:
    """A K or V projection weight (n_kv_head * D, C) -> (new_kv_head * D, C), each new head the mean
    of the n_kv_head / new_kv_head consecutive old heads it replaces."""
    if weight.dim() != 2 or weight.shape[0] % n_kv_head:
        raise ValueError(f"mean_pool_kv_heads: weight must be (n_kv_head * D, C) with n_kv_head={n_kv_head}, "
                         f"got {tuple(weight.shape)}")
    if new_kv_head < 1 or n_kv_head % new_kv_head:
        raise ValueError(f"mean_pool_kv_heads: new_kv_head={new_kv_head} must divide n_kv_head={n_kv_head}")
    D, C = weight.shape[0] // n_kv_head, weight.shape[1]
    group = n_kv_head // new_kv_head
    return weight.reshape(new_kv_head, group, D, C).mean(dim=1).reshape(new_kv_head * D, C)


def kv_heads_per_gpu(n_kv_head: int, tp: int) -> tuple[int, int]:
    """(K/V heads each GPU holds, copies of each K/V head) under tensor parallelism of degree ``tp``.

    Query heads are split evenly over the GPUs; K/V heads too while there are enough (Hkv / tp each,
    one copy). Once tp exceeds Hkv each GPU still needs the K/V head its query heads read, so every
    K/V head is replicated on tp / Hkv GPUs (vLLM's QKVParallelLinear: num_kv_head_replicas =
    tp / Hkv, K/V shard = tp_rank // replicas; vllm-project/vllm@9e109c98)."""
    if n_kv_head < 1 or tp < 1:
        raise ValueError(f"kv_heads_per_gpu: n_kv_head and tp must be >= 1, got {n_kv_head}, {tp}")
    if tp >= n_kv_head:
        if tp % n_kv_head:
            raise ValueError(f"kv_heads_per_gpu: tp={tp} must be a multiple of n_kv_head={n_kv_head} to replicate evenly")
        return 1, tp // n_kv_head
    if n_kv_head % tp:
        raise ValueError(f"kv_heads_per_gpu: n_kv_head={n_kv_head} must be a multiple of tp={tp}")
    return n_kv_head // tp, 1
