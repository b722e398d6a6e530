"""W4A16 matmul: 4-bit weights unpacked and dequantized inside the kernel, 16-bit activations.

The weight-only formats of AWQ and GPTQ keep W (N, K) as asymmetric 4-bit codes q in [0, 15] with
one scale s and one zero point z per group of g consecutive k (g = 128 in both papers):

    W_nk ~ s_{n, k // g} (q_nk - z_{n, k // g})                         (1)
    Y_mn = sum_k X_mk W_nk

There is no 4-bit x 16-bit tensor-core instruction, so the kernel loads the packed bytes (half of an
fp16 weight's bytes, a quarter counting the 2 codes per byte: 0.5 byte per weight plus
(2 + 1) / g bytes of scale and zero), expands them to fp16 in registers with equation (1), and
feeds an ordinary fp16 ``tl.dot``. At decode (M of a few tokens) the matmul is bound by the bytes
of W, so 4.19 bits instead of 16 per weight is up to 3.8x less time; at large M the unpacking is
extra work on the critical path and fp16 GEMMs win (the Marlin paper measures where).

One K step of the kernel covers BLOCK_K = min(g, 128) columns, which lies inside one group, so
each output channel needs one (s, z) pair per step, loaded as a (BLOCK_N,) vector.

Shapes: x (M, K) fp16/fp32; w_packed (N, K / 2) uint8 (:func:`kernels.quant.intq.pack_int4`, low
nibble = even k); scales (N, K / g) in x's dtype or fp32; zeros (N, K / g) uint8 codes; y (M, N) in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant.intq import unpack_int4


def w4a16_matmul_ref(x, w_packed, scales, zeros, group_size):
    """Dequantize W with equation (1) in float64, then X W^T: y (M, N) float64."""
    q = unpack_int4(w_packed).double()                                 # (N, K) codes in [0, 15]
    s = scales.double().repeat_interleave(group_size, 1)               # (N, K)
    z = zeros.double().repeat_interleave(group_size, 1)
    return x.double() @ (s * (q - z)).T


@triton.jit
def _w4a16_kernel(x_ptr, wp_ptr, s_ptr, z_ptr, y_ptr, M, N, K,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_ym, stride_yn,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP_NIBBLES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BN,)
    offs_kb = tl.arange(0, BLOCK_K // 2)                               # packed bytes of one K step
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm          # (BM, 1)
    w_rows = wp_ptr + offs_n.to(tl.int64)[:, None] * stride_wn         # (BN, 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                                    # K % GROUP == 0, GROUP % BLOCK_K == 0
        x = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)   # (BM, BK)
        p = tl.load(w_rows + (k0 // 2 + offs_kb)[None, :] * stride_wk, mask=n_ok[:, None], other=0)  # (BN, BK/2) uint8
        lo = (p & 0xF).to(tl.int32)                                    # code of column 2j
        hi = (p >> 4).to(tl.int32)                                     # code of column 2j + 1
        if SWAP_NIBBLES:
            q = tl.reshape(tl.join(hi, lo), (BLOCK_N, BLOCK_K))        # broken: odd/even columns exchanged
        else:
            q = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))        # (BN, BK): interleave back to k order
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_n.to(tl.int64) * stride_sn + g * stride_sg, mask=n_ok, other=0).to(tl.int32)
        w = ((q - z[:, None]).to(tl.float32) * s[:, None]).to(x.dtype)  # W = s (q - z), (BN, BK)
        acc = tl.dot(x, tl.trans(w), acc)                              # (BM, BK) x (BK, BN)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x, w_packed, scales, zeros, group_size):
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16 or fp32 tensor, got {x.dtype} with shape {tuple(x.shape)}")
    if w_packed.dim() != 2 or w_packed.dtype != torch.uint8:
        raise ValueError(f"w_packed must be a 2-D uint8 tensor (two codes per byte), got {w_packed.dtype}")
    M, K = x.shape
    N = w_packed.shape[0]
    if K % 2 or w_packed.shape[1] * 2 != K:
        raise ValueError(f"w_packed must be (N, K / 2) = (N, {K / 2:g}) for x's K={K}, got {tuple(w_packed.shape)}")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    if K % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={K}")
    G = K // group_size
    if scales.shape != (N, G) or scales.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scales must be fp16/fp32 of shape (N, K / group_size) = ({N}, {G}), "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if zeros.shape != (N, G) or zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be uint8 codes of shape ({N}, {G}), got {zeros.dtype} {tuple(zeros.shape)}")
    if zeros.stride() != scales.stride():
        raise ValueError("scales and zeros must have the same strides")
    if len({t.device for t in (x, w_packed, scales, zeros)}) != 1:
        raise ValueError("x, w_packed, scales and zeros must be on one device")


def w4a16_matmul(x, w_packed, scales, zeros, group_size=128, *, block_m=32, block_n=64, _swap_nibbles=False):
    """y (M, N) = x @ W^T with W dequantized group-wise from 4-bit codes in the kernel (equation 1)."""
    _check(x, w_packed, scales, zeros, group_size)
    M, K = x.shape
    N = w_packed.shape[0]
    block_k = min(group_size, 128)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_kernel[grid](x, w_packed, scales, zeros, y, M, N, K,
                        x.stride(0), x.stride(1), w_packed.stride(0), w_packed.stride(1),
                        scales.stride(0), scales.stride(1), y.stride(0), y.stride(1),
                        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        SWAP_NIBBLES=_swap_nibbles)
    return y


def aot_job(group_size=128, block_m=64, block_n=64, num_warps=4, num_stages=3, x_dtype="fp16"):
    """The kernel as a :class:`kernels.inspect.TritonJob` for an ahead-of-time compile (no GPU needed)."""
    from kernels.inspect import TritonJob

    sig = {"x_ptr": f"*{x_dtype}", "wp_ptr": "*u8", "s_ptr": f"*{x_dtype}", "z_ptr": "*u8", "y_ptr": f"*{x_dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
           "stride_wn": "i32", "stride_wk": "constexpr", "stride_sn": "i32", "stride_sg": "constexpr",
           "stride_ym": "i32", "stride_yn": "constexpr"}
    return TritonJob(_w4a16_kernel, sig, num_warps=num_warps, num_stages=num_stages,
                     constexprs={"stride_xk": 1, "stride_wk": 1, "stride_sg": 1, "stride_yn": 1, "GROUP": group_size,
                                 "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": min(group_size, 128),
                                 "SWAP_NIBBLES": False},
                     aligned=["x_ptr", "wp_ptr", "s_ptr", "z_ptr", "y_ptr", "stride_xm", "stride_wn", "stride_sn",
                              "stride_ym"])
