"""Soft MoE (Puigcerver et al. 2023): every expert slot is a weighted mixture of all the tokens of a
sequence, and every token's output a weighted mixture of all the slots' outputs.

Shapes: B sequences, m tokens each, d width, n experts with p slots each, s = n p slots.

    L  = X Phi                           (B, m, s) logits, Phi (d, s) learned
    D  = softmax of L over the m tokens  dispatch weights: each slot's weights sum to 1 over tokens
    C  = softmax of L over the s slots   combine weights: each token's weights sum to 1 over slots
    X~ = D^T X                           (B, s, d) slot inputs
    Y~[:, j] = f_{j // p}(X~[:, j])      (B, s, d) slot j goes through expert j // p
    Y  = C Y~                            (B, m, d)

Both mixtures are one operation, out = softmax_rows(S) @ V, with S = L^T (slots x tokens) and V = X
for the dispatch, S = L (tokens x slots) and V = Y~ for the combine. ``soft_mix`` is that operation
as a Triton kernel: one program per (sequence, block of output rows, block of d), an online softmax
over the blocks of the mixed axis (FlashAttention's recurrence, with S read from memory instead of
computed from Q K^T), and ``soft_mix_ref`` is its PyTorch reference.

The logits: L = X Phi as above, or, as in the paper's released router (``scale`` given), the cosine of
every token and slot parameter times one learned scalar: L = scale * X^ Phi^, with X^ each token
L2-normalised over d and Phi^ each slot's column likewise (:func:`slot_logits`). Only the logits
read the normalised X; the dispatch still mixes X itself.

Cost: the experts see s slot vectors per sequence whatever m is, so s = k m gives the expert FLOPs
of a top-k MoE; the two mixtures add 2 m s d multiply-adds each. No token is dropped and no load is
uneven (every expert gets exactly p slots). The price is causality: slot j mixes *all* m tokens, so
token t's output depends on tokens after t, which a language model's next-token training forbids.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# References (PyTorch)


def soft_mix_ref(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores, last axis) @ values in fp32 (fp64 kept): scores (B, R, J), values (B, J, D) -> (B, R, D)."""
    _check_mix("soft_mix_ref", scores, values)
    wide = torch.promote_types(scores.dtype, torch.float32)
    return torch.softmax(scores.to(wide), dim=-1) @ values.to(wide)


NORM_EPS = 1e-6      # under the square root of the L2 normalisation


def slot_logits(x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """L (B, m, s) for x (B, m, d) and phi (d, s): x @ phi, or with ``scale`` (a 0-d tensor)
    scale * (x / |x|) @ (phi / |phi_j|), each token and each slot column L2-normalised over d."""
    if scale is None:
        return x @ phi
    x_hat = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + NORM_EPS)           # (B, m, d), |x_t| = 1
    phi_hat = phi * torch.rsqrt(phi.pow(2).sum(0, keepdim=True) + NORM_EPS)      # (d, s), |phi_j| = 1
    return scale * (x_hat @ phi_hat)                                             # scale * cos(x_t, phi_j)


def soft_moe_ref(x: torch.Tensor, phi: torch.Tensor, experts, scale: torch.Tensor | None = None) -> torch.Tensor:
    """One Soft MoE layer in PyTorch: x (B, m, d), phi (d, s); ``experts`` maps the slot inputs
    (B, s, d) to the slot outputs (B, s, d); ``scale``: normalised logits (:func:`slot_logits`).
    Returns Y (B, m, d) in x's dtype."""
    logits = slot_logits(x, phi, scale)                                     # (B, m, s)
    slots_in = soft_mix_ref(logits.transpose(1, 2), x)                      # (B, s, d) = D^T X
    slots_out = experts(slots_in.to(x.dtype))                               # (B, s, d)
    return soft_mix_ref(logits, slots_out).to(x.dtype)                      # (B, m, d) = C Y~


