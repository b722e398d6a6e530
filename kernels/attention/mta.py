"""Multi-Token Attention (MTA, Golovneva et al. 2025): convolutions over queries, keys and heads.

Standard attention weighs key j for query i by one similarity, s_ij = q_i . k_j / sqrt(D): one query
vector against one key vector. MTA lets nearby queries and keys change each other's weights by
convolving the logit matrix before the softmax (the key-query convolution), and mixes groups of heads
before or after the softmax (head mixing):

    S      = Q K^T / sqrt(D)                                    (B, H, Nq, Nk)
    S0     = Mask_0(S)          S_ij -> 0 where key j is in query i's future (before the conv)
    C_ij   = sum_{a < c_q} sum_{b < c_k} theta[h, a, b] * S0[i - a, j - b + p]     p = (c_k - 1) // 2
    A      = softmax(Mask_-inf(C))                              (-inf where key j is in the future: after)

The query window looks back over c_q - 1 earlier queries (rows above i), the key window is centred on
key j (p keys after it, c_k - 1 - p before), the paper's configuration (``pad_key: both`` at
facebookresearch/RAM@85d44f05, projects/mta/mta_transformer.py). Out-of-range rows and columns are
zero padding. Masking with 0 *before* the convolution matters: the window at (i, j) with j <= i reaches
logits S[i - a, j - b + p] whose key j - b + p can lie after query i - a (and, with a centred key
window, after query i itself); those raw logits hold real q . k values of future tokens. Zeroing them
first keeps every C_ij a function of tokens <= i; masking only after the convolution lets keys up to
i + p leak into row i (``broken=True`` in the kernel does exactly that, and the tests show the leak).

Head mixing (``head_mix_ref``) multiplies the heads of each group of c_h heads by a learned c_h x c_h
matrix, on the logits (pre-softmax) or on the probabilities (post-softmax). The paper's 830M model
also convolves the probabilities a second time after the softmax, then normalises each head's output
(RMS group norm) and gates it; those act after the logits this module's kernel computes and are not
implemented here.

The pre-softmax convolution is linear in the logits and the logits are bilinear in q and k, so it is
also one GEMM (:func:`key_query_conv_gemm`):

    C_ij = sum_a q_{i-a} . Kt_{a,j} / sqrt(D),   Kt_{a,j} = sum_b theta[h, a, b] k_{j-b+p}
         = [q_i, q_{i-1}, ..., q_{i-c_q+1}] . [Kt_{0,j}, ..., Kt_{c_q-1,j}] / sqrt(D)   (inner dim c_q D)

exact wherever no tap reads a future logit. Mask_0 changes only the entries within c_q - 1 + p
diagonals of the main one (j >= i - (c_q + p - 2)); there the taps that read S[r, c] with c > r are
subtracted again (a band of at most c_q + p - 1 super-diagonals of S, N (c_q + p - 1) dot products).

The kernel (:func:`key_query_conv`) computes C over materialised logits: one program per
(batch x head, block of BLOCK_M query rows), looping over key blocks; for each tap (a, b) it loads the
shifted, masked logit tile and accumulates theta[h, a, b] times it in fp32. The output is fp32 (MTA's
softmax runs in fp32). Shapes: scores (B, H, Nq, Nk) in fp32/fp16/bf16 (any strides), theta (H, c_q, c_k)
with c_k odd; causal needs Nq == Nk.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention.reference import causal_mask

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU_BLOCKS = (64, 64, 4)          # BLOCK_M, BLOCK_N, num_warps
CPU_BLOCKS = (32, 64, 4)
PAIR_RUN = Path(__file__).resolve().parents[2] / "models" / "mta" / "pair_task.json"   # python -m kernels.attention.mta
# The paper's 830M MTA model (facebookresearch/RAM@180d1bad, projects/mta/configs/830M_mta.yaml):
# dim 1536, 24 layers, 16 heads (head dim 96), sequence length 2048, batch 4 per GPU, c_q = 6, c_k = 11,
# head kernel 16, MTA in layers 2, 6, 10, 14, 18, 22.
PAPER_830M = dict(dim=1536, n_layers=24, n_heads=16, head_dim=96, seq_len=2048, batch=4, c_q=6, c_k=11,
                  c_h=16, mta_layers=6)


# ----------------------------------------------------------------------------------------------
# References (PyTorch)


def key_query_conv_ref(scores: torch.Tensor, theta: torch.Tensor, *, causal: bool = True,
                       mask_before: bool = True) -> torch.Tensor:
    """C = Mask_-inf(conv_theta(Mask_0(S))) in fp32 (fp64 kept). scores (B, H, Nq, Nk), theta (H, c_q, c_k).

    ``mask_before=False`` is the broken order (mask only after the convolution)."""
    B, H, Nq, Nk = scores.shape
    _, cq, ck = theta.shape
    p = (ck - 1) // 2
    x = scores.double() if scores.dtype == torch.float64 else scores.float()
    th = theta.to(x.dtype)
    visible = causal_mask(Nq, Nk, device=x.device) if causal else None
    if causal and mask_before:
        x = x.masked_fill(~visible, 0.0)                                    # Mask_0
    xp = F.pad(x, (p, ck - 1 - p, cq - 1, 0))                              # xp[r, c] = x[r - (cq-1), c - p]
    out = torch.zeros_like(x)
    for a in range(cq):                                                    # query tap: row i - a
        for b in range(ck):                                                # key tap: column j - b + p
            r0, c0 = cq - 1 - a, ck - 1 - b
            out = out + th[:, a, b, None, None] * xp[:, :, r0:r0 + Nq, c0:c0 + Nk]
    if causal:
        out = out.masked_fill(~visible, float("-inf"))                     # Mask_-inf
    return out


def key_query_conv_conv2d(scores: torch.Tensor, theta: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """The same convolution written as the paper's code does it: F.conv2d with one group per head
    (cross-correlation, so theta is flipped), zero padding c_q - 1 rows on top and the key padding
    split around the centre. An independent second route to :func:`key_query_conv_ref`."""
    B, H, Nq, Nk = scores.shape
    _, cq, ck = theta.shape
    p = (ck - 1) // 2
    x = scores.double()
    visible = causal_mask(Nq, Nk, device=x.device)
    if causal:
        x = x.masked_fill(~visible, 0.0)
    weight = theta.double().flip(1, 2)[:, None]                           # (H, 1, cq, ck)
    out = F.conv2d(F.pad(x, (ck - 1 - p, p, cq - 1, 0)), weight, groups=H)
    return out.masked_fill(~visible, float("-inf")) if causal else out


def shifted_queries(q: torch.Tensor, c_q: int) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, N, c_q D): row i holds [q_i, q_{i-1}, ..., q_{i-c_q+1}] (zeros before 0)."""
    N = q.shape[2]
    qp = F.pad(q, (0, 0, c_q - 1, 0))                                      # qp[r] = q[r - (c_q - 1)]
    return torch.cat([qp[:, :, c_q - 1 - a:c_q - 1 - a + N] for a in range(c_q)], dim=-1)


