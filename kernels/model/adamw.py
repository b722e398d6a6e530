"""A fused mixed-precision AdamW step in Triton, and the byte counts that argue for it.

Mixed-precision training (Micikevicius et al. 2018) keeps an FP32 master copy of the weights and
the two Adam moments in FP32, and runs the forward and backward on a BF16 copy. One optimizer step
reads, per parameter, the BF16 gradient, the FP32 master weight and both moments, and writes the
master weight, the moments and the fresh BF16 copy: :func:`fused_adamw_` does that in one pass over
memory. The update is torch.optim.AdamW's (Loshchilov & Hutter 2019: decoupled weight decay)::

    p <- p (1 - lr wd)
    m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    w <- bf16(p)

The tensors are flat (a real model's parameters flattened into one buffer, as FSDP and ZeRO shard
them), so the element offset is a 64-bit integer: Llama-3-8B has 8.03e9 parameters, past 2**31.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rows import RowBudget, warps_for

ADAMW_BUDGET = RowBudget(per_thread=8, max_block=1024)

# Bytes per parameter of each tensor the step touches.
BYTES = {"bf16 weight": 2, "bf16 grad": 2, "fp32 master": 4, "adam m": 4, "adam v": 4}


@triton.jit
def _round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic: add 0x7FFF plus the lowest kept
    bit, clear the 16 dropped bits, then convert (exact now). Written out because Triton's
    interpreter truncates an fp32 -> bf16 cast where a GPU rounds to nearest; this gives both the
    same bits as torch's ``.to(torch.bfloat16)`` for finite values."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _adamw_kernel(w_ptr, g_ptr, p_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                  step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    """One AdamW step over n flat elements: 4 reads (g bf16, p m v fp32), 4 writes (p m v, w bf16)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)   # (BLOCK,) int64
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * weight_decay)                    # decoupled decay, before the Adam step
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(w_ptr + offs, _round_to_bf16(p), mask=mask)


def launch(block_size: int | None = None, *, on_gpu: bool | None = None) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: 1024 elements and 4 warps per program on a GPU (8 a thread), 8192 on
    the interpreter (fewer, larger programs). ``block_size`` overrides the block."""
    gpu = runtime.runtime().on_gpu if on_gpu is None else on_gpu
    block = block_size or (1024 if gpu else 8192)
    return block, warps_for(block, ADAMW_BUDGET)


def _launch_args(weight, grad, master, m, v, *, lr, betas, eps, weight_decay, step, block, warps):
    """(grid, args, kwargs) of one launch; shared by :func:`fused_adamw_` and :func:`launch_job`."""
    b1, b2 = betas
    step_size = lr / (1.0 - b1 ** step)               # bias corrections in double on the host
    inv_sqrt_bc2 = 1.0 / math.sqrt(1.0 - b2 ** step)
    n = master.numel()
    args = (weight, grad, master, m, v, n, lr, b1, b2, eps, weight_decay, step_size, inv_sqrt_bc2)
    return (triton.cdiv(n, block),), args, dict(BLOCK=block, num_warps=warps)


def _check(weight, grad, master, m, v, lr, betas, eps, weight_decay, step) -> None:
    named = dict(weight=weight, grad=grad, master=master, exp_avg=m, exp_avg_sq=v)
    want = dict(weight=torch.bfloat16, grad=torch.bfloat16, master=torch.float32, exp_avg=torch.float32,
                exp_avg_sq=torch.float32)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_adamw_: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != want[name]:
            raise TypeError(f"fused_adamw_: {name} must be {want[name]}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"fused_adamw_: {name} must be contiguous (a flat parameter buffer)")
        if t.device.type != runtime.device().type:
            raise ValueError(f"fused_adamw_: {name} is on {t.device}, kernels run on {runtime.device()} here")
        if t.numel() != master.numel():
            raise ValueError(f"fused_adamw_: {name} has {t.numel()} elements, master has {master.numel()}")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"fused_adamw_: step counts from 1 (the bias correction divides by 1 - beta**step), got {step!r}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"fused_adamw_: betas must lie in [0, 1), got {betas}")
    if not (lr >= 0.0 and eps > 0.0 and weight_decay >= 0.0):
        raise ValueError(f"fused_adamw_: need lr >= 0, eps > 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}")


def fused_adamw_(weight: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, *, lr: float, step: int, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 block_size: int | None = None, _kernel=None) -> None:
    """In place: the AdamW step ``step`` (from 1) on the FP32 ``master``, ``exp_avg`` (m) and
    ``exp_avg_sq`` (v), from the BF16 ``grad``; ``weight`` (BF16) receives the rounded new master.
    All five are flat, contiguous and of one length. Same defaults as torch.optim.AdamW."""
    if amsgrad:
        raise NotImplementedError("fused_adamw_: amsgrad is not implemented")
    if maximize:
        raise NotImplementedError("fused_adamw_: maximize is not implemented")
    _check(weight, grad, master, exp_avg, exp_avg_sq, lr, betas, eps, weight_decay, step)
    block, warps = launch(block_size)
    grid, args, kwargs = _launch_args(weight, grad, master, exp_avg, exp_avg_sq, lr=lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay, step=step, block=block, warps=warps)
    (_kernel or _adamw_kernel)[grid](*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Bytes: the ledger of training state, and the traffic of one step


def state_bytes_per_param() -> int:
    """2 + 2 + 4 + 4 + 4 = 16: the ZeRO paper's 2 + 2 + K with K = 12 (Rajbhandari et al. 2020)."""
    return sum(BYTES.values())


