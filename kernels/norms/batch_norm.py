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
average, is not supported). No kernel: no LLM in this course uses BatchNorm, and the chapter's
kernels are the per-row norms (LayerNorm, RMSNorm).
"""
from __future__ import annotations

import torch

from kernels.norms.common import wide


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
