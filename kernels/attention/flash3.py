"""FlashAttention-3 in Triton: a forward on tensor descriptors whose K/V loop is warp-specialised,
its FP8 path with block quantization and incoherent processing, and the ping-pong schedule as a model.

FlashAttention-3 (Shah et al. 2024) keeps FlashAttention-2's loop (one program per query block,
the online softmax over key blocks, kernels.attention.flash) and changes *how* Hopper runs it:

1. **Producer/consumer warp specialization.** A producer warp group only issues TMA copies of the
   K and V tiles into a ring of shared-memory stages (mbarriers hand the stages over); consumer warp
   groups only issue wgmma and the softmax. The producer gives its registers to the consumers with
   ``setmaxnreg``: 24 for the producer and 240 for each of two consumers in FA3's own kernel
   (Dao-AILab/flash-attention@0473b463, hopper/flash_fwd_kernel_sm90.h, LoadRegisterRequirement /
   MmaRegisterRequirement). Here ``tl.range(..., warp_specialize=True)`` asks Triton for that split,
   and the loads come from tensor descriptors (TMA on sm90a).
2. **Ping-pong** between two consumer warp groups (each on its own query block): a named barrier
   orders their GEMMs so that one group's softmax (exp2 on the MUFU unit, 16 per clock per SM
   against 4096 dense fp16 tensor-core FLOP per clock) runs under the other group's GEMMs.
   :func:`schedule` models it; the durations come from instruction counts of the compiled kernel
   and labelled assumptions, never from a timing.
3. **Intra-warpgroup overlap**: inside one group, the QK^T GEMM of block j+1 is issued (wgmma is
   asynchronous) before the softmax of block j, so the two overlap; also in :func:`schedule`.

FP8 (E4M3) inputs: Q, K, V are quantized per block (one fp32 scale per BLOCK_M rows of Q and per
BLOCK_N rows of K and V: *block quantization*), after an optional *incoherent processing* step that
multiplies Q and K by the same random orthogonal matrix M = H diag(s) / sqrt(d) (a Hadamard matrix
times random signs): (Q M)(K M)^T = Q K^T exactly, while an outlier channel is spread over all d
channels before rounding. In the kernel:

    S_ij = (Q8_i K8_j^T) * sq_i * sk_j * sm_scale                     fp8 x fp8 -> fp32 on the tensor cores
    P8   = e4m3(exp2(S_ij - m + 8))        P scaled by 2^8 before the cast (FA3's softmax Max_offset = 8
                                           for FP8, same file), so probabilities use E4M3's range
    A    = alpha A + (P8 V8_j) * sv_j / 2^8,   l = alpha l + rowsum(exp2(S_ij - m))

The interpreter's fp32 -> fp8 downcast does not round to nearest even (course-design facts), so
under it the kernel rounds P itself with :func:`_round_e4m3` (exact, ties to even); the compiled
kernel uses the hardware conversion (cvt.rn.satfinite), which rounds the same way.

Shapes: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), Hq a multiple of Hkv (GQA); D in HEAD_DIMS; the
last dimension contiguous and every other stride 16-byte aligned (TMA). Causal masking is bottom-right
aligned and fully masked rows give 0 and lse -inf, as in kernels.attention.reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention.reference import attention_ref

LOG2E = 1.4426950408889634
HEAD_DIMS = (32, 64, 128)
FP16_DTYPES = (torch.float16, torch.bfloat16)
E4M3_MAX = 448.0
P_OFFSET = 8                      # P is scaled by 2^8 before its E4M3 cast (FA3: Max_offset = 8 for FP8)
# The sm90a build: 64 x 128 tiles, 4 warps per partition; Triton 3.7.1 builds warp specialization
# for this loop at BLOCK_M = 64 (tests/test_flash_attention_3.py compiles it at Llama-3-70B's size).
GPU_BLOCKS = (64, 128)
CPU_BLOCKS = (64, 64)


# ----------------------------------------------------------------------------------------------
# Incoherent processing and block quantization (PyTorch: FA3 fuses them with RoPE, outside the kernel)


def hadamard_matrix(d: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix H_d (d a power of two), entries +-1, H H^T = d I; float64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_matrix: d must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)      # H_2n = [[H, H], [H, -H]]
    return h


def random_rotation(d: int, seed: int = 0) -> torch.Tensor:
    """M = H_d diag(s) / sqrt(d) with random signs s: orthogonal (M M^T = I), float64 (d, d)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=g).to(torch.float64) * 2 - 1
    return hadamard_matrix(d) * signs[None, :] / math.sqrt(d)


