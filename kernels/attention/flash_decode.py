"""Flash decoding: split the KV sequence of a decode step across programs, then merge exactly.

A decode step has one query row per (sequence, query head). :func:`kernels.attention.decode_attention`
gives each (sequence, K/V head) one program that walks the whole cache: B * Hkv programs, far
fewer than a GPU's SMs when the batch is small, however long the cache. Flash decoding (Dao,
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

Grid: the split kernel runs B x Hkv x num_splits programs (:func:`split_grid`), each packing the
Hq / Hkv query heads of a K/V group so that every K/V tile it loads serves the whole group (the
chunk loop is :mod:`kernels.attention.decode`'s own). :func:`choose_num_splits`, a pure function of
(B, Hkv, cache length, SM count), picks enough splits for about 4 programs per SM at batch 1: for
Llama-3-8B's 8 K/V heads on an H100's 132 SMs and a 32k cache, 64 splits and 512 programs where
decode_attention launches 8. ``flash_decode(..., num_splits=None)`` asks it with this device's SM count.

Shapes: q (B, Hq, D); k_cache, v_cache (B, Hkv, S_max, D); cache_seqlens (B,) integers in
[0, S_max]; output (B, Hq, D) in q's dtype, zeros for an empty cache (as decode_attention).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention.decode import (LOG2E, _group_attend, _kv_offset, _load_group_queries, check_block_s,
                                      check_decode_inputs, default_block_s)
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
# Kernels


@triton.jit
def _flash_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, mpart_ptr, lpart_ptr, opart_ptr, flag_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    Hq, D, GROUP, NUM_SPLITS, scale_log2, phi_log2, low_log2, high_log2,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, UNIFIED: tl.constexpr,
):
    """One program per (sequence b, K/V head, split s), grid (B, Hkv, NUM_SPLITS): the group's
    query heads over chunk s (GQA packing: each K/V tile is loaded once for the whole group).

    UNIFIED=False: online softmax (running max), the decode kernel's own loop. UNIFIED=True
    (FlashDecoding++): the max is the fixed phi, no rescaling; a score outside
    [phi + low, phi + high] sets flag[b, hk, s].
    Writes m_s, l_s (B*Hq, NUM_SPLITS) and the normalised o_s (B*Hq, NUM_SPLITS, D), all fp32,
    with m in natural-log units.
    """
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(L, NUM_SPLITS)                        # this sequence's chunk length
    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)                        # lo >= hi: an empty split (a short sequence's tail)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < D
    q = _load_group_queries(q_ptr, b, hk, stride_qb, stride_qh, stride_qd, GROUP, D, scale_log2, BLOCK_G, BLOCK_D)
    k_head = k_ptr + _kv_offset(b, hk, stride_kb, stride_kh)
    v_head = v_ptr + _kv_offset(b, hk, stride_vb, stride_vh)
    if UNIFIED:
        m = tl.full((BLOCK_G,), phi_log2, tl.float32)     # fixed ahead: never updated
        l = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        out_of_range = tl.zeros((BLOCK_G,), tl.int32)
        s_idx = tl.arange(0, BLOCK_S)
        for s0 in range(lo, hi, BLOCK_S):
            pos = s0 + s_idx
            s_ok = pos < hi
            kv_mask = s_ok[:, None] & d_ok[None, :]
            k = tl.load(k_head + pos[:, None].to(tl.int64) * stride_ks + d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_head + pos[:, None].to(tl.int64) * stride_vs + d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0).to(tl.float32)
            x = tl.sum(q[:, None, :] * k[None, :, :], axis=2)             # scores, log2 units (BLOCK_G, BLOCK_S)
            x = tl.where(s_ok[None, :], x, float("-inf"))
            blk_max = tl.max(x, axis=1)
            bad = (blk_max > phi_log2 + high_log2) | (blk_max < phi_log2 + low_log2)
            out_of_range = out_of_range | bad.to(tl.int32)
            p = tl.exp2(x - phi_log2)                                    # exp(x - phi): no max, no rescale
            l = l + tl.sum(p, axis=1)
            acc = acc + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    else:
        first = lo.to(tl.int64)                               # lo * stride_ks passes 2**31 in a (B, S, H, D) layout
        m, l, acc = _group_attend(q, k_head + first * stride_ks, v_head + first * stride_vs, hi - lo,
                                  stride_ks, stride_kd, stride_vs, stride_vd, D, BLOCK_G, BLOCK_S, BLOCK_D, True)
    empty = hi <= lo
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    m_out = tl.where(empty, float("-inf"), m * 0.6931471805599453)       # natural-log units; empty split: -inf
    rows = b.to(tl.int64) * Hq + hk * GROUP + g                          # (BLOCK_G,) rows of (B*Hq)
    tl.store(mpart_ptr + rows * NUM_SPLITS + split, m_out, mask=g_ok)
    tl.store(lpart_ptr + rows * NUM_SPLITS + split, l, mask=g_ok)
    tl.store(opart_ptr + (rows[:, None] * NUM_SPLITS + split) * D + d[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
    if UNIFIED:
        tl.store(flag_ptr + (b.to(tl.int64) * (Hq // GROUP) + hk) * NUM_SPLITS + split, tl.max(out_of_range, axis=0))


@triton.jit
def _flash_decode_combine_kernel(
    mpart_ptr, lpart_ptr, opart_ptr, o_ptr,
    stride_ob, stride_oh, stride_od,
    Hq, D, NUM_SPLITS,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head): o = sum_s l_s e^{m_s - m} o_s / sum_s l_s e^{m_s - m}."""
    row = tl.program_id(0).to(tl.int64)     # row * NUM_SPLITS * D grows with the batch: int64
    b = row // Hq
    h = row % Hq
    s = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    m_s = tl.load(mpart_ptr + row * NUM_SPLITS + s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(lpart_ptr + row * NUM_SPLITS + s, mask=s_ok, other=0.0)
    o_s = tl.load(opart_ptr + (row * NUM_SPLITS + s[:, None]) * D + d[None, :],
                  mask=s_ok[:, None] & (d < D)[None, :], other=0.0)           # (BLOCK_SPLITS, BLOCK_D)
    m = tl.max(m_s, axis=0)                                                    # m = max_s m_s
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = l_s * tl.exp(m_s - m_safe)                                             # w_s = l_s e^{m_s - m}
    l = tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * o_s, axis=0) / tl.where(l > 0, l, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d * stride_od, o.to(o_ptr.dtype.element_ty), mask=d < D)


