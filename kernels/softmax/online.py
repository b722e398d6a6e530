"""Softmax over one dimension: naive, safe, online (one pass over the statistics), and the Triton kernels.

For a row :math:`x \\in \\mathbb{R}^n`

    softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m),        m = max_j x_j

Subtracting ``m`` changes nothing mathematically (the factor exp(-m) cancels between numerator
and denominator) but keeps every exponent <= 0, so exp never overflows. The *online* form computes
``m`` and the denominator ``l = sum_j exp(x_j - m)`` in one pass, block by block, by rescaling the
running sum whenever the running max grows (Milakov and Gimelshein, 2018). Two partial results
``(m_a, l_a)`` and ``(m_b, l_b)`` over disjoint parts of a row merge exactly
(:func:`merge_softmax_stats`); FlashAttention applies the same merge to tiles of attention scores.

Public interface:

* :func:`softmax` -- Triton, any row length, differentiable (Triton backward);
* :func:`softmax_ref` -- PyTorch's softmax computed in fp32 (float64 stays float64);
* :func:`naive_softmax_ref` -- no max subtraction: overflows, on purpose;
* :func:`online_softmax_ref` -- the one-pass running max and running sum, in PyTorch;
* :func:`log_softmax_ref` -- ``x - m - log l`` from the same statistics;
* :func:`softmax_stats`, :func:`merge_softmax_stats` -- the (max, sum) pair of a block and the
  merge of two pairs, which the FlashAttention chapters import.

Rows that are entirely ``-inf`` give NaN, as ``torch.softmax`` does: the max is ``-inf`` and the
denominator is 0, so every entry is 0/0. A row that is ``-inf`` in some blocks and finite in others
is handled exactly (those blocks contribute 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rows import SOFTMAX, RowLaunch, as_rows, check_block_size, row_launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The launch comes from kernels.rows.row_launch with the softmax's budget (kernels.rows.SOFTMAX): a row
# of at most SOFTMAX.max_block = 32768 elements is held in one block (one read of x, one write of y),
# several short rows to a program; a longer row is walked in blocks with the online recurrence (two
# reads, one write). The backward uses the same rule.


# ----------------------------------------------------------------------------------------------
# References (PyTorch)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 for fp16/bf16/fp32 inputs; float64 stays float64 (for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The reference: ``torch.softmax`` in fp32 from the same inputs (float64 kept), returned wide."""
    return torch.softmax(_wide(x), dim=dim)


def naive_softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x) / sum exp(x) with no max subtraction, in the input's own dtype.

    Mathematically equal to softmax, numerically not: exp(x) overflows to inf once x exceeds
    log(max of the dtype) -- about 11.09 in fp16 and 88.72 in fp32 -- and inf/inf is NaN.
    """
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def softmax_stats(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics of one block: ``m = max x`` and ``l = sum exp(x - m)`` along ``dim`` (kept).

    A block that is all ``-inf`` has ``m = -inf`` and ``l = 0`` (not NaN): it contributes nothing.
    """
    m = x.amax(dim=dim, keepdim=True)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # keep exp(-inf - (-inf)) out
    l = torch.exp(x - m_safe).sum(dim=dim, keepdim=True)
    return m, l


