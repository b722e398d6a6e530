"""FlashAttention in Triton: exact attention without an (N x N) matrix in memory, forward and backward.

For one (batch, query head), with queries split into row blocks Q_i (BLOCK_M rows) and keys/values
into column blocks K_j, V_j (BLOCK_N rows), the forward walks j and keeps per row a running max m,
a running sum l and an unnormalised output accumulator A (the online softmax applied to tiles):

    S_ij   = sm_scale * Q_i K_j^T                         (BLOCK_M, BLOCK_N), on chip only
    m_new  = max(m, rowmax(S_ij))
    alpha  = exp(m - m_new)                                rescales what was summed under the old max
    P_ij   = exp(S_ij - m_new)
    l      = alpha * l + rowsum(P_ij)
    A      = alpha * A + P_ij V_j                          <- forgetting alpha here is the classic bug
    O_i    = A / l,   lse_i = m + log l                    once, after the last block

The exponentials use exp2 with the scale folded into log2(e) * sm_scale, which is one multiply
cheaper per score; m is then in log2 units, converted back for lse.

Two loop orders are kept, because the chapters compare them:

* ``_flash_fwd_v1_kernel`` (FlashAttention, Dao et al. 2022, Algorithm 1): one program per
  (batch, head); the **outer** loop runs over K/V blocks and the inner loop over Q blocks, so the
  partial O_i, l_i, m_i go back to HBM after every K/V block, and O_i is renormalised (divided by
  l) at every step. Forward only.
* ``_flash_fwd_kernel`` (FlashAttention-2, Dao 2023): one program per (Q block, batch, head) --
  parallel over the sequence -- with the K/V loop **inside**, so m, l, A stay in registers and O is
  divided by l once. This is the public forward.

Backward (FlashAttention-2): from the saved lse the probabilities are recomputed tile by tile,
P_ij = exp(S_ij - lse_i), and with D_i = rowsum(dO_i * O_i) (which equals rowsum(P * dP), one
cheap pass instead of a reduction over the N columns of dP):

    dV_j += P_ij^T dO_i        dP_ij = dO_i V_j^T        dS_ij = P_ij * (dP_ij - D_i)
    dK_j += sm_scale * dS_ij^T Q_i                         dQ_i += sm_scale * dS_ij K_j

``_flash_bwd_dkdv_kernel`` runs one program per (K/V block, batch, K/V head) and loops over every
query head of its group and every Q block, so GQA gradients are summed over the group in
registers (no repeated K/V, no atomics); ``_flash_bwd_dq_kernel`` runs one program per (Q block,
batch, query head) and loops over K/V blocks.

Masking conventions are those of :mod:`kernels.attention.reference`: causal is bottom-right
aligned (query i sees key j when j <= i + Nk - Nq); fully masked rows give output 0, lse -inf
and zero gradients. Head dims up to 256 are padded to a power of two of at least 16 (80 and 96
run as 128, 192 as 256, with the extra columns masked).

ALiBi (Press, Smith and Lewis, 2022) is the constexpr ``HAS_ALIBI`` of the same three kernels: one
added line, S_ij -= slope_h |j - (i + Nk - Nq)| (the distance from query i's own position, aligned
bottom-right as the causal mask; with the causal mask only j <= i + Nk - Nq remain and the bias is
the paper's slope_h (j - i - Nk + Nq)). The bias depends on no input, so the backward's formulas are
unchanged: only the recomputed P_ij = exp(S_ij - lse_i) includes it.

Two more options of real models, constexprs of the same three kernels:

* ``SOFTCAP`` (Gemma 2): S_ij -> c tanh(S_ij / c) before any mask (:func:`_scores`), with tanh from
  :func:`kernels.rows.tanh`; the backward multiplies dS by the cap's derivative 1 - tanh^2, read off the
  capped score it already holds (:func:`_through_cap`).
* ``HAS_WINDOW``: query i (at i' = i + Nk - Nq) sees keys i' - W < j <= i'. The forward and dQ start
  their key loop at the tile of the block's first row's oldest key (:func:`_window_start`) and dK/dV
  ends its query loop after the last row that sees its block's newest key, so tiles outside every
  window are never loaded; ``SKIP_OUTSIDE`` off reads and masks them (broken on purpose).

Offsets: each kernel forms a head's base (b * stride_b + h * stride_h) and a tile's first row times
its stride in int64, and only the offsets inside a tile in int32, so tensors past 2**31 elements
(B = 128, H = 32, N = 8192, D = 128 is 2**32) address correctly; K/V pointers advance by 64-bit
pointer arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rows import check_cap, tanh

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------
# Offsets and the ALiBi bias


@triton.jit
def _head_offset(b, h, stride_b, stride_h):
    """Element offset of head h of batch entry b, in int64: b * stride_b passes 2**31 once a tensor
    does (B = 128, H = 32, N = 8192, D = 128 is 2**32 elements; entry 64 starts at 2**31)."""
    return b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _alibi_bias(slope_log2, offs_m, offs_n, shift):
    """ALiBi's -slope * |j - (i + shift)| in log2 units, (BLOCK_M, BLOCK_N)."""
    dist = offs_n[None, :] - (offs_m[:, None] + shift)
    return -slope_log2 * tl.abs(dist).to(tl.float32)


