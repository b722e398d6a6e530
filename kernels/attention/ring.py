"""Ring attention: exact attention over a sequence split across p ranks, with K/V passed around a ring.

Rank r holds the queries, keys and values of its own tokens. In p steps every rank sees every
rank's K/V once: at step s rank r computes attention of its queries against the K/V block of rank
src = (r - s) mod p, while it sends that block to rank r + 1 and receives the next one from r - 1
(the send of step s overlaps the compute of step s). Each step gives a partial output O_b and the
log-sum-exp lse_b of its scores; two partials over disjoint key sets merge exactly (the online
softmax of :mod:`kernels.softmax.online`, with l = 1 at max = lse):

    lse = log(exp(lse_a) + exp(lse_b))
    O   = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b

Layouts of the sequence over ranks (n tokens, p ranks):

* ``contiguous``: rank r holds tokens [r n/p, (r + 1) n/p). Under a causal mask rank r needs the
  blocks of ranks 0..r only: rank 0 computes 1 block, rank p - 1 computes p, and the step time is
  set by the busiest rank;
* ``zigzag``: the sequence is cut into 2p chunks and rank r holds chunks r and 2p - 1 - r (Brandon
  et al.'s striping idea in its chunked form, as Llama 3 and ring-flash-attention do). At step 0 a
  rank attends causally within its own two chunks; from a rank src < r it needs both its query
  chunks against src's first chunk; from src > r only its second query chunk against both of src's
  chunks. Every step after the first is then exactly half of a full block on every rank.

Two block implementations: ``impl="torch"`` (:func:`block_attention_ref`, any float dtype, float64
for exact checks) and ``impl="flash"`` (the course's FlashAttention-2 kernel,
:func:`kernels.attention.flash.flash_attention` with its lse, merged by the Triton kernel
:func:`merge_attention`). The backward runs the ring again: with the *final* O and lse every block's
gradient is its exact share (P_ij = exp(S_ij - lse_i), D_i = rowsum(dO_i O_i) as in
FlashAttention-2), dQ stays on its rank, and dK, dV travel around the ring with the K/V block they
belong to, arriving home after one more hop (p sends of dK/dV, p - 1 of K/V).

``broken`` selects a deliberately wrong ring for the checks that must catch it:
``"merge_max"`` takes the larger lse instead of log-sum-exp in the merge; ``"causal_every_step"``
applies the diagonal causal mask to blocks of other ranks too; ``"dkv_stays"`` skips the last hop
of dK/dV (every rank keeps the gradient of its neighbour's keys: a right forward, wrong gradients).

This module does not import :mod:`kernels.dist` (that package imports this one); it counts its own
bytes in :class:`RingTraffic`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.attention.reference import attention_ref, causal_mask

LAYOUTS = ("contiguous", "zigzag")
IMPLS = ("torch", "flash")
BROKEN = ("merge_max", "causal_every_step", "dkv_stays")


# ---------------------------------------------------------------- the layouts

def chunk_ids(p: int, r: int, layout: str) -> list[int]:
    """Which chunks of the sequence rank r holds: [r] of p (contiguous), [r, 2p - 1 - r] of 2p (zigzag)."""
    _check_layout(layout)
    if not 0 <= r < p:
        raise ValueError(f"chunk_ids: rank {r} is not in [0, {p})")
    return [r] if layout == "contiguous" else [r, 2 * p - 1 - r]


def n_chunks(p: int, layout: str) -> int:
    return p if layout == "contiguous" else 2 * p


def shard(x: torch.Tensor, p: int, r: int, layout: str, dim: int = -2) -> torch.Tensor:
    """Rank r's tokens of x (the sequence along ``dim``), concatenated in chunk order."""
    n = x.shape[dim]
    if n % n_chunks(p, layout):
        raise ValueError(f"shard: {n} tokens do not split into {n_chunks(p, layout)} equal chunks ({layout}, p={p})")
    chunks = x.chunk(n_chunks(p, layout), dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(p, r, layout)], dim=dim)


def unshard(shards: list[torch.Tensor], layout: str, dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's shard (the inverse of :func:`shard`)."""
    p = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for r, part in enumerate(shards):
        for c, piece in zip(chunk_ids(p, r, layout), part.chunk(len(chunk_ids(p, r, layout)), dim=dim)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in range(n_chunks(p, layout))], dim=dim)


def positions(n: int, p: int, r: int, layout: str) -> torch.Tensor:
    """The global positions of rank r's tokens (for RoPE and masks)."""
    return shard(torch.arange(n), p, r, layout, dim=0)


