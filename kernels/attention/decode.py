"""Decode attention: one new query token per sequence against that sequence's KV cache.

During generation each step adds one token per sequence. Its query attends to every cached key of
its own sequence, and sequences in a batch have different lengths:

    o[b, h] = sum_{j < L_b} softmax_j(q[b, h] . k[b, g(h), j] / sqrt(D)) v[b, g(h), j],
    g(h) = h // (Hq / Hkv)   (grouped-query attention: Hq / Hkv query heads share one K/V head)

Shapes:
    q            (B, Hq, D)         the new token's queries
    k_cache      (B, Hkv, S_max, D) keys, positions 0..L_b-1 of sequence b filled, the rest ignored
    v_cache      (B, Hkv, S_max, D) values, same layout
    cache_seqlens (B,) int32/int64  L_b, 0 <= L_b <= S_max
    output       (B, Hq, D)         same dtype as q; a sequence with L_b = 0 gets zeros

The kernel runs one program per (sequence, K/V head) (GQA packing). It loads the group of
Hq / Hkv query heads that share the K/V head once, then walks that sequence's cache in tiles of
BLOCK_S positions with the online softmax (running max m, running sum l, rescaled accumulator), so
each cached key and value is read once for the whole group, and only the L_b filled positions are
read at all. Per step that is 2 * L_b * Hkv * D elements of cache per sequence: decode attention is
a stream over the cache, bound by memory bandwidth (about 1 FLOP per byte in fp16 per query head).

The grid is B x Hkv programs however long the cache: 8 at batch 1 for Llama-3-8B on a GPU of 132
SMs. That suits the tiny GPT (this is the kernel its KV-cache path calls); the split-KV version
that fills a GPU at batch 1 is :mod:`kernels.attention.flash_decode`, which reuses this module's
device functions. Offsets that grow with the batch or the cache length (b * stride_b, the K/V head,
the first position of a chunk) are computed in int64.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_seqlens: torch.Tensor) -> torch.Tensor:
    """The reference in fp32 from the same inputs; returns (B, Hq, D) in q's dtype.

    Only the first max_b(L_b) cache positions are touched (the rest of a preallocated cache is
    neither read nor multiplied), so its FLOPs are those of the filled part.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    S = int(cache_seqlens.max()) if B else 0
    k_cache, v_cache = k_cache[:, :, :S], v_cache[:, :, :S]
    group = Hq // Hkv
    k = k_cache.float().repeat_interleave(group, dim=1)                 # (B, Hq, S, D)
    v = v_cache.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) / math.sqrt(D)  # (B, Hq, S)
    valid = torch.arange(S, device=q.device)[None, :] < cache_seqlens.to(q.device).long()[:, None]  # (B, S)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid[:, None, :], probs, torch.zeros_like(probs))  # L_b = 0: all-zero row, not NaN
    out = torch.einsum("bhs,bhsd->bhd", probs, v.masked_fill(~valid[:, None, :, None], 0.0))
    return out.to(q.dtype)


@triton.jit
def _kv_offset(b, hk, stride_b, stride_h):
    """Element offset of K/V head ``hk`` of sequence ``b``, in int64.

    In int32, b * stride_b wraps for real caches: a (32, 8, 131072, 128) cache has
    stride_b = 8 * 131072 * 128 = 2**27, and sequence 31 starts at 31 * 2**27 > 2**31.
    """
    return b.to(tl.int64) * stride_b + hk.to(tl.int64) * stride_h


