"""The GEMM ladder: C = A @ B in three steps, each a Triton kernel checked against ``torch.matmul``.

1. ``matmul_naive``: every output element is its own dot product, built one K step at a time from
   scalars loaded from global memory (FFMA on the CUDA cores, no tensor cores, no reuse beyond
   what the caches happen to give). The program holds a tile only because one program per element
   would be a grid of M*N programs; the arithmetic is still a rank-1 update per K step.
2. ``kernels.gemm.matmul.matmul``: the tiled kernel (one program per BLOCK_M x BLOCK_N tile of C,
   ``tl.dot`` on BLOCK_K-wide slices: tensor cores, each loaded element reused BLOCK_N or BLOCK_M
   times), programs in row-major order.
3. ``matmul``: the same tiles visited in *grouped* order (GROUP_M tile rows at a time, column by
   column), so programs that run together share rows of A and columns of B in L2; tiles chosen
   per target; fp16/bf16/fp32 inputs; an fp32 accumulator; a fused epilogue (bias, ReLU or SiLU)
   and the output dtype applied before the single store.

The persistent step is in ``kernels.gemm.persistent``; split-K and stream-K in ``kernels.gemm.splitk``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EPILOGUES = (None, "relu", "silu")

# Tiles per target: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). A 128x128 fp32
# accumulator is 64 registers per thread at 8 warps and 128 at 4; with the operand tiles in flight,
# 4 warps spill (tests/test_gemm.py compiles these and asserts no spills). sm90/sm100: 128x128x64
# at 8 warps (two warp groups for wgmma); sm80: BLOCK_K 32, 3 stages of (128x32 + 32x128) fp16 =
# 48 KiB of shared memory.
TILES = {
    "sm80": (128, 128, 32, 8, 8, 3),
    "sm90": (128, 128, 64, 8, 8, 3),
    "sm100": (128, 128, 64, 8, 8, 3),
    "cpu": (64, 64, 64, 4, 4, 1),   # the interpreter: few, large programs
}


def matmul_ref(a, b, *, bias=None, epilogue=None, out_dtype=None):
    """The reference: fp32 product of the same inputs, + bias, activation, then one cast."""
    c = a.float() @ b.float()                      # (M, N), fp32 accumulate
    if bias is not None:
        c = c + bias.float()                       # bias (N,) broadcast over rows
    if epilogue == "relu":
        c = torch.relu(c)
    elif epilogue == "silu":
        c = c * torch.sigmoid(c)                   # silu(x) = x * sigmoid(x)
    return c.to(out_dtype or a.dtype)


def target() -> str:
    """The key of this machine in the tile tables: "sm80", "sm90", "sm100", or "cpu" (the interpreter)."""
    if not runtime.runtime().on_gpu:
        return "cpu"
    major, _ = torch.cuda.get_device_capability()
    return "sm100" if major >= 10 else "sm90" if major == 9 else "sm80"


def tiles_for(arch: str | None = None) -> tuple[int, int, int, int, int, int]:
    """The tile choice for ``arch`` ("sm80", "sm90", "sm100", "cpu"); by default this machine's."""
    arch = arch or target()
    if arch not in TILES:
        raise ValueError(f"tiles_for: no tiles for arch {arch!r}; known: {', '.join(TILES)}")
    return TILES[arch]