def block_plan(r: int, src: int, p: int, n_local: int, layout: str, causal: bool):
    """What rank r computes against the K/V block of rank ``src``: (query slice, key slice, causal
    flag for that sub-block), or None when no query of r sees any key of src."""
    _check_layout(layout)
    every = slice(0, n_local)
    if not causal:
        return every, every, False
    if src == r:
        return every, every, True                    # within the shard: causal over the concatenation
    if layout == "contiguous":
        return (every, every, False) if src < r else None
    half = n_local // 2
    if src < r:
        return every, slice(0, half), False          # src's first chunk precedes both of r's chunks
    return slice(half, n_local), every, False        # r's second chunk follows both of src's chunks


def block_work(r: int, src: int, p: int, n_local: int, layout: str, causal: bool) -> int:
    """Score entries (query, key pairs) rank r evaluates against src's block: the work of that step."""
    plan = block_plan(r, src, p, n_local, layout, causal)
    if plan is None:
        return 0
    qs, ks, c = plan
    nq, nk = qs.stop - qs.start, ks.stop - ks.start
    return nq * (nq + 1) // 2 if c else nq * nk


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# ---------------------------------------------------------------- the merge: reference and kernel

def merge_attention_ref(o_a, lse_a, o_b, lse_b):
    """(O, lse) of the union of two disjoint key sets from each part's (O, lse); fp32 (fp64 kept).

    The merge is the online softmax's (:func:`kernels.softmax.merge_softmax_stats`) with each part's
    max at its lse and its sum at 1. A part with lse = -inf (no visible key) is the identity; two
    such parts give O = 0, lse = -inf, never NaN."""
    from kernels.softmax import merge_softmax_stats

    wide = torch.promote_types(torch.promote_types(o_a.dtype, o_b.dtype), torch.float32)
    la, lb = lse_a.to(wide)[..., None], lse_b.to(wide)[..., None]
    m, l = merge_softmax_stats(la, torch.ones_like(la), lb, torch.ones_like(lb))
    lse = m + torch.log(l)                                       # -inf + log 0 = -inf when both are empty
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    o = torch.exp(la - lse_safe) * o_a.to(wide) + torch.exp(lb - lse_safe) * o_b.to(wide)
    return o, lse[..., 0]


