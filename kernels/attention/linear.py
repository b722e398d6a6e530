"""Linear attention as a running state, its chunkwise-parallel form, and a Triton chunked kernel
(Lightning Attention's tiling) with a per-head scalar decay (RetNet), forward and backward.

Drop the softmax from causal attention and the output of query t is a sum over the past,

    o_t = sum_{s <= t} lam^(t - s) (q_t . k_s) v_s                     (parallel form, T x T)

which regroups (associativity) into a state of fixed size d_k x d_v per head:

    S_t = lam S_{t-1} + k_t v_t^T,      o_t = S_t^T q_t                 (recurrent form)

(Katharopoulos et al. 2020 with the identity feature map; lam = 1 is plain linear attention, a
per-head constant lam < 1 is RetNet's retention / Lightning Attention's decay.)

Chunkwise form: cut the sequence into chunks of C tokens. With S the state after the previous chunk
and i, j = 0 .. C-1 the positions inside the current chunk,

    O_chunk = [(Q K^T) * D] V  +  diag(lam^(i+1)) Q S      D_ij = lam^(i-j) for i >= j, else 0
    S_next  = lam^C S  +  K^T diag(lam^(C-1-j)) V

the first term is the intra-chunk part (a small causal "attention without softmax"), the second the
inter-chunk part (every earlier chunk, summarised by the state). Lightning Attention-2 (Qin et al.
2024) computes exactly this with tiles: one program per (batch, head, block of d_v), the state a
(d_k, BLOCK_V) fp32 tile held in registers while the program walks the chunks in order.

Backward: with dO the output gradient, the three gradients are linear attentions of their own,
two of them running backwards in time:

    dq_t = sum_{s <= t} lam^(t-s) (do_t . v_s) k_s        queries dO, keys V,  values K   (forward)
    dk_s = sum_{t >= s} lam^(t-s) (v_s . do_t) q_t        queries V,  keys dO, values Q   (reversed)
    dv_s = sum_{t >= s} lam^(t-s) (k_s . q_t) do_t        queries K,  keys Q,  values dO  (reversed)

so the backward launches the forward kernel three times; ``REVERSE`` makes it read the sequence from
the end (position p of the walk is token T-1-p), which turns "s <= t" into "s >= t".

Offsets: a head's base (b * stride_b + h * stride_h) and each row's t * stride_t are int64, so a
(B, H, T, D) tensor past 2**31 elements (64 heads of 128 at 64k tokens, batch 4, is 2**31) addresses
correctly.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# References (PyTorch)


def _decay(decay, H: int, like: torch.Tensor) -> torch.Tensor:
    if decay is None:
        return torch.ones(H, dtype=like.dtype, device=like.device)
    return decay.to(like.dtype)


def linear_attention_recurrent_ref(q, k, v, decay=None):
    """The ground truth: one token at a time, S_t = lam_h S_{t-1} + k_t v_t^T, o_t = S_t^T q_t.

    q, k (B, H, T, d_k), v (B, H, T, d_v), decay (H,) in (0, 1] or None (= 1). Computes in fp64 when
    q is fp64, else fp32. Returns (o (B, H, T, d_v), S_T (B, H, d_k, d_v))."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    B, H, T, dk = q.shape
    lam = _decay(decay, H, q).view(1, H, 1, 1)
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=wide, device=q.device)     # (B, H, d_k, d_v)
    out = []
    for t in range(T):
        S = lam * S + k[:, :, t, :, None] * v[:, :, t, None, :]            # S_t = lam S_{t-1} + k_t v_t^T
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))            # o_t = S_t^T q_t
    return torch.stack(out, 2), S


