"""Cross-entropy for language models: a fused Triton forward+backward, and a chunked LM-head loss.

For one row of logits x (V,) and target t, with label smoothing eps:

    lse  = log sum_j exp(x_j)                     (computed as m + log sum_j exp(x_j - m), m = max_j x_j)
    loss = (1 - eps) (lse - x_t) + eps (lse - mean_j x_j)  =  lse - (1 - eps) x_t - eps mean_j x_j
    dloss/dx_j = softmax(x)_j - (1 - eps) [j = t] - eps / V

Two optional terms: soft-capping (Gemma 2) first replaces every logit by c(x) = cap tanh(x / cap),
and the loss above is taken on c(x), so dloss/dx_j = dloss/dc_j (1 - (c_j / cap)^2); the z-loss (PaLM)
adds w lse^2, whose gradient is 2 w lse softmax(x)_j, so the softmax term becomes (1 + 2 w lse) softmax_j.

Rows whose target equals ``ignore_index`` contribute no loss and no gradient, and the mean is over
the rows that are not ignored (PyTorch's convention; all rows ignored gives NaN, as PyTorch does).

:func:`cross_entropy` computes the loss and the gradient in the same kernel, in two sweeps over
each row (one for the max, the sum of exponentials, the target logit and the row sum; one that
writes the gradient), so backward only has to scale the stored gradient by the incoming gradient.
The gradient goes into a buffer the function owns, or, with ``inplace=True``, over the logits
themselves (their contract is in :func:`cross_entropy`). :func:`fused_linear_cross_entropy` goes one
step further for the LM head: it takes the hidden states and the (tied) embedding matrix, makes the
logits a chunk of tokens at a time (:func:`chunk_rows`), lets the kernel overwrite each chunk's
logits with their gradient, and folds that into the gradients of the hidden states and the weight
at once, so the (N, V) logits never exist in memory, only one (chunk, V) buffer.

Launch choices (block, warps) come from :func:`launch_config`. The in-place gradient and the
chunk-size rule follow Liger-Kernel (linkedin/Liger-Kernel, src/liger_kernel/ops/cross_entropy.py at
02e90db949eede7ad915a14893935de34efc2b4b and fused_linear_cross_entropy.py at
00eba634c2e9b5f05badbfb67e9b0a4caba301a2); the code here is written independently.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch.autograd.function import once_differentiable

from kernels import rows, runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_ref(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                      label_smoothing: float = 0.0, reduction: str = "mean", *, z_loss: float = 0.0,
                      softcap: float | None = None) -> torch.Tensor:
    """The reference: log-sum-exp written out, in fp32 from the same inputs (float64 stays float64).

    ``softcap``: the logits are first replaced by softcap * tanh(logits / softcap) (Gemma 2's final
    logits); ``z_loss``: each row's loss gains z_loss * lse^2 (PaLM's auxiliary loss on log Z)."""
    x = (logits if logits.dtype == torch.float64 else logits.float()).reshape(-1, logits.shape[-1])  # (N, V)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)                      # c(x), in (-cap, cap)
    t = target.reshape(-1).long()                                  # (N,)
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    m = x.max(dim=-1, keepdim=True).values                         # subtract the max: exp never overflows
    lse = (m + (x - m).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    x_t = x.gather(1, t_safe[:, None]).squeeze(1)
    loss = lse - (1 - label_smoothing) * x_t - label_smoothing * x.mean(-1) + z_loss * lse ** 2
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


@triton.jit
def _softcap(x, cap, inv_cap):
    """cap * tanh(x / cap), with :func:`kernels.rows.tanh` (libdevice's tanh fails under the
    interpreter, and 2 sigmoid(2u) - 1 loses digits for the small u of ordinary logits).
    inv_cap = 1 / cap, formed once per row: a multiply per logit instead of a division (on sm_90a the
    launch for V = 256,000 with both terms needs 58 registers, tests/test_loss.py)."""
    return cap * rows.tanh(x * inv_cap)


@triton.jit
def _cross_entropy_kernel(
    x_ptr, t_ptr, loss_ptr, grad_ptr,   # logits (N, V), targets (N,), row losses (N,), gradient (N, V): may be x_ptr
    V, stride_xn, stride_gn,            # row strides in elements; within a row the vocabulary is contiguous
    ignore_index, smoothing, grad_scale,
    z_loss, cap,                        # z-loss weight w, soft-cap value (used only when Z_LOSS / SOFTCAP)
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, SUBTRACT_MAX: tl.constexpr, INT64_ROWS: tl.constexpr,
    Z_LOSS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    row = tl.program_id(0)
    # row * stride passes 2**31 once N * V does (V = 128256: from row 16744 on), so it is formed in int64.
    # INT64_ROWS=False is the broken variant a test compiles to show the 32-bit product in the PTX.
    r = row.to(tl.int64) if INT64_ROWS else row
    x_row = x_ptr + r * stride_xn
    t = tl.load(t_ptr + row)
    is_valid = t != ignore_index
    cols = tl.arange(0, BLOCK_V)
    inv_cap = 1.0 / cap

    # Sweep 1: running max m and running sum s = sum exp(x - m) (online log-sum-exp), plus x_t and sum x.
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)    # per-lane running max
    s = tl.zeros((BLOCK_V,), tl.float32)                  # per-lane sum of exp(x - m_lane)
    x_sum = tl.zeros((BLOCK_V,), tl.float32)
    x_t = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        ok = v < V
        x = tl.load(x_row + v, mask=ok, other=float("-inf")).to(tl.float32)
        if SOFTCAP:   # c = cap tanh(x / cap); the lanes past V must stay -inf, not become -cap
            x = tl.where(ok, _softcap(x, cap, inv_cap), float("-inf"))
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
    inv_s = 1.0 / s_row                 # sweep 2 forms softmax as exp(x - m) / s: x - m is exact, x - lse is not
    target_logit = tl.sum(x_t, axis=0)
    mean_x = tl.sum(x_sum, axis=0) / V
    loss = lse - (1.0 - smoothing) * target_logit
    loss -= tl.where(smoothing > 0, smoothing * mean_x, 0.0)   # no 0 * -inf = NaN when eps = 0
    p_scale = 1.0                                              # d(lse + w lse^2)/d lse, multiplies softmax
    if Z_LOSS:
        loss += z_loss * lse * lse                             # PaLM's z-loss: w (log Z)^2
        p_scale = 1.0 + 2.0 * z_loss * lse
    tl.store(loss_ptr + row, tl.where(is_valid, loss, 0.0))

    # Sweep 2: gradient ((1 + 2 w lse) softmax - (1 - eps) onehot - eps / V) * grad_scale, zero for
    # ignored rows, times dc/dx = 1 - (c / cap)^2 when the logits were soft-capped.
    # In place (grad_ptr == x_ptr) each element is read and then overwritten by the same program, and
    # the target's logit was kept from sweep 1, so no logit is read after it has been overwritten.
    if WRITE_GRAD:
        g_row = grad_ptr + r * stride_gn
        scale = tl.where(is_valid, grad_scale, 0.0)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + cols
            ok = v < V
            x = tl.load(x_row + v, mask=ok, other=0.0).to(tl.float32)
            if SOFTCAP:
                x = _softcap(x, cap, inv_cap)
            p = tl.exp(x - m_row) * inv_s
            g = p_scale * p - tl.where(v == t, 1.0 - smoothing, 0.0) - smoothing / V
            if SOFTCAP:
                g = g * (1.0 - (x * inv_cap) * (x * inv_cap))  # chain rule through the cap: 1 - tanh^2
            tl.store(g_row + v, (g * scale).to(grad_ptr.dtype.element_ty), mask=ok)


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


def _check_terms(name, z_loss, softcap) -> dict:
    """The optional loss terms as keyword arguments of :func:`_ce_rows`, checked."""
    if not (isinstance(z_loss, (int, float)) and 0.0 <= float(z_loss) < float("inf")):
        raise ValueError(f"{name}: z_loss must be a finite number >= 0 (PaLM uses 1e-4), got {z_loss!r}")
    return {"z_loss": float(z_loss), "softcap": None if softcap is None else rows.check_cap(softcap, name)}


def _check_options(name, label_smoothing, reduction) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


# Per-thread budget of the cross-entropy kernel (kernels.rows.RowBudget): it keeps four per-lane fp32
# accumulators (max, sum of exponentials, sum of logits, target logit), each holding
# BLOCK_V / (32 * num_warps) values per thread, plus one block of logits. Measured on sm_90a at the
# launch's own specialisation (tests/test_loss.py compiles aot_job): 8 values a thread, 2048 logits
# with 8 warps, need 48 registers; the former launch, 4096 logits with the default 4 warps (32 a
# thread), needs 248 of the 255 a thread may have, and 8192 with 4 warps spills. A vocabulary wider than the block is walked in
# blocks (the kernel's loops), so the block does not grow with V.
CE_BUDGET = rows.RowBudget(per_thread=8, max_block=2048)


def launch_config(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for the cross-entropy kernel on a vocabulary of V; the launcher and the
    AOT spill test both call this, so the test compiles what runs."""
    block = min(triton.next_power_of_2(V), CE_BUDGET.max_block)
    return block, rows.warps_for(block, CE_BUDGET)