def fused_bytes_per_param() -> dict[str, int]:
    """Bytes read and written per parameter by :func:`_adamw_kernel`: each tensor once."""
    read = BYTES["bf16 grad"] + BYTES["fp32 master"] + BYTES["adam m"] + BYTES["adam v"]
    write = BYTES["fp32 master"] + BYTES["adam m"] + BYTES["adam v"] + BYTES["bf16 weight"]
    return {"read": read, "write": write, "total": read + write}


# The unfused step as separate elementwise kernels (torch.optim.AdamW's for-loop path, one kernel per
# tensor op): (op, bytes read, bytes written) per parameter. Intermediates live in FP32 memory.
UNFUSED_OPS = (
    ("g32 = g.float()", 2, 4),
    ("p *= 1 - lr*wd", 4, 4),
    ("m.lerp_(g32, 1-b1)", 8, 4),
    ("v *= b2", 4, 4),
    ("v += (1-b2) g32*g32", 8, 4),
    ("d = v.sqrt()", 4, 4),
    ("d /= sqrt(bc2)", 4, 4),
    ("d += eps", 4, 4),
    ("p -= lr/bc1 * m/d", 12, 4),
    ("w.copy_(p)", 4, 2),
)


def unfused_bytes_per_param() -> dict[str, int]:
    read = sum(r for _, r, _ in UNFUSED_OPS)
    write = sum(w for _, _, w in UNFUSED_OPS)
    return {"read": read, "write": write, "total": read + write, "kernels": len(UNFUSED_OPS)}


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds at real sizes

REAL_SIZES = (
    ("Llama-3-8B, whole model", 8_030_261_248),            # past 2**31: the offset must be 64-bit
    ("Llama-3-70B, 1/8 FSDP shard", 70_553_706_496 // 8),
)


def launch_job(n: int, *, on_gpu: bool = True):
    """The :class:`kernels.inspect.TritonJob` of :func:`fused_adamw_`'s launch over n parameters (meta tensors)."""
    from kernels import inspect as ki

    w = torch.empty(n, dtype=torch.bfloat16, device="meta")    # (n,) bf16: weight and grad
    p = torch.empty(n, dtype=torch.float32, device="meta")     # (n,) fp32: master, m, v
    block, warps = launch(on_gpu=on_gpu)
    grid, args, kwargs = _launch_args(w, w, p, p, p, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                      step=1, block=block, warps=warps)
    return ki.launch_job(_adamw_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """:data:`REAL_SIZES`: one AdamW step over a flat BF16/FP32 parameter buffer, the GPU launch."""
    return {f"adamw {label}": launch_job(n) for label, n in REAL_SIZES}