@triton.jit
def _scores(q, k, qk_scale, cap_log2, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """S_ij in log2 units, (BLOCK_M, BLOCK_N); with SOFTCAP Gemma 2's cap tanh(S / cap), before any
    bias or mask. cap_log2 = cap log2(e), so S log2(e) / cap_log2 = S / cap and the cap stays in
    natural units (capping the log2-unit score at cap would cap at cap / log2 e)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = cap_log2 * tanh(s * (1.0 / cap_log2))
    return s


@triton.jit
def _window_start(first_row, shift, window, BLOCK_N: tl.constexpr):
    """The first key tile any of the rows from first_row on can see in a window: row i sees keys
    j > i + shift - window, so the tile holding key first_row + shift - window + 1, at least 0."""
    return tl.maximum(first_row + shift - window + 1, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _through_cap(ds, s_capped, cap_log2):
    """dS with respect to the score before the cap: c = cap tanh(S / cap) has dc/dS = 1 - tanh^2, and
    tanh = c / cap is the capped score (log2 units) over cap_log2 (ALiBi is refused with a cap)."""
    t = s_capped * (1.0 / cap_log2)
    return ds * (1.0 - t * t)


# ----------------------------------------------------------------------------------------------
# Forward, FlashAttention-2 loop order (the public kernel)


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, slopes_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh,
    Hq, Nq, Nk, D, GROUP, qk_scale, cap_log2, window,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr, RESCALE: tl.constexpr, MASK_KV: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SKIP_OUTSIDE: tl.constexpr,
):
    start_m = tl.program_id(0)                     # which block of BLOCK_M query rows
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP                                # the K/V head this query head reads (GQA/MQA)
    rows = tl.arange(0, BLOCK_M)                         # (BLOCK_M,) rows within the block
    offs_m = start_m * BLOCK_M + rows                    # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)                       # (BLOCK_N,) key rows within a block
    offs_d = tl.arange(0, BLOCK_D)                       # (BLOCK_D,) head dim, padded
    m_ok = offs_m < Nq
    d_ok = offs_d < D
    first_m = (start_m * BLOCK_M).to(tl.int64)           # 64-bit tile origins, small offsets inside a tile
    q_tile = q_ptr + _head_offset(b, h, stride_qb, stride_qh) + first_m * stride_qm
    q = tl.load(q_tile + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)          # Q_i, (BLOCK_M, BLOCK_D)
    k_ptrs = k_ptr + _head_offset(b, hk, stride_kb, stride_kh) + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + _head_offset(b, hk, stride_vb, stride_vh) + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if HAS_ALIBI:
        slope_log2 = tl.load(slopes_ptr + h) * 1.4426950408889634   # this query head's slope, log2 units

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros((BLOCK_M,), tl.float32)                # running sum of exp2(s - m)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)        # running sum of exp2(s - m) V (unnormalised)

    shift = Nk - Nq                                       # bottom-right causal alignment
    if CAUSAL:
        # keys beyond the last visible one of this block's last row are never needed
        hi = tl.maximum(tl.minimum(Nk, (start_m + 1) * BLOCK_M + shift), 0)
    else:
        hi = Nk
    lo = 0
    if HAS_WINDOW:
        if SKIP_OUTSIDE:                                  # off: every tile read and masked (broken on purpose)
            lo = _window_start(start_m * BLOCK_M, shift, window, BLOCK_N)    # tiles before lo: outside every row's window
            k_ptrs += tl.cast(lo, tl.int64) * stride_kn
            v_ptrs += tl.cast(lo, tl.int64) * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        n_ok = n < Nk
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        s = _scores(q, k, qk_scale, cap_log2, SOFTCAP, DOT_PRECISION)         # S_ij in log2 units
        if HAS_ALIBI:
            s = s + _alibi_bias(slope_log2, offs_m, n, shift)                   # S_ij - slope |j - i'|
        if MASK_KV:
            visible = n_ok[None, :]
        else:
            visible = n[None, :] >= 0                      # broken on purpose: the tail's padding counts
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + shift)
        if HAS_WINDOW:
            visible = visible & (n[None, :] > offs_m[:, None] + shift - window)   # j > i' - W
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))        # m_new = max(m, rowmax(S_ij))
        # a row with nothing visible yet has m_new = -inf; exponentiate against 0 so no NaN appears
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)                     # alpha = exp(m - m_new)
        p = tl.exp2(s - m_safe[:, None])                  # P_ij = exp(S_ij - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)             # l = alpha l + rowsum(P_ij)
        if RESCALE:
            acc = acc * alpha[:, None]                    # A = alpha A ...
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)   # ... + P_ij V_j
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn                     # 64-bit pointers: no wrap however long
        v_ptrs += BLOCK_N * stride_vn

    l_safe = tl.where(l_i > 0, l_i, 1.0)                  # fully masked row: A = 0, output 0
    o = acc / l_safe[:, None]                             # O_i = A / l, once
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_tile = o_ptr + _head_offset(b, h, stride_ob, stride_oh) + first_m * stride_om
    tl.store(o_tile + rows[:, None] * stride_om + offs_d[None, :] * stride_od,
             o.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + _head_offset(b, h, stride_lb, stride_lh) + offs_m, lse, mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Forward, FlashAttention(-1) loop order: outer loop over K/V blocks, partial O in HBM


@triton.jit
def _flash_fwd_v1_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    Hq, Nq, Nk, D, GROUP, qk_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """o_ptr (fp32), m_ptr, l_ptr are contiguous scratch of shape (B*Hq, Nq[, BLOCK_D]), initialised
    to 0, -inf, 0: Algorithm 1 keeps O, l, m in HBM between K/V blocks."""
    bh = tl.program_id(0)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    shift = Nk - Nq
    q_head = q_ptr + _head_offset(b, h, stride_qb, stride_qh)
    k_head = k_ptr + _head_offset(b, hk, stride_kb, stride_kh)
    v_head = v_ptr + _head_offset(b, hk, stride_vb, stride_vh)
    row0 = bh.to(tl.int64) * Nq                           # this head's first row of the scratch
    for start_n in range(0, Nk, BLOCK_N):                 # outer: K_j, V_j loaded once each
        n = start_n + tl.arange(0, BLOCK_N)
        n_ok = n < Nk
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_head + n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        for start_m in range(0, Nq, BLOCK_M):             # inner: every Q_i, with O_i, l_i, m_i from HBM
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < Nq
            q = tl.load(q_head + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            row = row0 + offs_m
            o_ptrs = o_ptr + row[:, None] * BLOCK_D + offs_d[None, :]
            o_old = tl.load(o_ptrs, mask=m_ok[:, None], other=0.0)           # O_i (normalised)
            m_old = tl.load(m_ptr + row, mask=m_ok, other=float("-inf"))     # m_i
            l_old = tl.load(l_ptr + row, mask=m_ok, other=0.0)               # l_i
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (n[None, :] <= offs_m[:, None] + shift)
            s = tl.where(visible, s, float("-inf"))
            m_blk = tl.max(s, axis=1)                                         # m~_ij
            m_blk_safe = tl.where(m_blk == float("-inf"), 0.0, m_blk)
            p = tl.exp2(s - m_blk_safe[:, None])                              # P~_ij
            l_blk = tl.sum(p, axis=1)                                         # l~_ij
            m_new = tl.maximum(m_old, m_blk)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_old = l_old * tl.exp2(m_old - m_new_safe)
            a_blk = tl.exp2(m_blk - m_new_safe)
            l_new = a_old + a_blk * l_blk
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            l_div = tl.where(l_new > 0, l_new, 1.0)
            # O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j): renormalised every step
            o_new = (a_old[:, None] * o_old + a_blk[:, None] * pv) / l_div[:, None]
            tl.store(o_ptrs, o_new, mask=m_ok[:, None])
            tl.store(m_ptr + row, m_new, mask=m_ok)
            tl.store(l_ptr + row, l_new, mask=m_ok)
            tl.debug_barrier()                            # the next K/V block reads what was just written


# ----------------------------------------------------------------------------------------------
# Backward (FlashAttention-2)


@triton.jit
def _flash_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    Hq, Nq, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta_i = D_i = rowsum(dO_i * O_i), (B*Hq, Nq) fp32."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + rows
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < Nq)[:, None] & (offs_d < D)[None, :]
    first_m = (start_m * BLOCK_M).to(tl.int64)
    o_tile = o_ptr + _head_offset(b, h, stride_ob, stride_oh) + first_m * stride_om
    do_tile = do_ptr + _head_offset(b, h, stride_gb, stride_gh) + first_m * stride_gm
    o = tl.load(o_tile + rows[:, None] * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_tile + rows[:, None] * stride_gm + offs_d[None, :] * stride_gd, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * Nq + offs_m, tl.sum(o * do, axis=1), mask=offs_m < Nq)


@triton.jit
def _flash_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, slopes_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    Hq, Hkv, Nq, Nk, D, GROUP, sm_scale, qk_scale, cap_log2, window,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr, USE_DELTA: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SKIP_OUTSIDE: tl.constexpr,
):
    """One program per (K/V block j, batch, K/V head); dK_j, dV_j summed over the group's query heads.
    dk_ptr, dv_ptr are contiguous (B, Hkv, Nk, D)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    cols = tl.arange(0, BLOCK_N)                  # (BLOCK_N,) key rows within the block
    offs_n = start_n + cols
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Nk
    d_ok = offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    first_n = start_n.to(tl.int64)
    k_tile = k_ptr + _head_offset(b, hk, stride_kb, stride_kh) + first_n * stride_kn
    v_tile = v_ptr + _head_offset(b, hk, stride_vb, stride_vh) + first_n * stride_vn
    k = tl.load(k_tile + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)   # K_j
    v = tl.load(v_tile + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)   # V_j
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    rows = tl.arange(0, BLOCK_M)
    shift = Nk - Nq
    if CAUSAL:
        # the first query row that sees key start_n is start_n - shift; earlier Q blocks see none of K_j
        lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    hi = Nq
    if HAS_WINDOW:
        if SKIP_OUTSIDE:
            # row i sees key j when j - shift <= i < j - shift + window: no row from the last key's
            # j - shift + window on sees any of K_j
            hi = tl.minimum(Nq, start_n + BLOCK_N - 1 - shift + window)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_head = q_ptr + _head_offset(b, h, stride_qb, stride_qh)
        do_head = do_ptr + _head_offset(b, h, stride_gb, stride_gh)
        row_head = (b * Hq + h).to(tl.int64) * Nq             # this query head's rows of lse and delta
        if HAS_ALIBI:
            slope_log2 = tl.load(slopes_ptr + h) * 1.4426950408889634    # each query head has its own
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + rows
            m_ok = offs_m < Nq
            qm = m_ok[:, None] & d_ok[None, :]
            first_m = tl.cast(start_m, tl.int64)           # loop variable (a Python int in the interpreter)
            q = tl.load(q_head + first_m * stride_qm + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                        mask=qm, other=0.0)
            do = tl.load(do_head + first_m * stride_gm + rows[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                         mask=qm, other=0.0)
            lse = tl.load(lse_ptr + row_head + offs_m, mask=m_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)    # fully masked row: P = 0
            delta = tl.load(delta_ptr + row_head + offs_m, mask=m_ok, other=0.0)
            s = _scores(q, k, qk_scale, cap_log2, SOFTCAP, DOT_PRECISION)   # (BLOCK_M, BLOCK_N), log2 units
            if HAS_ALIBI:
                s = s + _alibi_bias(slope_log2, offs_m, offs_n, shift)
            visible = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > offs_m[:, None] + shift - window)
            p = tl.where(visible, tl.exp2(s - lse[:, None] * 1.4426950408889634), 0.0)   # P_ij = exp(S_ij - lse_i)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)  # dV_j += P^T dO_i
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                   # dP_ij = dO_i V_j^T
            if USE_DELTA:
                ds = p * (dp - delta[:, None])                                 # dS = P * (dP - D_i)
            else:
                ds = p * dp                                                    # broken on purpose
            if SOFTCAP:
                ds = _through_cap(ds, s, cap_log2)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)  # dK_j += dS^T Q_i
    dk = dk * sm_scale
    out = (bhk.to(tl.int64) * Nk + first_n) * D                                # contiguous (B*Hkv, Nk, D)
    tl.store(dk_ptr + out + cols[:, None] * D + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out + cols[:, None] * D + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, slopes_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    Hq, Nq, Nk, D, GROUP, sm_scale, qk_scale, cap_log2, window,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr, USE_DELTA: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SKIP_OUTSIDE: tl.constexpr,
):
    """One program per (Q block i, batch, query head): dQ_i = sm_scale * sum_j dS_ij K_j. dq_ptr is
    contiguous (B, Hq, Nq, D)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m * BLOCK_M + rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Nq
    d_ok = offs_d < D
    qm = m_ok[:, None] & d_ok[None, :]
    first_m = (start_m * BLOCK_M).to(tl.int64)
    q_tile = q_ptr + _head_offset(b, h, stride_qb, stride_qh) + first_m * stride_qm
    do_tile = do_ptr + _head_offset(b, h, stride_gb, stride_gh) + first_m * stride_gm
    q = tl.load(q_tile + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=qm, other=0.0)
    do = tl.load(do_tile + rows[:, None] * stride_gm + offs_d[None, :] * stride_gd, mask=qm, other=0.0)
    row_head = bh.to(tl.int64) * Nq
    lse = tl.load(lse_ptr + row_head + offs_m, mask=m_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_ptr + row_head + offs_m, mask=m_ok, other=0.0)
    if HAS_ALIBI:
        slope_log2 = tl.load(slopes_ptr + h) * 1.4426950408889634
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    k_ptrs = k_ptr + _head_offset(b, hk, stride_kb, stride_kh) + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + _head_offset(b, hk, stride_vb, stride_vh) + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    shift = Nk - Nq
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Nk, (start_m + 1) * BLOCK_M + shift), 0)
    else:
        hi = Nk
    lo = 0
    if HAS_WINDOW:
        if SKIP_OUTSIDE:
            lo = _window_start(start_m * BLOCK_M, shift, window, BLOCK_N)
            k_ptrs += tl.cast(lo, tl.int64) * stride_kn
            v_ptrs += tl.cast(lo, tl.int64) * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        n_ok = n < Nk
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        s = _scores(q, k, qk_scale, cap_log2, SOFTCAP, DOT_PRECISION)
        if HAS_ALIBI:
            s = s + _alibi_bias(slope_log2, offs_m, n, shift)
        visible = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + shift)
        if HAS_WINDOW:
            visible = visible & (n[None, :] > offs_m[:, None] + shift - window)
        p = tl.where(visible, tl.exp2(s - lse[:, None] * 1.4426950408889634), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if USE_DELTA:
            ds = p * (dp - delta[:, None])
        else:
            ds = p * dp
        if SOFTCAP:
            ds = _through_cap(ds, s, cap_log2)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)          # dQ_i += dS_ij K_j
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    dq = dq * sm_scale
    tl.store(dq_ptr + (row_head + first_m) * D + rows[:, None] * D + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=qm)


# ----------------------------------------------------------------------------------------------
# Launchers


def _check_inputs(q, k, v, sm_scale, name="flash_attention") -> None:
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    B, Hq, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{name}: q is (B={B}, Hq={Hq}, Nq={Nq}, D={D}) but k is (B={Bk}, Hkv={Hkv}, Nk={Nk}, D={Dk})")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv} (MHA, GQA or MQA)")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim D={D} must lie in [1, {MAX_HEAD_DIM}]")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"{name}: sequence lengths must be at least 1, got Nq={Nq}, Nk={Nk}")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ValueError(f"{name}: sm_scale must be a finite number or None, got {sm_scale!r}")


@dataclass(frozen=True)
class Tiles:
    """One launch's tiles and options: BLOCK_M query rows, BLOCK_N key rows, BLOCK_D head dim (padded)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


