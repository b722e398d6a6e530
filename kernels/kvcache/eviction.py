"""KV-cache eviction: which cached tokens a decode step keeps, per layer and per K/V head.

Three policies choose, from a prompt of P cached tokens, ``budget`` of them to keep per K/V head:

* StreamingLLM (Xiao et al. 2023): the first ``sinks`` positions (the attention sinks) and the most
  recent ``budget - sinks``; ``sinks=0`` is a plain sliding window. The same positions for every head.
* H2O (Zhang et al. 2023): the ``recent`` most recent positions and the ``budget - recent`` earlier
  ones with the largest accumulated attention (the column sums of the softmax over every query so
  far, summed over the query heads of the group): the heavy hitters. Per head.
* SnapKV (Li et al. 2024): the last ``window`` prompt queries (the observation window) vote: their
  attention to each earlier key, summed over the window and the group, pooled along the keys
  (``pool`` wide, so a chosen key brings its neighbours; average pooling of width 5 by default, as
  the authors' code runs it), keeps the top ``budget - window`` earlier keys plus the window itself.
  Per head.
* H2O-mean (a diagnostic, not a published policy): H2O with each key ranked by the mean, over the
  P - j prompt queries that could see it, of its attention relative to a uniform row ((i + 1) A_ij for
  row i), which is exactly 1 for every key under uniform causal attention: no bias towards early keys.

And one policy that evicts nothing: Quest (Tang et al. 2024) keeps every prompt token and lets each
decode query choose ``budget // page`` pages of the prompt by an upper bound of its scores, from each
page's channel-wise min and max key: sum_d max(q_d min_d, q_d max_d) >= q . k for every key k of the
page. The memory stays; what is saved is the reading.

Positions: a kept token keeps the RoPE position it was written with (its key is stored rotated),
and new tokens get their true positions. StreamingLLM instead re-assigns positions inside the cache
so that a stream longer than the trained context never sees a position past it; here the cache never
outgrows the trained context (the tiny GPT's 128), so the true positions are the exact ones.

The kernel: :func:`gather_attend`, decode attention of one new token over the kept slots
``idx`` (Hkv, n) of a K/V buffer, returning the output and each kept token's attention probability
(the column H2O accumulates). One program per query head. Pass 1 reads each kept K and V row once
in tiles of BLOCK_N: the online softmax (running max m, sum l, rescaled output) and the raw logits,
stored in ``probs``; pass 2 reads only those n fp32 logits back and turns them into probabilities
2^(s - m) / l. The output needs no second look at K or V.

Shapes:
    q       (Hq, D)        the new token's queries (one sequence)
    k, v    (Hkv, S, D)    the K/V buffer of that sequence (slots 0..S-1)
    idx     (Hkv, n)       int32/int64, the kept slots of each K/V head, 1 <= n, 0 <= idx < S
    out     (Hq, D) fp32,  probs (Hq, n) fp32 (each row sums to 1)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.model.gpt import add_rms_norm_torch, rope

POLICIES = ("full", "window", "streaming", "h2o", "h2o-mean", "snapkv", "quest")
PER_QUERY = ("quest",)                    # policies that choose per decode query and evict nothing
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------- the policies

def streaming_keep(P: int, budget: int, sinks: int = 4) -> torch.Tensor:
    """Kept positions (budget,) of a P-token prompt: 0..sinks-1 and the last budget - sinks."""
    if not 0 <= sinks < budget <= P:
        raise ValueError(f"streaming_keep: need 0 <= sinks={sinks} < budget={budget} <= P={P}")
    return torch.cat([torch.arange(sinks), torch.arange(P - (budget - sinks), P)])


def accumulated_attention(probs: torch.Tensor) -> torch.Tensor:
    """probs (B, Hkv, group, P, P) causal prompt attention -> H2O's scores (B, Hkv, P): the attention
    each key received, summed over every query row and the group's query heads."""
    return probs.sum(dim=(2, 3))


def mean_attention(probs: torch.Tensor) -> torch.Tensor:
    """probs (B, Hkv, group, P, P) -> (B, Hkv, P): for key j, the mean over the P - j rows i >= j that can
    see it of (i + 1) A_ij, its attention relative to a uniform row of i + 1 keys (summed over the group).
    The plain column sum favours early keys twice: more rows see them, and early rows spread their
    attention over fewer keys; under uniform causal attention this score is 1 for every key."""
    P = probs.shape[-1]
    relative = probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]            # row i times i + 1
    return accumulated_attention(relative) / torch.arange(P, 0, -1, dtype=probs.dtype)


