"""RMSNorm over the last dimension: the reference, and a fused Triton forward and backward.

For one row x of n features (Zhang and Sennrich, 2019):

    rms = sqrt((1/n) sum_j x_j^2 + eps),   rstd = 1 / rms,   y_j = w_j * x_j * rstd

No mean is subtracted and no bias added: one reduction per row instead of two, and no re-centring.
Backward, with xhat = x * rstd and gw = g * w:

    dx = rstd * (gw - xhat * mean(gw * xhat)),     dw = sum over rows of g * xhat

Semantics are those of ``torch.nn.functional.rms_norm(x, (n,), weight, eps)``; as there,
``eps=None`` means ``torch.finfo(x.dtype).eps``. ``weight_offset=1.0`` gives Gemma's form,
y_j = (1 + w_j) * x_j * rstd with (1 + w) formed in fp32: the backward is the same with gw = g * (1 + w),
and dw is unchanged, since d(1 + w)/dw = 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm.common import (
    backward_programs, check_norm_inputs, check_weight_offset, sum_partials, tiled_backward, weight_scale, wide,
)
from kernels.rows import BACKWARD, FORWARD, as_rows, check_block_size, row_launch


def _eps(x: torch.Tensor, eps: float | None) -> float:
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None,
                 weight_offset: float = 0.0) -> torch.Tensor:
    """The reference, written out: fp32 from the same inputs (float64 kept), returned wide.

    ``eps=None`` takes ``torch.finfo(x.dtype).eps`` of the *input's* dtype, as F.rms_norm does.
    ``weight_offset=1.0`` scales by Gemma's (1 + w), formed in the wide dtype as Gemma does in fp32.
    """
    e = _eps(x, eps)
    xw = wide(x)
    y = xw * torch.rsqrt((xw * xw).mean(dim=-1, keepdim=True) + e)   # x / rms(x)
    if weight is not None:
        y = y * (wide(weight) + weight_offset)                           # w, or Gemma's 1 + w
    return y


def rms_norm_backward_ref(x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor, eps: float | None = None,
                          weight_offset: float = 0.0):
    """The hand-derived backward in PyTorch: ``(dx, dw)`` for upstream gradient ``g``, no autograd.

    With xhat = x * rstd and gw = g * (weight_offset + w):  dx = rstd * (gw - xhat * mean(gw * xhat)),
    dw = sum over rows of g * xhat (the offset drops out: d(1 + w)/dw = 1). Computed wide (fp32, float64 kept).
    """
    e = _eps(x, eps)
    xw, gw_ = wide(x), wide(g)
    rstd = torch.rsqrt((xw * xw).mean(dim=-1, keepdim=True) + e)
    xhat = xw * rstd
    gw = gw_ * (wide(weight) + weight_offset) if weight is not None else gw_   # dL/dxhat
    dx = rstd * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
    dw = (gw_ * xhat).sum(dim=tuple(range(x.dim() - 1))) if weight is not None else None
    return dx, dw


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """v1, one block: BLOCK_R whole rows per program, held in registers (n <= BLOCK_N).
    x is read once and y written once: 2 memory passes per element."""
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
        w = weight_scale(tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32), W_OFFSET)   # w or 1 + w
        y = y * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)                          # saved for the backward


@triton.jit
def _rms_norm_fwd_tiled_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """v2, a row wider than one block: one program per row, walked in blocks of BLOCK_N twice.
    Pass 1 sums x^2; pass 2 re-reads x and writes y = x * rstd * w: 3 memory passes, not 2."""
    row = tl.program_id(0).to(tl.int64)                                   # int64: row * stride may pass 2**31
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    ss = tl.zeros((BLOCK_N,), tl.float32)                                 # lane sums of x^2
    for start in range(0, n, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n, other=0.0).to(tl.float32)
        ss += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / n + eps)                    # 1 / sqrt(mean(x^2) + eps)
    for start in range(0, n, BLOCK_N):
        c = start + cols
        y = tl.load(x_row + c, mask=c < n, other=0.0).to(tl.float32) * rstd
        if HAS_WEIGHT:
            y = y * weight_scale(tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32), W_OFFSET)
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < n)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dres_ptr,
    n_rows, n, stride_x, stride_g, stride_dx, stride_dres, n_tiles,
    HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, ADD_DRES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """One block: each program walks a strided set of (BLOCK_R, BLOCK_N) row tiles (n <= BLOCK_N),
    reading x and g once, writing dx once, and summing g * xhat for dw in registers.

    ADD_DRES: x also has a gradient of its own, dres (the residual stream's, in add_rms_norm),
    which is added to dx; off for a plain RMSNorm, where dres_ptr is unused. W_OFFSET = 1: the scale is
    Gemma's (1 + w), so gw = g * (1 + w); dw still sums g * xhat."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    if HAS_WEIGHT:
        w = weight_scale(tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32), W_OFFSET)   # w or 1 + w
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
    def forward(ctx, x, weight, eps, block_size, weight_offset):
        n = x.shape[-1]
        x2 = as_rows(x)
        n_rows = x2.shape[0]
        y2 = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            forward_rows(x2, weight, y2, rstd, eps, row_launch(n, x.dtype, FORWARD, n_rows=n_rows, block_size=block_size),
                         weight_offset)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape, ctx.block_size, ctx.weight_offset = x.shape, block_size, weight_offset
        return y2.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, weight, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        dx2, dw = backward_rows(x2, weight, rstd, as_rows(g.to(x2.dtype)), need_dw, block_size=ctx.block_size,
                                weight_offset=ctx.weight_offset)
        return dx2.view(ctx.x_shape), dw, None, None, None


