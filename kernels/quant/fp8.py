"""FP8: the E4M3 and E5M2 formats bit by bit, amax scaling (per tensor or per row; current and delayed),
an FP8 GEMM, and the three GEMMs of an FP8 training step.

An FP8 number is 1 sign bit, ``e`` exponent bits and ``m`` mantissa bits (Micikevicius et al., 2022):

* E4M3 (``torch.float8_e4m3fn``): bias 7, no infinities, one NaN pattern per sign (S.1111.111);
  the largest finite value is 1.75 * 2^8 = 448, the smallest subnormal 2^-9.
* E5M2 (``torch.float8_e5m2``): bias 15, IEEE-like: S.11111.00 is infinity, S.11111.xx NaN;
  largest finite 1.75 * 2^15 = 57344, smallest subnormal 2^-16.

``decode`` and ``encode`` work on the raw 8-bit codes with integer operations only, and match
PyTorch's conversions code for code (``tests/test_fp8.py`` checks all 256 codes and the rounding
of every midpoint): round to nearest, ties to even; E4M3 saturates out-of-range values (and
infinities) to +-448 as PyTorch's CPU conversion does since 2.13 (2.11 gives NaN), E5M2 overflows
to infinity. The scaled cast
:func:`quantize` clamps before it converts, so it never depends on those rules.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime


@dataclass(frozen=True)
class Fp8Format:
    name: str
    ebits: int
    mbits: int
    bias: int
    max: float            # largest finite magnitude
    has_inf: bool         # E5M2: exponent all ones, mantissa 0 is infinity
    torch_dtype: torch.dtype

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number: 1 - bias."""
        return 1 - self.bias


