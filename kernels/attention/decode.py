"""Decode attention: one new query token (or a few) per sequence against that sequence's KV cache.

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

Every program packs a GQA group: it loads the Hq / Hkv query heads that share a K/V head once, as
the rows of a (BLOCK_G, D) tile padded to at least 16 rows, then walks cache positions in tiles of
BLOCK_S with the online softmax (running max m, running sum l, rescaled accumulator). Both products,
S = q K^T (BLOCK_G, BLOCK_S) and acc += P V (BLOCK_G, D), run on the tensor cores with the group on
their M axis (FlashAttention-2's decode path and FlashInfer's tensor-core decode do the same), so each
cached key and value is read once for the whole group, only the L_b filled positions are read at all,
and the registers hold two MMA accumulators, not a group x BLOCK_S x D product. Per step that is
2 * L_b * Hkv * D elements of cache per sequence: decode attention is a stream over the cache, bound
by memory bandwidth (about 1 FLOP per byte in fp16 per query head; the padding rows of a small group
multiply zeros on tensor cores that would otherwise idle).

Several new queries per sequence (a speculative verification of T - 1 drafts, a prefill chunk of T
tokens against a cache): q (B, Hq, T, D), whose keys are already written at the cache's last T
positions, so query t of sequence b sees keys 0 .. L_b - T + t (causal within the new queries):

    o[b, h, t] = sum_{j <= L_b - T + t} softmax_j(q[b, h, t] . k[b, g(h), j] / sqrt(D)) v[b, g(h), j]

The program's tile rows become the T * Hq / Hkv (new query, group head) pairs (:func:`_tile_rows`),
each with its own causal end (:func:`_causal_end`), so every K/V tile still serves all of them; at
Llama-3-8B's group of 4 a verification of 3 drafts fills the 16 rows the one-query tile pads to.

Two launches, picked by ``num_splits``:

* one split: the single-pass kernel, one program per (sequence, K/V head), grid B x Hkv
  (:func:`decode_grid`). At batch 1 that is 8 programs for Llama-3-8B on a GPU of 132 SMs.
* s > 1 splits (flash decoding, :mod:`kernels.attention.flash_decode` derives it): the cache of
  sequence b is cut into s chunks of ceil(L_b / s) positions, one program per (sequence, K/V head,
  chunk) (:func:`split_grid`), each writing its partial (m_s, l_s, o_s); a combine kernel, one
  program per (sequence, query head), merges them exactly:
      m = max_s m_s,   w_s = l_s exp(m_s - m),   o = sum_s w_s o_s / sum_s w_s.

``num_splits=None`` asks :func:`choose_num_splits` (a pure function of batch, Hkv, cache length and
SM count) with this GPU's SM count: 64 splits, 512 programs for Llama-3-8B at batch 1 and a 32k
cache; 1 split once the batch fills the GPU or the cache is shorter than two chunks of MIN_CHUNK.
Under the interpreter it is always 1 split (programs run one after another there, so a split only
adds the partials and the combine: the tiny GPT's KV-cache path stays one kernel). Offsets that
grow with the batch or the cache length (b * stride_b, the K/V head, the first position of a chunk)
are computed in int64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_seqlens: torch.Tensor) -> torch.Tensor:
    """The reference in fp32 from the same inputs; returns q's shape, (B, Hq, D) or (B, Hq, T, D), in q's dtype.

    q (B, Hq, T, D) holds T new queries per sequence, the last T positions of its cache: query t of
    sequence b sits at position L_b - T + t and sees keys 0 .. L_b - T + t (causal within the new
    queries; T = 1 is the one-query case). Only the first max_b(L_b) cache positions are touched
    (the rest of a preallocated cache is neither read nor multiplied).
    """
    one = q.dim() == 3
    q4 = q[:, :, None] if one else q                                    # (B, Hq, T, D)
    B, Hq, T, D = q4.shape
    Hkv = k_cache.shape[1]
    S = int(cache_seqlens.max()) if B else 0
    k_cache, v_cache = k_cache[:, :, :S], v_cache[:, :, :S]
    group = Hq // Hkv
    k = k_cache.float().repeat_interleave(group, dim=1)                 # (B, Hq, S, D)
    v = v_cache.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", q4.float(), k) / math.sqrt(D)   # (B, Hq, T, S)
    lens = cache_seqlens.to(q.device).long()
    last = lens[:, None] - T + torch.arange(T, device=q.device)[None, :]      # (B, T) position of query t
    valid = torch.arange(S, device=q.device)[None, None, :] <= last[:, :, None]   # (B, T, S) key j <= position
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid[:, None], probs, torch.zeros_like(probs))  # L_b = 0: all-zero row, not NaN
    filled = torch.arange(S, device=q.device)[None, :] < lens[:, None]        # (B, S): slots past L_b may hold NaN
    out = torch.einsum("bhts,bhsd->bhtd", probs, v.masked_fill(~filled[:, None, :, None], 0.0))
    return (out[:, :, 0] if one else out).to(q.dtype)


@triton.jit
def _kv_offset(b, hk, stride_b, stride_h):
    """Element offset of K/V head ``hk`` of sequence ``b``, in int64.

    In int32, b * stride_b wraps for real caches: a (32, 8, 131072, 128) cache has
    stride_b = 8 * 131072 * 128 = 2**27, and sequence 31 starts at 31 * 2**27 > 2**31.
    """
    return b.to(tl.int64) * stride_b + hk.to(tl.int64) * stride_h


@triton.jit
def _kv_tile(k_ptrs, v_ptrs, s_ok, d_ok):
    """One (BLOCK_S, BLOCK_D) tile of K and of V in the cache's dtype; positions with s_ok False read as 0."""
    kv_mask = s_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _group_attend(
    q, k_ptr, v_ptr, n, row_end, stride_ks, stride_kd, stride_vs, stride_vd, D, scale_log2,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_LENGTH: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Online softmax of a group of query heads over n consecutive cache positions of one K/V head.

    q (BLOCK_G, BLOCK_D) in the cache's dtype, unscaled, its rows past the group zero: the group is
    the M axis of both tensor-core products, S = q K^T and acc += P V. k_ptr, v_ptr point at the first
    of the n positions (offsets computed in int64 by the caller). Each (BLOCK_S, D) tile of K and V is
    loaded once and serves every query head of the group. Returns m (BLOCK_G,) the max score (log2
    units), l (BLOCK_G,) the sum of exp2(score - m), acc (BLOCK_G, BLOCK_D) fp32 the sum of
    exp2(score - m) v; n <= 0 gives m = -inf, l = 0, acc = 0.

    CAUSAL (several new queries, :func:`_tile_rows`): row r also sees only positions below
    row_end[r] (BLOCK_G,), counted from k_ptr; a row that sees none of the n keys keeps m = -inf,
    l = 0, acc = 0 (a split that lies wholly after that query). Without CAUSAL row_end is unused.
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
        k, v = _kv_tile(k_ptrs, v_ptrs, s_ok, d_ok)
        # scores[g, j] = q[g] . k[j] / sqrt(D) in log2 units: (BLOCK_G, BLOCK_S), one MMA over the group
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            ok = s_ok[None, :] & (pos[None, :] < row_end[:, None])   # (BLOCK_G, BLOCK_S): key pos before row r's end
            scores = tl.where(ok, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))  # -inf for a row that has seen no key yet
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)   # there exp2(-inf - 0) = 0, not NaN
        else:
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the tile has at least one valid key
            shift = m_new
        alpha = tl.exp2(m - shift)                        # rescales what was summed under the old max
        p = tl.exp2(scores - shift[:, None])              # (BLOCK_G, BLOCK_S)
        l = l * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)   # acc = alpha acc + P V
        m = m_new
        k_ptrs += BLOCK_S * stride_ks                     # pointer arithmetic is 64-bit: no wrap however long
        v_ptrs += BLOCK_S * stride_vs
    return m, l, acc