def convolved_keys(k: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D), theta (H, c_q, c_k) -> (B, H, N, c_q D): Kt_{a,j} = sum_b theta[h, a, b] k_{j-b+p}."""
    _, cq, ck = theta.shape
    N = k.shape[2]
    p = (ck - 1) // 2
    kp = F.pad(k, (0, 0, ck - 1 - p, p))                                   # kp[c] = k[c - (ck - 1 - p)]
    th = theta.to(k.dtype)
    blocks = []
    for a in range(cq):
        kt = torch.zeros_like(k)
        for b in range(ck):                                                # k_{j-b+p} = kp[j + ck - 1 - b]
            kt = kt + th[:, a, b, None, None] * kp[:, :, ck - 1 - b:ck - 1 - b + N]
        blocks.append(kt)
    return torch.cat(blocks, dim=-1)


def future_band(q: torch.Tensor, k: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, N, N) logits S[r, c] = q_r . k_c / sqrt(D) on the ``width`` diagonals above the main one
    (0 < c - r <= width), zero elsewhere: the only future logits a causal tap can read."""
    N, D = q.shape[2], q.shape[3]
    band = q.new_zeros(q.shape[0], q.shape[1], N, N)
    r = torch.arange(N, device=q.device)
    for m in range(1, min(width, N - 1) + 1):
        band[:, :, r[:N - m], r[:N - m] + m] = (q[:, :, :N - m] * k[:, :, m:]).sum(-1) / math.sqrt(D)
    return band