E4M3 = Fp8Format("e4m3", 4, 3, 7, 448.0, False, torch.float8_e4m3fn)
E5M2 = Fp8Format("e5m2", 5, 2, 15, 57344.0, True, torch.float8_e5m2)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def _fmt(fmt) -> Fp8Format:
    if isinstance(fmt, Fp8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def decode(codes: torch.Tensor, fmt="e4m3") -> torch.Tensor:
    """The fp32 value of every 8-bit code (a uint8 tensor): (-1)^s * 2^(e - bias) * (1 + f / 2^m),
    or 2^(1 - bias) * (f / 2^m) when e = 0 (subnormal)."""
    f8 = _fmt(fmt)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"decode: codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    c = codes.to(torch.int32)
    sign = 1.0 - 2.0 * (c >> 7).float()
    e = (c >> f8.mbits) & ((1 << f8.ebits) - 1)                  # biased exponent field
    f = (c & ((1 << f8.mbits) - 1)).float()                      # mantissa field
    frac = torch.where(e == 0, f / 2**f8.mbits, 1.0 + f / 2**f8.mbits)
    power = torch.exp2((torch.where(e == 0, torch.ones_like(e), e) - f8.bias).float())
    value = sign * frac * power
    top = e == (1 << f8.ebits) - 1
    if f8.has_inf:                                               # E5M2: IEEE specials
        value = torch.where(top & (f == 0), sign * float("inf"), value)
        value = torch.where(top & (f != 0), float("nan"), value)
    else:                                                        # E4M3: only S.1111.111 is NaN
        value = torch.where(top & (f == (1 << f8.mbits) - 1), float("nan"), value)
    return value


def _shift_rne(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """v >> s rounded to nearest, ties to even (v, s int64, s >= 1)."""
    q = v >> s
    rem = v & ((1 << s) - 1)
    half = 1 << (s - 1)
    return q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).long()


def encode(x: torch.Tensor, fmt="e4m3") -> torch.Tensor:
    """The 8-bit code (uint8) nearest to each fp32 value, ties to even, from the fp32 bit pattern."""
    f8 = _fmt(fmt)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"encode: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    bits = x.float().view(torch.int32).long() & 0xFFFFFFFF
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    e32 = mag >> 23                                              # fp32 biased exponent
    mant = (mag & 0x7FFFFF) | (1 << 23)                          # 24-bit significand with the implicit 1
    shift = 23 - f8.mbits
    # normal in the target: keep m mantissa bits, rebias the exponent (a carry may bump the exponent)
    normal = _shift_rne(mag, torch.full_like(mag, shift)) - ((127 - f8.bias) << f8.mbits)
    # subnormal in the target: count units of the smallest subnormal 2^(emin - m)
    sub_shift = (shift + (f8.emin + 127) - e32).clamp(1, 40)
    sub = _shift_rne(mant, sub_shift)
    sub = torch.where(e32 == 0, torch.zeros_like(sub), sub)     # fp32 zeros and subnormals: far below 2^-16
    code = torch.where(e32 >= f8.emin + 127, normal, sub)
    max_code = _max_code(f8)
    nan_in = (e32 == 255) & ((mag & 0x7FFFFF) != 0)
    if f8.has_inf:
        inf_code = ((1 << f8.ebits) - 1) << f8.mbits
        code = torch.where(code > max_code, torch.full_like(code, inf_code), code)   # overflow -> inf
        nan_code = inf_code | ((1 << f8.mbits) - 1)
    else:
        code = torch.where(code > max_code, torch.full_like(code, max_code), code)   # saturate to +-448
        nan_code = (1 << 7) - 1
    code = torch.where(nan_in, torch.full_like(code, nan_code), code)
    return (code | sign).to(torch.uint8)


def _max_code(f8: Fp8Format) -> int:
    """Code (without sign) of the largest finite value."""
    if f8.has_inf:
        return (((1 << f8.ebits) - 2) << f8.mbits) | ((1 << f8.mbits) - 1)
    return (((1 << f8.ebits) - 1) << f8.mbits) | ((1 << f8.mbits) - 2)


# ------------------------------------------------------------------------------------------------
# Scaling


def amax_scale(amax: torch.Tensor | float, fmt="e4m3", margin: int = 0) -> torch.Tensor:
    """Per-tensor scale s with x ~= s * q: s = amax / (max_fp8 / 2^margin), so amax maps to the format's
    largest value (less a power-of-two margin). amax = 0 gives s = 1."""
    f8 = _fmt(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / (f8.max / 2**margin), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt="e4m3") -> torch.Tensor:
    """q = fp8(clamp(x / scale, -max, max)), in PyTorch (the interpreter's fp32-to-fp8 store does not
    round correctly). The clamp comes *before* the cast, as production casts do: what a cast does with
    an out-of-range value depends on the path (PyTorch 2.13's ``.to`` saturates E4M3 and sends E5M2 to
    infinity, ``Tensor.fill_`` refuses, older PyTorch returned NaN for E4M3 values >= 480), a clamp does not."""
    f8 = _fmt(fmt)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / s).clamp(-f8.max, f8.max).to(f8.torch_dtype)