def linear_attention_parallel_ref(q, k, v, decay=None):
    """The quadratic form: O = [(Q K^T) * D] V with D_ts = lam^(t-s) for s <= t (no softmax, no
    normalisation). Same shapes and precision rule as :func:`linear_attention_recurrent_ref`; returns o."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    T = q.shape[2]
    lam = _decay(decay, q.shape[1], q).view(-1, 1, 1)
    t = torch.arange(T, device=q.device)
    gap = (t[:, None] - t[None, :]).to(wide)                                # t - s
    D = torch.where(gap >= 0, lam ** gap.clamp(min=0), torch.zeros((), dtype=wide))   # (H, T, T)
    return ((q @ k.transpose(-1, -2)) * D) @ v


def linear_attention_chunked_ref(q, k, v, decay=None, chunk: int = 64):
    """The chunkwise-parallel form (see the module docstring), chunk by chunk in PyTorch: what the
    Triton kernel computes, written as plainly as possible. Returns (o, S_T) like the recurrent ref."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    B, H, T, dk = q.shape
    lam = _decay(decay, H, q).view(1, H, 1, 1)
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=wide, device=q.device)
    out = []
    for c0 in range(0, T, chunk):
        qc, kc, vc = q[:, :, c0:c0 + chunk], k[:, :, c0:c0 + chunk], v[:, :, c0:c0 + chunk]   # (B, H, C, d)
        C = qc.shape[2]
        i = torch.arange(C, device=q.device, dtype=wide)
        gap = i[:, None] - i[None, :]                                        # i - j
        D = torch.where(gap >= 0, lam ** gap.clamp(min=0), torch.zeros((), dtype=wide))     # (1, H, C, C)
        intra = ((qc @ kc.transpose(-1, -2)) * D) @ vc                        # [(Q K^T) * D] V
        inter = lam ** (i + 1).view(1, 1, C, 1) * (qc @ S)                     # diag(lam^(i+1)) Q S
        out.append(intra + inter)
        S = lam ** C * S + kc.transpose(-1, -2) @ (lam ** (C - 1 - i).view(1, 1, C, 1) * vc)  # lam^C S + K^T diag(lam^(C-1-j)) V
    return torch.cat(out, 2), S


# ----------------------------------------------------------------------------------------------
# The Triton kernel