def grouped_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """The (tile row, tile column) program ``pid`` computes, for every pid: Python mirror of ``_grouped_tile``."""
    order = []
    for pid in range(num_pid_m * num_pid_n):
        per_group = group_m * num_pid_n                      # programs in one band of GROUP_M tile rows
        first_m = (pid // per_group) * group_m
        rows_here = min(num_pid_m - first_m, group_m)        # the last band may be shorter
        order.append((first_m + (pid % per_group) % rows_here, (pid % per_group) // rows_here))
    return order


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr, SHORT_LAST_GROUP: tl.constexpr):
    """Map program ``pid`` to the tile (pid_m, pid_n): bands of GROUP_M tile rows, column-major inside."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    if SHORT_LAST_GROUP:
        rows_here = min(num_pid_m - first_m, GROUP_M)          # the last band holds what is left
    else:
        rows_here = GROUP_M                                     # broken: assumes every band is full
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    return pid_m, pid_n


@triton.jit
def _matmul_naive_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                         stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)   # (BLOCK_N,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K):
        a = tl.load(a_ptr + rows * stride_am + k * stride_ak, mask=rows < M, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k * stride_bk + cols * stride_bn, mask=cols < N, other=0.0).to(tl.float32)
        acc += a[:, None] * b[None, :]                          # c_ij += a_ik * b_kj, one FMA per element
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _mainloop(acc, a_ptr, b_ptr, M, N, K, row0, col0, stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
              CLAMP_EDGES: tl.constexpr = False):
    """acc (BLOCK_M, BLOCK_N) += A[row0:row0+BM, :] @ B[:, col0:col0+BN], BLOCK_K columns of A at a time."""
    # The tile's corner in int64 (row0 * stride_am passes 2**31 once M*K passes 2G elements);
    # offsets inside the tile stay int32, half the registers of a tile of 64-bit pointers.
    a_ptr += row0.to(tl.int64) * stride_am
    b_ptr += col0.to(tl.int64) * stride_bn
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if CLAMP_EDGES:
        # The chapter's counterexample: rows past M and columns past N re-read the last one, so only
        # K is masked. Correct, but the clamp along B's unit-stride axis hides that its columns are
        # contiguous: B's loads become scalar LDG + STS, outside the cp.async pipeline.
        a_offs = tl.minimum(r, M - 1 - row0)[:, None] * stride_am + ks[None, :] * stride_ak
        b_offs = ks[:, None] * stride_bk + tl.minimum(c, N - 1 - col0)[None, :] * stride_bn
        rows_in = tl.full((BLOCK_M, 1), True, tl.int1)                            # every (clamped) row is in
        cols_in = tl.full((1, BLOCK_N), True, tl.int1)
    else:
        a_offs = r[:, None] * stride_am + ks[None, :] * stride_ak                # (BLOCK_M, BLOCK_K)
        b_offs = ks[:, None] * stride_bk + c[None, :] * stride_bn                # (BLOCK_K, BLOCK_N)
        rows_in = (r < M - row0)[:, None]                                        # loop-invariant edge masks
        cols_in = (c < N - col0)[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_in = ks < K - k0                                                        # zeros past K add nothing
        a = tl.load(a_ptr + a_offs, mask=rows_in & k_in[None, :], other=0.0)    # (BLOCK_M, BLOCK_K)
        b = tl.load(b_ptr + b_offs, mask=k_in[:, None] & cols_in, other=0.0)    # (BLOCK_K, BLOCK_N)
        if UPCAST:   # bf16 under the interpreter: tl.dot would multiply bit patterns
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")              # acc += A_tile @ B_tile
        a_ptr += BLOCK_K * stride_ak                                  # the K walk moves the scalar bases
        b_ptr += BLOCK_K * stride_bk
    return acc


@triton.jit
def _epilogue_store(acc, c_ptr, bias_ptr, M, N, row0, col0, stride_cm, stride_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr):
    """C tile = epilogue(acc + bias), cast once to C's dtype and stored inside (M, N)."""
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + c, mask=col0 + c < N, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == "relu":
        acc = tl.maximum(acc, 0.0)
    elif EPILOGUE == "silu":
        acc = acc * tl.sigmoid(acc)                                   # x * sigmoid(x)
    c_ptr += row0.to(tl.int64) * stride_cm + col0.to(tl.int64) * stride_cn
    tl.store(c_ptr + r[:, None] * stride_cm + c[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(row0 + r[:, None] < M) & (col0 + c[None, :] < N))


@triton.jit
def _matmul_grouped_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, UPCAST: tl.constexpr,
    SHORT_LAST_GROUP: tl.constexpr = True, CLAMP_EDGES: tl.constexpr = False,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M, SHORT_LAST_GROUP)
    row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N                     # the tile's first row and column of C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _mainloop(acc, a_ptr, b_ptr, M, N, K, row0, col0, stride_am, stride_ak, stride_bk, stride_bn,
                    BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, CLAMP_EDGES)
    _epilogue_store(acc, c_ptr, bias_ptr, M, N, row0, col0, stride_cm, stride_cn, BLOCK_M, BLOCK_N, HAS_BIAS, EPILOGUE)


def check_inputs(name: str, a, b, *, dtypes=DTYPES) -> None:
    """Clear errors for what the GEMM launchers accept: two 2-D tensors of one supported dtype."""
    for arg, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: {arg} must be 2-D (rows, cols), got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name}: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{name}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.device != b.device or a.device.type != runtime.device().type:
        raise ValueError(f"{name}: a ({a.device}) and b ({b.device}) must both be on {runtime.device()}")


