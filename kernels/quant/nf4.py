"""NF4 (QLoRA's 4-bit NormalFloat): a 16-value table built from normal quantiles, one absmax scale
per group, double quantization of the scales, and a W4A16 matmul that looks the codes up in the kernel.

**The table.** Pretrained weights are close to normal, so QLoRA (Dettmers et al., 2023, section 3)
spends the 16 codes on quantiles of N(0, 1), normalized to [-1, 1]. With an even number of codes a
symmetric set has no exact zero, so the type is asymmetric: 2^(k-1) quantiles for the positive half
and 2^(k-1) - 1 for the negative half, plus 0. In bitsandbytes' construction (``create_normal_map``,
bitsandbytes-foundation/bitsandbytes@95f9af3):

    positive  Phi^-1(p) for the first 8 of p = linspace(delta, 1/2, 9)
    negative -Phi^-1(p) for the first 7 of p = linspace(delta, 1/2, 8)
    values    sort(positive + {0} + negative) / max

with delta = 0.9677083, the mean of 1 - 1/(2 * 15) and 1 - 1/(2 * 16) (the outermost quantile level is
pulled in from 1, where Phi^-1 is infinite). :func:`normal_float` computes it in fp32 with the fp64
quantile, and gives bitsandbytes' hard-coded table (``get_4bit_type("nf4")``) bit for bit.

**Codes.** A group of g weights is divided by its absmax and each value takes the code of the nearest
table entry (a value exactly between two entries takes the lower one, as bitsandbytes' ``bucketize``
on the midpoints does): W_hat = absmax * NF4[q].

**Double quantization** (QLoRA section 3): the absmax values (one fp32 per group of 64, 0.5 bits per
weight) are themselves quantized to 8 bits in blocks of 256 after subtracting their mean, leaving
8/64 + 32/(64 * 256) = 0.127 bits per weight. The paper calls the second level 8-bit floats;
bitsandbytes uses its dynamic 8-bit map; here it is E4M3 with one fp32 scale per block
(:mod:`kernels.quant.fp8`'s bit-exact encoder).

**The kernel** is the W4A16 matmul of :mod:`kernels.quant.w4a16` (same tiles, same split-K rule) with
the dequantization replaced by a table lookup: W_nk = absmax_{n, k // g} * T[q_nk]. The 16 fp32 table
entries are loaded once into registers and ``tl.gather`` looks each code up (on sm80/sm90 a warp
shuffle per weight, SHFL in the SASS; a lookup from memory inside the loop compiles to a 4-byte
cp.async per weight instead). Any 16-entry table runs in it (NF4, or E2M1 / 6 for FP4 with absmax scales).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import fp8
from kernels.quant import w4a16
from kernels.quant.intq import pack_int4, unpack_int4

OFFSET = 0.9677083
LOOKUPS = ("registers", "memory")
# bitsandbytes' NF4 table, bitsandbytes/functional.py get_4bit_type("nf4") at commit 95f9af3
BNB_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0)


def normal_float(bits: int = 4, offset: float = OFFSET) -> torch.Tensor:
    """The 2^bits-value NormalFloat table (fp32, ascending), QLoRA's asymmetric construction:
    2^(bits-1) positive quantiles, 2^(bits-1) - 1 negative ones and an exact zero, divided by the largest."""
    if bits < 2 or bits > 8:
        raise ValueError(f"bits must be 2..8, got {bits}")
    if not 0.5 < offset < 1:
        raise ValueError(f"offset must lie in (0.5, 1), got {offset}")
    half = 2 ** (bits - 1)
    levels = lambda n: torch.linspace(offset, 0.5, n)[:-1].double()   # noqa: E731  (fp32 grid, as bnb)
    positive = torch.special.ndtri(levels(half + 1))                 # Phi^-1: half positive values
    negative = -torch.special.ndtri(levels(half))                    # half - 1 negative values
    table = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).float().sort().values
    return table / table.max()


NF4 = normal_float(4)


def _check_groups(w: torch.Tensor, group_size: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {tuple(w.shape)}")
    if group_size < 1 or w.shape[1] % group_size:
        raise ValueError(f"group_size={group_size} must be positive and divide K={w.shape[1]}")


def quantize(w: torch.Tensor, group_size: int = 64, *, table: torch.Tensor = NF4,
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (N, K) uint8 in [0, 16) and absmax scales (N, K / g) in ``scale_dtype``: the nearest
    entry of ``table`` to w / absmax (ties to the lower entry). An all-zero group gets absmax 1."""
    _check_groups(w, group_size)
    N, K = w.shape
    absmax = w.abs().reshape(N, -1, group_size).amax(-1).to(scale_dtype)
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scaled = (w.double() / absmax.double().repeat_interleave(group_size, 1)).clamp(-1, 1)
    t = table.double()
    midpoints = (t[:-1] + t[1:]) / 2
    return torch.bucketize(scaled, midpoints).to(torch.uint8), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, *, table: torch.Tensor = NF4) -> torch.Tensor:
    """W_hat = absmax * T[q], fp32 (N, K)."""
    g = codes.shape[1] // absmax.shape[1]
    return table.float()[codes.long()] * absmax.float().repeat_interleave(g, 1)