def merge_softmax_stats(
    m_a: torch.Tensor, l_a: torch.Tensor, m_b: torch.Tensor, l_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the softmax statistics of two disjoint parts of a row into those of their union.

    With ``l_a = sum_{i in A} exp(x_i - m_a)`` and likewise for B, the union has

        m = max(m_a, m_b)
        l = l_a * exp(m_a - m) + l_b * exp(m_b - m)

    which is exact: each partial sum is rescaled from its own max to the common one. The merge is
    associative and commutative, so a row can be split into blocks and the blocks merged in any
    order (left to right: the online softmax; as a tree: a parallel reduction; per tile of
    attention scores: FlashAttention, which rescales its output accumulator by the same factors).
    A part with ``m = -inf`` (all entries -inf, ``l = 0``) is the identity of the merge; two such
    parts give ``(-inf, 0)``, never NaN.
    """
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    l = l_a * torch.exp(m_a - m_safe) + l_b * torch.exp(m_b - m_safe)
    return m, l


def log_softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log softmax(x) = x - m - log l from the row's statistics (:func:`softmax_stats`), in fp32
    (float64 kept), returned wide.

    Never ``log(softmax(x))``: an entry far below the max has a probability that underflows to 0,
    whose log is -inf, while ``x_i - m - log l`` is its finite log-probability (about ``x_i - m``).
    """
    xw = _wide(x)
    m, l = softmax_stats(xw, dim=dim)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return xw - m_safe - torch.log(l)                  # an all -inf row: -inf - 0 - log 0 = NaN, like torch


def online_softmax_ref(x: torch.Tensor, dim: int = -1, block: int = 128) -> torch.Tensor:
    """Softmax from the online recurrence: one pass over ``x`` in blocks of ``block`` for (m, l),
    then one pass to write ``exp(x - m) / l``. Computed in fp32 (float64 kept), returned wide."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    xw = _wide(x).movedim(dim, -1)                         # (..., n)
    shape = (*xw.shape[:-1], 1)
    m = torch.full(shape, float("-inf"), dtype=xw.dtype, device=xw.device)   # running max, (..., 1)
    l = torch.zeros(shape, dtype=xw.dtype, device=xw.device)                 # running sum of exp(x - m)
    for start in range(0, xw.shape[-1], block):
        m_b, l_b = softmax_stats(xw[..., start:start + block])
        m, l = merge_softmax_stats(m, l, m_b, l_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    y = torch.exp(xw - m_safe) / l                         # an all -inf row: 0 / 0 = NaN, like torch
    return y.movedim(-1, dim)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _softmax_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """v1, fused: BLOCK_R whole rows per program, each row in one block (n_cols <= BLOCK_N).

    x is read once and y written once: 2 memory passes per element.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)   # (BLOCK_R,), int64 offsets
    cols = tl.arange(0, BLOCK_N)                                         # (BLOCK_N,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)           # (BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, axis=1)                                                # m = max_j x_j, (BLOCK_R,)
    e = tl.exp(x - m[:, None])                                           # exp(x_j - m) <= 1; pads give 0
    l = tl.sum(e, axis=1)                                                # l = sum_j exp(x_j - m)
    y = e / l[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_online_kernel(
    x_ptr, y_ptr, n_cols, stride_x, stride_y,
    BLOCK_N: tl.constexpr,
):
    """v2, online: one program per row, the row walked in blocks of BLOCK_N (any n_cols).

    Pass 1 keeps the running max m and running sum l, rescaling l whenever m grows:
        m' = max(m, max(x_blk)),   l' = l * exp(m - m') + sum exp(x_blk - m')
    Pass 2 writes exp(x - m) / l. x is read twice and y written once: 3 passes per element
    (the three-pass safe softmax needs 4: max, sum, then read again and write).
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    m = tl.full((), float("-inf"), tl.float32)     # running max
    l = tl.full((), 0.0, tl.float32)               # running sum of exp(x - m)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While every entry so far is -inf, m_new is -inf: exponentiate against 0 instead, so that
        # exp(-inf - (-inf)) = NaN never enters l (all -inf so far contributes exactly 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv_l = 1.0 / l                                # an all -inf row: l = 0, y = 0 * inf = NaN, like torch
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m_safe) * inv_l
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < n_cols)


@triton.jit
def _softmax_bwd_kernel(
    y_ptr, g_ptr, dx_ptr, n_rows, n_cols, stride_y, stride_g, stride_dx,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = y * (g - sum_j g_j y_j) for BLOCK_R rows per program, the rows walked in blocks.

    From dy_i/dx_j = y_i (delta_ij - y_j): dx_j = sum_i g_i y_i (delta_ij - y_j) = y_j (g_j - <g, y>).
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows[:, None] < n_rows
    cols = tl.arange(0, BLOCK_N)
    dot = tl.zeros((BLOCK_R,), tl.float32)                               # <g, y> per row
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c[None, :] < n_cols)
        y = tl.load(y_ptr + rows[:, None] * stride_y + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(g * y, axis=1)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = row_ok & (c[None, :] < n_cols)
        y = tl.load(y_ptr + rows[:, None] * stride_y + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = y * (g - dot[:, None])
        tl.store(dx_ptr + rows[:, None] * stride_dx + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers


def _check_input(x, dim: int, name: str = "x") -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"softmax: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"softmax: {name} has dtype {x.dtype}; supported: float16, bfloat16, float32 "
            "(integers have no softmax; use softmax_ref for float64)"
        )
    if x.dim() == 0:
        raise ValueError("softmax: x must have at least one dimension, got a 0-d tensor")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"softmax: dim={dim!r} is out of range for a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    if x.device.type != runtime.device().type:
        raise ValueError(f"softmax: {name} is on {x.device}, kernels run on {runtime.device()} here")
    return dim % x.dim()


def launch(n_rows: int, n_cols: int, dtype: torch.dtype, block_size: int | None = None) -> RowLaunch:
    """The launch of both directions (:func:`kernels.rows.row_launch` with the softmax's budget);
    ``block_size``, a power of two, caps the block (the tests walk short rows in several blocks)."""
    return row_launch(n_cols, dtype, SOFTMAX, n_rows=n_rows, block_size=block_size)


def _forward_rows(x2: torch.Tensor, block_size: int | None) -> torch.Tensor:
    n_rows, n_cols = x2.shape
    y2 = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    if n_rows == 0 or n_cols == 0:
        return y2
    kernel, grid, args, kwargs = _forward_args(x2, y2, launch(n_rows, n_cols, x2.dtype, block_size))
    kernel[grid](*args, **kwargs)
    return y2


def _forward_args(x2: torch.Tensor, y2: torch.Tensor, lc: RowLaunch):
    """(kernel, grid, args, kwargs) of the forward's launch on (rows, n) views: whole rows in one block,
    or the online kernel over blocks. Shared by the launcher and :func:`launch_jobs`."""
    n_rows, n_cols = x2.shape
    if lc.one_block:
        return (_softmax_kernel, (triton.cdiv(n_rows, lc.block_r),),
                (x2, y2, n_rows, n_cols, x2.stride(0), y2.stride(0)),
                dict(BLOCK_R=lc.block_r, BLOCK_N=lc.block_n, num_warps=lc.num_warps))
    return (_softmax_online_kernel, (n_rows,), (x2, y2, n_cols, x2.stride(0), y2.stride(0)),
            dict(BLOCK_N=lc.block_n, num_warps=lc.num_warps))


def _backward_rows(y2: torch.Tensor, g2: torch.Tensor, block_size: int | None) -> torch.Tensor:
    n_rows, n_cols = y2.shape
    dx2 = torch.empty((n_rows, n_cols), dtype=y2.dtype, device=y2.device)
    if n_rows == 0 or n_cols == 0:
        return dx2
    grid, args, kwargs = _backward_args(y2, g2, dx2, launch(n_rows, n_cols, y2.dtype, block_size))
    _softmax_bwd_kernel[grid](*args, **kwargs)
    return dx2


def _backward_args(y2: torch.Tensor, g2: torch.Tensor, dx2: torch.Tensor, lc: RowLaunch):
    """(grid, args, kwargs) of the backward's launch, ``block_r`` rows a program. Shared by the
    launcher and :func:`launch_jobs`."""
    n_rows, n_cols = y2.shape
    return ((triton.cdiv(n_rows, lc.block_r),),
            (y2, g2, dx2, n_rows, n_cols, y2.stride(0), g2.stride(0), dx2.stride(0)),
            dict(BLOCK_R=lc.block_r, BLOCK_N=lc.block_n, num_warps=lc.num_warps))


def launch_jobs(n_cols: int, dtype: torch.dtype = torch.float16, n_rows: int = 4096) -> list:
    """``(label, TritonJob)`` of the forward and backward launches :func:`softmax` makes for ``n_rows``
    contiguous rows of ``n_cols``, on meta tensors (:func:`kernels.inspect.launch_job`: the
    specialisation Triton's binder gives a GPU launch)."""
    from kernels import inspect as ki

    x2 = torch.empty(n_rows, n_cols, dtype=dtype, device="meta")           # (rows, n): x, y, g and dx alike
    lc = launch(n_rows, n_cols, dtype)
    kernel, grid, args, kwargs = _forward_args(x2, torch.empty_like(x2), lc)
    fwd = ki.launch_job(kernel, *args, grid=grid, **kwargs)
    grid, args, kwargs = _backward_args(x2, torch.empty_like(x2), torch.empty_like(x2), lc)
    bwd = ki.launch_job(_softmax_bwd_kernel, *args, grid=grid, **kwargs)
    return [(f"softmax fwd {n_cols}", fwd), (f"softmax bwd {n_cols}", bwd)]


# (label, row length, rows) of real models' softmaxes: one layer's attention scores at full context,
# and the output distribution over Llama 3's vocabulary for a batch of 4096 tokens
REAL_ROWS = (
    ("LLaMA-2-7B scores, 32 heads x 4096 queries", 4096, 32 * 4096),
    ("Llama-3-8B scores, 32 heads x 8192 queries", 8192, 32 * 8192),
    ("Llama 3 vocabulary, 4096 tokens", 128256, 4096),
)


def compile_jobs() -> dict:
    """The forward and backward launches of :func:`softmax` at :data:`REAL_ROWS`, fp16."""
    return {f"{model}: {label}": job for model, n, rows in REAL_ROWS for label, job in launch_jobs(n, n_rows=rows)}


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, block_size):
        xl = x.movedim(dim, -1)                     # (..., n): the reduced dimension last
        y2 = _forward_rows(as_rows(xl), block_size)
        y = y2.view(xl.shape).movedim(-1, dim)
        ctx.save_for_backward(y)
        ctx.dim, ctx.block_size = dim, block_size
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        dim = ctx.dim
        yl = y.movedim(dim, -1)
        gl = g.to(y.dtype).movedim(dim, -1)
        dx2 = _backward_rows(as_rows(yl), as_rows(gl), ctx.block_size)
        return dx2.view(yl.shape).movedim(-1, dim), None, None


def softmax(x: torch.Tensor, dim: int = -1, *, block_size: int | None = None) -> torch.Tensor:
    """``torch.softmax(x, dim)`` in Triton, for fp16, bf16 or fp32 ``x`` of any shape; differentiable.

    The result has ``x``'s dtype; the arithmetic is fp32. Rows that fit the widest block of the
    launch rule (:func:`launch`; or ``block_size``, a power of two, when given) are done in one block by ``_softmax_kernel``;
    longer rows by ``_softmax_online_kernel``, which walks the row in blocks with the online
    recurrence. Any strides are accepted (a row-strided view is read in place; other layouts are
    copied first). A row that is all ``-inf`` gives NaN, as ``torch.softmax`` does.
    """
    d = _check_input(x, dim)
    check_block_size("softmax", block_size)
    if x.numel() == 0:
        return torch.empty_like(x)
    return _Softmax.apply(x, d, block_size)