def upcast_needed(dtype: torch.dtype) -> bool:
    """bf16 tl.dot is wrong under the interpreter (triton-lang/triton#11584): feed it fp32 there."""
    return dtype == torch.bfloat16 and not runtime.runtime().on_gpu


def _naive_launch_args(a, b, c, block: int):
    """(grid, args, kwargs) of one launch of the naive kernel: shared by :func:`matmul_naive` and
    :func:`compile_jobs`, so the AOT build is the launch."""
    (M, K), N = a.shape, b.shape[1]
    grid = (triton.cdiv(M, block), triton.cdiv(N, block))
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return grid, args, dict(BLOCK_M=block, BLOCK_N=block)


def matmul_naive(a: torch.Tensor, b: torch.Tensor, *, block: int = 32) -> torch.Tensor:
    """Step 1: ``a @ b`` with scalar FMAs per output element (no tensor cores); the inputs' dtype out."""
    check_inputs("matmul_naive", a, b)
    c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    grid, args, kwargs = _naive_launch_args(a, b, c, block)
    _matmul_naive_kernel[grid](*args, **kwargs)
    return c


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, epilogue: str | None = None,
           out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, tiles=None,
           _short_last_group: bool = True, _clamp_edges: bool = False) -> torch.Tensor:
    """``epilogue(a @ b + bias)`` in ``out_dtype`` (default: the inputs' dtype), grouped tile order.

    ``a`` (M, K) and ``b`` (K, N): fp16, bf16 or fp32, any strides; ``bias`` (N,); ``epilogue``
    None, "relu" or "silu"; ``out`` an (M, N) tensor to write into; ``tiles`` a
    (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) tuple, by default ``tiles_for()``.
    ``_short_last_group=False`` runs the broken tile mapping the tests must catch; ``_clamp_edges=True``
    the first version's clamped edges (right, but B's loads leave the pipeline: the chapter's AOT check).
    """
    check_inputs("matmul", a, b)
    if epilogue not in EPILOGUES:
        raise ValueError(f"matmul: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    (M, K), N = a.shape, b.shape[1]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,)):
        raise ValueError(f"matmul: bias must be a tensor of shape ({N},), got {getattr(bias, 'shape', bias)}")
    out_dtype = out_dtype or a.dtype
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != out_dtype:
        raise ValueError(f"matmul: out must be ({M}, {N}) {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    grid, args, kwargs = _grouped_launch_args(a, b, out, bias, epilogue=epilogue, tiles=tiles or tiles_for(),
                                              short_last_group=_short_last_group, clamp_edges=_clamp_edges)
    _matmul_grouped_kernel[grid](*args, **kwargs)
    return out


def _grouped_launch_args(a, b, out, bias, *, epilogue, tiles, short_last_group: bool = True,
                         clamp_edges: bool = False):
    """(grid, args, kwargs) of one launch of :func:`_matmul_grouped_kernel`, shared by :func:`matmul`
    and :func:`compile_jobs` (the AOT build is the launch)."""
    (M, K), N = a.shape, b.shape[1]
    bm, bn, bk, group_m, warps, stages = tiles
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    args = (a, b, out, bias if bias is not None else out, M, N, K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1))
    kwargs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, HAS_BIAS=bias is not None,
                  EPILOGUE=epilogue or "none", UPCAST=upcast_needed(a.dtype), SHORT_LAST_GROUP=short_last_group,
                  CLAMP_EDGES=clamp_edges, num_warps=warps, num_stages=stages)
    return grid, args, kwargs


