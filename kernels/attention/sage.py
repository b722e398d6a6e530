"""SageAttention: 8-bit Q K^T with K smoothing, FP8 P V, and the lower-precision formats of its sequels.

SageAttention (Zhang et al. 2024) quantizes Q and K to INT8 with one scale per block of tokens and
keeps FlashAttention's loop. Its observation: K in real models carries a large per-channel offset
shared by all tokens, so one block scale is set by the offset and the token-to-token differences that
decide the softmax get few of the 255 levels. Subtracting the mean over tokens (*smoothing K*) is free:

    softmax_j(q . (k_j - kbar)) = softmax_j(q . k_j - q . kbar) = softmax_j(q . k_j)   (q . kbar: one constant per row)

The kernel here (:func:`sage_attention`) is the INT8 Q K^T / FP8 P V path of SageAttention2 on the
sm89/sm90/sm120 GPUs (thu-ml/SageAttention@bbe24d40, sageattention/core.py dispatches sm89 and sm120 to
INT8 Q K / FP8 P V kernels):

    S_ij = (Q8_i K8_j^T) sq_i sk_j sm_scale            int8 x int8 -> int32 on the tensor cores, K smoothed
    P8   = e4m3(448 exp2(S_ij - m))                    P in [0, 1] scaled by 448 (E4M3's largest value)
    A    = alpha A + (P8 V8_j) sv / 448                every block's fp8 product accumulated afresh in the
                                                       MMA (a zero accumulator), dequantized, then added to
                                                       an fp32 register buffer (SageAttention2's two-level
                                                       accumulation); V quantized per channel
    O    = A / l

The dequantizing multiply sits between the MMA and the add on purpose: written as
``acc * alpha + tl.dot(p8, v)``, Triton's dot-add combine folds the add into the dot, which then
accumulates into the running fp32 buffer itself (seen in the sm_89 and sm_120 TTGIR), and the two
levels are gone. :func:`fp8_dot_accumulators` reads that property from a build; ``TWO_LEVEL=False``
is the folded form, kept as the broken variant the compile checks must catch.

Q is quantized per block of BLOCK_M rows (with sm_scale * log2 e folded into its scale, as
SageAttention's Triton quantizer does: sageattention/triton/quant_per_block.py), K per block of
BLOCK_N rows after smoothing. ``smooth_k=False`` is the broken variant the checks must catch on
activations with a per-channel offset. The interpreter's fp32-to-fp8 cast does not round to nearest
even, so under it P is rounded by kernels.attention.flash3._round_e4m3 (exact); a GPU uses the
hardware conversion.

The other members of the family are formats, emulated in PyTorch here to measure their error
(:func:`fake_quant_int`, :func:`per_thread_groups`, :func:`fake_quant_nvfp4`):
SageAttention2 INT4 Q, K with per-thread scales (the rows one thread's MMA fragment holds) and Q
smoothing; SageAttention2++ FP8 P V accumulated in FP16 (mma.f16.f8.f8.f16) with P and V scaled so
that a 32-term fp16 accumulation cannot overflow; SageAttention3 FP4 (E2M1) with one E4M3 scale per
16 elements (NVFP4 microscaling) on Blackwell's block-scaled MMA.

Shapes: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), Hq a multiple of Hkv, D a power of two in 16..128.
``causal``: bottom-right aligned (query i sees key j <= i + Nk - Nq, Nq <= Nk), the program stopping at
its last visible key block. Smoothing stays exact under the mask: K - mean(K) shifts row i's scores by
q_i . mean(K), one constant over whichever keys the row sees, and softmax ignores it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention.flash3 import _round_e4m3
from kernels.attention.reference import attention_ref

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)
P_SCALE = 448.0                   # P in [0, 1] -> [0, 448]: E4M3's range
E4M3_MAX = 448.0
# SageAttention's block sizes: 128 query rows and 64 key rows per scale (quant_per_block.py: BLKQ, BLKK).
GPU_BLOCKS = (128, 64, 8)         # BLOCK_M, BLOCK_N, num_warps
CPU_BLOCKS = (64, 64, 4)


# ----------------------------------------------------------------------------------------------
# Quantizers (PyTorch)


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    """K - mean over tokens, per (batch, head, channel): (B, H, N, D), in fp32 (fp64 kept)."""
    kf = k.double() if k.dtype == torch.float64 else k.float()
    return kf - kf.mean(dim=2, keepdim=True)


def quantize_int8_blocks(x: torch.Tensor, block: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes of scale * x (B, H, N, D), one fp32 scale per ``block`` rows: s = amax / 127 (1 for an
    all-zero block), codes = round-half-away(x / s) in [-127, 127], as SageAttention's quantizer.
    Returns codes int8 (B, H, N, D) and scales (B, H, ceil(N / block)) float32."""
    if x.dim() != 4 or block < 1:
        raise ValueError(f"quantize_int8_blocks: x must be (B, H, N, D) and block >= 1, got {tuple(x.shape)}, {block}")
    B, H, N, D = x.shape
    nb = -(-N // block)
    xp = torch.nn.functional.pad(x.double() * scale, (0, 0, 0, nb * block - N)).view(B, H, nb, block, D)
    amax = xp.abs().amax(dim=(3, 4), keepdim=True)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    y = xp / s
    codes = (y.abs() + 0.5).floor().clamp(max=127) * y.sign()               # round half away from zero
    return codes.to(torch.int8).view(B, H, nb * block, D)[:, :, :N].contiguous(), s[..., 0, 0].float().contiguous()


def quantize_v_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of V (B, H, N, D) with one fp32 scale per channel (amax over tokens / 448):
    codes (B, H, N, D) float8_e4m3fn, scales (B, H, D) float32."""
    amax = v.double().abs().amax(dim=2)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (v.double() / s[:, :, None]).float().to(torch.float8_e4m3fn).contiguous(), s.float().contiguous()


def fake_quant_int(x: torch.Tensor, bits: int, groups: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize x (..., N, D) symmetrically to ``bits`` with one scale per group of rows:
    ``groups`` (N,) gives each row's group id (per block, per thread, per token ...). Float64."""
    if bits < 2 or groups.shape != (x.shape[-2],):
        raise ValueError(f"fake_quant_int: bits >= 2 and groups of shape ({x.shape[-2]},) expected")
    qmax = 2 ** (bits - 1) - 1
    xd = x.double()
    out = torch.empty_like(xd)
    for g in torch.unique(groups).tolist():
        rows = groups == g
        amax = xd[..., rows, :].abs().amax(dim=(-2, -1), keepdim=True)
        s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        out[..., rows, :] = torch.round(xd[..., rows, :] / s).clamp(-qmax, qmax) * s
    return out


def block_groups(n: int, block: int) -> torch.Tensor:
    """Row -> group id for one scale per ``block`` consecutive rows."""
    return torch.arange(n) // block


def per_thread_groups(n: int, block: int = 128, warps: int = 4) -> torch.Tensor:
    """Row -> group for SageAttention2's per-thread granularity, from the mma.m16n8 fragment layout
    (PTX ISA: lane l holds rows l // 4 and l // 4 + 8 of each 16-row tile): a block of ``block`` rows
    split over ``warps`` warps; within a warp's rows, row r belongs to the thread group r % 8, so each
    block has warps x 8 scales and one thread's accumulators need one dequantization scale each."""
    r = torch.arange(n)
    rows_per_warp = block // warps
    return (r // block) * (warps * 8) + ((r % block) // rows_per_warp) * 8 + (r % 8)


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def fake_quant_nvfp4(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Quantize-dequantize x (..., D) to NVFP4: groups of ``block`` consecutive values along the last
    dimension share one E4M3 scale (amax / 6, itself rounded to E4M3, of a per-tensor fp32 scale),
    each value rounded to the nearest E2M1 number {0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the even code).
    Float64."""
    if x.shape[-1] % block:
        raise ValueError(f"fake_quant_nvfp4: the last dimension {x.shape[-1]} must be a multiple of block={block}")
    xd = x.double()
    g = xd.reshape(*xd.shape[:-1], -1, block)
    tensor_scale = g.abs().amax().clamp(min=1e-30) / (6.0 * E4M3_MAX)     # so block scales fit E4M3
    s = (g.abs().amax(-1, keepdim=True) / 6.0 / tensor_scale).float().to(torch.float8_e4m3fn).double()
    s = torch.where(s > 0, s, torch.ones_like(s)) * tensor_scale
    y = (g / s).abs().clamp(max=6.0)
    grid = E2M1_VALUES.to(x.device)
    dist = (y[..., None] - grid).abs()
    # nearest E2M1 value; ties go to the even code (index), i.e. the smaller of two equally near indices
    # when that index is even, else the larger: the argmin after a tiny bias on odd codes
    bias = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], dtype=torch.float64, device=x.device) * 1e-12
    q = grid[(dist + bias).argmin(-1)]
    return (q * g.sign() * s).reshape(xd.shape)


def smoothed(fq, block: int):
    """SageAttention2's Q smoothing around a quantizer: x -> fq(x - xbar) + xbar, xbar the mean of each
    block of ``block`` rows (the xbar K^T term is computed in high precision, a GEMV, so only the
    smoothed part is rounded)."""
    def apply(x):
        n = x.shape[-2]
        nb = -(-n // block)
        xp = torch.nn.functional.pad(x, (0, 0, 0, nb * block - n))
        counts = torch.clamp(n - torch.arange(nb, device=x.device) * block, max=block).to(x.dtype)
        mean = xp.reshape(*x.shape[:-2], nb, block, x.shape[-1]).sum(-2) / counts[:, None]
        xbar = mean.repeat_interleave(block, dim=-2)[..., :n, :]
        return fq(x - xbar) + xbar
    return apply


def quantized_attention_ref(q, k, v, *, q_fn=None, k_fn=None, p_fn=None, v_fn=None, smooth: bool = True,
                            sm_scale: float | None = None) -> torch.Tensor:
    """Attention with quantize-dequantize steps in float64: O = fq_P(softmax(fq_Q(Q) fq_K(K - kbar)^T tau)) fq_V(V),
    the normalization by the unquantized row sums. Each ``*_fn`` maps a float64 tensor to its
    quantize-dequantized value (None: exact). A PyTorch model of a format's error, not of a kernel."""
    tau = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    group = q.shape[1] // k.shape[1]
    qd = q.double()
    kd = smooth_k(k).double() if smooth else k.double()
    qd, kd = (q_fn(qd) if q_fn else qd), (k_fn(kd) if k_fn else kd)
    vd = v_fn(v.double()) if v_fn else v.double()
    s = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) * tau
    e = torch.exp(s - s.amax(-1, keepdim=True))
    p = e / e.sum(-1, keepdim=True)
    return (p_fn(p) if p_fn else p) @ vd.repeat_interleave(group, 1)


def relative_l1(x: torch.Tensor, ref: torch.Tensor) -> float:
    """sum |x - ref| / sum |ref|: the accuracy metric of the SageAttention papers."""
    return float((x.double() - ref.double()).abs().sum() / ref.double().abs().sum())


# ----------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _sage_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qs_ptr, ks_ptr, vs_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Hq, Hkv, Nq, Nk,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_ROUND: tl.constexpr,
    TWO_LEVEL: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One program per (query block, batch x query head): INT8 Q_i K_j^T, FP8 P_ij V_j."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hkv)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < Nq
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + d[None, :],
                mask=m_ok[:, None], other=0)                              # (BLOCK_M, D) int8
    q_scale = tl.load(qs_ptr + bh.to(tl.int64) * tl.cdiv(Nq, BLOCK_M) + start_m)   # sq_i (sm_scale log2e folded in)
    kv = b.to(tl.int64) * Hkv + hk
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    ks_base = ks_ptr + kv * tl.cdiv(Nk, BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)                      # the fp32 buffer
    v_scale = tl.load(vs_ptr + kv * HEAD_DIM + d) / 448.0                # (D,) per-channel scales of V, / 448
    shift = Nk - Nq                                                      # bottom-right causal alignment
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(Nk, (start_m + 1) * BLOCK_M + shift)             # the block's last row sees keys < hi
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        n_ok = n < Nk
        k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=n_ok[:, None], other=0)       # int8
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * (q_scale * tl.load(ks_base + start_n // BLOCK_N))  # log2 units
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + shift)  # j <= i + Nk - Nq
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])                                   # in [0, 1]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_big = p * 448.0                                                 # P_SCALE
        if EXACT_ROUND:
            p_big = _round_e4m3(p_big)
        v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=n_ok[:, None], other=0.0)   # e4m3
        if TWO_LEVEL:
            pv = tl.dot(p_big.to(tl.float8e4nv), v)                       # level 1: this block, a zero accumulator
            acc = acc * alpha[:, None] + pv * v_scale[None, :]            # level 2: dequantized, added in fp32
        else:   # broken on purpose: Triton folds this add, the MMA accumulates into the running buffer
            acc = acc * alpha[:, None] + tl.dot(p_big.to(tl.float8e4nv), v)
        m_i = m_new
    if not TWO_LEVEL:
        acc = acc * v_scale[None, :]                                     # the folded form dequantizes once
    o = acc / l_i[:, None]                                               # O = A / l
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launcher