DTYPES_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ce_args(x, t, loss, grad, ignore_index: int, smoothing: float, grad_scale: float, *, subtract_max: bool,
             z_loss: float, softcap: float | None, block_v: int, num_warps: int, int64_rows: bool = True):
    """(grid, args, kwargs) of the cross-entropy launch on logits x (N, V); shared by :func:`_ce_rows`
    and :func:`aot_job`."""
    N, V = x.shape
    args = (x, t, loss, loss if grad is None else grad,     # the grad pointer is unused without WRITE_GRAD
            V, x.stride(0), 0 if grad is None else grad.stride(0),
            ignore_index, float(smoothing), float(grad_scale), float(z_loss), float(softcap or 1.0))
    kwargs = dict(BLOCK_V=block_v, WRITE_GRAD=grad is not None, SUBTRACT_MAX=subtract_max, INT64_ROWS=int64_rows,
                  Z_LOSS=z_loss > 0, SOFTCAP=softcap is not None, num_warps=num_warps)
    return (N,), args, kwargs


def aot_job(V: int, dtype: str = "fp32", *, n_rows: int = 4096, block_v: int | None = None,
            num_warps: int | None = None, int64_rows: bool = True, z_loss: bool = False, softcap: bool = False):
    """The launch :func:`_ce_rows` makes on ``n_rows`` rows of a vocabulary of V with ``dtype`` logits
    ("fp32", "bf16", "fp16") and the gradient written in place, as a :class:`kernels.inspect.TritonJob`
    built by :func:`kernels.inspect.launch_job` from meta tensors (Triton's own specialisation of the
    launch); ``block_v``, ``num_warps`` and ``int64_rows`` override the launcher's choices (broken
    variants); ``z_loss`` and ``softcap`` compile the kernel with those terms."""
    from kernels import inspect as ki

    block, warps = launch_config(V)
    x = torch.empty(n_rows, V, dtype=DTYPES_BY_NAME[dtype], device="meta")   # (N, V) logits, gradient in place
    t = torch.empty(n_rows, dtype=torch.int64, device="meta")
    loss = torch.empty(n_rows, dtype=torch.float32, device="meta")
    grid, args, kwargs = _ce_args(x, t, loss, x, -100, 0.0, 1.0, subtract_max=True, z_loss=1e-4 if z_loss else 0.0,
                                  softcap=30.0 if softcap else None, block_v=block_v or block,
                                  num_warps=num_warps or warps, int64_rows=int64_rows)
    return ki.launch_job(_cross_entropy_kernel, *args, grid=grid, **kwargs)


