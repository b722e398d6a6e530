"""Scaled dot-product attention in plain PyTorch: the reference every attention kernel is checked against.

For one head, with queries Q (Nq, D), keys K (Nk, D), values V (Nk, D):

    S = sm_scale * Q K^T                  (Nq, Nk)   sm_scale = 1/sqrt(D) unless given
    P = softmax(S + mask)  row by row     (Nq, Nk)
    O = P V                               (Nq, D)
    lse_i = log sum_j exp(S_ij + mask_ij) (Nq,)      the log-sum-exp FlashAttention saves for its backward

Shapes: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq a multiple of Hkv. Query head h reads K/V
head h // (Hq / Hkv): Hkv = Hq is multi-head attention, 1 < Hkv < Hq grouped-query attention,
Hkv = 1 multi-query attention.

The causal mask is aligned to the **bottom right** when Nq != Nk, as in FlashAttention-2: query i
sees key j when j <= i + (Nk - Nq). With Nq = Nk this is the usual lower triangle (the diagonal
stays visible). With Nq < Nk (a chunk of new queries after a cached prefix) the last query sees
every key. With Nq > Nk the first Nq - Nk queries see no key at all: those rows are *fully masked*;
this module defines their output as 0 and their lse as -inf (FlashAttention-2's convention),
where a plain softmax would give 0/0 = NaN. PyTorch's ``is_causal=True`` aligns to the top left
instead; ``torch.nn.attention.bias.causal_lower_right`` is the bottom-right form.

Two options of real models: a soft-cap (Gemma 2) replaces S by cap tanh(S / cap) before the mask and
the softmax; a sliding window of W keeps, of the causal keys, only the last W: j > i + (Nk - Nq) - W.
"""
from __future__ import annotations

import math

import torch


def causal_mask(nq: int, nk: int, device=None, *, window: int | None = None) -> torch.Tensor:
    """(nq, nk) bool, True where query i may see key j: j <= i + (nk - nq) (bottom-right aligned), and
    with a ``window`` W also j > i + (nk - nq) - W (the W most recent keys, the query's own included)."""
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    visible = j <= i
    return visible if window is None else visible & (j > i - window)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    *,
    upcast: bool = True,
    return_lse: bool = False,
    softcap: float | None = None,
    window: int | None = None,
):
    """Attention written out in PyTorch, for MHA, GQA and MQA.

    ``upcast=True`` (the reference): computed in fp32 from the given inputs (float64 stays float64)
    and returned in that wide dtype. ``upcast=False``: every product and the softmax in the inputs'
    own dtype -- PyTorch's own low-precision result, the *baseline* of the FlashAttention test rule.
    With ``return_lse`` also returns lse (B, Hq, Nq) in fp32 (float64 kept). ``softcap``: S becomes
    softcap tanh(S / softcap); ``window`` (with ``causal``): the causal mask keeps the last ``window`` keys.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention_ref: q, k, v must be 4-D (B, H, N, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"attention_ref: Hq={Hq} must be a multiple of Hkv={Hkv}")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    dt = wide if upcast else q.dtype
    group = Hq // Hkv
    qf = q.to(dt)
    kf = k.to(dt).repeat_interleave(group, dim=1)          # (B, Hq, Nk, D): fine for a reference
    vf = v.to(dt).repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale                # S = sm_scale Q K^T, (B, Hq, Nq, Nk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)              # cap tanh(S / cap), before the mask
    Nk = k.shape[2]
    if window is not None and not causal:
        raise ValueError("attention_ref: window needs causal=True")
    if causal:
        visible = causal_mask(Nq, Nk, device=q.device, window=window)
        s = s.masked_fill(~visible, float("-inf"))
        empty = ~visible.any(dim=1)                        # (Nq,) fully masked rows
    else:
        empty = torch.zeros(Nq, dtype=torch.bool, device=q.device)
    # Fully masked rows: softmax of all -inf is NaN; give them zero weights (output 0), like FA2.
    s_for_softmax = s.masked_fill(empty[:, None], 0.0)
    p = torch.softmax(s_for_softmax, dim=-1)               # P = softmax(S), row by row
    p = p.masked_fill(empty[:, None], 0.0)
    o = p @ vf                                             # O = P V, (B, Hq, Nq, D)
    if not return_lse:
        return o
    lse = torch.logsumexp(s.to(wide), dim=-1)              # -inf on fully masked rows
    return o, lse


def tiled_attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None, *, block_n: int = 64,
                        rescale: bool = True):
    """The FlashAttention recurrence in PyTorch: K/V in blocks of ``block_n``, the online softmax per tile.

    Per block j, the tile's statistics come from :func:`kernels.softmax.softmax_stats` and merge into
    the running (m, l) with :func:`kernels.softmax.merge_softmax_stats`; the output accumulator is
    rescaled by the same factor exp(m_old - m_new) as l. ``rescale=False`` forgets that factor on the
    accumulator (the classic bug) and is wrong as soon as a later block raises the max.
    Computed in fp32 (float64 kept), returned wide, with the lse; no (Nq, Nk) tensor is kept across blocks.
    """
    from kernels.softmax import merge_softmax_stats, softmax_stats

    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(wide)
    kf = k.to(wide).repeat_interleave(Hq // Hkv, dim=1)
    vf = v.to(wide).repeat_interleave(Hq // Hkv, dim=1)
    m = torch.full((B, Hq, Nq, 1), float("-inf"), dtype=wide, device=q.device)   # running max
    l = torch.zeros((B, Hq, Nq, 1), dtype=wide, device=q.device)                  # running sum
    acc = torch.zeros((B, Hq, Nq, D), dtype=wide, device=q.device)                # unnormalised output
    visible = causal_mask(Nq, Nk, device=q.device) if causal else None
    for j in range(0, Nk, block_n):
        s = (qf @ kf[:, :, j:j + block_n].transpose(-1, -2)) * scale              # S_ij, (B, Hq, Nq, block)
        if causal:
            s = s.masked_fill(~visible[:, j:j + block_n], float("-inf"))
        m_blk, l_blk = softmax_stats(s)                                            # this tile's (max, sum)
        m_new, l = merge_softmax_stats(m, l, m_blk, l_blk)                         # exact merge
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)                                              # exp(m_old - m_new)
        p = torch.exp(s - m_safe)                                                  # P_ij = exp(S_ij - m_new)
        acc = (acc * alpha if rescale else acc) + p @ vf[:, :, j:j + block_n]
        m = m_new
    o = acc / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))), torch.full_like(l, float("-inf")))
    return o, lse[..., 0]
