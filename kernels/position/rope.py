"""RoPE (rotary position embedding): q and k rotated in one fused launch, forward and backward.

RoFormer (Su et al., 2021) asks for an encoding f(x, m) of a vector x at position m such that the
score <f(q, m), f(k, n)> depends on m and n only through m - n. Treating each pair of dimensions as
one complex number z_i = x_{a(i)} + j x_{b(i)}, the answer is a rotation by m theta_i:

    f(x, m)_i = z_i e^{j m theta_i},   theta_i = base^(-2i/D),   i = 0 .. D/2 - 1
    Re(f(q, m)_i conj(f(k, n)_i)) = Re(q_i conj(k_i) e^{j (m - n) theta_i})      <- only m - n

In real arithmetic, pair (x1, x2) at angle a = m theta_i becomes

    y1 = x1 cos a - x2 sin a
    y2 = x2 cos a + x1 sin a

Two layouts choose which dimensions form the pairs (a(i), b(i)):
* half-split, "rotate half" (GPT-NeoX, Llama, the course's tiny GPT): (i, i + D/2);
* interleaved (GPT-J, Meta's original Llama code with complex views): (2i, 2i + 1).
The same weights give different results under the two layouts; a checkpoint fixes one.

A rotation is orthogonal, so the backward pass is the rotation by -a (R(a)^T = R(-a)): dL/dx is
the incoming gradient rotated with sin negated. The kernel does both with one flag (CONJUGATE).

Shapes: q (B, T, Hq, D), k (B, T, Hkv, D), any strides (the layout straight out of the projection,
or a transposed (B, H, T, D) view); cos, sin (S, D/2) tables, row p holding position p;
positions (T,) or (B, T) integers in [0, S), one per token, so packed sequences (positions that
restart at 0) and decode steps at an offset are the same call. One program per token rotates all
of that token's query and key heads: B * T programs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Frequencies and tables


def rope_frequencies(dim: int, base: float = 10000.0, scaling: dict | None = None, *,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """The (dim/2,) float64 inverse frequencies theta_i = base^(-2i/dim), and the attention factor.

    ``scaling`` stretches them past the training length; its ``"type"`` is one of ``"linear"``,
    ``"ntk"``, ``"dynamic"``, ``"yarn"``, ``"llama3"`` (:mod:`kernels.position.scaling`, which
    documents each rule and its parameters). The attention factor multiplies cos and sin (YaRN's
    temperature; 1.0 for every other rule). ``seq_len`` is the current length, read by ``"dynamic"``.
    """
    if not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"rope_frequencies: dim must be a positive even integer, got {dim!r}")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
        raise ValueError(f"rope_frequencies: base must be a finite number > 1, got {base!r}")
    inv_freq = float(base) ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)   # theta_i = base^(-2i/D)
    if scaling is None:
        return inv_freq, 1.0
    from kernels.position.scaling import scale_frequencies
    return scale_frequencies(inv_freq, dim, float(base), scaling, seq_len=seq_len)


def rope_cos_sin(inv_freq: torch.Tensor, length: int, *, attention_factor: float = 1.0,
                 dtype: torch.dtype = torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (length, D/2): row p holds cos(p theta_i), sin(p theta_i) times ``attention_factor``.

    The angles are formed in float64 and rounded once (an fp32 product p * theta at p ~ 1e5 would
    already be off by ~1e-2 rad in its last bits).
    """
    if inv_freq.dim() != 1:
        raise ValueError(f"rope_cos_sin: inv_freq must be 1-D (D/2,), got shape {tuple(inv_freq.shape)}")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"rope_cos_sin: length must be a positive integer, got {length!r}")
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]   # (S, D/2): p theta_i
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    device = device or runtime.device()
    return cos.to(device, dtype), sin.to(device, dtype)


# ----------------------------------------------------------------------------------------------
# Reference


