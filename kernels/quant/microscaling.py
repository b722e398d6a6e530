"""Microscaling: one scale shared by a block of consecutive elements. MXFP8, MXFP6 and MXFP4 (the OCP
MX specification v1.0) and NVFP4 (NVIDIA), quantized and dequantized exactly, and a block-scaled
matmul that Blackwell runs as one ``tcgen05.mma ... .block_scale`` instruction.

**MX** (OCP MX v1.0, sections 5 and 6.3): a block of k = 32 elements along the reduction dimension
shares one E8M0 scale, an unsigned 8-bit exponent with bias 127 (code c is 2^(c - 127) for c in 0..254,
c = 255 is NaN, there is no zero). The conversion rule of section 6.3:

    X   = 2^(floor(log2(max_i |V_i|)) - emax_elem)      the block's scale, a power of two
    P_i = quantize_elem(V_i / X)                         round to nearest even, clamp to +-max_elem

emax_elem is the exponent of the element format's largest normal: 8 for E4M3 (448 = 1.75 * 2^8),
2 for E2M1 (6 = 1.5 * 2^2) and E2M3, 4 for E3M2. So max|V| / X lies in [2^emax, 2^(emax + 1)): the
largest element lands in the top binade, and above max_elem (E2M1: in (6, 8)) it is clamped. The
exponent is clamped to E8M0's range [-127, 127]; an all-zero block gets the smallest scale, code 0,
as the reference emulator does (microxcaling: log2 of FP32's smallest normal for a zero maximum).
A scale of NaN makes the whole block NaN (section 6.3); this module refuses NaN and infinite inputs.

**Rounding the scale up** (``rule="up"``): NVIDIA's MXFP8 pre-training recipe (Mishra et al., 2025)
found that the floor rule's clamping can make pre-training diverge and rounds the scale up instead,
as TransformerEngine converts it (``float_to_e8m0(amax * (1 / max_elem))``, on Blackwell
``cvt.rp.satfinite.ue8m0x2.f32``, round toward +infinity):

    X   = 2^ceil(log2(fp32(max_i |V_i| * fp32(1 / max_elem))))

so max|V| / X lies in (max_elem / 2, max_elem]: nothing clamps, and the top binade is only partly used.

**NVFP4** (NVIDIA, 2025): E2M1 elements in blocks of 16, each block with an E4M3 scale, plus one
FP32 scale for the whole tensor, so the block scales use E4M3's range:

    s_T = amax(x) / (6 * 448)                            FP32, per tensor
    s_b = e4m3(max_i |x_i| / 6 / s_T)                    RNE; the largest block gets 448
    q_i = e2m1(x_i / (s_b s_T))                          RNE, clamp to +-6 (s_b may have rounded down)

An E4M3 scale has 3 mantissa bits: a block's maximum lands within 1/16 of 6 instead of anywhere in
[4, 8) as with E8M0, and the block is half as long. A block whose s_b rounds to 0 (its maximum is
below 2^-10 of the tensor's largest block scale) is stored as zeros.

Elements use the encoders of :mod:`kernels.quant.fp8` (E4M3: RNE, saturating) and
:mod:`kernels.quant.minifloat` (E2M1, E2M3, E3M2: RNE, saturating), checked code by code against
``ml_dtypes``. Two E2M1 codes per byte, element 2j in the low nibble (:func:`kernels.quant.intq.pack_int4`),
the order ``tl.dot_scaled`` reads.

**The matmul** :func:`mx_matmul` computes C = A B^T for A (M, K) activations and B (N, K) weights
(nn.Linear's layout), both block-scaled along K. On a GPU it is ``tl.dot_scaled``: on sm100a Triton
3.7 lowers it to ``tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X`` (MXFP8),
``kind::mxf4.block_scale.scale_vec::2X`` (MXFP4) and ``kind::mxf4nvf4.block_scale.scale_vec::4X``
(NVFP4), with the scales copied into tensor memory (``tcgen05.st``) beside the accumulator; on sm120a
(no tensor memory) to the block-scaled ``mma.sync ... kind::mxf8f6f4`` / ``kind::mxf4nvf4``. The K loop
masks its loads in bytes and scales, so both copy the operands with 16-byte ``cp.async``
(:func:`global_loads`). Triton's
interpreter has no ``dot_scaled`` (its builder lacks ``create_dot_scaled``), so on the CPU the same
kernel takes its ``DECODE`` path: the same loads, the codes and scales decoded in the kernel with
integer operations, and an fp32 ``tl.dot`` (CUDA cores, not tensor cores: also what a GPU other than
compute capability 10 or 12 runs, a correctness path). The native path is compiled and read, never run here.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.quant import fp8, intq
from kernels.quant import minifloat as mf

E8M0_BIAS = 127
E8M0_NAN = 255


@dataclass(frozen=True)
class ElemFormat:
    """An MX element format: its name, bits, largest magnitude and emax (exponent of the largest normal)."""

    name: str
    bits: int
    max: float
    emax: int


ELEMENTS = {
    "e4m3": ElemFormat("e4m3", 8, fp8.E4M3.max, 8),
    **{f.name: ElemFormat(f.name, f.bits, f.max, f.emax) for f in (mf.E2M1, mf.E2M3, mf.E3M2)},
}
MX_BLOCK = 32
NVFP4_BLOCK = 16


def _elem(fmt: str) -> ElemFormat:
    if fmt not in ELEMENTS:
        raise ValueError(f"elem must be one of {sorted(ELEMENTS)}, got {fmt!r}")
    return ELEMENTS[fmt]


def encode_elem(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes (uint8) of x in the element format: RNE, saturating at +-max."""
    return fp8.encode(x, "e4m3") if _elem(fmt).name == "e4m3" else mf.encode(x, fmt)