def fake_quantize(w: torch.Tensor, group_size: int, *, double_quant: bool = False,
                  scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RTN in NF4 (optionally with double-quantized scales): W quantized and dequantized, W's dtype."""
    codes, absmax = quantize(w, group_size, scale_dtype=scale_dtype)
    if double_quant:
        absmax = double_dequantize(*double_quantize(absmax))
    return dequantize(codes, absmax).to(w.dtype)


# ------------------------------------------------------------------------------------------------
# Double quantization of the scales


def double_quantize(absmax: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The absmax values (any shape) as E4M3 codes: c = absmax - mean, one fp32 scale s2 = max|c| / 448
    per block of ``block`` consecutive values (flattened), q = e4m3(c / s2). Returns (codes uint8 in
    absmax's shape, s2 (blocks,) fp32, mean () fp32)."""
    flat = absmax.float().reshape(-1)
    mean = flat.mean()
    c = flat - mean
    pad = (-c.numel()) % block
    blocks = torch.cat([c, c.new_zeros(pad)]).reshape(-1, block)
    s2 = fp8.amax_scale(blocks.abs().amax(1), "e4m3")                  # max|c| -> 448
    codes = fp8.encode(blocks / s2[:, None], "e4m3").reshape(-1)[: c.numel()]
    return codes.reshape(absmax.shape), s2, mean


def double_dequantize(codes: torch.Tensor, s2: torch.Tensor, mean: torch.Tensor, block: int = 256) -> torch.Tensor:
    """absmax_hat = e4m3_value(q) * s2 + mean, fp32 in the codes' shape."""
    flat = fp8.decode(codes.reshape(-1), "e4m3")
    return (flat * s2.repeat_interleave(block)[: flat.numel()] + mean).reshape(codes.shape)


def bits_per_weight(group_size: int, *, double_quant: bool = False, scale_bits: int = 32, block: int = 256) -> float:
    """4 + 32 / g with fp32 absmax; with double quantization 4 + 8 / g + 32 / (g * block) (the fp32 scale
    per block of scales; the single fp32 mean is left out, it is per tensor)."""
    if double_quant:
        return 4 + 8 / group_size + 32 / (group_size * block)
    return 4 + scale_bits / group_size


# ------------------------------------------------------------------------------------------------
# W4A16 matmul with the table lookup in the kernel


def nf4_matmul_ref(x, w_packed, absmax, group_size, table=NF4):
    """Dequantize W = absmax * T[q] in float64, then X W^T: (M, N) float64."""
    q = unpack_int4(w_packed).long()                                    # (N, K) codes in [0, 16)
    w = table.double()[q] * absmax.double().repeat_interleave(group_size, 1)
    return x.double() @ w.T


@triton.jit
def _nf4_matmul_kernel(x_ptr, wp_ptr, s_ptr, t_ptr, y_ptr, M, N, steps_per_split,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
                       stride_ys, stride_ym, stride_yn,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ONE_SCALE: tl.constexpr, LOOKUP: tl.constexpr = "registers"):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BN,)
    offs_kb = tl.arange(0, BLOCK_K // 2)                               # packed bytes of one K step
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm          # (BM, 1)
    w_rows = wp_ptr + offs_n.to(tl.int64)[:, None] * stride_wn         # (BN, 1)
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn                   # (BN,)
    k_lo = pid_k * (steps_per_split * BLOCK_K)                         # this split's first column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    table = tl.broadcast_to(tl.load(t_ptr + tl.arange(0, 16))[None, :], (BLOCK_N, 16))   # T in registers
    for k0 in range(k_lo, k_lo + steps_per_split * BLOCK_K, BLOCK_K):  # a K step lies inside one group
        x = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)   # (BM, BK)
        p = tl.load(w_rows + (k0 // 2 + offs_kb)[None, :] * stride_wk, mask=n_ok[:, None], other=0)  # (BN, BK/2)
        q = tl.reshape(tl.join((p & 0xF).to(tl.int32), (p >> 4).to(tl.int32)), (BLOCK_N, BLOCK_K))  # k order
        if LOOKUP == "registers":
            t = tl.gather(table, q, 1)                                 # T[q]: the lookup, (BN, BK) fp32
        else:
            t = tl.load(t_ptr + q)                                     # the same lookup from memory
        g = 0 if ONE_SCALE else k0 // GROUP                            # broken variant: group 0's scale always
        s = tl.load(s_rows + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)   # absmax (BN,)
        w = (t * s[:, None]).to(x.dtype)                               # W = absmax * T[q], (BN, BK)
        acc = tl.dot(x, tl.trans(w), acc)                              # (BM, BK) x (BK, BN)
    y_ptrs = (y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym
              + offs_n[None, :] * stride_yn)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x, w_packed, absmax, group_size, table):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16 or fp32 tensor, got {getattr(x, 'dtype', None)} "
                         f"with shape {tuple(getattr(x, 'shape', ()))}")
    if w_packed.dim() != 2 or w_packed.dtype != torch.uint8:
        raise ValueError(f"w_packed must be a 2-D uint8 tensor (two codes per byte), got {w_packed.dtype}")
    M, K = x.shape
    N = w_packed.shape[0]
    if K % 2 or w_packed.shape[1] * 2 != K:
        raise ValueError(f"w_packed must be (N, K / 2) = (N, {K / 2:g}) for x's K={K}, got {tuple(w_packed.shape)}")
    if group_size < 16 or group_size & (group_size - 1) or K % group_size:
        raise ValueError(f"group_size must be a power of two >= 16 dividing K={K}, got {group_size}")
    if absmax.shape != (N, K // group_size) or absmax.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"absmax must be fp16/fp32 of shape (N, K / group_size) = ({N}, {K // group_size}), "
                         f"got {absmax.dtype} {tuple(absmax.shape)}")
    if table.shape != (16,) or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous (16,) float32 tensor, got {table.dtype} {tuple(table.shape)}")
    if len({t.device for t in (x, w_packed, absmax, table)}) != 1:
        raise ValueError("x, w_packed, absmax and table must be on one device")


def _output(x, N: int, split_k: int) -> torch.Tensor:
    """y (M, N) in x's dtype, or the fp32 partials (split_k, M, N) of a split launch."""
    M = x.shape[0]
    if split_k == 1:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    return torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)


def _launch_args(x, w_packed, absmax, table, y, group_size: int, *, tile: w4a16.Tile, split_k: int,
                 one_scale: bool = False, lookup: str = "registers"):
    """(grid, args, kwargs) of one launch of :func:`_nf4_matmul_kernel`, shared by :func:`nf4_matmul`
    and :func:`compile_jobs` (on meta tensors), so the AOT build is the launch."""
    M, K = x.shape
    N = w_packed.shape[0]
    ys = y.stride(0) if split_k > 1 else 0
    ym, yn = (y.stride(1), y.stride(2)) if split_k > 1 else (y.stride(0), y.stride(1))
    bk = w4a16.block_k_for(group_size)
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n), split_k)
    args = (x, w_packed, absmax, table, y, M, N, K // bk // split_k,
            x.stride(0), x.stride(1), w_packed.stride(0), w_packed.stride(1), absmax.stride(0), absmax.stride(1),
            ys, ym, yn)
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
    kwargs = dict(GROUP=group_size, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=bk, ONE_SCALE=one_scale,
                  LOOKUP=lookup, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return grid, args, kwargs


def nf4_matmul(x, w_packed, absmax, group_size: int = 64, *, table: torch.Tensor | None = None,
               tile: w4a16.Tile | None = None, split_k: int | None = None, lookup: str = "registers",
               _one_scale: bool = False):
    """y (M, N) = x @ W^T with W_nk = absmax_{n, k // g} * table[q_nk] looked up in the kernel.

    ``w_packed``: (N, K / 2) uint8 from :func:`kernels.quant.intq.pack_int4` (low nibble = even k);
    ``absmax``: (N, K / g); ``table``: (16,) fp32, default :data:`NF4`. Tiles and split-K follow
    :mod:`kernels.quant.w4a16` (:func:`~kernels.quant.w4a16.tile_for`, :func:`~kernels.quant.w4a16.choose_split_k`).
    ``lookup``: "registers" (the table held in registers, ``tl.gather``) or "memory" (``tl.load`` of the
    table entry per weight). ``_one_scale`` is the broken variant: every K step uses the first group's scale."""
    table = NF4.to(x.device) if table is None else table
    _check(x, w_packed, absmax, group_size, table)
    M, K = x.shape
    N = w_packed.shape[0]
    tile = tile or w4a16.tile_for(M)
    steps = K // w4a16.block_k_for(group_size)
    if split_k is None:
        split_k = w4a16.choose_split_k(M, N, K, group_size, num_sms=w4a16.device_sms(x.device), tile=tile)
    if not isinstance(split_k, int) or split_k < 1 or steps % split_k:
        raise ValueError(f"split_k must be a positive int dividing the {steps} K steps, got {split_k!r}")
    y = _output(x, N, split_k)
    grid, args, kwargs = _launch_args(x, w_packed, absmax, table, y, group_size, tile=tile, split_k=split_k,
                                      one_scale=_one_scale, lookup=lookup)
    _nf4_matmul_kernel[grid](*args, **kwargs)
    return y if split_k == 1 else y.sum(0).to(x.dtype)                # the split's partials, in a fixed order


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in [0, 16) to the kernel's bytes (N, K / 2): :func:`kernels.quant.intq.pack_int4`."""
    return pack_int4(codes)


# ------------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes

# (label, M, N, K): Llama-3-8B (d 4096, SwiGLU 14336) and Llama-3-70B (d 8192, SwiGLU 28672) projections
REAL_SHAPES = (
    ("Llama-3-8B o_proj decode", 1, 4096, 4096),
    ("Llama-3-8B down decode", 1, 4096, 14336),
    ("Llama-3-70B gate/up decode", 1, 28672, 8192),
    ("Llama-3-8B gate/up prefill", 4096, 14336, 4096),
    ("Llama-3-70B down prefill", 4096, 8192, 28672),
)


def launch_job(M: int, N: int, K: int, group_size: int = 64, *, num_sms: int = w4a16.H100_SMS,
               lookup: str = "registers"):
    """The :class:`kernels.inspect.TritonJob` of :func:`nf4_matmul`'s launch at (M, N, K) on meta tensors."""
    from kernels import inspect as ki

    tile = w4a16.tile_for(M)
    split_k = w4a16.choose_split_k(M, N, K, group_size, num_sms=num_sms, tile=tile)
    meta = dict(device="meta")
    x = torch.empty(M, K, dtype=torch.float16, **meta)
    w_packed = torch.empty(N, K // 2, dtype=torch.uint8, **meta)
    absmax = torch.empty(N, K // group_size, dtype=torch.float32, **meta)
    table = torch.empty(16, dtype=torch.float32, **meta)
    y = _output(x, N, split_k)
    grid, args, kwargs = _launch_args(x, w_packed, absmax, table, y, group_size, tile=tile, split_k=split_k,
                                      lookup=lookup)
    return ki.launch_job(_nf4_matmul_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """:data:`REAL_SHAPES` at bitsandbytes' block of 64 (fp16 activations, fp32 absmax), H100 split."""
    return {f"{label}, g64": launch_job(M, N, K) for label, M, N, K in REAL_SHAPES}
