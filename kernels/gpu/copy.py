"""y = x, element by element: the kernel whose speed is the memory bandwidth and nothing else.

Each program copies one BLOCK of the flattened tensor: it reads BLOCK elements and writes BLOCK
elements and does no arithmetic, so its arithmetic intensity is 0 FLOP per byte and its run time
on a GPU is bytes / bandwidth: 2 * n * itemsize bytes (one read, one write) over the HBM
bandwidth of ``kernels.gpu.hardware``. :func:`bench_copy` measures that on a GPU and records it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import bench, runtime
from kernels.gpu import hardware, roofline

BENCH_NAME = "memory-copy"


def copy_ref(x: torch.Tensor) -> torch.Tensor:
    """The reference: a fresh tensor equal to ``x``."""
    return x.clone()


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat indices this program copies
    mask = offs < n                            # the last block may run past n
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, x, mask=mask)


def copy(x: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """A contiguous copy of a contiguous tensor ``x`` of any shape and dtype, by ``_copy_kernel``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"copy: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_contiguous():
        raise ValueError(f"copy: x must be contiguous (got strides {x.stride()} for shape {tuple(x.shape)}); "
                         "the kernel walks memory as one flat array")
    if x.device.type != runtime.device().type:
        raise ValueError(f"copy: x is on {x.device}, kernels run on {runtime.device()} here")
    if block < 16 or block & (block - 1):
        raise ValueError(f"copy: block must be a power of two >= 16, got {block}")
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _copy_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block)
    return y


def bytes_moved(n: int, itemsize: int) -> int:
    """One read and one write of every element."""
    return 2 * n * itemsize


def bench_copy(sizes=(2**20, 2**24, 2**27), dtype=torch.float16, *, block: int = 4096, record: bool = True):
    """GPU only: time ``copy`` at each size, report GB/s, and record them as ``memory-copy``.

    Rows: n, dtype, bytes, ms (median), GB/s = bytes / time, and torch's own ``clone`` GB/s beside it.
    """
    if not runtime.runtime().on_gpu:
        raise bench.NoGPUError(f"bench_copy measures GPU bandwidth; there is no GPU here. {bench.missing_note(BENCH_NAME)}")
    rows = []
    for n in sizes:
        x = torch.randn(n, device="cuda").to(dtype)
        ms, lo, hi = bench.time_ms(lambda: copy(x, block=block))
        ms_t, _, _ = bench.time_ms(lambda: x.clone())
        b = bytes_moved(n, x.element_size())
        row = {"n": n, "dtype": str(dtype).replace("torch.", ""), "bytes": b, "ms": ms, "ms_q20": lo, "ms_q80": hi,
               "gbs": b / (ms * 1e-3) / 1e9, "torch_clone_gbs": b / (ms_t * 1e-3) / 1e9, "block": block}
        gpu = hardware.identify(torch.cuda.get_device_name())
        if gpu is not None:                       # the fraction of the HBM roof reached (a copy does no FLOPs)
            row.update(roofline.achieved(gpu, ms=ms, bytes_moved=b))
        rows.append(row)
    if record:
        bench.record(BENCH_NAME, rows, command=bench.command_line())
    return rows
