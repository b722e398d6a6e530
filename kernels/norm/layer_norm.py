"""LayerNorm over the last dimension: the reference, and a fused Triton forward and backward.

For one row x of n features (Ba, Kiros and Hinton, 2016):

    mu = (1/n) sum_j x_j,   var = (1/n) sum_j (x_j - mu)^2,   rstd = 1 / sqrt(var + eps)
    xhat_j = (x_j - mu) * rstd,   y_j = w_j * xhat_j + b_j

The statistics are per row (per token), over the feature axis, so a token's output never depends
on other tokens in the batch, in training and at inference alike. Backward, with gw = g * w:

    dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))     (means over the row)
    dw = sum over rows of g * xhat,    db = sum over rows of g

(the derivation is in the norms chapter). Semantics are those of
``torch.nn.functional.layer_norm(x, (n,), weight, bias, eps)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm.common import (
    backward_programs, check_norm_inputs, sum_partials, tiled_backward, wide,
)
from kernels.rows import BACKWARD, FORWARD, as_rows, check_block_size, row_launch


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   eps: float = 1e-5) -> torch.Tensor:
    """The reference, written out: fp32 from the same inputs (float64 kept), returned wide."""
    xw = wide(x)
    mu = xw.mean(dim=-1, keepdim=True)                       # (..., 1)
    var = ((xw - mu) ** 2).mean(dim=-1, keepdim=True)        # biased: divide by n
    y = (xw - mu) * torch.rsqrt(var + eps)                   # xhat
    if weight is not None:
        y = y * wide(weight)
    if bias is not None:
        y = y + wide(bias)
    return y


def layer_norm_backward_ref(x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor, eps: float = 1e-5):
    """The hand-derived backward in PyTorch: ``(dx, dw, db)`` for upstream gradient ``g``, no autograd.

    With xhat = (x - mu) * rstd and gw = g * w:  dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)),
    dw = sum over rows of g * xhat, db = sum over rows of g. Computed wide (fp32, float64 kept).
    """
    xw, gw_ = wide(x), wide(g)
    mu = xw.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(((xw - mu) ** 2).mean(dim=-1, keepdim=True) + eps)
    xhat = (xw - mu) * rstd
    gw = gw_ * wide(weight) if weight is not None else gw_                 # dL/dxhat
    dx = rstd * (gw - gw.mean(dim=-1, keepdim=True) - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
    rows = tuple(range(x.dim() - 1))                                       # every axis but the features
    dw = (gw_ * xhat).sum(dim=rows) if weight is not None else None
    db = gw_.sum(dim=rows)
    return dx, dw, db


def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics of one block along the last dimension: count n, mean, and M2 = sum (x - mean)^2."""
    n = torch.full((*x.shape[:-1], 1), float(x.shape[-1]), dtype=x.dtype, device=x.device)
    mean = x.mean(dim=-1, keepdim=True)
    return n, mean, ((x - mean) ** 2).sum(dim=-1, keepdim=True)


