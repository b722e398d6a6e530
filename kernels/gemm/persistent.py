"""Step 4 of the GEMM ladder: a persistent matmul with a static tile scheduler.

``matmul`` (kernels.gemm.ladder) launches one program per output tile; at 8192^3 with 128x128
tiles that is 4096 programs for 132 SMs, and every program pays its launch, prologue (address
math, first loads in flight) and epilogue on its own. A persistent kernel launches one program
per SM (``num_programs``) and each walks the tile list with a stride: program p computes tiles
p, p + P, p + 2P, ... in the same grouped order, so the programs running at any moment still
share bands of A and B in L2, and the next tile's loads can start while this tile's epilogue runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.gemm.ladder import _epilogue_store, _grouped_tile, _mainloop, check_inputs, matmul_ref, target, upcast_needed

__all__ = ["matmul_persistent", "matmul_persistent_ref", "persistent_schedule"]

matmul_persistent_ref = matmul_ref


def persistent_schedule(num_tiles: int, num_programs: int) -> list[list[int]]:
    """The tiles each program computes, in order: program p takes p, p + P, p + 2P, ..."""
    return [list(range(p, num_tiles, num_programs)) for p in range(min(num_programs, num_tiles))]


@triton.jit
def _matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, ALL_TILES: tl.constexpr = True,
):
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if not ALL_TILES:   # broken: tiles_per_program = num_tiles // P drops the last num_tiles % P tiles
        num_tiles = (num_tiles // NUM_PROGRAMS) * NUM_PROGRAMS
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):    # tiles p, p+P, p+2P ...
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M, True)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _mainloop(acc, a_ptr, b_ptr, M, N, K, pid_m * BLOCK_M, pid_n * BLOCK_N,
                        stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        _epilogue_store(acc, c_ptr, c_ptr, M, N, pid_m * BLOCK_M, pid_n * BLOCK_N, stride_cm, stride_cn,
                        BLOCK_M, BLOCK_N, False, "none")


# Tiles per target for the persistent kernel, chosen by the AOT spill check (tests/test_gemm.py):
# inside the tile loop the 128x128x64 tile at 8 warps spills on sm90 and sm100, so sm90 takes
# BLOCK_K 32 and sm100 a 64x128 tile at 4 warps.
TILES = {"sm80": (128, 128, 32, 8, 8, 3), "sm90": (128, 128, 32, 8, 8, 3), "sm100": (64, 128, 64, 8, 4, 3),
         "cpu": (64, 64, 64, 4, 4, 1)}


def matmul_persistent(a: torch.Tensor, b: torch.Tensor, *, num_programs: int | None = None, tiles=None,
                      out: torch.Tensor | None = None, _all_tiles: bool = True) -> torch.Tensor:
    """``a @ b`` by ``num_programs`` persistent programs (default: the GPU's SM count; 4 on the CPU).

    ``out``: an (M, N) tensor of a's dtype to write into. ``_all_tiles=False`` runs the broken
    scheduler (floor(tiles / programs) tiles each) that the tests must catch."""
    check_inputs("matmul_persistent", a, b)
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(0).multi_processor_count if runtime.runtime().on_gpu else 4
    if not isinstance(num_programs, int) or num_programs < 1:
        raise ValueError(f"matmul_persistent: num_programs must be a positive int, got {num_programs!r}")
    (M, K), N = a.shape, b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != a.dtype:
        raise ValueError(f"matmul_persistent: out must be ({M}, {N}) {a.dtype}, got {tuple(out.shape)} {out.dtype}")
    bm, bn, bk, group_m, warps, stages = tiles or TILES[target()]
    programs = min(num_programs, triton.cdiv(M, bm) * triton.cdiv(N, bn))
    _matmul_persistent_kernel[(programs,)](
        a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        NUM_PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
        UPCAST=upcast_needed(a.dtype), ALL_TILES=_all_tiles, num_warps=warps, num_stages=stages)
    return out