# ----------------------------------------------------------------------------------------------
# Launchers


def _check_inputs(q, k_cache, v_cache, cache_seqlens, num_splits, name) -> None:
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, name)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{name}: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")


def split_grid(batch: int, kv_heads: int, num_splits: int) -> tuple[int, int, int]:
    """The split kernel's grid: one program per (sequence, K/V head, split). The combine adds
    batch * Hq small programs after it."""
    return (batch, kv_heads, num_splits)


def _split(q, k_cache, v_cache, cache_seqlens, num_splits, *, block_s, unified=False, phi=0.0):
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    m = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    o = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    flags = torch.zeros((B, Hkv, num_splits), dtype=torch.int32, device=q.device)
    _flash_decode_split_kernel[split_grid(B, Hkv, num_splits)](
        q, k_cache, v_cache, cache_seqlens, m, l, o, flags,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        Hq, D, group, num_splits, LOG2E / math.sqrt(D), phi * LOG2E, UNIFIED_LOW * LOG2E, UNIFIED_HIGH * LOG2E,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D),
        UNIFIED=unified,
    )
    return m, l, o, flags


def combine(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, out_dtype=torch.float32) -> torch.Tensor:
    """The combine kernel: (m, l) (B, Hq, S) and o (B, Hq, S, D), fp32 contiguous -> (B, Hq, D)."""
    if m.dim() != 3 or l.shape != m.shape or o.shape[:3] != m.shape or o.dim() != 4:
        raise ValueError(f"combine: expected m, l (B, Hq, S) and o (B, Hq, S, D), got {tuple(m.shape)}, "
                         f"{tuple(l.shape)}, {tuple(o.shape)}")
    if any(t.dtype != torch.float32 for t in (m, l, o)):
        raise TypeError("combine: m, l, o must be float32 (the split step's partials)")
    m, l, o = m.contiguous(), l.contiguous(), o.contiguous()
    B, Hq, S, D = o.shape
    out = torch.empty((B, Hq, D), dtype=out_dtype, device=o.device)
    if B * Hq:
        _flash_decode_combine_kernel[(B * Hq,)](
            m, l, o, out, *out.stride(), Hq, D, S,
            BLOCK_SPLITS=triton.next_power_of_2(S), BLOCK_D=triton.next_power_of_2(D),
        )
    return out


