"""Flash decoding: split the KV sequence of a decode step across programs, then merge exactly.

A decode step has one query row per (sequence, query head). In one pass, decode attention gives
each (sequence, K/V head) one program that walks the whole cache: B * Hkv programs, far fewer than
a GPU's SMs when the batch is small, however long the cache. Flash decoding (Dao,
Haziza, Massa and Sizov, 2023) also splits the cache of length L into ``num_splits`` chunks, gives
each chunk its own program, and merges the partial results in a second, small kernel:

    split s over positions J_s:   m_s = max_{j in J_s} x_j,   l_s = sum_{j in J_s} exp(x_j - m_s),
                                  o_s = sum_{j in J_s} exp(x_j - m_s) v_j / l_s
    combine:                      m = max_s m_s,   w_s = l_s exp(m_s - m),   l = sum_s w_s,
                                  o = sum_s w_s o_s / l

The combine is :func:`kernels.softmax.merge_softmax_stats` applied across splits (with the
partial outputs carried along by the same weights), so the result is the exact softmax, not an
approximation; :func:`combine_ref` writes it as that fold. A split with no positions (a short
sequence, or L = 0) has m = -inf, l = 0, o = 0 and drops out of the merge.

FlashDecoding++ (Hong et al., 2023) removes the running max: every split uses one *unified* max
phi fixed ahead of time (from statistics of typical scores), so no split rescales and the combine
is a plain sum. It is exact as long as no score exceeds phi by more than the exponent range
allows; a split that sees a score outside [phi + LOW, phi + HIGH] raises a flag and its whole
sequence is recomputed with the safe method (:func:`flash_decode_unified_max`).

Where the code lives: the split kernel, the combine kernel, :func:`choose_num_splits` and the
grids are :mod:`kernels.attention.decode`'s, because ``decode_attention(..., num_splits=None)``
itself splits the cache when the batch is too small to fill the GPU (B x Hkv x splits programs,
each packing the Hq / Hkv query heads of a K/V group so that every K/V tile it loads serves the
whole group). For Llama-3-8B's 8 K/V heads on an H100's 132 SMs and a 32k cache that is 64 splits
and 512 programs where the single pass launches 8. This module is the chapter's side: the PyTorch
references, :func:`flash_decode` (the split kernel and the combine, with the split count given or
chosen), and the FlashDecoding++ variant with its fallback.

Shapes: q (B, Hq, D); k_cache, v_cache (B, Hkv, S_max, D); cache_seqlens (B,) integers in
[0, S_max]; output (B, Hq, D) in q's dtype, zeros for an empty cache (as decode_attention).
"""
from __future__ import annotations

import math

import torch

from kernels.attention.decode import check_decode_inputs, combine, resolve_launch, split_attention, split_partials
from kernels.softmax import merge_softmax_stats

# FlashDecoding++ fallback window, in natural-log units of (score - phi): exp(score - phi) stays
# within fp32 (exp(80) ~ 5.5e34, times up to 2**20 positions stays below 3.4e38) and a row whose
# largest score sits 80 below phi would underflow its sum toward zero. Outside it: fall back.
UNIFIED_LOW = -80.0
UNIFIED_HIGH = 80.0


# ----------------------------------------------------------------------------------------------
# References


