"""FP4 and FP6: the OCP MX element formats E2M1, E2M3 and E3M2, bit by bit, and round-to-nearest
with one scale per group of weights.

A minifloat with ``e`` exponent bits, ``m`` mantissa bits and bias ``b = 2^(e-1) - 1`` stores

    (-1)^s 2^(E - b) (1 + f / 2^m)        for a biased exponent field E > 0 (normal)
    (-1)^s 2^(1 - b) (f / 2^m)            for E = 0 (subnormal)

The OCP Microscaling (MX) specification v1.0 defines three of them as block elements, all without
infinities or NaN (every code is a finite number) [section 5.3]:

    E2M1 (FP4)   bias 1   0, 0.5, 1, 1.5, 2, 3, 4, 6    max 6     smallest subnormal 0.5
    E2M3 (FP6)   bias 1                                  max 7.5   smallest subnormal 0.125
    E3M2 (FP6)   bias 3                                  max 28    smallest subnormal 0.0625

:func:`decode` and :func:`encode` work on the raw codes (uint8, the code in the low bits) with
integer operations only. Rounding is to nearest, ties to even; a magnitude beyond the largest value
(infinities included) saturates to +-max, as PTX's ``cvt.rn.satfinite`` conversions to e2m1x2,
e2m3x2 and e3m2x2 do; NaN has no code and is refused. The checks (``tests/test_minifloat.py``) run
every code and every rounding midpoint against ``ml_dtypes`` (float4_e2m1fn, float6_e2m3fn,
float6_e3m2fn): PyTorch 2.13 has ``torch.float4_e2m1fn_x2`` as a storage type only (no conversion
on the CPU) and no FP6 type.

Two codes per byte: :func:`kernels.quant.intq.pack_int4` (element 2j in the low nibble), the order
``tl.dot_scaled`` reads packed E2M1 in; bitsandbytes packs the first element in the high nibble.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Minifloat:
    name: str
    ebits: int
    mbits: int

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def max_code(self) -> int:
        """Code (without the sign) of the largest value: every exponent and mantissa bit set."""
        return (1 << (self.ebits + self.mbits)) - 1

    @property
    def max(self) -> float:
        """Largest magnitude: 2^(2^e - 1 - bias) (2 - 2^-m)."""
        return 2.0 ** ((1 << self.ebits) - 1 - self.bias) * (2 - 2.0**-self.mbits)

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number (the MX scale rule subtracts it)."""
        return (1 << self.ebits) - 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mbits)


E2M1 = Minifloat("e2m1", 2, 1)
E2M3 = Minifloat("e2m3", 2, 3)
E3M2 = Minifloat("e3m2", 3, 2)
FORMATS = {f.name: f for f in (E2M1, E2M3, E3M2)}


