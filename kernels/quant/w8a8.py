"""W8A8 matmul: int8 activations times int8 weights, accumulated in int32, rescaled once per output;
and the fused RMSNorm + per-token int8 quantization that produces its activations.

With per-token activation scales a_m (X_mk ~ a_m Xq_mk) and per-output-channel weight scales w_n
(W_nk ~ w_n Wq_nk), both scales leave the sum over k:

    Y_mn = sum_k X_mk W_nk ~ a_m w_n sum_k Xq_mk Wq_nk                    (1)

so the inner sum is an exact integer dot product (|Xq Wq| <= 128^2 per term: up to (2^31 - 1) // 128^2 =
131071 terms fit int32, :data:`MAX_K`) done by the integer tensor cores, and the two scales are one multiply per
output in the epilogue. A per-input-channel (k) scale would not factor out of the sum: that is
why SmoothQuant moves the k-dependence into the weights offline instead (kernels.quant.smoothquant).

At decode (M of a few tokens) the output tiles do not fill the GPU; the K loop is then split as in
:mod:`kernels.quant.w4a16` (same rule, :func:`kernels.quant.w4a16.split_for`). Each split writes its
int32 partial sum unscaled; the partials are added as integers (exact, in any order) and the scales
are applied once, by :func:`scale_epilogue`, the same fp32 arithmetic as the unsplit kernel's:

    y_mn = fl(fl(fl(acc_mn) a_m) w_n),   acc_mn = sum_s acc^(s)_mn  (exact)      (1')

fl = round to nearest even in fp32 (fl(acc) is exact while |acc| < 2^24). The output is therefore the
same bits whatever the split, and two fp32 roundings (three once |acc| passes 2^24) away from the
exact a_m w_n acc_mn: the tests compare it with the exact integer product scaled in float64 and
rounded once to fp32, 1 ulp apart at most on their cases. Scaling each partial and summing the fp32
partials instead (this module's first version) rounds every partial and then cancels: where the
partials nearly cancel the output loses most of its digits (hundreds of ulps at M=37, N=129, K=200,
tests/test_w8a8.py).

The activations a linear reads come out of an RMSNorm. Quantizing them in a separate pass reads
and writes X once more; :func:`rms_norm_quant` does the norm, the row's absmax and the int8 codes
in one pass (one program per token row), as serving engines do before a W8A8 GEMM:

    h = x / rms(x) * g,   a_m = max_k |h_mk| / 127,   Xq_mk = round(h_mk / a_m)   (2)

Shapes: xq (M, K) int8, wq (N, K) int8 (nn.Linear layout), x_scale (M,) fp32, w_scale (N,) fp32;
y (M, N) fp32 (or ``out_dtype``). Bytes moved: M K + N K + 4 (M + N) in, 4 M N or 2 M N out.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.quant.intq import quantize_per_token
from kernels.quant.w4a16 import H100_SMS, device_sms, split_for


class Tile(NamedTuple):
    """(BLOCK_M, BLOCK_N, BLOCK_K), warps and pipeline stages of one launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# GPU tiles, chosen from the AOT builds at Llama-3 sizes (compile_jobs, tests/test_w8a8.py): no spills,
# cp.async pipelining on sm80 and sm90a. The interpreter takes one small tile (tens of programs).
DECODE_TILE = Tile(16, 64, 128, 4, 4)          # M <= 16
PREFILL_TILE = Tile(128, 128, 128, 8, 3)       # M > 16
CPU_TILE = Tile(64, 64, 64, 4, 1)
DECODE_MAX_M = 16
MAX_K = (2 ** 31 - 1) // 128 ** 2              # int8 x int8 products of at most 2^14: K of them fit int32


def w8a8_matmul_ref(xq, wq, x_scale, w_scale):
    """Equation (1) with a float64 dot product (exact for int8 codes): y (M, N) fp32."""
    acc = xq.double() @ wq.double().T                                  # (M, N), exact integers
    return (acc * x_scale.double()[:, None] * w_scale.double()[None, :]).float()


def integer_product(xq, wq) -> torch.Tensor:
    """sum_k Xq_mk Wq_nk exactly: (M, N) int64 (an int64 matmul on the host, no float on the way)."""
    return xq.long().cpu() @ wq.long().cpu().T


