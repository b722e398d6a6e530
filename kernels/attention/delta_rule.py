"""Gated DeltaNet's state update (Yang, Kautz and Hatamizadeh 2024): decay the state, then correct
its prediction. PyTorch references (the recurrence and its chunkwise form, checked equal in fp64) and a
Triton kernel of the recurrence (:func:`gated_delta_rule_recurrent`, the decode-time form: one token
after another from a carried state; no chunked Triton kernel here).

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
import triton
import triton.language as tl

from kernels import runtime


def gated_delta_rule_ref(q, k, v, alpha, beta, initial_state=None):
    """The recurrence, one token at a time. q, k (B, H, T, d_k), v (B, H, T, d_v), alpha and beta
    (B, H, T), initial_state (B, H, d_v, d_k) or None (zeros). fp64 in gives fp64, else fp32.
    Returns (o (B, H, T, d_v), S_T (B, H, d_v, d_k))."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, alpha, beta = (x.to(wide) for x in (q, k, v, alpha, beta))
    B, H, T, dk = q.shape
    S = torch.zeros(B, H, v.shape[-1], dk, dtype=wide, device=q.device) if initial_state is None \
        else initial_state.to(wide)                                          # (B, H, d_v, d_k)
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


# ----------------------------------------------------------------------------------------------
# The recurrence in Triton (decode form)


@triton.jit
def _gated_delta_rule_recurrent_kernel(
    Q, K, V, ALPHA, BETA, S0, O, S_OUT,
    T, H, DK, DV,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sab, sah, sat, sbb, sbh, sbt, sob, soh, sot, sod,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_S0: tl.constexpr, BROKEN: tl.constexpr,
):
    """One program per (batch * head, block of d_v rows of S): each row of the state is updated from its
    own prediction only, so blocks of rows are independent. BROKEN = 1 predicts from the undecayed state."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < DK, offs_v < DV
    m2 = mv[:, None] & mk[None, :]
    s_off = pid_bh.to(tl.int64) * DV * DK + offs_v[:, None] * DK + offs_k[None, :]
    if HAS_S0:
        S = tl.load(S0 + s_off, mask=m2, other=0.0)                                   # (BV, BK) fp32
    else:
        S = tl.zeros((BLOCK_V, BLOCK_K), dtype=tl.float32)
    for t in range(0, T):
        t64 = tl.full((), t, tl.int64)
        q = tl.load(Q + b * sqb + h * sqh + t64 * sqt + offs_k * sqd, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(K + b * skb + h * skh + t64 * skt + offs_k * skd, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(V + b * svb + h * svh + t64 * svt + offs_v * svd, mask=mv, other=0.0).to(tl.float32)
        a = tl.load(ALPHA + b * sab + h * sah + t64 * sat).to(tl.float32)
        beta = tl.load(BETA + b * sbb + h * sbh + t64 * sbt).to(tl.float32)
        if BROKEN:
            pred = tl.sum(S * k[None, :], 1)                     # the bug: predicts from S_{t-1}, not alpha S_{t-1}
            S = a * S
        else:
            S = a * S                                            # decay the state
            pred = tl.sum(S * k[None, :], 1)                     # its prediction of v_t, (BV,)
        S += (beta * (v - pred))[:, None] * k[None, :]           # write beta (v_t - pred) k_t^T
        o = tl.sum(S * q[None, :], 1)                            # o_t = S_t q_t
        tl.store(O + b * sob + h * soh + t64 * sot + offs_v * sod, o.to(O.dtype.element_ty), mask=mv)
    tl.store(S_OUT + s_off, S, mask=m2)


def launch_config(DK: int, DV: int, block_v: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps). At d_k = 128 a 32-row state block spilled one register at 4 warps
    (sm_90a, one STL/LDL pair); 8 warps hold it in 48 registers."""
    BK = max(16, triton.next_power_of_2(DK))
    BV = block_v or min(32, max(16, triton.next_power_of_2(DV)))
    return BK, BV, 8 if BK * BV >= 32 * 128 else 4


def gated_delta_rule_recurrent(q, k, v, alpha, beta, initial_state=None, *, block_v: int | None = None,
                               _broken: int = 0):
    """Gated DeltaNet's recurrence in Triton (forward only): q, k (B, H, T, d_k), v (B, H, T, d_v), alpha
    and beta (B, H, T), any strides, fp16 / bf16 / fp32; ``initial_state`` (B, H, d_v, d_k) fp32 or None.
    Returns (o (B, H, T, d_v) in q's dtype, S_T (B, H, d_v, d_k) fp32)."""
    name = "gated_delta_rule_recurrent"
    for arg, t in (("q", q), ("k", k), ("v", v), ("alpha", alpha), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: q, k must be (B, H, T, d_k) and v (B, H, T, d_v), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    if alpha.shape != (B, H, T) or beta.shape != (B, H, T):
        raise ValueError(f"{name}: alpha and beta must be (B, H, T) = {(B, H, T)}, got "
                         f"{tuple(alpha.shape)}, {tuple(beta.shape)}")
    if not 1 <= DK <= 256 or not 1 <= DV <= 256:
        raise ValueError(f"{name}: head dims must lie in [1, 256], got d_k={DK}, d_v={DV}")
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor) or initial_state.shape != (B, H, DV, DK)
                                      or initial_state.dtype != torch.float32):
        raise ValueError(f"{name}: initial_state must be a float32 tensor (B, H, d_v, d_k) = {(B, H, DV, DK)}")
    BK, BV, warps = launch_config(DK, DV, block_v)
    o = torch.empty(B, H, T, DV, dtype=q.dtype, device=q.device)
    s = torch.empty(B, H, DV, DK, dtype=torch.float32, device=q.device)
    s0 = initial_state.contiguous() if initial_state is not None else s
    grid = (B * H, triton.cdiv(DV, BV))
    _gated_delta_rule_recurrent_kernel[grid](
        q, k, v, alpha, beta, s0, o, s, T, H, DK, DV, *q.stride(), *k.stride(), *v.stride(),
        *alpha.stride(), *beta.stride(), *o.stride(),
        BLOCK_K=BK, BLOCK_V=BV, HAS_S0=initial_state is not None, BROKEN=_broken, num_warps=warps)
    return o, s



def compile_jobs() -> dict:
    """One decode step (T = 1) of Qwen3-Next-80B-A3B's Gated DeltaNet layer (32 value heads, d_k = d_v = 128)
    for a batch of 64 sequences, bf16, as gated_delta_rule_recurrent launches it (32-row state blocks)."""
    from kernels import inspect as ki

    B, H, T, d = 64, 32, 1, 128
    x = torch.empty(B, H, T, d, dtype=torch.bfloat16, device="meta")
    g = torch.empty(B, H, T, dtype=torch.bfloat16, device="meta")
    s = torch.empty(B, H, d, d, dtype=torch.float32, device="meta")
    BK, BV, warps = launch_config(d, d)
    grid = (B * H, triton.cdiv(d, BV))
    args = (x, x, x, g, g, s, x, s, T, H, d, d, *x.stride(), *x.stride(), *x.stride(), *g.stride(), *g.stride(),
            *x.stride())
    job = ki.launch_job(_gated_delta_rule_recurrent_kernel, *args, grid=grid, BLOCK_K=BK, BLOCK_V=BV, HAS_S0=True,
                        BROKEN=0, num_warps=warps)
    return {f"Gated DeltaNet decode step, bf16, B={B}, H={H}, d_k=d_v={d}": job}
