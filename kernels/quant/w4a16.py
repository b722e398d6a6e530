"""W4A16 matmul: 4-bit weights unpacked and dequantized inside the kernel, 16-bit activations.

The weight-only formats of AWQ and GPTQ keep W (N, K) as asymmetric 4-bit codes q in [0, 15] with
one scale s and one zero point z per group of g consecutive k (g = 128 in both papers):

    W_nk ~ s_{n, k // g} (q_nk - z_{n, k // g})                         (1)
    Y_mn = sum_k X_mk W_nk

There is no 4-bit x 16-bit tensor-core instruction, so the kernel loads the packed bytes (two codes
per byte: 0.5 byte per weight, plus 2 bytes of fp16 scale and 1 byte of uint8 zero point per group:
4 + 24 / g bits per weight, 4.19 at g = 128; checkpoint formats pack the zero point in 4 bits,
4.16), expands them to fp16 in registers with equation (1), and feeds an ordinary fp16 ``tl.dot``.
At decode (M of a few tokens) the matmul is bound by the bytes of W, so 4.19 bits instead of 16 per
weight is up to 3.8x less time; at large M the unpacking is extra work on the critical path and fp16
GEMMs win (the Marlin paper measures where).

One K step of the kernel covers BLOCK_K = min(g, 128) columns, which lies inside one group, so
each output channel needs one (s, z) pair per step, loaded as a (BLOCK_N,) vector.

**Split-K at decode.** At M = 1 there is one row of output tiles: N = 4096 with BLOCK_N = 64 is 64
programs, half of an H100's 132 SMs, each streaming a whole K row of weights. Split-K gives every
(tile, K chunk) its own program; each writes an fp32 partial (S, M, N) and the partials are summed
in a fixed order (deterministic, unlike atomics):

    Y = sum_{s < S} X[:, K_s] W[:, K_s]^T,   K_s = [s K / S, (s + 1) K / S)   (2)

:func:`choose_split_k` picks S: the smallest power of two that gives at least one program per SM,
with every chunk a whole number of K steps. At large M there are enough tiles and S = 1.

What the split costs in exactness: nothing beyond fp32 accumulation. Each product x_mk W_nk of two fp16
values is exact in fp32; the sums round, split or not; the partials stay fp32 (never the output
dtype) and the output is rounded to x's dtype once. So a split result differs from the unsplit one
only by the order of the fp32 additions, and where every partial sum is exactly representable in
fp32 (integer activations, power-of-two scales: tests/test_w4a16.py) split, unsplit and the float64
product are the same bits. Unlike W8A8's int32 sums, a float sum cannot be made exact for any input.

Shapes: x (M, K) fp16/fp32; w_packed (N, K / 2) uint8 (:func:`kernels.quant.intq.pack_int4`, low
nibble = even k); scales (N, K / g) in x's dtype or fp32; zeros (N, K / g) uint8 codes; y (M, N) in x's dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.quant.intq import unpack_int4


class Tile(NamedTuple):
    """One launch configuration: output tile (BLOCK_M, BLOCK_N), warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Chosen from the AOT builds at Llama-3 sizes (compile_jobs, tests/test_w4a16.py): spill-free on
# sm80 and sm90a with cp.async pipelining (64 x 128 and 128 x 128 spill on sm80). BLOCK_M = 16 is the
# smallest tile tl.dot accepts; it runs on mma.sync (HMMA) even on sm90a, whose wgmma needs M >= 64.
DECODE_TILE = Tile(16, 64, 4, 4)      # M <= 16: one row of tiles, streamed weights
PREFILL_TILE = Tile(64, 64, 4, 3)     # M > 16
DECODE_MAX_M = 16
H100_SMS = 132                        # kernels.gpu.hardware.gpu("H100").sms: the SM count off a GPU


def w4a16_matmul_ref(x, w_packed, scales, zeros, group_size):
    """Dequantize W with equation (1) in float64, then X W^T: y (M, N) float64."""
    q = unpack_int4(w_packed).double()                                 # (N, K) codes in [0, 15]
    s = scales.double().repeat_interleave(group_size, 1)               # (N, K)
    z = zeros.double().repeat_interleave(group_size, 1)
    return x.double() @ (s * (q - z)).T