def _resolve(q, k_cache, cache_seqlens, num_splits, block_s, name):
    """Fill in the defaults: splits from :func:`choose_num_splits` on this device, the decode kernel's tile."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if num_splits is None:
        longest = int(cache_seqlens.max()) if B else 0
        num_splits = choose_num_splits(max(B, 1), Hkv, longest, device_sms(q.device))
    if block_s is None:
        block_s = default_block_s(Hq // Hkv, D)
    check_block_s(block_s, name)
    return num_splits, block_s


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                 num_splits: int | None = None, *, block_s: int | None = None) -> torch.Tensor:
    """Split-KV decode attention: ``num_splits`` programs per (sequence, K/V head), then the combine.

    Same inputs and result as :func:`kernels.attention.decode_attention`; GQA heads of a group share
    each load of K and V. ``num_splits`` defaults to :func:`choose_num_splits` for this device's SM
    count (one "SM" under the interpreter, which runs programs one after another); ``num_splits=1`` is
    decode attention itself plus a trivial combine. ``block_s`` defaults to the decode kernel's tile.
    """
    if num_splits is not None:
        _check_inputs(q, k_cache, v_cache, cache_seqlens, num_splits, "flash_decode")
    else:
        check_decode_inputs(q, k_cache, v_cache, cache_seqlens, "flash_decode")
    num_splits, block_s = _resolve(q, k_cache, cache_seqlens, num_splits, block_s, "flash_decode")
    if q.shape[0] * q.shape[1] == 0:
        return torch.zeros_like(q)
    m, l, o, _ = _split(q, k_cache, v_cache, cache_seqlens, num_splits, block_s=block_s)
    return combine(m, l, o, out_dtype=q.dtype)


def flash_decode_unified_max(q, k_cache, v_cache, cache_seqlens, num_splits: int = 4, *, phi: float = 0.0,
                             block_s: int | None = None, fallback: bool = True, return_fallbacks: bool = False):
    """FlashDecoding++'s asynchronous softmax: every split uses the fixed max ``phi`` (natural-log units
    of the scaled score q.k/sqrt(D)), so no split rescales and partials simply add.

    A split that sees a score outside [phi + UNIFIED_LOW, phi + UNIFIED_HIGH] flags its
    (sequence, K/V head); with ``fallback`` (the default) every flagged sequence is recomputed with
    :func:`flash_decode` (the running-max method). ``fallback=False`` exists to show what goes wrong.
    With ``return_fallbacks`` also returns the (B,) bool tensor of sequences that fell back.
    """
    _check_inputs(q, k_cache, v_cache, cache_seqlens, num_splits, "flash_decode_unified_max")
    if not math.isfinite(phi):
        raise ValueError(f"flash_decode_unified_max: phi must be finite, got {phi}")
    num_splits, block_s = _resolve(q, k_cache, cache_seqlens, num_splits, block_s, "flash_decode_unified_max")
    B = q.shape[0]
    if B * q.shape[1] == 0:
        out, fell = torch.zeros_like(q), torch.zeros(B, dtype=torch.bool, device=q.device)
        return (out, fell) if return_fallbacks else out
    m, l, o, flags = _split(q, k_cache, v_cache, cache_seqlens, num_splits, block_s=block_s, unified=True, phi=phi)
    # every split's m is phi (or -inf when empty): the combine's weights e^{m_s - m} are all 1, a plain sum
    out = combine(m, l, o, out_dtype=q.dtype)
    fell = flags.flatten(1).any(dim=1)                       # (B,)
    if fallback and bool(fell.any()):
        idx = fell.nonzero().flatten()
        out[idx] = flash_decode(q[idx], k_cache[idx], v_cache[idx], cache_seqlens[idx], num_splits, block_s=block_s)
    return (out, fell) if return_fallbacks else out


# ----------------------------------------------------------------------------------------------
# How many splits

# The choice below, and why (a design, not a measurement; no GPU timing was run here):
# * WAVES: a decode program is 4 warps streaming K/V; an SM holds several such programs at once
#   (sm90: 64 resident warps), and a memory-bound stream needs many loads in flight per SM. Aim for
#   at least 4 programs per SM, i.e. B * Hkv * s >= 4 * SMs.
# * MIN_CHUNK: each split writes, and the combine reads back, group * (D + 2) fp32 values per K/V
#   head, about 8 * group * D bytes, against the 4 * chunk * D bytes of fp16 K and V it reads: a
#   fraction 2 * group / chunk. A chunk of at least 256 positions keeps that below 1/16 for groups
#   up to 8 (vLLM's paged attention v2 uses 512-token partitions: vllm-project/vllm@cc17020a,
#   csrc/attention/paged_attention_v2.cu, PARTITION_SIZE).
# * MAX_SPLITS: the combine holds a (next_pow2(s), next_pow2(D)) fp32 tile per program; 64 splits at
#   D = 128 compile without spills (tests/test_flash_decode.py).
# For comparison, FlashAttention-2's heuristic (Dao-AILab/flash-attention@765fbd92, csrc/flash_attn/
# flash_api.cpp, num_splits_heuristic) counts batch * query heads * query blocks, uses 1 split once
# that reaches 0.8 * SMs, caps at min(64, SMs, key blocks of 128 at D = 128) and takes the fewest
# splits whose last-wave efficiency is within 85% of the best.
WAVES = 4
MIN_CHUNK = 256
MAX_SPLITS = 64


def choose_num_splits(batch: int, kv_heads: int, cache_len: int, sms: int, *, waves: int = WAVES,
                      min_chunk: int = MIN_CHUNK, max_splits: int = MAX_SPLITS) -> int:
    """The number of splits s for a decode step: the fewest with batch * kv_heads * s >= waves * sms
    programs, but no chunk shorter than ``min_chunk`` positions and at most ``max_splits``.

    A pure function of its arguments (the launcher passes the device's SM count); 1 when the batch
    alone fills the GPU or the cache is too short to split.
    """
    for arg, val in (("batch", batch), ("kv_heads", kv_heads), ("sms", sms), ("waves", waves),
                     ("min_chunk", min_chunk), ("max_splits", max_splits)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"choose_num_splits: {arg} must be an int >= 1, got {val!r}")
    if not isinstance(cache_len, int) or cache_len < 0:
        raise ValueError(f"choose_num_splits: cache_len must be an int >= 0, got {cache_len!r}")
    programs = batch * kv_heads
    want = -(-waves * sms // programs)                 # ceil(waves * sms / programs)
    longest = cache_len // min_chunk                   # s <= L / min_chunk: every chunk >= min_chunk
    return max(1, min(want, longest, max_splits))


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 1 for the CPU, where the interpreter runs one program at a time."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