def scale_epilogue(acc, x_scale, w_scale, out_dtype=torch.float32):
    """Equation (1'): the exact integer sums acc (M, N) scaled once, in the kernel's fp32 order,
    fl(fl(fl(acc) a_m) w_n), then cast to ``out_dtype``."""
    y = acc.to(torch.float32) * x_scale.to(acc.device)[:, None]
    return (y * w_scale.to(acc.device)[None, :]).to(out_dtype)


@triton.jit
def _w8a8_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, steps_per_split,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALE: tl.constexpr, SCALE_BY_ROW: tl.constexpr):
    """SCALE: apply a_m w_n and store y (M, N); else store this K chunk's int32 sums (split-K partials)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)                                           # K chunk (split-K), 0 without a split
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BM,) token rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BN,) output channels
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    # int64 row offsets: M * K can pass 2**31 at long prefills
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm          # (BM, 1)
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn          # (1, BN): W^T tile (BK, BN)
    k_lo = pid_k * (steps_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_lo, k_lo + steps_per_split * BLOCK_K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        xq = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0)  # (BM, BK) int8
        wq = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0)  # (BK, BN) int8
        acc = tl.dot(xq, wq, acc, out_dtype=tl.int32)                  # sum_k Xq_mk Wq_nk in int32
    y_ptrs = (y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym
              + offs_n[None, :] * stride_yn)
    if SCALE:
        xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)            # a_m (BM,)
        if SCALE_BY_ROW:
            ws = tl.load(ws_ptr + offs_m, mask=m_ok, other=0.0)        # broken: channel scale indexed by token
            y = acc.to(tl.float32) * xs[:, None] * ws[:, None]
        else:
            ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)        # w_n (BN,)
            y = acc.to(tl.float32) * xs[:, None] * ws[None, :]         # Y = a_m w_n acc_mn
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])      # int32 partial, scaled after the sum


def _check(xq, wq, x_scale, w_scale):
    for name, t in (("xq", xq), ("wq", wq)):
        if t.dtype != torch.int8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D int8 tensor, got {t.dtype} with shape {tuple(t.shape)}")
    if xq.shape[1] != wq.shape[1]:
        raise ValueError(f"xq (M, K) and wq (N, K) disagree on K: {xq.shape[1]} vs {wq.shape[1]}")
    if xq.shape[1] > MAX_K:
        raise ValueError(f"K={xq.shape[1]} would overflow the int32 accumulator: at most {MAX_K} ((2^31 - 1) // 128^2)")
    for name, t, n in (("x_scale", x_scale, xq.shape[0]), ("w_scale", w_scale, wq.shape[0])):
        if t.shape != (n,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 of shape ({n},), got {t.dtype} {tuple(t.shape)}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if xq.device != wq.device or x_scale.device != xq.device or w_scale.device != xq.device:
        raise ValueError("xq, wq, x_scale and w_scale must be on one device")


def tile_for(M: int, on_gpu: bool = True) -> Tile:
    """The launch tile: :data:`DECODE_TILE` up to :data:`DECODE_MAX_M` tokens, :data:`PREFILL_TILE`
    above; :data:`CPU_TILE` under the interpreter."""
    if not on_gpu:
        return CPU_TILE
    return DECODE_TILE if M <= DECODE_MAX_M else PREFILL_TILE


def choose_split_k(M: int, N: int, K: int, tile: Tile, *, num_sms: int = H100_SMS) -> int:
    """The split-K rule of :func:`kernels.quant.w4a16.split_for` for this kernel's tiles and K steps."""
    tiles = triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n)
    return split_for(tiles, triton.cdiv(K, tile.block_k), num_sms)