@triton.jit
def _linear_attention_fwd_kernel(
    Q, K, V, O, S_OUT, LOG2_DECAY,
    T, H, DK, DV,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr, STORE_STATE: tl.constexpr, BROKEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (batch * head, block of d_v): walks the chunks in order, the state
    S (BLOCK_K, BLOCK_V) in fp32 registers. BROKEN = 1 forgets the inter-chunk decay lam^(i+1)."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    log2_lam = tl.load(LOG2_DECAY + h)                       # log2 of lam_h (0 for plain linear attention)

    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    q_base = Q + b * sqb + h.to(tl.int64) * sqh
    k_base = K + b * skb + h.to(tl.int64) * skh
    v_base = V + b * svb + h.to(tl.int64) * svh
    o_base = O + b * sob + h.to(tl.int64) * soh

    # decay inside a chunk: D_ij = lam^(i-j) for i >= j (the where keeps lam^(negative) out)
    gap = offs_t[:, None] - offs_t[None, :]
    causal = gap >= 0
    D = tl.where(causal, tl.exp2(tl.where(causal, gap, 0).to(tl.float32) * log2_lam), 0.0)
    q_decay = tl.exp2((offs_t + 1).to(tl.float32) * log2_lam)          # lam^(i+1)

    S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for c in range(0, tl.cdiv(T, BLOCK_T)):
        pos = c * BLOCK_T + offs_t                           # position along the walk
        valid = pos < T
        if REVERSE:
            t = (T - 1 - pos).to(tl.int64)
        else:
            t = pos.to(tl.int64)
        qk_mask = valid[:, None] & mask_k[None, :]
        q = tl.load(q_base + t[:, None] * sqt + offs_k[None, :] * sqd, mask=qk_mask, other=0.0)   # (C, BK)
        k = tl.load(k_base + t[:, None] * skt + offs_k[None, :] * skd, mask=qk_mask, other=0.0)   # (C, BK)
        v = tl.load(v_base + t[:, None] * svt + offs_v[None, :] * svd,
                    mask=valid[:, None] & mask_v[None, :], other=0.0)                              # (C, BV)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * D                 # (Q K^T) * D, (C, C) fp32
        o = tl.dot(scores.to(v.dtype), v, input_precision=DOT_PRECISION)                  # intra-chunk
        inter = tl.dot(q, S.to(q.dtype), input_precision=DOT_PRECISION)                 # Q S, (C, BV)
        if BROKEN:
            o += inter                                       # the bug: the state read without lam^(i+1)
        else:
            o += inter * q_decay[:, None]                    # diag(lam^(i+1)) Q S
        tl.store(o_base + t[:, None] * sot + offs_v[None, :] * sod, o.to(O.dtype.element_ty),
                 mask=valid[:, None] & mask_v[None, :])

        n = tl.minimum(T - c * BLOCK_T, BLOCK_T)             # tokens in this chunk (the tail is shorter)
        v_decay = tl.where(valid, tl.exp2((n - 1 - offs_t).to(tl.float32) * log2_lam), 0.0)   # lam^(n-1-j)
        S = S * tl.exp2(n.to(tl.float32) * log2_lam) + tl.dot(
            tl.trans(k), (v * v_decay[:, None]).to(v.dtype), input_precision=DOT_PRECISION)   # lam^n S + K^T diag(lam^(n-1-j)) V

    if STORE_STATE:
        s_base = S_OUT + pid_bh.to(tl.int64) * DK * DV
        tl.store(s_base + offs_k[:, None] * DV + offs_v[None, :], S, mask=mask_k[:, None] & mask_v[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def gpu_chunk(capability_major: int) -> int:
    """The token tile on a GPU: 64 (Lightning Attention-2's block, wgmma's 64 rows) from sm_90 on; 32 below,
    where mma.sync keeps every accumulator in registers and the 64-token tile at d = 128 spilled on sm_80
    (compiled here with BLOCK_V = 64 and 8 warps: 76 spilled registers; at chunk 32 none)."""
    return 64 if capability_major >= 9 else 32


def default_chunk(T: int) -> int:
    """On a GPU, :func:`gpu_chunk` of its architecture; on the interpreter the smallest power of two >= 16
    that covers T in at most 4 chunks, capped at 64, so a check walks several chunks and a tail."""
    if runtime.runtime().on_gpu:
        return gpu_chunk(torch.cuda.get_device_capability()[0])
    return min(64, _pow2(triton.cdiv(T, 4)))


def _launch_args(q, k, v, o, s, log2_decay, *, chunk: int, block_v: int | None, reverse: bool,
                 store_state: bool, broken: int):
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    BV = block_v or min(64, _pow2(DV))
    grid = (B * H, triton.cdiv(DV, BV))
    args = (q, k, v, o, s, log2_decay, T, H, DK, DV, *q.stride(), *k.stride(), *v.stride(), *o.stride())
    kwargs = dict(BLOCK_T=chunk, BLOCK_K=_pow2(DK), BLOCK_V=BV, REVERSE=reverse, STORE_STATE=store_state,
                  BROKEN=broken, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",   # fp32: no tf32
                  num_warps=4 if BV * _pow2(DK) < 64 * 128 else 8)
    return grid, args, kwargs


def _run(q, k, v, log2_decay, *, chunk, block_v=None, reverse=False, want_state=False, broken=0):
    B, H, T, DK = q.shape
    o = torch.empty(B, H, T, v.shape[-1], dtype=q.dtype, device=q.device)
    s = torch.empty(B, H, DK, v.shape[-1], dtype=torch.float32, device=q.device) if want_state else o
    grid, args, kwargs = _launch_args(q, k, v, o, s, log2_decay, chunk=chunk, block_v=block_v, reverse=reverse,
                                      store_state=want_state, broken=broken)
    _linear_attention_fwd_kernel[grid](*args, **kwargs)
    return o, (s if want_state else None)


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log2_decay, chunk, block_v, broken_fwd, broken_bwd):
        o, s = _run(q, k, v, log2_decay, chunk=chunk, block_v=block_v, want_state=True, broken=broken_fwd)
        ctx.save_for_backward(q, k, v, log2_decay)       # O(T d) saved: the state is recomputed by the walks
        ctx.args = (chunk, block_v, broken_bwd)
        ctx.mark_non_differentiable(s)
        return o, s

    @staticmethod
    def backward(ctx, do, _ds):
        q, k, v, log2_decay = ctx.saved_tensors
        chunk, block_v, broken = ctx.args
        do = do.to(q.dtype)
        dq, _ = _run(do, v, k, log2_decay, chunk=chunk, broken=broken)                 # queries dO, keys V, values K
        dk, _ = _run(v, do, q, log2_decay, chunk=chunk, reverse=True, broken=broken)   # queries V, keys dO, values Q
        dv, _ = _run(k, q, do, log2_decay, chunk=chunk, reverse=True, broken=broken)   # queries K, keys Q, values dO
        return dq, dk, dv, None, None, None, None, None


def _check(q, k, v, decay, chunk, block_v, name="linear_attention"):
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D (B, H, T, d), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"{name}: k shape {tuple(k.shape)} differs from q shape {tuple(q.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: v must be (B, H, T, d_v) with (B, H, T) = {tuple(q.shape[:3])}, "
                         f"got {tuple(v.shape)}")
    B, H, T, dk = q.shape
    if T < 1 or B < 1 or H < 1:
        raise ValueError(f"{name}: B, H and T must be at least 1, got {tuple(q.shape[:3])}")
    for d, label in ((dk, "d_k"), (v.shape[-1], "d_v")):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {label}={d} must lie in [1, {MAX_HEAD_DIM}]")
    if decay is not None:
        if not isinstance(decay, torch.Tensor) or decay.shape != (H,):
            raise ValueError(f"{name}: decay must be a tensor of shape (H,) = ({H},), one per head, "
                             f"got {tuple(getattr(decay, 'shape', ())) or type(decay).__name__}")
        if decay.requires_grad:
            raise ValueError(f"{name}: decay is a fixed per-head constant here (RetNet, Lightning); "
                             "a decay that requires grad is not supported")
        if not bool(((decay > 0) & (decay <= 1)).all()):
            raise ValueError(f"{name}: decay must lie in (0, 1], got {decay.tolist()}")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"{name}: chunk must be a power of two >= 16 (a tl.dot tile), got {chunk!r}")
    if block_v is not None and (not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"{name}: block_v must be a power of two >= 16, got {block_v!r}")


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None = None, *,
                     chunk: int | None = None, block_v: int | None = None, return_state: bool = False,
                     _broken: tuple[int, int] = (0, 0)):
    """Causal linear attention with a per-head scalar decay, chunked (Lightning Attention-2's tiling),
    differentiable in q, k and v.

    q, k (B, H, T, d_k), v (B, H, T, d_v), any strides, fp16 / bf16 / fp32, d <= 256; ``decay`` (H,)
    in (0, 1] (None: 1, plain linear attention), a constant. ``chunk`` (power of two >= 16) is the
    token tile, ``block_v`` the slice of d_v per program. Returns o (B, H, T, d_v) in q's dtype and,
    with ``return_state``, the final state S_T (B, H, d_k, d_v) in fp32 (what a decode step would
    carry on; not differentiable). ``_broken`` = (forward, backward) switches the kernel's BROKEN
    variant on in one pass, for the checks that must catch it."""
    _check(q, k, v, decay, chunk, block_v)
    H, T = q.shape[1], q.shape[2]
    lam = torch.ones(H, device=q.device) if decay is None else decay.detach().to(q.device, torch.float64)
    log2_decay = torch.log2(lam).to(torch.float32).contiguous()
    o, s = _LinearAttention.apply(q, k, v, log2_decay, chunk or default_chunk(T), block_v, *_broken)
    return (o, s) if return_state else o


