"""A deliberately wrong online softmax, kept so the chapter and the tests can show it is caught.

``_online_no_rescale_kernel`` is ``_softmax_online_kernel`` (:mod:`kernels.softmax.online`) with
one line changed: when a block raises the running max from m to m', the running sum should become
``l * exp(m - m') + sum exp(x_blk - m')``; this kernel forgets the factor ``exp(m - m')``, so every
earlier block keeps the weight it had against its own, smaller, max. The result is exact only when
the first block already holds the row's max, which is why a check with random rows can miss it and
a check with an increasing row cannot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rows import as_rows
from kernels.softmax.online import _check_input, launch


@triton.jit
def _online_no_rescale_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
    """BROKEN on purpose: the running sum is not rescaled when the running max grows."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.full((), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        l = l + tl.sum(tl.exp(x - m_new), axis=0)        # BROKEN: should be l * exp(m - m_new) + ...
        m = m_new
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        tl.store(y_ptr + row * stride_y + c, (tl.exp(x - m) / l).to(y_ptr.dtype.element_ty), mask=c < n_cols)


def softmax_without_rescale(x: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Softmax over the last dimension by the broken kernel, the row walked in blocks of ``block_size``
    (a power of two) with the same launch rule as :func:`kernels.softmax.softmax`. Forward only."""
    _check_input(x, -1)
    lc = launch(max(x.numel() // max(x.shape[-1], 1), 1), max(x.shape[-1], 1), x.dtype, block_size)
    x2 = as_rows(x)
    y2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        _online_no_rescale_kernel[(x2.shape[0],)](x2, y2, x2.shape[1], x2.stride(0), y2.stride(0),
                                                  BLOCK_N=lc.block_n, num_warps=lc.num_warps)
    return y2.view(x.shape)