def slot_experts(slots: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert j // p on slot j: slots (B, n p, d), w_gate_up (n, d, 2F), w_down (n, F, d)."""
    B, s, d = slots.shape
    n, _, two_f = w_gate_up.shape
    p = s // n
    x = slots.view(B, n, p, d).transpose(0, 1).reshape(n, B * p, d)        # (n, B p, d): each expert's slots
    gu = torch.bmm(x, w_gate_up)                                            # (n, B p, 2F)
    h = F.silu(gu[..., : two_f // 2]) * gu[..., two_f // 2:]
    y = torch.bmm(h, w_down)                                                # (n, B p, d)
    return y.view(n, B, p, d).transpose(0, 1).reshape(B, s, d)


# ----------------------------------------------------------------------------------------------
# The kernel: out[b, r] = sum_j softmax_j(S[b, r, :]) V[b, j], online over blocks of j


@triton.jit
def _soft_mix_kernel(
    s_ptr, v_ptr, o_ptr,
    R, J, D,
    stride_sb, stride_sr, stride_sj, stride_vb, stride_vj, stride_vd, stride_ob, stride_or, stride_od,
    BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, MASK_TAIL: tl.constexpr = True,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)                     # (BLOCK_R,) output rows
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)                     # (BLOCK_D,) columns
    r_in, d_in = r < R, d < D
    s_base = s_ptr + b * stride_sb + r.to(tl.int64)[:, None] * stride_sr       # (BLOCK_R, 1) int64
    v_base = v_ptr + b * stride_vb + d[None, :] * stride_vd                    # (1, BLOCK_D)
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)                       # running max of S[r, :j]
    l_i = tl.zeros((BLOCK_R,), tl.float32)                                     # running sum of e^(S - m)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)                             # running sum of e^(S - m) V
    for j0 in range(0, J, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_in = j < J
        if MASK_TAIL:   # a position past J is -inf: it takes no share of the softmax
            s = tl.load(s_base + j[None, :] * stride_sj, mask=r_in[:, None] & j_in[None, :], other=float("-inf"))
        else:           # broken: the tail is read as logit 0 and takes a share e^(0 - m)
            s = tl.load(s_base + j[None, :] * stride_sj, mask=r_in[:, None] & j_in[None, :], other=0.0)
        s = tl.where(r_in[:, None], s.to(tl.float32), 0.0)                    # rows past R: finite, unused
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)                                            # rescales what came before
        e = tl.exp(s - m_new[:, None])                                         # (BLOCK_R, BLOCK_J)
        l_i = l_i * alpha + tl.sum(e, axis=1)
        v = tl.load(v_base + j.to(tl.int64)[:, None] * stride_vj, mask=j_in[:, None] & d_in[None, :], other=0.0)
        if UPCAST:      # bf16 under the interpreter: tl.dot would multiply bit patterns
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + b * stride_ob + r.to(tl.int64)[:, None] * stride_or + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=r_in[:, None] & d_in[None, :])


# (BLOCK_R, BLOCK_J, BLOCK_D, num_warps, num_stages): the GPU tile, and few large programs for the interpreter.
GPU_TILE = (64, 64, 64, 4, 2)
CPU_TILE = (32, 32, 64, 4, 1)


def soft_mix(scores: torch.Tensor, values: torch.Tensor, *, tile: tuple | None = None) -> torch.Tensor:
    """softmax(scores, last axis) @ values: scores (B, R, J) any strides (a transposed view is the
    dispatch), values (B, J, D); returns (B, R, D) in values' dtype, accumulated in fp32."""
    _check_mix("soft_mix", scores, values)
    B, R, _ = scores.shape
    out = torch.empty(B, R, values.shape[2], dtype=values.dtype, device=values.device)
    if out.numel() == 0:
        return out
    grid, args, kwargs = _launch_args(scores, values, out, tile or (GPU_TILE if runtime.runtime().on_gpu else CPU_TILE))
    _soft_mix_kernel[grid](*args, **kwargs)
    return out


