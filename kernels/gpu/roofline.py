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
