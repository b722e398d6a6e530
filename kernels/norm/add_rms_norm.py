"""Fused residual add + RMSNorm: ``h = x + residual``, ``y = rms_norm(h) * w``, in one pass.

In a pre-norm Transformer block every sub-layer's output is added to the residual stream and the
sum is normalized at once for the next sub-layer:

    h = x + residual                                   (the new residual stream, kept for later)
    rstd = 1 / sqrt(mean_j h_j^2 + eps),   y_j = w_j * h_j * rstd

Done as two operations, h is written to memory by the add and read back by the norm: per row of n
features that is 2n (read x, residual) + n (write h) + n (read h) + n (write y) elements. Fused,
the row is read once and both outputs are written: 2n + 2n. The backward is fused the same way.
With upstream gradients dh (from the later uses of h) and dy, hhat = h * rstd, gw = dy * w:

    dh_total = dh + rstd * (gw - hhat * mean(gw * hhat))      (the residual path adds dh)
    dx = dresidual = dh_total,                                  dw = sum over rows of dy * hhat

The sum is rounded to x's dtype before it is normalized, so the fused kernel computes exactly
what the two unfused operations compute. ``weight_offset=1.0`` scales by Gemma's (1 + w) (formed in
fp32) instead of w; the backward then uses gw = dy * (1 + w), and dw is unchanged (d(1 + w)/dw = 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm.common import check_norm_inputs, check_weight_offset, weight_scale
from kernels.norm.rms_norm import GEMMA_WIDTH, REAL_WIDTHS, backward_rows, launch_jobs as rms_norm_launch_jobs
from kernels.rows import FORWARD, as_rows, check_block_size, row_launch


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                     eps: float = 1e-6, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The two unfused operations: h = x + residual (in x's dtype), y = rms_norm(h) * (weight_offset + weight)
    in fp32 (weight_offset=1.0: Gemma's 1 + w)."""
    h = x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + weight_offset)
    return h, y


@triton.jit
def _add_rms_norm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr,
    n_rows, n, stride_x, stride_r, stride_h, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """One block: BLOCK_R whole rows per program (n <= BLOCK_N); reads x and residual once,
    writes h and y once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)   # (BLOCK_R,), int64 offsets
    cols = tl.arange(0, BLOCK_N)                                         # (BLOCK_N,) the whole row
    row_ok = rows < n_rows
    col_ok = cols < n
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)  # h = x + residual, in x's dtype
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / n + eps)            # 1 / rms(h)
    y = hf * rstd[:, None]
    if HAS_WEIGHT:
        w = weight_scale(tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32), W_OFFSET)   # w or 1 + w
        y = y * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _add_rms_norm_fwd_tiled_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr,
    n, stride_x, stride_r, stride_h, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """A row wider than one block: one program per row, walked in blocks of BLOCK_N twice.
    Pass 1 writes h = x + residual and sums h^2; pass 2 reads h back and writes y = h * rstd * w
    (5 memory passes instead of 4: h is read once more)."""
    row = tl.program_id(0).to(tl.int64)                                  # int64: row * stride may pass 2**31
    cols = tl.arange(0, BLOCK_N)
    ss = tl.zeros((BLOCK_N,), tl.float32)                                # lane sums of h^2
    for start in range(0, n, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n, other=0.0)
        r = tl.load(r_ptr + row * stride_r + c, mask=c < n, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + c, h, mask=c < n)
        ss += h.to(tl.float32) * h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / n + eps)
    tl.debug_barrier()                                                   # this program's h stores land before pass 2 reads them
    for start in range(0, n, BLOCK_N):
        c = start + cols
        y = tl.load(h_ptr + row * stride_h + c, mask=c < n, other=0.0).to(tl.float32) * rstd
        if HAS_WEIGHT:
            y = y * weight_scale(tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32), W_OFFSET)
        tl.store(y_ptr + row * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=c < n)
    tl.store(rstd_ptr + row, rstd)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, block_size, residual_grad=True, weight_offset=0.0):
        n = x.shape[-1]
        x2, r2 = as_rows(x), as_rows(residual)
        n_rows = x2.shape[0]
        h2 = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        y2 = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            launch = row_launch(n, x.dtype, FORWARD, n_rows=n_rows, block_size=block_size)
            kernel, grid, args, kwargs = _forward_args(x2, r2, weight, h2, y2, rstd, eps, launch, weight_offset)
            kernel[grid](*args, **kwargs)
        ctx.save_for_backward(h2, weight, rstd)
        ctx.shape, ctx.block_size, ctx.weight_offset = x.shape, block_size, weight_offset
        ctx.residual_grad = residual_grad
        return h2.view(x.shape), y2.view(x.shape)

    @staticmethod
    def backward(ctx, dh, dy):
        h2, weight, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[2]
        # The norm's backward on h, plus the gradient h receives directly (dh); residual_grad=False
        # leaves dh out and exists only for the tests' broken variant.
        dh2 = as_rows(dh.to(h2.dtype)) if ctx.residual_grad else None
        dx2, dw = backward_rows(h2, weight, rstd, as_rows(dy.to(h2.dtype)), need_dw, dh2, block_size=ctx.block_size,
                                weight_offset=ctx.weight_offset)
        dx = dx2.view(ctx.shape)
        # x and residual get the same gradient; separate tensors, so neither can alias the other's .grad
        return dx, dx.clone(), dw, None, None, None, None


def _forward_args(x2, r2, weight, h2, y2, rstd, eps: float, launch, weight_offset: float = 0.0):
    """(kernel, grid, args, kwargs) of the forward's launch on (rows, n) views: one block per row tile,
    or two passes over blocks. Shared by the launcher and :func:`launch_jobs`."""
    n_rows, n = x2.shape
    w = weight if weight is not None else x2
    strides = (x2.stride(0), r2.stride(0), h2.stride(0), y2.stride(0))
    if launch.one_block:
        return (_add_rms_norm_fwd_kernel, (triton.cdiv(n_rows, launch.block_r),),
                (x2, r2, w, h2, y2, rstd, n_rows, n, *strides, eps),
                dict(HAS_WEIGHT=weight is not None, BLOCK_R=launch.block_r, BLOCK_N=launch.block_n,
                     W_OFFSET=weight_offset, num_warps=launch.num_warps))
    return (_add_rms_norm_fwd_tiled_kernel, (n_rows,), (x2, r2, w, h2, y2, rstd, n, *strides, eps),
            dict(HAS_WEIGHT=weight is not None, BLOCK_N=launch.block_n, W_OFFSET=weight_offset,
                 num_warps=launch.num_warps))


def launch_jobs(n: int, dtype: torch.dtype = torch.float16, n_rows: int = 4096, *, weight_offset: float = 0.0,
                sms: int = 132) -> list:
    """``(label, TritonJob)`` of the launches :func:`add_rms_norm` makes on a GPU of ``sms`` SMs for
    ``n_rows`` rows of ``n`` features with a weight, on meta tensors: the fused forward, then the
    RMSNorm backward it reuses with the residual gradient added (:func:`kernels.norm.rms_norm.launch_jobs`).
    ``weight_offset=1.0``: Gemma's (1 + w), labelled " (1 + w)"."""
    from kernels import inspect as ki

    x2 = torch.empty(n_rows, n, dtype=dtype, device="meta")                   # (rows, n), as x, residual, h, y
    rstd = torch.empty(n_rows, dtype=torch.float32, device="meta")
    launch = row_launch(n, dtype, FORWARD, n_rows=n_rows)
    kernel, grid, args, kwargs = _forward_args(x2, torch.empty_like(x2), torch.empty(n, dtype=dtype, device="meta"),
                                               torch.empty_like(x2), torch.empty_like(x2), rstd, 1e-6, launch,
                                               weight_offset)
    bwd = [(label.replace("rms_norm", "add_rms_norm"), job)
           for label, job in rms_norm_launch_jobs(n, dtype, n_rows, add_dres=True, weight_offset=weight_offset, sms=sms)
           if " bwd " in label]
    tag = " (1 + w)" if weight_offset else ""
    return [(f"add_rms_norm fwd {n}{tag}", ki.launch_job(kernel, *args, grid=grid, **kwargs))] + bwd


