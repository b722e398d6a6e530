"""y = x, element by element: the kernel whose speed is the memory bandwidth and nothing else.

Each program copies one BLOCK of the flattened tensor: it reads BLOCK elements and writes BLOCK
elements and does no arithmetic, so its arithmetic intensity is 0 FLOP per byte and its run time
on a GPU is bytes / bandwidth: 2 * n * itemsize bytes (one read, one write) over the HBM
bandwidth of ``kernels.gpu.hardware``. :func:`bench_copy` measures that on a GPU and records it.

Its strided twin, :func:`strided_copy` (y[i] = x[i * stride]), reads with neighbouring threads
``stride`` elements apart: the same bytes written, but each warp's loads span up to 32 sectors
instead of a few (coalescing: ``kernels.gpu.hardware.warp_sectors``). With stride 1 a launch
specialises the stride to the constant 1 and the loads become 16-byte vector loads; with any other
stride they stay one element per thread.
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
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) flat indices, int64: n may pass 2**31
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
    if x.numel():
        grid, args, kwargs = _launch_args(x, y, block)
        _copy_kernel[grid](*args, **kwargs)
    return y


@triton.jit
def _strided_copy_kernel(src_ptr, dst_ptr, n, stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) output indices, int64
    mask = offs < n                                         # n outputs: ceil(len(x) / stride)
    x = tl.load(src_ptr + offs * stride, mask=mask)         # thread t reads element t * stride
    tl.store(dst_ptr + offs, x, mask=mask)


def strided_copy_ref(x: torch.Tensor, stride: int) -> torch.Tensor:
    """The reference: every ``stride``-th element of the 1-D ``x``, contiguous."""
    return x[::stride].clone()


def strided_copy(x: torch.Tensor, stride: int, *, block: int = 1024) -> torch.Tensor:
    """y[i] = x[i * stride] for a contiguous 1-D ``x``: ceil(len(x) / stride) elements."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"strided_copy: x must be a contiguous 1-D torch.Tensor, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise ValueError(f"strided_copy: stride must be an int >= 1, got {stride!r}")
    if x.device.type != runtime.device().type:
        raise ValueError(f"strided_copy: x is on {x.device}, kernels run on {runtime.device()} here")
    if block < 16 or block & (block - 1):
        raise ValueError(f"strided_copy: block must be a power of two >= 16, got {block}")
    y = torch.empty(-(-x.numel() // stride), dtype=x.dtype, device=x.device)
    if y.numel():
        grid, args, kwargs = _strided_launch_args(x, y, stride, block)
        _strided_copy_kernel[grid](*args, **kwargs)
    return y


def _strided_launch_args(x: torch.Tensor, y: torch.Tensor, stride: int, block: int):
    """(grid, args, kwargs) of one launch of :func:`_strided_copy_kernel` (launcher and compile_jobs)."""
    n = y.numel()
    return (triton.cdiv(n, block),), (x, y, n, stride), dict(BLOCK=block)


def _launch_args(x: torch.Tensor, y: torch.Tensor, block: int):
    """(grid, args, kwargs) of one launch of :func:`_copy_kernel`, shared by :func:`copy` and
    :func:`compile_jobs` so the AOT build is the launch."""
    n = x.numel()
    return (triton.cdiv(n, block),), (x, y, n), dict(BLOCK=block)


def compile_jobs() -> dict:
    """The copy of one layer's fp16 K and V cache of Llama-3-8B at batch 32 and 8192 positions
    (2 x 32 x 8 x 8192 x 128 = 2**29 elements), with the launcher's default block and the
    benchmark's; and the strided copy writing as many elements from 16 times as wide a source,
    with stride 1 (a launch specialises it to the constant 1) and 16."""
    from kernels import inspect as ki

    n = 2 * 32 * 8 * 8192 * 128
    x = torch.empty(n, dtype=torch.float16, device="meta")
    jobs = {}
    for block in (1024, 4096):
        grid, args, kwargs = _launch_args(x, x, block)
        jobs[f"Llama-3-8B layer KV cache copy, batch 32, BLOCK={block}"] = ki.launch_job(_copy_kernel, *args, grid=grid,
                                                                                         **kwargs)
    wide = torch.empty(16 * n, dtype=torch.float16, device="meta")
    for stride in (1, 16):
        grid, args, kwargs = _strided_launch_args(wide, x, stride, 1024)
        jobs[f"strided copy of 2**29 fp16, stride {stride}"] = ki.launch_job(_strided_copy_kernel, *args, grid=grid,
                                                                             **kwargs)
    return jobs


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
