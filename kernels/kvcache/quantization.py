"""KV-cache quantization: the cache stored as low-bit codes with their scales, dequantized inside decode.

A stored element x comes back as

    x_hat = s * c + z          c the code; s the scale, z the zero point (z = 0 for a symmetric grid)

    int8   (symmetric)    c in -127..127,        s = max|x| / 127,               z = 0
    fp8    (E4M3)         c an E4M3 number,      s = max|x| / 448,               z = 0
    asym   (b = 2, 4, 8)  c in 0..2^b - 1,       s = (max x - min x) / (2^b - 1), z = min x
    nvfp4  (E2M1)         c in {0, .5, 1, 1.5, 2, 3, 4, 6} with a sign,
                          s = E4M3(max|x| / 6 / g) * g per 16 channels, g = max|x| over the tensor / 448

NVFP4 (as TensorRT-LLM and FlashInfer store a KV cache) has two levels of scale: an FP8 E4M3 scale per
16 consecutive channels of a token, and one fp32 scale g per tensor (QPages.gscale), here per layer's
K or V pool, from its amax (FlashInfer's default when no calibrated scale is given).

where max and min run over the elements that share one (s, z), chosen by the spec's ``axis``:

* ``"token"``: one (s, z) per token, K/V head and ``group`` consecutive channels (group = the head
  dim by default): the per-token scales of vLLM-style INT8/FP8 caches and of KIVI's values;
* ``"channel"``: one (s, z) per channel over the P tokens of a page (a page is KIVI's token group):
  KIVI's keys, whose outliers sit in fixed channels (Liu et al. 2024);
* ``"head"``: one static s per layer and K/V head, calibrated offline (``head_amax``).

Scales and zero points are stored in fp16, and codes are computed from the fp16-rounded scale, so
the kernel and the reference dequantize the same numbers. Codes of b < 8 bits are packed along the
head dim, 8 / b per byte, element i of a byte at bits i*b .. i*b + b - 1 (low first; b = 4 is
kernels.quant.intq.pack_int4's order).

A scheme pairs a key spec and a value spec with a ``residual`` window: with per-channel keys a page
can be quantized only once it is full, and KIVI keeps the most recent tokens in full precision. For
a sequence of L tokens the first

    Lq = L                                    (per-token schemes without a residual)
    Lq = P * floor(max(L - R, 0) / P)         (otherwise: whole pages older than the R newest tokens)

positions are read from the quantized pages and positions Lq .. L-1 from a float residual buffer.

The kernel, :func:`quant_paged_decode`, is the paged decode of kernels.attention.paged with the
loads replaced: one program per (sequence, K/V head); for each tile of BLOCK_S positions of a page it
loads the codes, the scales and zero points the tile's positions and channels use, dequantizes in
registers and updates the online softmax; then it walks the residual buffer with the same state.

Shapes:
    q                (B, Hq, D)
    QPages.codes     (num_pages, Hkv, P, D * bits / 8)   int8 | uint8 | float8_e4m3fn
    QPages.scale     (num_pages | 1, Hkv, P | 1, D / group | 1) fp16 (size-1 axes broadcast); zero the same
    block_table      (B, max_pages) int32; seqlens, qlens (B,) int32 (0 <= qlens <= seqlens)
    residual k, v    (B, Hkv, R_max, D) float, position Lq_b + j at j
    output           (B, Hq, D) in q's dtype
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.decode import _load_rows_q, _tile_rows
from kernels import runtime
from kernels.attention.paged import LOG2E, check_paged_inputs, gather_pages
from kernels.kvcache.eviction import _finish, _qkv
from kernels.quant import fp8, intq

FORMATS = ("int8", "fp8", "asym", "nvfp4")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)        # FP4 E2M1 magnitudes, codes 0..7 (bit 3: sign)
NVFP4_BLOCK = 16
AXES = ("token", "channel", "head")
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class Spec:
    """How one of K, V is stored: the number format, its bits, the axis its scales run along."""
    fmt: str                    # "int8" | "fp8" | "asym" | "nvfp4"
    bits: int = 8               # 8 for int8 and fp8; 2, 4 or 8 for asym; 4 for nvfp4
    axis: str = "token"         # "token" | "channel" | "head"
    group: int | None = None    # axis "token": channels per scale (None: the whole head)

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"Spec: fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.axis not in AXES:
            raise ValueError(f"Spec: axis must be one of {AXES}, got {self.axis!r}")
        allowed = {"asym": (2, 4, 8), "nvfp4": (4,)}.get(self.fmt, (8,))
        if self.bits not in allowed:
            raise ValueError(f"Spec: {self.fmt} takes bits in {allowed}, got {self.bits}")
        if self.fmt == "nvfp4" and (self.axis, self.group) != ("token", NVFP4_BLOCK):
            raise ValueError(f"Spec: nvfp4 has one scale per {NVFP4_BLOCK} channels of a token: axis 'token', "
                             f"group {NVFP4_BLOCK}; got axis {self.axis!r}, group {self.group}")

    @property
    def has_zero(self) -> bool:
        return self.fmt == "asym"


@dataclass(frozen=True)
class Scheme:
    k: Spec | None              # None: the float cache
    v: Spec | None
    residual: int = 0           # R: newest tokens kept in full precision

    @property
    def per_token(self) -> bool:
        """Every position quantized as it is written (no page statistics, no residual window)."""
        return self.k is not None and self.residual == 0 and "channel" not in (self.k.axis, self.v.axis)


SCHEMES = {
    "float": Scheme(None, None),
    "int8": Scheme(Spec("int8"), Spec("int8")),
    "fp8": Scheme(Spec("fp8"), Spec("fp8")),
    "int8-head": Scheme(Spec("int8", axis="head"), Spec("int8", axis="head")),
    "fp8-head": Scheme(Spec("fp8", axis="head"), Spec("fp8", axis="head")),
    "int4-token": Scheme(Spec("asym", 4), Spec("asym", 4)),
    "int2-token": Scheme(Spec("asym", 2), Spec("asym", 2)),
    "kivi4": Scheme(Spec("asym", 4, "channel"), Spec("asym", 4), residual=32),
    "kivi2": Scheme(Spec("asym", 2, "channel"), Spec("asym", 2), residual=32),
    "nvfp4": Scheme(Spec("nvfp4", 4, group=NVFP4_BLOCK), Spec("nvfp4", 4, group=NVFP4_BLOCK)),
}
# served by the engine: per-token scales computed at write time (NVFP4's per-tensor scale needs calibration)
ENGINE_SCHEMES = tuple(n for n, s in SCHEMES.items()
                       if s.k is None or (s.per_token and s.k.axis == "token" and s.k.fmt != "nvfp4"))


def scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"unknown KV-cache scheme {name!r}; known: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def quantized_len(length: int, page_size: int, sch: Scheme) -> int:
    """Lq: the positions of a length-L sequence read from quantized pages (module docstring)."""
    if sch.k is None:
        return 0
    if sch.per_token:
        return length
    return page_size * (max(length - sch.residual, 0) // page_size)


# ---------------------------------------------------------------- packing

def pack_codes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., D) in 0..2^b - 1 to bytes (..., D * b / 8); b = 8 is the identity."""
    if bits == 8:
        return c
    per = 8 // bits
    if c.shape[-1] % per:
        raise ValueError(f"pack_codes: the last dim {c.shape[-1]} must be a multiple of {per} for {bits}-bit codes")
    w = c.to(torch.int32)
    return sum(w[..., i::per] << (i * bits) for i in range(per)).to(torch.uint8)