def _check(q, k, v, causal, sm_scale, name="sage_attention"):
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    B, Hq, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{name}: q is (B={B}, Hq={Hq}, Nq={Nq}, D={D}) but k is (B={Bk}, Hkv={Hkv}, Nk={Nk}, D={Dk})")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if D not in HEAD_DIMS:
        raise ValueError(f"{name}: head dim D={D} must be one of {HEAD_DIMS}")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"{name}: sequence lengths must be at least 1, got Nq={Nq}, Nk={Nk}")
    if causal and Nq > Nk:
        raise ValueError(f"{name}: causal with Nq={Nq} > Nk={Nk} would leave query rows with no key "
                         "(bottom-right alignment); give at least as many keys as queries")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"{name}: sm_scale must be a positive finite number or None, got {sm_scale!r}")


def quantize_inputs(q, k, v, sm_scale: float, *, block_m: int, block_n: int, smooth: bool = True):
    """What the kernel reads: Q int8 per BLOCK_M rows (scale x sm_scale log2 e folded in), K int8 per
    BLOCK_N rows after smoothing (``smooth``), V e4m3 per channel. Returns (q8, qs, k8, ks, v8, vs)."""
    q8, qs = quantize_int8_blocks(q, block_m, scale=sm_scale * LOG2E)
    k8, ks = quantize_int8_blocks(smooth_k(k) if smooth else k, block_n)
    v8, vs = quantize_v_fp8(v)
    return q8, qs, k8, ks, v8, vs