@triton.jit
def _group_attend(
    q, k_ptr, v_ptr, n, stride_ks, stride_kd, stride_vs, stride_vd, D,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, MASK_LENGTH: tl.constexpr,
):
    """Online softmax of a group of query heads over n consecutive cache positions of one K/V head.

    q (BLOCK_G, BLOCK_D) fp32, pre-scaled by log2(e)/sqrt(D); k_ptr, v_ptr point at the first of
    the n positions (offsets computed in int64 by the caller). Each (BLOCK_S, D) tile of K and V is loaded once and serves all
    BLOCK_G query heads. Returns m (BLOCK_G,) the max score (log2 units), l (BLOCK_G,) the sum of
    exp2(score - m), acc (BLOCK_G, BLOCK_D) the sum of exp2(score - m) v; n <= 0 gives
    m = -inf, l = 0, acc = 0.
    """
    s = tl.arange(0, BLOCK_S)       # (BLOCK_S,) cache positions within one tile
    d = tl.arange(0, BLOCK_D)       # (BLOCK_D,) head dimension
    d_ok = d < D
    k_ptrs = k_ptr + s[:, None] * stride_ks + d[None, :] * stride_kd    # (BLOCK_S, BLOCK_D), small offsets
    v_ptrs = v_ptr + s[:, None] * stride_vs + d[None, :] * stride_vd
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)    # running max of the scores (log2 units)
    l = tl.zeros((BLOCK_G,), tl.float32)                  # running sum of exp2(score - m)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)        # running sum of exp2(score - m) * v
    for s0 in range(0, n, BLOCK_S):
        pos = s0 + s
        if MASK_LENGTH:
            s_ok = pos < n                                # only the filled part of the cache
        else:
            s_ok = pos < s0 + BLOCK_S                     # broken on purpose: reads the whole last tile
        kv_mask = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        # scores[g, j] = q[g] . k[j]   (BLOCK_G, BLOCK_S); a group of a few heads is too small for tl.dot
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))     # finite: the tile has at least one valid key
        alpha = tl.exp2(m - m_new)                        # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])              # (BLOCK_G, BLOCK_S)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
        k_ptrs += BLOCK_S * stride_ks                     # pointer arithmetic is 64-bit: no wrap however long
        v_ptrs += BLOCK_S * stride_vs
    return m, l, acc


@triton.jit
def _load_group_queries(q_ptr, b, hk, stride_qb, stride_qh, stride_qd, GROUP, D, scale_log2,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The GROUP query heads hk*GROUP .. hk*GROUP+GROUP-1 of sequence b, scaled: (BLOCK_G, BLOCK_D) fp32."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = hk * GROUP + g
    offs = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + offs, mask=(g < GROUP)[:, None] & (d < D)[None, :], other=0.0)
    return q.to(tl.float32) * scale_log2


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_od,
    D, GROUP, scale_log2,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_LENGTH: tl.constexpr,
):
    """One program per (sequence b, K/V head hk), grid (B, Hkv): the group's query heads over the whole cache."""
    b = tl.program_id(0)            # sequence
    hk = tl.program_id(1)           # K/V head; it serves query heads hk*GROUP .. hk*GROUP+GROUP-1
    L = tl.load(lens_ptr + b).to(tl.int32)   # filled cache positions of this sequence
    q = _load_group_queries(q_ptr, b, hk, stride_qb, stride_qh, stride_qd, GROUP, D, scale_log2, BLOCK_G, BLOCK_D)
    m, l, acc = _group_attend(q, k_ptr + _kv_offset(b, hk, stride_kb, stride_kh),
                              v_ptr + _kv_offset(b, hk, stride_vb, stride_vh), L,
                              stride_ks, stride_kd, stride_vs, stride_vd, D,
                              BLOCK_G, BLOCK_S, BLOCK_D, MASK_LENGTH)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]          # o = acc / l; L = 0: acc is 0, output 0
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    offs = b.to(tl.int64) * stride_ob + (hk * GROUP + g)[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (d < D)[None, :])


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens, name: str = "decode_attention") -> None:
    """Validate the decode-attention arguments (shared by every decode kernel); errors start with ``name``."""
    for arg, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be (B, Hq, D), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"{name}: k_cache must be (B, Hkv, S_max, D), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, S, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{name}: q is (B={B}, Hq={Hq}, D={D}) but k_cache is (B={Bk}, Hkv={Hkv}, S={S}, D={Dk})")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    for arg, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"{name}: q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if cache_seqlens.shape != (B,) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: cache_seqlens must be a (B,)=({B},) int32/int64 tensor, "
                         f"got {tuple(cache_seqlens.shape)} {cache_seqlens.dtype}")
    if B and (int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > S):
        raise ValueError(f"{name}: cache_seqlens must lie in [0, S_max={S}], got "
                         f"min {int(cache_seqlens.min())}, max {int(cache_seqlens.max())}")


