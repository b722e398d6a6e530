"""Token log-probabilities log pi(y_t | x_{<t}) from an LM head, without the (N, V) log-softmax.

Every RL and preference loss in this part reads one number per generated token: the log-probability
the policy gives the token it produced. With logits z (V,) and the token y,

    log pi(y) = z_y - lse(z),        lse(z) = log sum_j exp(z_j)
    d log pi(y) / d z_j = [j = y] - softmax(z)_j

which is minus the cross-entropy of kernels.model.lm_head: the forward reuses that kernel
(``_ce_rows``, one program per row, online max and sum over blocks of the vocabulary). The backward
differs. A loss over log-probs gives every token its own incoming gradient g_t (the advantage, a
KL weight, a DPO sigmoid), known only when backward runs, so the forward cannot fold the gradient
into the weight as the fused cross-entropy does. :func:`fused_linear_token_logprobs` therefore
keeps one float per token, lse, and in backward remakes each chunk of logits, lets
``_logprob_grad_kernel`` overwrite them with g_t ([j = y_t] - exp(z_j - lse_t)), and folds that
chunk into dL/dhidden and dL/dweight: the (N, V) logits never exist at once, in either pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels import rows, runtime
from kernels.model.lm_head import DTYPES_BY_NAME, SUPPORTED_DTYPES, _ce_rows, chunk_rows, launch_config

IGNORE = -100


def token_logprobs_ref(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[target], fp32 (float64 stays float64); logits (..., V), target (...)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(x, dim=-1).gather(-1, target.long()[..., None]).squeeze(-1)


def fused_linear_token_logprobs_ref(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The unfused version: all logits hidden @ weight^T at once, then :func:`token_logprobs_ref`."""
    return token_logprobs_ref(hidden @ weight.T, target)