def _launch_args(q8, qs, k8, ks, v8, vs, o, *, block_m: int, block_n: int, num_warps: int, causal: bool = False):
    """(grid, args, kwargs) of one launch of :func:`_sage_fwd_kernel`, shared with :func:`compile_jobs`."""
    B, Hq, Nq, D = q8.shape
    Hkv, Nk = k8.shape[1], k8.shape[2]
    args = (q8, k8, v8, o, qs, ks, vs, q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1),
            k8.stride(2), v8.stride(0), v8.stride(1), v8.stride(2), o.stride(0), o.stride(1), o.stride(2),
            Hq, Hkv, Nq, Nk)
    kwargs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, EXACT_ROUND=runtime.runtime().interpreted,
                  TWO_LEVEL=True, CAUSAL=causal, num_warps=num_warps)
    return (triton.cdiv(Nq, block_m), B * Hq), args, kwargs


def sage_attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None):
    """The exact reference: :func:`kernels.attention.attention_ref` in fp32 (fp64 kept)."""
    return attention_ref(q, k, v, causal, sm_scale)


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   sm_scale: float | None = None, *, smooth_k: bool = True, blocks: tuple[int, int, int] | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SageAttention's INT8 Q K^T / FP8 P V attention: quantize in PyTorch (:func:`quantize_inputs`),
    then the kernel. Returns (B, Hq, Nq, D) in ``out_dtype`` (default q's dtype). ``smooth_k=False`` is
    the broken variant (no K smoothing). ``blocks`` = (BLOCK_M, BLOCK_N, num_warps)."""
    _check(q, k, v, causal, sm_scale)
    bm, bn, warps = blocks or (GPU_BLOCKS if runtime.runtime().on_gpu else CPU_BLOCKS)
    for nm, val in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"sage_attention: {nm} must be a power of two >= 16, got {val!r}")
    tau = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    q8, qs, k8, ks, v8, vs = quantize_inputs(q, k, v, tau, block_m=bm, block_n=bn, smooth=smooth_k)
    o = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    grid, args, kwargs = _launch_args(q8, qs, k8, ks, v8, vs, o, block_m=bm, block_n=bn, num_warps=warps,
                                      causal=causal)
    _sage_fwd_kernel[grid](*args, **kwargs)
    return o


def dequantized_inputs(q, k, v, sm_scale: float | None = None, *, block_m: int, block_n: int, smooth: bool = True):
    """Q, K, V as the kernel sees them (float64, (B, H, N, D)): the INT8 / E4M3 codes times their
    scales, K smoothed if ``smooth``. Exact attention on these differs from the kernel only by the
    E4M3 rounding of P (bounded by kernels.attention.flash3.p_rounding_bound with p_scale = 448)."""
    tau = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    q8, qs, k8, ks, v8, vs = quantize_inputs(q, k, v, tau, block_m=block_m, block_n=block_n, smooth=smooth)
    qd = q8.double() * qs.double().repeat_interleave(block_m, 2)[:, :, :q.shape[2], None] / (tau * LOG2E)
    kd = k8.double() * ks.double().repeat_interleave(block_n, 2)[:, :, :k.shape[2], None]
    return qd, kd, v8.double() * vs.double()[:, :, None, :]


# ----------------------------------------------------------------------------------------------
# Compile jobs


def compile_jobs(*, two_level: bool = True) -> dict:
    """Llama-3.1-8B prefill (32 query heads, 8 K/V heads, D = 128, 8192 tokens; hf2024llama31config),
    as :func:`sage_attention` launches it on a GPU (128 x 64 blocks, 8 warps). ``two_level=False``:
    the broken variant whose FP8 dot Triton folds into the running accumulator."""
    from kernels import inspect as ki

    B, Hq, Hkv, N, D = 1, 32, 8, 8192, 128
    bm, bn, warps = GPU_BLOCKS
    q8 = torch.empty(B, Hq, N, D, device="meta", dtype=torch.int8)
    k8 = torch.empty(B, Hkv, N, D, device="meta", dtype=torch.int8)
    v8 = torch.empty(B, Hkv, N, D, device="meta", dtype=torch.float8_e4m3fn)
    o = torch.empty(B, Hq, N, D, device="meta", dtype=torch.float16)
    qs = torch.empty(B, Hq, N // bm, device="meta", dtype=torch.float32)
    ks = torch.empty(B, Hkv, N // bn, device="meta", dtype=torch.float32)
    vs = torch.empty(B, Hkv, D, device="meta", dtype=torch.float32)
    grid, args, kwargs = _launch_args(q8, qs, k8, ks, v8, vs, o, block_m=bm, block_n=bn, num_warps=warps)
    kwargs["EXACT_ROUND"] = False
    kwargs["TWO_LEVEL"] = two_level
    variant = "" if two_level else " (folded: broken variant)"
    return {f"Llama-3.1-8B prefill, INT8 QK / FP8 PV, 32/8 heads, D=128, S=8192{variant}": ki.launch_job(
        _sage_fwd_kernel, *args, grid=grid, **kwargs)}


def fp8_dot_accumulators(ttgir: str) -> list[bool]:
    """For every FP8 (f8E4M3FN) dot of a TTGIR listing (``tt.dot`` or Hopper's ``ttng.warp_group_dot``),
    whether its accumulator operand is a zero constant: True is a fresh per-block accumulation (the
    first level of SageAttention2's two), False an MMA that accumulates into a running value."""
    import re

    zeros = set(re.findall(r"(%[\w#]+) = arith\.constant dense<0\.000000e\+00> : tensor<[^>]*xf32", ttgir))
    out = []
    for line in ttgir.splitlines():
        m = re.search(r"(?:tt\.dot|ttng\.warp_group_dot) (%[\w#]+), (%[\w#]+), (%[\w#]+)", line)
        if m and "f8E4M3FN" in line:
            out.append(m.group(3) in zeros)
    return out
