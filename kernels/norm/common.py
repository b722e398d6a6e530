"""What the norm kernels share: input checks, the tiled backward for wide rows, and the
weight-gradient sum (the (rows, n) view and the launch rule come from :mod:`kernels.rows`).

A norm over the last dimension treats ``x`` as a matrix of ``rows = numel / n`` rows of ``n``
features. When a row fits one block (:func:`kernels.rows.row_launch`), each forward program
normalizes ``BLOCK_R`` whole rows held in one (BLOCK_R, BLOCK_N) tile, and each backward program
walks a strided set of row tiles, writes its rows of dx, and keeps running column sums for the
weight (and bias) gradients in registers. A wider row is walked in column blocks: the forward in
two passes (statistics, then normalize), the backward in two kernels defined here, one pass for
each row's dot products (``_norm_bwd_dots_kernel``) and one over (column block, row group) tiles
for dx and the partial weight sums (``_norm_bwd_tiled_kernel``). Either way the per-program
partial sums, a (programs, n) fp32 buffer, are added up by :func:`sum_partials`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rows import RowLaunch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def check_weight_offset(fn: str, weight_offset, weight) -> float:
    """Validate ``weight_offset`` (the constant added to the weight: 0.0 for Llama, 1.0 for Gemma's
    ``x / rms(x) * (1 + w)``) and return it as a float. An offset scales nothing without a weight."""
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)) or not math.isfinite(weight_offset):
        raise ValueError(f"{fn}: weight_offset must be a finite number (0.0, or 1.0 for Gemma's (1 + w)), "
                         f"got {weight_offset!r}")
    if weight is None and weight_offset != 0:
        raise ValueError(f"{fn}: weight_offset={weight_offset} needs a weight to offset, but weight is None")
    return float(weight_offset)


@triton.jit
def weight_scale(w, W_OFFSET: tl.constexpr):
    """The per-feature scale from the loaded fp32 weight: w (W_OFFSET = 0, Llama), or Gemma's
    (W_OFFSET + w) computed in fp32 (W_OFFSET = 1). The add is compiled only when W_OFFSET != 0."""
    if W_OFFSET != 0.0:
        w = w + W_OFFSET
    return w


def backward_programs(n_tiles: int, col_blocks: int = 1, *, sms: int | None = None) -> int:
    """How many row groups share the backward's row tiles (each writes one row of partial sums);
    with ``col_blocks`` column blocks per row, each group is that many programs. ``sms`` names a
    GPU's SM count (the AOT jobs: an H100's 132) instead of asking this machine."""
    if sms is not None or runtime.runtime().on_gpu:
        sms = sms if sms is not None else torch.cuda.get_device_properties(0).multi_processor_count
        target = 4 * sms // col_blocks
        return max(1, min(n_tiles, target))
    return max(1, min(n_tiles, 4))  # the interpreter runs programs one after another: keep few


@triton.jit
def _norm_bwd_dots_kernel(
    x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, c1_ptr, c2_ptr, n, stride_x, stride_g,
    HAS_WEIGHT: tl.constexpr, CENTERED: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """Tiled backward, pass 1, one program per row: the row's dot products, block by block,
        c1 = mean(gw * xhat),   c2 = mean(gw)   (c2 for LayerNorm only: CENTERED),
    with gw = g * (W_OFFSET + w) and xhat = (x - mean) * rstd (mean = 0 for RMSNorm). Reads x and g once."""
    row = tl.program_id(0).to(tl.int64)                                 # int64: row * stride may pass 2**31
    x_row = x_ptr + row * stride_x
    g_row = g_ptr + row * stride_g
    rstd = tl.load(rstd_ptr + row)
    mean = tl.load(mean_ptr + row) if CENTERED else 0.0
    cols = tl.arange(0, BLOCK_N)
    s1 = tl.zeros((BLOCK_N,), tl.float32)                                # lane sums of gw * xhat
    s2 = tl.zeros((BLOCK_N,), tl.float32)                                # lane sums of gw
    for start in range(0, n, BLOCK_N):
        c = start + cols
        ok = c < n
        x = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
        gw = tl.load(g_row + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            gw = gw * weight_scale(tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32), W_OFFSET)
        s1 += gw * tl.where(ok, (x - mean) * rstd, 0.0)
        s2 += gw
    tl.store(c1_ptr + row, tl.sum(s1, axis=0) / n)
    if CENTERED:
        tl.store(c2_ptr + row, tl.sum(s2, axis=0) / n)


@triton.jit
def _norm_bwd_tiled_kernel(
    x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, c1_ptr, c2_ptr, dres_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n, stride_x, stride_g, stride_dres, stride_dx,
    HAS_WEIGHT: tl.constexpr, CENTERED: tl.constexpr, ADD_DRES: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """Tiled backward, pass 2, grid (column blocks, row groups): for each row of its group,
        dx = rstd * (gw - c2 - xhat * c1)  (+ dres, the residual's own gradient, when ADD_DRES)
    and the weight (bias) gradient partials sum_rows g * xhat (sum_rows g) of its column block
    (d(W_OFFSET + w)/dw = 1, so dw is the same with Gemma's offset),
    kept in registers and written once, one row of the (row groups, n) partial buffers."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)           # (BLOCK_N,) this column block
    ok = cols < n
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    if HAS_WEIGHT:
        w = weight_scale(tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32), W_OFFSET)   # w, or 1 + w
    dw_acc = tl.zeros((BLOCK_N,), tl.float32)
    db_acc = tl.zeros((BLOCK_N,), tl.float32)
    for r in range(group, n_rows, n_groups):
        row = tl.cast(r, tl.int64)                                       # int64: row * stride may pass 2**31
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        mean = tl.load(mean_ptr + row) if CENTERED else 0.0
        xhat = tl.where(ok, (x - mean) * rstd, 0.0)
        gw = g * w if HAS_WEIGHT else g
        dx = gw - xhat * tl.load(c1_ptr + row)
        if CENTERED:
            dx -= tl.load(c2_ptr + row)
        dx *= rstd
        if ADD_DRES:
            dx += tl.load(dres_ptr + row * stride_dres + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        if NEED_DW:
            dw_acc += g * xhat
        if NEED_DB:
            db_acc += g
    part = group.to(tl.int64) * n
    if NEED_DW:
        tl.store(dw_part_ptr + part + cols, dw_acc, mask=ok)
    if NEED_DB:
        tl.store(db_part_ptr + part + cols, db_acc, mask=ok)


def tiled_backward(x2, weight, g2, mean, rstd, launch: RowLaunch, *, need_dw: bool, need_db: bool, dres2=None,
                   weight_offset: float = 0.0):
    """The norm backward for rows wider than one block, on (rows, n) views: ``(dx2, dw_part, db_part)``.

    ``mean`` is None for RMSNorm (no centring, no c2); ``dres2`` is added into dx; the weight acts as
    ``weight_offset + weight`` (Gemma's 1 + w). The partial
    buffers are (row groups, n) fp32, zero where not needed; :func:`sum_partials` adds them up.
    """
    n_rows, n = x2.shape
    centered = mean is not None
    dev = x2.device
    c1 = torch.empty(n_rows, dtype=torch.float32, device=dev)
    c2 = torch.empty(n_rows, dtype=torch.float32, device=dev) if centered else c1
    n_groups = backward_programs(n_rows, launch.col_blocks)
    dx2 = torch.empty((n_rows, n), dtype=x2.dtype, device=dev)
    dw_part = torch.zeros((n_groups, n), dtype=torch.float32, device=dev)
    db_part = torch.zeros((n_groups, n), dtype=torch.float32, device=dev)
    dots, tiled = _tiled_backward_args(x2, weight, g2, mean, rstd, c1, c2, dx2, dw_part, db_part, launch,
                                       need_dw=need_dw, need_db=need_db, dres2=dres2, weight_offset=weight_offset)
    for kernel, grid, args, kwargs in (dots, tiled):
        kernel[grid](*args, **kwargs)
    return dx2, dw_part, db_part


def _tiled_backward_args(x2, weight, g2, mean, rstd, c1, c2, dx2, dw_part, db_part, launch: RowLaunch, *,
                         need_dw: bool, need_db: bool, dres2=None, weight_offset: float = 0.0):
    """The two launches of :func:`tiled_backward`, each (kernel, grid, args, kwargs): the dots kernel,
    then the (column blocks, row groups) kernel, the row groups being ``dw_part``'s rows. Shared by
    the launcher and :func:`tiled_backward_launch_jobs`, so the AOT builds are the launches."""
    n_rows, n = x2.shape
    centered = mean is not None
    w = weight if weight is not None else x2
    dots = (_norm_bwd_dots_kernel, (n_rows,),
            (x2, w, g2, mean if centered else rstd, rstd, c1, c2, n, x2.stride(0), g2.stride(0)),
            dict(HAS_WEIGHT=weight is not None, CENTERED=centered, BLOCK_N=launch.block_n, W_OFFSET=weight_offset,
                 num_warps=launch.num_warps))
    tiled = (_norm_bwd_tiled_kernel, (launch.col_blocks, dw_part.shape[0]),
             (x2, w, g2, mean if centered else rstd, rstd, c1, c2, g2 if dres2 is None else dres2, dx2, dw_part,
              db_part, n_rows, n, x2.stride(0), g2.stride(0), 0 if dres2 is None else dres2.stride(0), dx2.stride(0)),
             dict(HAS_WEIGHT=weight is not None, CENTERED=centered, ADD_DRES=dres2 is not None,
                  NEED_DW=need_dw, NEED_DB=need_db, BLOCK_N=launch.block_n, W_OFFSET=weight_offset,
                  num_warps=launch.num_warps))
    return dots, tiled


def tiled_backward_launch_jobs(label: str, x2, weight, g2, mean, rstd, launch: RowLaunch, *, need_dw: bool,
                               need_db: bool, dres2=None, weight_offset: float = 0.0, sms: int = 132,
                               target: str = "sm90") -> list:
    """``(label, TritonJob)`` of the two launches :func:`tiled_backward` makes on these (meta) tensors,
    on a GPU of ``sms`` SMs: the jobs of real launches (:func:`kernels.inspect.launch_job`)."""
    from kernels import inspect as ki

    n_rows, n = x2.shape
    c1 = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    c2 = torch.empty(n_rows, dtype=torch.float32, device=x2.device) if mean is not None else c1
    groups = backward_programs(n_rows, launch.col_blocks, sms=sms)
    dx2 = torch.empty_like(x2)
    part = torch.empty((groups, n), dtype=torch.float32, device=x2.device)
    jobs = []
    for name, (kernel, grid, args, kwargs) in zip(("dots", "dx"), _tiled_backward_args(
            x2, weight, g2, mean, rstd, c1, c2, dx2, part, part, launch, need_dw=need_dw, need_db=need_db, dres2=dres2,
            weight_offset=weight_offset)):
        jobs.append((f"{label} {name}", ki.launch_job(kernel, *args, target=target, grid=grid, **kwargs)))
    return jobs


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
    out = torch.empty(partial.shape[1], dtype=dtype, device=partial.device)
    grid, args, kwargs = _sum_partials_args(partial, out)
    _sum_partials_kernel[grid](*args, **kwargs)
    return out


def _sum_partials_args(partial: torch.Tensor, out: torch.Tensor):
    """(grid, args, kwargs) of :func:`sum_partials`' launch, shared with :func:`compile_jobs`."""
    n_parts, n = partial.shape
    block_n = min(triton.next_power_of_2(n), 1024)
    block_p = min(triton.next_power_of_2(n_parts), 64)
    return (triton.cdiv(n, block_n),), (partial, out, n_parts, n), dict(BLOCK_P=block_p, BLOCK_N=block_n)


def compile_jobs(n_rows: int = 4096, sms: int = 132) -> dict:
    """The launches of the shared kernels at real widths over ``n_rows`` tokens on an H100 (132 SMs),
    fp16, on meta tensors: the tiled backward (too wide for one backward block) of Llama-3-70B's
    RMSNorm (8192) and of GPT-3 175B's LayerNorm (12288, three column blocks), and the weight
    gradient's sum of the partial rows each backward leaves (:func:`backward_programs` of them)."""
    from kernels import inspect as ki
    from kernels.rows import BACKWARD, row_launch

    jobs = {}
    for label, n, centered in (("Llama-3-70B RMSNorm", 8192, False), ("GPT-3 175B LayerNorm", 12288, True)):
        x2 = torch.empty(n_rows, n, dtype=torch.float16, device="meta")             # (rows, n)
        w = torch.empty(n, dtype=torch.float16, device="meta")
        stat = torch.empty(n_rows, dtype=torch.float32, device="meta")              # rstd (and mean)
        launch = row_launch(n, x2.dtype, BACKWARD, n_rows=n_rows)
        jobs.update(tiled_backward_launch_jobs(f"{label} bwd {n}, {n_rows} tokens", x2, w, torch.empty_like(x2),
                                               stat if centered else None, stat, launch, need_dw=True,
                                               need_db=centered, sms=sms))
    for label, n in (("Llama-3-8B", 4096), ("Llama-3-70B", 8192)):
        launch = row_launch(n, torch.float16, BACKWARD, n_rows=n_rows)
        tiles = triton.cdiv(n_rows, launch.block_r) if launch.one_block else n_rows
        partial = torch.empty(backward_programs(tiles, launch.col_blocks, sms=sms), n, dtype=torch.float32,
                              device="meta")                                     # (row groups, n)
        grid, args, kwargs = _sum_partials_args(partial, torch.empty(n, dtype=torch.float16, device="meta"))
        jobs[f"{label} dw: sum of {partial.shape[0]} partial rows of {n}"] = ki.launch_job(
            _sum_partials_kernel, *args, grid=grid, **kwargs)
    return jobs
