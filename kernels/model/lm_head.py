"""Cross-entropy for language models: a fused Triton forward+backward, and a chunked LM-head loss.

For one row of logits x (V,) and target t, with label smoothing eps:

    lse  = log sum_j exp(x_j)                     (computed as m + log sum_j exp(x_j - m), m = max_j x_j)
    loss = (1 - eps) (lse - x_t) + eps (lse - mean_j x_j)  =  lse - (1 - eps) x_t - eps mean_j x_j
    dloss/dx_j = softmax(x)_j - (1 - eps) [j = t] - eps / V

Rows whose target equals ``ignore_index`` contribute no loss and no gradient, and the mean is over
the rows that are not ignored (PyTorch's convention; all rows ignored gives NaN, as PyTorch does).

:func:`cross_entropy` computes the loss and the gradient in the same kernel, in two sweeps over
each row (one for the max, the sum of exponentials, the target logit and the row sum; one that
writes the gradient), while the row is hot, so backward only has to scale the stored gradient by
the incoming gradient. :func:`fused_linear_cross_entropy` goes one step further for the LM head:
it takes the hidden states and the (tied) embedding matrix, makes the logits a chunk of tokens at
a time, runs the same kernel on the chunk, and folds the chunk's gradient into the gradients of
the hidden states and the weight at once, so the (N, V) logits never exist in memory, only a
(chunk, V) slice of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_ref(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                      label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """The reference: log-sum-exp written out, in fp32 from the same inputs (float64 stays float64)."""
    x = (logits if logits.dtype == torch.float64 else logits.float()).reshape(-1, logits.shape[-1])  # (N, V)
    t = target.reshape(-1).long()                                  # (N,)
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    m = x.max(dim=-1, keepdim=True).values                         # subtract the max: exp never overflows
    lse = (m + (x - m).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    x_t = x.gather(1, t_safe[:, None]).squeeze(1)
    loss = lse - (1 - label_smoothing) * x_t - label_smoothing * x.mean(-1)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


@triton.jit
def _cross_entropy_kernel(
    x_ptr, t_ptr, loss_ptr, grad_ptr,
    V, stride_xn, stride_xv, stride_gn, stride_gv,
    ignore_index, smoothing, grad_scale,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, SUBTRACT_MAX: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xn
    t = tl.load(t_ptr + row)
    is_valid = t != ignore_index
    cols = tl.arange(0, BLOCK_V)

    # Sweep 1: running max m and running sum s = sum exp(x - m) (online log-sum-exp), plus x_t and sum x.
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)    # per-lane running max
    s = tl.zeros((BLOCK_V,), tl.float32)                  # per-lane sum of exp(x - m_lane)
    x_sum = tl.zeros((BLOCK_V,), tl.float32)
    x_t = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        ok = v < V
        x = tl.load(x_row + v * stride_xv, mask=ok, other=float("-inf")).to(tl.float32)
        if SUBTRACT_MAX:
            m_new = tl.maximum(m, x)
            # lanes that have seen only -inf keep s = 0 (avoid -inf - -inf = NaN)
            s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
            m = m_new
        else:
            s = s + tl.exp(x)                             # broken on purpose: overflows for large logits
            m = tl.zeros((BLOCK_V,), tl.float32)
        x_sum += tl.where(ok, x, 0.0)
        x_t += tl.where(v == t, x, 0.0)
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0)
    lse = m_row + tl.log(s_row)
    target_logit = tl.sum(x_t, axis=0)
    mean_x = tl.sum(x_sum, axis=0) / V
    loss = lse - (1.0 - smoothing) * target_logit
    loss -= tl.where(smoothing > 0, smoothing * mean_x, 0.0)   # no 0 * -inf = NaN when eps = 0
    tl.store(loss_ptr + row, tl.where(is_valid, loss, 0.0))

    # Sweep 2: gradient (softmax - (1 - eps) onehot - eps / V) * grad_scale, zero for ignored rows.
    if WRITE_GRAD:
        g_row = grad_ptr + row.to(tl.int64) * stride_gn
        scale = tl.where(is_valid, grad_scale, 0.0)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + cols
            ok = v < V
            x = tl.load(x_row + v * stride_xv, mask=ok, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            g = p - tl.where(v == t, 1.0 - smoothing, 0.0) - smoothing / V
            tl.store(g_row + v * stride_gv, (g * scale).to(grad_ptr.dtype.element_ty), mask=ok)


def _check_ce_inputs(name, logits, target, ignore_index, label_smoothing, reduction) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: logits and target must be torch.Tensors")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name}: logits must be (..., V) with V >= 1, got shape {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: logits have dtype {logits.dtype}; supported: float16, bfloat16, float32")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"{name}: target shape {tuple(target.shape)} must equal logits' leading shape "
                         f"{tuple(logits.shape[:-1])}")
    _check_target(name, target, logits.shape[-1], ignore_index, logits.device)
    _check_options(name, label_smoothing, reduction)


def _check_target(name, target, V, ignore_index, device) -> None:
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must be int64 or int32 class indices, got {target.dtype}")
    if target.device != device:
        raise ValueError(f"{name}: target is on {target.device}, logits on {device}")
    if device.type != runtime.device().type:
        raise ValueError(f"{name}: inputs are on {device}, kernels run on {runtime.device()} here")
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        first = int(target.reshape(-1)[bad.reshape(-1)][0])
        raise ValueError(f"{name}: target values must be in [0, {V}) or equal ignore_index={ignore_index}; found {first}")


def _check_options(name, label_smoothing, reduction) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(V), 4096)


def _ce_rows(x: torch.Tensor, t: torch.Tensor, ignore_index: int, smoothing: float, grad_scale: float,
             write_grad: bool, *, subtract_max: bool = True, block_v: int | None = None):
    """Launch the kernel on 2-D logits x (N, V); returns per-row losses (N,) fp32 and the gradient (N, V)."""
    N, V = x.shape
    loss = torch.empty(N, dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x) if write_grad else loss  # the pointer is unused without WRITE_GRAD
    if N:
        _cross_entropy_kernel[(N,)](
            x, t, loss, grad,
            V, x.stride(0), x.stride(1), grad.stride(0) if write_grad else 0, grad.stride(1) if write_grad else 0,
            ignore_index, float(smoothing), float(grad_scale),
            BLOCK_V=block_v or _block_v(V), WRITE_GRAD=write_grad, SUBTRACT_MAX=subtract_max,
        )
    return loss, (grad if write_grad else None)


def _reduce(loss_rows: torch.Tensor, n_valid: int, reduction: str, shape) -> torch.Tensor:
    if reduction == "none":
        return loss_rows.reshape(shape)
    total = loss_rows.sum()
    return total if reduction == "sum" else total / n_valid  # n_valid = 0: 0/0 = NaN, like PyTorch


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction):
        V = logits.shape[-1]
        x = logits.reshape(-1, V)
        t = target.reshape(-1)
        n_valid = int((t != ignore_index).sum())
        # The gradient of a mean is 1/n_valid per row; of a sum or per-row loss, 1 (scaled in backward).
        grad_scale = 1.0 / n_valid if (reduction == "mean" and n_valid) else 1.0
        loss_rows, grad = _ce_rows(x, t, ignore_index, label_smoothing, grad_scale, logits.requires_grad)
        ctx.reduction = reduction
        ctx.logits_shape = logits.shape
        ctx.save_for_backward(grad if grad is not None else logits.new_empty(0))
        return _reduce(loss_rows, n_valid, reduction, target.shape).to(torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        if ctx.reduction == "none":
            g = grad * grad_out.reshape(-1, 1).to(grad.dtype)   # each row by its own incoming gradient
        else:
            g = grad * grad_out.to(grad.dtype)                  # one scalar for the whole tensor
        return g.reshape(ctx.logits_shape), None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` for class-index targets, with one fused Triton kernel.

    logits (..., V) in fp16/bf16/fp32 with any strides; target (...) int64/int32. The loss is fp32;
    the gradient has the logits' dtype. Differentiable in logits.
    """
    _check_ce_inputs("cross_entropy", logits, target, ignore_index, label_smoothing, reduction)
    return _CrossEntropy.apply(logits, target, int(ignore_index), float(label_smoothing), reduction)


