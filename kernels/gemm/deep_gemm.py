"""DeepGEMM-style FP8 GEMM with fine-grained scaling: C = A @ W^T from E4M3 codes with one scale per
1x128 slice of each activation row and one per 128x128 block of the weight (DeepSeek-V3, sec. 3.3).

Per-tensor scaling lets one outlier set the scale of a whole tensor. With a scale per 128 columns of
a row of A (``scale_a``: (M, ceil(K/128))) and per 128x128 block of W (``scale_w``:
(ceil(N/128), ceil(K/128))), an outlier only coarsens its own slice. The scales differ along K, so
they cannot be applied once at the end: the kernel multiplies each 128-wide K block on the tensor
cores into a fresh fp32 partial, then adds ``partial * s_a[m] * s_w`` into the running fp32 sum on
the CUDA cores. That add is also the "promotion" DeepSeek-V3 describes: Hopper's FP8 tensor cores
accumulate with about 14 bits of precision, so long K sums are moved to full fp32 every 128
elements. ``accumulate_emulated`` reproduces the error growth without and with promotion on a CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.quant.fp8 import E4M3

GROUP = 128   # elements of K per scale
# (BLOCK_M, BLOCK_N) on a GPU, from the build a launch compiles (launch_job at DeepSeek-V3's sizes):
# 128x128 at 8 warps holds the running sum and the per-block partial in 179 registers on sm90a, no
# spills, 3 cp.async stages in 96 KiB (tests/test_deep_gemm.py). An earlier 128x64 rested on a build
# with no divisibility hints (255 registers, 45 spills), which no GPU launch compiles.
GPU_TILE = (128, 128)
CPU_TILE = (64, 64)


def block_scale(amax: torch.Tensor, *, ue8m0: bool = False) -> torch.Tensor:
    """The scale that maps a block's amax to E4M3's 448; 1 for an all-zero block. ``ue8m0=True``
    rounds it up to a power of two, the only scales UE8M0 (8 exponent bits, no mantissa) can hold,
    as DeepGEMM's sm100 kernels take them: amax / scale then lies in (224, 448], never above 448."""
    scale = torch.where(amax > 0, amax / E4M3.max, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(scale))) if ue8m0 else scale