def quantize_blocks(x: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of x (B, H, N, D) with one fp32 scale per ``block`` rows of each head (block
    quantization), or one per head (``block=None``: per-tensor scaling per head, the baseline).

    scale = amax / 448 of the block (1 for an all-zero block), codes = e4m3(x / scale), rounded to
    nearest even by PyTorch's conversion (equal to kernels.quant.fp8.encode on every code).
    Returns codes (B, H, N, D) float8_e4m3fn and scales (B, H, ceil(N / block)) float32; with
    ``block=None`` the one scale per head is repeated for every block of ``len`` rows (use
    :func:`scales_for_blocks` to expand it to the kernel's block size).
    """
    if x.dim() != 4:
        raise ValueError(f"quantize_blocks: x must be (B, H, N, D), got {tuple(x.shape)}")
    B, H, N, D = x.shape
    xf = x.float()
    if block is None:
        amax = xf.abs().amax(dim=(2, 3), keepdim=True)                         # (B, H, 1, 1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        return (xf / scale).to(torch.float8_e4m3fn), scale[..., 0]             # scales (B, H, 1)
    if block < 1:
        raise ValueError(f"quantize_blocks: block must be >= 1 or None, got {block}")
    nb = -(-N // block)
    pad = nb * block - N
    xp = torch.nn.functional.pad(xf, (0, 0, 0, pad)).view(B, H, nb, block, D)
    amax = xp.abs().amax(dim=(3, 4), keepdim=True)                             # (B, H, nb, 1, 1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (xp / scale).to(torch.float8_e4m3fn).view(B, H, nb * block, D)[:, :, :N]
    return codes, scale[..., 0, 0]


def scales_for_blocks(scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Per-head scales (B, H, 1) repeated for the ceil(n / block) blocks the kernel walks."""
    return scales[..., :1].expand(*scales.shape[:2], -(-n // block)).contiguous()


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """codes * scale of each row's block, float32 (B, H, N, D)."""
    N = codes.shape[2]
    per_row = scales.repeat_interleave(block, dim=2)[:, :, :N]                # (B, H, N)
    return codes.float() * per_row[..., None]


# ----------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _round_e4m3(x):
    """x (>= 0, fp32) rounded to the nearest E4M3 value, ties to even, saturating at 448.

    The spacing of E4M3 values around x is 2^(e - 3) for x in [2^e, 2^(e+1)), e >= -6, and 2^-9 below
    2^-6 (subnormals); x / spacing is rounded to an integer by the fp32 add-and-subtract of 1.5 * 2^23,
    which rounds to nearest even, and scaled back (both exact: the spacing is a power of two)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127                       # floor(log2 x) for normal fp32
    spacing_exp = tl.maximum(exponent, -6) - 3
    spacing = ((spacing_exp + 127) << 23).to(tl.float32, bitcast=True)
    y = x / spacing
    y = (y + 12582912.0) - 12582912.0                            # round to nearest integer, ties to even
    return tl.minimum(y * spacing, 448.0)


@triton.jit
def _fa3_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr,
    B, Hq, Hkv, Nq, Nk,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    FP8: tl.constexpr, EXACT_ROUND: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
    RESCALE: tl.constexpr, SCALE_V: tl.constexpr,
):
    """One program per (query block, batch x query head). Q, K, V, O through tensor descriptors of
    the (B, H, N, D) tensors: TMA on sm90a, zeros past N (the key tail is masked to -inf below)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hkv)                                     # the K/V head of this query head (GQA)
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[B, Hq, Nq, HEAD_DIM], strides=[stride_qb, stride_qh, stride_qm, 1],
                                       block_shape=[1, 1, BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[B, Hkv, Nk, HEAD_DIM], strides=[stride_kb, stride_kh, stride_kn, 1],
                                       block_shape=[1, 1, BLOCK_N, HEAD_DIM])
    if FP8:   # V^T (B, Hkv, D, Nk): fp8 wgmma reads its B operand K-major only, so FP8 V arrives transposed
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[B, Hkv, HEAD_DIM, Nk], strides=[stride_vb, stride_vh, stride_vn, 1],
                                           block_shape=[1, 1, HEAD_DIM, BLOCK_N])
    else:
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[B, Hkv, Nk, HEAD_DIM], strides=[stride_vb, stride_vh, stride_vn, 1],
                                           block_shape=[1, 1, BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[B, Hq, Nq, HEAD_DIM], strides=[stride_ob, stride_oh, stride_om, 1],
                                       block_shape=[1, 1, BLOCK_M, HEAD_DIM])
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([b, h, start_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)        # Q_i (BLOCK_M, D)
    scale = qk_scale                                                                # sm_scale * log2(e)
    n_kv_blocks = tl.cdiv(Nk, BLOCK_N)
    if FP8:
        scale = scale * tl.load(qs_ptr + bh.to(tl.int64) * tl.cdiv(Nq, BLOCK_M) + start_m)   # * sq_i
    kv_row = (b * Hkv + hk).to(tl.int64) * n_kv_blocks                             # first scale of this K/V head
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)      # running max (log2 units)
    l_i = tl.zeros((BLOCK_M,), tl.float32)                    # running sum of exp2(s - m)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)           # running sum of exp2(s - m) V
    shift = Nk - Nq                                           # bottom-right causal alignment
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Nk, (start_m + 1) * BLOCK_M + shift), 0)
    else:
        hi = Nk
    for start_n in tl.range(0, hi, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)            # K_j (producer: TMA)
        s = tl.dot(q, tl.trans(k))                                                  # Q_i K_j^T, fp32
        if FP8:
            s = s * (scale * tl.load(ks_ptr + kv_row + start_n // BLOCK_N))         # * sq_i sk_j sm_scale log2e
        else:
            s = s * scale
        n = start_n + offs_n
        visible = (n < Nk)[None, :]                            # the descriptor's zero rows past Nk
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))            # m_new = max(m, rowmax(S_ij))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)                         # exp(m - m_new)
        p = tl.exp2(s - m_safe[:, None])                      # P_ij = exp(S_ij - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if RESCALE:
            acc = acc * alpha[:, None]
        if FP8:
            v = tl.trans(v_desc.load([b, hk, 0, start_n]).reshape(HEAD_DIM, BLOCK_N))   # V8_j from V^T
            p_big = p * 256.0                                                       # 2^P_OFFSET
            if EXACT_ROUND:
                p_big = _round_e4m3(p_big)
            pv = tl.dot(p_big.to(tl.float8e4nv), v)                                 # P8 V8_j, fp32 accumulate
            if SCALE_V:
                acc += pv * (tl.load(vs_ptr + kv_row + start_n // BLOCK_N) * (1.0 / 256.0))   # * sv_j / 2^8
            else:
                acc += pv * (1.0 / 256.0)                      # broken on purpose: V's block scale forgotten
        else:
            v = v_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)        # V_j
            acc = tl.dot(p.to(v.dtype), v, acc)               # A += P_ij V_j
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]                                 # O_i = A / l
    o_desc.store([b, h, start_m * BLOCK_M, 0], o.reshape(1, 1, BLOCK_M, HEAD_DIM).to(o_desc.dtype))
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)