# Real sizes: Llama-3-70B (hidden 8192, MLP 28672) in a 4096-token prefill.
LLAMA3_70B_UP = (4096, 8192, 28672)   # (M tokens, K hidden, N intermediate)


def meta_operands(M: int, K: int, N: int, dtype=torch.float16, *, bias: bool = False):
    """A (M, K), B (K, N), C (M, N) and the bias (N,) on the meta device: a real model's sizes, no memory."""
    def meta(*shape):
        return torch.empty(*shape, device="meta", dtype=dtype)
    return meta(M, K), meta(K, N), meta(M, N), meta(N) if bias else None


def launch_job(M: int, K: int, N: int, *, tiles, dtype=torch.float16, epilogue: str | None = "silu",
               clamp_edges: bool = False):
    """The AOT job of ``matmul`` at (M, K) @ (K, N) with ``tiles``: bias and ``epilogue`` fused."""
    from kernels import inspect as ki

    a, b, c, bias = meta_operands(M, K, N, dtype, bias=True)
    grid, args, kwargs = _grouped_launch_args(a, b, c, bias, epilogue=epilogue, tiles=tiles, clamp_edges=clamp_edges)
    return ki.launch_job(_matmul_grouped_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The naive and grouped kernels at Llama-3-70B's up projection (4096-token prefill), with each
    target's tiles; the grouped kernel with its bias + SiLU epilogue."""
    from kernels import inspect as ki

    M, K, N = LLAMA3_70B_UP
    a, b, c, _ = meta_operands(M, K, N)
    grid, args, kwargs = _naive_launch_args(a, b, c, 64)
    jobs = {"Llama-3-70B up proj, 4096 tokens: naive 64x64": ki.launch_job(_matmul_naive_kernel, *args, grid=grid, **kwargs)}
    for arch in ("sm80", "sm90", "sm100"):
        tiles = TILES[arch]
        label = "Llama-3-70B up proj, 4096 tokens: grouped {}x{}x{}, {} warps, {} stages".format(*tiles[:3], *tiles[4:])
        jobs.setdefault(label, launch_job(M, K, N, tiles=tiles))
    return jobs


# ------------------------------------------------------------------------------------------------
# Traffic models used by the chapter (assumptions stated in each docstring).


def l2_bytes(step: str, M: int, N: int, K: int, *, itemsize: int = 2, block_m: int = 128, block_n: int = 128) -> float:
    """Bytes the SMs fetch from L2 (or beyond) for C = A @ B, plus C written once.

    "naive": no on-chip reuse, every multiply-add loads its two operands: 2*M*N*K elements.
    "tiled" (and every later step): a tile loads its BLOCK_M rows of A and BLOCK_N columns of B
    once, K long: M*K*ceil(N/BN) + K*N*ceil(M/BM) elements.
    """
    if step == "naive":
        loads = 2 * M * N * K
    elif step in ("tiled", "grouped", "persistent"):
        loads = M * K * -(-N // block_n) + K * N * -(-M // block_m)
    else:
        raise ValueError(f"l2_bytes: unknown step {step!r}")
    return float(loads + M * N) * itemsize


def wave_dram_bytes(M: int, N: int, K: int, *, itemsize: int = 2, block_m: int = 128, block_n: int = 128,
                    group_m: int = 1, resident: int = 132) -> float:
    """Bytes read from DRAM if programs run in waves of ``resident`` (one per SM) and L2 holds exactly
    the A row bands and B column bands the current wave touches, each fetched once per wave, plus C
    written once. ``group_m=1`` is row-major program order; it is a model, not a cache simulation."""
    order = grouped_order(-(-M // block_m), -(-N // block_n), group_m)
    loads = 0
    for w in range(0, len(order), resident):
        wave = order[w: w + resident]
        loads += len({m for m, _ in wave}) * block_m * K + len({n for _, n in wave}) * block_n * K
    return float(loads + M * N) * itemsize
