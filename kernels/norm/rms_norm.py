"""RMSNorm over the last dimension: the reference, and a fused Triton forward and backward.

For one row x of n features (Zhang and Sennrich, 2019):

    rms = sqrt((1/n) sum_j x_j^2 + eps),   rstd = 1 / rms,   y_j = w_j * x_j * rstd

No mean is subtracted and no bias added: one reduction per row instead of two, and no re-centring.
Backward, with xhat = x * rstd and gw = g * w:

    dx = rstd * (gw - xhat * mean(gw * xhat)),     dw = sum over rows of g * xhat

Semantics are those of ``torch.nn.functional.rms_norm(x, (n,), weight, eps)``; as there,
``eps=None`` means ``torch.finfo(x.dtype).eps``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm.common import backward_programs, block_sizes, check_norm_inputs, sum_partials, wide
from kernels.rows import as_rows, num_warps


def _eps(x: torch.Tensor, eps: float | None) -> float:
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """The reference, written out: fp32 from the same inputs (float64 kept), returned wide.

    ``eps=None`` takes ``torch.finfo(x.dtype).eps`` of the *input's* dtype, as F.rms_norm does.
    """
    e = _eps(x, eps)
    xw = wide(x)
    y = xw * torch.rsqrt((xw * xw).mean(dim=-1, keepdim=True) + e)   # x / rms(x)
    if weight is not None:
        y = y * wide(weight)
    return y


def rms_norm_backward_ref(x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor, eps: float | None = None):
    """The hand-derived backward in PyTorch: ``(dx, dw)`` for upstream gradient ``g``, no autograd.

    With xhat = x * rstd and gw = g * w:  dx = rstd * (gw - xhat * mean(gw * xhat)),
    dw = sum over rows of g * xhat. Computed wide (fp32, float64 kept).
    """
    e = _eps(x, eps)
    xw, gw_ = wide(x), wide(g)
    rstd = torch.rsqrt((xw * xw).mean(dim=-1, keepdim=True) + e)
    xhat = xw * rstd
    gw = gw_ * wide(weight) if weight is not None else gw_                 # dL/dxhat
    dx = rstd * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
    dw = (gw_ * xhat).sum(dim=tuple(range(x.dim() - 1))) if weight is not None else None
    return dx, dw


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)   # (BLOCK_R,), int64 offsets
    cols = tl.arange(0, BLOCK_N)                                          # (BLOCK_N,) covers the row
    row_ok = rows < n_rows
    col_ok = cols < n
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / n                                        # mean(x^2): the one reduction
    rstd = 1.0 / tl.sqrt(ms + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)                          # saved for the backward


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dres_ptr,
    n_rows, n, stride_x, stride_g, stride_dx, stride_dres, n_tiles,
    HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, ADD_DRES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # ADD_DRES: x also has a gradient of its own, dres (the residual stream's, in add_rms_norm),
    # which is added to dx; off for a plain RMSNorm, where dres_ptr is unused.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)                    # running sum of g * xhat
    for tile in range(pid, n_tiles, n_prog):                              # this program's row tiles
        rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)   # int64: rows * stride may pass 2**31
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        if HAS_WEIGHT:
            gw = g * w[None, :]                                           # dL/dxhat
        else:
            gw = g
        c1 = tl.sum(gw * xhat, axis=1) / n                                # mean(gw * xhat)
        dx = (gw - xhat * c1[:, None]) * rstd[:, None]
        if ADD_DRES:
            dx += tl.load(dres_ptr + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += g * xhat
    if NEED_DW:
        tl.store(dw_part_ptr + pid * n + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n = x.shape[-1]
        x2 = as_rows(x)
        n_rows = x2.shape[0]
        y2 = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_r, block_n = block_sizes(n_rows, n)
        if n_rows:
            _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
                x2, weight if weight is not None else x2, y2, rstd, n_rows, n, x2.stride(0), y2.stride(0), eps,
                HAS_WEIGHT=weight is not None, BLOCK_R=block_r, BLOCK_N=block_n,
                num_warps=num_warps(block_r * block_n),
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y2.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, weight, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        dx2, dw = backward_rows(x2, weight, rstd, as_rows(g.to(x2.dtype)), need_dw)
        return dx2.view(ctx.x_shape), dw, None


def backward_rows(x2, weight, rstd, g2, need_dw: bool, dres2=None):
    """The RMSNorm backward on (rows, n) views: ``(dx2, dw)``, with ``dw`` None unless ``need_dw``.

    ``dres2`` is a gradient that x receives directly, besides through the norm (the residual
    stream's, in :mod:`kernels.norm.add_rms_norm`); the kernel adds it into dx.
    """
    n_rows, n = x2.shape
    block_r, block_n = block_sizes(n_rows, n)
    n_tiles = triton.cdiv(n_rows, block_r)
    n_prog = backward_programs(n_tiles)
    dx2 = torch.empty((n_rows, n), dtype=x2.dtype, device=x2.device)
    dw_part = torch.zeros((n_prog, n), dtype=torch.float32, device=x2.device)
    if n_rows:
        _rms_norm_bwd_kernel[(n_prog,)](
            x2, weight if weight is not None else x2, g2, rstd, dx2, dw_part, g2 if dres2 is None else dres2,
            n_rows, n, x2.stride(0), g2.stride(0), dx2.stride(0), 0 if dres2 is None else dres2.stride(0), n_tiles,
            HAS_WEIGHT=weight is not None, NEED_DW=need_dw, ADD_DRES=dres2 is not None,
            BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps(block_r * block_n),
        )
    return dx2, (sum_partials(dw_part, x2.dtype) if need_dw else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), weight, eps)`` in Triton, forward and backward.

    ``x``: fp16, bf16 or fp32, any shape with features last (at most 65536 of them); ``weight``:
    ``(n,)`` of x's dtype, or None. ``eps=None`` is ``torch.finfo(x.dtype).eps``. The statistic is
    fp32; the result has x's dtype. Gradients flow to x and weight.
    """
    check_norm_inputs("rms_norm", x, weight=weight)
    if eps is not None and (not isinstance(eps, (int, float)) or eps < 0):
        raise ValueError(f"rms_norm: eps must be a non-negative number or None, got {eps!r}")
    return _RMSNorm.apply(x, weight, _eps(x, eps))