# ----------------------------------------------------------------------------------------------
# Memory: a fixed state against a growing KV cache


def kv_cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int = 2) -> int:
    """Keys and values of one token over ``layers`` softmax-attention layers."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


def linear_state_bytes(layers: int, heads: int, d_k: int, d_v: int, bytes_per_element: int = 2,
                       conv_channels: int = 0, conv_width: int = 0) -> int:
    """The fixed per-sequence state of ``layers`` linear-attention layers: one d_k x d_v matrix per head,
    plus a short convolution's last (conv_width - 1) inputs per channel where the layer has one
    (Gated DeltaNet in Qwen3-Next). Independent of the context length."""
    return layers * (heads * d_k * d_v + conv_channels * max(conv_width - 1, 0)) * bytes_per_element


# Facts from the models' config.json (cited in the chapter):
# Llama-3-8B: 32 layers, 8 KV heads, head dim 4096 / 32 = 128.
# Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4 (36 Gated DeltaNet + 12 gated-attention
# layers), attention: 2 KV heads of head_dim 256; Gated DeltaNet: 16 key heads and 32 value heads of
# 128 (one 128 x 128 state per value head), causal conv of width 4 over q, k, v channels.
LLAMA3_8B = dict(layers=32, kv_heads=8, head_dim=128)
QWEN3_NEXT = dict(layers=48, full_interval=4, kv_heads=2, head_dim=256, lin_k_heads=16, lin_v_heads=32,
                  lin_k_dim=128, lin_v_dim=128, conv_width=4)


def qwen3_next_bytes(context: int, bytes_per_element: int = 2) -> tuple[int, int]:
    """(KV cache of the 12 attention layers, the 36 Gated DeltaNet states) of one Qwen3-Next-80B-A3B
    sequence at ``context`` tokens."""
    c = QWEN3_NEXT
    full = c["layers"] // c["full_interval"]
    lin = c["layers"] - full
    conv_channels = 2 * c["lin_k_heads"] * c["lin_k_dim"] + c["lin_v_heads"] * c["lin_v_dim"]
    kv = kv_cache_bytes_per_token(full, c["kv_heads"], c["head_dim"], bytes_per_element) * context
    state = linear_state_bytes(lin, c["lin_v_heads"], c["lin_k_dim"], c["lin_v_dim"], bytes_per_element,
                               conv_channels, c["conv_width"])
    return kv, state


# ----------------------------------------------------------------------------------------------
# Compile jobs

# Qwen3-Next-80B-A3B's linear layers: 32 value heads with d_k = d_v = 128 (config.json); 64k tokens, batch 1.
REAL_SHAPE = dict(B=1, H=32, T=65536, d=128)


def compile_jobs() -> dict:
    """The forward and one reversed (backward) walk at head dim 128, 32 heads, 64k tokens, fp16 and bf16,
    chunk 64, as ``linear_attention`` launches them on an H100 or B200; and the forward at chunk 32, as it
    launches on an A100."""
    from kernels import inspect as ki

    jobs = {}
    B, H, T, d = REAL_SHAPE["B"], REAL_SHAPE["H"], REAL_SHAPE["T"], REAL_SHAPE["d"]
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.empty(B, H, T, d, dtype=dtype, device="meta")
        s = torch.empty(B, H, d, d, dtype=torch.float32, device="meta")
        lg = torch.empty(H, dtype=torch.float32, device="meta")
        name = str(dtype).removeprefix("torch.")
        for reverse in (False, True):
            grid, args, kwargs = _launch_args(q, q, q, q, s, lg, chunk=64, block_v=None, reverse=reverse,
                                              store_state=not reverse, broken=0)
            label = (f"linear attention {'backward (reversed walk)' if reverse else 'forward'}, {name}, H={H}, T={T}, "
                     f"d={d}, H100/B200 launch (chunk 64)")
            jobs[label] = ki.launch_job(_linear_attention_fwd_kernel, *args, grid=grid, **kwargs)
    q = torch.empty(B, H, T, d, dtype=torch.float16, device="meta")
    grid, args, kwargs = _launch_args(q, q, q, q, s, lg, chunk=gpu_chunk(8), block_v=None, reverse=False,
                                      store_state=True, broken=0)
    jobs[f"linear attention forward, float16, H={H}, T={T}, d={d}, A100 launch (chunk {gpu_chunk(8)})"] = \
        ki.launch_job(_linear_attention_fwd_kernel, *args, target="sm80", grid=grid, **kwargs)
    return jobs


# ----------------------------------------------------------------------------------------------
# Associative recall: what a fixed state cannot do (a committed run, python -m kernels.attention.linear)

RECALL_CONFIG = dict(keys=64, values=64, d_model=64, d_head=16, batch=64, steps=600, lr=3e-3,
                     pairs=(4, 8, 16, 32, 64), eval_sequences=1024)


def recall_batch(n_pairs: int, batch: int, keys: int, values: int, generator: torch.Generator):
    """MQAR-style data (Arora et al. 2023): each sequence binds n_pairs distinct keys to random values,
    then asks for every key once, in a new order. Returns (pair_keys, pair_values, query_keys, targets),
    each (batch, n_pairs) int64."""
    pk = torch.argsort(torch.rand(batch, keys, generator=generator), -1)[:, :n_pairs]
    pv = torch.randint(0, values, (batch, n_pairs), generator=generator)
    order = torch.argsort(torch.rand(batch, n_pairs, generator=generator), -1)
    return pk, pv, torch.gather(pk, 1, order), torch.gather(pv, 1, order)


class RecallModel(torch.nn.Module):
    """One attention layer reading n (key, value) pair tokens from n query tokens. ``kind``:
    "softmax" (softmax(Q K^T / sqrt(d)) V), "linear" (Q (K^T V): the d_head x d_head state of
    linear_attention, decay 1) or "delta" (the delta rule's state, alpha = 1, beta learned, keys
    L2-normalised: gated_delta_rule_ref). The same parameters in all three, but beta's d_model weights."""

    def __init__(self, kind: str, keys: int, values: int, d_model: int, d_head: int):
        super().__init__()
        if kind not in ("softmax", "linear", "delta"):
            raise ValueError(f"RecallModel: kind must be softmax, linear or delta, got {kind!r}")
        self.kind = kind
        self.key_emb = torch.nn.Embedding(keys, d_model)
        self.val_emb = torch.nn.Embedding(values, d_model)
        self.wq, self.wk, self.wv = (torch.nn.Linear(d_model, d_head, bias=False) for _ in range(3))
        self.out = torch.nn.Linear(d_head, values)
        self.wb = torch.nn.Linear(d_model, 1) if kind == "delta" else None

    def forward(self, pk, pv, qk):
        x = self.key_emb(pk) + self.val_emb(pv)                  # pair tokens (B, n, d_model)
        xq = self.key_emb(qk)                                     # query tokens
        q, k, v = self.wq(xq), self.wk(x), self.wv(x)              # (B, n, d_head)
        if self.kind == "softmax":
            o = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1) @ v
        elif self.kind == "linear":
            o = q @ (k.transpose(1, 2) @ v)                       # Q S with S = sum_i k_i v_i^T
        else:
            from kernels.attention.delta_rule import gated_delta_rule_ref
            kn = torch.nn.functional.normalize(k, dim=-1)
            beta = torch.sigmoid(self.wb(x))[..., 0]
            _, S = gated_delta_rule_ref(kn[:, None], kn[:, None], v[:, None],
                                        torch.ones_like(beta)[:, None], beta[:, None])   # S (B, 1, d_v, d_k)
            o = q @ S[:, 0].transpose(1, 2)                        # o = S q for every query
        return self.out(o)


