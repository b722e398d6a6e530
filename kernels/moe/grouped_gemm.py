"""Grouped GEMM over uneven expert loads: C_e = A_e @ W_e for every expert e, in one launch.

Shapes: M assignment rows sorted by expert (:mod:`kernels.moe.permute`), K input width, N output
width, E experts; W (E, K, N); ``offsets`` (E + 1,): expert e owns sorted rows offsets[e] to
offsets[e+1] (its load n_e, any number, zero included). A is either the sorted rows themselves
(M, K), or the unsorted tokens (T, K) read through ``rows`` (M,): sorted row r is token rows[r]
(the *gather* form, which never writes the permuted copy).

    C[r, :] = A[rows[r], :] @ W[e(r)]       for r in expert e's range          (M, N)

FLOPs 2 M K N, the same as one dense GEMM of M rows; bytes: E K N weights + M (K + N) activations.

The schedule (``tile_schedule``): each expert's rows are cut into ceil(n_e / BLOCK_M) tiles of
BLOCK_M rows, so no tile straddles two experts; a tile is (expert, first row, end row). The table
has a fixed length ceil(M / BLOCK_M) + E, an upper bound on the sum of the ceilings, so it is built
on the device with no host synchronisation; the unused entries are empty tiles whose programs do
nothing. This is what vLLM's ``moe_align_block_size`` does by padding each expert's segment to a
multiple of the block. The grid is (tiles, ceil(N / BLOCK_N)).

Backward (``grouped_gemm`` is differentiable):
    dA_sorted = dC @ W_e^T per expert: the same kernel with W's last two strides swapped;
                in the gather form, dA = scatter-add of dA_sorted into the tokens' rows;
    dW_e      = A_e^T @ dC_e: ``_grouped_wgrad_kernel``, one program per (expert, K tile, N tile)
                looping over that expert's rows.

Offsets that scale with the problem are int64: a token row times K (Mixtral: 4096 wide, so 2**31
is passed at 524,288 rows) and the expert index times K N (DeepSeek-V3: 256 experts of
7168 x 2048 is 3.8e9 elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per target. sm90: 64 rows (an expert of a
# decode batch holds few tokens, so a 128-row tile would be mostly empty) x 128 columns, 64 deep.
TILES = {
    "sm80": (64, 128, 32, 4, 3),
    "sm90": (64, 128, 64, 4, 3),
    "sm100": (64, 128, 64, 4, 3),
    "cpu": (32, 64, 32, 4, 1),      # the interpreter: few, large programs
}
# The weight-gradient kernel: (BLOCK_K, BLOCK_N, BLOCK_M, num_warps, num_stages).
WGRAD_TILES = {
    "sm80": (64, 128, 32, 4, 3),
    "sm90": (64, 128, 64, 4, 3),
    "sm100": (64, 128, 64, 4, 3),
    "cpu": (64, 64, 32, 4, 1),
}


def _arch() -> str:
    if not runtime.runtime().on_gpu:
        return "cpu"
    major, _ = torch.cuda.get_device_capability()
    return "sm100" if major >= 10 else "sm90" if major == 9 else "sm80"


# ----------------------------------------------------------------------------------------------
# Reference (PyTorch): one matmul per expert


def grouped_gemm_ref(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """(M, N) in fp32 (fp64 kept): a loop over the experts, C_e = A_e @ W_e."""
    wide = torch.promote_types(a.dtype, torch.float32)
    M = int(offsets[-1])
    out = torch.zeros(M, w.shape[2], dtype=wide, device=a.device)
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            a_e = a[rows[lo:hi]] if rows is not None else a[lo:hi]            # (n_e, K)
            out[lo:hi] = a_e.to(wide) @ w[e].to(wide)                          # (n_e, N)
    return out


# ----------------------------------------------------------------------------------------------
# The schedule


def num_tile_slots(M: int, E: int, block_m: int) -> int:
    """ceil(M / BLOCK_M) + E >= sum_e ceil(n_e / BLOCK_M) for any split of M rows into E loads."""
    return triton.cdiv(M, block_m) + E


def tile_schedule(offsets: torch.Tensor, M: int, block_m: int, *, aligned: bool = True):
    """(tile_expert, tile_start, tile_end), each (ceil(M / BLOCK_M) + E,) int32, built on the device.

    Tile i belongs to expert e when sum_{e' < e} t_e' <= i < sum_{e' <= e} t_e', t_e = ceil(n_e / BLOCK_M);
    it covers rows offsets[e] + (i - first tile of e) * BLOCK_M up to min(that + BLOCK_M, offsets[e+1]).

    ``aligned=False`` is the broken schedule that a first attempt writes: tiles of BLOCK_M
    consecutive sorted rows, each multiplied by the weights of the expert of its first row. A tile
    that straddles an expert boundary then multiplies the next expert's rows by the wrong weights.
    """
    E = offsets.numel() - 1
    slots = num_tile_slots(M, E, block_m)
    i = torch.arange(slots, device=offsets.device)
    if not aligned:
        start = i * block_m
        expert = torch.searchsorted(offsets[1:], start, right=True).clamp(max=E - 1)
        end = torch.where(start < M, torch.full_like(start, M), start)
        return expert.int(), start.int(), end.int()
    loads = offsets[1:] - offsets[:-1]                                     # (E,) n_e
    tiles = (loads + block_m - 1) // block_m                               # (E,) t_e
    last = tiles.cumsum(0)                                                 # (E,) one past e's last tile
    expert = torch.searchsorted(last, i, right=True)                       # (slots,) E for unused slots
    used = expert < E
    e = expert.clamp(max=E - 1)
    first = last[e] - tiles[e]
    start = offsets[e] + (i - first) * block_m
    end = torch.minimum(start + block_m, offsets[e + 1])
    start, end = torch.where(used, start, 0), torch.where(used, end, 0)   # unused slot: empty tile
    return e.int(), start.int(), end.int()


# ----------------------------------------------------------------------------------------------
# The kernels


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, rows_ptr, w_ptr, c_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK_N
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start < end:                                                        # empty slots do nothing
        e = tl.load(tile_expert_ptr + tile).to(tl.int64)
        r = start + tl.arange(0, BLOCK_M)                                  # (BLOCK_M,) sorted rows
        r_in = r < end                                                     # rows of this expert only
        if GATHER:
            src = tl.load(rows_ptr + r, mask=r_in, other=0)               # token row of each sorted row
        else:
            src = r
        src = tl.where(r_in, src, 0).to(tl.int64)                          # int64: row * K may pass 2**31
        ks = tl.arange(0, BLOCK_K)
        cols = col0 + tl.arange(0, BLOCK_N)
        a_rows = src * stride_am                                           # (BLOCK_M,) int64 row offsets
        w_ptr += e * stride_we                                             # int64: e * K * N may pass 2**31
        w_offs = ks[:, None] * stride_wk + cols[None, :] * stride_wn       # (BLOCK_K, BLOCK_N) int32 in one expert
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_in = ks < K - k0
            a = tl.load(a_ptr + a_rows[:, None] + ks[None, :] * stride_ak, mask=r_in[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_ptr + w_offs, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
            if UPCAST:   # bf16 under the interpreter: tl.dot would multiply bit patterns
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")                # acc += A_tile @ W_e tile
            a_ptr += BLOCK_K * stride_ak                                   # the K walk moves the scalar bases
            w_ptr += BLOCK_K * stride_wk
        c_ptrs = c_ptr + r.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=r_in[:, None] & (cols[None, :] < N))


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, rows_ptr, dc_ptr, dw_ptr, offsets_ptr,
    K, N,
    stride_am, stride_ak, stride_dcm, stride_dcn, stride_we, stride_wk, stride_wn,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    GATHER: tl.constexpr, UPCAST: tl.constexpr,
):
    e = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    k_in = ks < K
    n_in = cols < N
    for r0 in range(lo, hi, BLOCK_M):                                      # this expert's rows only
        r = r0 + tl.arange(0, BLOCK_M)
        r_in = r < hi
        if GATHER:
            src = tl.load(rows_ptr + r, mask=r_in, other=0)
        else:
            src = r
        src = tl.where(r_in, src, 0).to(tl.int64)                          # int64 row offsets
        a = tl.load(a_ptr + (src * stride_am)[:, None] + ks[None, :] * stride_ak,
                    mask=r_in[:, None] & k_in[None, :], other=0.0)          # (BLOCK_M, BLOCK_K)
        dc = tl.load(dc_ptr + (r.to(tl.int64) * stride_dcm)[:, None] + cols[None, :] * stride_dcn,
                     mask=r_in[:, None] & n_in[None, :], other=0.0)        # (BLOCK_M, BLOCK_N)
        if UPCAST:
            a, dc = a.to(tl.float32), dc.to(tl.float32)
        acc = tl.dot(tl.trans(a), dc, acc, input_precision="ieee")         # dW_e += A_e^T dC_e
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (cols[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Launchers


def _upcast(dtype: torch.dtype, on_gpu: bool | None = None) -> bool:
    """bf16 operands go through tl.dot as fp32 under the interpreter (which multiplies bf16 bit patterns)."""
    on_gpu = runtime.runtime().on_gpu if on_gpu is None else on_gpu
    return dtype == torch.bfloat16 and not on_gpu


def _forward_args(a, w, rows, c, offsets, schedule, tiles, *, on_gpu: bool | None = None):
    """(grid, args, kwargs) of one launch of :func:`_grouped_gemm_kernel`, for the launcher and for
    :func:`compile_jobs` alike. ``schedule`` is (tile_expert, tile_start, tile_end); ``w`` may be any
    strided (E, K, N) view (the backward pass passes W^T per expert by swapping strides).
    ``on_gpu`` (default: this process's device) decides the interpreter's bf16 upcast."""
    block_m, block_n, block_k, warps, stages = tiles
    _, K, N = w.shape
    expert, start, end = schedule
    grid = (expert.numel(), triton.cdiv(N, block_n))
    args = (a, rows if rows is not None else offsets, w, c, expert, start, end, N, K,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1))
    kwargs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATHER=rows is not None,
                  UPCAST=_upcast(a.dtype, on_gpu), num_warps=warps, num_stages=stages)
    return grid, args, kwargs


def _forward(a, w, rows, offsets, M, *, tiles=None, aligned=True, slot_of=None):
    """C (M, N) = A[rows] @ W_e per expert. ``slot_of`` (E,) int32 maps expert e to the index of its
    weights in ``w`` (an expert cache holding only some experts, :mod:`kernels.moe.offload`)."""
    tiles = tiles or TILES[_arch()]
    N = w.shape[2]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    expert, start, end = tile_schedule(offsets, M, tiles[0], aligned=aligned)
    if slot_of is not None:
        expert = slot_of[expert.long()].to(torch.int32)                    # tile's expert -> its cache slot
    grid, args, kwargs = _forward_args(a, w, rows, c, offsets, (expert, start, end), tiles)
    _grouped_gemm_kernel[grid](*args, **kwargs)
    return c


def _wgrad_args(a, rows, dc, dw, offsets, tiles, *, on_gpu: bool | None = None):
    """(grid, args, kwargs) of one launch of :func:`_grouped_wgrad_kernel`."""
    block_k, block_n, block_m, warps, stages = tiles
    E, K, N = dw.shape
    grid = (E, triton.cdiv(K, block_k), triton.cdiv(N, block_n))
    args = (a, rows if rows is not None else offsets, dc, dw, offsets, K, N,
            a.stride(0), a.stride(1), dc.stride(0), dc.stride(1), dw.stride(0), dw.stride(1), dw.stride(2))
    kwargs = dict(BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_M=block_m, GATHER=rows is not None,
                  UPCAST=_upcast(dc.dtype, on_gpu), num_warps=warps, num_stages=stages)
    return grid, args, kwargs


def _wgrad(a, rows, dc, offsets, shape, dtype, *, tiles=None):
    """dW (E, K, N) with dW_e = A_e^T dC_e."""
    dw = torch.empty(*shape, dtype=dtype, device=dc.device)
    grid, args, kwargs = _wgrad_args(a, rows, dc, dw, offsets, tiles or WGRAD_TILES[_arch()])
    _grouped_wgrad_kernel[grid](*args, **kwargs)
    return dw


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, rows, offsets, M, tiles, aligned):
        ctx.save_for_backward(a, w, rows, offsets)
        ctx.tiles = tiles
        return _forward(a, w, rows, offsets, M, tiles=tiles, aligned=aligned)

    @staticmethod
    def backward(ctx, dc):
        a, w, rows, offsets = ctx.saved_tensors
        dc = dc.contiguous()
        M = dc.shape[0]
        da = dw = None
        if ctx.needs_input_grad[0]:
            da_sorted = _forward(dc, w.transpose(1, 2), None, offsets, M, tiles=ctx.tiles)   # dC_e W_e^T
            if rows is None:
                da = da_sorted
            else:                                                            # the gather's adjoint
                da = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
                da = da.index_add_(0, rows, da_sorted.float()).to(a.dtype)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(a, rows, dc, offsets, w.shape, w.dtype)
        return da, dw, None, None, None, None, None


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, rows: torch.Tensor | None = None,
                 tiles: tuple | None = None, aligned: bool = True) -> torch.Tensor:
    """C (M, N) in a's dtype, C[r] = A[rows[r]] @ W[e(r)] (A[r] without ``rows``); differentiable.

    a (M, K), or (T, K) with rows (M,) int64 token indices; w (E, K, N); offsets (E + 1,) int64,
    non-decreasing from 0 to M. ``tiles`` overrides the per-target tile choice; ``aligned=False``
    runs the broken schedule of :func:`tile_schedule` (for the test that must catch it)."""
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
            raise ValueError(f"grouped_gemm: {name} must be a tensor of {', '.join(map(str, DTYPES))}, "
                             f"got {getattr(t, 'dtype', type(t))}")
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_gemm: a must be 2-D and w (E, K, N), got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise ValueError(f"grouped_gemm: a and w must share a dtype, got {a.dtype} and {w.dtype}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_gemm: a has K={a.shape[1]} columns but w has K={w.shape[1]} rows per expert")
    if offsets.dtype != torch.int64 or offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"grouped_gemm: offsets must be int64 of shape (E + 1,) = ({w.shape[0] + 1},), "
                         f"got {offsets.dtype} {tuple(offsets.shape)}")
    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[0]) != 0:
        raise ValueError("grouped_gemm: offsets must start at 0 and never decrease")
    M = int(offsets[-1])
    if rows is None:
        if M != a.shape[0]:
            raise ValueError(f"grouped_gemm: offsets end at M={M} but a has {a.shape[0]} rows (pass rows= to gather)")
    else:
        if rows.dtype != torch.int64 or rows.shape != (M,):
            raise ValueError(f"grouped_gemm: rows must be int64 of shape (M,) = ({M},), got {rows.dtype} {tuple(rows.shape)}")
        if M and (int(rows.min()) < 0 or int(rows.max()) >= a.shape[0]):
            raise ValueError(f"grouped_gemm: rows must index the {a.shape[0]} rows of a")
    return _GroupedGemm.apply(a, w, rows, offsets, M, tiles, aligned)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds at real models' widths (no GPU needed)

# (E, K, N) of the expert GEMMs of two real models, from their configurations: Mixtral 8x7B (hidden
# 4096, expert FFN 14336, 8 experts) and DeepSeek-V3 (hidden 7168, expert FFN 2048, 256 experts).
# Gate and up share one GEMM of width 2 * FFN.
REAL_WIDTHS = {
    "Mixtral gate+up": (8, 4096, 2 * 14336), "Mixtral down": (8, 14336, 4096),
    "DeepSeek-V3 gate+up": (256, 7168, 2 * 2048), "DeepSeek-V3 down": (256, 2048, 7168),
}


def launch_jobs(label: str, num_tokens: int, top_k: int, *, arch: str = "sm90",
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """The AOT jobs of one expert GEMM of :data:`REAL_WIDTHS` on ``num_tokens`` tokens routed top-k:
    the forward in its gather form (the first GEMM reads the unsorted tokens through ``rows``; the
    second reads the sorted rows) and the weight gradient, on meta tensors, with ``arch``'s tiles."""
    from kernels import inspect as ki

    E, K, N = REAL_WIDTHS[label]
    M = num_tokens * top_k
    gather = "gate+up" in label
    meta = dict(device="meta", dtype=dtype)
    a = torch.empty(num_tokens if gather else M, K, **meta)
    rows = torch.empty(M, dtype=torch.int64, device="meta") if gather else None
    w = torch.empty(E, K, N, **meta)
    c = torch.empty(M, N, **meta)
    offsets = torch.empty(E + 1, dtype=torch.int64, device="meta")
    tiles = TILES[arch]
    slots = num_tile_slots(M, E, tiles[0])
    schedule = tuple(torch.empty(slots, dtype=torch.int32, device="meta") for _ in range(3))
    fwd_grid, fwd_args, fwd_kwargs = _forward_args(a, w, rows, c, offsets, schedule, tiles, on_gpu=True)
    wg_grid, wg_args, wg_kwargs = _wgrad_args(a, rows, c, w, offsets, WGRAD_TILES[arch], on_gpu=True)
    return {"forward": ki.launch_job(_grouped_gemm_kernel, *fwd_args, target=arch, grid=fwd_grid, **fwd_kwargs),
            "wgrad": ki.launch_job(_grouped_wgrad_kernel, *wg_args, target=arch, grid=wg_grid, **wg_kwargs)}


def compile_jobs() -> dict:
    """The forward and weight-gradient kernels at Mixtral's and DeepSeek-V3's expert widths, 4096
    tokens routed top-2 and top-8, with the sm90 tiles."""
    jobs = {}
    for label, k in (("Mixtral gate+up", 2), ("DeepSeek-V3 down", 8)):
        for kind, job in launch_jobs(label, 4096, k).items():
            jobs[f"grouped_gemm {kind} {label}, 4096 tokens top-{k}"] = job
    return jobs
