"""What the norm kernels share: input checks, block sizes, and the weight-gradient sum (the (rows, n)
view and the warp count come from :mod:`kernels.rows`).

A norm over the last dimension treats ``x`` as a matrix of ``rows = numel / n`` rows of ``n``
features. Each forward program normalizes ``BLOCK_R`` whole rows held in one (BLOCK_R, BLOCK_N)
tile. Each backward program walks a strided set of row tiles, writes its rows of dx, and keeps
running column sums for the weight (and bias) gradients; those per-program partial sums, a
(programs, n) fp32 buffer, are added up by :func:`sum_partials` (``_sum_partials_kernel``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The longest row a norm kernel holds in one block (a row is reduced in registers, not re-read).
MAX_FEATURES = 65536
# Elements per (BLOCK_R, BLOCK_N) tile: several short rows share one program.
TILE_ELEMENTS = 4096


def wide(x: torch.Tensor | None) -> torch.Tensor | None:
    """fp32 for fp16/bf16/fp32; float64 stays float64 (so gradcheck can run the references)."""
    if x is None:
        return None
    return x if x.dtype == torch.float64 else x.float()


def check_norm_inputs(fn: str, x, **params) -> int:
    """Validate ``x`` and the per-feature parameters (``weight=``, ``bias=``); return n = x.shape[-1]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension (the features), got a 0-d tensor")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"{fn}: x has no features (last dimension is 0), shape {tuple(x.shape)}")
    if n > MAX_FEATURES:
        raise ValueError(f"{fn}: rows of {n} features exceed the kernel's one-block limit of {MAX_FEATURES}")
    if x.device.type != runtime.device().type:
        raise ValueError(f"{fn}: x is on {x.device}, kernels run on {runtime.device()} here")
    for name, p in params.items():
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != (n,):
            raise ValueError(
                f"{fn}: {name} must have shape ({n},) to match the last dimension of x {tuple(x.shape)}, "
                f"got {tuple(p.shape)}"
            )
        if p.dtype != x.dtype:
            raise TypeError(f"{fn}: {name} has dtype {p.dtype} but x has {x.dtype}; they must match")
        if p.device != x.device:
            raise ValueError(f"{fn}: {name} is on {p.device} but x is on {x.device}")
    return n


def block_sizes(n_rows: int, n: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N): a whole row per block, as many rows as fit in TILE_ELEMENTS."""
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(TILE_ELEMENTS // block_n, triton.next_power_of_2(max(n_rows, 1))))
    return block_r, block_n


def backward_programs(n_tiles: int) -> int:
    """How many programs share the backward's row tiles (each writes one row of partial sums)."""
    if runtime.runtime().on_gpu:
        return max(1, min(n_tiles, 4 * torch.cuda.get_device_properties(0).multi_processor_count))
    return max(1, min(n_tiles, 4))  # the interpreter runs programs one after another: keep few


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, n_parts, n, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[j] = sum_p partial[p, j]: the column sums of a (n_parts, n) fp32 buffer."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    parts = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        p = start + parts
        mask = (p[:, None] < n_parts) & (cols[None, :] < n)
        acc += tl.sum(tl.load(p_ptr + p[:, None] * n + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of the contiguous (programs, n) fp32 ``partial``, returned in ``dtype``."""
    n_parts, n = partial.shape
    out = torch.empty(n, dtype=dtype, device=partial.device)
    block_n = min(triton.next_power_of_2(n), 1024)
    block_p = min(triton.next_power_of_2(n_parts), 64)
    _sum_partials_kernel[(triton.cdiv(n, block_n),)](partial, out, n_parts, n, BLOCK_P=block_p, BLOCK_N=block_n)
    return out