def _forward_args(x2, weight, y2, rstd, eps: float, launch, weight_offset: float = 0.0):
    """(kernel, grid, args, kwargs) of the forward's launch on (rows, n) views: one block per row tile,
    or two passes over blocks. Shared by :func:`forward_rows` and :func:`launch_jobs`."""
    n_rows, n = x2.shape
    w = weight if weight is not None else x2
    if launch.one_block:
        return (_rms_norm_fwd_kernel, (triton.cdiv(n_rows, launch.block_r),),
                (x2, w, y2, rstd, n_rows, n, x2.stride(0), y2.stride(0), eps),
                dict(HAS_WEIGHT=weight is not None, BLOCK_R=launch.block_r, BLOCK_N=launch.block_n,
                     W_OFFSET=weight_offset, num_warps=launch.num_warps))
    return (_rms_norm_fwd_tiled_kernel, (n_rows,), (x2, w, y2, rstd, n, x2.stride(0), y2.stride(0), eps),
            dict(HAS_WEIGHT=weight is not None, BLOCK_N=launch.block_n, W_OFFSET=weight_offset,
                 num_warps=launch.num_warps))


def forward_rows(x2, weight, y2, rstd, eps: float, launch, weight_offset: float = 0.0) -> None:
    """Launch the forward on (rows, n) views: one block per row tile, or two passes over blocks."""
    kernel, grid, args, kwargs = _forward_args(x2, weight, y2, rstd, eps, launch, weight_offset)
    kernel[grid](*args, **kwargs)


def _backward_args(x2, weight, rstd, g2, dx2, dw_part, need_dw: bool, dres2, launch, weight_offset: float = 0.0):
    """(kernel, grid, args, kwargs) of the one-block backward, one program per row of ``dw_part``.
    Shared by :func:`backward_rows` and :func:`launch_jobs`."""
    n_rows, n = x2.shape
    n_tiles = triton.cdiv(n_rows, launch.block_r)
    return (_rms_norm_bwd_kernel, (dw_part.shape[0],),
            (x2, weight if weight is not None else x2, g2, rstd, dx2, dw_part, g2 if dres2 is None else dres2,
             n_rows, n, x2.stride(0), g2.stride(0), dx2.stride(0), 0 if dres2 is None else dres2.stride(0), n_tiles),
            dict(HAS_WEIGHT=weight is not None, NEED_DW=need_dw, ADD_DRES=dres2 is not None,
                 BLOCK_R=launch.block_r, BLOCK_N=launch.block_n, W_OFFSET=weight_offset, num_warps=launch.num_warps))


def backward_rows(x2, weight, rstd, g2, need_dw: bool, dres2=None, *, block_size: int | None = None,
                  weight_offset: float = 0.0):
    """The RMSNorm backward on (rows, n) views: ``(dx2, dw)``, with ``dw`` None unless ``need_dw``.

    ``dres2`` is a gradient that x receives directly, besides through the norm (the residual
    stream's, in :mod:`kernels.norm.add_rms_norm`); the kernel adds it into dx. Rows that fit one
    block take ``_rms_norm_bwd_kernel``; wider rows the two tiled kernels of :mod:`kernels.norm.common`.
    ``weight_offset`` is the forward's (1.0: Gemma's 1 + w).
    """
    n_rows, n = x2.shape
    if n_rows == 0:
        return torch.empty_like(x2), (torch.zeros(n, dtype=x2.dtype, device=x2.device) if need_dw else None)
    launch = row_launch(n, x2.dtype, BACKWARD, n_rows=n_rows, block_size=block_size)
    if not launch.one_block:
        dx2, dw_part, _ = tiled_backward(x2, weight, g2, None, rstd, launch, need_dw=need_dw, need_db=False,
                                         dres2=dres2, weight_offset=weight_offset)
        return dx2, (sum_partials(dw_part, x2.dtype) if need_dw else None)
    n_prog = backward_programs(triton.cdiv(n_rows, launch.block_r))
    dx2 = torch.empty((n_rows, n), dtype=x2.dtype, device=x2.device)
    dw_part = torch.zeros((n_prog, n), dtype=torch.float32, device=x2.device)
    kernel, grid, args, kwargs = _backward_args(x2, weight, rstd, g2, dx2, dw_part, need_dw, dres2, launch,
                                                weight_offset)
    kernel[grid](*args, **kwargs)
    return dx2, (sum_partials(dw_part, x2.dtype) if need_dw else None)