def unpack_codes(p: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: bytes (..., D * b / 8) to codes (..., D) as uint8."""
    if bits == 8:
        return p
    w = p.to(torch.int32)
    return torch.stack([(w >> (i * bits)) & (2**bits - 1) for i in range(8 // bits)], -1).flatten(-2).to(torch.uint8)


# ---------------------------------------------------------------- quantize / dequantize pages

@dataclass
class QPages:
    """K or V of a pool of pages as codes plus scales (and zero points): shapes in the module docstring."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: Spec
    gscale: torch.Tensor | None = None       # nvfp4: the fp32 per-tensor scale g, shape ()

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 8 // self.spec.bits

    def select(self, pages: torch.Tensor) -> "QPages":
        """The pages ``pages`` (n,), in that order (broadcast statistics stay as they are)."""
        pick = lambda t: t if t is None or t.shape[0] == 1 else t[pages]    # noqa: E731
        return QPages(self.codes[pages], pick(self.scale), pick(self.zero), self.spec, self.gscale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero, self.gscale)
                   if t is not None)


def _stats(x: torch.Tensor, spec: Spec, head_amax: torch.Tensor | None):
    """(lo, hi) over the elements sharing one scale: (N, Hkv, P, G), (N, Hkv, 1, D) or (1, Hkv, 1, 1)."""
    N, H, P, D = x.shape
    if spec.axis == "token":
        g = spec.group or D
        if D % g:
            raise ValueError(f"quantize_pages: group={g} does not divide the head dim {D}")
        xg = x.unflatten(-1, (D // g, g))                                     # (N, H, P, G, g)
        return xg.amin(-1), xg.amax(-1)
    if spec.axis == "channel":
        return x.amin(2, keepdim=True), x.amax(2, keepdim=True)             # over the page's P tokens
    if head_amax is None or head_amax.shape != (H,):
        raise ValueError(f"quantize_pages: axis 'head' needs head_amax of shape ({H},) from calibration, "
                         f"got {None if head_amax is None else tuple(head_amax.shape)}")
    a = head_amax.float().view(1, H, 1, 1)
    return -a, a


def _wide(t: torch.Tensor, D: int) -> torch.Tensor:
    """A statistic (.., G) broadcast over the D channels of its group."""
    return t.repeat_interleave(D // t.shape[-1], -1) if t.shape[-1] not in (1, D) else t


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """y (float, already divided by its scales) -> uint8 E2M1 codes: the nearest of E2M1_VALUES in
    magnitude (ties to the even code, as round-to-nearest-even does; saturating at 6), sign in bit 3."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    dist = (y.abs().clamp(max=6.0)[..., None] - table).abs()                     # (..., 8)
    dist = dist + 1e-6 * (torch.arange(8) % 2)                                   # a tie goes to the even code
    return (dist.argmin(-1) + 8 * (y < 0)).to(torch.uint8)


def e2m1_values(c: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> their fp32 values."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32)[(c & 7).long()]
    return torch.where(c >= 8, -mag, mag)


def fill_nan_(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NaN canaries: t[mask] = NaN in place, also for an E4M3 tensor (no fp8 masked_fill kernel: its
    byte 0x7F is E4M3's NaN). A kernel that reads a canary returns NaN."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).masked_fill_(mask, 0x7F)
    else:
        t.masked_fill_(mask, float("nan"))
    return t


def _quantize_nvfp4(xf: torch.Tensor, spec: Spec, amax: torch.Tensor) -> QPages:
    """x (N, Hkv, P, D) fp32, amax (N, Hkv, P, D / 16) per block -> codes, E4M3 block scales, gscale."""
    g = (xf.abs().amax() / fp8.E4M3.max).clamp(min=1e-12)                         # g = amax / 448
    s = fp8.quantize(amax / E2M1_VALUES[-1], g)                                   # E4M3(amax_b / 6 / g)
    sw = _wide(s.float(), xf.shape[-1]) * g                                       # the block's step s g
    y = torch.where(sw > 0, xf / torch.where(sw > 0, sw, 1.0), 0.0)
    return QPages(pack_codes(e2m1_codes(y), 4), s, None, spec, g.float())


def quantize_pages(x: torch.Tensor, spec: Spec, head_amax: torch.Tensor | None = None) -> QPages:
    """x (N, Hkv, P, D) float -> QPages (codes, fp16 scale, fp16 zero) as ``spec`` says."""
    if x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_pages: x must be a float (N, Hkv, P, D) tensor, got {x.dtype} {tuple(x.shape)}")
    D = x.shape[-1]
    xf = x.float()
    lo, hi = _stats(xf, spec, head_amax)
    amax = torch.maximum(lo.abs(), hi.abs())
    if spec.fmt == "nvfp4":
        return _quantize_nvfp4(xf, spec, amax)
    if spec.fmt == "int8":
        s = (amax / intq.qrange(8, True)[1]).to(SCALE_DTYPE)                 # s = max|x| / 127
    elif spec.fmt == "fp8":
        s = (amax / fp8.E4M3.max).to(SCALE_DTYPE)                           # s = max|x| / 448
    else:
        s = ((hi - lo) / intq.qrange(spec.bits, False)[1]).to(SCALE_DTYPE)   # s = (max - min) / (2^b - 1)
    s = torch.where(s > 0, s, torch.ones_like(s))                           # a constant group: any s is exact
    sw = _wide(s.float(), D)
    if spec.fmt == "int8":
        return QPages(torch.clamp(torch.round(xf / sw), -127, 127).to(torch.int8), s, None, spec)
    if spec.fmt == "fp8":
        return QPages(fp8.quantize(xf, sw), s, None, spec)                  # clamp to +-448, round to E4M3
    z = lo.to(SCALE_DTYPE)                                                  # z = min x
    c = torch.clamp(torch.round((xf - _wide(z.float(), D)) / sw), 0, 2**spec.bits - 1).to(torch.uint8)
    return QPages(pack_codes(c, spec.bits), s, z, spec)


def dequantize_pages(qp: QPages) -> torch.Tensor:
    """x_hat = s * c + z, fp32 (N, Hkv, P, D) (nvfp4: s * g * E2M1(c))."""
    D = qp.head_dim
    if qp.spec.fmt == "nvfp4":
        return _wide(qp.scale.float(), D) * qp.gscale * e2m1_values(unpack_codes(qp.codes, 4))
    c = unpack_codes(qp.codes, qp.spec.bits) if qp.spec.fmt == "asym" else qp.codes
    x = _wide(qp.scale.float(), D) * c.float()
    if qp.zero is not None:
        x = x + _wide(qp.zero.float(), D)
    return x


def fake_quantize(x: torch.Tensor, spec: Spec | None, head_amax: torch.Tensor | None = None) -> torch.Tensor:
    """x (N, Hkv, P, D) through the cache and back (the identity for the float cache)."""
    return x if spec is None else dequantize_pages(quantize_pages(x, spec, head_amax)).to(x.dtype)


# ---------------------------------------------------------------- the reference decode

def quant_paged_decode_ref(q, kq: QPages, vq: QPages, block_table, seqlens, qlens=None, residual=None, *,
                           compute_dtype: torch.dtype | None = None):
    """Dequantize the pages in PyTorch, gather positions 0..Lq-1 through the table, append the residual
    positions Lq..L-1, attend in fp32 (fp64 for fp64 queries). Returns (B, Hq, D) in q's dtype.
    ``compute_dtype=torch.float16`` is PyTorch's own attention in fp16 over the dequantized cache: the
    baseline of :func:`kernels.testing.assert_close` for the tensor-core variant."""
    B, Hq, D = q.shape
    wide = compute_dtype or torch.promote_types(q.dtype, torch.float32)
    qlens = seqlens if qlens is None else qlens
    k_pages, v_pages = dequantize_pages(kq).to(wide), dequantize_pages(vq).to(wide)   # (pages, Hkv, P, D)
    out = torch.zeros(B, Hq, D, dtype=wide)
    for b in range(B):
        L, Lq = int(seqlens[b]), int(qlens[b])
        if L == 0:
            continue
        ks, vs = gather_pages(k_pages, block_table[b], Lq), gather_pages(v_pages, block_table[b], Lq)
        if L > Lq:
            ks = torch.cat([ks, residual[0][b, :, : L - Lq].to(wide)], 1)
            vs = torch.cat([vs, residual[1][b, :, : L - Lq].to(wide)], 1)
        g = Hq // ks.shape[0]
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)      # (Hq, L, D)
        p = torch.softmax(torch.einsum("hd,hsd->hs", q[b].to(wide), ks) / math.sqrt(D), -1)
        out[b] = torch.einsum("hs,hsd->hd", p, vs)
    return out.to(q.dtype)


# ---------------------------------------------------------------- the kernel

@triton.jit
def _dequant_tile(c_ptr, s_ptr, z_ptr, page, hk, slot, d, mask,
                  stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss, stride_sd, gscale,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FP4: tl.constexpr):
    """x_hat (BLOCK_S, BLOCK_D) fp32 of the rows ``slot`` of one page: the codes (b < 8: byte d // (8/b),
    bits (d mod 8/b) * b), times the scale of the row and channel group d // GROUP, plus the zero point.
    FP4: the 4-bit code is E2M1 (bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa), the scale
    an E4M3 number, and the tile is multiplied by the per-tensor scale ``gscale``."""
    c_off = page * stride_cp + hk * stride_ch + slot[:, None] * stride_cs + (d // (8 // BITS))[None, :]
    raw = tl.load(c_ptr + c_off, mask=mask, other=0.0)
    if BITS == 8:
        code = raw.to(tl.float32)                                        # int8 or E4M3 -> fp32
    elif FP4:
        shift = ((d % 2) * 4)[None, :]
        c4 = (raw.to(tl.int32) >> shift) & 15
        e = (c4 >> 1) & 3                                                # exponent field
        m = (c4 & 1).to(tl.float32)                                      # mantissa bit
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))   # subnormal | normal
        code = tl.where(c4 >= 8, -mag, mag) * gscale                     # sign; g folded into the code
    else:
        shift = ((d % (8 // BITS)) * BITS)[None, :]
        code = ((raw.to(tl.int32) >> shift) & ((1 << BITS) - 1)).to(tl.float32)
    s_off = page * stride_sp + hk * stride_sh + slot[:, None] * stride_ss + (d // GROUP)[None, :] * stride_sd
    x = code * tl.load(s_ptr + s_off, mask=mask, other=0.0).to(tl.float32)        # s c
    if HAS_ZERO:
        x += tl.load(z_ptr + s_off, mask=mask, other=0.0).to(tl.float32)           # + z
    return x


@triton.jit
def _load_group_queries(q_ptr, b, hk, stride_qb, stride_qh, stride_qd, GROUP, D, scale_log2,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The GROUP query heads of K/V head hk (one query each) in fp32, pre-scaled by scale_log2: (BLOCK_G,
    BLOCK_D), rows g >= GROUP and columns d >= D zero (decode's tile rows, decode._tile_rows)."""
    heads, t, row_ok = _tile_rows(hk, GROUP, 1, BLOCK_G, False)
    q = _load_rows_q(q_ptr, b, heads, t, row_ok, stride_qb, stride_qh, 0, stride_qd, D, BLOCK_D)
    return q.to(tl.float32) * scale_log2


@triton.jit
def _online_update(q, k, v, ok, m, l, acc, DOT: tl.constexpr):
    """One tile of the online softmax: scores (BLOCK_G, n) in log2 units; m, l, acc rescaled. DOT: both
    products on tensor cores (the dequantized tiles cast to fp16, fp32 accumulation; BLOCK_G and the
    tile padded to 16), otherwise a 3-D broadcast product reduced on CUDA cores."""
    if DOT:
        scores = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))             # (BLOCK_G, BLOCK_S) fp32
    else:
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    scores = tl.where(ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)                                    # l' = alpha l + sum p
    if DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))    # (BLOCK_G, BLOCK_D)
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l, acc