def h2o_keep(scores: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """scores (..., P) accumulated attention per key; kept positions (..., budget), sorted: the last
    ``recent`` and the top budget - recent of the earlier P - recent by score."""
    P = scores.shape[-1]
    if not 0 <= recent <= budget <= P:
        raise ValueError(f"h2o_keep: need 0 <= recent={recent} <= budget={budget} <= P={P}")
    heavy = scores[..., : P - recent].topk(budget - recent, dim=-1).indices            # (..., budget - recent)
    tail = torch.arange(P - recent, P).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values


def snapkv_keep(obs_probs: torch.Tensor, budget: int, window: int, pool: int = 5,
                pooling: str = "avg") -> torch.Tensor:
    """obs_probs (..., window, P): attention of the last ``window`` prompt queries (summed over the
    group's query heads); kept positions (..., budget): the window and the top budget - window of the
    earlier keys by pooled votes. ``pooling`` "avg" (the reference code's default, with pool 5) or "max"."""
    P = obs_probs.shape[-1]
    if not 0 < window <= budget <= P or obs_probs.shape[-2] != window:
        raise ValueError(f"snapkv_keep: need 0 < window={window} <= budget={budget} <= P={P} and "
                         f"obs_probs (..., window, P), got {tuple(obs_probs.shape)}")
    if pool % 2 != 1:
        raise ValueError(f"snapkv_keep: pool={pool} must be odd (a centred window)")
    if pooling not in ("avg", "max"):
        raise ValueError(f"snapkv_keep: pooling must be 'avg' or 'max', got {pooling!r}")
    votes = obs_probs[..., : P - window].sum(-2)                                        # (..., P - window)
    lead = votes.shape[:-1]
    pool1d = F.avg_pool1d if pooling == "avg" else F.max_pool1d                        # avg counts the zero padding, as SnapKV's does
    pooled = pool1d(votes.reshape(-1, 1, P - window), pool, stride=1, padding=pool // 2).reshape(*lead, -1)
    chosen = pooled.topk(budget - window, dim=-1).indices
    tail = torch.arange(P - window, P).expand(*lead, window)
    return torch.cat([chosen, tail], dim=-1).sort(dim=-1).values


def select(policy: str, probs: torch.Tensor, budget: int, *, sinks: int = 4, recent: int | None = None,
           window: int = 8, pool: int = 5, pooling: str = "avg") -> torch.Tensor:
    """Kept positions (B, Hkv, budget) of a P-token prompt from one layer's prompt attention
    probs (B, Hkv, group, P, P) (causal softmax rows)."""
    B, Hkv, _, P, _ = probs.shape
    if policy == "full":
        return torch.arange(P).expand(B, Hkv, P)
    if policy in ("window", "streaming"):
        keep = streaming_keep(P, budget, sinks if policy == "streaming" else 0)
        return keep.expand(B, Hkv, budget)
    if policy in ("h2o", "h2o-mean"):
        scores = (accumulated_attention if policy == "h2o" else mean_attention)(probs)
        return h2o_keep(scores, budget, budget // 2 if recent is None else recent)
    if policy == "snapkv":
        return snapkv_keep(probs[:, :, :, P - window:].sum(2), budget, window, pool, pooling)
    raise ValueError(f"select: unknown policy {policy!r}; implemented: {', '.join(POLICIES)}")


# ---------------------------------------------------------------- Quest: per-query page selection

def page_bounds(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (..., P, D) -> channel-wise min and max key of each page of ``page`` positions, (..., P // page, D)
    each: the metadata Quest keeps per page (P must be a multiple of the page)."""
    P, D = k.shape[-2:]
    if page < 1 or P % page:
        raise ValueError(f"page_bounds: the prompt length {P} must be a multiple of page={page}")
    kp = k.reshape(*k.shape[:-2], P // page, page, D)
    return kp.amin(-2), kp.amax(-2)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q (..., G, T, D), the group's queries at T positions; kmin, kmax (..., n_pages, D) -> (..., T, n_pages):
    sum_d max(q_d min_d, q_d max_d), an upper bound of q . k over the page's keys, summed over the group."""
    prod_lo = q[..., :, :, None, :] * kmin[..., None, None, :, :]                       # (..., G, T, n_pages, D)
    prod_hi = q[..., :, :, None, :] * kmax[..., None, None, :, :]
    return torch.maximum(prod_lo, prod_hi).sum(-1).sum(-3)                             # over D, then the group


def quest_keep(q: torch.Tensor, k: torch.Tensor, budget: int, page: int) -> torch.Tensor:
    """q (..., G, T, D) queries, k (..., P, D) the prompt's keys -> kept prompt positions (..., T, budget)
    per query: the budget // page pages with the largest bound, sorted."""
    P = k.shape[-2]
    if budget % page or not 0 < budget <= P:
        raise ValueError(f"quest_keep: budget={budget} must be a positive multiple of page={page}, at most P={P}")
    kmin, kmax = page_bounds(k, page)
    pages = quest_scores(q, kmin, kmax).topk(budget // page, dim=-1).indices            # (..., T, budget // page)
    pos = pages[..., :, None] * page + torch.arange(page)                              # (..., T, pages, page)
    return pos.flatten(-2).sort(dim=-1).values


def quest_slots(q: torch.Tensor, k_prompt: torch.Tensor, budget: int, page: int) -> torch.Tensor:
    """One decode step: q (Hq, D), k_prompt (Hkv, P, D) -> the prompt slots (Hkv, budget) this query reads,
    the ``idx`` of :func:`gather_attend`."""
    Hkv, D = k_prompt.shape[0], q.shape[-1]
    return quest_keep(q.view(Hkv, -1, 1, D), k_prompt, budget, page)[:, 0]


# ---------------------------------------------------------------- the tiny GPT with a compressed prompt

def _qkv(blk, x, pos, cfg):
    """One layer's rotated q (B, Hq, T, D), k (B, Hkv, T, D) and v of x (B, T, C) at positions pos (T,)."""
    B, T, _ = x.shape
    at, D = blk.attn, cfg.head_dim
    h = blk.norm1(x)
    q = rope(at.wq(h).view(B, T, cfg.n_head, D).transpose(1, 2), pos, cfg.rope_theta)
    k = rope(at.wk(h).view(B, T, cfg.n_kv_head, D).transpose(1, 2), pos, cfg.rope_theta)
    v = at.wv(h).view(B, T, cfg.n_kv_head, D).transpose(1, 2)
    return q, k, v


def _finish(blk, x, out, cfg):
    """The rest of the block: W_o, the residual add and norm, the MLP. out (B, Hq, T, D)."""
    B, Hq, T, D = out.shape
    a = blk.attn.wo(out.transpose(1, 2).reshape(B, T, Hq * D))
    hh, hn = add_rms_norm_torch(x, a, blk.norm2.weight, cfg.norm_eps)
    return hh + blk.mlp(hn)


@torch.no_grad()
def compressed_forward(model, idx: torch.Tensor, prompt_len: int, policy: str = "full", budget: int | None = None,
                       page: int = 8, **options) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits (B, T, V) of ``idx`` (B, T) when the first ``prompt_len`` tokens are prefilled in full,
    their cache cut to ``budget`` tokens per layer and K/V head by ``policy``, and the rest decoded
    against the kept prompt tokens plus every decoded token. Exactly the step-by-step decode, run as one
    masked forward: prompt rows attend causally to the prompt (their softmax is the prompt attention the
    policies read); a row i >= P sees key j iff j <= i and (j >= P or j kept).
    Also returns each layer's kept positions (B, Hkv, budget) and the per-layer prompt attention
    (B, Hq, P, P). For "quest" nothing is evicted: each decoded row i keeps its own prompt positions,
    (B, Hkv, T - P, budget) per layer, chosen in pages of ``page``."""
    cfg = model.config
    B, T = idx.shape
    P = prompt_len
    if not 0 < P <= T <= cfg.block_size:
        raise ValueError(f"compressed_forward: need 0 < prompt_len={P} <= T={T} <= block_size={cfg.block_size}")
    budget = P if budget is None else budget
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    g = Hq // Hkv
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]                                               # (T, T)
    x = model.wte(idx)
    kept_all, prompt_attn = [], []
    for blk in model.blocks:
        q, k, v = _qkv(blk, x, pos, cfg)                                                # (B, Hq|Hkv, T, D)
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)                  # (B, Hq, T, D)
        scores = q[:, :, :P] @ kr[:, :, :P].transpose(-1, -2) / math.sqrt(D)          # prompt rows (B, Hq, P, P)
        pp = torch.softmax(scores.masked_fill(~causal[:P, :P], float("-inf")), -1)     # causal, in full
        seen = torch.zeros(B, Hkv, T - P, T, dtype=torch.bool)                          # decoded rows (B, Hkv, row, key)
        seen[..., P:] = True                                                            # decoded tokens stay
        if policy in PER_QUERY:
            kept = quest_keep(q[:, :, P:].view(B, Hkv, g, T - P, D), k[:, :, :P], budget, page)
            seen.scatter_(3, kept, True)                                                # (B, Hkv, T - P, budget) per row
        else:
            kept = select(policy, pp.view(B, Hkv, g, P, P), budget, **options)         # (B, Hkv, budget)
            seen.scatter_(3, kept[:, :, None, :].expand(B, Hkv, T - P, budget), True)
        allowed = (causal[P:] & seen).repeat_interleave(g, 1)                           # (B, Hq, T - P, T)
        scores = q[:, :, P:] @ kr.transpose(-1, -2) / math.sqrt(D)                      # decoded rows (B, Hq, T - P, T)
        decoded = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        out = torch.cat([pp @ vr[:, :, :P], decoded @ vr], dim=2)                       # a prompt row sees keys < P only
        x = _finish(blk, x, out, cfg)
        kept_all.append(kept)
        prompt_attn.append(pp)
    return model.norm_f(x) @ model.wte.weight.T, kept_all, prompt_attn


@torch.no_grad()
def step_decode(model, idx: torch.Tensor, prompt_len: int, kept: list[torch.Tensor] | None = None, attend=None,
                per_query=None) -> torch.Tensor:
    """The same computation token by token, as a server runs it: prefill ``idx[:prompt_len]`` (idx (T,),
    one sequence) in full into a K/V buffer (Hkv, T, D) per layer, keep the slots ``kept[l]`` (Hkv, budget)
    of layer l, then decode each further token against the kept slots plus the decoded ones with
    ``attend(q, k_buf, v_buf, slots)`` (default :func:`gather_attend_ref`; :func:`gather_attend` is the
    kernel). With ``per_query(q (Hq, D), k_prompt (Hkv, P, D)) -> (Hkv, budget)`` instead of ``kept``,
    nothing is evicted: every step chooses its own prompt slots (Quest). Returns the logits
    (T - prompt_len, V) of the decoded tokens."""
    if (kept is None) == (per_query is None):
        raise ValueError("step_decode: give exactly one of kept (eviction) and per_query (per-query selection)")
    attend = attend or gather_attend_ref
    cfg = model.config
    T, P, D = idx.shape[0], prompt_len, cfg.head_dim
    g = cfg.n_head // cfg.n_kv_head
    dt = model.wte.weight.dtype
    K = [torch.zeros(cfg.n_kv_head, T, D, dtype=dt) for _ in model.blocks]
    V = [torch.zeros(cfg.n_kv_head, T, D, dtype=dt) for _ in model.blocks]
    x = model.wte(idx[None, :P])
    pos = torch.arange(P)
    for l, blk in enumerate(model.blocks):                       # the prefill, causal, in full
        q, k, v = _qkv(blk, x, pos, cfg)
        K[l][:, :P], V[l][:, :P] = k[0], v[0]
        scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(D)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        x = _finish(blk, x, torch.softmax(scores, -1) @ v.repeat_interleave(g, 1), cfg)
    slots = [None] * len(model.blocks) if kept is None else [kp.to(torch.int32) for kp in kept]
    logits = []
    for t in range(P, T):
        x = model.wte(idx[None, t:t + 1])                        # (1, 1, C)
        for l, blk in enumerate(model.blocks):
            q, k, v = _qkv(blk, x, torch.tensor([t]), cfg)       # true position t
            K[l][:, t], V[l][:, t] = k[0, :, 0], v[0, :, 0]
            new = torch.arange(P, t + 1, dtype=torch.int32).expand(cfg.n_kv_head, t + 1 - P)
            prompt = slots[l] if kept is not None else per_query(q[0, :, 0], K[l][:, :P]).to(torch.int32)
            out, _ = attend(q[0, :, 0], K[l], V[l], torch.cat([prompt, new], 1))     # (Hq, D)
            x = _finish(blk, x, out[None, :, None], cfg)
        logits.append((model.norm_f(x) @ model.wte.weight.T)[0, 0])
    return torch.stack(logits)


def decode_loss(model, windows: torch.Tensor, prompt_len: int, policy: str, budget: int | None = None,
                **options) -> float:
    """Mean next-token cross-entropy (nats) over the decoded part: targets prompt_len+1 .. T-1."""
    logits, _, _ = compressed_forward(model, windows, prompt_len, policy, budget, **options)
    return F.cross_entropy(logits[:, prompt_len:-1].reshape(-1, logits.shape[-1]),
                           windows[:, prompt_len + 1:].reshape(-1)).item()


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int = 2) -> int:
    """K and V of one token across all layers."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


# ---------------------------------------------------------------- the kernel

def gather_attend_ref(q, k, v, idx) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference in fp32 (fp64 for fp64 inputs): (out (Hq, D), probs (Hq, n))."""
    Hq, D = q.shape
    g = Hq // k.shape[0]
    idx = idx.long()
    up = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(up), k.to(up), v.to(up)
    kk = torch.gather(k.float() if up == torch.float32 else k, 1, idx[..., None].expand(-1, -1, D)).repeat_interleave(g, 0)   # (Hq, n, D)
    vv = torch.gather(v, 1, idx[..., None].expand(-1, -1, D)).repeat_interleave(g, 0)
    probs = torch.softmax(torch.einsum("hd,hnd->hn", q, kk) / math.sqrt(D), -1)
    return torch.einsum("hn,hnd->hd", probs, vv), probs


@triton.jit
def _gather_attend_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, p_ptr, n,
                          stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ih, stride_oh, stride_ph,
                          GROUP, D, scale_log2,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BROKEN: tl.constexpr):
    """One program per query head h (K/V head h // GROUP). Pass 1 reads each kept K and V row once (online
    softmax; the logits s_j stored in p); pass 2 reads the n stored logits, not K, and writes p_j.
    BROKEN: 0 correct, 1 no 1/l (unnormalised), 2 no rescale of l and acc when the max grows."""
    h = tl.program_id(0)
    hk = h // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    j = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32) * scale_log2   # (BLOCK_D,)
    k_base = k_ptr + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + hk.to(tl.int64) * stride_vh
    p_row = p_ptr + h * stride_ph
    m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)     # running max (log2 units)
    l = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)                   # running sum of exp2(s - m)
    acc = tl.zeros((BLOCK_D,), tl.float32)                                 # running sum of exp2(s - m) v
    for n0 in range(0, n, BLOCK_N):
        ok = n0 + j < n
        slot = tl.load(idx_ptr + hk * stride_ih + n0 + j, mask=ok, other=0).to(tl.int64)      # (BLOCK_N,)
        kv_ok = ok[:, None] & d_ok[None, :]
        kt = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
        vt = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_ok, other=0.0)
        s = tl.where(ok, tl.sum(kt.to(tl.float32) * q[None, :], axis=1), float("-inf"))       # (BLOCK_N,) s_j
        tl.store(p_row + n0 + j, s, mask=ok)                                                   # the logits, for pass 2
        m_new = tl.maximum(m, tl.max(s, axis=0))
        e = tl.exp2(s - m_new)                                             # (BLOCK_N,)
        if BROKEN != 2:
            alpha = tl.exp2(m - m_new)                                     # rescale what was summed at the old max
            l = l * alpha
            acc = acc * alpha
        l += tl.sum(e, axis=0)
        acc += tl.sum(e[:, None] * vt.to(tl.float32), axis=0)
        m = m_new
    inv_l = 1.0 / l
    if BROKEN == 1:
        inv_l = 1.0 + 0.0 * l                                              # broken on purpose: no 1 / l
    tl.store(o_ptr + h * stride_oh + d, acc * inv_l, mask=d_ok)            # o = sum_j 2^(s_j - m) v_j / l
    tl.debug_barrier()                                                     # pass 1's logits visible to every thread
    for n0 in range(0, n, BLOCK_N):
        ok = n0 + j < n
        s = tl.load(p_row + n0 + j, mask=ok, other=float("-inf"))
        tl.store(p_row + n0 + j, tl.exp2(s - m) * inv_l, mask=ok)         # p_j = 2^(s_j - m) / l: rows sum to 1


def check_inputs(q, k, v, idx, name: str = "gather_attend") -> None:
    if q.dim() != 2 or k.dim() != 3 or v.shape != k.shape or idx.dim() != 2:
        raise ValueError(f"{name}: q (Hq, D), k and v (Hkv, S, D), idx (Hkv, n); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(idx.shape)}")
    Hq, D = q.shape
    Hkv, S, Dk = k.shape
    if Dk != D or Hq % Hkv or idx.shape[0] != Hkv or idx.shape[1] < 1:
        raise ValueError(f"{name}: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, idx {tuple(idx.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: q, k, v must share a dtype among float16, bfloat16, float32")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: idx must be int32 or int64, got {idx.dtype}")
    if int(idx.min()) < 0 or int(idx.max()) >= S:
        raise ValueError(f"{name}: idx must lie in [0, S={S}), got [{int(idx.min())}, {int(idx.max())}]")


BROKEN_VARIANTS = {None: 0, "no-normalize": 1, "no-rescale": 2}


def _args(q, k, v, idx, out, probs, *, block_n: int, broken: str | None = None):
    Hq, D = q.shape
    grid = (Hq,)
    args = (q, k, v, idx, out, probs, idx.shape[1], q.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            idx.stride(0), out.stride(0), probs.stride(0), Hq // k.shape[0], D, 1.4426950408889634 / math.sqrt(D))
    kwargs = dict(BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), BROKEN=BROKEN_VARIANTS[broken], num_warps=4)
    return grid, args, kwargs


def gather_attend(q, k, v, idx, *, block_n: int = 32, _broken: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel: (out (Hq, D) fp32, probs (Hq, n) fp32). ``_broken`` names a deliberately wrong variant
    ("no-normalize": no 1/l; "no-rescale": l and the output not rescaled when the running max grows)."""
    if _broken not in BROKEN_VARIANTS:
        raise ValueError(f"gather_attend: _broken must be one of {sorted(map(str, BROKEN_VARIANTS))}, got {_broken!r}")
    check_inputs(q, k, v, idx)
    q, k, v, idx = (t.contiguous() for t in (q, k, v, idx))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    probs = torch.empty(q.shape[0], idx.shape[1], dtype=torch.float32, device=q.device)
    grid, args, kwargs = _args(q, k, v, idx, out, probs, block_n=block_n, broken=_broken)
    _gather_attend_kernel[grid](*args, **kwargs)
    return out, probs


REAL_CONFIGS = [("Llama-3-8B", 32, 8, 128, 4096)]


def launch_job(hq: int, hkv: int, head_dim: int, budget: int, *, slots: int = 8192, block_n: int = 32,
               dtype=torch.bfloat16, target: str = "sm90"):
    """The GPU launch of :func:`gather_attend` on meta tensors: a buffer of ``slots`` positions, ``budget`` kept."""
    from kernels import inspect as ki

    q = torch.empty(hq, head_dim, dtype=dtype, device="meta")
    k = torch.empty(hkv, slots, head_dim, dtype=dtype, device="meta")
    idx = torch.empty(hkv, budget, dtype=torch.int32, device="meta")
    out = torch.empty(hq, head_dim, dtype=torch.float32, device="meta")
    probs = torch.empty(hq, budget, dtype=torch.float32, device="meta")
    grid, args, kwargs = _args(q, k, k, idx, out, probs, block_n=block_n)
    return ki.launch_job(_gather_attend_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama-3-8B (32 q heads, 8 K/V heads, D=128), a 4096-token budget out of 8192 slots, bf16, at two tiles."""
    jobs = {}
    for label, hq, hkv, d, budget in REAL_CONFIGS:
        for block_n in (32, 64):
            jobs[f"{label}, budget {budget}, BLOCK_N {block_n}"] = launch_job(hq, hkv, d, budget, block_n=block_n)
    return jobs