@triton.jit
def _logprob_grad_kernel(
    z_ptr, t_ptr, lse_ptr, g_ptr,       # logits (N, V) overwritten by the gradient, targets (N,), lse (N,), dL/dlogp (N,)
    V, stride_zn,
    BLOCK_V: tl.constexpr, ONE_HOT: tl.constexpr,
):
    """dL/dz_j = g * ([j = t] - exp(z_j - lse)), written over z in place, one program per row.
    ONE_HOT=False drops the indicator (a broken variant: the gradient of -lse alone)."""
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_zn    # row * stride passes 2**31 at V = 128256 from row 16744 on
    t = tl.load(t_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        ok = v < V
        z = tl.load(z_row + v, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)                                            # softmax_j
        d = tl.where(v == t, 1.0, 0.0) - p if ONE_HOT else -p          # d log pi(t) / d z_j
        tl.store(z_row + v, (g * d).to(z_ptr.dtype.element_ty), mask=ok)


def _grad_args(z, t, lse, g, one_hot: bool):
    """(grid, args, kwargs) of the gradient launch on z (n, V); shared by :func:`_grad_rows` and :func:`aot_job`."""
    n, V = z.shape
    block, warps = launch_config(V)
    return (n,), (z, t, lse, g, V, z.stride(0)), dict(BLOCK_V=block, ONE_HOT=one_hot, num_warps=warps)


def aot_job(V: int, dtype: str = "fp32", n_rows: int = 4096):
    """The gradient launch :func:`_grad_rows` makes on ``n_rows`` rows of a vocabulary of V, built from
    meta tensors by :func:`kernels.inspect.launch_job` (Triton's own specialisation of the launch)."""
    from kernels import inspect as ki

    z = torch.empty(n_rows, V, dtype=DTYPES_BY_NAME[dtype], device="meta")                  # (n, V) logits, gradient in place
    t = torch.empty(n_rows, dtype=torch.int64, device="meta")
    lse, g = (torch.empty(n_rows, dtype=torch.float32, device="meta") for _ in range(2))
    grid, args, kwargs = _grad_args(z, t, lse, g, True)
    return ki.launch_job(_logprob_grad_kernel, *args, grid=grid, **kwargs)


def _forward_rows(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(t), lse) per row of z (n, V): the cross-entropy kernel gives lse - z_t; z_t is one gather."""
    nll = _ce_rows(z, t, IGNORE, 0.0, 1.0)                           # (n,) lse - z_t, fp32
    z_t = z.gather(1, t[:, None]).squeeze(1).float()
    return -nll, nll + z_t


def _grad_rows(z: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, one_hot: bool = True) -> None:
    """Overwrite z (n, V) with dL/dz given dL/dlogp = g (n,)."""
    if z.shape[0]:
        grid, args, kwargs = _grad_args(z, t, lse, g.float().contiguous(), one_hot)
        _logprob_grad_kernel[grid](*args, **kwargs)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, one_hot):
        z = rows.as_rows(logits)                                       # (N, V)
        t = target.reshape(-1).long()
        logp, lse = _forward_rows(z, t)
        ctx.save_for_backward(logits, t, lse)
        ctx.one_hot = one_hot
        return logp.reshape(target.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, t, lse = ctx.saved_tensors
        grad = rows.as_rows(logits).clone(memory_format=torch.contiguous_format)   # the kernel writes over it
        _grad_rows(grad, t, lse, grad_out.reshape(-1), ctx.one_hot)
        return grad.reshape(logits.shape), None, None


def _check(name: str, x: torch.Tensor, target: torch.Tensor, V: int, lead) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: inputs must be torch.Tensors")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: got dtype {x.dtype}; supported: float16, bfloat16, float32")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must be int64 or int32 token ids, got {target.dtype}")
    if tuple(target.shape) != tuple(lead):
        raise ValueError(f"{name}: target shape {tuple(target.shape)} must equal the leading shape {tuple(lead)}")
    if x.device.type != runtime.device().type or target.device != x.device:
        raise ValueError(f"{name}: inputs must be on {runtime.device()} (got {x.device} and {target.device})")
    if target.numel() and bool(((target < 0) | (target >= V)).any()):
        raise ValueError(f"{name}: target ids must be in [0, {V})")


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, one_hot: bool = True) -> torch.Tensor:
    """log_softmax(logits)[target] (fp32, shape of target), differentiable in logits, no (N, V) log-softmax.

    logits (..., V) fp16/bf16/fp32, target (...) int. ``one_hot=False`` is the broken backward the
    tests must catch (the gradient of -lse only)."""
    _check("token_logprobs", logits, target, logits.shape[-1] if logits.dim() else 0, logits.shape[:-1])
    return _TokenLogprobs.apply(logits, target, bool(one_hot))


class _FusedLinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, chunk, one_hot):
        C = hidden.shape[-1]
        h = hidden.reshape(-1, C)                                      # (N, C)
        t = target.reshape(-1).long()
        N, V = h.shape[0], weight.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=h.device)
        lse = torch.empty(N, dtype=torch.float32, device=h.device)
        for i in range(0, N, chunk):
            z_c = h[i: i + chunk] @ weight.T                           # Z_c = H_c W^T   (n, V), the only logits alive
            logp[i: i + chunk], lse[i: i + chunk] = _forward_rows(z_c, t[i: i + chunk])
        ctx.save_for_backward(hidden, weight, t, lse)
        ctx.chunk, ctx.one_hot = chunk, one_hot
        return logp.reshape(target.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, t, lse = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        g = grad_out.reshape(-1)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        for i in range(0, h.shape[0], ctx.chunk):
            h_c = h[i: i + ctx.chunk]
            z_c = h_c @ weight.T                                       # remade, then overwritten by G_c = dL/dZ_c
            _grad_rows(z_c, t[i: i + ctx.chunk], lse[i: i + ctx.chunk], g[i: i + ctx.chunk], ctx.one_hot)
            torch.mm(z_c, weight, out=grad_h[i: i + ctx.chunk])        # dL/dH_c = G_c W        (n, C)
            grad_w += (z_c.T @ h_c).float()                            # dL/dW  += G_c^T H_c    (V, C)
        return grad_h.reshape(hidden.shape), grad_w.to(weight.dtype), None, None, None


def fused_linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                chunk_size: int | None = None, *, one_hot: bool = True) -> torch.Tensor:
    """log_softmax(hidden @ weight^T)[target] a chunk of tokens at a time (default
    kernels.model.lm_head.chunk_rows); hidden (..., C), weight (V, C), target (...). Differentiable in
    hidden and weight; stores lse (one fp32 per token) for backward, which remakes each chunk's logits."""
    name = "fused_linear_token_logprobs"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(hidden, torch.Tensor) \
            or hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{name}: hidden must be (..., C) and weight (V, C)")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{name}: hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    _check(name, hidden, target, weight.shape[0], hidden.shape[:-1])
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    N = target.numel()
    chunk = int(chunk_size) if chunk_size else chunk_rows(max(N, 1), hidden.shape[-1], weight.shape[0])
    return _FusedLinearTokenLogprobs.apply(hidden, weight, target, chunk, bool(one_hot))


def compile_jobs() -> dict:
    """The gradient launch over 4096 tokens of Llama 3's (128256) and Qwen 2.5's (151936) vocabularies, bf16 logits."""
    return {f"vocabulary {V}, 4096 tokens, bf16": aot_job(V, "bf16") for V in (128_256, 151_936)}
