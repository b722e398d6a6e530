"""Integer quantization: int8 and int4 codes, their scales and zero points, and int4 packing.

A b-bit integer grid stores a real number x as a code q and recovers it as x_hat = s (q - z):

    symmetric  (z = 0):     q = clamp(round(x / s), -(2^(b-1) - 1), 2^(b-1) - 1),   s = max|x| / (2^(b-1) - 1)
    asymmetric (z integer): q = clamp(round(x / s) + z, 0, 2^b - 1),
                            s = (max x - min x) / (2^b - 1),   z = round(-min x / s)

The symmetric grid drops the code -2^(b-1) so that +-max|x| are both exact (int8: -127..127). The
asymmetric grid spends all 2^b codes on [min x, max x] (with 0 inside the range, so that a zero
weight stays exactly zero), which is what the 4-bit weight formats of AWQ and GPTQ use.

Granularity: one (s, z) per tensor, per output channel (a row of a weight W (N, K), or a token
row of an activation X (M, K)), or per group of ``group_size`` consecutive elements along K. A
group of g elements at b bits with an fp16 scale and a b-bit zero point costs b + (16 + b) / g
bits per weight: 4.156 bits at g = 128 for int4.

Rounding is round-half-to-even (``torch.round``), which is what the kernels' ``rint`` also does.

int4 packing: two 4-bit codes per byte along the last dimension, element 2j in the low nibble and
element 2j + 1 in the high nibble (the order the w4a16 kernel unpacks; the GPTQ and AWQ CUDA kernels
pack eight codes per int32 in orders of their own).
"""
from __future__ import annotations

import torch

GRANULARITIES = ("tensor", "channel", "group")


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The codes a ``bits``-bit grid uses: (-(2^(b-1) - 1), 2^(b-1) - 1) symmetric, (0, 2^b - 1) asymmetric."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    if symmetric:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _groups(x: torch.Tensor, granularity: str, group_size: int | None) -> torch.Tensor:
    """x (R, K) viewed as (R, G, g): the elements that share one scale along the last axis."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    R, K = x.shape
    if granularity == "tensor":
        return x.reshape(1, 1, R * K)
    if granularity == "channel":
        return x.reshape(R, 1, K)
    if group_size is None or group_size < 1:
        raise ValueError(f"granularity='group' needs a positive group_size, got {group_size}")
    if K % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={K}")
    return x.reshape(R, K // group_size, group_size)


def quant_params(x: torch.Tensor, bits: int, *, symmetric: bool = True, granularity: str = "channel",
                 group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale s and zero point z (both float, z integral) for x (R, K): shapes (1, 1), (R, 1) or (R, K / g).

    An all-zero group gets s = 1 (any scale represents it exactly) instead of a division by zero.
    """
    xg = _groups(x, granularity, group_size)                          # (R', G, g)
    lo, hi = qrange(bits, symmetric)
    if symmetric:
        s = xg.abs().amax(-1) / hi                                      # s = max|x| / (2^(b-1) - 1)
        z = torch.zeros_like(s)
    else:
        xmin = xg.amin(-1).clamp(max=0)                                 # keep 0 inside the range
        xmax = xg.amax(-1).clamp(min=0)
        s = (xmax - xmin) / hi                                          # s = (max - min) / (2^b - 1)
        z = torch.round(-xmin / torch.where(s > 0, s, torch.ones_like(s)))  # z = round(-min / s)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return s, z


def _expand(p: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A (R', G) parameter broadcast back over x's (R, K) elements."""
    R, K = shape
    Rp, G = p.shape
    return p.repeat_interleave(R // Rp, 0).repeat_interleave(K // G, 1) if Rp != R or G != K else p


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Codes q = clamp(round(x / s) + z, lo, hi), int8 (symmetric) or uint8 (asymmetric), with (s, z) of any
    granularity from :func:`quant_params`."""
    lo, hi = qrange(bits, symmetric)
    s, z = _expand(scale, x.shape), _expand(zero, x.shape)
    return torch.clamp(torch.round(x / s) + z, lo, hi).to(torch.int8 if symmetric else torch.uint8)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x_hat = s (q - z), in the scale's dtype."""
    s, z = _expand(scale, q.shape), _expand(zero, q.shape)
    return s * (q.to(s.dtype) - z)


def fake_quantize(x: torch.Tensor, bits: int, *, symmetric: bool = True, granularity: str = "channel",
                  group_size: int | None = None) -> torch.Tensor:
    """Round-to-nearest (RTN): x quantized and dequantized again, same shape and dtype (the error a format adds)."""
    s, z = quant_params(x, bits, symmetric=symmetric, granularity=granularity, group_size=group_size)
    return dequantize_ref(quantize_ref(x, s, z, bits, symmetric), s, z).to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations X (M, K) to int8 codes (M, K) with one fp32 scale per token row (M,): s_m = max_k |x_mk| / 127.

    The scale is rounded to fp32 first and the codes are computed from that fp32 scale, so the codes
    and the scale a kernel receives agree exactly (x in float64 stays float64 until the rounding).
    """
    return _symmetric_rows(x, 8)


def quantize_per_channel(w: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights W (N, K) to symmetric codes (N, K) with one fp32 scale per output channel (N,)."""
    return _symmetric_rows(w, bits)


def _symmetric_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"expected a 2-D floating-point tensor, got {x.dtype} with shape {tuple(x.shape)}")
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    _, hi = qrange(bits, True)
    s = (x.to(wide).abs().amax(1) / hi).float()                       # (R,) fp32
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.clamp(torch.round(x.to(wide) / s.to(wide)[:, None]), -hi, hi).to(torch.int8)
    return q, s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes (..., K) with values in [-8, 15] to bytes (..., K / 2): byte j = (q[2j] & 15) | (q[2j+1] & 15) << 4.

    Signed codes keep their two's-complement low nibble; :func:`unpack_int4` with ``signed=True`` restores them.
    """
    if q.dtype not in (torch.int8, torch.uint8, torch.int32, torch.int64):
        raise ValueError(f"q must hold integer codes, got {q.dtype}")
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even length along the last dimension, got {q.shape[-1]}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 15):
        raise ValueError(f"q must lie in [-8, 15] to fit 4 bits, got [{int(q.min())}, {int(q.max())}]")
    n = q.to(torch.int32) & 0xF
    return (n[..., 0::2] | (n[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Bytes (..., K / 2) back to codes (..., K) as int8: [0, 15], or [-8, 7] with ``signed``."""
    if p.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {p.dtype}")
    v = p.to(torch.int32)
    n = torch.stack([v & 0xF, v >> 4], dim=-1).flatten(-2)            # (..., K): low nibble first
    if signed:
        n = n - 16 * (n >= 8).to(torch.int32)                          # two's complement of a nibble
    return n.to(torch.int8)


def bits_per_weight(bits: int, group_size: int | None, *, scale_bits: int = 16, zero_bits: int | None = None) -> float:
    """Storage cost of one weight: b + (scale bits + zero bits) / g (per-channel: g = K, pass ``group_size=None`` -> b)."""
    if group_size is None:
        return float(bits)
    return bits + (scale_bits + (bits if zero_bits is None else zero_bits)) / group_size