def _pair_index(D: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dimensions (a(i), b(i)) of pair i: (2i, 2i+1) interleaved, (i, i + D/2) half-split."""
    i = torch.arange(D // 2)
    return (2 * i, 2 * i + 1) if interleaved else (i, i + D // 2)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (B, T, H, D) rotated pairwise by the per-token angles whose cos, sin are (B, T, 1, D/2)."""
    a, b = _pair_index(x.shape[-1], interleaved)
    wide = cos.dtype
    x1, x2 = x[..., a].to(wide), x[..., b].to(wide)
    out = torch.empty_like(x, dtype=wide)
    out[..., a] = x1 * cos - x2 * sin          # y1 = x1 cos - x2 sin
    out[..., b] = x2 * cos + x1 * sin          # y2 = x2 cos + x1 sin
    return out.to(x.dtype)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor | None = None, *, interleaved: bool = False):
    """RoPE in PyTorch, computed in fp32 (float64 for float64 inputs) and returned in q's and k's dtypes."""
    B, T = q.shape[0], q.shape[1]
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    pos = _positions(positions, B, T, q.device).long()               # (B, T)
    c = cos.to(wide)[pos][:, :, None, :]                              # (B, T, 1, D/2)
    s = sin.to(wide)[pos][:, :, None, :]
    return _rotate_ref(q, c, s, interleaved), _rotate_ref(k, c, s, interleaved)