def _blocks(nq: int, nk: int, d: int, block_m: int | None, block_n: int | None, default_m: int = 64,
            default_n: int = 64) -> tuple[int, int, int]:
    """Power-of-two tiles of at least 16 (tl.dot's minimum), no larger than the problem needs."""
    bm = block_m or default_m
    bn = block_n or default_n
    for nm, val in (("block_m", bm), ("block_n", bn)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"flash_attention: {nm} must be a power of two >= 16, got {val}")
    bm = min(bm, max(16, triton.next_power_of_2(nq)))
    bn = min(bn, max(16, triton.next_power_of_2(nk)))
    return bm, bn, max(16, triton.next_power_of_2(d))


# The launches, chosen from the AOT builds of compile_jobs (tests/test_flash_attention.py): no spills
# on sm_80 or sm_90a at head dims 64 and 128, with and without ALiBi, causal fp16, 2 cp.async stages.
# * Forward: 128 query rows by 64 keys at 8 warps, 16 rows per warp: the Q block splits along its
#   rows only (warpsPerCTA [8, 1] for both products), as FlashAttention-2 splits its Q block. 64 rows
#   at 8 warps would split the keys too ([4, 2]) and need a cross-warp reduction of the row max/sum.
# * dK/dV: the program owns BLOCK_N keys and walks the queries BLOCK_M at a time. At D = 128, 64 x 64
#   tiles spill with 2 stages (18 STL+LDL on sm_80, 28 on sm_90a at 8 warps): 32 query rows by 64 keys
#   at 8 warps; at D <= 64, 64 x 32 at 4 warps.
# * dQ: 64 x 64, 4 warps (8 at D = 128); it does not spill at 64 rows (179 registers on sm_90a).
# * D = 256 (and 192, which runs as 256), measured with the soft-cap and the window on (Gemma 2 9B),
#   the most registers: the D = 128 tiles spill (forward 128 x 64: 143 STL+LDL on sm_80; dK/dV 32 x 64:
#   2046 on sm_80, 137 on sm_90a). The forward takes 64 x 32 at 8 warps (64 x 32 at 4 warps spills on
#   sm_80 once the cap is on), dK/dV 16 x 32 at 8 warps (its two fp32 accumulators are 32 x 256 each),
#   dQ 64 x 32 at 8 warps.
# ``block_m`` / ``block_n`` given by the caller apply to every kernel.
FWD_TILE = {64: (128, 64, 8), 128: (128, 64, 8), 256: (64, 32, 8)}   # BLOCK_M, BLOCK_N, warps by padded head dim
DKDV_TILE = {64: (64, 32, 4), 128: (32, 64, 8), 256: (16, 32, 8)}
DQ_TILE = {64: (64, 64, 4), 128: (64, 64, 8), 256: (64, 32, 8)}
# With the soft-cap or the window on (a tanh, or one more comparison, per score), two of the D <= 128
# launches spill on sm_80: the forward at D = 128 (128 x 64: 49 STL+LDL with the cap, 22 with the
# window) and dQ at D = 64 (64 x 64, 4 warps: 45 with both). They take half as many keys per step.
OPTION_TILE = {("fwd", 128): (128, 32, 8), ("dq", 64): (64, 32, 4)}
GPU_STAGES = 2


