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
The row is read once and 2k numbers are written: one pass over memory instead of three.

Public interface:

* :func:`softmax_topk_ref` -- the fused pass in PyTorch, block by block;
* :func:`softmax_topk` -- the Triton kernel, one program per row, any row length.

* :func:`topk_launch` -- the kernel's block, key-list width and warps, used by the launcher and
  by the ahead-of-time spill check (:func:`launch_job`).

Both return ``(probs, indices)`` of shape ``(..., k)``, largest first, like
``torch.topk(torch.softmax(x, -1), k)``. The kernel breaks ties between equal logits towards the
earlier column; torch does not promise an order for ties.

The kernel keeps its running top-k as packed 64-bit keys: an order-preserving integer image of the
fp32 logit in the high 32 bits and the (complemented) column in the low 32, so that one integer
``tl.topk`` orders by value, breaks ties by column, and carries the index along. Each block costs one
bitonic top-k of the block and one of the 2 x BLOCK_K merged keys, instead of k unrolled rounds of
max and strike-out (which spilled at vocabulary widths: 1264 STL+LDL at V=128256, k=50, 32 warps,
when it was replaced).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.rows import as_rows, check_block_size
from kernels.softmax.online import _check_input, _wide, merge_softmax_stats, softmax_stats

MAX_K = 64          # the running keys live in registers; the AOT test checks k = 64 at vocabulary widths
MAX_BLOCK = 2048    # columns a program takes at once: KEYS_PER_THREAD keys a thread at MAX_WARPS warps
KEYS_PER_THREAD = 8 # int64 keys: 16 registers a thread per live copy of the block
MAX_WARPS = 8


@dataclass(frozen=True)
class TopkLaunch:
    """``block_n`` columns per block, a running list of ``block_k`` keys, ``num_warps`` warps."""

    block_n: int
    block_k: int
    num_warps: int


