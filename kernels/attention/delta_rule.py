"""Gated DeltaNet's state update (Yang, Kautz and Hatamizadeh 2024): decay the state, then correct
its prediction. References only (PyTorch): the recurrence and its chunkwise form, checked equal in fp64.

With the state S (d_v x d_k) of one head, a decay alpha_t in (0, 1] and a write strength beta_t in [0, 1],

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,      o_t = S_t q_t

Read as an update: the decayed state predicts v_t from k_t as alpha_t S_{t-1} k_t; the delta rule writes
only the error, S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T. Plain linear attention
(kernels.attention.linear) is alpha = 1 with the correction term left out: it only ever adds.

Chunkwise form (the WY / UT-transform idea of the paper, derived here for one chunk of C tokens with
state S_0 on entry). Write u_i = beta_i (v_i - alpha_i S_{i-1} k_i) for the corrected values, so that
S_i = alpha_i S_{i-1} + u_i k_i^T; with g_i = alpha_1 ... alpha_i (cumulative decay inside the chunk),

    S_i = g_i S_0 + sum_{j <= i} (g_i / g_j) u_j k_j^T
    u_i + beta_i sum_{j < i} (g_i / g_j) (k_i . k_j) u_j = beta_i (v_i - g_i S_0 k_i)

The second line is a unit lower-triangular system (I + A) U = diag(beta) (V - diag(g) K S_0^T) with
A_ij = beta_i (g_i / g_j) (k_i . k_j) for j < i: one triangular solve per chunk (the "UT transform")
instead of C sequential rank-1 updates. Then, all as matrix products,

    O      = diag(g) Q S_0^T + [(Q K^T) * M] U,      M_ij = g_i / g_j for j <= i, else 0
    S_next = g_C S_0 + U^T diag(g_C / g) K
"""
from __future__ import annotations

import torch


def gated_delta_rule_ref(q, k, v, alpha, beta):
    """The recurrence, one token at a time. q, k (B, H, T, d_k), v (B, H, T, d_v), alpha and beta
    (B, H, T). fp64 in gives fp64, else fp32. Returns (o (B, H, T, d_v), S_T (B, H, d_v, d_k))."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, alpha, beta = (x.to(wide) for x in (q, k, v, alpha, beta))
    B, H, T, dk = q.shape
    S = torch.zeros(B, H, v.shape[-1], dk, dtype=wide, device=q.device)     # (B, H, d_v, d_k)
    out = []
    for t in range(T):
        a, b = alpha[:, :, t, None, None], beta[:, :, t, None, None]
        kt, vt = k[:, :, t], v[:, :, t]
        S = a * S                                                            # decay the state
        pred = torch.einsum("bhvk,bhk->bhv", S, kt)                          # its prediction of v_t
        S = S + b * (vt - pred)[..., None] * kt[:, :, None, :]              # write beta (v_t - pred) k_t^T
        out.append(torch.einsum("bhvk,bhk->bhv", S, q[:, :, t]))            # o_t = S_t q_t
    return torch.stack(out, 2), S


def gated_delta_rule_chunked_ref(q, k, v, alpha, beta, chunk: int = 16):
    """The chunkwise form of the module docstring (one triangular solve per chunk). Same arguments and
    returns as :func:`gated_delta_rule_ref`."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, alpha, beta = (x.to(wide) for x in (q, k, v, alpha, beta))
    B, H, T, dk = q.shape
    S = torch.zeros(B, H, v.shape[-1], dk, dtype=wide, device=q.device)
    out = []
    for c0 in range(0, T, chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]      # (B, H, C, .)
        C = qc.shape[2]
        logg = torch.cumsum(torch.log(alpha[:, :, sl]), -1)                     # log g_i
        g = logg.exp()                                                           # (B, H, C)
        ratio = (logg[..., :, None] - logg[..., None, :]).clamp(max=0).exp()    # g_i / g_j where j <= i
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        strict = lower.clone().fill_diagonal_(False)
        A = torch.where(strict, bc[..., None] * ratio * (kc @ kc.transpose(-1, -2)), 0.0)   # A_ij, j < i
        rhs = bc[..., None] * (vc - g[..., None] * (kc @ S.transpose(-1, -2)))    # diag(beta)(V - diag(g) K S_0^T)
        eye = torch.eye(C, dtype=wide, device=q.device)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)   # (I + A) U = rhs
        M = torch.where(lower, ratio, 0.0)
        out.append(g[..., None] * (qc @ S.transpose(-1, -2)) + ((qc @ kc.transpose(-1, -2)) * M) @ U)
        gC = g[..., -1:]                                                         # (B, H, 1)
        S = gC[..., None] * S + U.transpose(-1, -2) @ ((gC / g)[..., None] * kc)  # g_C S_0 + U^T diag(g_C/g) K
    return torch.cat(out, 2), S