def _tile_key(d: int) -> int:
    """The row of the tile tables a head dim uses: 64 up to 64, 128 up to 128, 256 beyond (192 runs as 256)."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _table_tile(kernel: str, table: dict, d: int, options: bool) -> tuple[int, int, int]:
    """The (BLOCK_M, BLOCK_N, warps) of ``kernel`` at head dim d; ``options``: soft-cap or window on."""
    key = _tile_key(d)
    return OPTION_TILE.get((kernel, key), table[key]) if options else table[key]


def _tiles(nq: int, nk: int, d: int, block_m, block_n, default: tuple[int, int, int], stages: int | None = None) -> Tiles:
    """The table's tile clipped to the problem; warps shrink with the tile's area (a problem smaller
    than the tile), so at real sizes the launch is the table's. ``stages`` None: the device's."""
    bm, bn, bd = _blocks(nq, nk, d, block_m, block_n, default_m=default[0], default_n=default[1])
    if stages is None:
        stages = 1 if runtime.runtime().interpreted else GPU_STAGES
    shrink = max(1, (default[0] * default[1]) // (bm * bn))
    return Tiles(bm, bn, bd, max(1, default[2] // shrink), stages)


def fwd_tiles(nq: int, nk: int, d: int, block_m: int | None = None, block_n: int | None = None, *,
              options: bool = False, stages: int | None = None) -> Tiles:
    """The forward's launch (:data:`FWD_TILE`, :data:`OPTION_TILE` with ``options``), clipped to the problem."""
    return _tiles(nq, nk, d, block_m, block_n, _table_tile("fwd", FWD_TILE, d, options), stages)