def decode_grid(batch: int, kv_heads: int) -> tuple[int, int]:
    """The single-pass kernel's grid: one program per (sequence, K/V head), whatever the cache length.

    At batch 1 that is Hkv programs (8 for Llama-3-8B or Llama-2-70B) for a GPU of 132 SMs:
    :func:`kernels.attention.flash_decode` splits the cache to fill it.
    """
    return (batch, kv_heads)


def _launch(q, k_cache, v_cache, cache_seqlens, *, block_s: int, mask_length: bool) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0 or Hq == 0:
        return out
    _decode_attention_kernel[decode_grid(B, Hkv)](
        q, k_cache, v_cache, cache_seqlens, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        D, group, LOG2E / math.sqrt(D),
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D),
        MASK_LENGTH=mask_length,
    )
    return out


# The per-tile product q[:, None, :] * k[None, :, :] holds BLOCK_G x BLOCK_S x BLOCK_D fp32 values,
# spread over the 128 threads of 4 warps. Compiled (Triton 3.7.1) for sm_90a with BLOCK_D = 128:
# group 4 at BLOCK_S = 16 (8192 values) needs 168 registers per thread; group 8 at BLOCK_S = 16
# (16384 values) reaches the 255-register limit and at 32 spills to local memory (STL/LDL), at 8 it
# needs 196 (tests/test_flash_decode.py compiles these). So on a GPU the tile keeps that product at
# 8192 values; the interpreter, where each loop iteration costs time, takes 64 positions.
GPU_PRODUCT_ELEMENTS = 8192
MIN_BLOCK_S = 8


def gpu_block_s(group: int, head_dim: int) -> int:
    """BLOCK_S on a GPU: the largest power of two with next_pow2(group) * BLOCK_S * next_pow2(head_dim)
    <= GPU_PRODUCT_ELEMENTS, between MIN_BLOCK_S and 128."""
    per_position = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim)
    fits = max(1, GPU_PRODUCT_ELEMENTS // per_position)
    return max(MIN_BLOCK_S, min(128, 1 << (fits.bit_length() - 1)))      # largest power of two <= fits


def default_block_s(group: int, head_dim: int) -> int:
    """BLOCK_S for a group of ``group`` query heads of dimension ``head_dim`` on this device."""
    return 64 if runtime.runtime().interpreted else gpu_block_s(group, head_dim)


def check_block_s(block_s: int, name: str) -> None:
    if not isinstance(block_s, int) or block_s < MIN_BLOCK_S or block_s & (block_s - 1):
        raise ValueError(f"{name}: block_s must be a power of two >= {MIN_BLOCK_S}, got {block_s!r}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, *, block_s: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its first ``cache_seqlens[b]`` cached positions.

    q (B, Hq, D), k_cache and v_cache (B, Hkv, S_max, D) with Hq a multiple of Hkv, cache_seqlens (B,)
    integers in [0, S_max]; any strides. Returns (B, Hq, D) in q's dtype; zeros where the cache is empty.
    ``block_s`` (cache positions per loop iteration, a power of two >= 8) defaults to
    :func:`default_block_s`.

    The single-pass kernel: :func:`decode_grid` programs, each walking a whole cache. It is what
    the tiny GPT's KV-cache path calls (small batches of short caches, where a split would only add
    a combine); at batch 1 on a GPU it leaves most SMs idle, and
    :func:`kernels.attention.flash_decode` is the split-KV version that fills them.
    """
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    if block_s is None:
        block_s = default_block_s(q.shape[1] // k_cache.shape[1], q.shape[2])
    check_block_s(block_s, "decode_attention")
    return _launch(q, k_cache, v_cache, cache_seqlens, block_s=block_s, mask_length=True)