def compile_jobs() -> dict:
    """:func:`launch_jobs` at the widths of :data:`kernels.norm.rms_norm.REAL_WIDTHS`, 4096 tokens, fp16, and
    Gemma's (1 + w) at :data:`kernels.norm.rms_norm.GEMMA_WIDTH` in bf16."""
    jobs = {f"{model} {label}, 4096 tokens": job for model, n in REAL_WIDTHS for label, job in launch_jobs(n)}
    model, n = GEMMA_WIDTH
    jobs.update({f"{model} {label}, bf16, 4096 tokens": job
                 for label, job in launch_jobs(n, torch.bfloat16, weight_offset=1.0)})
    return jobs


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 1e-6, *, weight_offset: float = 0.0,
                 block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``y = rms_norm(h) * weight`` in one Triton kernel; returns (h, y).

    x and residual: same shape and dtype (fp16, bf16 or fp32), features last, any row stride;
    weight: (n,) of that dtype or None. Both outputs are contiguous, in x's dtype; the statistic is
    fp32. ``weight_offset=1.0`` scales by Gemma's ``1 + weight`` (formed in fp32) instead of ``weight``.
    Differentiable in x, residual and weight (the backward is fused too). Rows wider than the
    launch rule's widest block (:func:`kernels.rows.row_launch`), or ``block_size``, are walked in blocks.
    """
    n = check_norm_inputs("add_rms_norm", x, weight=weight)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"add_rms_norm: residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} must equal x's {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"add_rms_norm: residual has dtype {residual.dtype} but x has {x.dtype}; they must match")
    if residual.device != x.device:
        raise ValueError(f"add_rms_norm: residual is on {residual.device} but x is on {x.device}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"add_rms_norm: eps must be a non-negative number, got {eps!r}")
    del n
    offset = check_weight_offset("add_rms_norm", weight_offset, weight)
    check_block_size("add_rms_norm", block_size)
    return _AddRMSNorm.apply(x, residual, weight, float(eps), block_size, True, offset)