@triton.jit
def _quant_paged_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, lens_ptr, qlens_ptr, rk_ptr, rv_ptr, o_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kcp, stride_kch, stride_kcs, stride_ksp, stride_ksh, stride_kss, stride_ksd,
    stride_vcp, stride_vch, stride_vcs, stride_vsp, stride_vsh, stride_vss, stride_vsd,
    stride_tb, stride_rb, stride_rh, stride_rs, stride_ob, stride_oh, stride_od,
    D, GROUP, scale_log2, k_gscale, v_gscale,
    PAGE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_ZERO: tl.constexpr, K_FP4: tl.constexpr,
    V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_ZERO: tl.constexpr, V_FP4: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, DOT: tl.constexpr,
):
    """One program per (sequence b, K/V head hk): the quantized tiles of positions 0..Lq-1 through the
    page table, dequantized in registers, then the residual positions Lq..L-1, one online softmax."""
    b = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    L = tl.load(lens_ptr + b).to(tl.int32)
    Lq = tl.load(qlens_ptr + b).to(tl.int32)
    q = _load_group_queries(q_ptr, b, hk, stride_qb, stride_qh, stride_qd, GROUP, D, scale_log2, BLOCK_G, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for t in range(0, tl.cdiv(Lq, BLOCK_S)):                    # quantized tiles (BLOCK_S divides PAGE)
        i = (t * BLOCK_S) // PAGE
        page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + i).to(tl.int64)
        slot = t * BLOCK_S - i * PAGE + s                         # rows of the tile inside its page
        ok = t * BLOCK_S + s < Lq
        mask = ok[:, None] & d_ok[None, :]
        k = _dequant_tile(kc_ptr, ks_ptr, kz_ptr, page, hk, slot, d, mask, stride_kcp, stride_kch, stride_kcs,
                          stride_ksp, stride_ksh, stride_kss, stride_ksd, k_gscale, K_BITS, K_GROUP, K_ZERO, K_FP4)
        v = _dequant_tile(vc_ptr, vs_ptr, vz_ptr, page, hk, slot, d, mask, stride_vcp, stride_vch, stride_vcs,
                          stride_vsp, stride_vsh, stride_vss, stride_vsd, v_gscale, V_BITS, V_GROUP, V_ZERO, V_FP4)
        m, l, acc = _online_update(q, k, v, ok, m, l, acc, DOT)
    if HAS_RESIDUAL:
        base = b.to(tl.int64) * stride_rb + hk * stride_rh
        for r0 in range(0, L - Lq, BLOCK_S):                      # full-precision positions Lq + j
            ok = r0 + s < L - Lq
            mask = ok[:, None] & d_ok[None, :]
            off = base + (r0 + s)[:, None] * stride_rs + d[None, :]
            k = tl.load(rk_ptr + off, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(rv_ptr + off, mask=mask, other=0.0).to(tl.float32)
            m, l, acc = _online_update(q, k, v, ok, m, l, acc, DOT)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    g = tl.arange(0, BLOCK_G)
    offs = b.to(tl.int64) * stride_ob + (hk * GROUP + g)[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & d_ok[None, :])


BROKEN = (None, "scale-per-head", "no-zero-point")

# The CUDA-core path's tile: its per-tile product q[:, None, :] * k[None, :, :] holds group x BLOCK_S x D
# fp32 values over 128 threads; the float paged kernel kept that at 8192 when it reduced on CUDA cores
# (168 registers at group 4, BLOCK_S 16, D 128 on sm_90a), and this kernel halves it (below).
GPU_PRODUCT_ELEMENTS = 8192


def gpu_block_s(group: int, head_dim: int) -> int:
    """The largest power of two BLOCK_S with next_pow2(group) * BLOCK_S * next_pow2(head_dim) <=
    GPU_PRODUCT_ELEMENTS, between 8 and 128."""
    per_position = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim)
    fits = max(1, GPU_PRODUCT_ELEMENTS // per_position)
    return max(8, min(128, 1 << (fits.bit_length() - 1)))      # largest power of two <= fits


def gpu_block_s_quant(group: int, head_dim: int, page_size: int) -> int:
    """The GPU tile of the CUDA-core path: half of :func:`gpu_block_s`, since the codes, the scales
    and the dequantized K and V tiles need registers of their own (at Llama-3-8B's shape BLOCK_S = 16
    takes 255 registers per thread, the ceiling; 8 takes about half: tests/test_kv_quantization.py), capped by
    the page."""
    return max(1, min(page_size, gpu_block_s(group, head_dim) // 2))


def default_block_s(group: int, head_dim: int, page_size: int) -> int:
    """The whole page under the interpreter (fewer iterations), :func:`gpu_block_s_quant` on a GPU."""
    return page_size if runtime.runtime().interpreted else gpu_block_s_quant(group, head_dim, page_size)


def _stat_strides(t: torch.Tensor, pages: int, P: int, broken: str | None) -> tuple[int, int, int, int]:
    """Strides of a statistic broadcast to (pages, Hkv, P, G): 0 along its size-1 axes. The broken
    variant ``scale-per-head`` reads every row and page with the scale of page 0, row 0."""
    st = list(t.expand(pages, t.shape[1], P, t.shape[3]).stride())
    if broken == "scale-per-head":
        st[0] = st[2] = 0
    return tuple(st)


def _shape_only(q, qp: QPages) -> torch.Tensor:
    """A zero-stride float tensor of the pages' logical shape, for the shared shape checks."""
    return q.new_zeros(()).expand(*qp.codes.shape[:3], qp.head_dim)


def check_inputs(q, kq, vq, block_table, seqlens, qlens, residual, name: str = "quant_paged_decode") -> None:
    if not isinstance(kq, QPages) or not isinstance(vq, QPages):
        raise TypeError(f"{name}: k and v must be QPages (quantize_pages), got {type(kq).__name__}, {type(vq).__name__}")
    if not isinstance(seqlens, torch.Tensor) or seqlens.shape != (q.shape[0],) or \
            seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: seqlens must be a (B,)=({q.shape[0]},) int32/int64 tensor")
    if not isinstance(qlens, torch.Tensor) or qlens.shape != seqlens.shape or bool((qlens > seqlens).any()) \
            or bool((qlens < 0).any()):
        raise ValueError(f"{name}: qlens must be (B,) with 0 <= qlens <= seqlens")
    # the pages hold positions 0..Lq-1: the table and the page pool are checked against qlens
    check_paged_inputs(q, _shape_only(q, kq), _shape_only(q, vq), block_table, qlens, None, name=name)
    for arg, qp in (("k", kq), ("v", vq)):
        if qp.scale.dim() != 4 or (qp.zero is not None) != qp.spec.has_zero or \
                (qp.zero is not None and qp.zero.stride() != qp.scale.stride()):
            raise ValueError(f"{name}: {arg}'s scale must be 4-D, with a zero point of the same layout exactly "
                             f"when the format is asym ({qp.spec})")
        if not qp.codes.is_contiguous():
            raise ValueError(f"{name}: {arg}.codes must be contiguous")
        if (qp.gscale is not None) != (qp.spec.fmt == "nvfp4"):
            raise ValueError(f"{name}: {arg}.gscale (the per-tensor scale) is given exactly when the format is nvfp4")
    if bool((qlens < seqlens).any()):
        B, Hkv = q.shape[0], kq.codes.shape[1]
        if residual is None or residual[0].shape != residual[1].shape or residual[0].dim() != 4 \
                or residual[0].shape[:2] != (B, Hkv) or residual[0].shape[3] != q.shape[2] \
                or residual[0].shape[2] < int((seqlens - qlens).max()) or residual[0].stride(3) != 1:
            raise ValueError(f"{name}: positions qlens..seqlens-1 need residual (k, v), each (B={B}, Hkv={Hkv}, "
                             f">= {int((seqlens - qlens).max())}, D) with unit stride along D")


def _gscale(qp: QPages) -> float:
    """The per-tensor scale as a launch argument: 1.0 where there is none (and for meta tensors)."""
    return 1.0 if qp.gscale is None or qp.gscale.is_meta else float(qp.gscale)


def _args(q, kq: QPages, vq: QPages, table, seqlens, qlens, residual, out, *, block_s: int, broken: str | None = None,
          tensor_cores: bool = False):
    """(grid, args, kwargs) of one launch, shared by :func:`quant_paged_decode` and :func:`launch_job`."""
    B, Hq, D = q.shape
    pages, Hkv, P, _ = kq.codes.shape
    rk, rv = residual if residual is not None else (q, q)             # unread without a residual
    pointers, strides = [], []
    for qp in (kq, vq):
        pointers += [qp.codes, qp.scale, qp.zero if qp.zero is not None else qp.scale]
        strides += [*qp.codes.stride()[:3], *_stat_strides(qp.scale, pages, P, broken)]
    args = (q, *pointers, table, seqlens, qlens, rk, rv, out,
            *q.stride(), *strides, table.stride(0), *(rk.stride()[:3] if residual is not None else (0, 0, 0)),
            *out.stride(), D, Hq // Hkv, LOG2E / math.sqrt(D), _gscale(kq), _gscale(vq))

    def group(qp):                                  # channels per scale: 1 per channel, D per token
        return D // qp.scale.shape[-1]

    def zero(qp):
        return qp.zero is not None and broken != "no-zero-point"

    block_g = triton.next_power_of_2(Hq // Hkv)
    kwargs = dict(PAGE=P, BLOCK_S=block_s, BLOCK_G=max(16, block_g) if tensor_cores else block_g,   # tl.dot: M >= 16
                  BLOCK_D=triton.next_power_of_2(D),
                  K_BITS=kq.spec.bits, K_GROUP=group(kq), K_ZERO=zero(kq), K_FP4=kq.spec.fmt == "nvfp4",
                  V_BITS=vq.spec.bits, V_GROUP=group(vq), V_ZERO=zero(vq), V_FP4=vq.spec.fmt == "nvfp4",
                  HAS_RESIDUAL=residual is not None, DOT=tensor_cores)
    return (B, Hkv), args, kwargs


def quant_paged_decode(q, kq: QPages, vq: QPages, block_table, seqlens, qlens=None, residual=None, *,
                       block_s: int | None = None, tensor_cores: bool = False, _broken: str | None = None) -> torch.Tensor:
    """Decode attention over quantized pages (and a float residual): shapes in the module docstring.
    ``tensor_cores``: both products by tl.dot on fp16 casts of the dequantized tiles (tiles of at least
    16 positions, the group padded to 16 rows). ``_broken`` ("scale-per-head", "no-zero-point")
    launches a deliberately wrong variant for the tests."""
    if _broken not in BROKEN:
        raise ValueError(f"quant_paged_decode: _broken must be one of {BROKEN}, got {_broken!r}")
    qlens = seqlens if qlens is None else qlens
    check_inputs(q, kq, vq, block_table, seqlens, qlens, residual)
    B, Hq, D = q.shape
    out = torch.empty_like(q)
    if B == 0:
        return out
    P = kq.codes.shape[2]
    if block_s is not None and (block_s < 1 or block_s & (block_s - 1) or block_s > P):
        raise ValueError(f"quant_paged_decode: block_s must be a power of two <= page_size={P}, got {block_s!r}")
    block_s = block_s or (P if tensor_cores else default_block_s(Hq // kq.codes.shape[1], D, P))
    if tensor_cores and (block_s < 16 or D < 16):
        raise ValueError(f"quant_paged_decode: tensor_cores needs tiles of >= 16 positions and a head dim >= 16 "
                         f"(tl.dot's smallest operand), got block_s={block_s}, D={D}")
    grid, args, kwargs = _args(q, kq, vq, block_table.contiguous(), seqlens, qlens.to(seqlens.dtype),
                               residual if bool((qlens < seqlens).any()) else None, out,
                               block_s=block_s, broken=_broken, tensor_cores=tensor_cores)
    _quant_paged_decode_kernel[grid](*args, **kwargs)
    return out


# ---------------------------------------------------------------- the cache the engine serves from

class QuantizedPagedKVCache:
    """kernels.serving.kv_cache.PagedKVCache's interface (write / gather / decode / copy / nbytes) over
    pools of codes and per-token scales: a per-token scheme (``ENGINE_SCHEMES``), each position
    quantized as it is written. Prefill chunks attend to the dequantized cache, as decode does."""

    def __init__(self, n_layer: int, num_pages: int, n_kv_head: int, page_size: int, head_dim: int,
                 scheme_name: str = "int8", *, device=None):
        sch = scheme(scheme_name)
        if scheme_name not in ENGINE_SCHEMES or sch.k is None:
            raise ValueError(f"QuantizedPagedKVCache: scheme {scheme_name!r} is not served by the engine; it "
                             f"serves the per-token schemes {', '.join(n for n in ENGINE_SCHEMES if n != 'float')}")
        self.scheme, self.page_size = sch, page_size
        empty = torch.zeros(num_pages, n_kv_head, page_size, head_dim, device=device)
        self.k = [quantize_pages(empty, sch.k) for _ in range(n_layer)]      # QPages per layer
        self.v = [quantize_pages(empty, sch.v) for _ in range(n_layer)]

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, Hkv, D) of N new positions, quantized per token, into slots (pages[i], offsets[i])."""
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            new = quantize_pages(x[:, :, None], pool.spec)                  # (N, Hkv, 1, .)
            for t, u in ((pool.codes, new.codes), (pool.scale, new.scale), (pool.zero, new.zero)):
                if t is not None:
                    t[pages, :, offsets] = u[:, :, 0]

    def gather(self, layer: int, table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of one sequence, dequantized: k, v (Hkv, length, D) fp32."""
        n = -(-length // self.page_size)
        rows = table_row[:n].long()
        return tuple(gather_pages(dequantize_pages(pool.select(rows)), torch.arange(n), length)
                     for pool in (self.k[layer], self.v[layer]))

    def decode(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor, *,
               use_kernels: bool) -> torch.Tensor:
        attend = quant_paged_decode if use_kernels else quant_paged_decode_ref
        return attend(q, self.k[layer], self.v[layer], block_table, lens)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Page src -> page dst, codes and scales, in every layer (gathered before written)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for qp in self.k + self.v:
            for t in (qp.codes, qp.scale, qp.zero):
                if t is not None:
                    t[dst] = t[src]

    def nbytes(self) -> int:
        return sum(qp.nbytes() for qp in self.k + self.v)


def engine_cache(scheme_name: str):
    """The cache factory ``EngineConfig(kv_cache=engine_cache("int8"))`` takes: (n_layer, num_pages,
    n_kv_head, page_size, head_dim) -> a :class:`QuantizedPagedKVCache` of that scheme. An unknown
    name, or a scheme the engine cannot serve, is refused here, naming it and those it can serve."""
    if scheme_name == "float":
        raise ValueError("engine_cache: float pages are the engine's default: leave EngineConfig.kv_cache as None")
    if scheme_name not in SCHEMES:
        raise ValueError(f"engine_cache: unknown scheme {scheme_name!r}; the engine serves "
                         f"{', '.join(n for n in ENGINE_SCHEMES if n != 'float')}")
    if scheme_name not in ENGINE_SCHEMES or SCHEMES[scheme_name].k is None:
        raise ValueError(f"engine_cache: scheme {scheme_name!r} is not served by the engine; it serves the "
                         f"per-token schemes {', '.join(n for n in ENGINE_SCHEMES if n != 'float')}")

    def make(n_layer: int, num_pages: int, n_kv_head: int, page_size: int, head_dim: int) -> QuantizedPagedKVCache:
        return QuantizedPagedKVCache(n_layer, num_pages, n_kv_head, page_size, head_dim, scheme_name)
    return make


# ---------------------------------------------------------------- the tiny GPT with a quantized cache

def _paged(x: torch.Tensor, P: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> pages (B * n, Hkv, P, D), T padded with zeros to n * P."""
    B, H, T, D = x.shape
    n = -(-T // P)
    x = torch.nn.functional.pad(x, (0, 0, 0, n * P - T))
    return x.view(B, H, n, P, D).transpose(1, 2).reshape(B * n, H, P, D).contiguous()


def _unpaged(pages: torch.Tensor, B: int, T: int) -> torch.Tensor:
    _, H, P, D = pages.shape
    return pages.view(B, -1, H, P, D).transpose(1, 2).reshape(B, H, -1, D)[:, :, :T]


def cache_view(k: torch.Tensor, v: torch.Tensor, sch: Scheme, page_size: int = 16, head_amax=None):
    """What a decode step reads back of k, v (B, Hkv, T, D): each position through the cache (per-channel
    statistics over its page). ``head_amax`` (2, Hkv): calibrated K and V amax of this layer."""
    B, _, T, _ = k.shape
    ka, va = (None, None) if head_amax is None else head_amax
    return tuple(_unpaged(fake_quantize(_paged(x, page_size), spec, a), B, T)
                 for x, spec, a in ((k, sch.k, ka), (v, sch.v, va)))


@torch.no_grad()
def quantized_forward(model, idx: torch.Tensor, sch: Scheme, page_size: int = 16, head_amax=None,
                      kv_out: list | None = None) -> torch.Tensor:
    """Logits (B, T, V) when every position t is predicted as a decode step at cache length t + 1 would
    predict it: key/value j is read dequantized if j < Lq(t + 1), else in full precision (the residual).
    One masked forward, equal to the token-by-token decode (tests/test_kv_quantization.py).
    ``head_amax`` (n_layer, 2, Hkv) for the per-head schemes; ``kv_out`` collects each layer's float (k, v)."""
    cfg = model.config
    B, T = idx.shape
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    g = Hq // Hkv
    pos = torch.arange(T)
    lq = torch.tensor([quantized_len(t + 1, page_size, sch) for t in range(T)])        # (T,)
    causal = pos[None, :] <= pos[:, None]                                               # (T, T)
    from_q = pos[None, :] < lq[:, None]                                                 # key j dequantized for row i
    x = model.wte(idx)
    for layer, blk in enumerate(model.blocks):
        q, k, v = _qkv(blk, x, pos, cfg)                                                # (B, H, T, D)
        if kv_out is not None:
            kv_out.append((k, v))
        kh, vh = cache_view(k, v, sch, page_size, None if head_amax is None else head_amax[layer])
        rep = lambda t: t.repeat_interleave(g, 1)                                       # noqa: E731
        scores = torch.where(from_q, q @ rep(kh).transpose(-1, -2), q @ rep(k).transpose(-1, -2)) / math.sqrt(D)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)           # (B, Hq, T, T)
        out = (probs * from_q) @ rep(vh) + (probs * ~from_q) @ rep(v)
        x = _finish(blk, x, out, cfg)
    return model.norm_f(x) @ model.wte.weight.T


@torch.no_grad()
def stream_decode(model, ids: torch.Tensor, sch: Scheme, page_size: int = 16, *, attend=None,
                  head_amax=None) -> torch.Tensor:
    """The same, token by token, as a server runs it: each layer keeps its float history only to build
    the pages; pages 0..ceil(Lq / P) - 1 are quantized (per-channel pages once full: their codes never
    change), the positions Lq..L-1 form the residual, and ``attend`` (default :func:`quant_paged_decode_ref`;
    :func:`quant_paged_decode` is the kernel) attends over them. ids (T,) -> logits (T, V)."""
    cfg = model.config
    attend = attend or quant_paged_decode_ref
    Hkv, D = cfg.n_kv_head, cfg.head_dim
    hist = [[torch.zeros(1, Hkv, 0, D), torch.zeros(1, Hkv, 0, D)] for _ in model.blocks]
    logits = []
    for t in range(ids.shape[0]):
        L, Lq = t + 1, quantized_len(t + 1, page_size, sch)
        x = model.wte(ids[None, t:t + 1])
        for layer, blk in enumerate(model.blocks):
            q, k, v = _qkv(blk, x, torch.tensor([t]), cfg)
            h = hist[layer]
            h[0], h[1] = torch.cat([h[0], k], 2), torch.cat([h[1], v], 2)               # (1, Hkv, L, D)
            n = max(-(-Lq // page_size), 1)
            ka, va = (None, None) if head_amax is None else head_amax[layer]
            kq = quantize_pages(_paged(h[0][:, :, :n * page_size], page_size)[:n], sch.k, ka)
            vq = quantize_pages(_paged(h[1][:, :, :n * page_size], page_size)[:n], sch.v, va)
            res = (h[0][:, :, Lq:].contiguous(), h[1][:, :, Lq:].contiguous())
            out = attend(q[:, :, 0], kq, vq, torch.arange(n, dtype=torch.int32)[None], torch.tensor([L], dtype=torch.int32),
                         torch.tensor([Lq], dtype=torch.int32), res)                     # (1, Hq, D)
            x = _finish(blk, x, out[:, :, None], cfg)
        logits.append((model.norm_f(x) @ model.wte.weight.T)[0, 0])
    return torch.stack(logits)


def calibrate_head_amax(model, idx: torch.Tensor) -> torch.Tensor:
    """Per layer and K/V head, the largest |k| and |v| over calibration windows idx (B, T) run with the
    float cache: (n_layer, 2, Hkv), the static scales of the per-head schemes."""
    kv = []
    quantized_forward(model, idx, SCHEMES["float"], kv_out=kv)
    return torch.stack([torch.stack([t.abs().amax(dim=(0, 2, 3)) for t in pair]) for pair in kv])


# ---------------------------------------------------------------- bytes

def bytes_per_token(sch: Scheme, n_layer: int, n_kv_head: int, head_dim: int, page_size: int = 16,
                    float_bytes: int = 2) -> float:
    """K and V of one token over all layers: codes plus its share of the fp16 scales and zero points
    (per token: D / group of each; per channel: D of each per page of P tokens; per head: ~0; nvfp4:
    one E4M3 byte per 16 channels, the per-tensor fp32 scale ~0). The float residual window is per
    sequence, not per token, and is not included."""
    def one(spec):
        if spec is None:
            return head_dim * float_bytes
        stats = 1 if spec.fmt == "nvfp4" else 2 * (1 + spec.has_zero)       # E4M3 scale | fp16 scale (+ zero)
        per = {"token": head_dim // (spec.group or head_dim), "channel": head_dim / page_size, "head": 0}[spec.axis]
        return head_dim * spec.bits / 8 + stats * per
    return n_layer * n_kv_head * (one(sch.k) + one(sch.v))


# ---------------------------------------------------------------- compile jobs at a real model's size

REAL_CONFIGS = (("Llama-3-8B", 32, 8, 128),)


def launch_job(hq: int, hkv: int, head_dim: int, name: str, *, batch: int = 32, context: int = 8192,
               page_size: int = 16, residual: int = 32, block_s: int | None = None, tensor_cores: bool = False,
               target: str = "sm90"):
    """The GPU launch of :func:`quant_paged_decode` for scheme ``name`` on meta tensors: ``batch``
    sequences of ``context`` positions in ``page_size`` pages, fp16 queries, int32 tables; with a
    residual window, a (batch, Hkv, residual + page_size, D) fp16 residual buffer. ``block_s`` defaults
    to :func:`gpu_block_s_quant`."""
    from kernels import inspect as ki

    sch = scheme(name)
    pages = batch * -(-context // page_size)
    meta = dict(device="meta")
    q = torch.empty(batch, hq, head_dim, dtype=torch.float16, **meta)

    def qpages(spec):
        codes_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "asym": torch.uint8, "nvfp4": torch.uint8}[spec.fmt]
        codes = torch.empty(pages, hkv, page_size, head_dim * spec.bits // 8, dtype=codes_dtype, **meta)
        shape = {"token": (pages, hkv, page_size, head_dim // (spec.group or head_dim)),
                 "channel": (pages, hkv, 1, head_dim), "head": (1, hkv, 1, 1)}[spec.axis]
        if spec.fmt == "nvfp4":
            return QPages(codes, torch.empty(shape, dtype=torch.float8_e4m3fn, **meta), None, spec,
                          torch.empty((), dtype=torch.float32, **meta))
        stat = torch.empty(shape, dtype=SCALE_DTYPE, **meta)
        return QPages(codes, stat, torch.empty(shape, dtype=SCALE_DTYPE, **meta) if spec.has_zero else None, spec)

    table = torch.empty(batch, pages // batch, dtype=torch.int32, **meta)
    lens = torch.empty(batch, dtype=torch.int32, **meta)
    res = None
    if not sch.per_token:
        res = tuple(torch.empty(batch, hkv, residual + page_size, head_dim, dtype=torch.float16, **meta) for _ in "kv")
    block_s = block_s or gpu_block_s_quant(hq // hkv, head_dim, page_size)
    grid, args, kwargs = _args(q, qpages(sch.k), qpages(sch.v), table, lens, lens, res, torch.empty_like(q),
                               block_s=block_s, tensor_cores=tensor_cores)
    return ki.launch_job(_quant_paged_decode_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama-3-8B (32 q heads, 8 K/V heads, D = 128), batch 32, 8k positions in 16-position pages: int8,
    fp8, KIVI-2 and NVFP4 at the GPU tile, and int8 at the float kernel's tile of 16 for comparison,
    with the broadcast product and with tl.dot."""
    jobs = {}
    for label, hq, hkv, d in REAL_CONFIGS:
        bs = gpu_block_s_quant(hq // hkv, d, 16)
        for name in ("int8", "fp8", "kivi2", "nvfp4"):
            jobs[f"{label}, {name}, BLOCK_S {bs}"] = launch_job(hq, hkv, d, name)
        jobs[f"{label}, int8, BLOCK_S 16"] = launch_job(hq, hkv, d, "int8", block_s=16)
        jobs[f"{label}, int8, BLOCK_S 16, tl.dot"] = launch_job(hq, hkv, d, "int8", block_s=16, tensor_cores=True)
    return jobs