# ----------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_h, stride_d, H, HALF, cos, sin,
                  INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the (H, D) rows of one token at x_ptr into the contiguous (H, D) rows at o_ptr."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (i < HALF)[None, :]
    if INTERLEAVED:
        a = 2 * i                              # pair i = dimensions (2i, 2i + 1)
        b = 2 * i + 1
    else:
        a = i                                  # pair i = dimensions (i, i + D/2)
        b = i + HALF
    x1 = tl.load(x_ptr + h[:, None] * stride_h + a[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h[:, None] * stride_h + b[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]     # y1 = x1 cos a - x2 sin a
    y2 = x2 * cos[None, :] + x1 * sin[None, :]     # y2 = x2 cos a + x1 sin a
    out = o_ptr + h[:, None] * (2 * HALF)
    tl.store(out + a[None, :], y1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(out + b[None, :], y2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_pb, stride_pt, stride_cs, stride_ci,
    T, Hq, Hkv, HALF,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)        # token b * T + t; int64: B*T*H*D can pass 2**31
    b = tok // T
    t = tok % T
    p = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.int64)   # this token's position
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_ptr + p * stride_cs + i * stride_ci, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + p * stride_cs + i * stride_ci, mask=i_ok, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin                             # backward: R(a)^T = R(-a)
    _rotate_heads(q_ptr + b * stride_qb + t * stride_qt, qo_ptr + tok * Hq * 2 * HALF, stride_qh, stride_qd,
                  Hq, HALF, cos, sin, INTERLEAVED, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + b * stride_kb + t * stride_kt, ko_ptr + tok * Hkv * 2 * HALF, stride_kh, stride_kd,
                  Hkv, HALF, cos, sin, INTERLEAVED, BLOCK_HK, BLOCK_HALF)


def rope_launch(Hq: int, Hkv: int, D: int) -> dict:
    """Tiles and warps for one token's heads: every head and pair in one tile, 4 warps up to 4096
    pairs (Hq + Hkv heads x D/2), 8 beyond."""
    pairs = (Hq + Hkv) * (D // 2)
    return dict(BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hkv),
                BLOCK_HALF=triton.next_power_of_2(D // 2), num_warps=4 if pairs <= 4096 else 8)


def _rope_args(q, k, qo, ko, cos, sin, pos, interleaved: bool, conjugate: bool):
    """(grid, args, kwargs) of the kernel's launch, one program per token; shared by :func:`_launch`
    and :func:`launch_job`."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    args = (q, k, qo, ko, cos, sin, pos, *q.stride(), *k.stride(), *pos.stride(), *cos.stride(), T, Hq, Hkv, D // 2)
    return (B * T,), args, dict(INTERLEAVED=interleaved, CONJUGATE=conjugate, **rope_launch(Hq, Hkv, D))


def _launch(q, k, cos, sin, pos, interleaved: bool, conjugate: bool):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qo = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, T, Hkv, D), dtype=k.dtype, device=k.device)
    grid, args, kwargs = _rope_args(q, k, qo, ko, cos, sin, pos, interleaved, conjugate)
    _rope_kernel[grid](*args, **kwargs)
    return qo, ko


def launch_job(Hq: int, Hkv: int, D: int, *, dtype: torch.dtype = torch.bfloat16, batch: int = 1,
               tokens: int = 8192, interleaved: bool = False, target: str = "sm90"):
    """The job of the launch :func:`rope` makes for ``batch`` sequences of ``tokens`` contiguous
    (B, T, H, D) queries and keys with a table of ``tokens`` positions, on meta tensors
    (:func:`kernels.inspect.launch_job`: Triton's own specialisation, so the unit strides of the head
    dimension, the positions and the table become constants, as on a GPU)."""
    from kernels import inspect as ki

    q = torch.empty(batch, tokens, Hq, D, dtype=dtype, device="meta")        # (B, T, Hq, D)
    k = torch.empty(batch, tokens, Hkv, D, dtype=dtype, device="meta")       # (B, T, Hkv, D)
    cos = torch.empty(tokens, D // 2, dtype=torch.float32, device="meta")    # (S, D/2) angles' cosines
    pos = torch.empty(batch, tokens, dtype=torch.int64, device="meta")       # (B, T) positions
    grid, args, kwargs = _rope_args(q, k, torch.empty_like(q), torch.empty_like(k), cos, cos, pos, interleaved, False)
    return ki.launch_job(_rope_kernel, *args, target=target, grid=grid, **kwargs)


# (label, query heads, K/V heads, head dim, interleaved) of real models' RoPE
REAL_CONFIGS = (
    ("Llama-3-8B", 32, 8, 128, False),
    ("Llama-3-70B", 64, 8, 128, False),
    ("Qwen2-VL-7B", 28, 4, 128, False),
)


def compile_jobs() -> dict:
    """The forward launch at :data:`REAL_CONFIGS`, bf16, one sequence of 8192 tokens."""
    return {f"{label}: {hq} + {hkv} heads, D {d}, bf16": launch_job(hq, hkv, d, interleaved=inter)
            for label, hq, hkv, d, inter in REAL_CONFIGS}


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, pos, interleaved, conjugate_backward):
        ctx.save_for_backward(cos, sin, pos)
        ctx.args = (interleaved, conjugate_backward)
        return _launch(q, k, cos, sin, pos, interleaved, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, pos = ctx.saved_tensors
        interleaved, conjugate = ctx.args
        gq, gk = _launch(dq, dk, cos, sin, pos, interleaved, conjugate)   # dL/dx = R(-a) dL/dy
        return gq, gk, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Entry


def _positions(positions, B: int, T: int, device) -> torch.Tensor:
    """(B, T) view of the positions (``None``: 0..T-1 for every sequence)."""
    if positions is None:
        return torch.arange(T, device=device).expand(B, T)
    return positions.expand(B, T) if positions.dim() == 1 else positions


def check_rope_inputs(q, k, cos, sin, positions, name: str = "rope") -> None:
    for arg, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    for arg, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D (B, T, H, D), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    B, T, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"{name}: q is (B={B}, T={T}, Hq, D={D}) but k is {tuple(k.shape)}; B, T and D must match")
    if D % 2:
        raise ValueError(f"{name}: head dim D={D} must be even (RoPE rotates pairs of dimensions)")
    if cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() != 2 or cos.shape[1] != D // 2:
        raise ValueError(f"{name}: cos and sin must be (S, D/2) = (S, {D // 2}) tables, got {tuple(cos.shape)}")
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise TypeError(f"{name}: positions must be an integer tensor, got "
                            f"{getattr(positions, 'dtype', type(positions).__name__)}")
        if positions.shape not in ((T,), (B, T)):
            raise ValueError(f"{name}: positions must be (T,) = ({T},) or (B, T) = ({B}, {T}), "
                             f"got {tuple(positions.shape)}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
            raise ValueError(f"{name}: positions must lie in [0, {cos.shape[0]}) (the cos/sin tables' rows), "
                             f"got [{int(positions.min())}, {int(positions.max())}]")
    elif T > cos.shape[0]:
        raise ValueError(f"{name}: {T} tokens at positions 0..{T - 1} exceed the {cos.shape[0]} rows of cos/sin")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor | None = None, *, interleaved: bool = False):
    """Rotate q (B, T, Hq, D) and k (B, T, Hkv, D) by their tokens' positions; one launch for both.

    ``cos``, ``sin``: (S, D/2) tables (:func:`rope_cos_sin`); ``positions``: (T,) or (B, T)
    integers in [0, S), default 0..T-1. ``interleaved`` pairs (2i, 2i+1) (GPT-J) instead of
    (i, i + D/2) (GPT-NeoX/Llama). Returns new contiguous (q_rot, k_rot) in the inputs' dtypes,
    differentiable in q and k (the backward rotates the gradients by -angle). Checking the
    positions against S reads them on the host (one synchronisation per call).
    """
    check_rope_inputs(q, k, cos, sin, positions)
    pos = _positions(positions, q.shape[0], q.shape[1], q.device)
    return _Rope.apply(q, k, cos, sin, pos, bool(interleaved), True)
