"""C = A @ B with one Triton program per (BLOCK_M x BLOCK_N) tile of C.

Each program walks the shared K dimension in steps of BLOCK_K, loading a (BLOCK_M x BLOCK_K) tile
of A and a (BLOCK_K x BLOCK_N) tile of B and accumulating their product in fp32 with ``tl.dot``,
the call that the compiler lowers to the tensor cores (mma.sync, wgmma or tcgen05.mma by
architecture). Masks on every load and store let M, N and K be any size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.float32)


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: the product computed in fp32 from the same inputs, returned in fp32."""
    return a.float() @ b.float()


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of C this program owns
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of C
    ks = tl.arange(0, BLOCK_K)                      # (BLOCK_K,) offsets along K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        # A tile (BLOCK_M, BLOCK_K) and B tile (BLOCK_K, BLOCK_N); out-of-range entries load as 0,
        # which adds nothing to the dot product.
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # acc += a @ b, in fp32 (no TF32)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, c,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _check_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"matmul: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"matmul: {name} must be 2-D (rows, cols), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"matmul: {name} has dtype {t.dtype}; supported: float16, float32")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"matmul: a is on {a.device} but b is on {b.device}")
    if a.device.type != runtime.device().type:
        raise ValueError(f"matmul: inputs are on {a.device}, kernels run on {runtime.device()} here")


def _launch_args(a, b, c, block_m: int, block_n: int, block_k: int):
    """(grid, args, kwargs) of one launch of the tiled kernel: shared by the launchers and :func:`compile_jobs`."""
    (M, K), N = a.shape, b.shape[1]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    return grid, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def _launch(kernel, a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int) -> torch.Tensor:
    """Validate, allocate C (M, N) in the inputs' dtype, and run ``kernel`` on one program per tile."""
    _check_inputs(a, b)
    c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    grid, args, kwargs = _launch_args(a, b, c, block_m, block_n, block_k)
    kernel[grid](*args, **kwargs)
    return c


def launch_job(M: int, K: int, N: int, *, block=(64, 64, 32), dtype=torch.float16):
    """The AOT job of :func:`matmul` at (M, K) @ (K, N) with ``block`` = (BLOCK_M, BLOCK_N, BLOCK_K)."""
    from kernels import inspect as ki

    a = torch.empty(M, K, device="meta", dtype=dtype)
    b = torch.empty(K, N, device="meta", dtype=dtype)
    c = torch.empty(M, N, device="meta", dtype=dtype)
    grid, args, kwargs = _launch_args(a, b, c, *block)
    return ki.launch_job(_matmul_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The tiled kernel at Llama-3-70B's up projection (4096 tokens x 8192 -> 28672), as ``matmul``
    launches it: its default 64x64x32 blocks and 128x128x64, both at Triton's default 4 warps."""
    M, K, N = 4096, 8192, 28672
    return {f"Llama-3-70B up proj, 4096 tokens: tiled {bm}x{bn}x{bk}, 4 warps": launch_job(M, K, N, block=(bm, bn, bk))
            for bm, bn, bk in ((64, 64, 32), (128, 128, 64))}


def matmul(a: torch.Tensor, b: torch.Tensor, *, block_m: int = 64, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """``a @ b`` for 2-D fp16 or fp32 tensors of any size and strides; the result has the inputs' dtype.

    fp32 inputs multiply in full fp32 (``input_precision="ieee"``), not TF32, so the kernel can be
    checked at fp32 tolerance on a GPU as on the CPU.
    """
    return _launch(_matmul_kernel, a, b, block_m, block_n, block_k)


# ----------------------------------------------------------------------------------------------
# A deliberately broken variant, kept for the start chapter and the tests: the loads along K are
# not masked, so when K is not a multiple of BLOCK_K the last step reads past the end of each row
# of A and past the last row of B. On a GPU that can fault or read garbage; under the interpreter
# it silently reads whatever host memory lies there, which is why the checks use NaN canaries.


@triton.jit
def _matmul_no_k_mask_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak, mask=rows[:, None] < M, other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn, mask=cols[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul_no_k_mask(a: torch.Tensor, b: torch.Tensor, *, block_m: int = 64, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """The broken variant above, launched like :func:`matmul`. Wrong whenever K % block_k != 0."""
    return _launch(_matmul_no_k_mask_kernel, a, b, block_m, block_n, block_k)
