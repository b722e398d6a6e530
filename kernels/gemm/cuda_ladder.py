"""The CUDA C++ GEMM ladder (``kernels/cuda/gemm_ladder.cu``): fp32 C = A @ B in five steps, each
changing one thing, the way CUDA programmers climb towards cuBLAS (Boehm's worklog names the same
steps): naive, coalesced, shared-memory tiles, 1-D register blocking, 2-D register blocking with
16-byte loads.

``matmul_cuda(a, b, step)`` launches a step on a GPU (``kernels.cuda_launch``) and is checked against
``matmul_ref`` by the GPU tests; on a CPU the chapter compiles the file and reads each step's SASS.
``warp_addresses`` is the coalescing argument in numbers: the byte addresses the 32 lanes of one warp
touch in one load, from the same index formulas as the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gemm.ladder import matmul_ref

__all__ = ["STEPS", "matmul_cuda", "matmul_ref", "warp_addresses"]


@dataclass(frozen=True)
class Step:
    kernel: str
    block: tuple[int, int]          # threads per block (x, y)
    tile: tuple[int, int]           # (rows, cols) of C per block
    multiple: int                   # M, N and K must be multiples of this (1: any size)
    rows_on_x: bool = False         # threadIdx.x walks rows (the naive step) rather than columns


STEPS = {
    "naive": Step("sgemm_naive", (32, 32), (32, 32), 1, rows_on_x=True),
    "coalesced": Step("sgemm_coalesced", (32, 32), (32, 32), 1),
    "shared memory": Step("sgemm_smem", (32, 32), (32, 32), 32),
    "1-D register blocking": Step("sgemm_blocktile_1d", (512, 1), (64, 64), 64),
    "2-D blocking, float4": Step("sgemm_vectorized", (256, 1), (128, 128), 128),
}


def matmul_cuda(a: torch.Tensor, b: torch.Tensor, step: str) -> torch.Tensor:
    """``a @ b`` (fp32, contiguous, on a CUDA GPU) by the CUDA kernel of ``step`` (a key of ``STEPS``)."""
    if step not in STEPS:
        raise ValueError(f"matmul_cuda: step must be one of {list(STEPS)}, got {step!r}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"matmul_cuda: {name} must be a contiguous 2-D float32 tensor")
    (M, K), N = a.shape, b.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"matmul_cuda: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    s = STEPS[step]
    if any(d % s.multiple for d in (M, N, K)):
        raise ValueError(f"matmul_cuda: step {step!r} needs M, N, K multiples of {s.multiple}, got {M}, {N}, {K}")
    from kernels import cuda_launch

    c = torch.empty((M, N), dtype=torch.float32, device=a.device)
    rows, cols = -(-M // s.tile[0]), -(-N // s.tile[1])
    grid = (rows, cols) if s.rows_on_x else (cols, rows)
    cuda_launch.load("gemm_ladder").launch(s.kernel, grid, s.block, M, N, K, a, b, c)
    return c


def warp_addresses(step: str, operand: str, *, K: int, N: int, k: int = 0) -> list[int]:
    """Byte offsets the 32 lanes of warp 0 (threadIdx.y = 0, x = 0..31) read from ``operand`` ("A" or
    "B") at K step ``k`` in the naive or coalesced step: the kernels' index formulas, fp32."""
    if step not in ("naive", "coalesced"):
        raise ValueError(f"warp_addresses: only the naive and coalesced steps, got {step!r}")
    lanes = range(32)
    if operand == "A":       # A[row * K + k]: row = lane (naive) or 0 (coalesced)
        return [4 * ((lane if step == "naive" else 0) * K + k) for lane in lanes]
    if operand == "B":       # B[k * N + col]: col = 0 (naive) or lane (coalesced)
        return [4 * (k * N + (0 if step == "naive" else lane)) for lane in lanes]
    raise ValueError(f"warp_addresses: operand must be 'A' or 'B', got {operand!r}")