@triton.jit
def _merge_attention_kernel(
    o_ptr, lse_ptr, ob_ptr, lseb_ptr,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bd,
    stride_xb, stride_xh, stride_xm,
    H, N, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, LOGADDEXP: tl.constexpr,
):
    """In place: (o, lse) <- merge((o, lse), (o_b, lse_b)) for BLOCK_M rows of one (batch, head)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)                       # int64: b * stride_b passes 2**31 at long contexts
    h = (bh % H).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_D)                                                # (BLOCK_D,)
    r_ok = rows < N
    mask = r_ok[:, None] & (cols < D)[None, :]
    lse_a = tl.load(lse_ptr + b * stride_lb + h * stride_lh + rows * stride_lm, mask=r_ok, other=float("-inf"))
    lse_b = tl.load(lseb_ptr + b * stride_xb + h * stride_xh + rows * stride_xm, mask=r_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    if LOGADDEXP:
        lse = m_safe + tl.log(tl.exp(lse_a - m_safe) + tl.exp(lse_b - m_safe))   # log(e^a + e^b)
    else:
        lse = m                                      # broken on purpose: as if one part held all the mass
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    w_a = tl.exp(lse_a - lse_safe)                   # exp(lse_a - lse): this part's share of the union
    w_b = tl.exp(lse_b - lse_safe)
    o_offs = b * stride_ob + h * stride_oh + rows[:, None] * stride_om + cols[None, :] * stride_od
    b_offs = b * stride_bb + h * stride_bh + rows[:, None] * stride_bm + cols[None, :] * stride_bd
    o_a = tl.load(o_ptr + o_offs, mask=mask, other=0.0)
    o_b = tl.load(ob_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + o_offs, o_a * w_a[:, None] + o_b * w_b[:, None], mask=mask)   # O = w_a O_a + w_b O_b
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + rows * stride_lm, lse, mask=r_ok)


def merge_block_m(n: int) -> int:
    """Rows per program: 64 (a 64 x 128 fp32 tile is 64 values a thread at 4 warps), fewer for short rows."""
    return max(16, min(64, triton.next_power_of_2(max(n, 1))))


def _merge_args(o, lse, o_b, lse_b, *, logaddexp: bool = True):
    """(grid, args, kwargs) of one merge launch, shared by :func:`merge_attention` and :func:`compile_jobs`."""
    B, H, N, D = o.shape
    block_m = merge_block_m(N)
    grid = (triton.cdiv(N, block_m), B * H)
    args = (o, lse, o_b, lse_b, *o.stride(), *lse.stride(), *o_b.stride(), *lse_b.stride(), H, N, D)
    kwargs = dict(BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(D)), LOGADDEXP=logaddexp, num_warps=4)
    return grid, args, kwargs


def merge_attention(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, *,
                    broken: str | None = None):
    """In place: the accumulator (o, lse) becomes the merge of itself and the block (o_b, lse_b).

    o (B, H, N, D) fp32 and lse (B, H, N) fp32, any strides (views of a larger accumulator are how
    the zig-zag ring merges into half of its rows); o_b (B, H, N, D) fp32/fp16/bf16; lse_b (B, H, N)
    fp32. Returns (o, lse). ``broken="merge_max"`` keeps the larger lse instead of log-sum-exp."""
    if broken not in (None, "merge_max"):
        raise ValueError(f"merge_attention: broken must be None or 'merge_max', got {broken!r}")
    for name, t, dtypes in (("o", o, (torch.float32,)), ("lse", lse, (torch.float32,)),
                            ("o_b", o_b, (torch.float32, torch.float16, torch.bfloat16)),
                            ("lse_b", lse_b, (torch.float32,))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"merge_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"merge_attention: {name} has dtype {t.dtype}; expected one of {dtypes}")
    if o.dim() != 4 or o_b.shape != o.shape:
        raise ValueError(f"merge_attention: o and o_b must be (B, H, N, D) of one shape, got "
                         f"{tuple(o.shape)} and {tuple(o_b.shape)}")
    if lse.shape != o.shape[:3] or lse_b.shape != o.shape[:3]:
        raise ValueError(f"merge_attention: lse and lse_b must be (B, H, N) = {tuple(o.shape[:3])}, got "
                         f"{tuple(lse.shape)} and {tuple(lse_b.shape)}")
    if o.numel() == 0:
        return o, lse
    grid, args, kwargs = _merge_args(o, lse, o_b, lse_b, logaddexp=broken is None)
    _merge_attention_kernel[grid](*args, **kwargs)
    return o, lse


# Long-context training shapes: Llama 3 8B (32 query heads, 8 K/V heads, D = 128) at 128k tokens
# over 8 ranks, and Llama 3 405B (128 heads) at 128k over CP = 16, its long-context stage.
REAL_SHAPES = {"Llama-3-8B, 128k over 8 ranks": (32, 131072 // 8, 128),
               "Llama-3-405B, 128k over CP=16": (128, 131072 // 16, 128)}


def compile_jobs() -> dict:
    """The merge at :data:`REAL_SHAPES` (fp32 accumulator, bf16 block), and the zig-zag case that
    merges into the second half of the rows only (a strided view of the accumulator)."""
    from kernels import inspect as ki

    jobs = {}
    for label, (h, n, d) in REAL_SHAPES.items():
        o = torch.empty(1, h, n, d, device="meta")
        lse = torch.empty(1, h, n, device="meta")
        o_b = torch.empty(1, h, n, d, dtype=torch.bfloat16, device="meta")
        grid, args, kwargs = _merge_args(o, lse, o_b, lse)
        jobs[f"merge {label}, D={d}"] = ki.launch_job(_merge_attention_kernel, *args, grid=grid, **kwargs)
    h, n, d = REAL_SHAPES["Llama-3-8B, 128k over 8 ranks"]
    o = torch.empty(1, h, n, d, device="meta")
    lse = torch.empty(1, h, n, device="meta")
    o_b = torch.empty(1, h, n // 2, d, dtype=torch.bfloat16, device="meta")
    grid, args, kwargs = _merge_args(o[:, :, n // 2:], lse[:, :, n // 2:], o_b, lse[:, :, : n // 2])
    jobs["merge Llama-3-8B, zig-zag second half"] = ki.launch_job(_merge_attention_kernel, *args, grid=grid, **kwargs)
    return jobs


# ---------------------------------------------------------------- one block: forward and backward

def block_attention_ref(q, k, v, causal: bool, sm_scale: float):
    """(O, lse) of one block in PyTorch (:func:`kernels.attention.reference.attention_ref`)."""
    return attention_ref(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)


def block_attention_backward_ref(do, q, k, v, o, lse, causal: bool, sm_scale: float):
    """(dQ, dK, dV) of one block given the *final* O and lse of its query rows (FlashAttention-2's
    backward written out): P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q; K/V heads shared by a group of query heads sum its gradients."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kf, vf = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # (B, Hq, Nk, D)
    s = (q @ kf.transpose(-1, -2)) * sm_scale                                        # (B, Hq, Nq, Nk)
    lse_safe = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)  # empty row: P = 0
    prob = torch.exp(s - lse_safe[..., None])
    if causal:
        prob = prob.masked_fill(~causal_mask(Nq, Nk, device=q.device), 0.0)
    dv = prob.transpose(-1, -2) @ do                                                 # (B, Hq, Nk, D)
    dp = do @ vf.transpose(-1, -2)
    ds = prob * (dp - (do * o).sum(-1, keepdim=True))                                # dS = P (dP - D_i)
    dq = (ds @ kf) * sm_scale
    dk = (ds.transpose(-1, -2) @ q) * sm_scale
    fold = lambda t: t.view(B, Hkv, group, Nk, D).sum(2)                              # noqa: E731
    return dq, fold(dk), fold(dv)