def key_query_conv_gemm(q: torch.Tensor, k: torch.Tensor, theta: torch.Tensor, *, causal: bool = True,
                        return_parts: bool = False):
    """The key-query convolution of S = Q K^T / sqrt(D) as one GEMM plus a band correction (fp64 kept,
    else fp32). q, k (B, H, N, D), theta (H, c_q, c_k). Equals ``key_query_conv_ref(q k^T / sqrt(D), theta)``.

    GEMM: C = shifted_queries(Q) convolved_keys(K)^T / sqrt(D), inner dimension c_q D. Causal: minus the
    convolution of the future logits the taps read (``future_band``, c_q - 1 + p diagonals), then
    Mask_-inf. ``return_parts`` also returns the GEMM and the correction."""
    if q.shape != k.shape:
        raise ValueError(f"key_query_conv_gemm: q and k must have one shape (self-attention), got {tuple(q.shape)}, {tuple(k.shape)}")
    _, cq, ck = theta.shape
    x = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, theta = q.to(x), k.to(x), theta.to(x)
    D = q.shape[-1]
    gemm = shifted_queries(q, cq) @ convolved_keys(k, theta).transpose(-1, -2) / math.sqrt(D)   # (B, H, N, N)
    if not causal:
        return (gemm, gemm, torch.zeros_like(gemm)) if return_parts else gemm
    width = cq - 1 + (ck - 1) // 2                                         # farthest future logit a tap reads
    fix = key_query_conv_ref(future_band(q, k, width), theta, causal=False)
    out = (gemm - fix).masked_fill(~causal_mask(q.shape[2], q.shape[2], device=q.device), float("-inf"))
    return (out, gemm, fix) if return_parts else out


