"""FLOPs and bytes of the chapter's three workloads, for the roofline (GPU numbers: kernels.gpu.hardware).

Counts are for one pass with ideal reuse (each input read once, each output written once) in a
``itemsize``-byte dtype; they are the minimum traffic a fused kernel needs, so intensity is an
upper bound on what a real kernel reaches.

* softmax over rows of an (R, C) tensor: per element a max compare, a subtract, an exp, an add
  into the sum and a divide (or multiply by 1/sum): 5 FLOP (exp counted as one). Bytes: read and
  write each element: 2 * R * C * itemsize.
* RMSNorm of an (R, C) tensor with weight (C,): per element a square, an add, a multiply by
  1/rms and a multiply by the weight: 4 FLOP (plus one rsqrt per row). Bytes: read x, write y,
  read the weight once: (2 R C + C) * itemsize.
* matmul (M, K) @ (K, N): 2 M N K FLOP; bytes (M K + K N + M N) * itemsize.
"""
from __future__ import annotations

from kernels.gpu import hardware


def softmax_counts(rows: int, cols: int, itemsize: int = 2) -> tuple[float, float]:
    return 5.0 * rows * cols, 2.0 * rows * cols * itemsize


def rmsnorm_counts(rows: int, cols: int, itemsize: int = 2) -> tuple[float, float]:
    return 4.0 * rows * cols + rows, (2.0 * rows * cols + cols) * itemsize


def matmul_counts(m: int, n: int, k: int, itemsize: int = 2) -> tuple[float, float]:
    return 2.0 * m * n * k, float(m * k + k * n + m * n) * itemsize


def intensity(counts: tuple[float, float]) -> float:
    """FLOP per byte."""
    flops, nbytes = counts
    return flops / nbytes


def achieved(gpu: hardware.GPU | str, *, ms: float, bytes_moved: float, flops: float = 0.0,
             dtype: str = "fp16") -> dict:
    """What a measured run reached against the roofline of ``gpu``: the roofline's lower bound on
    the time, which roof binds, and the fraction of that bound reached
    (1.0 = at the roofline). ``bytes_moved`` and ``flops`` are the minimum a fused kernel must do
    (the counts above), so the fraction is conservative: a kernel that moves more scores lower."""
    if ms <= 0:
        raise ValueError(f"ms must be > 0, got {ms}")
    g = hardware.gpu(gpu)
    bound_ms = hardware.roofline_time_s(g, flops, bytes_moved, dtype) * 1e3
    memory_ms = bytes_moved / g.bytes_per_s * 1e3
    return {
        "roofline_ms": bound_ms,
        "bound": "memory" if memory_ms >= bound_ms else "compute",
        "fraction_of_roofline": bound_ms / ms,
        "roofline_gpu": g.key,
    }