def _ce_rows(x: torch.Tensor, t: torch.Tensor, ignore_index: int, smoothing: float, grad_scale: float,
             grad: torch.Tensor | None = None, *, subtract_max: bool = True, z_loss: float = 0.0,
             softcap: float | None = None) -> torch.Tensor:
    """Launch the kernel on logits x (N, V) with contiguous rows; returns the row losses (N,) fp32.

    With ``grad`` (N, V, contiguous rows) the kernel also writes dloss/dx * grad_scale there;
    ``grad`` may be ``x`` itself, and then the gradient replaces the logits. ``z_loss`` > 0 and
    ``softcap`` compile the kernel with those terms; without them it is the plain kernel."""
    N, V = x.shape
    loss = torch.empty(N, dtype=torch.float32, device=x.device)
    block_v, warps = launch_config(V)
    if N:
        grid, args, kwargs = _ce_args(x, t, loss, grad, ignore_index, smoothing, grad_scale, subtract_max=subtract_max,
                                      z_loss=z_loss, softcap=softcap, block_v=block_v, num_warps=warps)
        _cross_entropy_kernel[grid](*args, **kwargs)
    return loss


def _reduce(loss_rows: torch.Tensor, n_valid: int, reduction: str, shape) -> torch.Tensor:
    if reduction == "none":
        return loss_rows.reshape(shape)
    total = loss_rows.sum()
    return total if reduction == "sum" else total / n_valid  # n_valid = 0: 0/0 = NaN, like PyTorch


