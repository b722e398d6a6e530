"""W8A8 matmul: int8 activations times int8 weights, accumulated in int32, rescaled once per output.

With per-token activation scales a_m (X_mk ~ a_m Xq_mk) and per-output-channel weight scales w_n
(W_nk ~ w_n Wq_nk), both scales leave the sum over k:

    Y_mn = sum_k X_mk W_nk ~ a_m w_n sum_k Xq_mk Wq_nk                    (1)

so the inner sum is an exact integer dot product (|Xq Wq| <= 127^2 per term: K up to 2^31 / 127^2 ~ 133k
terms fit int32) done by the integer tensor cores, and the two scales are one multiply per
output in the epilogue. A per-input-channel (k) scale would not factor out of the sum: that is
why SmoothQuant moves the k-dependence into the weights offline instead (kernels.quant.smoothquant).

Shapes: xq (M, K) int8, wq (N, K) int8 (nn.Linear layout), x_scale (M,) fp32, w_scale (N,) fp32;
y (M, N) fp32 (or ``out_dtype``). Bytes moved: M K + N K + 4 (M + N) in, 4 M N or 2 M N out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def w8a8_matmul_ref(xq, wq, x_scale, w_scale):
    """Equation (1) with a float64 dot product (exact for int8 codes): y (M, N) fp32."""
    acc = xq.double() @ wq.double().T                                  # (M, N), exact integers
    return (acc * x_scale.double()[:, None] * w_scale.double()[None, :]).float()


@triton.jit
def _w8a8_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALE_BY_ROW: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BM,) token rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BN,) output channels
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    # int64 row offsets: M * K can pass 2**31 at long prefills
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm          # (BM, 1)
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn          # (1, BN): W^T tile (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        xq = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0)  # (BM, BK) int8
        wq = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0)  # (BK, BN) int8
        acc = tl.dot(xq, wq, acc, out_dtype=tl.int32)                  # sum_k Xq_mk Wq_nk in int32
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)                # a_m (BM,)
    if SCALE_BY_ROW:
        ws = tl.load(ws_ptr + offs_m, mask=m_ok, other=0.0)            # broken: channel scale indexed by token
        y = acc.to(tl.float32) * xs[:, None] * ws[:, None]
    else:
        ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)            # w_n (BN,)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]             # Y = a_m w_n acc_mn
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(xq, wq, x_scale, w_scale):
    for name, t in (("xq", xq), ("wq", wq)):
        if t.dtype != torch.int8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D int8 tensor, got {t.dtype} with shape {tuple(t.shape)}")
    if xq.shape[1] != wq.shape[1]:
        raise ValueError(f"xq (M, K) and wq (N, K) disagree on K: {xq.shape[1]} vs {wq.shape[1]}")
    for name, t, n in (("x_scale", x_scale, xq.shape[0]), ("w_scale", w_scale, wq.shape[0])):
        if t.shape != (n,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 of shape ({n},), got {t.dtype} {tuple(t.shape)}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if xq.device != wq.device or x_scale.device != xq.device or w_scale.device != xq.device:
        raise ValueError("xq, wq, x_scale and w_scale must be on one device")


def w8a8_matmul(xq, wq, x_scale, w_scale, *, out_dtype=torch.float32, block_m=64, block_n=64, block_k=64,
                _scale_by_row=False):
    """y (M, N) = x_scale[:, None] * w_scale[None, :] * (xq @ wq^T), int32 accumulation (equation 1)."""
    _check(xq, wq, x_scale, w_scale)
    if out_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"out_dtype must be float32 or float16, got {out_dtype}")
    M, K = xq.shape
    N = wq.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w8a8_kernel[grid](xq, wq, x_scale, w_scale, y, M, N, K,
                       xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), y.stride(0), y.stride(1),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BY_ROW=_scale_by_row)
    return y


def aot_job(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, out_dtype="fp16"):
    """The kernel as a :class:`kernels.inspect.TritonJob` for an ahead-of-time compile (no GPU needed)."""
    from kernels.inspect import TritonJob

    sig = {"x_ptr": "*i8", "w_ptr": "*i8", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "y_ptr": f"*{out_dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
           "stride_wn": "i32", "stride_wk": "constexpr", "stride_ym": "i32", "stride_yn": "constexpr"}
    return TritonJob(_w8a8_kernel, sig, num_warps=num_warps, num_stages=num_stages,
                     constexprs={"stride_xk": 1, "stride_wk": 1, "stride_yn": 1, "BLOCK_M": block_m,
                                 "BLOCK_N": block_n, "BLOCK_K": block_k, "SCALE_BY_ROW": False},
                     aligned=["x_ptr", "w_ptr", "xs_ptr", "ws_ptr", "y_ptr", "stride_xm", "stride_wn", "stride_ym"])