def topk_launch(n_cols: int, k: int, block_size: int | None = None) -> TopkLaunch:
    """The launch of :func:`softmax_topk` for rows of ``n_cols`` and ``k`` kept entries (the launcher
    and the AOT spill test both call this). The keys are int64 whatever the input dtype, so the
    dtype does not enter. ``block_k`` is k rounded up to a power of two (``tl.topk`` needs one) and at
    least 2; a block holds at least ``block_k`` columns. Measured for sm_90a (the chapter prints the
    table): 2048 columns at 8 warps keep k = 64 in 122 registers with no spills; 8192 at 16 warps spill.
    ``block_size`` (a power of two) caps the block, for the tests' short rows."""
    check_block_size("softmax_topk", block_size)
    block_k = max(2, triton.next_power_of_2(k))
    block_n = max(block_k, min(triton.next_power_of_2(n_cols), block_size or MAX_BLOCK))
    return TopkLaunch(block_n, block_k, min(max(block_n // (32 * KEYS_PER_THREAD), 1), MAX_WARPS))


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
def _order_key(x):
    """fp32 -> int32 in the same order under a signed compare. A non-negative float's bits already
    grow with its value; a negative float's bits grow as it falls, so its 31 magnitude bits are
    flipped: -inf (0xFF800000) becomes 0x807FFFFF, the least key a number can have. -0 is folded
    into +0 first, so that equal values get equal keys."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _pack(x, col):
    """(value, column) -> one int64 whose order is (value, then earlier column) largest first:
    key = order_key(x) * 2**32 + (2**31 - 1 - col), for 0 <= col < 2**31."""
    return (_order_key(x).to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)


@triton.jit
def _unpack(key):
    """The inverse of _pack: (fp32 value, int64 column)."""
    hi = (key >> 32).to(tl.int32)
    bits = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi)
    return bits.to(tl.float32, bitcast=True), 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit(do_not_specialize=["k"])  # k a plain i32 on a GPU too: no variant for k = 1 or k % 16 == 0
def _softmax_topk_kernel(
    x_ptr, p_ptr, i_ptr, n_cols, stride_x, k,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per row, the row walked once in blocks of BLOCK_N (>= BLOCK_K). Per block:
        (m, l) merged as in the online softmax;
        the running top-BLOCK_K packed keys merged with the block's: topk of the block, then topk
        of the 2 * BLOCK_K keys of the two lists.
    Writes p = exp(v - m) / l and the columns of the first k keys, largest first (k <= BLOCK_K is
    an argument, not a constant: every k up to a power of two shares one compiled kernel)."""
    row = tl.program_id(0).to(tl.int64)                                   # int64: row * stride may pass 2**31
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m = tl.full((), float("-inf"), tl.float32)                            # running max
    l = tl.full((), 0.0, tl.float32)                                      # running sum of exp(x - m)
    top = tl.full((BLOCK_K,), -2**63, tl.int64)                           # running top keys; -2**63 loses to all
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)             # all -inf so far: contribute 0
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)   # l' = l e^(m - m') + sum e^(x - m')
        m = m_new
        keys = tl.where(c < n_cols, _pack(x, c), -2**63)                  # (BLOCK_N,); padded lanes lose
        # (2 BLOCK_K,): old top and block's top, in any order: topk reads them as a set (the packed keys
        # are distinct), so the unordered cat is exact, and it is the only cat Triton 3.6 has
        both = tl.cat(top, tl.topk(keys, BLOCK_K), can_reorder=True)
        top = tl.topk(both, BLOCK_K)                                      # the BLOCK_K largest, largest first
    v, col = _unpack(top)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(v - m_safe) / l
    tl.store(p_ptr + row * k + ks, p.to(p_ptr.dtype.element_ty), mask=ks < k)
    tl.store(i_ptr + row * k + ks, col, mask=ks < k)


def softmax_topk(x: torch.Tensor, k: int, *, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(torch.softmax(x, -1), k)`` in one pass over each row of ``x`` (fp16, bf16 or
    fp32, any shape, softmax over the last dimension); forward only. Returns probabilities in
    ``x``'s dtype and int64 indices, shape ``(..., k)``. ``block_size`` (a power of two) caps the
    block the row is walked in (raised to k's power of two); by default :func:`topk_launch`."""
    _check_input(x, -1)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"softmax_topk: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    _check_k(x, k)
    x2 = as_rows(x)                                                       # (rows, n)
    n_rows, n_cols = x2.shape
    probs = torch.empty((n_rows, k), dtype=x.dtype, device=x.device)
    idx = torch.empty((n_rows, k), dtype=torch.int64, device=x.device)
    if n_rows:
        grid, args, kwargs = _topk_args(x2, probs, idx, k, topk_launch(n_cols, k, block_size))
        _softmax_topk_kernel[grid](*args, **kwargs)
    return probs.view(*x.shape[:-1], k), idx.view(*x.shape[:-1], k)


def _topk_args(x2: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor, k: int, lc: TopkLaunch):
    """(grid, args, kwargs) of :func:`softmax_topk`'s launch on the (rows, n) ``x2``, one program per row;
    shared by the launcher and :func:`launch_job`."""
    return ((x2.shape[0],), (x2, probs, idx, x2.shape[1], x2.stride(0), k),
            dict(BLOCK_K=lc.block_k, BLOCK_N=lc.block_n, num_warps=lc.num_warps))


def launch_job(n_cols: int, k: int, dtype: torch.dtype = torch.float16, n_rows: int = 64,
               launch: TopkLaunch | None = None):
    """The :class:`kernels.inspect.TritonJob` of the launch :func:`softmax_topk` makes for ``n_rows``
    contiguous rows of ``n_cols`` of ``dtype`` and ``k``, on meta tensors (:func:`kernels.inspect.launch_job`);
    the launcher's own :func:`topk_launch`, or ``launch`` to compile another."""
    from kernels import inspect as ki

    x2 = torch.empty(n_rows, n_cols, dtype=dtype, device="meta")            # (rows, n)
    probs = torch.empty(n_rows, k, dtype=dtype, device="meta")
    idx = torch.empty(n_rows, k, dtype=torch.int64, device="meta")
    grid, args, kwargs = _topk_args(x2, probs, idx, k, launch or topk_launch(n_cols, k))
    return ki.launch_job(_softmax_topk_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Sampling from Llama 3's vocabulary (128256) for a batch of 64 sequences, fp16: k = 1 (a running
    list of 2) and k = 50 (the top-k Hugging Face's ``generate`` defaults to; a list of 64, the kernel
    of every k from 33 to :data:`MAX_K`)."""
    return {f"Llama 3 vocabulary 128256, batch 64, k={k}": launch_job(128256, k) for k in (1, 50)}