def quantize_blockwise(a: torch.Tensor, w: torch.Tensor, *, ue8m0: bool = False):
    """E4M3 codes and scales: A (M, K) per 1x128 slice, W (N, K) per 128x128 block (amax -> 448, or
    the power of two just above with ``ue8m0``). Returns (a_q, scale_a (M, K/128), w_q,
    scale_w (N/128, K/128)), quantized in PyTorch."""
    M, K = a.shape
    N = w.shape[0]
    kb, nb = -(-K // GROUP), -(-N // GROUP)
    a_pad = torch.zeros(M, kb * GROUP, dtype=torch.float32, device=a.device)
    a_pad[:, :K] = a.float()
    amax_a = a_pad.view(M, kb, GROUP).abs().amax(-1)                               # (M, kb)
    scale_a = block_scale(amax_a, ue8m0=ue8m0)
    a_q = (a_pad.view(M, kb, GROUP) / scale_a[..., None]).view(M, -1)[:, :K].to(torch.float8_e4m3fn)
    w_pad = torch.zeros(nb * GROUP, kb * GROUP, dtype=torch.float32, device=w.device)
    w_pad[:N, :K] = w.float()
    amax_w = w_pad.view(nb, GROUP, kb, GROUP).abs().amax(dim=(1, 3))                # (nb, kb)
    scale_w = block_scale(amax_w, ue8m0=ue8m0)
    w_q = (w_pad.view(nb, GROUP, kb, GROUP) / scale_w[:, None, :, None]).view(nb * GROUP, -1)[:N, :K]
    return a_q, scale_a, w_q.to(torch.float8_e4m3fn), scale_w


def dequantize_blockwise(a_q, scale_a, w_q, scale_w):
    """The fp32 tensors the codes and scales stand for."""
    a = a_q.float() * scale_a.repeat_interleave(GROUP, dim=1)[:, : a_q.shape[1]]
    s = scale_w.repeat_interleave(GROUP, dim=0).repeat_interleave(GROUP, dim=1)
    return a, w_q.float() * s[: w_q.shape[0], : w_q.shape[1]]


def deep_gemm_ref(a_q, scale_a, w_q, scale_w, out_dtype=torch.bfloat16):
    """Dequantize, then C = A @ W^T in fp32, cast once."""
    a, w = dequantize_blockwise(a_q, scale_a, w_q, scale_w)
    return (a @ w.t()).to(out_dtype)


@triton.jit
def _deep_gemm_kernel(a_ptr, w_ptr, c_ptr, sa_ptr, sw_ptr, M, N, K,
                      stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                      stride_sam, stride_sak, stride_swn, stride_swk,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PER_BLOCK_SCALES: tl.constexpr = True):
    row0, col0 = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    r, c, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    rr = tl.minimum(r, M - 1 - row0)                                     # clamped rows (never stored)
    cc = tl.minimum(c, N - 1 - col0)
    a_ptr += row0.to(tl.int64) * stride_am
    w_ptr += col0.to(tl.int64) * stride_wn
    a_offs = rr[:, None] * stride_am + ks[None, :] * stride_ak          # (BLOCK_M, BLOCK_K)
    w_offs = ks[:, None] * stride_wk + cc[None, :] * stride_wn          # (BLOCK_K, BLOCK_N): W^T tile
    sa_rows = sa_ptr + (row0 + rr).to(tl.int64) * stride_sam            # (BLOCK_M,) this tile's activation scales
    sw_blk = sw_ptr + (col0 // 128) * stride_swn                        # the weight block row: 128 % BLOCK_N == 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptr + a_offs, mask=ks[None, :] < K - kb * BLOCK_K, other=0.0)
        w = tl.load(w_ptr + w_offs, mask=ks[:, None] < K - kb * BLOCK_K, other=0.0)
        partial = tl.dot(a, w)                                          # this K block, fp8 x fp8 -> fp32
        kk = kb if PER_BLOCK_SCALES else 0                              # broken: block 0's scales for every block
        s_a = tl.load(sa_rows + kk * stride_sak)                        # (BLOCK_M,)
        s_w = tl.load(sw_blk + kk * stride_swk)                         # scalar
        acc += partial * (s_a[:, None] * s_w)                           # promote: C += s_a s_w (A_kb W_kb^T)
        a_ptr += BLOCK_K * stride_ak
        w_ptr += BLOCK_K * stride_wk
    c_ptr += row0.to(tl.int64) * stride_cm + col0.to(tl.int64) * stride_cn
    tl.store(c_ptr + r[:, None] * stride_cm + c[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(row0 + r[:, None] < M) & (col0 + c[None, :] < N))


def deep_gemm(a_q, scale_a, w_q, scale_w, *, out_dtype=torch.bfloat16, block_mn=None,
              _per_block_scales: bool = True) -> torch.Tensor:
    """C (M, N) = dequant(a_q) @ dequant(w_q)^T with DeepGEMM's scale layout (see quantize_blockwise)."""
    for name, t in (("a_q", a_q), ("w_q", w_q)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"deep_gemm: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"deep_gemm: {name} must be float8_e4m3fn, got {t.dtype}")
    (M, K), N = a_q.shape, w_q.shape[0]
    if w_q.shape[1] != K:
        raise ValueError(f"deep_gemm: a_q is {tuple(a_q.shape)} but w_q is {tuple(w_q.shape)}: K differs")
    kb, nb = -(-K // GROUP), -(-N // GROUP)
    if scale_a.shape != (M, kb) or scale_w.shape != (nb, kb):
        raise ValueError(f"deep_gemm: scale_a must be ({M}, {kb}) and scale_w ({nb}, {kb}), "
                         f"got {tuple(scale_a.shape)} and {tuple(scale_w.shape)}")
    if scale_a.dtype != torch.float32 or scale_w.dtype != torch.float32:
        raise TypeError("deep_gemm: scale_a and scale_w must be float32")
    if a_q.device.type != runtime.device().type:
        raise ValueError(f"deep_gemm: inputs must be on {runtime.device()}")
    bm, bn = _check_block(block_mn or (GPU_TILE if runtime.runtime().on_gpu else CPU_TILE))
    c = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    grid, args, kwargs = _launch_args(a_q, w_q, c, scale_a, scale_w, block_mn=(bm, bn), per_block_scales=_per_block_scales)
    _deep_gemm_kernel[grid](*args, **kwargs)
    return c


def _check_block(block_mn):
    """(BLOCK_M, BLOCK_N): powers of two from 16, and BLOCK_N dividing 128, so that every column of a
    tile shares one weight scale (the kernel loads one per K block). A BLOCK_N of 256 would straddle
    two 128-row scale blocks and apply the first one's scale to both (tests/test_deep_gemm.py)."""
    if not (isinstance(block_mn, tuple) and len(block_mn) == 2 and all(isinstance(v, int) for v in block_mn)):
        raise ValueError(f"deep_gemm: block_mn must be a (BLOCK_M, BLOCK_N) tuple of ints, got {block_mn!r}")
    bm, bn = block_mn
    if any(v < 16 or v & (v - 1) for v in block_mn):
        raise ValueError(f"deep_gemm: block_mn must be powers of two from 16, got {block_mn}")
    if GROUP % bn:
        raise ValueError(f"deep_gemm: BLOCK_N={bn} does not divide {GROUP}: a tile would span two weight scale "
                         f"blocks and get one scale for both; use BLOCK_N <= {GROUP}")
    return bm, bn


def _launch_args(a_q, w_q, c, scale_a, scale_w, *, block_mn, per_block_scales: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_deep_gemm_kernel`: shared by :func:`deep_gemm`
    and :func:`compile_jobs` (the AOT build is the launch). No check of ``block_mn`` here."""
    (M, K), N = a_q.shape, w_q.shape[0]
    bm, bn = block_mn
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    args = (a_q, w_q, c, scale_a, scale_w, M, N, K,
            a_q.stride(0), a_q.stride(1), w_q.stride(0), w_q.stride(1), c.stride(0), c.stride(1),
            scale_a.stride(0), scale_a.stride(1), scale_w.stride(0), scale_w.stride(1))
    kwargs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=GROUP, PER_BLOCK_SCALES=per_block_scales,
                  num_warps=8 if bm == 128 else 4)
    return grid, args, kwargs


# DeepSeek-V3's config.json: hidden 7168, dense-MLP intermediate 18432 (the first three layers; the
# experts' is 2048): the dense up projection in a 4096-token prefill.
DEEPSEEK_V3_UP = (4096, 7168, 18432)   # (M tokens, K hidden, N intermediate)


def launch_job(M: int, K: int, N: int, *, block_mn=GPU_TILE):
    """The AOT job of :func:`deep_gemm` at A (M, K) x W (N, K)^T with ``block_mn``, bf16 out."""
    from kernels import inspect as ki

    meta = lambda *shape, dtype: torch.empty(*shape, device="meta", dtype=dtype)  # noqa: E731
    kb, nb = -(-K // GROUP), -(-N // GROUP)
    a_q, w_q = meta(M, K, dtype=torch.float8_e4m3fn), meta(N, K, dtype=torch.float8_e4m3fn)
    c = meta(M, N, dtype=torch.bfloat16)
    scale_a, scale_w = meta(M, kb, dtype=torch.float32), meta(nb, kb, dtype=torch.float32)
    grid, args, kwargs = _launch_args(a_q, w_q, c, scale_a, scale_w, block_mn=block_mn)
    return ki.launch_job(_deep_gemm_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The block-scaled FP8 GEMM at DeepSeek-V3's dense up projection (4096 tokens x 7168 -> 18432)."""
    M, K, N = DEEPSEEK_V3_UP
    return {f"DeepSeek-V3 dense up proj, 4096 tokens: {bm}x{bn}x128, {8 if bm == 128 else 4} warps":
            launch_job(M, K, N, block_mn=(bm, bn)) for bm, bn in (GPU_TILE, (128, 64))}


# ------------------------------------------------------------------------------------------------
# Accumulation precision, emulated


def chop(x: torch.Tensor, mant_bits: int) -> torch.Tensor:
    """fp32 values truncated (toward zero) to ``mant_bits`` explicit mantissa bits."""
    drop = 23 - mant_bits
    return (x.float().view(torch.int32) & ~((1 << drop) - 1)).view(torch.float32)


def accumulate_emulated(products: torch.Tensor, *, mant_bits: int = 13, promote_every: int | None = None) -> torch.Tensor:
    """Sum ``products`` (rows, K) left to right in an accumulator that keeps ``mant_bits`` mantissa bits
    after every add (a model of a reduced-precision tensor-core accumulator, an assumption); with
    ``promote_every`` = n, the partial is added to a full fp32 sum and reset every n products."""
    full = torch.zeros(products.shape[0], dtype=torch.float32)
    part = torch.zeros_like(full)
    for k in range(products.shape[1]):
        part = chop(part + products[:, k], mant_bits)
        if promote_every and (k + 1) % promote_every == 0:
            full, part = full + part, torch.zeros_like(part)
    return full + part