def decode_elem(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of element codes."""
    return fp8.decode(codes, "e4m3") if _elem(fmt).name == "e4m3" else mf.decode(codes, fmt)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 scale codes (uint8) to fp32: 2^(c - 127), NaN for 255. Code 0 is 2^-127, an fp32 subnormal."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"decode_e8m0: codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    v = torch.exp2(codes.double() - E8M0_BIAS).float()                 # exact: a power of two >= 2^-127
    return torch.where(codes == E8M0_NAN, torch.full_like(v, float("nan")), v)


def _blocks(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """x (..., K) as fp64 blocks (..., K / block, block), after checking it."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1 or x.shape[-1] % block or block < 1:
        raise ValueError(f"{name}: the last dimension ({x.shape[-1] if x.dim() else None}) must be a multiple of "
                         f"block={block}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name}: x contains NaN or infinity; an MX/NVFP4 block holding one would decode as NaN")
    return x.double().reshape(*x.shape[:-1], -1, block)


SCALE_RULES = ("floor", "up")


def mx_scale_exponent(amax: torch.Tensor, fmt: str, rule: str = "floor") -> torch.Tensor:
    """The shared exponent of each block (int64), clamped to [-127, 127]; a zero block gets -127.
    ``rule="floor"``: floor(log2(amax)) - emax_elem (OCP MX v1.0, section 6.3). ``rule="up"``:
    ceil(log2(q)) with q = amax * (1 / max_elem) in fp32, TransformerEngine's round-up conversion."""
    f = _elem(fmt)
    a = amax.double()
    if rule == "floor":
        mant, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))    # a = mant 2^e, mant in [0.5, 1)
        exp = e.long() - 1 - f.emax                                          # floor(log2 a) - emax, exact
    elif rule == "up":
        q = a.float() * torch.tensor(1.0 / f.max, dtype=torch.float32)       # fp32 product, as TE forms it
        mant, e = torch.frexp(torch.where(q > 0, q, torch.ones_like(q)))    # q = mant 2^e
        exp = e.long() - (mant == 0.5).long()                                # ceil(log2 q), exact
    else:
        raise ValueError(f"rule must be one of {SCALE_RULES}, got {rule!r}")
    exp = torch.where(a > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mx(x: torch.Tensor, elem: str = "e2m1", block: int = MX_BLOCK, *, rule: str = "floor"):
    """MX quantization of x (..., K) along its last dimension: element codes (..., K) uint8 and E8M0 scale
    codes (..., K / block) uint8. ``block`` is 32 in the specification; other sizes are for experiments.
    ``rule`` is the scale rule of :func:`mx_scale_exponent` ("floor": OCP v1.0, "up": NVIDIA's recipe)."""
    f = _elem(elem)
    v = _blocks(x, block, "quantize_mx")                                 # (..., K/b, b) fp64
    exp = mx_scale_exponent(v.abs().amax(-1), f.name, rule)              # (..., K/b)
    scaled = v * torch.exp2(-exp.double())[..., None]                    # V_i / X, exact (X a power of two)
    codes = encode_elem(scaled.reshape(x.shape).float(), f.name)         # RNE, clamp to +-max_elem
    return codes, (exp + E8M0_BIAS).to(torch.uint8)


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor, elem: str = "e2m1") -> torch.Tensor:
    """x_hat = X * decode(P), fp32 (exact: a power of two times an element). A NaN scale gives a NaN block."""
    block = codes.shape[-1] // scales.shape[-1]
    return decode_elem(codes, elem) * decode_e8m0(scales).repeat_interleave(block, -1)


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """s_T = amax / (6 * 448) as a one-element fp32 tensor (1 for an all-zero tensor)."""
    amax = x.detach().abs().max().double()
    return torch.where(amax > 0, amax / (mf.E2M1.max * fp8.E4M3.max), torch.ones_like(amax)).float().reshape(1)