def _launch_args(scores, values, out, tile, *, mask_tail: bool = True, on_gpu: bool | None = None):
    """(grid, args, kwargs) of one launch of :func:`_soft_mix_kernel`, for :func:`soft_mix` and
    :func:`compile_jobs` alike; ``mask_tail=False`` is the broken variant. ``on_gpu`` (default:
    this process's device) decides the interpreter's bf16 upcast."""
    on_gpu = runtime.runtime().on_gpu if on_gpu is None else on_gpu
    block_r, block_j, block_d, warps, stages = tile
    B, R, J = scores.shape
    D = values.shape[2]
    grid = (B, triton.cdiv(R, block_r), triton.cdiv(D, block_d))
    args = (scores, values, out, R, J, D, *scores.stride(), *values.stride(), *out.stride())
    kwargs = dict(BLOCK_R=block_r, BLOCK_J=block_j, BLOCK_D=block_d,
                  UPCAST=values.dtype == torch.bfloat16 and not on_gpu, MASK_TAIL=mask_tail,
                  num_warps=warps, num_stages=stages)
    return grid, args, kwargs


def _check_mix(name: str, scores, values) -> None:
    for arg, t in (("scores", scores), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.dtype.is_floating_point:
            raise ValueError(f"{name}: {arg} must be a 3-D floating-point tensor, got "
                             f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    if scores.shape[0] != values.shape[0] or scores.shape[2] != values.shape[1]:
        raise ValueError(f"{name}: scores (B, R, J) and values (B, J, D) disagree: {tuple(scores.shape)} "
                         f"and {tuple(values.shape)}")
    if scores.shape[2] == 0:
        raise ValueError(f"{name}: a softmax over J = 0 entries is undefined")
    if name == "soft_mix" and (scores.dtype not in DTYPES or values.dtype not in DTYPES):
        raise ValueError(f"{name}: scores and values must be fp16, bf16 or fp32, got {scores.dtype} and {values.dtype}")


def soft_moe(x: torch.Tensor, phi: torch.Tensor, experts, scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`soft_moe_ref` with both mixtures done by the :func:`soft_mix` kernel."""
    logits = slot_logits(x, phi, scale).to(x.dtype)                         # (B, m, s)
    slots_out = experts(soft_mix(logits.transpose(1, 2), x))                # (B, s, d)
    return soft_mix(logits, slots_out.to(x.dtype))                          # (B, m, d)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds

# (sequences, tokens m, width d, slots s). A ViT-B/16 image: 196 patches of a 224 x 224 image, d = 768,
# with 128 slots; a language-model batch at Llama-3-8B's width, d = 4096, 4096 tokens, 256 slots.
REAL_SHAPES = {"ViT-B/16 image, 128 slots": (32, 196, 768, 128), "d=4096, 4096 tokens, 256 slots": (1, 4096, 4096, 256)}


def launch_jobs(label: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The dispatch and combine launches at one of :data:`REAL_SHAPES` (meta tensors, the GPU tile)."""
    from kernels import inspect as ki

    B, m, d, s = REAL_SHAPES[label]
    meta = dict(device="meta", dtype=dtype)
    logits = torch.empty(B, m, s, **meta)
    x, slots = torch.empty(B, m, d, **meta), torch.empty(B, s, d, **meta)
    jobs = {}
    for kind, (scores, values, out) in {"dispatch": (logits.transpose(1, 2), x, torch.empty(B, s, d, **meta)),
                                        "combine": (logits, slots, torch.empty(B, m, d, **meta))}.items():
        grid, args, kwargs = _launch_args(scores, values, out, GPU_TILE, on_gpu=True)
        jobs[kind] = ki.launch_job(_soft_mix_kernel, *args, grid=grid, **kwargs)
    return jobs


def compile_jobs() -> dict:
    return {f"soft_mix {kind}, {label}": job for label in REAL_SHAPES for kind, job in launch_jobs(label).items()}