# ----------------------------------------------------------------------------------------------
# Launchers


def _alloc(size: int, alignment: int, stream):
    """Scratch for the device-side tensor descriptors (Triton asks the host for it)."""
    return torch.empty(size, dtype=torch.int8, device=runtime.device())


def _check_tensor(t, arg: str, name: str, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name}: {arg} must be 4-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if t.device.type != runtime.device().type:
        raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if t.stride(-1) != 1 or any((st * t.element_size()) % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name}: {arg} must have a contiguous last dimension and 16-byte aligned strides and "
                         f"address (a TMA descriptor's rule), got strides {t.stride()}")


def _check_shapes(q_shape, k_shape, v_shape, name: str) -> None:
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) (v given as its logical shape)."""
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"{name}: k shape {tuple(k_shape)} differs from v shape {tuple(v_shape)}")
    B, Hq, Nq, D = q_shape
    Bk, Hkv, Nk, Dk = k_shape
    if Bk != B or Dk != D:
        raise ValueError(f"{name}: q is (B={B}, Hq={Hq}, Nq={Nq}, D={D}) but k is (B={Bk}, Hkv={Hkv}, Nk={Nk}, D={Dk})")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if D not in HEAD_DIMS:
        raise ValueError(f"{name}: head dim D={D} is not one of {HEAD_DIMS} (a power of two the descriptor tiles)")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"{name}: sequence lengths must be at least 1, got Nq={Nq}, Nk={Nk}")


def _blocks(block_m, block_n) -> tuple[int, int]:
    if (block_m is None) != (block_n is None):
        raise ValueError("flash_attention_3: give both block_m and block_n, or neither")
    bm, bn = (block_m, block_n) if block_m else (GPU_BLOCKS if runtime.runtime().on_gpu else CPU_BLOCKS)
    for nm, val in (("block_m", bm), ("block_n", bn)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"flash_attention_3: {nm} must be a power of two >= 16, got {val!r}")
    return bm, bn


def _scale(sm_scale, d: int) -> float:
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"flash_attention_3: sm_scale must be a positive finite number or None, got {sm_scale!r}")
    return 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)


def _launch_args(q, k, v, o, lse, scales, causal: bool, sm_scale: float, *, block_m: int, block_n: int,
                 warp_specialize: bool = True, num_stages: int = 2, rescale: bool = True, scale_v: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_fa3_fwd_kernel`: what the launchers run and what
    :func:`compile_jobs` compiles (on meta tensors), so the AOT build cannot drift from the launch.
    For FP8, v is V^T (B, Hkv, D, >= Nk) and ``scales`` = (sq, sk, sv)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    fp8 = q.dtype == torch.float8_e4m3fn
    qs, ks, vs = scales if fp8 else (lse, lse, lse)          # unread when not FP8
    args = (q, k, v, o, lse, qs, ks, vs, B, Hq, Hkv, Nq, Nk,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), sm_scale * LOG2E)
    kwargs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), FP8=fp8,
                  EXACT_ROUND=fp8 and runtime.runtime().interpreted, WARP_SPECIALIZE=warp_specialize,
                  NUM_STAGES=num_stages, RESCALE=rescale, SCALE_V=scale_v, num_warps=4)
    return (triton.cdiv(Nq, block_m), B * Hq), args, kwargs


def _run(q, k, v, scales, causal, sm_scale, out_dtype, *, block_m, block_n, **variant):
    B, Hq, Nq, D = q.shape
    o = torch.empty((B, Hq, Nq, D), dtype=out_dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    grid, args, kwargs = _launch_args(q, k, v, o, lse, scales, causal, sm_scale, block_m=block_m, block_n=block_n,
                                      **variant)
    _fa3_fwd_kernel[grid](*args, **kwargs)
    return o, lse


def flash_attention_3_ref(q, k, v, causal: bool = False, sm_scale: float | None = None):
    """The reference: :func:`kernels.attention.attention_ref` in fp32 (fp64 kept) from the same inputs."""
    return attention_ref(q, k, v, causal, sm_scale)


def flash_attention_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      sm_scale: float | None = None, *, return_lse: bool = False, block_m: int | None = None,
                      block_n: int | None = None, warp_specialize: bool = True, _rescale: bool = True):
    """Exact attention, forward only, with the K/V loop warp-specialised on sm90+.

    q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) in fp16 or bf16 (bf16 is checked on a GPU only: the
    interpreter's bf16 arithmetic is wrong), D in HEAD_DIMS, TMA-aligned strides. Returns O in q's
    dtype (and the lse (B, Hq, Nq) fp32 with ``return_lse``). ``_rescale=False`` is the broken variant
    that forgets alpha on the accumulator.
    """
    for arg, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, arg, "flash_attention_3", FP16_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"flash_attention_3: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_shapes(q.shape, k.shape, v.shape, "flash_attention_3")
    bm, bn = _blocks(block_m, block_n)
    o, lse = _run(q, k, v, None, causal, _scale(sm_scale, q.shape[-1]), q.dtype, block_m=bm, block_n=bn,
                  warp_specialize=warp_specialize, rescale=_rescale)
    return (o, lse) if return_lse else o


@dataclass(frozen=True)
class Fp8Inputs:
    """What the FP8 kernel reads: E4M3 codes, their fp32 block scales, and the rotation applied to Q, K."""
    q: torch.Tensor             # (B, Hq, Nq, D) e4m3
    k: torch.Tensor             # (B, Hkv, Nk, D) e4m3
    vt: torch.Tensor            # (B, Hkv, D, Nk padded to 16) e4m3: V transposed
    q_scale: torch.Tensor       # (B, Hq, ceil(Nq / block_m)) fp32
    k_scale: torch.Tensor       # (B, Hkv, ceil(Nk / block_n)) fp32
    v_scale: torch.Tensor       # (B, Hkv, ceil(Nk / block_n)) fp32
    block_m: int
    block_n: int
    rotation: torch.Tensor | None

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as the kernel sees them, fp32 (B, H, N, D): Q and K rotated if a rotation was applied."""
        Nk = self.k.shape[2]
        v = self.vt[..., :Nk].transpose(2, 3)
        return (dequantize_blocks(self.q, self.q_scale, self.block_m),
                dequantize_blocks(self.k, self.k_scale, self.block_n), dequantize_blocks(v, self.v_scale, self.block_n))


def prepare_fp8(q, k, v, *, rotate: bool = True, block_quant: bool = True, seed: int = 0,
                block_m: int | None = None, block_n: int | None = None) -> Fp8Inputs:
    """Rotate Q and K by :func:`random_rotation` (``rotate``: incoherent processing), quantize Q, K, V
    to E4M3 with one scale per kernel block (``block_quant``) or per head (the per-tensor baseline),
    and lay V out transposed (padded to 16 positions, TMA's stride rule)."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(t, arg, "prepare_fp8", (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    _check_shapes(q.shape, k.shape, v.shape, "prepare_fp8")
    bm, bn = _blocks(block_m, block_n)
    rotation = random_rotation(q.shape[-1], seed).to(q.device) if rotate else None
    if rotation is not None:
        q, k = q.double() @ rotation, k.double() @ rotation       # (Q M)(K M)^T = Q K^T
    qc, qs = quantize_blocks(q, bm if block_quant else None)
    kc, ks = quantize_blocks(k, bn if block_quant else None)
    vc, vs = quantize_blocks(v, bn if block_quant else None)
    if not block_quant:
        qs = scales_for_blocks(qs, q.shape[2], bm)
        ks, vs = scales_for_blocks(ks, k.shape[2], bn), scales_for_blocks(vs, k.shape[2], bn)
    B, Hkv, Nk, D = k.shape
    vt = torch.zeros((B, Hkv, D, -(-Nk // 16) * 16), dtype=torch.float8_e4m3fn, device=v.device)
    vt[..., :Nk] = vc.transpose(2, 3)
    return Fp8Inputs(qc.contiguous(), kc.contiguous(), vt, qs.contiguous(), ks.contiguous(), vs.contiguous(),
                     bm, bn, rotation)


def flash_attention_3_fp8(inputs: Fp8Inputs, causal: bool = False, sm_scale: float | None = None, *,
                          out_dtype: torch.dtype = torch.float16, return_lse: bool = False,
                          warp_specialize: bool = True, _scale_v: bool = True):
    """The FP8 forward on :func:`prepare_fp8`'s codes and scales; O (B, Hq, Nq, D) in ``out_dtype``.

    ``sm_scale`` defaults to 1/sqrt(D). ``_scale_v=False`` is the broken variant that forgets V's
    block scale."""
    if not isinstance(inputs, Fp8Inputs):
        raise TypeError(f"flash_attention_3_fp8: inputs must be prepare_fp8's Fp8Inputs, got {type(inputs).__name__}")
    q, k, vt = inputs.q, inputs.k, inputs.vt
    for arg, t in (("q", q), ("k", k), ("vt", vt)):
        _check_tensor(t, arg, "flash_attention_3_fp8", (torch.float8_e4m3fn,))
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if vt.shape[:3] != (B, Hkv, D) or vt.shape[3] < Nk:
        raise ValueError(f"flash_attention_3_fp8: vt must be (B, Hkv, D, >= Nk) = ({B}, {Hkv}, {D}, >= {Nk}), "
                         f"got {tuple(vt.shape)}")
    _check_shapes(q.shape, k.shape, k.shape, "flash_attention_3_fp8")
    want = {"q_scale": (B, Hq, -(-Nq // inputs.block_m)), "k_scale": (B, Hkv, -(-Nk // inputs.block_n)),
            "v_scale": (B, Hkv, -(-Nk // inputs.block_n))}
    for arg, shape in want.items():
        t = getattr(inputs, arg)
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"flash_attention_3_fp8: {arg} must be contiguous float32 {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if out_dtype not in FP16_DTYPES:
        raise TypeError(f"flash_attention_3_fp8: out_dtype must be float16 or bfloat16, got {out_dtype}")
    bm, bn = _blocks(inputs.block_m, inputs.block_n)
    o, lse = _run(q, k, vt, (inputs.q_scale, inputs.k_scale, inputs.v_scale), causal, _scale(sm_scale, D),
                  out_dtype, block_m=bm, block_n=bn, warp_specialize=warp_specialize, scale_v=_scale_v)
    return (o, lse) if return_lse else o


def p_rounding_bound(v_absmax: float, n_keys: int, p_scale: float = 2.0 ** P_OFFSET) -> float:
    """The most the E4M3 rounding of P can move an output, Q K^T and V held fixed. P is cast as
    p_scale * P_ij: values >= 2^-6 are rounded with relative error <= 2^-4 (three mantissa bits, half a
    unit), smaller ones (subnormals) with absolute error <= 2^-10, i.e. 2^-10 / p_scale on P_ij. The row
    max contributes exp(0) = 1, so l >= 1 and |sum_j dP_ij v_j| / l <= (2^-4 + 2^-10 n_keys / p_scale) max|v|."""
    return (2.0 ** -4 + 2.0 ** -10 * n_keys / p_scale) * float(v_absmax)


# ----------------------------------------------------------------------------------------------
# The ping-pong schedule: a model of two consumer warp groups on one SM (durations are inputs)

# Per-SM rates of an H100 (sm90), per clock: dense FP16 tensor-core FLOP (kernels.gpu.hardware, from
# the Hopper whitepaper), FP8 twice that, MUFU exp2 results and FP32 ALU results (CUDA C++ Programming
# Guide, "Arithmetic Instructions", throughput table for compute capability 9.0: 16 and 128).
MUFU_PER_CLOCK_PER_SM = 16
FP32_PER_CLOCK_PER_SM = 128
WARPGROUP_THREADS = 128


@dataclass(frozen=True)
class Event:
    wg: int          # consumer warp group (0 or 1)
    kind: str        # "gemm0" (S = Q K^T), "softmax", "gemm1" (O += P V)
    block: int       # K/V block index
    start: float
    end: float


def schedule(kind: str, n_blocks: int, gemm0: float, softmax: float, gemm1: float, *,
             ordered: bool = True, shared_units: bool = True) -> list[Event]:
    """Events of the K/V loop of one SM, in clocks, for three ways to run it.

    * ``"serial"``: one consumer warp group, each block's GEMM0, softmax, GEMM1 in turn, nothing
      overlapped. A lower bound, not FlashAttention-2: FA2 runs several warps per SM, and the warp
      schedulers already interleave one warp's softmax with another's ``mma.sync``.
    * ``"intra"``: one group, GEMM0 of block j+1 issued (asynchronous wgmma) before the softmax of block j,
      so the tensor cores run it while the group computes the softmax (FA3's intra-warpgroup overlap).
    * ``"pingpong"``: two groups, each on its own query rows; the tensor cores take one group's GEMMs at a
      time, in turn (FA3's named barriers); ``ordered=False`` drops that order (a broken variant: both
      groups' GEMMs on the tensor cores at once, which the model would let overlap for free).

    ``softmax`` is priced at the whole SM's MUFU and FP32 rates (:func:`loop_costs`), so the two groups
    share one timeline of those units: a softmax starts when its group's GEMM is done **and** the
    previous softmax has left the units. ``shared_units=False`` drops that (the broken variant: two
    softmaxes at once, each at the SM's full rate, a unit utilisation of 2; :func:`unit_utilisation`).
    Assumed: GEMMs of one group run back to back on the tensor cores; a softmax uses no tensor core.
    """
    if kind not in ("serial", "intra", "pingpong"):
        raise ValueError(f"schedule: kind must be 'serial', 'intra' or 'pingpong', got {kind!r}")
    if n_blocks < 1 or min(gemm0, softmax, gemm1) < 0:
        raise ValueError(f"schedule: need n_blocks >= 1 and durations >= 0, got {n_blocks}, {gemm0}, {softmax}, {gemm1}")
    ev: list[Event] = []
    if kind == "serial":
        t = 0.0
        for j in range(n_blocks):
            for name, dur in (("gemm0", gemm0), ("softmax", softmax), ("gemm1", gemm1)):
                ev.append(Event(0, name, j, t, t + dur))
                t += dur
        return ev
    if kind == "intra":
        tc = gemm0                                          # the tensor cores are free after GEMM0(0)
        ev.append(Event(0, "gemm0", 0, 0.0, gemm0))
        wg = gemm0                                          # the group's own clock
        for j in range(n_blocks):
            if j + 1 < n_blocks:                            # GEMM0(j+1) issued before softmax(j)
                ev.append(Event(0, "gemm0", j + 1, tc, tc + gemm0))
                tc += gemm0
            ev.append(Event(0, "softmax", j, wg, wg + softmax))
            start = max(wg + softmax, tc)                   # GEMM1(j) needs P(j) and the tensor cores
            ev.append(Event(0, "gemm1", j, start, start + gemm1))
            tc = wg = start + gemm1
        return ev
    tc = 0.0                                                # ping-pong: the tensor cores' clock
    units = 0.0                                             # the SM's MUFU + FP32 units' clock
    free = [0.0, 0.0]                                       # each group's own clock
    for j in range(n_blocks):
        for g in (0, 1):
            start = max(free[g], tc) if ordered else free[g]
            ev.append(Event(g, "gemm1" if j else "gemm0", j - 1 if j else 0, start, start + (gemm1 if j else gemm0)))
            if j:                                           # GEMM1(j-1) and GEMM0(j) back to back
                ev.append(Event(g, "gemm0", j, start + gemm1, start + gemm1 + gemm0))
            end = ev[-1].end
            tc = end if ordered else tc
            s0 = max(end, units) if shared_units else end   # S(j) ready, and the units free
            ev.append(Event(g, "softmax", j, s0, s0 + softmax))
            free[g] = units = s0 + softmax
    for g in (0, 1):                                        # the last GEMM1 of each group
        start = max(free[g], tc) if ordered else free[g]
        ev.append(Event(g, "gemm1", n_blocks - 1, start, start + gemm1))
        tc = start + gemm1 if ordered else tc
    return ev


def makespan(events: list[Event]) -> float:
    return max((e.end for e in events), default=0.0)


def tensor_core_busy(events: list[Event]) -> float:
    """Clocks during which some GEMM runs: the union of the GEMM intervals."""
    spans = sorted((e.start, e.end) for e in events if e.kind != "softmax")
    busy, cur = 0.0, None
    for s, e in spans:
        if cur is None or s >= cur[1]:
            busy += (cur[1] - cur[0]) if cur else 0.0
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return busy + ((cur[1] - cur[0]) if cur else 0.0)


def unit_utilisation(events: list[Event]) -> float:
    """The peak demand on the SM's MUFU and FP32 units: the largest number of softmaxes running at once
    (each is priced at the units' whole rate). A schedule the SM can run has at most 1."""
    edges = sorted([(e.start, 1) for e in events if e.kind == "softmax"] + [(e.end, -1) for e in events if e.kind == "softmax"])
    load = peak = 0
    for _, step in edges:                                   # at equal times the end (-1) sorts first
        load += step
        peak = max(peak, load)
    return float(peak)


def overlapping_gemms(events: list[Event]) -> int:
    """Pairs of GEMMs of DIFFERENT warp groups that overlap in time: 0 for a valid ping-pong."""
    g = [e for e in events if e.kind != "softmax"]
    return sum(1 for i, a in enumerate(g) for b in g[i + 1:] if a.wg != b.wg and a.start < b.end and b.start < a.end)


@dataclass(frozen=True)
class LoopCosts:
    """Clocks of one K/V block for one consumer warp group, from a compiled kernel's instruction counts."""
    gemm0: float
    gemm1: float
    softmax: float
    mufu: int            # MUFU.EX2 per thread per block
    alu: int             # FP32 ALU instructions (FMUL, FADD, FFMA, FMNMX, FSEL) per thread per block
    mma: int             # tensor-core instructions per block


def loop_costs(build, *, block_m: int, block_n: int, head_dim: int, consumers: int = 2, fp8: bool = False) -> LoopCosts:
    """Per-block clocks of one consumer from the SASS of a warp-specialised build (``consumers`` identical
    consumer partitions, the loop body not unrolled). Assumptions, each labelled: the static counts of
    the whole kernel divided by ``consumers`` are one block's (epilogue instructions included, an
    overestimate); a GEMM of F FLOP takes F / (tensor-core FLOP per clock per SM) clocks (the H100 rate,
    twice that for FP8); a softmax takes MUFU count x 128 / 16 + ALU count x 128 / 128 clocks (the two
    units not overlapped)."""
    from kernels.gpu import hardware
    from kernels import inspect as ki

    fam = build.families("sass")
    ops = ki.instructions(build.sass, "sass")
    mma = (fam["HGMMA"] + fam["QGMMA"]) // consumers
    flop_rate = hardware.TENSOR_FP16_FLOP_PER_CLOCK_PER_SM["sm90"] * (2 if fp8 else 1)
    gemm = 2.0 * block_m * block_n * head_dim / flop_rate              # one of the two GEMMs
    mufu = sum(n for op, n in ops.items() if op.startswith("MUFU.EX2")) // consumers
    alu = sum(fam[f] for f in ("FMUL", "FADD", "FFMA", "FMNMX", "FSEL")) // consumers
    softmax = (mufu * WARPGROUP_THREADS / MUFU_PER_CLOCK_PER_SM + alu * WARPGROUP_THREADS / FP32_PER_CLOCK_PER_SM)
    return LoopCosts(gemm, gemm, softmax, mufu, alu, mma)


def warp_partitions(ttgir: str) -> dict[str, list[str]]:
    """The operations of each region of a ``ttg.warp_specialize`` in a TTGIR listing, in order:
    {"default": [...], "partition0": [...], ...}. Operation names only (SSA names, barrier indices and
    locations dropped), so two partitions that run the same code compare equal."""
    import re

    parts: dict[str, list[str]] = {}
    current = None
    for line in ttgir.splitlines():
        head = re.match(r"\s*(default|partition\d+)\s*[({]", line)
        if head:
            current = head.group(1)
            parts[current] = []
            continue
        if current is None:
            continue
        if re.match(r"\s*\} : \(", line) or line.strip() == "tt.return":
            current = None
            continue
        op = re.search(r"(?:= |^\s*)([a-z_]+\.[a-z_.]+)[ (]", line)
        if op:
            parts[current].append(op.group(1))
    return parts


def channel_offsets(x: torch.Tensor) -> torch.Tensor:
    """|mean| / std over tokens of every channel, the worst channel of each head: (H,) for x (B, H, N, D)."""
    xf = x.double()
    return (xf.mean(dim=(0, 2)).abs() / xf.std(dim=(0, 2))).amax(-1)


# ----------------------------------------------------------------------------------------------
# Compile jobs at a real model's size


def compile_jobs() -> dict:
    """Llama-3-70B prefill (64 query heads, 8 K/V heads, D = 128, 8192 tokens: hf2024llama370bconfig),
    fp16 and FP8, causal, as :func:`flash_attention_3` / :func:`flash_attention_3_fp8` launch on a GPU."""
    from kernels import inspect as ki

    B, Hq, Hkv, N, D = 1, 64, 8, 8192, 128
    bm, bn = GPU_BLOCKS
    jobs = {}
    for label, dtype in (("fp16", torch.float16), ("FP8 e4m3", torch.float8_e4m3fn)):
        q = torch.empty(B, Hq, N, D, device="meta", dtype=dtype)
        k = torch.empty(B, Hkv, N, D, device="meta", dtype=dtype)
        v = torch.empty(B, Hkv, D, N, device="meta", dtype=dtype) if dtype != torch.float16 else k
        o = torch.empty(B, Hq, N, D, device="meta", dtype=torch.float16)
        lse = torch.empty(B, Hq, N, device="meta", dtype=torch.float32)
        scales = tuple(torch.empty(B, h, N // blk, device="meta", dtype=torch.float32)
                       for h, blk in ((Hq, bm), (Hkv, bn), (Hkv, bn)))
        grid, args, kwargs = _launch_args(q, k, v, o, lse, scales, True, 1 / math.sqrt(D), block_m=bm, block_n=bn)
        kwargs["EXACT_ROUND"] = False                     # the GPU build: the hardware's cvt.rn rounding
        jobs[f"Llama-3-70B prefill {label}, 64/8 heads, D=128, S=8192, causal"] = ki.launch_job(
            _fa3_fwd_kernel, *args, grid=grid, **kwargs)
    return jobs