def flash_decode_ref(q, k_cache, v_cache, cache_seqlens):
    """Decode attention over the first ``cache_seqlens[b]`` positions, in fp32 (float64 kept), returned wide.

    The same mathematics as :func:`kernels.attention.decode_attention_ref` (which returns q's dtype).
    """
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.to(wide).repeat_interleave(Hq // Hkv, dim=1)            # (B, Hq, S, D)
    v = v_cache.to(wide).repeat_interleave(Hq // Hkv, dim=1)
    valid = torch.arange(S, device=q.device)[None, :] < cache_seqlens.long()[:, None]   # (B, S)
    s = torch.einsum("bhd,bhsd->bhs", q.to(wide), k) / math.sqrt(D)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s.masked_fill(~valid.any(1)[:, None, None], 0.0), dim=-1)
    p = p * valid[:, None, :]                                           # empty cache: all-zero row
    return torch.einsum("bhs,bhsd->bhd", p, v.masked_fill(~valid[:, None, :, None], 0.0))


def split_ref(q, k_cache, v_cache, cache_seqlens, num_splits):
    """The split step in PyTorch: per split s the partial (m_s, l_s, o_s), shapes (B, Hq, S) and (B, Hq, S, D).

    Sequence b's positions 0..L_b-1 are cut into ``num_splits`` chunks of ceil(L_b / num_splits).
    """
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    k = k_cache.to(wide).repeat_interleave(Hq // Hkv, dim=1)
    v = v_cache.to(wide).repeat_interleave(Hq // Hkv, dim=1)
    m = torch.full((B, Hq, num_splits), float("-inf"), dtype=wide, device=q.device)
    l = torch.zeros((B, Hq, num_splits), dtype=wide, device=q.device)
    o = torch.zeros((B, Hq, num_splits, D), dtype=wide, device=q.device)
    for b in range(B):
        L = int(cache_seqlens[b])
        chunk = -(-L // num_splits) if L else 0
        for s in range(num_splits):
            lo, hi = s * chunk, min((s + 1) * chunk, L)
            if hi <= lo:
                continue
            x = torch.einsum("hd,hsd->hs", q[b].to(wide), k[b, :, lo:hi]) / math.sqrt(D)   # (Hq, n)
            m_s = x.amax(-1)
            e = torch.exp(x - m_s[:, None])
            m[b, :, s], l[b, :, s] = m_s, e.sum(-1)
            o[b, :, s] = torch.einsum("hs,hsd->hd", e, v[b, :, lo:hi]) / e.sum(-1, keepdim=True)
    return m, l, o


def combine_ref(m, l, o):
    """Merge the splits: fold :func:`merge_softmax_stats` over s, carrying the outputs along.

    m, l (..., S); o (..., S, D). Returns (..., D); a row whose splits are all empty gives 0.
    """
    M = torch.full_like(m[..., :1], float("-inf"))      # running (max, sum) of the merged splits
    Lsum = torch.zeros_like(l[..., :1])
    acc = torch.zeros_like(o[..., 0, :])                # running sum of l_s exp(m_s - M) o_s
    for s in range(m.shape[-1]):
        M_new, Lsum = merge_softmax_stats(M, Lsum, m[..., s:s + 1], l[..., s:s + 1])
        safe = torch.where(torch.isneginf(M_new), torch.zeros_like(M_new), M_new)
        acc = acc * torch.exp(M - safe) + (l[..., s:s + 1] * torch.exp(m[..., s:s + 1] - safe)) * o[..., s, :]
        M = M_new
    return acc / torch.where(Lsum > 0, Lsum, torch.ones_like(Lsum))


# ----------------------------------------------------------------------------------------------
# Entries (the kernels are kernels.attention.decode's)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                 num_splits: int | None = None, *, block_s: int | None = None) -> torch.Tensor:
    """Split-KV decode attention: ``num_splits`` programs per (sequence, K/V head), then the combine.

    Same inputs and result as :func:`kernels.attention.decode_attention`, but always through the split
    kernel and the combine, even for one split (decode attention itself plus a trivial combine).
    ``num_splits`` defaults to :func:`kernels.attention.decode.default_num_splits` (this GPU's SM
    count; 1 under the interpreter); ``block_s`` to the decode kernel's tile.
    """
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, "flash_decode")
    num_splits, block_s = resolve_launch(q, k_cache, cache_seqlens, num_splits, block_s, "flash_decode")
    return split_attention(q, k_cache, v_cache, cache_seqlens, num_splits, block_s=block_s)


def flash_decode_unified_max(q, k_cache, v_cache, cache_seqlens, num_splits: int = 4, *, phi: float = 0.0,
                             block_s: int | None = None, fallback: bool = True, return_fallbacks: bool = False):
    """FlashDecoding++'s asynchronous softmax: every split uses the fixed max ``phi`` (natural-log units
    of the scaled score q.k/sqrt(D)), so no split rescales and partials simply add.

    A split that sees a score outside [phi + UNIFIED_LOW, phi + UNIFIED_HIGH] flags its
    (sequence, K/V head); with ``fallback`` (the default) every flagged sequence is recomputed with
    :func:`flash_decode` (the running-max method). ``fallback=False`` exists to show what goes wrong.
    With ``return_fallbacks`` also returns the (B,) bool tensor of sequences that fell back.
    """
    name = "flash_decode_unified_max"
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, name)
    if not math.isfinite(phi):
        raise ValueError(f"{name}: phi must be finite, got {phi}")
    num_splits, block_s = resolve_launch(q, k_cache, cache_seqlens, num_splits, block_s, name)
    m, l, o, flags = split_partials(q, k_cache, v_cache, cache_seqlens, num_splits, block_s=block_s,
                                    unified=(phi, UNIFIED_LOW, UNIFIED_HIGH))
    # every split's m is phi (or -inf when empty): the combine's weights e^{m_s - m} are all 1, a plain sum
    out = combine(m, l, o, out_dtype=q.dtype)
    fell = flags.flatten(1).any(dim=1)                       # (B,)
    if fallback and bool(fell.any()):
        idx = fell.nonzero().flatten()
        out[idx] = flash_decode(q[idx], k_cache[idx], v_cache[idx], cache_seqlens[idx], num_splits, block_s=block_s)
    return (out, fell) if return_fallbacks else out