def head_mix_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Mix heads within groups: x (B, H, Nq, Nk), w (H // c_h, c_h, c_h);
    out[:, g c_h + o] = sum_i w[g, o, i] x[:, g c_h + i]."""
    B, H, Nq, Nk = x.shape
    G, ch, _ = w.shape
    xg = x.reshape(B, G, ch, Nq, Nk)
    return torch.einsum("goi,bginm->bgonm", w.to(x.dtype), xg).reshape(B, H, Nq, Nk)


def mta_attention_ref(q, k, v, theta, head_w=None, *, head_mix: str = "pre", causal: bool = True,
                      return_probs: bool = False):
    """MTA attention in fp32: key-query convolution, head mixing (``"pre"`` or ``"post"`` softmax, or
    no mixing with ``head_w=None``), softmax, values. q, k, v (B, H, N, D); theta (H, c_q, c_k)."""
    if head_mix not in ("pre", "post"):
        raise ValueError(f"mta_attention_ref: head_mix must be 'pre' or 'post', got {head_mix!r}")
    D = q.shape[-1]
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)         # (B, H, Nq, Nk)
    c = key_query_conv_ref(s, theta, causal=causal)
    visible = torch.isfinite(c)
    if head_w is not None and head_mix == "pre":
        c = head_mix_ref(c.masked_fill(~visible, 0.0), head_w).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(c, dim=-1)
    if head_w is not None and head_mix == "post":
        probs = head_mix_ref(probs, head_w).masked_fill(~visible, 0.0)
    out = probs @ v.float()
    return (out, probs) if return_probs else out


def identity_theta(n_heads: int, c_q: int, c_k: int) -> torch.Tensor:
    """The kernel that leaves the logits unchanged (the paper's identity initialisation)."""
    th = torch.zeros(n_heads, c_q, c_k)
    th[:, 0, (c_k - 1) // 2] = 1.0
    return th


# ----------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _kq_conv_kernel(
    s_ptr, th_ptr, o_ptr,
    stride_sb, stride_sh, stride_sm, stride_sn, stride_ob, stride_oh, stride_om,
    H, Nq, Nk,
    CQ: tl.constexpr, CK: tl.constexpr, CAUSAL: tl.constexpr, BROKEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query block, batch x head): C[i, j] = sum_ab theta[h, a, b] S0[i - a, j - b + P]."""
    P: tl.constexpr = (CK - 1) // 2
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    s_base = s_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    th_base = th_ptr + h * (CQ * CK)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # query i
    row_ok = rows < Nq
    n_conv = Nk
    if CAUSAL:                                                           # key blocks past the last row: all -inf
        n_conv = tl.minimum(Nk, (start_m + 1) * BLOCK_M)
    for start_n in range(0, n_conv, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)                           # key j
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for a in range(CQ):
            r = rows - a                                                 # query row i - a
            r_ok = (r >= 0) & (r < Nq)
            for kb in range(CK):
                c = cols - kb + P                                        # key column j - b + P
                ok = r_ok[:, None] & ((c >= 0) & (c < Nk))[None, :]
                if CAUSAL and not BROKEN:
                    ok = ok & (c[None, :] <= r[:, None])                 # Mask_0: future logits read as 0
                x = tl.load(s_base + r.to(tl.int64)[:, None] * stride_sm + c[None, :] * stride_sn,
                            mask=ok, other=0.0).to(tl.float32)
                acc += tl.load(th_base + a * CK + kb) * x
        if CAUSAL:
            acc = tl.where(cols[None, :] <= rows[:, None], acc, float("-inf"))   # Mask_-inf
        tl.store(o_base + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc,
                 mask=row_ok[:, None] & (cols < Nk)[None, :])
    if CAUSAL:
        for start_n in range(tl.cdiv(n_conv, BLOCK_N) * BLOCK_N, Nk, BLOCK_N):    # wholly in the future
            cols = start_n + tl.arange(0, BLOCK_N)
            tl.store(o_base + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
                     tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32),
                     mask=row_ok[:, None] & (cols < Nk)[None, :])


def _check(scores, theta, causal, name="key_query_conv"):
    for arg, t in (("scores", scores), ("theta", theta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if scores.dim() != 4:
        raise ValueError(f"{name}: scores must be 4-D (B, H, Nq, Nk), got shape {tuple(scores.shape)}")
    if scores.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: scores has dtype {scores.dtype}; supported: float32, float16, bfloat16")
    if theta.dim() != 3 or theta.shape[0] != scores.shape[1]:
        raise ValueError(f"{name}: theta must be (H={scores.shape[1]}, c_q, c_k), got {tuple(theta.shape)}")
    if theta.dtype != torch.float32:
        raise TypeError(f"{name}: theta must be float32, got {theta.dtype}")
    cq, ck = theta.shape[1], theta.shape[2]
    if cq < 1 or ck < 1 or ck % 2 == 0:
        raise ValueError(f"{name}: c_q >= 1 and an odd c_k (a centred key window) expected, got c_q={cq}, c_k={ck}")
    B, H, Nq, Nk = scores.shape
    if B < 1 or H < 1 or Nq < 1 or Nk < 1:
        raise ValueError(f"{name}: every dimension of scores must be at least 1, got {tuple(scores.shape)}")
    if causal and Nq != Nk:
        raise ValueError(f"{name}: causal=True needs Nq == Nk (a whole sequence), got Nq={Nq}, Nk={Nk}")


def _launch_args(scores, theta, out, *, causal: bool, broken: bool, block_m: int, block_n: int, num_warps: int):
    """(grid, args, kwargs) of one launch of :func:`_kq_conv_kernel`, shared with :func:`compile_jobs`."""
    B, H, Nq, Nk = scores.shape
    args = (scores, theta, out, *scores.stride(), out.stride(0), out.stride(1), out.stride(2), H, Nq, Nk)
    kwargs = dict(CQ=theta.shape[1], CK=theta.shape[2], CAUSAL=causal, BROKEN=broken, BLOCK_M=block_m,
                  BLOCK_N=block_n, num_warps=num_warps)
    return (triton.cdiv(Nq, block_m), B * H), args, kwargs


def key_query_conv(scores: torch.Tensor, theta: torch.Tensor, *, causal: bool = True, broken: bool = False,
                   blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The key-query convolution of MTA on materialised logits: (B, H, Nq, Nk) float32, -inf in the causal
    future. ``broken=True`` masks only after the convolution (future logits leak in).
    ``blocks`` = (BLOCK_M, BLOCK_N, num_warps)."""
    _check(scores, theta, causal)
    if not isinstance(broken, bool):
        raise TypeError(f"key_query_conv: broken must be a bool, got {broken!r}")
    bm, bn, warps = blocks or (GPU_BLOCKS if runtime.runtime().on_gpu else CPU_BLOCKS)
    for nm, val in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"key_query_conv: {nm} must be a power of two >= 16, got {val!r}")
    if causal and bm > bn:
        raise ValueError(f"key_query_conv: causal needs BLOCK_M <= BLOCK_N, got {bm} > {bn}")
    out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
    grid, args, kwargs = _launch_args(scores, theta.contiguous(), out, causal=causal, broken=broken,
                                      block_m=bm, block_n=bn, num_warps=warps)
    _kq_conv_kernel[grid](*args, **kwargs)
    return out


# ----------------------------------------------------------------------------------------------
# Costs


def conv_costs(n: int, *, head_dim: int, c_q: int, c_k: int, c_h: int = 0, block_m: int = 128,
               block_n: int = 128) -> dict:
    """Per head and sequence of n tokens (causal, counting the n(n+1)/2 visible logits):
    FLOPs of Q K^T, of one c_q x c_k convolution as scalar FMAs (2 c_q c_k per logit), of the same
    convolution as the GEMM of :func:`key_query_conv_gemm` (2 c_q D per logit, on tensor cores, in place
    of Q K^T) and the visible logits in its correction band (c_q - 1 + p diagonals), of one c_h-head mix
    (2 c_h per logit); the bytes of materialising fp32 logits; and the halo: a fused kernel's
    BLOCK_M x BLOCK_N output tile needs the logits of (BLOCK_M + c_q - 1) x (BLOCK_N + c_k - 1) positions."""
    logits = n * (n + 1) // 2
    diagonals = min(n, c_q - 1 + (c_k - 1) // 2)                           # j in [i - diagonals + 1, i]
    band = diagonals * n - diagonals * (diagonals - 1) // 2
    halo_tile = (block_m + c_q - 1) * (block_n + c_k - 1)
    return dict(logits=logits, qk_flops=2 * head_dim * logits, conv_flops=2 * c_q * c_k * logits,
                gemm_flops=2 * c_q * head_dim * logits, band_diagonals=diagonals, band_logits=band,
                head_mix_flops=2 * c_h * logits, logit_bytes_fp32=4 * n * n,
                halo_factor=halo_tile / (block_m * block_n))


# ----------------------------------------------------------------------------------------------
# The toy task: point at the place where letter a is followed by letter b


def pair_task(n: int, *, length: int = 16, vocab: int = 8, distractors: int = 2, seed: int = 0):
    """n sequences of ``length`` letters from ``vocab``, each with exactly one adjacent pair (a, b),
    a != b, plus ``distractors`` extra copies of a and of b elsewhere (never forming the pair).
    Returns ctx (n, length) int64, a (n,), b (n,), target (n,): the position of the pair's b."""
    if length < 4 or vocab < 3:
        raise ValueError(f"pair_task: length >= 4 and vocab >= 3 expected, got {length}, {vocab}")
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(vocab, (n, length), generator=g)
    a = torch.randint(vocab, (n,), generator=g)
    b = (a + torch.randint(1, vocab, (n,), generator=g)) % vocab
    target = torch.randint(1, length, (n,), generator=g)
    rows = torch.arange(n)
    for letter in (a, b):
        for _ in range(distractors):
            pos = torch.randint(length, (n,), generator=g)
            ctx[rows, pos] = letter
    ctx[rows, target - 1], ctx[rows, target] = a, b
    other = (b[:, None] + 1 + torch.randint(vocab - 2, (n, length), generator=g)) % vocab
    other = torch.where(other == a[:, None], (other + 1) % vocab, other)  # neither a nor b
    other = torch.where(other == b[:, None], (other + 1) % vocab, other)
    for j in range(1, length):                                            # break every other pair
        extra = (ctx[:, j - 1] == a) & (ctx[:, j] == b) & (j != target)
        ctx[:, j] = torch.where(extra, other[:, j], ctx[:, j])
    return ctx, a, b, target


class PairPointer(torch.nn.Module):
    """One attention head that points at a context position: query from the two letters (a, b)
    (both known to the query, in order), keys from each context token plus its position, logits
    s_j = q . k_j / sqrt(d). ``mta=True`` adds a key convolution of width ``c_k`` over the logits
    (c_q = 1: one query row), initialised to the identity; with ``mta=False`` it stays the identity,
    i.e. standard attention. The two models differ by c_k parameters."""

    def __init__(self, vocab: int, length: int, d: int = 32, *, mta: bool, c_k: int = 3):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(length, d)
        self.qa = torch.nn.Embedding(vocab, d)
        self.qb = torch.nn.Embedding(vocab, d)
        self.wq = torch.nn.Linear(d, d, bias=False)
        self.wk = torch.nn.Linear(d, d, bias=False)
        self.theta = torch.nn.Parameter(identity_theta(1, 1, c_k), requires_grad=mta)
        self.mta = mta

    def logits(self, ctx, a, b):
        L = ctx.shape[1]
        k = self.wk(self.tok(ctx) + self.pos(torch.arange(L)))            # (n, L, d): one token per key
        q = self.wq(self.qa(a) + self.qb(b))                               # (n, d): knows a and b
        s = (k @ q[:, :, None])[:, None, :, 0] / math.sqrt(q.shape[-1])    # (n, 1 query, L)
        if self.mta:
            s = key_query_conv_ref(s[:, None], self.theta, causal=False)[:, 0]
        return s[:, 0]                                                     # (n, L)


def train_pair_pointer(*, mta: bool, steps: int = 300, batch: int = 256, seed: int = 0, lr: float = 0.02,
                       length: int = 16, vocab: int = 8, progress: bool = False) -> tuple[PairPointer, list[float]]:
    """Adam on fresh batches of :func:`pair_task` (cross-entropy over positions); returns the model and losses."""
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    model = PairPointer(vocab, length, mta=mta)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in tqdm(range(steps), disable=not progress, desc="MTA" if mta else "standard"):
        ctx, a, b, t = pair_task(batch, length=length, vocab=vocab, seed=10_000 * seed + step + 1)
        loss = F.cross_entropy(model.logits(ctx, a, b), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@torch.no_grad()
def pair_accuracy(model: PairPointer, n: int = 4000, *, seed: int = 123, length: int = 16, vocab: int = 8) -> float:
    ctx, a, b, t = pair_task(n, length=length, vocab=vocab, seed=seed)
    return float((model.logits(ctx, a, b).argmax(-1) == t).double().mean())


# ----------------------------------------------------------------------------------------------
# Compile jobs


def compile_jobs() -> dict:
    """The paper's 830M MTA layer (16 heads, 2048 tokens, batch 4, c_q = 6, c_k = 11; PAPER_830M) on
    bf16 logits, as :func:`key_query_conv` launches it on a GPU (64 x 64 blocks, 4 warps)."""
    from kernels import inspect as ki

    c = PAPER_830M
    B, H, N = c["batch"], c["n_heads"], c["seq_len"]
    bm, bn, warps = GPU_BLOCKS
    scores = torch.empty(B, H, N, N, device="meta", dtype=torch.bfloat16)
    theta = torch.empty(H, c["c_q"], c["c_k"], device="meta", dtype=torch.float32)
    out = torch.empty(B, H, N, N, device="meta", dtype=torch.float32)
    grid, args, kwargs = _launch_args(scores, theta, out, causal=True, broken=False, block_m=bm, block_n=bn,
                                      num_warps=warps)
    return {"830M MTA layer key-query conv, 16 heads, S=2048, c_q=6, c_k=11": ki.launch_job(
        _kq_conv_kernel, *args, grid=grid, **kwargs)}


def single_token_ceiling(n: int = 4000, *, seed: int = 123, length: int = 16, vocab: int = 8) -> float:
    """The accuracy of the best pointer that sees each key's token alone: pick uniformly among the
    positions j >= 1 holding b (the target is one of them, placed uniformly): E[1 / #{j >= 1: x_j = b}]."""
    ctx, a, b, t = pair_task(n, length=length, vocab=vocab, seed=seed)
    m = (ctx[:, 1:] == b[:, None]).sum(-1)
    return float((1.0 / m.double()).mean())


def load_pair_run() -> dict:
    """The committed run's results (:data:`PAIR_RUN`)."""
    import json

    return json.loads(PAIR_RUN.read_text())


def pair_run(seeds=(0, 1, 2), steps: int = 300, progress: bool = True) -> dict:
    """Train both models for each seed; accuracies on a held-out set (seed 123), learned kernels."""
    out = {"command": "python -m kernels.attention.mta", "steps": steps, "batch": 256, "length": 16, "vocab": 8,
           "d": 32, "c_k": 3, "seeds": list(seeds), "standard": [], "mta": [], "theta": [],
           "ceiling": single_token_ceiling()}
    for seed in seeds:
        for kind in ("standard", "mta"):
            model, losses = train_pair_pointer(mta=kind == "mta", steps=steps, seed=seed, progress=progress)
            out[kind].append(pair_accuracy(model))
            if kind == "mta":
                out["theta"].append([round(x, 4) for x in model.theta.detach().flatten().tolist()])
    return out


if __name__ == "__main__":
    import json
    import time

    torch.set_num_threads(1)
    t0 = time.time()
    result = pair_run()
    result["seconds"] = round(time.time() - t0, 1)
    path = PAIR_RUN
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(path, result)