# ---------------------------------------------------------------- the LM head fused with the loss

def fused_linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   ignore_index: int = -100, label_smoothing: float = 0.0,
                                   reduction: str = "mean") -> torch.Tensor:
    """The unfused version: materialize all (N, V) logits = hidden @ weight^T, then the loss (PyTorch)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    loss = F.cross_entropy(logits.float(), target.reshape(-1).long(), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, label_smoothing, reduction, chunk_size):
        C = hidden.shape[-1]
        h = hidden.reshape(-1, C)                                  # (N, C)
        t = target.reshape(-1)
        N = h.shape[0]
        n_valid = int((t != ignore_index).sum())
        grad_scale = 1.0 / n_valid if (reduction == "mean" and n_valid) else 1.0
        need_grad = hidden.requires_grad or weight.requires_grad
        loss_rows = torch.empty(N, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_grad else None
        for i in range(0, N, chunk_size):
            h_c = h[i: i + chunk_size]                             # (n, C)
            logits_c = h_c @ weight.T                              # (n, V): the only logits alive
            loss_c, g_c = _ce_rows(logits_c, t[i: i + chunk_size], ignore_index, label_smoothing,
                                   grad_scale, need_grad)
            loss_rows[i: i + chunk_size] = loss_c
            if need_grad:
                grad_h[i: i + chunk_size] = g_c @ weight           # dL/dh = dL/dlogits W      (n, C)
                grad_w += g_c.T.float() @ h_c.float()              # dL/dW += dL/dlogits^T h   (V, C)
            del logits_c, g_c
        ctx.reduction = reduction
        ctx.shapes = (hidden.shape, weight.dtype)
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w)
        return _reduce(loss_rows, n_valid, reduction, target.shape)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        hidden_shape, w_dtype = ctx.shapes
        if ctx.reduction == "none":
            # Per-row incoming gradients do not factor out of grad_w; this case is for inspection only.
            raise RuntimeError("fused_linear_cross_entropy: backward with reduction='none' is not supported; "
                               "use 'mean' or 'sum'")
        gh = (grad_h * grad_out.to(grad_h.dtype)).reshape(hidden_shape)
        gw = (grad_w * grad_out).to(w_dtype)
        return gh, gw, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, label_smoothing: float = 0.0,
                               reduction: str = "mean", chunk_size: int = 1024) -> torch.Tensor:
    """cross_entropy(hidden @ weight^T, target) without ever holding all the logits.

    hidden (..., C), weight (V, C) (the LM head, or the tied embedding), target (...). Logits are made
    ``chunk_size`` tokens at a time; each chunk's loss and gradient come from :func:`cross_entropy`'s
    kernel and are folded into dL/dhidden and dL/dweight during the forward pass, so the peak extra
    memory is about chunk_size x V logits plus their gradient, instead of N x V of each.
    """
    name = "fused_linear_cross_entropy"
    if not all(isinstance(a, torch.Tensor) for a in (hidden, weight, target)):
        raise TypeError(f"{name}: hidden, weight and target must be torch.Tensors")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{name}: hidden must be (..., C) and weight (V, C); got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    for arg, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{name}: hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{name}: weight is on {weight.device}, hidden on {hidden.device}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"{name}: target shape {tuple(target.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if int(chunk_size) < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    _check_target(name, target, weight.shape[0], ignore_index, hidden.device)
    _check_options(name, label_smoothing, reduction)
    return _FusedLinearCrossEntropy.apply(hidden, weight, target, int(ignore_index), float(label_smoothing),
                                          reduction, int(chunk_size))
