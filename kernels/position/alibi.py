"""ALiBi (Press, Smith and Lewis, 2022): no position embedding at all, a linear penalty on distance.

Head h adds a fixed, untrained bias to its scores:

    S_ij = q_i . k_j / sqrt(D)  -  m_h * (i - j)        (causal: j <= i)

so each head sees a recency prior whose strength is its slope m_h. For n heads, n a power of two,
the slopes are the geometric sequence m_h = 2^(-8 h / n), h = 1..n (8 heads: 1/2, 1/4, ..., 1/256).
For other n the paper takes the 2^floor(log2 n) slopes of the nearest lower power of two and fills
the remaining heads with every other slope of the sequence for twice that power (the odd-h
ones of 2^(-8 h / p'), h = 1, 3, 5, ..., p' = 2 * 2^floor(log2 n); 12 heads: 2^(-1/2), 2^(-3/2),
2^(-5/2), 2^(-7/2)), so the slopes interleave without repeating.

Where the bias goes: into the scores inside the attention kernel
(``kernels.attention.flash_attention(..., alibi_slopes=...)``), never materialised. Its form there,
-m_h |j - (i + Nk - Nq)|, is the paper's with queries aligned bottom-right (a decode step's query
sits at position Nk - 1) and symmetric when there is no causal mask.

Shapes: q (B, Hq, Nq, D), k, v (B, Hkv, Nk, D); slopes (Hq,).
"""
from __future__ import annotations

import math

import torch


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The (n_heads,) float64 slopes m_h of the ALiBi paper, for any head count."""
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"alibi_slopes: n_heads must be a positive integer, got {n_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)                      # m_1 = 2^(-8/n), ratio the same
        return [start ** (h + 1) for h in range(n)]

    p = 2 ** int(math.floor(math.log2(n_heads)))     # closest power of two below (or equal)
    slopes = power_of_two(p)
    if p < n_heads:
        slopes += power_of_two(2 * p)[0::2][: n_heads - p]   # every other slope of the 2p sequence
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(slopes: torch.Tensor, n_q: int, n_k: int, *, device=None) -> torch.Tensor:
    """The explicit (H, n_q, n_k) bias -m_h |j - (i + n_k - n_q)| (what the kernel never stores)."""
    i = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)     # query i's own position
    j = torch.arange(n_k, device=device)[None, :]
    return -slopes.to(device)[:, None, None] * (j - i).abs()


def alibi_attention_ref(q, k, v, slopes, causal: bool = True, sm_scale: float | None = None):
    """Attention with the explicit bias matrix, in fp32 (float64 kept), returned wide.

    softmax(sm_scale q k^T + bias, causal mask bottom-right) v; rows with no visible key give 0.
    """
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, Nq, D = q.shape
    group = Hq // k.shape[1]
    Nk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kf = k.to(wide).repeat_interleave(group, 1)
    vf = v.to(wide).repeat_interleave(group, 1)
    s = (q.to(wide) @ kf.transpose(-1, -2)) * scale + alibi_bias(slopes, Nq, Nk, device=q.device).to(wide)
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None] + (Nk - Nq)
        visible = torch.arange(Nk, device=q.device)[None, :] <= i            # (Nq, Nk)
        s = s.masked_fill(~visible, float("-inf"))
        empty = ~visible.any(1)
        p = torch.softmax(s.masked_fill(empty[:, None], 0.0), -1).masked_fill(empty[:, None], 0.0)
    else:
        p = torch.softmax(s, -1)
    return p @ vf