@triton.jit
def _group_attend_unified_max(
    q, k_ptr, v_ptr, n, stride_ks, stride_kd, stride_vs, stride_vd, D, scale_log2, phi_log2, low_log2, high_log2,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """FlashDecoding++'s loop: :func:`_group_attend` with the max fixed at phi (log2 units) ahead of time,
    so p = exp2(score - phi) and nothing is rescaled. Returns m = phi, l, acc as _group_attend, and
    out_of_range (BLOCK_G,) int32: 1 where a tile's largest score left [phi + low, phi + high]."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k_ptrs = k_ptr + s[:, None] * stride_ks + d[None, :] * stride_kd
    v_ptrs = v_ptr + s[:, None] * stride_vs + d[None, :] * stride_vd
    m = tl.full((BLOCK_G,), phi_log2, tl.float32)         # fixed ahead: never updated
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    out_of_range = tl.zeros((BLOCK_G,), tl.int32)
    for s0 in range(0, n, BLOCK_S):
        s_ok = s0 + s < n
        k, v = _kv_tile(k_ptrs, v_ptrs, s_ok, d_ok)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2   # (BLOCK_G, BLOCK_S)
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        tile_max = tl.max(scores, axis=1)
        bad = (tile_max > phi_log2 + high_log2) | (tile_max < phi_log2 + low_log2)
        out_of_range = out_of_range | bad.to(tl.int32)
        p = tl.exp2(scores - phi_log2)                                     # exp(x - phi): no max, no rescale
        l = l + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_S * stride_ks
        v_ptrs += BLOCK_S * stride_vs
    return m, l, acc, out_of_range


@triton.jit
def _tile_rows(hk, GROUP, Q_LEN, BLOCK_G: tl.constexpr, CAUSAL: tl.constexpr):
    """What each of the BLOCK_G tile rows of K/V head hk's program computes: its query head
    ``heads``, its new query ``t`` (0-based among the Q_LEN new ones) and ``row_ok``, all (BLOCK_G,).

    One new query (CAUSAL False): row g is head hk*GROUP + g, t = 0, rows g >= GROUP padding.
    Q_LEN > 1 (CAUSAL): row r = t * GROUP + g is new query t of head hk*GROUP + g, so the
    Q_LEN * GROUP rows share every K/V tile (FlashInfer packs (position, group head) the same way).
    """
    r = tl.arange(0, BLOCK_G)
    if CAUSAL:
        t = r // GROUP
        heads = hk * GROUP + r % GROUP
        row_ok = r < Q_LEN * GROUP
    else:
        t = tl.zeros((BLOCK_G,), tl.int32)
        heads = hk * GROUP + r
        row_ok = r < GROUP
    return heads, t, row_ok


@triton.jit
def _load_rows_q(q_ptr, b, heads, t, row_ok, stride_qb, stride_qh, stride_qt, stride_qd, D,
                 BLOCK_D: tl.constexpr):
    """q[b, heads[r], t[r], :] for the tile rows: (BLOCK_G, BLOCK_D) in q's dtype, rows without
    row_ok (the padding up to the tensor-core tile) and columns d >= D zero."""
    d = tl.arange(0, BLOCK_D)
    offs = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :] * stride_qd
    return tl.load(q_ptr + offs, mask=row_ok[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _causal_end(L, t, Q_LEN, lo, CAUSAL_SLACK: tl.constexpr):
    """Where new query t's keys end, counted from position lo: query t sits at position L - Q_LEN + t
    and sees keys 0 .. L - Q_LEN + t, so it sees position lo + i iff i < L - Q_LEN + 1 + t - lo.
    CAUSAL_SLACK > 0 is the broken variant that lets each query see that many keys further."""
    return L - Q_LEN + 1 + t + CAUSAL_SLACK - lo


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    D, GROUP, Q_LEN, scale_log2,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_LENGTH: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_SLACK: tl.constexpr,
):
    """num_splits=1: one program per (sequence b, K/V head hk), grid (B, Hkv): the group's query heads
    (times the Q_LEN new queries when CAUSAL) over the whole cache."""
    b = tl.program_id(0)            # sequence
    hk = tl.program_id(1)           # K/V head; it serves query heads hk*GROUP .. hk*GROUP+GROUP-1
    L = tl.load(lens_ptr + b).to(tl.int32)   # filled cache positions of this sequence
    heads, t, row_ok = _tile_rows(hk, GROUP, Q_LEN, BLOCK_G, CAUSAL)
    q = _load_rows_q(q_ptr, b, heads, t, row_ok, stride_qb, stride_qh, stride_qt, stride_qd, D, BLOCK_D)
    m, l, acc = _group_attend(q, k_ptr + _kv_offset(b, hk, stride_kb, stride_kh),
                              v_ptr + _kv_offset(b, hk, stride_vb, stride_vh), L,
                              _causal_end(L, t, Q_LEN, 0, CAUSAL_SLACK),
                              stride_ks, stride_kd, stride_vs, stride_vd, D, scale_log2,
                              BLOCK_G, BLOCK_S, BLOCK_D, DOT_PRECISION, MASK_LENGTH, CAUSAL)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]          # o = acc / l; L = 0: acc is 0, output 0
    d = tl.arange(0, BLOCK_D)
    offs = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :] * stride_od
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, mpart_ptr, lpart_ptr, opart_ptr, flag_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    Hq, D, GROUP, Q_LEN, NUM_SPLITS, scale_log2, phi_log2, low_log2, high_log2,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UNIFIED: tl.constexpr, MASK_LENGTH: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_SLACK: tl.constexpr,
):
    """Split KV (decode_attention runs it from 2 splits, flash_decode from 1): one program per
    (sequence b, K/V head hk, split), grid (B, Hkv, NUM_SPLITS): the group's query heads over chunk
    ``split`` of sequence b's cache.

    UNIFIED=False: the online softmax (:func:`_group_attend`). UNIFIED=True (FlashDecoding++):
    the max is the fixed phi (:func:`_group_attend_unified_max`); a score outside
    [phi + low, phi + high] sets flag[b, hk, split].
    CAUSAL: the rows are (new query, group head) pairs (:func:`_tile_rows`), each limited to the keys
    before its own position; a split wholly after a query's position leaves that row empty.
    Writes m_s, l_s (B*Hq*Q_LEN, NUM_SPLITS) and the normalised o_s (B*Hq*Q_LEN, NUM_SPLITS, D), all
    fp32, with m in natural-log units (-inf for an empty chunk or row).
    """
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(L, NUM_SPLITS)                        # this sequence's chunk length
    lo = split * chunk
    n = tl.minimum(lo + chunk, L) - lo                    # n <= 0: an empty split (a short sequence's tail)
    first = lo.to(tl.int64)                               # lo * stride_ks passes 2**31 in a (B, S, H, D) layout
    k_chunk = k_ptr + _kv_offset(b, hk, stride_kb, stride_kh) + first * stride_ks
    v_chunk = v_ptr + _kv_offset(b, hk, stride_vb, stride_vh) + first * stride_vs
    heads, t, row_ok = _tile_rows(hk, GROUP, Q_LEN, BLOCK_G, CAUSAL)
    q = _load_rows_q(q_ptr, b, heads, t, row_ok, stride_qb, stride_qh, stride_qt, stride_qd, D, BLOCK_D)
    if UNIFIED:
        m, l, acc, out_of_range = _group_attend_unified_max(
            q, k_chunk, v_chunk, n, stride_ks, stride_kd, stride_vs, stride_vd, D, scale_log2,
            phi_log2, low_log2, high_log2, BLOCK_G, BLOCK_S, BLOCK_D, DOT_PRECISION)
        tl.store(flag_ptr + (b.to(tl.int64) * (Hq // GROUP) + hk) * NUM_SPLITS + split,
                 tl.max(tl.where(row_ok, out_of_range, 0), axis=0))   # the padding rows' scores are 0, not the group's
    else:
        m, l, acc = _group_attend(q, k_chunk, v_chunk, n, _causal_end(L, t, Q_LEN, lo, CAUSAL_SLACK),
                                  stride_ks, stride_kd, stride_vs, stride_vd, D, scale_log2,
                                  BLOCK_G, BLOCK_S, BLOCK_D, DOT_PRECISION, MASK_LENGTH, CAUSAL)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]                           # o_s = acc / l_s
    m_out = tl.where(n <= 0, float("-inf"), m * 0.6931471805599453)      # ln 2: natural-log units; empty: -inf
    d = tl.arange(0, BLOCK_D)
    rows = (b.to(tl.int64) * Hq + heads) * Q_LEN + t                    # (BLOCK_G,) rows of (B*Hq*Q_LEN)
    tl.store(mpart_ptr + rows * NUM_SPLITS + split, m_out, mask=row_ok)
    tl.store(lpart_ptr + rows * NUM_SPLITS + split, l, mask=row_ok)
    tl.store(opart_ptr + (rows[:, None] * NUM_SPLITS + split) * D + d[None, :], o, mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _decode_combine_kernel(
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
# Grids and the number of splits


def decode_grid(batch: int, kv_heads: int) -> tuple[int, int]:
    """The single-pass kernel's grid: one program per (sequence, K/V head), whatever the cache length.

    At batch 1 that is Hkv programs (8 for Llama-3-8B or Llama-2-70B) for a GPU of 132 SMs, which
    is why :func:`decode_attention` splits the cache there (:func:`choose_num_splits`).
    """
    return (batch, kv_heads)


def split_grid(batch: int, kv_heads: int, num_splits: int) -> tuple[int, int, int]:
    """The split kernel's grid: one program per (sequence, K/V head, split). The combine adds
    batch * Hq small programs after it."""
    return (batch, kv_heads, num_splits)


def attention_grid(batch: int, kv_heads: int, num_splits: int) -> tuple[int, ...]:
    """The K/V-streaming grid :func:`decode_attention` launches for ``num_splits``: :func:`decode_grid`
    for one split, :func:`split_grid` for more."""
    return decode_grid(batch, kv_heads) if num_splits == 1 else split_grid(batch, kv_heads, num_splits)


# The choice below, and why (a design, not a measurement; no GPU timing was run here):
# * WAVES: a decode program is 4 warps streaming K/V; an SM holds several such programs at once
#   (sm90: 64 resident warps), and a memory-bound stream needs many loads in flight per SM. Aim for
#   at least 4 programs per SM, i.e. B * Hkv * s >= 4 * SMs.
# * MIN_CHUNK: each split writes, and the combine reads back, group * (D + 2) fp32 values per K/V
#   head, about 8 * group * D bytes, against the 4 * chunk * D bytes of fp16 K and V it reads: a
#   fraction 2 * group / chunk. A chunk of at least 256 positions keeps that below 1/16 for groups
#   up to 8 (vLLM's paged attention v2 uses 512-token partitions: vllm-project/vllm@cc17020a,
#   csrc/attention/paged_attention_v2.cu, PARTITION_SIZE). The price: at batch 1 with 8 K/V heads a
#   cache shorter than 256 * ceil(132 / 8) = 4352 positions gets fewer programs than an H100 has SMs.
# * MAX_SPLITS: the combine holds a (next_pow2(s), next_pow2(D)) fp32 tile per program; 64 splits at
#   D = 128 compile without spills (tests/test_decode_attention.py).
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
    """The SM count of a CUDA device (what :func:`choose_num_splits` fills)."""
    if device.type != "cuda":
        raise ValueError(f"device_sms: {device} is not a CUDA device")
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, cache_len: int, device: torch.device) -> int:
    """``num_splits=None``: :func:`choose_num_splits` with the GPU's SM count; 1 under the interpreter,
    which runs programs one after another (a split there only adds the partials and the combine)."""
    if runtime.runtime().interpreted:
        return 1
    return choose_num_splits(max(batch, 1), kv_heads, cache_len, device_sms(device))


# ----------------------------------------------------------------------------------------------
# Launchers


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens, name: str = "decode_attention", *,
                        multi_query: bool = False) -> None:
    """Validate the decode-attention arguments (shared by every decode kernel); errors start with ``name``.
    ``multi_query`` also accepts q (B, Hq, T, D), T new queries per sequence, which needs
    T <= cache_seqlens[b] (the new queries are the cache's last T positions) and T * Hq / Hkv <= MAX_GROUP."""
    for arg, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if q.dim() != 3 and not (multi_query and q.dim() == 4):
        want = "(B, Hq, D) or (B, Hq, T, D)" if multi_query else "(B, Hq, D)"
        raise ValueError(f"{name}: q must be {want}, got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"{name}: k_cache must be (B, Hkv, S_max, D), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    T = q.shape[2] if q.dim() == 4 else 1
    Bk, Hkv, S, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{name}: q is (B={B}, Hq={Hq}, D={D}) but k_cache is (B={Bk}, Hkv={Hkv}, S={S}, D={Dk})")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if Hq // Hkv > MAX_GROUP:
        raise ValueError(f"{name}: Hq / Hkv = {Hq // Hkv} query heads per K/V head; one program serves at most "
                         f"MAX_GROUP={MAX_GROUP} (the tensor-core tile's rows), larger groups are not implemented")
    if T < 1:
        raise ValueError(f"{name}: q must hold at least one new query per sequence, got T={T} in shape {tuple(q.shape)}")
    if T * (Hq // Hkv) > MAX_GROUP:
        raise ValueError(f"{name}: T * Hq / Hkv = {T} * {Hq // Hkv} = {T * (Hq // Hkv)} rows (new queries times "
                         f"group); one program serves at most MAX_GROUP={MAX_GROUP} rows, more are not implemented")
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
    if q.dim() == 4 and B and int(cache_seqlens.min()) < T:
        raise ValueError(f"{name}: q holds T={T} new queries per sequence, the last T positions of its cache, "
                         f"but cache_seqlens has a length {int(cache_seqlens.min())} < T (write the new keys first)")


# Tiles. The group is the M axis of the tensor-core products, padded to at least 16 rows (the
# smallest M of mma.sync, which Triton emits for tiles below 64 rows; a 64-row tile becomes wgmma on
# sm_90a); BLOCK_S cache positions per iteration are the N axis of S = q K^T and the K axis of P V.
# FlashAttention-2 decodes the same way: with one query row and a GQA group it reshapes q so that
# the group becomes the query-row (M) axis of its attention kernel, whose split-KV tiles are 64 rows
# by 256 (D <= 64) or 128 (D <= 128) keys (Dao-AILab/flash-attention@00979f57,
# csrc/flash_attn/flash_api.cpp: mha_fwd's seqlenq_ngroups_swapped, set_params_splitkv);
# FlashInfer's decode with use_tensor_cores runs its prefill kernel, whose rows are the (position,
# group head) pairs packed (flashinfer-ai/flashinfer@6b1a33f0, flashinfer/decode.py;
# @0d618712, include/flashinfer/attention/prefill.cuh: load_q_global_smem, group_size.divmod).
# The GPU tiles below are chosen from the AOT builds (compile_jobs, tests/test_decode_attention.py):
# no spills on sm_80 or sm_90a for groups 1..128 at head dims 64 and 128, with cp.async pipelining.
MAX_GROUP = 128                 # query heads per K/V head one program serves (Falcon-7B: 71)
MIN_BLOCK_S = 16                # tl.dot's smallest N and K
INTERPRETER_BLOCK_S = 64        # under the interpreter each loop iteration costs time: few, large tiles


@dataclass(frozen=True)
class DecodeTiles:
    """One launch's tile sizes and launch options (see the comment above)."""

    block_g: int                # query heads per program, padded: the MMA's M
    block_s: int                # cache positions per iteration
    block_d: int                # head dim, padded to a power of two >= 16
    num_warps: int
    num_stages: int             # K/V tiles in flight (cp.async buffers)


def group_rows(group: int) -> int:
    """BLOCK_G: the group padded to a power of two of at least 16 rows."""
    return max(16, triton.next_power_of_2(group))


def gpu_tiles(group: int, head_dim: int, block_s: int | None = None, *, causal: bool = False) -> DecodeTiles:
    """The GPU launch for a group of ``group`` tile rows (query heads per K/V head, times the new
    queries per sequence when there are several) of dimension ``head_dim``: 128 cache
    positions per iteration at D <= 64, 64 above (the same halving as FlashAttention-2's split-KV
    tiles), 4 warps (8 from 64 group rows on: a 128-row group at 4 warps spills on sm_80), 3 stages
    (2 at D > 128, to stay within 100 KiB of shared memory). ``causal`` (several new queries): at 128
    rows the positions per iteration halve, since the per-row causal end takes the 64-position tile at
    D = 128 to 255 registers with spills on sm_80 (tests/test_decode_attention.py's AOT builds)."""
    block_g, block_d = group_rows(group), max(16, triton.next_power_of_2(head_dim))
    default_s = 128 if block_d <= 64 else 64
    if causal and block_g >= 128:
        default_s //= 2
    return DecodeTiles(block_g, block_s or default_s, block_d,
                       8 if block_g >= 64 else 4, 3 if block_d <= 128 else 2)


def default_tiles(group: int, head_dim: int, block_s: int | None = None, *, causal: bool = False) -> DecodeTiles:
    """:func:`gpu_tiles` on a GPU; under the interpreter ``block_s`` defaults to 64 (one stage)."""
    if runtime.runtime().interpreted:
        t = gpu_tiles(group, head_dim, block_s or INTERPRETER_BLOCK_S)
        return DecodeTiles(t.block_g, t.block_s, t.block_d, 4, 1)
    return gpu_tiles(group, head_dim, block_s, causal=causal)


def check_block_s(block_s, name: str) -> None:
    if not isinstance(block_s, int) or isinstance(block_s, bool) or block_s < MIN_BLOCK_S or block_s & (block_s - 1):
        raise ValueError(f"{name}: block_s must be a power of two >= {MIN_BLOCK_S}, got {block_s!r}")


def check_num_splits(num_splits, name: str) -> None:
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{name}: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")


def resolve_launch(q, k_cache, cache_seqlens, num_splits, block_s, name: str) -> tuple[int, int | None]:
    """(num_splits, block_s) with the split count filled in (:func:`default_num_splits`) and both
    checked; block_s stays None for the device's default (:func:`default_tiles`). Inputs validated."""
    B, Hkv = q.shape[0], k_cache.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, int(cache_seqlens.max()) if B else 0, q.device)
    check_num_splits(num_splits, name)
    if block_s is not None:
        check_block_s(block_s, name)
    return num_splits, block_s


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # fp32 caches: full fp32 products, not tf32


def query_len(q) -> int:
    """T, the new queries per sequence: q (B, Hq, D) holds one, q (B, Hq, T, D) T."""
    return q.shape[2] if q.dim() == 4 else 1


def _strides_bhtd(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_b, stride_h, stride_t, stride_d) of a (B, H, D) or (B, H, T, D) tensor; stride_t = 0 for one query."""
    return t.stride() if t.dim() == 4 else (t.stride(0), t.stride(1), 0, t.stride(2))


def _causal_kwargs(q, causal_slack: int) -> dict:
    """The constexprs of the new-query rows: CAUSAL for T > 1 (the (query, head) rows of _tile_rows
    and each row's causal end), CAUSAL_SLACK > 0 only for the broken variant."""
    return dict(CAUSAL=query_len(q) > 1, CAUSAL_SLACK=causal_slack)


def _single_pass_args(q, k_cache, v_cache, cache_seqlens, out, tiles: DecodeTiles, *, mask_length: bool = True,
                      causal_slack: int = 0):
    """(grid, args, kwargs) of one launch of :func:`_decode_attention_kernel`, shared by the launcher
    and :func:`compile_jobs` so the AOT build is the launch."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    Hkv = k_cache.shape[1]
    args = (q, k_cache, v_cache, cache_seqlens, out,
            *_strides_bhtd(q), *k_cache.stride(), *v_cache.stride(), *_strides_bhtd(out),
            D, Hq // Hkv, query_len(q), LOG2E / math.sqrt(D))
    kwargs = dict(BLOCK_G=tiles.block_g, BLOCK_S=tiles.block_s, BLOCK_D=tiles.block_d,
                  DOT_PRECISION=_precision(q.dtype), MASK_LENGTH=mask_length, **_causal_kwargs(q, causal_slack),
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return decode_grid(B, Hkv), args, kwargs


def _split_args(q, k_cache, v_cache, cache_seqlens, m, l, o, flags, num_splits: int, tiles: DecodeTiles, *,
                mask_length: bool = True, unified: tuple[float, float, float] | None = None, causal_slack: int = 0):
    """(grid, args, kwargs) of one launch of :func:`_decode_split_kernel` (launcher and compile_jobs)."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    Hkv = k_cache.shape[1]
    if unified is not None and query_len(q) > 1:
        raise ValueError("the unified-max loop (FlashDecoding++) takes one query per sequence, not several")
    phi, low, high = unified if unified is not None else (0.0, 0.0, 0.0)
    args = (q, k_cache, v_cache, cache_seqlens, m, l, o, flags,
            *_strides_bhtd(q), *k_cache.stride(), *v_cache.stride(),
            Hq, D, Hq // Hkv, query_len(q), num_splits, LOG2E / math.sqrt(D), phi * LOG2E, low * LOG2E, high * LOG2E)
    kwargs = dict(BLOCK_G=tiles.block_g, BLOCK_S=tiles.block_s, BLOCK_D=tiles.block_d,
                  DOT_PRECISION=_precision(q.dtype), UNIFIED=unified is not None, MASK_LENGTH=mask_length,
                  **_causal_kwargs(q, causal_slack), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return split_grid(B, Hkv, num_splits), args, kwargs


def _combine_args(m, l, o, out):
    """(grid, args, kwargs) of one launch of :func:`_decode_combine_kernel`."""
    B, Hq, S, D = o.shape
    return (B * Hq,), (m, l, o, out, *out.stride(), Hq, D, S), dict(
        BLOCK_SPLITS=triton.next_power_of_2(S), BLOCK_D=triton.next_power_of_2(D))


def _tile_rows_needed(q, k_cache) -> int:
    """The tile rows one program fills: the group times the new queries (T * Hq / Hkv)."""
    return query_len(q) * (q.shape[1] // k_cache.shape[1])


def _single_pass(q, k_cache, v_cache, cache_seqlens, *, block_s: int | None, mask_length: bool,
                 causal_slack: int = 0) -> torch.Tensor:
    B, Hq = q.shape[0], q.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)      # (B, Hq, D) or (B, Hq, T, D)
    if B == 0 or Hq == 0:
        return out
    tiles = default_tiles(_tile_rows_needed(q, k_cache), q.shape[-1], block_s, causal=query_len(q) > 1)
    grid, args, kwargs = _single_pass_args(q, k_cache, v_cache, cache_seqlens, out, tiles, mask_length=mask_length,
                                           causal_slack=causal_slack)
    _decode_attention_kernel[grid](*args, **kwargs)
    return out


def split_partials(q, k_cache, v_cache, cache_seqlens, num_splits: int, *, block_s: int | None = None,
                   mask_length: bool = True, unified: tuple[float, float, float] | None = None,
                   causal_slack: int = 0):
    """The split kernel: per split the partial m_s, l_s (B, Hq, s) and o_s (B, Hq, s, D), fp32, and the
    (B, Hkv, s) int32 flags; for q (B, Hq, T, D) the partials are (B, Hq, T, s) and (B, Hq, T, s, D).
    ``unified=(phi, low, high)`` (natural-log units) runs FlashDecoding++'s fixed-max loop, flagging
    scores outside [phi + low, phi + high]; inputs already validated."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    Hkv = k_cache.shape[1]
    rows = q.shape[:-1]                                              # (B, Hq) or (B, Hq, T)
    m = torch.empty((*rows, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty((*rows, num_splits), dtype=torch.float32, device=q.device)
    o = torch.empty((*rows, num_splits, D), dtype=torch.float32, device=q.device)
    flags = torch.zeros((B, Hkv, num_splits), dtype=torch.int32, device=q.device)
    if B * Hq == 0:
        return m, l, o, flags
    tiles = default_tiles(_tile_rows_needed(q, k_cache), D, block_s, causal=query_len(q) > 1)
    grid, args, kwargs = _split_args(q, k_cache, v_cache, cache_seqlens, m, l, o, flags, num_splits, tiles,
                                     mask_length=mask_length, unified=unified, causal_slack=causal_slack)
    _decode_split_kernel[grid](*args, **kwargs)
    return m, l, o, flags


def combine(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, out_dtype=torch.float32) -> torch.Tensor:
    """The combine kernel: (m, l) (B, Hq, S) and o (B, Hq, S, D), fp32 -> (B, Hq, D)."""
    if m.dim() != 3 or l.shape != m.shape or o.dim() != 4 or o.shape[:3] != m.shape:
        raise ValueError(f"combine: expected m, l (B, Hq, S) and o (B, Hq, S, D), got {tuple(m.shape)}, "
                         f"{tuple(l.shape)}, {tuple(o.shape)}")
    if any(t.dtype != torch.float32 for t in (m, l, o)):
        raise TypeError("combine: m, l, o must be float32 (the split step's partials)")
    m, l, o = m.contiguous(), l.contiguous(), o.contiguous()
    B, Hq, S, D = o.shape
    out = torch.empty((B, Hq, D), dtype=out_dtype, device=o.device)
    if B * Hq:
        grid, args, kwargs = _combine_args(m, l, o, out)
        _decode_combine_kernel[grid](*args, **kwargs)
    return out


def split_attention(q, k_cache, v_cache, cache_seqlens, num_splits: int, *, block_s: int | None = None,
                    mask_length: bool = True, causal_slack: int = 0) -> torch.Tensor:
    """The split kernel then the combine, whatever ``num_splits`` (one split too); inputs already validated.
    With T new queries the combine merges each (sequence, head, query) row: (B, Hq * T) rows."""
    m, l, o, _ = split_partials(q, k_cache, v_cache, cache_seqlens, num_splits, block_s=block_s,
                                mask_length=mask_length, causal_slack=causal_slack)
    B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
    rows = Hq * query_len(q)
    out = combine(m.view(B, rows, num_splits), l.view(B, rows, num_splits), o.view(B, rows, num_splits, D),
                  out_dtype=q.dtype)
    return out.view(q.shape)


def _launch(q, k_cache, v_cache, cache_seqlens, *, num_splits: int, block_s: int | None,
            mask_length: bool, causal_slack: int = 0) -> torch.Tensor:
    """What :func:`decode_attention` runs once its arguments are checked: the single-pass kernel for one
    split, the split kernel and the combine for more. ``mask_length=False`` is the broken variant
    that reads every tile whole (past the sequence's length, or into the next chunk);
    ``causal_slack=k > 0`` the one that lets each of several new queries see k keys past its own position."""
    if num_splits == 1:
        return _single_pass(q, k_cache, v_cache, cache_seqlens, block_s=block_s, mask_length=mask_length,
                            causal_slack=causal_slack)
    return split_attention(q, k_cache, v_cache, cache_seqlens, num_splits, block_s=block_s, mask_length=mask_length,
                           causal_slack=causal_slack)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, *, num_splits: int | None = None,
                     block_s: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its first ``cache_seqlens[b]`` cached positions,
    or of T new queries per sequence, causal among themselves.

    q (B, Hq, D), k_cache and v_cache (B, Hkv, S_max, D) with Hq a multiple of Hkv (at most
    MAX_GROUP query heads per K/V head), cache_seqlens (B,) integers in [0, S_max]; any strides.
    Returns (B, Hq, D) in q's dtype; zeros where the cache is empty.

    q (B, Hq, T, D): T new queries per sequence (a speculative verification of T - 1 drafts, or a
    prefill chunk against a cache), whose keys are already written at the cache's last T positions:
    query t of sequence b sits at position L_b - T + t and sees keys 0 .. L_b - T + t. Needs
    T <= cache_seqlens[b] and T * Hq / Hkv <= MAX_GROUP (the tile rows, :func:`_tile_rows`); returns
    (B, Hq, T, D).

    ``num_splits`` (an int in [1, MAX_SPLITS]) cuts each cache into that many chunks: 1 runs the
    single-pass kernel (:func:`decode_grid` programs), more the split kernel (:func:`split_grid`)
    and the combine. None (the default) is :func:`default_num_splits`: enough splits to fill this
    GPU (:func:`choose_num_splits`), 1 under the interpreter. ``block_s`` (cache positions per loop
    iteration, a power of two >= 16) defaults to :func:`default_tiles`'.
    """
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, multi_query=True)
    num_splits, block_s = resolve_launch(q, k_cache, cache_seqlens, num_splits, block_s, "decode_attention")
    return _launch(q, k_cache, v_cache, cache_seqlens, num_splits=num_splits, block_s=block_s, mask_length=True)


# ----------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes (fp16 caches of 32k positions, the launch decode_attention
# picks by default on an H100's 132 SMs)

H100_SMS = 132
# (label, query heads, K/V heads, head dim)
REAL_CONFIGS = (
    ("Llama-2-7B (MHA)", 32, 32, 128),
    ("Llama-3-8B", 32, 8, 128),
    ("Qwen2.5-7B", 28, 4, 128),
    ("Llama-2-70B", 64, 8, 128),
    ("Falcon-7B (MQA)", 71, 1, 64),
)


def launch_job(hq: int, hkv: int, head_dim: int, *, batch: int = 1, cache_len: int = 32768, q_len: int = 1,
               num_splits: int | None = None, tiles: DecodeTiles | None = None, unified: bool = False,
               dtype=torch.float16, target: str = "sm90"):
    """The job of a GPU launch at these sizes on meta tensors: the single-pass kernel for one split,
    the split kernel for more (``unified``: FlashDecoding++'s loop). ``q_len`` > 1: that many new
    queries per sequence, q (batch, hq, q_len, head_dim) in decode_attention's layout. ``num_splits``
    defaults to :func:`choose_num_splits` on an H100 (what ``decode_attention`` launches there),
    ``tiles`` to :func:`gpu_tiles` of the q_len * group rows."""
    from kernels import inspect as ki

    rows = (batch, hq, q_len) if q_len > 1 else (batch, hq)
    q = torch.empty(*rows, head_dim, dtype=dtype, device="meta")
    k = torch.empty(batch, hkv, cache_len, head_dim, dtype=dtype, device="meta")
    lens = torch.empty(batch, dtype=torch.int32, device="meta")
    tiles = tiles or gpu_tiles(q_len * (hq // hkv), head_dim, causal=q_len > 1)
    if num_splits is None:
        num_splits = choose_num_splits(batch, hkv, cache_len, H100_SMS)
    if num_splits == 1 and not unified:
        out = torch.empty_like(q)
        grid, args, kwargs = _single_pass_args(q, k, k, lens, out, tiles)
        return ki.launch_job(_decode_attention_kernel, *args, target=target, grid=grid, **kwargs)
    m = torch.empty(*rows, num_splits, device="meta")
    o = torch.empty(*rows, num_splits, head_dim, device="meta")
    flags = torch.empty(batch, hkv, num_splits, dtype=torch.int32, device="meta")
    grid, args, kwargs = _split_args(q, k, k, lens, m, m, o, flags, num_splits, tiles,
                                     unified=(0.0, -80.0, 80.0) if unified else None)
    return ki.launch_job(_decode_split_kernel, *args, target=target, grid=grid, **kwargs)


def combine_job(batch: int, hq: int, num_splits: int, head_dim: int, *, dtype=torch.float16):
    """The combine kernel's job for (batch, hq) rows of ``num_splits`` partials, on meta tensors."""
    from kernels import inspect as ki

    m = torch.empty(batch, hq, num_splits, device="meta")
    o = torch.empty(batch, hq, num_splits, head_dim, device="meta")
    out = torch.empty(batch, hq, head_dim, dtype=dtype, device="meta")
    grid, args, kwargs = _combine_args(m, m, o, out)
    return ki.launch_job(_decode_combine_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """At :data:`REAL_CONFIGS`, batch 1 and 32, a 32k cache: the kernel ``decode_attention`` launches by
    default on an H100 (single pass or split, :func:`choose_num_splits`), FlashDecoding++'s loop once,
    Llama-3-8B's speculative verification (4 new queries, causal among themselves) at batch 1,
    and the combine of the widest split."""
    jobs = {}
    for label, hq, hkv, d in REAL_CONFIGS:
        for batch in (1, 32):
            s = choose_num_splits(batch, hkv, 32768, H100_SMS)
            kind = "single pass" if s == 1 else f"{s} splits"
            jobs[f"{label} decode, group {hq // hkv}, D={d}, batch {batch}: {kind}"] = launch_job(hq, hkv, d, batch=batch)
    jobs["Llama-3-8B decode, batch 1, unified max (FlashDecoding++)"] = launch_job(32, 8, 128, unified=True)
    # a speculative verification of gamma = 3 drafts: 4 new queries x group 4 = 16 rows (batch 32 would
    # build the same split kernel with the same constexprs; the single pass is in the tests' AOT batch)
    s = choose_num_splits(1, 8, 32768, H100_SMS)
    jobs[f"Llama-3-8B verify, 4 new queries, group 4, batch 1: {s} splits"] = launch_job(32, 8, 128, q_len=4)
    jobs[f"Llama-3-8B combine, batch 1, {MAX_SPLITS} splits"] = combine_job(1, 32, MAX_SPLITS, 128)
    return jobs
