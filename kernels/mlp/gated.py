"""Gated MLPs: the GLU family's fused elementwise kernels, and the LLaMA MLP.

A gated linear unit multiplies an activated *gate* projection by a linear *up* projection
(Dauphin et al., 2017; Shazeer, 2020):

    h = act(x W_gate^T) * (x W_up^T),       y = h W_down^T

    SwiGLU: act = SiLU (Swish-1):  silu(g) = g * sigmoid(g)
    GeGLU:  act = GELU:            gelu(g) = g * Phi(g)         (exact, through erf)
                                   or g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)
                                   (the tanh approximation: 0.5 (1 + tanh u) = sigmoid(2u))
    ReGLU:  act = ReLU:            relu(g) = max(g, 0)

The kernels here fuse the elementwise middle, ``h = act(gate) * up``: they read gate and up once
and write h once (3 tensors of traffic instead of the 5 that a separate activation and multiply
move), and the backward recomputes act(gate) instead of storing it:

    d up   = dh * act(gate)
    d gate = dh * up * act'(gate)

Production computes gate and up with one GEMM on the concatenated (2h, d) weight [W_gate; W_up]
and hands the activation its (T, 2h) output (vLLM's MergedColumnParallelLinear and SiluAndMul):
:func:`swiglu_fused` reads gate at column j and up at column h + j of each row, by stride, and its
backward writes d gate and d up into one (T, 2h) gradient, the one the merged GEMM's backward takes.

The matrix products stay in PyTorch (``llama_mlp_ref``, :class:`LlamaMLP`); the GEMM chapters
cover them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime
from kernels.rows import RowBudget, as_rows, check_block_size, warps_for

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
# 8 elements a thread: 1024-element blocks take 4 warps.
GLU_BUDGET = RowBudget(per_thread=8, max_block=1024)


# ----------------------------------------------------------------------------------------------
# References (PyTorch)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 (float64 kept), returned wide."""
    return F.silu(_wide(gate)) * _wide(up)


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up in fp32 (float64 kept), returned wide; ``approximate`` as in F.gelu."""
    return F.gelu(_wide(gate), approximate=approximate) * _wide(up)


def reglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """relu(gate) * up in fp32 (float64 kept), returned wide."""
    return F.relu(_wide(gate)) * _wide(up)


def llama_mlp_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The LLaMA feed-forward block: ``(silu(x W_gate^T) * (x W_up^T)) W_down^T``.

    Weights are laid out as ``nn.Linear`` stores them: w_gate and w_up are (hidden, d), w_down is
    (d, hidden). Computed in fp32 from the same inputs (float64 kept), returned wide.
    """
    x, w_gate, w_up, w_down = (_wide(t) for t in (x, w_gate, w_up, w_down))
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def fuse_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The fused layout: W_gate (h, d) stacked on W_up (h, d) as one (2h, d) weight, so that one GEMM
    ``x W_gu^T`` (T, 2h) computes both projections; its first h columns are the gate, the last h the up."""
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape:
        raise ValueError(f"fuse_gate_up: w_gate and w_up must be (hidden, d) of one shape, got "
                         f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    return torch.cat([w_gate, w_up], dim=0)


def llama_mlp_fused_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """:func:`llama_mlp_ref` with the fused (2h, d) gate/up weight: one GEMM, then split into views.

    ``gate, up = (x W_gu^T).chunk(2, -1)``: two (T, h) views with row stride 2h, no copy.
    Computed in fp32 from the same inputs (float64 kept), returned wide.
    """
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2:
        raise ValueError(f"llama_mlp_fused_ref: w_gate_up must be (2 * hidden, d), got {tuple(w_gate_up.shape)}")
    x, w_gate_up, w_down = (_wide(t) for t in (x, w_gate_up, w_down))
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)                      # (T, 2h) -> two (T, h) views
    return (F.silu(gate) * up) @ w_down.T


def swiglu_fused_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the (..., 2h) output of the merged gate/up GEMM: gate is the first h
    columns, up the last h (vLLM's SiluAndMul). fp32 (float64 kept), returned wide, (..., h)."""
    gate, up = _wide(gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def llama_hidden_size(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The hidden width Meta's LLaMA code picks: two thirds of 4d, times an optional multiplier, rounded
    up to ``multiple_of``. Three d x h matrices at h = 8d/3 hold as many parameters as the two
    d x 4d matrices of a plain MLP (3 * 8/3 = 2 * 4 = 8 d^2). LLaMA-7B: d = 4096 gives 11008;
    Llama 3 8B (multiplier 1.3, multiple_of 1024) 14336; Llama 2 70B (1.3, 4096) 28672."""
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def mlp_parameters(d_model: int, hidden: int, *, gated: bool, bias: bool = False) -> int:
    """Weights (and biases) of a feed-forward block: 2 matrices (up, down) or 3 when gated."""
    matrices = 3 if gated else 2
    biases = ((2 if gated else 1) * hidden + d_model) if bias else 0
    return matrices * d_model * hidden + biases


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _act_and_grad(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) for one activation, in fp32."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = g * s                                         # silu(g) = g sigmoid(g)
        da = s * (1.0 + g * (1.0 - s))                    # sigmoid(g) (1 + g (1 - sigmoid(g)))
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))   # Phi(g)
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327           # phi(g) = exp(-g^2/2) / sqrt(2 pi)
        a = g * cdf                                       # gelu(g) = g Phi(g)
        da = cdf + g * pdf
    elif ACTIVATION == "gelu_tanh":
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)       # sqrt(2/pi) (g + 0.044715 g^3)
        s = tl.sigmoid(2.0 * u)                           # = 0.5 (1 + tanh u): no libdevice tanh needed
        a = g * s
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        da = s + g * 2.0 * s * (1.0 - s) * du             # d/dg sigmoid(2u) = 2 s (1 - s) u'
    else:  # relu
        a = tl.maximum(g, 0.0)
        da = tl.where(g > 0.0, 1.0, 0.0)                  # 0 at g = 0, as torch's relu backward
    return a, da


@triton.jit
def _act(g, ACTIVATION: tl.constexpr):
    """act(g) alone (the forward needs no derivative)."""
    if ACTIVATION == "silu":
        a = g * tl.sigmoid(g)
    elif ACTIVATION == "gelu":
        a = g * 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 2 sqrt(2/pi) = 1.5958
    else:
        a = tl.maximum(g, 0.0)
    return a


@triton.jit
def _glu_fwd_kernel(gate_ptr, up_ptr, h_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """h = act(gate) * up over n elements, BLOCK per program: 2 reads and 1 write per element."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = _act(g, ACTIVATION) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(gate_ptr, up_ptr, dh_ptr, dgate_ptr, dup_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """d up = dh act(gate), d gate = dh up act'(gate): 3 reads and 2 writes per element, act recomputed."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACTIVATION)
    tl.store(dup_ptr + offs, (dh * a).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (dh * u * da).to(dgate_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_fused_fwd_kernel(gu_ptr, h_ptr, T, H, stride_gu, stride_h, ACTIVATION: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """h[t, j] = act(gu[t, j]) * gu[t, H + j]: gate and up are the two halves of each row of the
    (T, 2H) merged GEMM output, read by stride; a (BLOCK_T, BLOCK_H) tile per program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)   # int64: rows * stride may pass 2**31
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)                         # (BLOCK_T, BLOCK_H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]                # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)               # up: column H + j, same row
    h = _act(g, ACTIVATION) * u
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_fused_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, T, H, stride_gu, stride_dh, stride_dgu,
                          ACTIVATION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """d gu[t, j] = dh up act'(gate) and d gu[t, H + j] = dh act(gate): the gradient of the (T, 2H)
    merged GEMM output in the same layout, act recomputed from gate."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACTIVATION)
    dgate = dgu_ptr + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgate, (dh * u * da).to(dgu_ptr.dtype.element_ty), mask=mask)  # d gate: column j
    tl.store(dgate + H, (dh * a).to(dgu_ptr.dtype.element_ty), mask=mask)   # d up: column H + j


# ----------------------------------------------------------------------------------------------
# Launchers


def launch(block_size: int | None = None, *, on_gpu: bool | None = None) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of the GLU kernels. They are elementwise over the flattened
    (tokens x hidden) tensors, so the launch does not depend on the width: on a GPU 1024 elements
    per program with 4 warps, 8 elements a thread (one 16-byte load of fp16 per tensor), which
    compiles without spills for every activation (tests/test_row_kernels_aot.py); on the
    interpreter 8192, fewer and larger programs. ``block_size`` overrides the block."""
    gpu = runtime.runtime().on_gpu if on_gpu is None else on_gpu
    block = block_size or (1024 if gpu else 8192)
    return block, warps_for(block, GLU_BUDGET)


def launch_fused(hidden: int, block_size: int | None = None, *, on_gpu: bool | None = None) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, num_warps)`` of the fused-layout kernels. On a GPU one row segment of 1024
    columns a program with 4 warps, 8 elements a thread, as :func:`launch` (Llama 3 8B's h = 14336 is
    14 programs a row); on the interpreter 16 rows by up to 1024 columns, fewer and larger programs.
    ``block_size`` overrides BLOCK_H (a power of two)."""
    gpu = runtime.runtime().on_gpu if on_gpu is None else on_gpu
    block_h = block_size or min(triton.next_power_of_2(max(hidden, 16)), 1024)
    block_t = 1 if gpu else 16
    return block_t, block_h, warps_for(block_t * block_h, GLU_BUDGET)


def _fused_forward_args(gu, h, activation: str, block_t: int, block_h: int, warps: int):
    """(grid, args, kwargs) of the fused-layout forward over (T, 2H) ``gu`` into (T, H) ``h``."""
    T, H = h.shape
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    return grid, (gu, h, T, H, gu.stride(0), h.stride(0)), dict(ACTIVATION=activation, BLOCK_T=block_t,
                                                               BLOCK_H=block_h, num_warps=warps)


def _fused_backward_args(gu, dh, dgu, activation: str, block_t: int, block_h: int, warps: int):
    """(grid, args, kwargs) of the fused-layout backward: (T, 2H) ``gu``, (T, H) ``dh`` into (T, 2H) ``dgu``."""
    T, H = dh.shape
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    return grid, (gu, dh, dgu, T, H, gu.stride(0), dh.stride(0), dgu.stride(0)), dict(
        ACTIVATION=activation, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)


def _forward_args(g, u, h, activation: str, block: int, warps: int):
    """(grid, args, kwargs) of the forward launch over the flattened tensors; shared by the launcher
    and :func:`launch_jobs`."""
    n = g.numel()
    return (triton.cdiv(n, block),), (g, u, h, n), dict(ACTIVATION=activation, BLOCK=block, num_warps=warps)


def _backward_args(g, u, dh, dgate, dup, activation: str, block: int, warps: int):
    """(grid, args, kwargs) of the backward launch; shared by the launcher and :func:`launch_jobs`."""
    n = g.numel()
    return ((triton.cdiv(n, block),), (g, u, dh, dgate, dup, n),
            dict(ACTIVATION=activation, BLOCK=block, num_warps=warps))


def launch_jobs(dtype: torch.dtype = torch.float16, tokens: int = 4096, hidden: int = 14336) -> list:
    """``(label, TritonJob)`` of the forward and backward launches each activation makes on a GPU for
    (tokens, hidden) gate and up tensors (Llama-3-8B's 14336 by default), on meta tensors
    (:func:`kernels.inspect.launch_job`: Triton's own specialisation of the launch's arguments)."""
    from kernels import inspect as ki

    g = torch.empty(tokens, hidden, dtype=dtype, device="meta")        # (tokens, hidden): gate, up, h alike
    block, warps = launch(on_gpu=True)
    jobs = []
    for act in ACTIVATIONS:
        grid, args, kwargs = _forward_args(g, g, g, act, block, warps)
        jobs.append((f"glu fwd {act}", ki.launch_job(_glu_fwd_kernel, *args, grid=grid, **kwargs)))
        grid, args, kwargs = _backward_args(g, g, g, g, g, act, block, warps)
        jobs.append((f"glu bwd {act}", ki.launch_job(_glu_bwd_kernel, *args, grid=grid, **kwargs)))
    return jobs


def fused_launch_jobs(dtype: torch.dtype = torch.float16, tokens: int = 4096, hidden: int = 14336) -> list:
    """``(label, TritonJob)`` of :func:`swiglu_fused`'s forward and backward on a GPU, reading the
    (tokens, 2 hidden) merged GEMM output (Llama-3-8B's 4096 x 28672 by default), on meta tensors."""
    from kernels import inspect as ki

    gu = torch.empty(tokens, 2 * hidden, dtype=dtype, device="meta")   # [gate | up] of each token
    h = torch.empty(tokens, hidden, dtype=dtype, device="meta")        # h, and dh in the backward
    block_t, block_h, warps = launch_fused(hidden, on_gpu=True)
    grid, args, kwargs = _fused_forward_args(gu, h, "silu", block_t, block_h, warps)
    fwd = ki.launch_job(_glu_fused_fwd_kernel, *args, grid=grid, **kwargs)
    grid, args, kwargs = _fused_backward_args(gu, h, gu, "silu", block_t, block_h, warps)
    bwd = ki.launch_job(_glu_fused_bwd_kernel, *args, grid=grid, **kwargs)
    return [("glu fused-layout fwd silu", fwd), ("glu fused-layout bwd silu", bwd)]


def compile_jobs() -> dict:
    """Llama-3-8B's MLP (4096 tokens x 14336 hidden), fp16 and bf16: the forward and backward of every
    activation on separate gate and up tensors, and SwiGLU's on the (4096, 28672) merged GEMM output."""
    return {f"Llama-3-8B 4096 x 14336 {str(dt).removeprefix('torch.')}: {label}": job
            for dt in (torch.float16, torch.bfloat16) for label, job in launch_jobs(dt) + fused_launch_jobs(dt)}


def _check(fn: str, gate, up) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{fn}: {name} is on {t.device}, kernels run on {runtime.device()} here")
    if gate.shape != up.shape:
        raise ValueError(f"{fn}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"{fn}: gate and up must share a dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"{fn}: gate is on {gate.device} but up is on {up.device}")


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, block_size):
        g, u = gate.contiguous(), up.contiguous()      # a view with other strides is copied first
        h = torch.empty_like(g, memory_format=torch.contiguous_format)
        n = g.numel()
        block, warps = launch(block_size)
        if n:
            grid, args, kwargs = _forward_args(g, u, h, activation, block, warps)
            _glu_fwd_kernel[grid](*args, **kwargs)
        ctx.save_for_backward(g, u)
        ctx.activation, ctx.block_size = activation, block_size
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        dh = dh.to(g.dtype).contiguous()
        dgate, dup = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        block, warps = launch(ctx.block_size)
        if n:
            grid, args, kwargs = _backward_args(g, u, dh, dgate, dup, ctx.activation, block, warps)
            _glu_bwd_kernel[grid](*args, **kwargs)
        return dgate, dup, None, None


def _glu(fn: str, gate, up, activation: str, block_size: int | None) -> torch.Tensor:
    _check(fn, gate, up)
    check_block_size(fn, block_size, minimum=16)
    return _GLU.apply(gate, up, activation, block_size)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """``silu(gate) * up``, fused, in Triton; differentiable. Same-shape fp16/bf16/fp32 inputs;
    fp32 arithmetic; the result has the inputs' dtype and shape (contiguous)."""
    return _glu("swiglu", gate, up, "silu", block_size)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *, block_size: int | None = None) -> torch.Tensor:
    """``gelu(gate, approximate) * up``, fused, in Triton; differentiable.

    ``approximate="none"``: the exact GELU, g Phi(g) through erf; ``"tanh"``: the tanh
    approximation of Hendrycks and Gimpel, computed as g sigmoid(2u) (equal to 0.5 g (1 + tanh u)).
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _glu("geglu", gate, up, "gelu" if approximate == "none" else "gelu_tanh", block_size)


def reglu(gate: torch.Tensor, up: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """``relu(gate) * up``, fused, in Triton; differentiable (the gradient at gate = 0 is 0, as torch's)."""
    return _glu("reglu", gate, up, "relu", block_size)


class _GLUFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, activation, block_size):
        H = gu.shape[-1] // 2
        gu2 = as_rows(gu)                              # (T, 2H) with unit column stride; row stride kept
        h = torch.empty(gu2.shape[0], H, dtype=gu.dtype, device=gu.device)
        block_t, block_h, warps = launch_fused(H, block_size)
        if h.numel():
            grid, args, kwargs = _fused_forward_args(gu2, h, activation, block_t, block_h, warps)
            _glu_fused_fwd_kernel[grid](*args, **kwargs)
        ctx.save_for_backward(gu2)
        ctx.activation, ctx.block_size, ctx.shape = activation, block_size, gu.shape
        return h.view(*gu.shape[:-1], H)

    @staticmethod
    def backward(ctx, dh):
        (gu2,) = ctx.saved_tensors
        H = gu2.shape[1] // 2
        dh2 = as_rows(dh.to(gu2.dtype))
        dgu = torch.empty(gu2.shape, dtype=gu2.dtype, device=gu2.device)   # (T, 2H): [d gate | d up]
        block_t, block_h, warps = launch_fused(H, ctx.block_size)
        if dgu.numel():
            grid, args, kwargs = _fused_backward_args(gu2, dh2, dgu, ctx.activation, block_t, block_h, warps)
            _glu_fused_bwd_kernel[grid](*args, **kwargs)
        return dgu.view(ctx.shape), None, None


def swiglu_fused(gate_up: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` from the (..., 2h) output of the merged gate/up GEMM, in Triton;
    differentiable. Gate is the first h columns, up the last h (concatenated, as vLLM's
    MergedColumnParallelLinear lays them out); rows may have any stride (no copy), columns must be
    contiguous or are copied. Returns (..., h) in the input's dtype; the gradient is (..., 2h)."""
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"swiglu_fused: gate_up must be a torch.Tensor, got {type(gate_up).__name__}")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_fused: gate_up must be (..., 2 * hidden) with an even last dimension, "
                         f"got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"swiglu_fused: gate_up has dtype {gate_up.dtype}; supported: float16, bfloat16, float32")
    if gate_up.device.type != runtime.device().type:
        raise ValueError(f"swiglu_fused: gate_up is on {gate_up.device}, kernels run on {runtime.device()} here")
    check_block_size("swiglu_fused", block_size, minimum=16)
    return _GLUFused.apply(gate_up, "silu", block_size)


class LlamaMLP(torch.nn.Module):
    """LLaMA's feed-forward block as production runs it: one GEMM on the merged (2h, d) gate/up
    weight, the fused-layout SwiGLU on its (T, 2h) output, then the down projection.

    ``gate_up_proj.weight`` is :func:`fuse_gate_up` of a checkpoint's gate_proj and up_proj weights
    (vLLM's MergedColumnParallelLinear, gate shard 0, up shard 1). ``hidden`` defaults to
    :func:`llama_hidden_size` (the 2/3 rule). No biases, as in LLaMA.
    """

    def __init__(self, d_model: int, hidden: int | None = None, *, multiple_of: int = 256,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.d_model = d_model
        self.hidden = hidden if hidden is not None else llama_hidden_size(d_model, multiple_of)
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_up_proj = torch.nn.Linear(d_model, 2 * self.hidden, **kw)    # weight (2h, d): [W_gate; W_up]
        self.down_proj = torch.nn.Linear(self.hidden, d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"LlamaMLP: x must end in d_model={self.d_model} features, got shape {tuple(x.shape)}")
        return self.down_proj(swiglu_fused(self.gate_up_proj(x)))              # (..., 2h) -> (..., h) -> (..., d)
