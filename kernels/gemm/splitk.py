"""Split-K and stream-K: more programs than output tiles when M*N is small and K is long.

A GEMM with few output tiles (a decode step's 16 x 8192 x 8192 is 64 tiles of 128x128 at M=16)
leaves most of an H100's 132 SMs idle if one program owns a whole tile. Split-K cuts the K loop
into ``split_k`` chunks, gives each (tile, chunk) its own program writing an fp32 partial tile,
and a second step sums the partials: C = sum_s A[:, K_s] @ B[K_s, :].

Stream-K (Osama et al., 2023) goes further: it lays all tiles' K iterations end to end and gives
every SM an equal contiguous share, so no SM idles in a last partial wave; tiles cut between SMs
are fixed up by summing partials. ``streamk_segments`` computes that assignment, ``streamk_ref``
executes it in PyTorch (proof that the cut-and-fix-up is the same product), and ``wave_model``
compares the makespans.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.gemm.ladder import check_inputs, matmul_ref, meta_operands, upcast_needed

matmul_splitk_ref = matmul_ref


def split_chunk(K: int, split_k: int, block_k: int) -> int:
    """K elements per split: ceil(K / split_k) rounded up to whole BLOCK_K steps (the last split may be short)."""
    return triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k


@triton.jit
def _matmul_splitk_kernel(
    a_ptr, b_ptr, part_ptr, M, N, K, K_CHUNK,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)   # (BLOCK_N,)
    ks = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(K, (s + 1) * K_CHUNK)                        # this split covers [s*K_CHUNK, k_end)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(s * K_CHUNK, k_end, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < k_end), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < k_end) & (cols[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")             # partial_s += A[:, K_s] @ B[K_s, :]
    # part is (split_k, M, N) fp32, contiguous
    off = s.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
    tl.store(part_ptr + off, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul_splitk(a: torch.Tensor, b: torch.Tensor, *, split_k: int = 4, block_m: int = 64, block_n: int = 64,
                  block_k: int = 32, _k_chunk: int | None = None) -> torch.Tensor:
    """``a @ b`` with K cut into ``split_k`` chunks: fp32 partials (split_k, M, N), summed, cast to a's dtype.

    ``_k_chunk`` overrides the chunk length (the tests pass a wrong one to prove the check catches it).
    """
    check_inputs("matmul_splitk", a, b)
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"matmul_splitk: split_k must be a positive int, got {split_k!r}")
    (M, K), N = a.shape, b.shape[1]
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
    grid, args, kwargs = _launch_args(a, b, part, split_k=split_k, block=(block_m, block_n, block_k),
                                      k_chunk=_k_chunk)
    _matmul_splitk_kernel[grid](*args, **kwargs)
    return part.sum(dim=0).to(a.dtype)        # the fix-up: C = sum over splits, in fp32, one rounding


def _launch_args(a, b, part, *, split_k: int, block, k_chunk: int | None = None):
    """(grid, args, kwargs) of one split-K launch, shared by :func:`matmul_splitk` and :func:`compile_jobs`."""
    (M, K), N = a.shape, b.shape[1]
    block_m, block_n, block_k = block
    chunk = k_chunk or split_chunk(K, split_k, block_k)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
    args = (a, b, part, M, N, K, chunk, a.stride(0), a.stride(1), b.stride(0), b.stride(1))
    return grid, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast_needed(a.dtype))


def compile_jobs() -> dict:
    """Split-K at Llama-3-70B's down projection in decode (16 tokens: 16 x 28672 -> 8192), the
    launcher's default 64x64x32 tiles, 4 splits: 1 x 128 x 4 = 512 programs for 132 SMs."""
    from kernels import inspect as ki

    M, K, N = 16, 28672, 8192
    a, b, _, _ = meta_operands(M, K, N)
    part = torch.empty((4, M, N), device="meta", dtype=torch.float32)
    grid, args, kwargs = _launch_args(a, b, part, split_k=4, block=(64, 64, 32))
    return {"Llama-3-70B down proj, decode 16 tokens: split-K 4, 64x64x32":
            ki.launch_job(_matmul_splitk_kernel, *args, grid=grid, **kwargs)}


# ------------------------------------------------------------------------------------------------
# Stream-K, simulated


def streamk_segments(num_tiles: int, iters_per_tile: int, num_sms: int) -> list[tuple[int, int, int, int]]:
    """Stream-K's assignment: (sm, tile, first k-iteration, end k-iteration) for every segment.

    The ``num_tiles * iters_per_tile`` MAC iterations are laid end to end (tile-major) and SM s
    takes iterations [s*T/P, (s+1)*T/P): an equal share, cut wherever it falls inside a tile."""
    total = num_tiles * iters_per_tile
    segs = []
    for sm in range(num_sms):
        lo, hi = sm * total // num_sms, (sm + 1) * total // num_sms
        while lo < hi:
            tile = lo // iters_per_tile
            end = min(hi, (tile + 1) * iters_per_tile)
            segs.append((sm, tile, lo - tile * iters_per_tile, end - tile * iters_per_tile))
            lo = end
    return segs


def streamk_ref(a: torch.Tensor, b: torch.Tensor, *, block_m: int, block_n: int, block_k: int, num_sms: int) -> torch.Tensor:
    """Execute stream-K's segments in PyTorch: each adds its partial product into its tile (the fix-up)."""
    (M, K), N = a.shape, b.shape[1]
    tm, tn, iters = math.ceil(M / block_m), math.ceil(N / block_n), math.ceil(K / block_k)
    acc = torch.promote_types(a.dtype, torch.float32)                 # fp32, or fp64 for fp64 inputs
    c = torch.zeros((M, N), dtype=acc, device=a.device)
    for _, tile, k_lo, k_hi in streamk_segments(tm * tn, iters, num_sms):
        r, q = divmod(tile, tn)
        rs, cs, ks = slice(r * block_m, (r + 1) * block_m), slice(q * block_n, (q + 1) * block_n), slice(k_lo * block_k, k_hi * block_k)
        c[rs, cs] += a[rs, ks].to(acc) @ b[ks, cs].to(acc)          # partial over this SM's k-iterations
    return c


def wave_model(num_tiles: int, iters_per_tile: int, num_sms: int, *, split_k: int = 1) -> dict:
    """Makespan in k-iterations (one BLOCK_K step of one tile = 1) of three schedules, and SM utilisation.

    Data parallel (one program per tile, or per (tile, split)): ceil(work items / SMs) waves, each as
    long as one item. Stream-K: ceil(total / SMs) plus, per tile cut between SMs, one fix-up of
    one tile's partial (counted as 1 iteration: an assumption, labelled)."""
    total = num_tiles * iters_per_tile
    items, item_len = num_tiles * split_k, math.ceil(iters_per_tile / split_k)
    dp = math.ceil(items / num_sms) * item_len
    cut_tiles = len({t for _, t, lo, hi in streamk_segments(num_tiles, iters_per_tile, num_sms) if hi - lo < iters_per_tile})
    sk = math.ceil(total / num_sms) + (1 if cut_tiles else 0)
    return {"data_parallel": dp, "stream_k": sk, "dp_util": total / (num_sms * dp),
            "sk_util": total / (num_sms * sk), "cut_tiles": cut_tiles}