def fmt_of(fmt) -> Minifloat:
    """The :class:`Minifloat` named by ``fmt`` ("e2m1", "e2m3", "e3m2") or ``fmt`` itself."""
    if isinstance(fmt, Minifloat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def decode(codes: torch.Tensor, fmt="e2m1") -> torch.Tensor:
    """The fp32 value of every code (uint8, the code in the low ``bits`` bits):
    (-1)^s (E == 0 ? f : 2^m + f) 2^(max(E, 1) - bias - m)."""
    f = fmt_of(fmt)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"decode: codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    if codes.numel() and int(codes.max()) >> f.bits:
        raise ValueError(f"decode: {f.name} codes are {f.bits}-bit, got a code {int(codes.max())}")
    c = codes.to(torch.int32)
    sign = 1.0 - 2.0 * ((c >> (f.ebits + f.mbits)) & 1).float()
    e = (c >> f.mbits) & ((1 << f.ebits) - 1)                      # biased exponent field
    frac = c & ((1 << f.mbits) - 1)                                 # mantissa field
    significand = torch.where(e == 0, frac, frac + (1 << f.mbits)).float()   # an integer < 2^(m+1)
    return sign * significand * torch.exp2((e.clamp(min=1) - f.bias - f.mbits).float())


def _rshift_rne(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """v >> s rounded to nearest, ties to even (int64 tensors, s >= 1)."""
    q = v >> s
    rest = v & ((1 << s) - 1)
    half = 1 << (s - 1)
    return q + ((rest > half) | ((rest == half) & (q & 1 == 1))).long()


def encode(x: torch.Tensor, fmt="e2m1") -> torch.Tensor:
    """The code (uint8) nearest to each value of ``x``, ties to even, saturating at +-max; computed
    from the fp32 bit pattern (x is first rounded to fp32)."""
    f = fmt_of(fmt)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"encode: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    x32 = x.float()
    if torch.isnan(x32).any():
        raise ValueError(f"encode: x contains NaN, which {f.name} cannot represent (it has no NaN code)")
    bits = x32.view(torch.int32).long() & 0xFFFFFFFF
    sign = (bits >> 31) << (f.ebits + f.mbits)
    mag = bits & 0x7FFFFFFF
    e32 = mag >> 23                                                 # fp32 biased exponent
    # normal in the target: drop 23 - m mantissa bits of the whole magnitude (a carry bumps the
    # exponent) and rebias the exponent from 127 to the format's bias
    normal = _rshift_rne(mag, torch.full_like(mag, 23 - f.mbits)) - ((127 - f.bias) << f.mbits)
    # subnormal in the target: the 24-bit significand in units of the smallest subnormal 2^(1-b-m)
    significand = (mag & 0x7FFFFF) | (1 << 23)
    sub = _rshift_rne(significand, (23 - f.mbits + 1 - f.bias + 127 - e32).clamp(1, 40))
    sub = torch.where(e32 == 0, torch.zeros_like(sub), sub)        # fp32 zeros and subnormals: 0
    code = torch.where(e32 >= 1 - f.bias + 127, normal, sub).clamp(max=f.max_code)   # saturate (inf too)
    return (code | sign).to(torch.uint8)


def values(fmt="e2m1") -> torch.Tensor:
    """Every code's value, in code order: (2^bits,) fp32."""
    f = fmt_of(fmt)
    return decode(torch.arange(1 << f.bits, dtype=torch.int32).to(torch.uint8), f)


# ------------------------------------------------------------------------------------------------
# Round-to-nearest with one scale per group


def group_scales(w: torch.Tensor, fmt, group_size: int) -> torch.Tensor:
    """One fp16 scale per group of ``group_size`` consecutive inputs of W (N, K): s = max|w| / max,
    so the group's largest magnitude lands on the format's largest value; (N, K / g) fp16. An all-zero
    group gets s = 1."""
    f = fmt_of(fmt)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {tuple(w.shape)}")
    if group_size < 1 or w.shape[1] % group_size:
        raise ValueError(f"group_size={group_size} must be positive and divide K={w.shape[1]}")
    amax = w.abs().reshape(w.shape[0], -1, group_size).amax(-1).float()
    s = (amax / f.max).half()
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize(w: torch.Tensor, fmt, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (N, K) uint8 and fp16 scales (N, K / g) of W: q = encode(w / s). The division is by the
    stored fp16 scale, so the codes and the scale a kernel receives agree."""
    s = group_scales(w, fmt, group_size)
    scaled = w.double() / s.double().repeat_interleave(group_size, 1)
    return encode(scaled, fmt), s


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt) -> torch.Tensor:
    """W_hat = s * decode(q), fp32 (N, K)."""
    g = codes.shape[1] // scales.shape[1]
    return decode(codes, fmt) * scales.float().repeat_interleave(g, 1)


def fake_quantize(w: torch.Tensor, fmt, group_size: int) -> torch.Tensor:
    """RTN in the format: W quantized and dequantized again, in W's dtype."""
    return dequantize(*quantize(w, fmt, group_size), fmt).to(w.dtype)


def bits_per_weight(fmt, group_size: int, scale_bits: int = 16) -> float:
    """Storage per weight: element bits + scale bits / g."""
    return fmt_of(fmt).bits + scale_bits / group_size