def train_recall(kind: str, n_pairs: int, *, steps: int | None = None, seed: int = 0, progress=None) -> float:
    """Train one RecallModel on n_pairs pairs (seeded), return its accuracy on fresh sequences."""
    c = RECALL_CONFIG
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = RecallModel(kind, c["keys"], c["values"], c["d_model"], c["d_head"])
    opt = torch.optim.Adam(model.parameters(), lr=c["lr"])
    for _ in range(steps or c["steps"]):
        pk, pv, qk, tgt = recall_batch(n_pairs, c["batch"], c["keys"], c["values"], g)
        loss = torch.nn.functional.cross_entropy(model(pk, pv, qk).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress.update(1)
    g_eval = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        pk, pv, qk, tgt = recall_batch(n_pairs, c["eval_sequences"], c["keys"], c["values"], g_eval)
        return float((model(pk, pv, qk).argmax(-1) == tgt).float().mean())


def recall_experiment(out_path=None, kinds=("softmax", "linear", "delta"), pairs=None, steps=None) -> dict:
    """Every kind at every pair count; writes json to ``out_path`` when given."""
    import json
    import time

    from tqdm import tqdm

    pairs = pairs or RECALL_CONFIG["pairs"]
    steps = steps or RECALL_CONFIG["steps"]
    t0 = time.time()
    acc = {}
    with tqdm(total=len(kinds) * len(pairs) * steps, desc="recall") as bar:
        for kind in kinds:
            acc[kind] = {str(n): train_recall(kind, n, steps=steps, progress=bar) for n in pairs}
    result = dict(config={**RECALL_CONFIG, "pairs": list(pairs), "steps": steps}, accuracy=acc,
                  seconds=round(time.time() - t0, 1), torch=torch.__version__,
                  command="OMP_NUM_THREADS=1 python -m kernels.attention.linear")
    if out_path is not None:
        from pathlib import Path
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


RECALL_RESULTS = "models/linear-attention/recall.json"


def load_recall_results() -> dict:
    """The committed run's json (``RECALL_RESULTS``, relative to the repository root)."""
    import json
    from pathlib import Path
    return json.loads((Path(__file__).resolve().parents[2] / RECALL_RESULTS).read_text())

if __name__ == "__main__":
    torch.set_num_threads(1)
    res = recall_experiment(RECALL_RESULTS)
    print(res["accuracy"], f"{res['seconds']} s")