def launch_jobs(n: int, dtype: torch.dtype = torch.float16, n_rows: int = 4096, *, add_dres: bool = False,
                weight_offset: float = 0.0, fwd=None, bwd=None, sms: int = 132, target: str = "sm90") -> list:
    """``(label, TritonJob)`` of the launches :func:`rms_norm` makes on a GPU of ``sms`` SMs (an H100's
    132) for ``n_rows`` rows of ``n`` features with a weight, forward then backward, on meta tensors
    (:func:`kernels.inspect.launch_job`: Triton's own specialisation). ``add_dres`` adds the residual
    gradient into dx, as :mod:`kernels.norm.add_rms_norm`'s backward does; ``weight_offset=1.0`` compiles
    Gemma's (1 + w) and adds " (1 + w)" to the labels. ``fwd`` and ``bwd`` (a
    :class:`kernels.rows.RowLaunch`) replace :func:`kernels.rows.row_launch`'s choices, to compile
    another launch rule's launch."""
    from kernels import inspect as ki
    from kernels.norm.common import tiled_backward_launch_jobs

    fwd = fwd or row_launch(n, dtype, FORWARD, n_rows=n_rows)
    bwd = bwd or row_launch(n, dtype, BACKWARD, n_rows=n_rows)
    x2 = torch.empty(n_rows, n, dtype=dtype, device="meta")                   # (rows, n), contiguous
    w = torch.empty(n, dtype=dtype, device="meta")
    rstd = torch.empty(n_rows, dtype=torch.float32, device="meta")
    tag = " (1 + w)" if weight_offset else ""
    kernel, grid, args, kwargs = _forward_args(x2, w, torch.empty_like(x2), rstd, 1e-5, fwd, weight_offset)
    jobs = [(f"rms_norm fwd {n}{tag}", ki.launch_job(kernel, *args, target=target, grid=grid, **kwargs))]
    g2 = torch.empty_like(x2)
    dres2 = torch.empty_like(x2) if add_dres else None
    if not bwd.one_block:
        return jobs + tiled_backward_launch_jobs(f"rms_norm bwd {n}{tag}", x2, w, g2, None, rstd, bwd, need_dw=True,
                                                 need_db=False, dres2=dres2, weight_offset=weight_offset, sms=sms,
                                                 target=target)
    n_prog = backward_programs(triton.cdiv(n_rows, bwd.block_r), sms=sms)
    dw_part = torch.empty(n_prog, n, dtype=torch.float32, device="meta")      # (programs, n) partial sums
    kernel, grid, args, kwargs = _backward_args(x2, w, rstd, g2, torch.empty_like(x2), dw_part, True, dres2, bwd,
                                                weight_offset)
    return jobs + [(f"rms_norm bwd {n}{tag}", ki.launch_job(kernel, *args, target=target, grid=grid, **kwargs))]


# (label, hidden size) of real models' RMSNorm, over a batch of 4096 tokens
REAL_WIDTHS = (("Llama-3-8B", 4096), ("Llama-3-70B", 8192), ("Llama-3-405B", 16384))
# Gemma 3 27B: hidden size 5376, norms as (1 + w) in fp32, weights in bf16 (google/gemma_pytorch@014acb7,
# gemma/config.py get_config_for_27b_v3 and gemma/model.py RMSNorm)
GEMMA_WIDTH = ("Gemma-3-27B", 5376)


def compile_jobs() -> dict:
    """The forward and backward launches of :func:`rms_norm` at :data:`REAL_WIDTHS`, 4096 tokens, fp16,
    and Gemma's (1 + w) launches at :data:`GEMMA_WIDTH` in bf16."""
    jobs = {f"{model} {label}, 4096 tokens": job for model, n in REAL_WIDTHS for label, job in launch_jobs(n)}
    model, n = GEMMA_WIDTH
    jobs.update({f"{model} {label}, bf16, 4096 tokens": job
                 for label, job in launch_jobs(n, torch.bfloat16, weight_offset=1.0)})
    return jobs


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None, *,
             weight_offset: float = 0.0, block_size: int | None = None) -> torch.Tensor:
    """``F.rms_norm(x, (x.shape[-1],), weight, eps)`` in Triton, forward and backward.

    ``x``: fp16, bf16 or fp32, any shape with features last; ``weight``: ``(n,)`` of x's dtype, or
    None. ``eps=None`` is ``torch.finfo(x.dtype).eps``. The statistic is fp32; the result has x's
    dtype. Gradients flow to x and weight. ``weight_offset=1.0`` scales by Gemma's ``1 + weight``
    (formed in fp32, as Gemma does) instead of ``weight``. Rows wider than the launch rule's widest block
    (:func:`kernels.rows.row_launch`), or than ``block_size`` when given, are walked in blocks.
    """
    check_norm_inputs("rms_norm", x, weight=weight)
    if eps is not None and (not isinstance(eps, (int, float)) or eps < 0):
        raise ValueError(f"rms_norm: eps must be a non-negative number or None, got {eps!r}")
    offset = check_weight_offset("rms_norm", weight_offset, weight)
    check_block_size("rms_norm", block_size)
    return _RMSNorm.apply(x, weight, _eps(x, eps), block_size, offset)