def _launch_args(xq, wq, x_scale, w_scale, y, *, tile: Tile, split_k: int, scale_by_row: bool = False,
                 scale_partials: bool = False):
    """(grid, args, kwargs) of one launch of :func:`_w8a8_kernel`, for :func:`w8a8_matmul` and for
    :func:`compile_jobs` alike. ``y`` is (M, N), or the int32 partials (split_k, M, N) when split
    (fp32 scaled partials with ``scale_partials``, the broken variant)."""
    M, K = xq.shape
    N = wq.shape[0]
    steps = triton.cdiv(K, tile.block_k) // split_k
    ys = y.stride(0) if split_k > 1 else 0
    ym, yn = (y.stride(1), y.stride(2)) if split_k > 1 else (y.stride(0), y.stride(1))
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n), split_k)
    args = (xq, wq, x_scale, w_scale, y, M, N, K, steps,
            xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), ys, ym, yn)
    kwargs = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  SCALE=split_k == 1 or scale_partials, SCALE_BY_ROW=scale_by_row,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    return grid, args, kwargs


def _output(M: int, N: int, split_k: int, out_dtype, device, scale_partials: bool = False) -> torch.Tensor:
    if split_k == 1:
        return torch.empty(M, N, dtype=out_dtype, device=device)
    return torch.empty(split_k, M, N, dtype=torch.float32 if scale_partials else torch.int32, device=device)


def w8a8_matmul(xq, wq, x_scale, w_scale, *, out_dtype=torch.float32, tile: Tile | None = None,
                split_k: int | None = None, _scale_by_row=False, _scale_partials=False):
    """y (M, N) = x_scale[:, None] * w_scale[None, :] * (xq @ wq^T), int32 accumulation (equation 1),
    scaled once in fp32 (equation 1'): the same bits for every ``split_k``.

    ``tile`` defaults to :func:`tile_for` (the GPU tiles on a GPU, :data:`CPU_TILE` under the
    interpreter), ``split_k`` to :func:`choose_split_k` for the device's SMs. ``_scale_by_row`` and
    ``_scale_partials`` (each split's partial scaled in fp32, then the fp32 partials summed) are the
    broken variants the checks must catch."""
    _check(xq, wq, x_scale, w_scale)
    if out_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"out_dtype must be float32 or float16, got {out_dtype}")
    M, K = xq.shape
    N = wq.shape[0]
    tile = tile or tile_for(M, on_gpu=xq.device.type == "cuda")
    steps = triton.cdiv(K, tile.block_k)
    if split_k is None:
        split_k = choose_split_k(M, N, K, tile, num_sms=device_sms(xq.device))
    if not isinstance(split_k, int) or split_k < 1 or steps % split_k:
        raise ValueError(f"split_k must be a positive int dividing the {steps} K steps, got {split_k!r}")
    y = _output(M, N, split_k, out_dtype, xq.device, _scale_partials)
    grid, args, kwargs = _launch_args(xq, wq, x_scale, w_scale, y, tile=tile, split_k=split_k,
                                      scale_by_row=_scale_by_row, scale_partials=_scale_partials)
    _w8a8_kernel[grid](*args, **kwargs)
    if split_k == 1:
        return y
    if _scale_partials:
        return y.sum(0).to(out_dtype)                                  # broken: rounded partials cancel
    return scale_epilogue(y.sum(0, dtype=torch.int32), x_scale, w_scale, out_dtype)   # exact sum (|acc| < 2^31)


# ------------------------------------------------------------------------------------------------
# Fused RMSNorm + per-token int8 quantization (equation 2)

RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: v + C - C rounds an fp32 |v| < 2^22 to an integer, ties to even