def quantize_nvfp4(x: torch.Tensor, block: int = NVFP4_BLOCK, tensor_scale: torch.Tensor | None = None):
    """NVFP4 quantization of x (..., K) along its last dimension: E2M1 codes (..., K) uint8, E4M3 block
    scales (..., K / block) float8_e4m3fn and the fp32 tensor scale (1,). The quotient x / (s_b s_T) is
    formed in fp64 and rounded to fp32 before the E2M1 rounding."""
    v = _blocks(x, block, "quantize_nvfp4")                              # (..., K/b, b) fp64
    s_t = nvfp4_tensor_scale(x) if tensor_scale is None else tensor_scale.float().reshape(1)
    if not (torch.isfinite(s_t).all() and s_t.item() > 0):
        raise ValueError(f"quantize_nvfp4: tensor_scale must be positive and finite, got {s_t.item()}")
    want = v.abs().amax(-1) / mf.E2M1.max / s_t.double()                 # (..., K/b) ideal block scale
    s_b = fp8.decode(fp8.encode(want.float(), "e4m3"), "e4m3")           # E4M3, RNE, saturating at 448
    denom = (s_b.double() * s_t.double())[..., None]                     # exact in fp64
    scaled = torch.where(denom > 0, v / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(v))
    codes = mf.encode(scaled.reshape(x.shape).float(), "e2m1")           # RNE, clamp to +-6
    return codes, s_b.to(torch.float8_e4m3fn), s_t


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """x_hat = (decode(q) s_b) s_T in fp32: the first product is exact, the second rounds once."""
    block = codes.shape[-1] // scales.shape[-1]
    return mf.decode(codes, "e2m1") * scales.float().repeat_interleave(block, -1) * tensor_scale.float()


