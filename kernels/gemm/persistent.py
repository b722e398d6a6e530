"""Step 4 of the GEMM ladder: a persistent matmul with a static tile scheduler.

``matmul`` (kernels.gemm.ladder) launches one program per output tile; at 8192^3 with 128x128
tiles that is 4096 programs for 132 SMs, and every program pays its launch, prologue (address
math, first loads in flight) and epilogue on its own. A persistent kernel launches one program
per SM (``num_programs``) and each walks the tile list with a stride: program p computes tiles
p, p + P, p + 2P, ... in the same grouped order, so the programs running at any moment still
share bands of A and B in L2.

Whether the next tile's loads overlap this tile's epilogue is the compiler's choice, not the
loop's: a plain ``for`` over tiles around the K loop is two nested loops, and Triton's pipeliner
pipelines only the inner one, draining it (``async_wait 0``) before each tile's store. The tile
loop here is ``tl.range(..., flatten=True)`` (as Triton's persistent tutorial writes it): the two
loops become one over (tile, K step), and the cp.async copies for the next tile are issued while
this tile is stored. ``FLATTEN=False`` builds the nested form, which the chapter compares.
"""
from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.gemm.ladder import (LLAMA3_70B_UP, _epilogue_store, _grouped_tile, _mainloop, check_inputs, matmul_ref,
                                 meta_operands, target, upcast_needed)

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
    UPCAST: tl.constexpr, ALL_TILES: tl.constexpr = True, FLATTEN: tl.constexpr = True,
):
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if not ALL_TILES:   # broken: tiles_per_program = num_tiles // P drops the last num_tiles % P tiles
        num_tiles = (num_tiles // NUM_PROGRAMS) * NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):   # tiles p, p+P, p+2P ...
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M, True)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _mainloop(acc, a_ptr, b_ptr, M, N, K, pid_m * BLOCK_M, pid_n * BLOCK_N,
                        stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        _epilogue_store(acc, c_ptr, c_ptr, M, N, pid_m * BLOCK_M, pid_n * BLOCK_N, stride_cm, stride_cn,
                        BLOCK_M, BLOCK_N, False, "none")


# Tiles per target for the persistent kernel, as the launch compiles them (launch_job at Llama-3-70B's
# up projection; tests/test_gemm.py asserts no spills): 128x128x64 at 8 warps on sm90a and sm100a
# (170 and 186 registers flattened); BLOCK_K 32 on sm80, where 128x128x64 sits at 255 registers.
TILES = {"sm80": (128, 128, 32, 8, 8, 3), "sm90": (128, 128, 64, 8, 8, 3), "sm100": (128, 128, 64, 8, 8, 3),
         "cpu": (64, 64, 64, 4, 4, 1)}


_DOT = re.compile(r"\b(tt\.dot|ttng\.warp_group_dot|ttng\.tc_gen5_mma)\b")


def one_loop_over_tiles_and_k(ttgir: str) -> bool:
    """True if one ``scf.for`` of the TTGIR holds the cp.async copies, the MMA and the store of C
    (each attributed to its innermost enclosing loop): the tile and K loops were flattened into one
    pipelined loop, so copies for the next tile can be in flight while this tile is stored. For the
    nested form the MMA sits in the inner loop and the store in the outer one: False."""
    stack: list = []                       # per open region: None, or the ops seen in that scf.for
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            frame = stack.pop() if stack else None
            if frame is not None and frame == {"copy", "dot", "store"}:
                return True
            if text.endswith("{"):         # "} else {" opens the other branch
                stack.append(None)
            continue
        loops = [f for f in stack if f is not None]
        if loops:
            if "ttg.async_copy_global_to_local" in text:
                loops[-1].add("copy")
            if _DOT.search(text):
                loops[-1].add("dot")
            if "tt.store" in text:
                loops[-1].add("store")
        if text.endswith("{"):
            stack.append(set() if "scf.for" in text else None)
    return False


def _launch_args(a, b, out, *, num_programs: int, tiles, all_tiles: bool = True, flatten: bool = True):
    """(grid, args, kwargs) of one launch of the persistent kernel, shared by :func:`matmul_persistent`
    and :func:`compile_jobs`: min(num_programs, tiles) programs."""
    (M, K), N = a.shape, b.shape[1]
    bm, bn, bk, group_m, warps, stages = tiles
    programs = min(num_programs, triton.cdiv(M, bm) * triton.cdiv(N, bn))
    args = (a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1))
    kwargs = dict(NUM_PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                  UPCAST=upcast_needed(a.dtype), ALL_TILES=all_tiles, FLATTEN=flatten, num_warps=warps,
                  num_stages=stages)
    return (programs,), args, kwargs


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
    grid, args, kwargs = _launch_args(a, b, out, num_programs=num_programs, tiles=tiles or TILES[target()],
                                      all_tiles=_all_tiles)
    _matmul_persistent_kernel[grid](*args, **kwargs)
    return out


def launch_job(M: int, K: int, N: int, *, tiles, num_programs: int = 132, dtype=torch.float16, flatten: bool = True):
    """The AOT job of ``matmul_persistent`` at (M, K) @ (K, N) on ``num_programs`` SMs (an H100's 132)."""
    from kernels import inspect as ki

    a, b, c, _ = meta_operands(M, K, N, dtype)
    grid, args, kwargs = _launch_args(a, b, c, num_programs=num_programs, tiles=tiles, flatten=flatten)
    return ki.launch_job(_matmul_persistent_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The persistent kernel at Llama-3-70B's up projection (4096-token prefill) on 132 SMs, each target's tiles."""
    M, K, N = LLAMA3_70B_UP
    jobs = {}
    for arch in ("sm80", "sm90", "sm100"):
        tiles = TILES[arch]
        label = "Llama-3-70B up proj, 4096 tokens, 132 programs: {}x{}x{}, {} warps, {} stages".format(*tiles[:3], *tiles[4:])
        jobs.setdefault(label, launch_job(M, K, N, tiles=tiles))
    return jobs