def rms_norm_quant_ref(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-5):
    """Equation (2) in PyTorch (fp32): codes (M, K) int8 and scales (M,) fp32."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gain.float()
    return quantize_per_token(h)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, g_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, eps,
                           BLOCK_K: tl.constexpr, SCALE_BEFORE_NORM: tl.constexpr):
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k, mask=ok, other=0.0).to(tl.float32)   # (BK,)
    g = tl.load(g_ptr + k, mask=ok, other=0.0).to(tl.float32)
    h = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)) * g                              # h = x / rms(x) * g
    if SCALE_BEFORE_NORM:
        scale = tl.max(tl.abs(x), axis=0) / 127.0                      # broken: the scale of x, not of h
    else:
        scale = tl.max(tl.abs(h), axis=0) / 127.0                      # a_m = max_k |h_mk| / 127
    scale = tl.where(scale > 0, scale, 1.0)
    v = tl.minimum(tl.maximum(h / scale, -127.0), 127.0)
    code = (v + RNE_MAGIC) - RNE_MAGIC                                 # round half to even, as torch.round
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + k, code.to(tl.int8), mask=ok)
    tl.store(s_ptr + row, scale)


def _rms_args(x, gain, q, s, eps: float, *, scale_before_norm: bool = False):
    M, K = x.shape
    block = triton.next_power_of_2(K)
    kwargs = dict(BLOCK_K=block, SCALE_BEFORE_NORM=scale_before_norm, num_warps=min(max(block // 256, 1), 16))
    return (M,), (x, gain, q, s, K, x.stride(0), q.stride(0), eps), kwargs


def rms_norm_quant(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-5, *, _scale_before_norm=False):
    """Equation (2) in one pass, one program per token row: (codes (M, K) int8, scales (M,) fp32).

    ``_scale_before_norm`` is the broken variant (the row's scale taken from x instead of h)."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16 or fp32 tensor, got {x.dtype} with shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along K")
    if gain.shape != (x.shape[1],) or gain.device != x.device or gain.stride(0) != 1:
        raise ValueError(f"gain must be a contiguous ({x.shape[1]},) tensor on x's device, got {tuple(gain.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    grid, args, kwargs = _rms_args(x, gain, q, s, eps, scale_before_norm=_scale_before_norm)
    _rms_norm_quant_kernel[grid](*args, **kwargs)
    return q, s


# ------------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes

# (label, M, N, K): Llama-3-8B / 70B projections at decode and at a 4096-token prefill
REAL_SHAPES = (
    ("Llama-3-8B o_proj decode", 1, 4096, 4096),
    ("Llama-3-8B gate/up decode", 1, 14336, 4096),
    ("Llama-3-8B gate/up prefill", 4096, 14336, 4096),
    ("Llama-3-8B down prefill", 4096, 4096, 14336),
    ("Llama-3-70B gate/up prefill", 4096, 28672, 8192),
)


def launch_job(M: int, N: int, K: int, *, tile: Tile | None = None, split_k: int | None = None,
               out_dtype=torch.float16, num_sms: int = H100_SMS):
    """The :class:`kernels.inspect.TritonJob` a GPU launch at (M, N, K) compiles (meta tensors)."""
    from kernels import inspect as ki

    tile = tile or tile_for(M)
    if split_k is None:
        split_k = choose_split_k(M, N, K, tile, num_sms=num_sms)
    xq = torch.empty(M, K, dtype=torch.int8, device="meta")
    wq = torch.empty(N, K, dtype=torch.int8, device="meta")
    xs, ws = torch.empty(M, device="meta"), torch.empty(N, device="meta")
    y = _output(M, N, split_k, out_dtype, "meta")
    _, args, kwargs = _launch_args(xq, wq, xs, ws, y, tile=tile, split_k=split_k)
    return ki.launch_job(_w8a8_kernel, *args, **kwargs)


def rms_norm_quant_job(M: int, K: int):
    """The job of :func:`rms_norm_quant` on an fp16 (M, K) input (meta tensors)."""
    from kernels import inspect as ki

    x = torch.empty(M, K, dtype=torch.float16, device="meta")
    gain = torch.empty(K, dtype=torch.float16, device="meta")
    q = torch.empty(M, K, dtype=torch.int8, device="meta")
    s = torch.empty(M, dtype=torch.float32, device="meta")
    _, args, kwargs = _rms_args(x, gain, q, s, 1e-5)
    return ki.launch_job(_rms_norm_quant_kernel, *args, **kwargs)


def compile_jobs() -> dict:
    """W8A8 at :data:`REAL_SHAPES` (fp16 output) and the fused norm + quantization at d = 4096 / 8192."""
    jobs = {f"{label}, fp16 out": launch_job(M, N, K) for label, M, N, K in REAL_SHAPES}
    jobs["rms_norm_quant Llama-3-8B d=4096, 4096 tokens"] = rms_norm_quant_job(4096, 4096)
    jobs["rms_norm_quant Llama-3-70B d=8192, 4096 tokens"] = rms_norm_quant_job(4096, 8192)
    return jobs