def fake_quantize(x: torch.Tensor, fmt: str, rule: str = "floor") -> torch.Tensor:
    """x quantized and dequantized (fp32) in one of :data:`FORMATS`; ``rule`` is the MX scale rule
    (NVFP4 has none: its E4M3 block scale rounds to nearest)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    elem, _ = FORMATS[fmt]
    if fmt == "nvfp4":
        return dequantize_nvfp4(*quantize_nvfp4(x))
    return dequantize_mx(*quantize_mx(x, elem, rule=rule), elem)


# name -> (element format, block); the scale is E8M0 except for NVFP4 (E4M3 + FP32)
FORMATS = {"mxfp8": ("e4m3", 32), "mxfp6_e2m3": ("e2m3", 32), "mxfp6_e3m2": ("e3m2", 32),
           "mxfp4": ("e2m1", 32), "nvfp4": ("e2m1", 16)}


def bits_per_element(fmt: str) -> float:
    """Storage per element: element bits + 8 scale bits / block (NVFP4's FP32 tensor scale is negligible)."""
    elem, block = FORMATS[fmt]
    return ELEMENTS[elem].bits + 8 / block


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales (rows, K / block) uint8 or float8 (one byte each) in the layout cuBLAS and CUTLASS read
    for a block-scaled GEMM (the cuBLAS "block scaling factors layout"; TransformerEngine calls the
    conversion swizzling): rows padded to a multiple of 128 and scale columns to a multiple of 4 (with
    zero bytes), the (128, 4) tile each 128 x 128 (MXFP8) tile of the operand needs stored as 512
    contiguous bytes, tiles row-major, and inside a tile the 4-byte row r at position 4 (r % 32) + r // 32:

        offset(r, c) = (r // 128 * C4 + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4

    with C4 the number of 4-column tiles: rows r, r + 32, r + 64, r + 96 side by side, the order
    TransformerEngine's documentation gives for the hardware (this module does not derive it). Returns
    the flat byte vector (uint8)."""
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.element_size() != 1:
        raise ValueError("swizzle_scales: scales must be a 2-D tensor of one-byte scale codes")
    b = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    b = torch.nn.functional.pad(b, (0, -b.shape[1] % 4, 0, -b.shape[0] % 128))     # (R, C), R % 128 = C % 4 = 0
    R, C = b.shape
    tiles = b.reshape(R // 128, 128, C // 4, 4).permute(0, 2, 1, 3)                # (R/128, C/4, 128, 4)
    tiles = tiles.reshape(R // 128, C // 4, 4, 32, 4).transpose(2, 3)               # row 32 i + k -> 4 k + i
    return tiles.reshape(-1).contiguous()


# ------------------------------------------------------------------------------------------------
# The block-scaled matmul


def mx_matmul_ref(a: tuple, b: tuple, fmt: str) -> torch.Tensor:
    """C = dequantize(A) dequantize(B)^T in fp64, from the quantized operands ``a`` and ``b`` as
    :func:`quantize` returns them: (codes, scales) for MX, (codes, scales, tensor_scale) for NVFP4."""
    if fmt == "nvfp4":
        return dequantize_nvfp4(*a).double() @ dequantize_nvfp4(*b).double().T
    elem, _ = FORMATS[fmt]
    return dequantize_mx(*a, elem).double() @ dequantize_mx(*b, elem).double().T


def quantize(x: torch.Tensor, fmt: str, rule: str = "floor") -> tuple:
    """Operand of :func:`mx_matmul` in ``fmt``: (codes, scales) for the MX formats, E2M1 codes packed two
    per byte; NVFP4 adds its tensor scale. x (rows, K); ``rule`` the MX scale rule."""
    if fmt not in MATMUL_FORMATS:
        raise ValueError(f"fmt must be one of {MATMUL_FORMATS}, got {fmt!r}")
    if fmt == "nvfp4":
        q, s, t = quantize_nvfp4(x)
        return intq.pack_int4(q), s, t
    q, s = quantize_mx(x, FORMATS[fmt][0], rule=rule)
    return (intq.pack_int4(q) if fmt == "mxfp4" else q), s


def unpack(op: tuple, fmt: str) -> tuple:
    """The operand with E2M1 codes unpacked again (for the reference)."""
    return (intq.unpack_int4(op[0]).to(torch.uint8), *op[1:]) if fmt in ("mxfp4", "nvfp4") else op


MATMUL_FORMATS = ("mxfp8", "mxfp4", "nvfp4")
_KERNEL_FMT = {"mxfp8": "e4m3", "mxfp4": "e2m1", "nvfp4": "e2m1"}


@triton.jit
def _decode_codes(c, FMT: tl.constexpr):
    """Element codes (int32) to fp32: (-1)^s (E == 0 ? f : 2^m + f) 2^(max(E, 1) - bias - m)."""
    if FMT == "e2m1":
        e, f, sign = (c >> 1) & 3, c & 1, (c >> 3) & 1
        mag = tl.where(e == 0, f, f + 2).to(tl.float32) * tl.exp2((tl.maximum(e, 1) - 2).to(tl.float32))
    else:  # e4m3 (bias 7, 3 mantissa bits)
        e, f, sign = (c >> 3) & 15, c & 7, (c >> 7) & 1
        mag = tl.where(e == 0, f, f + 8).to(tl.float32) * tl.exp2((tl.maximum(e, 1) - 10).to(tl.float32))
    return tl.where(sign == 1, -mag, mag)


@triton.jit
def _decode_scales(s, NVFP4: tl.constexpr):
    """Scale codes (int32) to fp32: E4M3 for NVFP4, else E8M0 2^(c - 127) with 255 = NaN."""
    if NVFP4:
        return _decode_codes(s, "e4m3")
    return tl.where(s == 255, float("nan"), tl.exp2((s - 127).to(tl.float32)))


@triton.jit
def _mx_matmul_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, alpha_ptr, M, N, K, K_BYTES, K_SCALES,
                      stride_am, stride_sam, stride_bn, stride_sbn, stride_cm,
                      FMT: tl.constexpr, VEC: tl.constexpr, NVFP4: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DECODE: tl.constexpr = False, BROKEN: tl.constexpr = False,
                      ELEMENT_MASK: tl.constexpr = False):
    PACK: tl.constexpr = 2 if FMT == "e2m1" else 1                       # elements per byte
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), M - 1)     # rows past M re-read the last one
    rn = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)     # (never stored)
    kb = tl.arange(0, BLOCK_K // PACK)                                   # bytes of one K step
    ks = tl.arange(0, BLOCK_K // VEC)                                    # scales of one K step
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am                # (BM, 1)
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn                # (1, BN): B^T tile, K down the rows
    sa_rows = sa_ptr + rm.to(tl.int64)[:, None] * stride_sam
    sb_rows = sb_ptr + rn.to(tl.int64)[:, None] * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Masks in units of what is loaded (bytes, scales), against K_BYTES = K / PACK and K_SCALES = K / VEC,
        # which Triton specializes as multiples of 16: it then sees runs of 16 equal mask bits and issues
        # 16-byte cp.async copies. ELEMENT_MASK (broken) counts elements, k0 + 2 kb < K for E2M1: a stride-2
        # left side, no constancy, and the packed operands are loaded one byte at a time.
        kmask = (k0 + kb * PACK < K) if ELEMENT_MASK else (k0 // PACK + kb < K_BYTES)
        smask = (k0 + ks * VEC < K) if ELEMENT_MASK else (k0 // VEC + ks < K_SCALES)
        a = tl.load(a_rows + (k0 // PACK + kb)[None, :], mask=kmask[None, :], other=0)    # (BM, BK/PACK) u8
        b = tl.load(b_cols + (k0 // PACK + kb)[:, None], mask=kmask[:, None], other=0)    # (BK/PACK, BN) u8
        sa = tl.load(sa_rows + (k0 // VEC + ks)[None, :], mask=smask[None, :], other=0.0)  # (BM, BK/VEC)
        sb = tl.load(sb_rows + (k0 // VEC + ks)[None, :], mask=smask[None, :], other=0.0)  # (BN, BK/VEC)
        if DECODE:
            a_c, b_c = a.to(tl.int32), b.to(tl.int32)
            if PACK == 2:                                                # low nibble = element 2j
                a_c = tl.reshape(tl.join(a_c & 15, a_c >> 4), (BLOCK_M, BLOCK_K))
                b_c = tl.reshape(tl.permute(tl.join(b_c & 15, b_c >> 4), (0, 2, 1)), (BLOCK_K, BLOCK_N))
            sa_c, sb_c = sa.to(tl.int32), sb.to(tl.int32)                # NVFP4 scales arrive as their E4M3 bytes
            if BROKEN:                                                   # broken: block 2j's scale for block 2j+1
                sa_c = tl.reshape(tl.broadcast_to(tl.reshape(sa_c, (BLOCK_M, BLOCK_K // VEC // 2, 2))
                                                  .split()[0][:, :, None], (BLOCK_M, BLOCK_K // VEC // 2, 2)),
                                  (BLOCK_M, BLOCK_K // VEC))
            sa_f = _decode_scales(sa_c, NVFP4)                           # (BM, BK/VEC)
            sb_f = _decode_scales(sb_c, NVFP4)                           # (BN, BK/VEC)
            sa_e = tl.reshape(tl.broadcast_to(sa_f[:, :, None], (BLOCK_M, BLOCK_K // VEC, VEC)), (BLOCK_M, BLOCK_K))
            sb_e = tl.reshape(tl.broadcast_to(sb_f[:, :, None], (BLOCK_N, BLOCK_K // VEC, VEC)), (BLOCK_N, BLOCK_K))
            a_f = _decode_codes(a_c, FMT) * sa_e                         # X_a * P_a, (BM, BK)
            b_f = _decode_codes(b_c, FMT) * tl.trans(sb_e)               # X_b * P_b, (BK, BN)
            acc = tl.dot(a_f, b_f, acc, input_precision="ieee")
        else:
            acc = tl.dot_scaled(a, sa, FMT, b, sb, FMT, acc)              # one block-scaled MMA per K step
    acc = acc * tl.load(alpha_ptr)                                       # NVFP4: s_T(A) s_T(B); MX: 1
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


GPU_TILE = (128, 128, 128, 4)      # (BLOCK_M, BLOCK_N, BLOCK_K, warps): spill-free on sm100a (compile_jobs)
DECODE_TILE = (64, 64, 64, 4)      # the DECODE path on a GPU: spill-free on sm80 and sm90a (at GPU_TILE it spills heavily)
CPU_TILE = (32, 32, 64, 4)
GPU_STAGES = {10: 3, 12: 2, 9: 3}  # by compute capability (others: 3); sm120's MXFP8 spills at 3 stages
NATIVE_MAJORS = (10, 12)           # compute capabilities whose tensor cores take block scales


def _check_operand(op, fmt: str, name: str) -> tuple[int, int]:
    """(rows, K) of an operand, or a ValueError naming what is wrong."""
    want = 3 if fmt == "nvfp4" else 2
    if not isinstance(op, tuple) or len(op) != want:
        raise ValueError(f"mx_matmul: {name} must be the tuple quantize(x, {fmt!r}) returns ({want} tensors)")
    codes, scales = op[0], op[1]
    pack, vec = (2 if fmt != "mxfp8" else 1), FORMATS[fmt][1]
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2 or codes.stride(1) != 1:
        raise ValueError(f"mx_matmul: {name} codes must be a 2-D uint8 tensor with unit stride along K")
    rows, k = codes.shape[0], codes.shape[1] * pack
    sdtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    if (not isinstance(scales, torch.Tensor) or scales.dtype != sdtype or tuple(scales.shape) != (rows, k // vec)
            or scales.stride(1) != 1):
        raise ValueError(f"mx_matmul: {name} scales must be {sdtype} of shape ({rows}, {k // vec}) with unit stride, "
                         f"got {getattr(scales, 'dtype', None)} {tuple(getattr(scales, 'shape', ()))}")
    if fmt == "nvfp4" and (op[2].dtype != torch.float32 or op[2].numel() != 1):
        raise ValueError(f"mx_matmul: {name} tensor scale must be a one-element float32 tensor")
    if codes.device.type != runtime.device().type:
        raise ValueError(f"mx_matmul: {name} must be on {runtime.device()}")
    return rows, k


def _launch_args(a, b, c, alpha, fmt: str, *, tile, decode: bool, broken: bool = False, num_stages: int = 1,
                 element_mask: bool = False):
    """(grid, args, kwargs) of one launch of :func:`_mx_matmul_kernel`, shared by :func:`mx_matmul` and
    :func:`launch_job`, so the AOT build is the launch."""
    (M, N), K = c.shape, a[1].shape[1] * FORMATS[fmt][1]
    bm, bn, bk, warps = tile
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    sa, sb = (a[1].view(torch.uint8), b[1].view(torch.uint8)) if decode else (a[1], b[1])   # DECODE reads bytes
    args = (a[0], sa, b[0], sb, c, alpha, M, N, K, a[0].shape[1], a[1].shape[1],     # K, K / PACK, K / VEC
            a[0].stride(0), a[1].stride(0), b[0].stride(0), b[1].stride(0), c.stride(0))
    kwargs = dict(FMT=_KERNEL_FMT[fmt], VEC=FORMATS[fmt][1], NVFP4=fmt == "nvfp4", BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk, DECODE=decode, BROKEN=broken, ELEMENT_MASK=element_mask, num_warps=warps,
                  num_stages=num_stages)
    return grid, args, kwargs


def mx_matmul(a: tuple, b: tuple, fmt: str, *, tile=None, _broken: bool = False) -> torch.Tensor:
    """C = A B^T (M, N) fp32 from A (M, K) and B (N, K), each quantized by :func:`quantize` in ``fmt``
    ("mxfp8", "mxfp4" or "nvfp4"). On a GPU of compute capability 10 (tcgen05.mma) or 12 (block-scaled
    mma.sync) it is ``tl.dot_scaled``; elsewhere (the interpreter, or Hopper, where Triton refuses NVFP4's
    dot_scaled) the kernel's DECODE path, an fp32 ``tl.dot`` on CUDA cores: correct, not fast."""
    if fmt not in MATMUL_FORMATS:
        raise ValueError(f"mx_matmul: fmt must be one of {MATMUL_FORMATS}, got {fmt!r}")
    (M, K), (N, Kb) = _check_operand(a, fmt, "a"), _check_operand(b, fmt, "b")
    if K != Kb:
        raise ValueError(f"mx_matmul: a has K={K}, b has K={Kb}")
    rt = runtime.runtime()
    major = torch.cuda.get_device_capability()[0] if rt.on_gpu else 0
    native = major in NATIVE_MAJORS
    alpha = (a[2] * b[2]).reshape(1) if fmt == "nvfp4" else torch.ones(1, device=a[0].device)
    c = torch.empty((M, N), dtype=torch.float32, device=a[0].device)
    default = (GPU_TILE if native else DECODE_TILE) if rt.on_gpu else CPU_TILE
    grid, args, kwargs = _launch_args(a, b, c, alpha, fmt, tile=tile or default, decode=not native, broken=_broken,
                                      num_stages=GPU_STAGES.get(major, 3) if rt.on_gpu else 1)
    _mx_matmul_kernel[grid](*args, **kwargs)
    return c


# ------------------------------------------------------------------------------------------------
# Compile jobs at a real model's size

# (label, M, N, K): Llama-3-8B's gate/up projection at a 4096-token prefill, and its down projection
REAL_SHAPES = (("Llama-3-8B gate/up prefill", 4096, 14336, 4096), ("Llama-3-8B down prefill", 4096, 4096, 14336))


def launch_job(M: int, N: int, K: int, fmt: str, *, tile=None, num_stages: int | None = None, target="sm100",
               decode: bool = False, _element_mask: bool = False):
    """The job of a launch of :func:`mx_matmul` at (M, N, K) on meta tensors: the native (``tl.dot_scaled``)
    one that compute capability 10 and 12 make, or with ``decode`` the DECODE one that every other GPU makes
    (with :data:`DECODE_TILE`); ``_element_mask`` compiles the broken mask that loads packed operands byte
    by byte."""
    from kernels import inspect as ki

    tile = tile or (DECODE_TILE if decode else GPU_TILE)
    num_stages = GPU_STAGES[ki.parse_arch(target).capability // 10] if num_stages is None else num_stages
    pack, vec = (1 if fmt == "mxfp8" else 2), FORMATS[fmt][1]
    sdtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    a = (torch.empty(M, K // pack, dtype=torch.uint8, device="meta"), torch.empty(M, K // vec, dtype=sdtype, device="meta"))
    b = (torch.empty(N, K // pack, dtype=torch.uint8, device="meta"), torch.empty(N, K // vec, dtype=sdtype, device="meta"))
    c = torch.empty(M, N, dtype=torch.float32, device="meta")
    grid, args, kwargs = _launch_args(a, b, c, torch.empty(1, device="meta"), fmt, tile=tile, decode=decode,
                                      num_stages=num_stages, element_mask=_element_mask)
    return ki.launch_job(_mx_matmul_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs(target: str = "sm100", shapes=REAL_SHAPES) -> dict:
    """The native launch in each format at :data:`REAL_SHAPES`, with ``target``'s stage count. Only
    Blackwell (sm100, sm120) launches it; other GPUs run the DECODE path (:data:`DECODE_TILE`)."""
    jobs = {f"{label}, {fmt}": launch_job(M, N, K, fmt, target=target) for label, M, N, K in shapes
            for fmt in MATMUL_FORMATS}
    for job in jobs.values():
        job.launched_on = ("sm100", "sm120")
    return jobs


_BLOCK_SCALED = re.compile(r"(?:tcgen05\.mma\.cta_group::\d|mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col)"
                           r"\.kind::(\w+)\.block_scale(?:\.scale_vec::(\w+))?")


def block_scaled_mmas(ptx: str) -> list[tuple[str, str]]:
    """(kind, scale_vec) of every block-scaled ``tcgen05.mma`` (sm100) or ``mma.sync`` (sm120) in PTX text,
    e.g. ("mxf4nvf4", "4X")."""
    return [(m.group(1), m.group(2) or "") for m in _BLOCK_SCALED.finditer(ptx)]


_LOAD_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def global_loads(sass: str) -> dict[str, Counter]:
    """Global loads in SASS text by kind and width: {"LDG": Counter(bytes -> count), "LDGSTS": ...,
    "UTMALDG": Counter(tile -> count)}. LDG goes through registers; LDGSTS is cp.async (straight into
    shared memory, what ``num_stages`` pipelines); UTMALDG is a TMA tile copy. LDG.E.U8 is one byte."""
    from kernels import inspect as ki

    out = {"LDG": Counter(), "LDGSTS": Counter(), "UTMALDG": Counter()}
    for op, n in ki.instructions(sass, "sass").items():
        family, *mods = op.split(".")
        if family == "UTMALDG":
            out[family]["tile"] += n
        elif family in ("LDG", "LDGSTS"):
            out[family][max([_LOAD_BYTES[m] for m in mods if m in _LOAD_BYTES] or [4])] += n
    return out


def load_summary(sass: str) -> str:
    """One table cell: e.g. "LDGSTS 16B x32 4B x8" or "LDG 1B x136"."""
    loads = global_loads(sass)
    parts = [f"{kind} " + " ".join(f"{w}B x{n}" for w, n in sorted(c.items(), reverse=True))
             for kind, c in loads.items() if kind != "UTMALDG" and c]
    return "; ".join(parts + ([f"UTMALDG x{loads['UTMALDG']['tile']}"] if loads["UTMALDG"] else []))
