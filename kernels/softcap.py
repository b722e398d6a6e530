"""tanh for Triton kernels, accurate near zero, and the logit soft-cap built on it.

Gemma 2 caps attention scores (cap 50) and final logits (cap 30) with c(x) = cap * tanh(x / cap):
about x for |x| << cap, never past +-cap. Its derivative is c'(x) = 1 - tanh(x / cap)^2.

libdevice's tanh fails under Triton's interpreter, and 2 sigmoid(2u) - 1 loses the small u that
ordinary scores give (u = x / cap ~ 0.03 at cap 50): sigmoid(2u) sits near 1/2, and subtracting 1
keeps only its absolute rounding error, about 1.5e-7, a relative error near 1e-4 at u = 1e-3.
Here, with a = |u| and the sign put back at the end:

    a <  0.25:  tanh a = a (1 - a^2/3 + 2a^4/15 - 17a^6/315 + 62a^8/2835)   next term < 1e-8 relative
    a >= 0.25:  tanh a = (1 - e) / (1 + e),  e = e^(-2a) <= 0.61, so 1 - e >= 0.39 cancels less than 2 bits

Against tanh in float64 (tests/test_softcap.py): within 2x torch.tanh's own fp32 relative error
below 0.25, and below 3e-7 relative everywhere (torch.tanh: 6e-8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SERIES_BELOW = 0.25          # |u| below this: the odd series; above: the exponential form


@triton.jit
def tanh(u):
    """tanh(u) elementwise in fp32, accurate to a few ulp from 1e-30 to inf (module docstring)."""
    a = tl.abs(u)
    a2 = a * a
    series = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * 0.021869488536155203))))
    e = tl.exp2(-2.8853900817779268 * a)                  # e^(-2a) = 2^(-2a log2 e)
    t = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(u < 0, -t, t)


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in PyTorch: the reference."""
    return cap * torch.tanh(x / cap)


def check_cap(cap, name: str) -> float:
    """A soft-cap must be a finite number > 0 (c(x) -> x as cap -> inf: no cap is None, not inf)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (0 < cap < float("inf")):
        raise ValueError(f"{name}: softcap must be a finite number > 0 (or None for no cap), got {cap!r}")
    return float(cap)