def _grad_scale(t: torch.Tensor, ignore_index: int, reduction: str) -> tuple[int, float]:
    """(rows not ignored, the factor the gradient is born with): 1/n_valid for a mean, else 1."""
    n_valid = int((t != ignore_index).sum())
    return n_valid, (1.0 / n_valid if (reduction == "mean" and n_valid) else 1.0)


def _pop_grads(ctx, name: str) -> tuple[torch.Tensor, ...]:
    """The gradients the forward stored on ``ctx``, handed over once. They are kept as attributes
    rather than through ``save_for_backward`` so that dropping them here leaves autograd the only
    reference (it then adopts them as ``.grad`` instead of copying); and since backward scales them
    in place, a second backward through the same graph (``retain_graph=True``) must not reuse them."""
    grads = getattr(ctx, "grads", None)
    if grads is None:
        raise RuntimeError(f"{name}: backward ran twice through one graph (retain_graph=True); the gradient "
                           "buffers were handed to autograd by the first backward: recompute the loss")
    ctx.grads = None
    return grads


def _scale_(grad: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """grad *= grad_out in place, skipped when grad_out is exactly 1 (the loss is the last node):
    that saves a read and a write of the whole buffer."""
    if grad_out.numel() != 1 or float(grad_out) != 1.0:
        grad.mul_(grad_out.to(grad.dtype))
    return grad


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, inplace, need_grad, terms):
        x = rows.as_rows(logits)                       # (N, V) rows; a view of logits when inplace
        t = target.reshape(-1)
        n_valid, grad_scale = _grad_scale(t, ignore_index, reduction)
        grad = None
        if need_grad:
            grad = x if inplace else torch.empty_like(x)    # the only (N, V) tensor the forward may allocate
        loss_rows = _ce_rows(x, t, ignore_index, label_smoothing, grad_scale, grad, **terms)
        if grad is x:
            # The logits now hold the gradient. Bumping their version makes any other node that saved
            # them for its backward fail loudly there, instead of reading the gradient as logits.
            torch.autograd.graph.increment_version(logits)
        ctx.reduction = reduction
        ctx.logits_shape = logits.shape
        ctx.grads = (grad,)
        return _reduce(loss_rows, n_valid, reduction, target.shape).to(torch.float32)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (grad,) = _pop_grads(ctx, "cross_entropy")
        if ctx.reduction == "none":
            grad.mul_(grad_out.reshape(-1, 1).to(grad.dtype))   # each row by its own incoming gradient
        else:
            _scale_(grad, grad_out)                              # one scalar for the whole tensor
        return grad.reshape(ctx.logits_shape), None, None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean", *, inplace: bool = False,
                  z_loss: float = 0.0, softcap: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` for class-index targets, with one fused Triton kernel.

    logits (..., V) in fp16/bf16/fp32; target (...) int64/int32. The loss is fp32; the gradient has
    the logits' dtype. Differentiable in logits; the kernel writes the gradient during the forward.
    ``softcap`` (> 0) takes the loss on softcap * tanh(logits / softcap), Gemma 2's final-logit
    cap; ``z_loss`` (>= 0) adds z_loss * lse^2 to each row's loss, PaLM's auxiliary z-loss
    (:func:`cross_entropy_ref` writes both out).

    Where the gradient goes (only when one is needed: logits require grad and grad mode is on):

    - ``inplace=False`` (default, PyTorch's semantics): into a new (N, V) buffer that this function
      owns; ``logits`` is never modified.
    - ``inplace=True``: over ``logits`` itself, as Liger-Kernel does, so the forward allocates no
      (N, V) tensor. The caller gives up the logits: after the call their storage holds
      dloss/dlogits (for a mean, already divided by the number of rows not ignored), and backward
      scales it in place and returns it. Their version counter is bumped, so an autograd node that
      saved the logits (``z.exp()`` saves its output) raises in backward rather than reading the
      gradient; a read by the caller cannot be detected and is the caller's error. Rows must be
      contiguous (``logits.stride(-1) == 1`` and a (N, V) view must exist).

    Backward scales the gradient buffer in place, so it runs once per forward: ``retain_graph=True``
    and a second backward raise.
    """
    _check_ce_inputs("cross_entropy", logits, target, ignore_index, label_smoothing, reduction)
    terms = _check_terms("cross_entropy", z_loss, softcap)
    if inplace:
        _check_inplace_logits(logits)
    need_grad = torch.is_grad_enabled() and logits.requires_grad   # (inside forward, grad mode is off)
    return _CrossEntropy.apply(logits, target, int(ignore_index), float(label_smoothing), reduction, bool(inplace),
                               need_grad, terms)


def _check_inplace_logits(logits: torch.Tensor) -> None:
    if any(st == 0 and n > 1 for st, n in zip(logits.stride(), logits.shape)):
        raise ValueError("cross_entropy: inplace=True needs logits without broadcast (stride-0) dimensions")
    if logits.numel() and rows.as_rows(logits).data_ptr() != logits.data_ptr():   # as_rows had to copy
        raise ValueError(f"cross_entropy: inplace=True writes the gradient over logits, which needs rows with unit "
                         f"stride viewable as (N, {logits.shape[-1]}); got strides {tuple(logits.stride())}: pass "
                         "logits.contiguous() or inplace=False")


# ---------------------------------------------------------------- the LM head fused with the loss

def fused_linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   ignore_index: int = -100, label_smoothing: float = 0.0,
                                   reduction: str = "mean", *, z_loss: float = 0.0,
                                   softcap: float | None = None) -> torch.Tensor:
    """The unfused version: materialize all (N, V) logits = hidden @ weight^T, then the loss (PyTorch;
    with a z-loss or a soft cap, :func:`cross_entropy_ref`)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    if z_loss or softcap is not None:
        loss = cross_entropy_ref(logits, target.reshape(-1), ignore_index, label_smoothing, reduction,
                                 z_loss=z_loss, softcap=softcap)
    else:
        loss = F.cross_entropy(logits.float(), target.reshape(-1).long(), ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def chunk_rows(N: int, C: int, V: int) -> int:
    """Tokens per chunk of the fused LM-head loss: the most, in steps of 128 (a GEMM tile's height),
    whose logits (n, V) hold no more elements than the hidden states (N, C); at least min(N, 128).

    The rule of Liger-Kernel's fused linear cross-entropy (a chunk's logits about the size of the
    hidden states), rounded down instead of up to a power of two, so the budget is a bound: the loss
    never needs more transient memory than one more copy of the layer's input. Llama 3 8B (C = 4096,
    V = 128256) at N = 65536: n = 2048, a 0.53 GB bf16 chunk beside 0.54 GB of hidden states."""
    n = (N * C // V) // 128 * 128
    return max(1, min(N, max(n, 128)))


def _accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b without an fp32 copy of the (V, n) operand a: the product is made in the inputs'
    dtype (fp32 accumulation inside the matmul) and summed over chunks in acc's fp32."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, label_smoothing, reduction, chunk_size, need_grad, terms):
        C = hidden.shape[-1]
        h = hidden.reshape(-1, C)                                  # (N, C)
        t = target.reshape(-1)
        N, V = h.shape[0], weight.shape[0]
        n_valid, grad_scale = _grad_scale(t, ignore_index, reduction)
        n = chunk_size or chunk_rows(N, C, V)
        loss_rows = torch.empty(N, dtype=torch.float32, device=h.device)
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_grad else None
        logits = torch.empty(min(n, N), V, dtype=h.dtype, device=h.device)   # (n, V): the only logits alive
        for i in range(0, N, n):
            h_c, z_c = h[i: i + n], logits[: min(n, N - i)]
            torch.mm(h_c, weight.T, out=z_c)                       # Z_c = H_c W^T              (n, V)
            # the kernel overwrites Z_c with G_c = dL/dZ_c: the chunk's logits are dead after it
            loss_rows[i: i + n] = _ce_rows(z_c, t[i: i + n], ignore_index, label_smoothing, grad_scale,
                                           z_c if need_grad else None, **terms)
            if need_grad:
                torch.mm(z_c, weight, out=grad_h[i: i + n])        # dL/dH_c = G_c W            (n, C)
                _accumulate_(grad_w, z_c.T, h_c)                   # dL/dW  += G_c^T H_c        (V, C)
        del logits
        ctx.reduction = reduction
        ctx.shapes = (hidden.shape, weight.dtype)
        ctx.grads = (grad_h, grad_w)
        return _reduce(loss_rows, n_valid, reduction, target.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden_shape, w_dtype = ctx.shapes
        if ctx.reduction == "none":
            # Per-row incoming gradients do not factor out of grad_w; this case is for inspection only.
            raise RuntimeError("fused_linear_cross_entropy: backward with reduction='none' is not supported; "
                               "use 'mean' or 'sum'")
        grad_h, grad_w = _pop_grads(ctx, "fused_linear_cross_entropy")
        return (_scale_(grad_h, grad_out).reshape(hidden_shape), _scale_(grad_w, grad_out).to(w_dtype),
                None, None, None, None, None, None, None)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, label_smoothing: float = 0.0,
                               reduction: str = "mean", chunk_size: int | None = None, *, z_loss: float = 0.0,
                               softcap: float | None = None) -> torch.Tensor:
    """cross_entropy(hidden @ weight^T, target) without ever holding all the logits (``z_loss`` and
    ``softcap`` as in :func:`cross_entropy`).

    hidden (..., C), weight (V, C) (the LM head, or the tied embedding), target (...). Logits are made
    ``chunk_size`` tokens at a time (default :func:`chunk_rows`) into one (chunk, V) buffer; the
    kernel overwrites each chunk's logits with their gradient, which is folded into dL/dhidden and
    dL/dweight (fp32) during the forward pass. Peak extra memory: one chunk of logits, dL/dweight in
    fp32 and dL/dhidden, instead of several (N, V) tensors. Backward scales the two gradients in place
    and runs once per forward.
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
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1 (or None for chunk_rows), got {chunk_size}")
    _check_target(name, target, weight.shape[0], ignore_index, hidden.device)
    _check_options(name, label_smoothing, reduction)
    terms = _check_terms(name, z_loss, softcap)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(hidden, weight, target, int(ignore_index), float(label_smoothing),
                                          reduction, None if chunk_size is None else int(chunk_size), need_grad,
                                          terms)


def compile_jobs() -> dict:
    """The fused cross-entropy over 4096 tokens of Llama 2's (32000), Llama 3's (128256) and Qwen 2's
    (151936) vocabularies, bf16 logits with the gradient in place, and Gemma 2's (256000) with its
    z-loss and logit soft-capping compiled in."""
    jobs = {f"cross-entropy V={V}, 4096 tokens, bf16": aot_job(V, "bf16") for V in (32_000, 128_256, 151_936)}
    jobs["cross-entropy V=256000, 4096 tokens, bf16, z-loss + softcap"] = aot_job(256_000, "bf16", z_loss=True,
                                                                                  softcap=True)
    return jobs
