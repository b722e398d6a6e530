"""Softmax fused with top-k: the k most probable entries of each row and their probabilities in
one pass over the row (Milakov and Gimelshein, 2018, arXiv:1805.02867).

Sampling from a language model's output needs only the k largest probabilities of a vocabulary
row, not the whole softmax. Composed, ``torch.topk(torch.softmax(x), k)`` reads the row, writes all
n probabilities, and reads them again. Since softmax is increasing, the top k probabilities sit at
the top k logits, and

    p_i = exp(x_i - m) / l,     m = max_j x_j,   l = sum_j exp(x_j - m)

needs only the row's (m, l), which the online recurrence gathers block by block. So one walk over
the row can carry three running things: m, l (merged as in :func:`kernels.softmax.online.merge_softmax_stats`)
and the k largest logits seen so far with their positions (merged by keeping the k largest of the
old k and the new block). At the end ``exp(v - m) / l`` turns the k logits into probabilities.
The row is read once and 2k numbers are written: one pass over memory instead of four.

Public interface:

* :func:`softmax_topk_ref` -- the fused pass in PyTorch, block by block;
* :func:`softmax_topk` -- the Triton kernel, one program per row, any row length.

Both return ``(probs, indices)`` of shape ``(..., k)``, largest first, like
``torch.topk(torch.softmax(x, -1), k)``. Ties between equal logits may be ordered differently.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rows import as_rows
from kernels.softmax.online import _check_input, _wide, launch, merge_softmax_stats, softmax_stats

MAX_K = 64   # the running top-k lives in registers and costs k max-reductions per block


def _check_k(x: torch.Tensor, k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= min(x.shape[-1], MAX_K):
        raise ValueError(f"softmax_topk: k must be an int in [1, min(n, {MAX_K})] for rows of "
                         f"n={x.shape[-1]}, got {k!r}")


def softmax_topk_ref(x: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused pass in PyTorch over the last dimension, in blocks of ``block``: running (m, l)
    and running top-k logits with their indices; probabilities in fp32 (float64 kept)."""
    _check_k(x, k)
    xw = _wide(x)                                                          # (..., n)
    lead = xw.shape[:-1]
    m = torch.full((*lead, 1), float("-inf"), dtype=xw.dtype, device=xw.device)
    l = torch.zeros((*lead, 1), dtype=xw.dtype, device=xw.device)
    top_v = torch.full((*lead, k), float("-inf"), dtype=xw.dtype, device=xw.device)   # k largest logits so far
    top_i = torch.full((*lead, k), -1, dtype=torch.int64, device=xw.device)           # and their positions
    for start in range(0, xw.shape[-1], block):
        blk = xw[..., start:start + block]                                 # (..., b)
        m, l = merge_softmax_stats(m, l, *softmax_stats(blk))
        cand_v = torch.cat([top_v, blk], dim=-1)                           # (..., k + b)
        pos = torch.arange(start, start + blk.shape[-1], device=xw.device).expand(*lead, -1)
        cand_i = torch.cat([top_i, pos], dim=-1)
        top_v, j = cand_v.topk(k, dim=-1)                                  # keep the k largest
        top_i = cand_i.gather(-1, j)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return torch.exp(top_v - m_safe) / l, top_i                            # p = exp(v - m) / l


@triton.jit
def _softmax_topk_kernel(
    x_ptr, p_ptr, i_ptr, n_cols, stride_x,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per row, the row walked once in blocks of BLOCK_N. Per block:
        (m, l) merged as in the online softmax;
        the running top-K (values top_v, positions top_i) merged with the block by K rounds of
        "take the larger of the two heads, then strike it out".
    Writes p = exp(top_v - m) / l and top_i: K values each, largest first."""
    row = tl.program_id(0).to(tl.int64)                                   # int64: row * stride may pass 2**31
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m = tl.full((), float("-inf"), tl.float32)                            # running max
    l = tl.full((), 0.0, tl.float32)                                      # running sum of exp(x - m)
    top_v = tl.full((BLOCK_K,), float("-inf"), tl.float32)                # running top-K logits
    top_i = tl.full((BLOCK_K,), -1, tl.int64)                             # and their columns
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)             # all -inf so far: contribute 0
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)   # l' = l e^(m - m') + sum e^(x - m')
        m = m_new
        new_v = tl.full((BLOCK_K,), float("-inf"), tl.float32)
        new_i = tl.full((BLOCK_K,), -1, tl.int64)
        for r in tl.static_range(K):                                      # merge: K largest of top-K and block
            bv = tl.max(x, axis=0)
            bj = tl.argmax(x, axis=0)
            tv = tl.max(top_v, axis=0)
            tj = tl.argmax(top_v, axis=0)
            from_block = bv > tv                                          # ties keep the earlier column
            t_col = tl.sum(tl.where(ks == tj, top_i, 0), axis=0)
            new_v = tl.where(ks == r, tl.where(from_block, bv, tv), new_v)
            new_i = tl.where(ks == r, tl.where(from_block, start + bj, t_col), new_i)
            x = tl.where(cols == bj, tl.where(from_block, float("-inf"), x), x)        # strike the winner out
            top_v = tl.where(ks == tj, tl.where(from_block, top_v, float("-inf")), top_v)
        top_v = new_v
        top_i = new_i
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(top_v - m_safe) / l
    tl.store(p_ptr + row * K + ks, p.to(p_ptr.dtype.element_ty), mask=ks < K)
    tl.store(i_ptr + row * K + ks, top_i, mask=ks < K)


def softmax_topk(x: torch.Tensor, k: int, *, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(torch.softmax(x, -1), k)`` in one pass over each row of ``x`` (fp16, bf16 or
    fp32, any shape, softmax over the last dimension); forward only. Returns probabilities in
    ``x``'s dtype and int64 indices, shape ``(..., k)``. ``block_size`` (a power of two) caps the
    block the row is walked in; by default the launch rule of :func:`kernels.softmax.softmax`."""
    _check_input(x, -1)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"softmax_topk: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    _check_k(x, k)
    x2 = as_rows(x)                                                       # (rows, n)
    n_rows, n_cols = x2.shape
    probs = torch.empty((n_rows, k), dtype=x.dtype, device=x.device)
    idx = torch.empty((n_rows, k), dtype=torch.int64, device=x.device)
    if n_rows:
        lc = launch(n_rows, n_cols, x.dtype, block_size)
        _softmax_topk_kernel[(n_rows,)](x2, probs, idx, n_cols, x2.stride(0), K=k,
                                        BLOCK_K=triton.next_power_of_2(k), BLOCK_N=lc.block_n,
                                        num_warps=lc.num_warps)
    return probs.view(*x.shape[:-1], k), idx.view(*x.shape[:-1], k)