@triton.jit
def _w4a16_kernel(x_ptr, wp_ptr, s_ptr, z_ptr, y_ptr, M, N, steps_per_split,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_ys, stride_ym, stride_yn,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP_NIBBLES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)                                           # which K chunk (split-K), 0 without a split
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BN,)
    offs_kb = tl.arange(0, BLOCK_K // 2)                               # packed bytes of one K step
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm          # (BM, 1)
    w_rows = wp_ptr + offs_n.to(tl.int64)[:, None] * stride_wn         # (BN, 1)
    k_lo = pid_k * (steps_per_split * BLOCK_K)                         # this chunk's first column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + steps_per_split * BLOCK_K, BLOCK_K):  # K % GROUP == 0, GROUP % BLOCK_K == 0
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
    # y is (M, N) without split-K, else the fp32 partials (S, M, N) of equation (2)
    y_ptrs = (y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym
              + offs_n[None, :] * stride_yn)
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


def block_k_for(group_size: int) -> int:
    """The K step: one group, at most 128 columns (so a step never straddles two groups)."""
    return min(group_size, 128)


def tile_for(M: int) -> Tile:
    """The launch tile for M tokens: :data:`DECODE_TILE` up to :data:`DECODE_MAX_M`, else :data:`PREFILL_TILE`."""
    return DECODE_TILE if M <= DECODE_MAX_M else PREFILL_TILE


def split_for(tiles: int, steps: int, num_sms: int) -> int:
    """The split S of equation (2): the smallest power of two with tiles * S >= num_sms such that the
    ``steps`` K steps divide evenly into S chunks; 1 when the output tiles alone fill the SMs."""
    split = 1
    while tiles * split < num_sms and steps % (2 * split) == 0:
        split *= 2
    return split


def choose_split_k(M: int, N: int, K: int, group_size: int, *, num_sms: int = H100_SMS,
                   tile: Tile | None = None) -> int:
    """:func:`split_for` this kernel's output tiles and its K / BLOCK_K steps."""
    tile = tile or tile_for(M)
    tiles = triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n)
    return split_for(tiles, K // block_k_for(group_size), num_sms)


def device_sms(device: torch.device) -> int:
    """SMs to fill: the GPU's own count, or the H100's (the course's reference GPU) off a GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H100_SMS


def _launch_args(x, w_packed, scales, zeros, y, group_size: int, *, tile: Tile, split_k: int,
                 swap_nibbles: bool = False):
    """(grid, args, kwargs) of one launch of :func:`_w4a16_kernel`: what :func:`w4a16_matmul` runs and
    what :func:`compile_jobs` compiles (on meta tensors), so the AOT build cannot drift from the launch.
    ``y`` is the output (M, N) when ``split_k == 1``, else the fp32 partials (split_k, M, N)."""
    M, K = x.shape
    N = w_packed.shape[0]
    ys = y.stride(0) if split_k > 1 else 0
    ym, yn = (y.stride(1), y.stride(2)) if split_k > 1 else (y.stride(0), y.stride(1))
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n), split_k)
    steps = K // block_k_for(group_size) // split_k                  # K steps per chunk
    args = (x, w_packed, scales, zeros, y, M, N, steps,
            x.stride(0), x.stride(1), w_packed.stride(0), w_packed.stride(1),
            scales.stride(0), scales.stride(1), ys, ym, yn)
    kwargs = dict(GROUP=group_size, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k_for(group_size),
                  SWAP_NIBBLES=swap_nibbles, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return grid, args, kwargs


def _output(x, N: int, split_k: int) -> torch.Tensor:
    M = x.shape[0]
    if split_k == 1:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    return torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)


def w4a16_matmul(x, w_packed, scales, zeros, group_size=128, *, tile: Tile | None = None,
                 split_k: int | None = None, _swap_nibbles=False, _drop_partial=False):
    """y (M, N) = x @ W^T with W dequantized group-wise from 4-bit codes in the kernel (equation 1).

    ``tile`` defaults to :func:`tile_for`, ``split_k`` to :func:`choose_split_k` for the device's SMs.
    ``_swap_nibbles`` and ``_drop_partial`` (the sum of equation 2 without its last partial) are the
    broken variants the checks must catch."""
    _check(x, w_packed, scales, zeros, group_size)
    M, K = x.shape
    N = w_packed.shape[0]
    tile = tile or tile_for(M)
    steps = K // block_k_for(group_size)
    if split_k is None:
        split_k = choose_split_k(M, N, K, group_size, num_sms=device_sms(x.device), tile=tile)
    if not isinstance(split_k, int) or split_k < 1 or steps % split_k:
        raise ValueError(f"split_k must be a positive int dividing the {steps} K steps of {block_k_for(group_size)} "
                         f"columns, got {split_k!r}")
    y = _output(x, N, split_k)
    grid, args, kwargs = _launch_args(x, w_packed, scales, zeros, y, group_size, tile=tile, split_k=split_k,
                                      swap_nibbles=_swap_nibbles)
    _w4a16_kernel[grid](*args, **kwargs)
    if split_k == 1:
        return y
    partials = y[:-1] if _drop_partial else y
    return partials.sum(0).to(x.dtype)                                  # equation (2), in a fixed order


# ------------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes

# (label, M, N, K): Llama-3-8B (d = 4096, SwiGLU 14336) and Llama-3-70B (d = 8192, SwiGLU 28672)
# projections, at decode (M = 1) and prefill (M = 4096 tokens).
REAL_SHAPES = (
    ("Llama-3-8B o_proj decode", 1, 4096, 4096),
    ("Llama-3-8B gate/up decode", 1, 14336, 4096),
    ("Llama-3-8B down decode", 1, 4096, 14336),
    ("Llama-3-70B gate/up decode", 1, 28672, 8192),
    ("Llama-3-70B down decode", 1, 8192, 28672),
    ("Llama-3-8B gate/up prefill", 4096, 14336, 4096),
    ("Llama-3-70B down prefill", 4096, 8192, 28672),
)


def launch_plan(M: int, N: int, K: int, group_size: int = 128, *, num_sms: int = H100_SMS) -> dict:
    """What :func:`w4a16_matmul` launches at this shape: tile, split, grid and programs per SM."""
    tile = tile_for(M)
    split = choose_split_k(M, N, K, group_size, num_sms=num_sms, tile=tile)
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n), split)
    programs = grid[0] * grid[1] * grid[2]
    return {"tile": tile, "split_k": split, "grid": grid, "programs": programs, "per_sm": programs / num_sms}


def launch_job(M: int, N: int, K: int, group_size: int = 128, *, split_k: int | None = None,
               tile: Tile | None = None, num_sms: int = H100_SMS):
    """The :class:`kernels.inspect.TritonJob` of one launch at (M, N, K) on meta tensors (no memory)."""
    from kernels import inspect as ki

    tile = tile or tile_for(M)
    if split_k is None:
        split_k = choose_split_k(M, N, K, group_size, num_sms=num_sms, tile=tile)
    meta = dict(device="meta")
    x = torch.empty(M, K, dtype=torch.float16, **meta)
    w_packed = torch.empty(N, K // 2, dtype=torch.uint8, **meta)
    scales = torch.empty(N, K // group_size, dtype=torch.float16, **meta)
    zeros = torch.empty(N, K // group_size, dtype=torch.uint8, **meta)
    y = _output(x, N, split_k)
    _, args, kwargs = _launch_args(x, w_packed, scales, zeros, y, group_size, tile=tile, split_k=split_k)
    return ki.launch_job(_w4a16_kernel, *args, **kwargs)


def compile_jobs() -> dict:
    """The launches of :data:`REAL_SHAPES` at group 128 (fp16 activations), with the split an H100 gets."""
    return {f"{label}, g128": launch_job(M, N, K) for label, M, N, K in REAL_SHAPES}