def bwd_tiles(nq: int, nk: int, d: int, block_m: int | None = None, block_n: int | None = None, *,
              options: bool = False, stages: int | None = None) -> dict:
    """``{"dkdv": Tiles, "dq": Tiles}``: the backward kernels' launches (:data:`DKDV_TILE`, :data:`DQ_TILE`,
    :data:`OPTION_TILE` with ``options``)."""
    return {name: _tiles(nq, nk, d, block_m, block_n, _table_tile(name, table, d, options), stages)
            for name, table in (("dkdv", DKDV_TILE), ("dq", DQ_TILE))}


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # fp32 inputs: full fp32 products, not tf32


def _score_args(softcap, window, cap_units: float = LOG2E) -> tuple:
    """The kernels' (cap_log2, window) runtime arguments: cap log2(e) (the scores are in log2 units;
    ``cap_units=1`` caps them in those units, a broken variant) and the window, unused when None."""
    return (1.0 if softcap is None else softcap * cap_units), (0 if window is None else window)


def _score_options(softcap, window, skip_outside: bool) -> dict:
    return dict(SOFTCAP=softcap is not None, HAS_WINDOW=window is not None, SKIP_OUTSIDE=skip_outside)


def _fwd_args(q, k, v, o, lse, slopes, causal: bool, sm_scale: float, tiles: Tiles, *, rescale: bool = True,
              mask_kv: bool = True, softcap=None, window=None, cap_units: float = LOG2E, skip_outside: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_flash_fwd_kernel`, shared by the launcher and
    :func:`compile_jobs` so the AOT build is the launch. ``slopes``, ``softcap``, ``window`` None: not used."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    args = (q, k, v, o, lse, slopes,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0), lse.stride(1),
            Hq, Nq, Nk, D, Hq // Hkv, sm_scale * LOG2E, *_score_args(softcap, window, cap_units))
    kwargs = dict(CAUSAL=causal, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
                  DOT_PRECISION=_precision(q.dtype), HAS_ALIBI=slopes is not None, RESCALE=rescale,
                  MASK_KV=mask_kv, **_score_options(softcap, window, skip_outside),
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return (triton.cdiv(Nq, tiles.block_m), B * Hq), args, kwargs


def _bwd_args(do, q, k, v, lse, delta, dq, dk, dv, slopes, causal: bool, sm_scale: float, tiles: dict, *,
              use_delta: bool = True, softcap=None, window=None, skip_outside: bool = True):
    """``{"dkdv": (grid, args, kwargs), "dq": (...)}``: one launch each of :func:`_flash_bwd_dkdv_kernel`
    and :func:`_flash_bwd_dq_kernel` with ``tiles`` (:func:`bwd_tiles`), for the launcher and compile_jobs."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())

    def options(t: Tiles) -> dict:
        return dict(CAUSAL=causal, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=t.block_d,
                    DOT_PRECISION=_precision(q.dtype), HAS_ALIBI=slopes is not None, USE_DELTA=use_delta,
                    **_score_options(softcap, window, skip_outside), num_warps=t.num_warps, num_stages=t.num_stages)
    kv, qt = tiles["dkdv"], tiles["dq"]
    scores = _score_args(softcap, window)
    return {
        "dkdv": ((triton.cdiv(Nk, kv.block_n), B * Hkv),
                 (q, k, v, do, lse, delta, dk, dv, slopes, *strides, Hq, Hkv, Nq, Nk, D, Hq // Hkv, sm_scale,
                  sm_scale * LOG2E, *scores), options(kv)),
        "dq": ((triton.cdiv(Nq, qt.block_m), B * Hq),
               (q, k, v, do, lse, delta, dq, slopes, *strides, Hq, Nq, Nk, D, Hq // Hkv, sm_scale,
                sm_scale * LOG2E, *scores), options(qt)),
    }


def _forward(q, k, v, causal: bool, sm_scale: float, *, slopes=None, block_m=None, block_n=None,
             rescale: bool = True, mask_kv: bool = True, softcap=None, window=None, cap_units: float = LOG2E,
             skip_outside: bool = True):
    B, Hq, Nq, D = q.shape
    o = torch.empty((B, Hq, Nq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    tiles = fwd_tiles(Nq, k.shape[2], D, block_m, block_n, options=softcap is not None or window is not None)
    grid, args, kwargs = _fwd_args(q, k, v, o, lse, slopes, causal, sm_scale, tiles, rescale=rescale, mask_kv=mask_kv,
                                   softcap=softcap, window=window, cap_units=cap_units, skip_outside=skip_outside)
    _flash_fwd_kernel[grid](*args, **kwargs)
    return o, lse


def _backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, *, slopes=None, block_m=None, block_n=None,
              use_delta: bool = True, softcap=None, window=None, skip_outside: bool = True):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    tiles = bwd_tiles(Nq, Nk, D, block_m, block_n, options=softcap is not None or window is not None)
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    pre = tiles["dq"]
    _flash_bwd_preprocess_kernel[(triton.cdiv(Nq, pre.block_m), B * Hq)](
        o, do, delta, *o.stride(), *do.stride(), Hq, Nq, D, BLOCK_M=pre.block_m, BLOCK_D=pre.block_d,
    )
    lse = lse.contiguous()
    dq = torch.empty((B, Hq, Nq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, Nk, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Nk, D), dtype=v.dtype, device=q.device)
    launches = _bwd_args(do, q, k, v, lse, delta, dq, dk, dv, slopes, causal, sm_scale, tiles, use_delta=use_delta,
                         softcap=softcap, window=window, skip_outside=skip_outside)
    for kernel, name in ((_flash_bwd_dkdv_kernel, "dkdv"), (_flash_bwd_dq_kernel, "dq")):
        grid, args, kwargs = launches[name]
        kernel[grid](*args, **kwargs)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """``alibi_fwd`` / ``alibi_bwd`` (with slopes given) switch the bias off in one pass only: the
    deliberately broken variants the checks must catch."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, causal, sm_scale, block_m, block_n, alibi_fwd=True, alibi_bwd=True,
                softcap=None, window=None):
        o, lse = _forward(q, k, v, causal, sm_scale, slopes=slopes if alibi_fwd else None,
                          block_m=block_m, block_n=block_n, softcap=softcap, window=window)
        ctx.save_for_backward(q, k, v, o, lse)      # O(N d) saved: no P, no S
        ctx.slopes = slopes if alibi_bwd else None
        ctx.args = (causal, sm_scale, block_m, block_n, softcap, window)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, sm_scale, block_m, block_n, softcap, window = ctx.args
        dq, dk, dv = _backward(do, q, k, v, o, lse, causal, sm_scale, slopes=ctx.slopes, block_m=block_m,
                               block_n=block_n, softcap=softcap, window=window)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _check_slopes(slopes, Hq: int, q: torch.Tensor) -> torch.Tensor:
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"flash_attention: alibi_slopes must be a torch.Tensor, got {type(slopes).__name__}")
    if slopes.shape != (Hq,):
        raise ValueError(f"flash_attention: alibi_slopes must be (Hq,) = ({Hq},), one per query head, "
                         f"got {tuple(slopes.shape)}")
    if not slopes.dtype.is_floating_point or not bool(torch.isfinite(slopes).all()):
        raise ValueError("flash_attention: alibi_slopes must be finite floating-point numbers")
    if slopes.device != q.device:
        raise ValueError(f"flash_attention: alibi_slopes is on {slopes.device}, q on {q.device}")
    return slopes.to(torch.float32).contiguous()


def _check_options(softcap, window, causal, slopes) -> tuple:
    """The soft-cap and window, checked: (cap as a float or None, window as an int or None)."""
    if softcap is not None:
        softcap = check_cap(softcap, "flash_attention")
        if slopes is not None:
            raise ValueError("flash_attention: softcap with alibi_slopes is not offered (no model uses both, "
                             "and the order of cap and bias would be a choice)")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"flash_attention: window must be an int >= 1 (keys i' - window < j <= i'), got {window!r}")
        if not causal:
            raise ValueError("flash_attention: window needs causal=True (a query sees the window behind it)")
    return softcap, window


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None, *, return_lse: bool = False,
                    block_m: int | None = None, block_n: int | None = None,
                    alibi_slopes: torch.Tensor | None = None, softcap: float | None = None,
                    window: int | None = None):
    """Exact attention, FlashAttention-2 style, differentiable in q, k and v.

    q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq a multiple of Hkv (K/V heads are shared by
    groups of query heads and never repeated in memory); any strides; fp16, bf16 or fp32; D <= 256
    (192 runs as 256, the extra columns masked).
    ``causal`` masks bottom-right aligned (query i sees key j <= i + Nk - Nq). ``sm_scale``
    defaults to 1/sqrt(D). Returns O (B, Hq, Nq, D) in q's dtype, and with ``return_lse`` also the
    log-sum-exp (B, Hq, Nq) in fp32 (-inf on fully masked rows, whose output is 0).
    ``alibi_slopes`` (Hq,), one per query head, adds ALiBi's bias -slope_h |j - (i + Nk - Nq)| to
    every score, forward and backward (the kernels' ``HAS_ALIBI``).
    ``softcap`` (> 0, Gemma 2's 50) replaces every score S = sm_scale q.k by softcap tanh(S / softcap)
    before the mask and the softmax (``SOFTCAP``). ``window`` (>= 1, needs ``causal``): query i sees
    only keys j with i' - window < j <= i', i' = i + Nk - Nq, and the kernels skip the key (or query)
    tiles that lie wholly outside (``HAS_WINDOW``).
    """
    _check_inputs(q, k, v, sm_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    slopes = None if alibi_slopes is None else _check_slopes(alibi_slopes, q.shape[1], q)
    softcap, window = _check_options(softcap, window, causal, slopes)
    if window is not None:
        window = min(window, k.shape[2])     # a window of Nk keys already shows every causal key: same mask, int32
    o, lse = _FlashAttention.apply(q, k, v, slopes, bool(causal), scale, block_m, block_n, True, True, softcap, window)
    return (o, lse) if return_lse else o


def flash_attention_v1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       sm_scale: float | None = None, *, return_lse: bool = False,
                       block_m: int | None = None, block_n: int | None = None):
    """FlashAttention-1 loop order (K/V outer, partial O, l, m through HBM), forward only.

    Same interface and result as :func:`flash_attention`; kept so the chapters can compare loop orders.
    """
    _check_inputs(q, k, v, sm_scale, name="flash_attention_v1")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    bm, bn, bd = _blocks(Nq, Nk, D, block_m, block_n)
    o_acc = torch.zeros((B * Hq, Nq, bd), dtype=torch.float32, device=q.device)
    m = torch.full((B * Hq, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros((B * Hq, Nq), dtype=torch.float32, device=q.device)
    _flash_fwd_v1_kernel[(B * Hq,)](
        q, k, v, o_acc, m, l, *q.stride(), *k.stride(), *v.stride(),
        Hq, Nq, Nk, D, Hq // Hkv, scale * LOG2E,
        CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, DOT_PRECISION=_precision(q.dtype),
    )
    o = o_acc[..., :D].reshape(B, Hq, Nq, D).to(q.dtype)
    if not return_lse:
        return o
    lse = torch.where(l > 0, (m + torch.log2(torch.where(l > 0, l, 1.0))) * LN2, float("-inf"))
    return o, lse.reshape(B, Hq, Nq)


# ----------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes: fp16 prefill of 8192 tokens, causal

# (label, query heads, K/V heads, head dim)
REAL_CONFIGS = (
    ("Llama-3.2-1B", 32, 8, 64),
    ("Llama-3-8B", 32, 8, 128),
)


def launch_jobs(hq: int, hkv: int, head_dim: int, *, batch: int = 1, seq: int = 8192, alibi: bool = False,
                softcap: float | None = None, window: int | None = None,
                fwd: Tiles | None = None, bwd: dict | None = None, dtype=torch.float16, target: str = "sm90"):
    """``{"fwd": job, "dkdv": job, "dq": job}``: the jobs of a GPU launch at these sizes on meta
    tensors (contiguous (B, H, N, D) q, k, v, o, dO; causal), with the GPU tiles of :data:`FWD_TILE`,
    :data:`DKDV_TILE`, :data:`DQ_TILE` (:data:`OPTION_TILE` with a soft-cap or window) unless ``fwd`` (Tiles) or ``bwd`` ({"dkdv": Tiles, "dq": Tiles}) say otherwise."""
    from kernels import inspect as ki

    q = torch.empty(batch, hq, seq, head_dim, dtype=dtype, device="meta")
    k = torch.empty(batch, hkv, seq, head_dim, dtype=dtype, device="meta")
    lse = torch.empty(batch, hq, seq, device="meta")
    slopes = torch.empty(hq, device="meta") if alibi else None

    options = softcap is not None or window is not None
    fwd = fwd or fwd_tiles(seq, seq, head_dim, options=options, stages=GPU_STAGES)
    bwd = bwd or bwd_tiles(seq, seq, head_dim, options=options, stages=GPU_STAGES)
    grid, args, kwargs = _fwd_args(q, k, k, q, lse, slopes, True, head_dim ** -0.5, fwd, softcap=softcap, window=window)
    jobs = {"fwd": ki.launch_job(_flash_fwd_kernel, *args, target=target, grid=grid, **kwargs)}
    launches = _bwd_args(q, q, k, k, lse, lse, q, k, k, slopes, True, head_dim ** -0.5, bwd, softcap=softcap,
                         window=window)
    for kernel, name in ((_flash_bwd_dkdv_kernel, "dkdv"), (_flash_bwd_dq_kernel, "dq")):
        grid, args, kwargs = launches[name]
        jobs[name] = ki.launch_job(kernel, *args, target=target, grid=grid, **kwargs)
    return jobs


# Gemma 2 9B's local layers: 16 query heads, 8 K/V heads, head dim 256, scores capped at 50, a window
# of 4096 (its global layers are the same without the window). DeepSeek-V3's prefill head dim 192
# (Q/K; V is 128 there, and this kernel takes one head dim for all three) runs this D = 256 build.
GEMMA2_9B = dict(hq=16, hkv=8, head_dim=256, softcap=50.0, window=4096)
# Gemma 2 27B's local layers: 32 query heads, 16 K/V heads, head dim 128, the same cap and window.
GEMMA2_27B = dict(hq=32, hkv=16, head_dim=128, softcap=50.0, window=4096)


def compile_jobs() -> dict:
    """Forward, dK/dV and dQ at :data:`REAL_CONFIGS` (batch 1, 8192 tokens, causal), with ALiBi at D = 128,
    at :data:`GEMMA2_9B` (D = 256, soft-cap, window) with and without its two options, at :data:`GEMMA2_27B`
    (D = 128, soft-cap, window), and dQ at D = 64 with both options (:data:`OPTION_TILE`)."""
    jobs = {}
    for label, hq, hkv, d in REAL_CONFIGS:
        for part, job in launch_jobs(hq, hkv, d).items():
            jobs[f"{label} prefill {part}, D={d}"] = job
    for part, job in launch_jobs(32, 8, 128, alibi=True).items():
        jobs[f"Llama-3-8B-sized ALiBi prefill {part}, D=128"] = job
    for name, g in (("Gemma-2-9B", GEMMA2_9B), ("Gemma-2-27B", GEMMA2_27B)):
        d = g["head_dim"]
        for part, job in launch_jobs(g["hq"], g["hkv"], d, softcap=g["softcap"], window=g["window"]).items():
            jobs[f"{name} local prefill {part}, D={d}, cap 50, window 4096"] = job
    g = GEMMA2_9B
    for part, job in launch_jobs(g["hq"], g["hkv"], g["head_dim"]).items():
        jobs[f"Gemma-2-9B-sized plain prefill {part}, D=256"] = job
    # the other launch OPTION_TILE changes: dQ at D = 64 with the cap and window
    jobs["Llama-3.2-1B-sized capped, windowed prefill dq, D=64"] = launch_jobs(32, 8, 64, softcap=50.0, window=4096)["dq"]
    return jobs
