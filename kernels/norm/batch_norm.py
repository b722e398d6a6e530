"""BatchNorm: the reference, with training and eval behaviour and running statistics.

For x of shape (N, C, *) (Ioffe and Szegedy, 2015), each channel c is normalized over the batch
axis and every spatial position, i.e. over all axes except 1:

    training:  mu_c, var_c = mean and biased variance of x[:, c, ...]
               y = w_c * (x - mu_c) / sqrt(var_c + eps) + b_c
               running_mean <- (1 - momentum) * running_mean + momentum * mu_c
               running_var  <- (1 - momentum) * running_var  + momentum * var_c * m / (m - 1)
               (m = elements per channel: the running variance is the *unbiased* estimate)
    eval:      the same normalization with running_mean and running_var in place of mu_c, var_c

So in training one sample's output depends on the other samples in its batch; in eval it does
not. Semantics are those of ``torch.nn.functional.batch_norm`` (momentum=None, the cumulative
average, is not supported).

:func:`batch_norm` is a forward-only Triton version (no LLM in this course trains with BatchNorm;
the chapter's differentiable kernels are the per-row norms). Its reduction runs the other way:
``_batch_norm_stats_kernel`` gives each program one *channel* and walks the batch axis, reading
that channel's contiguous segments of L = H*W values that lie C*L apart in memory, where a
LayerNorm program owns one contiguous row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.norm.common import SUPPORTED_DTYPES, wide


def batch_norm_ref(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """BatchNorm over axis 1 of ``x`` (N, C, *); updates ``running_mean``/``running_var`` in place
    when ``training``. Computed in fp32 (float64 kept), returned wide."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"batch_norm_ref: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 2:
        raise ValueError(f"batch_norm_ref: x must be (N, C, *) with at least 2 dimensions, got {tuple(x.shape)}")
    c = x.shape[1]
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (c,):
            raise ValueError(f"batch_norm_ref: {name} must have shape ({c},) for x of shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if momentum is None:
        raise ValueError("batch_norm_ref: momentum=None (cumulative moving average) is not supported")
    axes = [0, *range(2, x.dim())]                       # every axis but the channel axis
    shape = [1, c] + [1] * (x.dim() - 2)                 # broadcast a (C,) vector over x
    xw = wide(x)
    if training:
        m = x.numel() // c                               # elements per channel
        if m <= 1:
            raise ValueError(f"batch_norm_ref: training needs more than 1 value per channel, got x of shape {tuple(x.shape)}")
        mu = xw.mean(dim=axes)                           # (C,)
        var = xw.var(dim=axes, unbiased=False)           # (C,), biased: used to normalize
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mu.detach().to(running_mean.dtype))
        if running_var is not None:
            with torch.no_grad():
                unbiased = var.detach() * m / (m - 1)
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm_ref: eval mode (training=False) needs running_mean and running_var")
        mu, var = wide(running_mean), wide(running_var)
    y = (xw - mu.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        y = y * wide(weight).view(shape)
    if bias is not None:
        y = y + wide(bias).view(shape)
    return y


def batch_norm_backward_ref(x: torch.Tensor, weight: torch.Tensor | None, g: torch.Tensor, eps: float = 1e-5):
    """The hand-derived training-mode backward in PyTorch: ``(dx, dw, db)`` for upstream gradient ``g``.

    Per channel c, over its m = N * L values, with xhat = (x - mu_c) * rstd_c and gw = g * w_c:
        dx = rstd_c * (gw - mean_c(gw) - xhat * mean_c(gw * xhat)),
        dw_c = sum_c(g * xhat),   db_c = sum_c(g)
    LayerNorm's formula with the means taken down the channel instead of along the row, because the
    statistics depend on every value of the channel. (The running statistics carry no gradient.)
    Computed wide (fp32, float64 kept).
    """
    axes = [0, *range(2, x.dim())]                       # every axis but the channel axis
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    xw, gw_ = wide(x), wide(g)
    mu = xw.mean(dim=axes, keepdim=True)
    rstd = torch.rsqrt(xw.var(dim=axes, unbiased=False, keepdim=True) + eps)
    xhat = (xw - mu) * rstd
    gw = gw_ * wide(weight).view(shape) if weight is not None else gw_     # dL/dxhat
    dx = rstd * (gw - gw.mean(dim=axes, keepdim=True) - xhat * (gw * xhat).mean(dim=axes, keepdim=True))
    dw = (gw_ * xhat).sum(dim=axes) if weight is not None else None
    return dx, dw, gw_.sum(dim=axes)


@triton.jit
def _batch_norm_stats_kernel(
    x_ptr, mean_ptr, rstd_ptr, rmean_ptr, rvar_ptr,
    N, C, L, eps, momentum,
    UPDATE_RUNNING: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Program c: mean and biased variance of x[:, c, :] for x viewed as (N, C, L), two passes;
    then running <- (1 - momentum) running + momentum * (mean, unbiased variance)."""
    c = tl.program_id(0).to(tl.int64)
    ns = tl.arange(0, BLOCK_N)
    ls = tl.arange(0, BLOCK_L)
    count = N * L
    acc = tl.zeros((BLOCK_N, BLOCK_L), tl.float32)
    for n0 in range(0, N, BLOCK_N):                       # walk the batch axis ...
        n = (n0 + ns).to(tl.int64)
        for l0 in range(0, L, BLOCK_L):                   # ... and the spatial positions
            l = l0 + ls
            mask = (n[:, None] < N) & (l[None, :] < L)
            acc += tl.load(x_ptr + n[:, None] * C * L + c * L + l[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(tl.sum(acc, axis=1), axis=0) / count
    acc = tl.zeros((BLOCK_N, BLOCK_L), tl.float32)
    for n0 in range(0, N, BLOCK_N):                       # second pass: sum of (x - mean)^2
        n = (n0 + ns).to(tl.int64)
        for l0 in range(0, L, BLOCK_L):
            l = l0 + ls
            mask = (n[:, None] < N) & (l[None, :] < L)
            x = tl.load(x_ptr + n[:, None] * C * L + c * L + l[None, :], mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - mean, 0.0)
            acc += d * d
    var = tl.sum(tl.sum(acc, axis=1), axis=0) / count     # biased: used to normalize
    tl.store(mean_ptr + c, mean)
    tl.store(rstd_ptr + c, 1.0 / tl.sqrt(var + eps))
    if UPDATE_RUNNING:
        rm = tl.load(rmean_ptr + c).to(tl.float32)
        rv = tl.load(rvar_ptr + c).to(tl.float32)
        unbiased = var * count / (count - 1)
        tl.store(rmean_ptr + c, ((1.0 - momentum) * rm + momentum * mean).to(rmean_ptr.dtype.element_ty))
        tl.store(rvar_ptr + c, ((1.0 - momentum) * rv + momentum * unbiased).to(rvar_ptr.dtype.element_ty))


@triton.jit
def _batch_norm_apply_kernel(
    x_ptr, y_ptr, scale_ptr, shift_ptr, total, C, L, BLOCK: tl.constexpr,
):
    """y = x * scale[c] + shift[c] elementwise, c = (flat index // L) % C."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    c = (offs // L) % C
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + c, mask=mask, other=0.0)
    shift = tl.load(shift_ptr + c, mask=mask, other=0.0)
    tl.store(y_ptr + offs, (x * scale + shift).to(y_ptr.dtype.element_ty), mask=mask)


def batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.batch_norm`` forward in Triton for x of shape (N, C, *), fp16/bf16/fp32; not differentiable.

    Training: per-channel batch statistics (``_batch_norm_stats_kernel``, one program per channel),
    running statistics updated in place when given. Eval: the running statistics. Then one
    elementwise pass, y = x * scale_c + shift_c with scale = w * rstd and shift = b - mean * scale.
    Returns x's dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"batch_norm: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"batch_norm: x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if x.dim() < 2:
        raise ValueError(f"batch_norm: x must be (N, C, *) with at least 2 dimensions, got {tuple(x.shape)}")
    if x.device.type != runtime.device().type:
        raise ValueError(f"batch_norm: x is on {x.device}, kernels run on {runtime.device()} here")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("batch_norm: the Triton BatchNorm is forward-only; use batch_norm_ref (or F.batch_norm) to train")
    N, C = x.shape[0], x.shape[1]
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (C,)):
            raise ValueError(f"batch_norm: {name} must be a tensor of shape ({C},) for x of shape {tuple(x.shape)}")
        if t is not None and (t.device != x.device or not t.is_contiguous()):
            raise ValueError(f"batch_norm: {name} must be a contiguous tensor on {x.device}")
    if momentum is None:
        raise ValueError("batch_norm: momentum=None (cumulative moving average) is not supported")
    xc = x.contiguous()                                  # (N, C, L) with L = prod of the spatial dims
    L = xc.numel() // max(N * C, 1)
    if training:
        if N * L <= 1:
            raise ValueError(f"batch_norm: training needs more than 1 value per channel, got x of shape {tuple(x.shape)}")
        if (running_mean is None) != (running_var is None):
            raise ValueError("batch_norm: pass both running_mean and running_var, or neither")
        mean = torch.empty(C, dtype=torch.float32, device=x.device)
        rstd = torch.empty(C, dtype=torch.float32, device=x.device)
        grid, args, kwargs = _stats_args(xc, mean, rstd, running_mean, running_var, eps, momentum)
        _batch_norm_stats_kernel[grid](*args, **kwargs)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: eval mode (training=False) needs running_mean and running_var")
        mean = running_mean.float()
        rstd = torch.rsqrt(running_var.float() + eps)
    scale = rstd * (weight.float() if weight is not None else 1.0)          # (C,) fp32: O(C) work on the host side
    shift = (bias.float() if bias is not None else 0.0) - mean * scale
    y = torch.empty_like(xc)
    if xc.numel():
        grid, args, kwargs = _apply_args(xc, y, scale.contiguous(), shift.contiguous(),
                                         block=1024 if runtime.runtime().on_gpu else 8192)
        _batch_norm_apply_kernel[grid](*args, **kwargs)
    return y.view(x.shape)


def _stats_args(xc, mean, rstd, running_mean, running_var, eps: float, momentum: float):
    """(grid, args, kwargs) of the statistics launch over the contiguous (N, C, *) ``xc``, one program
    per channel; running statistics updated when given. Shared by :func:`batch_norm` and :func:`compile_jobs`."""
    N, C = xc.shape[0], xc.shape[1]
    L = xc.numel() // max(N * C, 1)
    update = running_mean is not None
    block_l = min(triton.next_power_of_2(max(L, 1)), 1024)
    block_n = max(1, min(triton.next_power_of_2(N), 4096 // block_l))
    return ((C,), (xc, mean, rstd, running_mean if update else mean, running_var if update else rstd,
                   N, C, L, float(eps), float(momentum)),
            dict(UPDATE_RUNNING=update, BLOCK_N=block_n, BLOCK_L=block_l))


def _apply_args(xc, y, scale, shift, *, block: int):
    """(grid, args, kwargs) of the elementwise y = x * scale_c + shift_c launch over ``xc``."""
    total, C = xc.numel(), xc.shape[1]
    L = total // max(xc.shape[0] * C, 1)
    return (triton.cdiv(total, block),), (xc, y, scale, shift, total, C, L), dict(BLOCK=block)


# (label, shape) of BatchNorm inputs in a real convolutional network: ResNet-50's first BatchNorm (after
# the 7x7 stem convolution) and its last (after the final 1x1 convolution), batch 32 at 224 x 224
REAL_SHAPES = (("ResNet-50 stem", (32, 64, 112, 112)), ("ResNet-50 last block", (32, 2048, 7, 7)))


def compile_jobs() -> dict:
    """The launches of a training-mode :func:`batch_norm` with running statistics on a GPU (the apply
    kernel in blocks of 1024) at :data:`REAL_SHAPES`, fp16, on meta tensors."""
    from kernels import inspect as ki

    jobs = {}
    for label, shape in REAL_SHAPES:
        x = torch.empty(shape, dtype=torch.float16, device="meta")
        per_channel = [torch.empty(shape[1], dtype=torch.float32, device="meta") for _ in range(4)]
        grid, args, kwargs = _stats_args(x, *per_channel, 1e-5, 0.1)            # mean, rstd, running mean, var
        jobs[f"{label} {shape}: statistics"] = ki.launch_job(_batch_norm_stats_kernel, *args, grid=grid, **kwargs)
        grid, args, kwargs = _apply_args(x, torch.empty_like(x), *per_channel[:2], block=1024)
        jobs[f"{label} {shape}: apply"] = ki.launch_job(_batch_norm_apply_kernel, *args, grid=grid, **kwargs)
    return jobs