def merge_moments(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Merge the (count, mean, M2) of two disjoint parts into those of their union (Chan, Golub and
    LeVeque, 1983), the update ``_layer_norm_fwd_tiled_kernel`` applies block by block:

        n = n_a + n_b,   d = mean_b - mean_a,
        mean = mean_a + d * n_b / n,   M2 = M2_a + M2_b + d^2 * n_a * n_b / n

    Exact, associative and commutative, with identity (0, 0, 0) -- the twin of
    :func:`kernels.softmax.merge_softmax_stats`. Never forms E[x^2] - E[x]^2. (Welford's update is
    the case n_b = 1.)
    """
    n = n_a + n_b
    d = mean_b - mean_a
    w = torch.where(n > 0, n_b / n.clamp_min(1), torch.zeros_like(n))    # n_b / n, 0 for two empty parts
    return n, mean_a + d * w, m2_a + m2_b + d * d * n_a * w


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_rows, n, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """v1, one block: BLOCK_R whole rows per program, held in registers (n <= BLOCK_N).
    x is read once and y written once: 2 memory passes per element."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)   # (BLOCK_R,), int64 offsets
    cols = tl.arange(0, BLOCK_N)                                          # (BLOCK_N,) covers the row
    row_ok = rows < n_rows
    col_ok = cols < n
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n                                          # mu, (BLOCK_R,)
    xc = tl.where(mask, x - mean[:, None], 0.0)                           # x - mu, pads kept at 0
    var = tl.sum(xc * xc, axis=1) / n                                     # biased variance
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None]                                                # xhat
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_ok)                          # saved for the backward
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_fwd_tiled_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """v2, a row wider than one block: one program per row, walked in blocks of BLOCK_N twice.

    Pass 1 merges each block's count, mean and sum of squared deviations M2 into the row's
    (Chan, Golub and LeVeque): with d = mean_b - mean_a and n_ab = n_a + n_b,
        mean = mean_a + d * n_b / n_ab,     M2 = M2_a + M2_b + d^2 * n_a * n_b / n_ab
    which never forms E[x^2] - E[x]^2 (that difference cancels catastrophically when |mean| >> std).
    Pass 2 re-reads x and writes y: 3 memory passes, not 2.
    """
    row = tl.program_id(0).to(tl.int64)                                   # int64: row * stride may pass 2**31
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    mean = tl.full((), 0.0, tl.float32)                                   # of the blocks merged so far
    m2 = tl.full((), 0.0, tl.float32)
    for start in range(0, n, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n, other=0.0).to(tl.float32)
        n_a = start * 1.0                                                 # elements merged so far
        n_b = tl.minimum(n - start, BLOCK_N) * 1.0                        # elements in this block
        mean_b = tl.sum(x, axis=0) / n_b
        dev = tl.where(c < n, x - mean_b, 0.0)
        d = mean_b - mean
        mean += d * n_b / (n_a + n_b)
        m2 += tl.sum(dev * dev, axis=0) + d * d * n_a * n_b / (n_a + n_b)
    rstd = 1.0 / tl.sqrt(m2 / n + eps)
    for start in range(0, n, BLOCK_N):
        c = start + cols
        y = (tl.load(x_row + c, mask=c < n, other=0.0).to(tl.float32) - mean) * rstd   # xhat
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + c, mask=c < n, other=0.0).to(tl.float32)
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < n)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n, stride_x, stride_g, stride_dx, n_tiles,
    HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One block: each program walks a strided set of (BLOCK_R, BLOCK_N) row tiles (n <= BLOCK_N),
    reading x and g once, writing dx once, and summing g * xhat and g for dw, db in registers."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)                    # running sum of g * xhat
    db_acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)                    # running sum of g
    for tile in range(pid, n_tiles, n_prog):                              # this program's row tiles
        rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)   # int64: rows * stride may pass 2**31
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            gw = g * w[None, :]                                           # dL/dxhat
        else:
            gw = g
        c1 = tl.sum(gw * xhat, axis=1) / n                                # mean(gw * xhat)
        c2 = tl.sum(gw, axis=1) / n                                       # mean(gw)
        dx = (gw - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += g * xhat
        if NEED_DB:
            db_acc += g
    if NEED_DW:
        tl.store(dw_part_ptr + pid * n + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if NEED_DB:
        tl.store(db_part_ptr + pid * n + cols, tl.sum(db_acc, axis=0), mask=col_ok)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, block_size):
        n = x.shape[-1]
        x2 = as_rows(x)
        n_rows = x2.shape[0]
        y2 = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            launch = row_launch(n, x.dtype, FORWARD, n_rows=n_rows, block_size=block_size)
            kernel, grid, args, kwargs = _forward_args(x2, weight, bias, y2, mean, rstd, eps, launch)
            kernel[grid](*args, **kwargs)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.block_size = x.shape, block_size
        return y2.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, weight, mean, rstd = ctx.saved_tensors
        n_rows, n = x2.shape
        g2 = as_rows(g.to(x2.dtype))
        need_dw = weight is not None and ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        launch = row_launch(n, x2.dtype, BACKWARD, n_rows=n_rows, block_size=ctx.block_size)
        if n_rows == 0:
            dx2 = torch.empty_like(x2)
            dw_part = db_part = torch.zeros((1, n), dtype=torch.float32, device=x2.device)
        elif launch.one_block:
            dx2, dw_part, db_part = _one_block_backward(x2, weight, g2, mean, rstd, launch, need_dw, need_db)
        else:
            dx2, dw_part, db_part = tiled_backward(x2, weight, g2, mean, rstd, launch, need_dw=need_dw, need_db=need_db)
        dw = sum_partials(dw_part, x2.dtype) if need_dw else None
        db = sum_partials(db_part, x2.dtype) if need_db else None
        return dx2.view(ctx.x_shape), dw, db, None, None


def _forward_args(x2, weight, bias, y2, mean, rstd, eps: float, launch):
    """(kernel, grid, args, kwargs) of the forward's launch on (rows, n) views: one block per row tile,
    or two passes over blocks. Shared by the launcher and :func:`launch_jobs`."""
    n_rows, n = x2.shape
    w, b = weight if weight is not None else x2, bias if bias is not None else x2
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    if launch.one_block:
        return (_layer_norm_fwd_kernel, (triton.cdiv(n_rows, launch.block_r),),
                (x2, w, b, y2, mean, rstd, n_rows, n, x2.stride(0), y2.stride(0), eps),
                dict(flags, BLOCK_R=launch.block_r, BLOCK_N=launch.block_n, num_warps=launch.num_warps))
    return (_layer_norm_fwd_tiled_kernel, (n_rows,), (x2, w, b, y2, mean, rstd, n, x2.stride(0), y2.stride(0), eps),
            dict(flags, BLOCK_N=launch.block_n, num_warps=launch.num_warps))


def _one_block_backward(x2, weight, g2, mean, rstd, launch, need_dw: bool, need_db: bool):
    """``(dx2, dw_part, db_part)`` from ``_layer_norm_bwd_kernel``, for rows that fit one block."""
    n_rows, n = x2.shape
    n_prog = backward_programs(triton.cdiv(n_rows, launch.block_r))
    dx2 = torch.empty((n_rows, n), dtype=x2.dtype, device=x2.device)
    dw_part = torch.zeros((n_prog, n), dtype=torch.float32, device=x2.device)
    db_part = torch.zeros((n_prog, n), dtype=torch.float32, device=x2.device)
    kernel, grid, args, kwargs = _backward_args(x2, weight, g2, mean, rstd, dx2, dw_part, db_part, launch,
                                                need_dw, need_db)
    kernel[grid](*args, **kwargs)
    return dx2, dw_part, db_part


def _backward_args(x2, weight, g2, mean, rstd, dx2, dw_part, db_part, launch, need_dw: bool, need_db: bool):
    """(kernel, grid, args, kwargs) of the one-block backward, one program per row of ``dw_part``.
    Shared by :func:`_one_block_backward` and :func:`launch_jobs`."""
    n_rows, n = x2.shape
    return (_layer_norm_bwd_kernel, (dw_part.shape[0],),
            (x2, weight if weight is not None else x2, g2, mean, rstd, dx2, dw_part, db_part,
             n_rows, n, x2.stride(0), g2.stride(0), dx2.stride(0), triton.cdiv(n_rows, launch.block_r)),
            dict(HAS_WEIGHT=weight is not None, NEED_DW=need_dw, NEED_DB=need_db,
                 BLOCK_R=launch.block_r, BLOCK_N=launch.block_n, num_warps=launch.num_warps))


def launch_jobs(n: int, dtype: torch.dtype = torch.float16, n_rows: int = 4096, *, sms: int = 132) -> list:
    """``(label, TritonJob)`` of the launches :func:`layer_norm` makes on a GPU of ``sms`` SMs (an H100's
    132) for ``n_rows`` rows of ``n`` features with weight and bias, forward then backward, on meta
    tensors (:func:`kernels.inspect.launch_job`: Triton's own specialisation)."""
    from kernels import inspect as ki
    from kernels.norm.common import tiled_backward_launch_jobs

    fwd = row_launch(n, dtype, FORWARD, n_rows=n_rows)
    bwd = row_launch(n, dtype, BACKWARD, n_rows=n_rows)
    x2 = torch.empty(n_rows, n, dtype=dtype, device="meta")                   # (rows, n), contiguous
    w = torch.empty(n, dtype=dtype, device="meta")
    mean, rstd = (torch.empty(n_rows, dtype=torch.float32, device="meta") for _ in range(2))
    kernel, grid, args, kwargs = _forward_args(x2, w, w, torch.empty_like(x2), mean, rstd, 1e-5, fwd)
    jobs = [(f"layer_norm fwd {n}", ki.launch_job(kernel, *args, grid=grid, **kwargs))]
    g2 = torch.empty_like(x2)
    if not bwd.one_block:
        return jobs + tiled_backward_launch_jobs(f"layer_norm bwd {n}", x2, w, g2, mean, rstd, bwd, need_dw=True,
                                                 need_db=True, sms=sms)
    n_prog = backward_programs(triton.cdiv(n_rows, bwd.block_r), sms=sms)
    part = torch.empty(n_prog, n, dtype=torch.float32, device="meta")         # (programs, n) partial sums
    kernel, grid, args, kwargs = _backward_args(x2, w, g2, mean, rstd, torch.empty_like(x2), part, part, bwd,
                                                True, True)
    return jobs + [(f"layer_norm bwd {n}", ki.launch_job(kernel, *args, grid=grid, **kwargs))]


# (label, hidden size) of real models' LayerNorm, over a batch of 4096 tokens
REAL_WIDTHS = (("GPT-J-6B", 4096), ("Falcon-40B", 8192), ("GPT-3 175B", 12288))


def compile_jobs() -> dict:
    """The forward and backward launches of :func:`layer_norm` at :data:`REAL_WIDTHS`, 4096 tokens, fp16."""
    return {f"{model} {label}, 4096 tokens": job for model, n in REAL_WIDTHS for label, job in launch_jobs(n)}


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, *, block_size: int | None = None) -> torch.Tensor:
    """``F.layer_norm(x, (x.shape[-1],), weight, bias, eps)`` in Triton, forward and backward.

    ``x``: fp16, bf16 or fp32, any shape with features last; ``weight`` and ``bias``: ``(n,)`` of
    x's dtype, or None. Statistics are fp32; the result has x's dtype. Gradients flow to x, weight
    and bias. Rows wider than the launch rule's widest block (:func:`kernels.rows.row_launch`), or
    than ``block_size`` when given, are walked in blocks.
    """
    check_norm_inputs("layer_norm", x, weight=weight, bias=bias)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"layer_norm: eps must be a non-negative number, got {eps!r}")
    check_block_size("layer_norm", block_size)
    return _LayerNorm.apply(x, weight, bias, float(eps), block_size)