def _block_forward(q, k, v, causal, scale, impl):
    if impl == "torch":
        return block_attention_ref(q, k, v, causal, scale)
    from kernels.attention.flash import flash_attention
    return flash_attention(q, k, v, causal=causal, sm_scale=scale, return_lse=True)


def _block_backward(do, q, k, v, o, lse, causal, scale, impl):
    if impl == "torch":
        return block_attention_backward_ref(do, q, k, v, o, lse, causal, scale)
    from kernels.attention.flash import _backward          # the kernel's backward, with our final O and lse
    return _backward(do.contiguous(), q, k, v, o.contiguous(), lse.float(), causal, scale)


# ---------------------------------------------------------------- the ring

@dataclass
class RingTraffic:
    """Bytes and messages this rank sent, forward and backward."""
    forward_bytes: int = 0
    forward_messages: int = 0
    backward_bytes: int = 0
    backward_messages: int = 0


def _ring_pass(send: torch.Tensor, group):
    """Post: send ``send`` to the next rank, receive a tensor like it from the previous one."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % p), dist.get_global_rank(group, (r - 1) % p)
    recv = torch.empty_like(send)
    reqs = [dist.isend(send, nxt, group=group), dist.irecv(recv, prv, group=group)]
    return recv, reqs


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


def _group(group):
    return group if group is not None else dist.group.WORLD


def ring_forward(q, k, v, causal, scale, layout, impl, group=None, traffic=None, broken=None):
    """(O in q's dtype, lse (B, H, n) wide) of the local queries against every rank's keys."""
    group = _group(group)
    p, r = dist.get_world_size(group), dist.get_rank(group)
    B, H, n, D = q.shape
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.zeros(B, H, n, D, dtype=wide, device=q.device)
    lse = torch.full((B, H, n), -math.inf, dtype=wide, device=q.device)
    kv = torch.stack([k, v]).contiguous()                                    # one message: (2, B, Hkv, n, D)
    for s in range(p):
        src = (r - s) % p
        if s < p - 1:
            nxt, reqs = _ring_pass(kv, group)                                # overlaps this step's compute
            if traffic is not None:
                traffic.forward_bytes += kv.numel() * kv.element_size()
                traffic.forward_messages += 1
        plan = block_plan(r, src, p, n, layout, causal)
        if plan is not None:
            qs, ks, c = plan
            c = c or (causal and broken == "causal_every_step")
            o_b, lse_b = _block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], c, scale, impl)
            if impl == "flash":
                merge_attention(o[:, :, qs], lse[:, :, qs], o_b, lse_b,
                                broken="merge_max" if broken == "merge_max" else None)
            else:
                o_m, lse_m = (merge_attention_ref(o[:, :, qs], lse[:, :, qs], o_b, lse_b)
                              if broken != "merge_max" else _merge_max_ref(o[:, :, qs], lse[:, :, qs], o_b, lse_b))
                o[:, :, qs], lse[:, :, qs] = o_m, lse_m
        if s < p - 1:
            _wait(reqs)
            kv = nxt
    return o.to(q.dtype), lse


def _merge_max_ref(o_a, lse_a, o_b, lse_b):
    """The broken merge in PyTorch (the kernel's LOGADDEXP=False): lse = max(lse_a, lse_b)."""
    lse = torch.maximum(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return (torch.exp(lse_a - safe)[..., None] * o_a + torch.exp(lse_b - safe)[..., None] * o_b), lse


def ring_backward(do, q, k, v, o, lse, causal, scale, layout, impl, group=None, traffic=None, broken=None):
    """(dQ, dK, dV) of the local shard: dQ summed here, dK/dV accumulated as they travel with their K/V."""
    group = _group(group)
    p, r = dist.get_world_size(group), dist.get_rank(group)
    n = q.shape[2]
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)              # the gradient of the K/V block this rank holds now
    for s in range(p):
        src = (r - s) % p
        if s < p - 1:
            nxt, reqs = _ring_pass(kv, group)
            if traffic is not None:
                traffic.backward_bytes += kv.numel() * kv.element_size()
                traffic.backward_messages += 1
        plan = block_plan(r, src, p, n, layout, causal)
        if plan is not None:
            qs, ks, c = plan
            c = c or (causal and broken == "causal_every_step")
            dq_b, dk_b, dv_b = _block_backward(do[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                               o[:, :, qs], lse[:, :, qs], c, scale, impl)
            dq[:, :, qs] += dq_b
            dkv[0][:, :, ks] += dk_b
            dkv[1][:, :, ks] += dv_b
        if s < p - 1 or broken != "dkv_stays":           # the last hop brings dK/dV home
            dkv_next, dreqs = _ring_pass(dkv, group)
            _wait(dreqs)
            dkv = dkv_next
            if traffic is not None:
                traffic.backward_bytes += dkv.numel() * dkv.element_size()
                traffic.backward_messages += 1
        if s < p - 1:
            _wait(reqs)
            kv = nxt
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, impl, group, traffic, broken):
        o, lse = ring_forward(q, k, v, causal, scale, layout, impl, group, traffic, broken)
        ctx.save_for_backward(q, k, v, o, lse)           # O(n) per rank: no scores are kept
        ctx.args = (causal, scale, layout, impl, group, traffic, broken)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   sm_scale: float | None = None, layout: str = "zigzag", impl: str = "torch", group=None,
                   traffic: RingTraffic | None = None, broken: str | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, differentiable in q, k and v.

    q (B, Hq, n, D), k and v (B, Hkv, n, D) are this rank's tokens in ``layout`` (:func:`shard`);
    every rank of ``group`` (default: the world) calls it with the same shapes. The causal mask is
    over global positions. ``impl="flash"`` needs float32/float16 inputs (the kernel's dtypes here);
    ``impl="torch"`` takes any float dtype. Returns O (B, Hq, n, D) in q's dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be a 4-D (B, H, n, D) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share B, n, D")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]}")
    _check_layout(layout)
    if impl not in IMPLS:
        raise ValueError(f"ring_attention: impl must be one of {IMPLS}, got {impl!r}")
    if broken is not None and broken not in BROKEN:
        raise ValueError(f"ring_attention: broken must be None or one of {BROKEN}, got {broken!r}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"ring_attention: the zigzag layout holds two equal chunks per rank; n={q.shape[2]} is odd")
    if not dist.is_initialized():
        raise RuntimeError("ring_attention: no process group; call it inside kernels.dist.launch.launch")
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return _RingAttention.apply(q, k, v, bool(causal), scale, layout, impl, group, traffic, broken)


# ---------------------------------------------------------------- overlap of the ring with the compute

def step_times(tokens_per_rank: int, n_heads: int, n_kv_heads: int, head_dim: int, *, peak_tflops: float,
               link_gbs: float, alpha_s: float, bytes_per_value: int = 2, layout: str = "zigzag") -> dict:
    """The alpha-beta model of one forward ring step of a causal ring, per rank.

    compute: 4 n_q n_k H D FLOPs of a full block (two matmuls of 2 n_q n_k D each, per head) times the
    block's share (1/2 on every zig-zag step; the busiest rank's full block on a contiguous one), at
    ``peak_tflops``; comm: alpha + 2 n H_kv D bytes (K and V of the block) / link bandwidth. With
    the send overlapped a step takes max(compute, comm); without, their sum."""
    _check_layout(layout)
    n = tokens_per_rank
    full = 4 * n * n * n_heads * head_dim
    compute = (full / 2 if layout == "zigzag" else full) / (peak_tflops * 1e12)
    comm = alpha_s + 2 * n * n_kv_heads * head_dim * bytes_per_value / (link_gbs * 1e9)
    return {"compute_s": compute, "comm_s": comm, "overlapped_s": max(compute, comm), "serial_s": compute + comm}


def overlap_threshold_tokens(n_heads: int, n_kv_heads: int, *, peak_tflops: float, link_gbs: float,
                             bytes_per_value: int = 2) -> float:
    """Tokens per rank above which a zig-zag step's compute hides its K/V transfer (alpha left out):
    2 n^2 H D / F = 2 n H_kv D b / W  gives  n* = H_kv b F / (H W)."""
    return n_kv_heads * bytes_per_value * peak_tflops * 1e12 / (n_heads * link_gbs * 1e9)


def ring_timeline(p: int, compute_s: float, comm_s: float, *, overlap: bool = True) -> dict:
    """Start and end of every step's compute and K/V transfer on one rank of a ring of p ranks whose
    steps all cost ``compute_s`` (zig-zag: every step is half a block) and whose transfers cost
    ``comm_s``. Step s's transfer (the block step s + 1 needs) starts with step s's compute when
    ``overlap`` (double buffering: two K/V blocks live at once), after it otherwise; step s + 1
    starts when both are done. Makespan: c + (p - 1) max(c, m) overlapped, c + (p - 1)(c + m) not.
    Returns {"compute": [(start, end)] * p, "comm": [(start, end)] * (p - 1), "makespan": float}."""
    if not (isinstance(p, int) and p >= 1):
        raise ValueError(f"ring_timeline: p must be a positive int, got {p!r}")
    if compute_s < 0 or comm_s < 0:
        raise ValueError(f"ring_timeline: times must be >= 0, got compute_s={compute_s}, comm_s={comm_s}")
    compute, comm, t = [], [], 0.0
    for s in range(p):
        compute.append((t, t + compute_s))
        if s == p - 1:
            t += compute_s
            break
        start = t if overlap else t + compute_s
        comm.append((start, start + comm_s))
        t = max(t + compute_s, start + comm_s)
    return {"compute": compute, "comm": comm, "makespan": t}


def ring_bytes(n_local: int, n_kv_heads: int, head_dim: int, p: int, *, value_bytes: int,
               grad_bytes: int = 4, batch: int = 1) -> dict:
    """Bytes one rank sends in one ring attention, derived: forward p - 1 K/V blocks of
    2 b n H_kv D values; backward p - 1 K/V blocks again plus p dK/dV blocks, which travel in the
    accumulation dtype (``grad_bytes``: fp32 here and in ring-flash-attention)."""
    block = 2 * batch * n_local * n_kv_heads * head_dim
    return {"forward": (p - 1) * block * value_bytes,
            "backward": (p - 1) * block * value_bytes + p * block * grad_bytes}


# ---------------------------------------------------------------- the chapter's experiment (one launch)

def case_inputs(case: dict, seed: int):
    """(q, k, v, dO) of one case, the whole sequence, the same on every rank (seeded)."""
    b, hq, hkv, n, d = case["shape"]
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, h, n, d, generator=g, dtype=torch.float64)        # noqa: E731
    dtype = getattr(torch, case["dtype"])
    return mk(hq).to(dtype), mk(hkv).to(dtype), mk(hkv).to(dtype), mk(hq).to(dtype)


def _run_case(rank: int, p: int, case: dict, seed: int) -> dict:
    """One ring on this rank's shard of :func:`case_inputs`: its O (and dQ, dK, dV unless
    ``case["backward"]`` is False) and the bytes it sent."""
    q, k, v, do = case_inputs(case, seed)
    layout = case["layout"]
    mine = [shard(t, p, rank, layout).clone().requires_grad_(True) for t in (q, k, v)]
    traffic = RingTraffic()
    o = ring_attention(*mine, causal=case["causal"], layout=layout, impl=case["impl"], traffic=traffic,
                       broken=case.get("broken"))
    out = {"o": o.detach(), "traffic": traffic}
    if case.get("backward", True):
        o.backward(shard(do, p, rank, layout))
        out.update(dq=mine[0].grad, dk=mine[1].grad, dv=mine[2].grad)
    return out


def chapter_worker(rank: int, p: int, cases: dict) -> dict:
    """Every case of the ring-attention chapter on this rank (case i seeded with i): {label: result}."""
    return {label: _run_case(rank, p, case, seed=i) for i, (label, case) in enumerate(cases.items())}