def quantize_current(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling: the scale from this tensor's own amax. Returns (q, scale)."""
    scale = amax_scale(x.detach().abs().max().float(), fmt)
    return quantize(x, scale.to(x.device), fmt), scale


def quantize_rowwise(x: torch.Tensor, fmt="e4m3", dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise scaling of a 2-D tensor: one scale per slice along ``dim`` (the reduction dimension of
    the GEMM that reads it). For A (M, K) use ``dim=1``: scales (M,); for B (K, N) ``dim=0``: scales (N,)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise: x must be 2-D, got shape {tuple(x.shape)}")
    scale = amax_scale(x.detach().abs().amax(dim).float(), fmt)           # (rows,)
    return quantize(x, scale.unsqueeze(dim).to(x.device), fmt), scale


class DelayedScaling:
    """Delayed scaling (Transformer Engine's recipe): quantize with a scale computed from the amax
    *history* of earlier steps, then record this step's amax. No reduction over the tensor is needed
    before the cast, at the price of saturating when a step's amax jumps above the history."""

    def __init__(self, fmt="e4m3", history_len: int = 16, margin: int = 0):
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.fmt, self.history_len, self.margin = _fmt(fmt), history_len, margin
        self.history: list[float] = []

    def scale(self) -> torch.Tensor:
        """From the largest amax in the window; 1.0 before the first step."""
        return amax_scale(max(self.history) if self.history else 0.0, self.fmt, self.margin)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scale()
        q = quantize(x, scale.to(x.device), self.fmt)
        self.history = (self.history + [float(x.detach().abs().max())])[-self.history_len:]
        return q, scale


# ------------------------------------------------------------------------------------------------
# FP8 GEMM with per-tensor or row-wise scales


def fp8_matmul_ref(a_q, b_q, scale_a, scale_b, out_dtype=torch.float32):
    """C = (scale_a * A) @ (scale_b * B), from the fp8 codes, in fp32, cast once. Per-tensor scales
    are one-element tensors; row-wise scales are scale_a (M,) and scale_b (N,)."""
    sa = scale_a.float().reshape(-1, 1) if scale_a.numel() > 1 else scale_a.float()
    sb = scale_b.float().reshape(1, -1) if scale_b.numel() > 1 else scale_b.float()
    return ((a_q.float() @ b_q.float()) * sa * sb).to(out_dtype)


@triton.jit
def _fp8_matmul_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROWWISE: tl.constexpr = False, DEQUANT: tl.constexpr = "multiply"):
    row0, col0 = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    a_ptr += row0.to(tl.int64) * stride_am                      # int64 tile corners, int32 offsets inside
    b_ptr += col0.to(tl.int64) * stride_bn
    r, c, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    # rows past M / columns past N re-read the last one (never stored): only the K tail is masked
    rr, cc = tl.minimum(r, M - 1 - row0), tl.minimum(c, N - 1 - col0)
    a_offs = rr[:, None] * stride_am + ks[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_offs = ks[:, None] * stride_bk + cc[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + a_offs, mask=ks[None, :] < K - k0, other=0.0)   # fp8 (BLOCK_M, BLOCK_K)
        b = tl.load(b_ptr + b_offs, mask=ks[:, None] < K - k0, other=0.0)   # fp8 (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)                                  # fp8 x fp8 -> fp32 on the tensor cores
        a_ptr += BLOCK_K * stride_ak
        b_ptr += BLOCK_K * stride_bk
    if ROWWISE:                                                  # s_a (M,) per row of A, s_b (N,) per column of B
        s = tl.load(sa_ptr + row0 + rr)[:, None] * tl.load(sb_ptr + col0 + cc)[None, :]
    else:
        s = tl.load(sa_ptr) * tl.load(sb_ptr)                    # s_a * s_b
    if DEQUANT == "multiply":
        acc = acc * s                                            # C = s_a s_b (A_q @ B_q)
    else:
        acc = acc / s                                            # broken: divides by the scales
    c_ptr += row0.to(tl.int64) * stride_cm + col0.to(tl.int64) * stride_cn
    tl.store(c_ptr + r[:, None] * stride_cm + c[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(row0 + r[:, None] < M) & (col0 + c[None, :] < N))


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): from the AOT builds of compile_jobs at Llama-3 sizes (B
# K-major, as nn.Linear's weight gives it): 128 x 128 x 128 at 8 warps runs without spills with a
# 3-stage cp.async pipeline on sm89, sm90a and sm100a (tests/test_fp8.py). The interpreter takes 64-tiles.
GPU_TILE = (128, 128, 128, 8)
CPU_TILE = (64, 64, 64, 4)
GPU_STAGES = 3


def _check_scales(scale_a, scale_b, M: int, N: int) -> bool:
    """True for row-wise scales ((M,) and (N,)), False for per-tensor ones (one element each)."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise ValueError(f"fp8_matmul: {name} must be a float32 tensor")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return False
    if scale_a.shape == (M,) and scale_b.shape == (N,) and scale_a.stride(0) == 1 and scale_b.stride(0) == 1:
        return True
    raise ValueError(f"fp8_matmul: scale_a and scale_b must be one-element tensors (per-tensor) or contiguous "
                     f"({M},) and ({N},) (row-wise), got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")


def _launch_args(a_q, b_q, c, scale_a, scale_b, *, tile, num_stages: int, rowwise: bool, dequant: str = "multiply"):
    """(grid, args, kwargs) of one launch of :func:`_fp8_matmul_kernel`, shared by :func:`fp8_matmul`
    and :func:`compile_jobs` so the AOT build is the launch."""
    (M, K), N = a_q.shape, b_q.shape[1]
    bm, bn, bk, warps = tile
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    args = (a_q, b_q, c, scale_a.reshape(-1), scale_b.reshape(-1), M, N, K,
            a_q.stride(0), a_q.stride(1), b_q.stride(0), b_q.stride(1), c.stride(0), c.stride(1))
    kwargs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ROWWISE=rowwise, DEQUANT=dequant, num_warps=warps,
                  num_stages=num_stages)
    return grid, args, kwargs


def fp8_matmul(a_q: torch.Tensor, b_q: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
               out_dtype: torch.dtype = torch.float32, tile: tuple[int, int, int, int] | None = None,
               _dequant: str = "multiply") -> torch.Tensor:
    """``(scale_a * a_q) @ (scale_b * b_q)``: fp8 (M, K) and (K, N) inputs (either FP8 format, mixed
    allowed), fp32 scales per tensor (one element each) or row-wise ((M,) and (N,)), fp32 accumulation."""
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"fp8_matmul: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"fp8_matmul: {name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    if a_q.shape[1] != b_q.shape[0]:
        raise ValueError(f"fp8_matmul: inner dimensions differ: a_q is {tuple(a_q.shape)}, b_q is {tuple(b_q.shape)}")
    if a_q.device.type != runtime.device().type or b_q.device != a_q.device:
        raise ValueError(f"fp8_matmul: a_q and b_q must be on {runtime.device()}")
    (M, K), N = a_q.shape, b_q.shape[1]
    rowwise = _check_scales(scale_a, scale_b, M, N)
    c = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    on_gpu = runtime.runtime().on_gpu
    grid, args, kwargs = _launch_args(a_q, b_q, c, scale_a, scale_b, tile=tile or (GPU_TILE if on_gpu else CPU_TILE),
                                      num_stages=GPU_STAGES if on_gpu else 1, rowwise=rowwise, dequant=_dequant)
    _fp8_matmul_kernel[grid](*args, **kwargs)
    return c


# ------------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes

# (label, M, N, K): Llama-3-8B / 70B projections at a 4096-token prefill
REAL_SHAPES = (
    ("Llama-3-8B gate/up", 4096, 14336, 4096),
    ("Llama-3-8B down", 4096, 4096, 14336),
    ("Llama-3-70B gate/up", 4096, 28672, 8192),
)


def launch_job(M: int, N: int, K: int, *, tile=GPU_TILE, num_stages: int = GPU_STAGES, rowwise: bool = False,
               b_k_major: bool = True, a_fmt=torch.float8_e4m3fn, b_fmt=torch.float8_e4m3fn,
               out_dtype=torch.bfloat16):
    """The job of a GPU launch of :func:`fp8_matmul` at (M, N, K) on meta tensors. ``b_k_major``: B
    (K, N) is the transpose of an (N, K) row-major weight (stride along K = 1), as nn.Linear stores it;
    ``False`` gives a row-major (K, N) B, the layout dgrad and wgrad would read without a transpose."""
    from kernels import inspect as ki

    a = torch.empty(M, K, dtype=a_fmt, device="meta")
    b = torch.empty(N, K, dtype=b_fmt, device="meta").t() if b_k_major else torch.empty(K, N, dtype=b_fmt, device="meta")
    c = torch.empty(M, N, dtype=out_dtype, device="meta")
    sa, sb = (torch.empty(M, device="meta"), torch.empty(N, device="meta")) if rowwise else \
        (torch.empty(1, device="meta"), torch.empty(1, device="meta"))
    _, args, kwargs = _launch_args(a, b, c, sa, sb, tile=tile, num_stages=num_stages, rowwise=rowwise)
    return ki.launch_job(_fp8_matmul_kernel, *args, **kwargs)


def compile_jobs() -> dict:
    """E4M3 x E4M3 -> bf16 at :data:`REAL_SHAPES` with per-tensor scales, and the 8B gate/up row-wise."""
    jobs = {f"{label} prefill, per-tensor": launch_job(M, N, K) for label, M, N, K in REAL_SHAPES}
    jobs["Llama-3-8B gate/up prefill, row-wise"] = launch_job(4096, 14336, 4096, rowwise=True)
    return jobs


# ------------------------------------------------------------------------------------------------
# FP8 training: which GEMM reads which format

# A linear layer Y = X W^T costs three GEMMs per training step. With the HYBRID recipe (Transformer
# Engine; Micikevicius et al., 2022) activations and weights are E4M3 and the gradient dY is E5M2.


def training_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor | None = None) -> dict:
    """The GEMMs of one linear layer's step, as {name: (equation, A, B)} with A (rows, R) @ B (R, cols)
    and R the reduction: views of x (M, K), w (N, K) and dy (M, N) as they are stored, no copy.

        fprop  Y  = X W^T     A = X (M, K),     B = W^T (K, N)
        dgrad  dX = dY W      A = dY (M, N),    B = W (N, K)        (only with dy)
        wgrad  dW = dY^T X    A = dY^T (N, M),  B = X (M, K)        (only with dy)

    An operand is *K-major* when its reduction dimension has stride 1 (A.stride(1), B.stride(0));
    Hopper's FP8 wgmma reads only K-major operands from shared memory."""
    gemms = {"fprop": ("Y = X W^T", x, w.t())}
    if dy is not None:
        gemms["dgrad"] = ("dX = dY W", dy, w)
        gemms["wgrad"] = ("dW = dY^T X", dy.t(), x)
    return gemms


class _Fp8LinearFn(torch.autograd.Function):
    """Y = X W^T with all three GEMMs of :func:`training_gemms` on FP8 codes (current scaling per
    tensor), fp32 accumulation. The master weight stays fp32; only its cast enters the GEMMs."""

    @staticmethod
    def forward(ctx, x, w, grad_fmt):
        xq, sx = quantize_current(x, "e4m3")
        wq, sw = quantize_current(w, "e4m3")
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.grad_fmt = grad_fmt
        _, a, b = training_gemms(xq, wq)["fprop"]
        return fp8_matmul_ref(a, b, sx, sw)                                   # E4M3 x E4M3

    @staticmethod
    def backward(ctx, dy):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = quantize_current(dy, ctx.grad_fmt)                           # E5M2 under HYBRID
        gemms = training_gemms(xq, wq, gq)
        dx = fp8_matmul_ref(*gemms["dgrad"][1:], sg, sw)
        dw = fp8_matmul_ref(*gemms["wgrad"][1:], sg, sx)
        return dx, dw, None


class Fp8Linear(torch.nn.Module):
    """A bias-free nn.Linear whose three GEMMs read FP8 (``grad_fmt="e5m2"``: HYBRID; ``"e4m3"``: E4M3
    everywhere), with an fp32 master weight that the optimizer updates."""

    def __init__(self, weight: torch.Tensor, grad_fmt: str = "e5m2"):
        super().__init__()
        _fmt(grad_fmt)
        self.weight = torch.nn.Parameter(weight.detach().float().clone())    # the fp32 master copy
        self.grad_fmt = grad_fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = _Fp8LinearFn.apply(x.reshape(-1, shape[-1]).float(), self.weight, self.grad_fmt)
        return y.reshape(*shape[:-1], -1)


def fp8_blocks(model: torch.nn.Module, grad_fmt: str = "e5m2") -> torch.nn.Module:
    """``model`` (in place) with every nn.Linear inside its transformer blocks replaced by
    :class:`Fp8Linear`; embeddings, norms, attention's softmax and the output head keep full precision."""
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    if child.bias is not None:
                        raise ValueError(f"fp8_blocks: {name} has a bias, which Fp8Linear does not implement")
                    setattr(parent, name, Fp8Linear(child.weight, grad_fmt))
    return model
