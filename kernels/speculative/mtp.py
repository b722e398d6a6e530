"""Multi-token prediction (MTP): extra training targets t+2, t+3, ... on top of next-token prediction,
and the extra module reused as a draft for greedy self-speculative decoding.

Two architectures, both trained here from scratch on the course's Shakespeare bytes:

* :class:`ParallelHeads` (Gloeckle et al. 2024): a shared trunk (the first L - 1 blocks of the GPT)
  and n independent one-block heads; head k predicts token t + k from the trunk's state at t, all
  heads share the unembedding. Head 1 is the GPT's own last block, so the next-token model is
  exactly a plain :class:`~kernels.model.gpt.GPT` with L blocks.

      z_t = trunk(x_<=t),   P(x_{t+k} | x_<=t) = softmax(E norm_k(head_k(z_t)))      k = 1..n

* :class:`SequentialMTP` (DeepSeek-V3, Liu et al. 2024): D modules in a chain; module k at position
  i combines the previous depth's state h_i^{k-1} (depth 0 = the main model) with the embedding of
  the token at i + k, and runs one transformer block over the sequence (causal, so the chain of
  predictions stays causal at every depth); the embedding E and the output head are shared:

      h'_i^k = M_k [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))]           M_k: (C, 2C)
      h_{1:T-k}^k = TRM_k(h'_{1:T-k}^k)
      P_{i+k+1}^k = softmax(E RMSNorm(h_i^k))                              predicts t_{i+k+1}

  Loss: L = L_main + (lambda / D) sum_k L_MTP^k, each L_MTP^k the mean cross-entropy over the
  positions that have a target at depth k.

The Triton kernel :func:`mtp_cross_entropy` computes that weighted multi-depth loss and its gradient
from the logits of every depth in one launch: row (k, b, t) is scored against the token shifted by
k + 1, rows past the end are masked, each depth's mean uses its own count. ``broken=True`` shifts
the targets by k instead of k + 1 (depth k scored against the previous depth's target), for the
tests to catch. :func:`mtp_cross_entropy_ref` is the PyTorch reference.

:func:`mtp_speculative_greedy`: greedy decoding where the depth-1 MTP module proposes the token
after next and one two-token forward of the main model verifies it; equal to plain greedy decoding
token for token.

The committed run: ``python -m kernels.speculative.mtp`` (writes models/mtp/).

Shapes: B batch, T tokens, C d_model, V vocabulary, D MTP depth, K = D + 1 depths scored (main + D).
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.model.gpt import GPT, Block, GPTConfig, KVCache, RMSNorm

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "mtp"
SEED = 1337
# The committed run's model: the tiny GPT's width and vocabulary, 3 blocks, 64-byte windows.
RUN_CONFIG = GPTConfig(n_layer=3, block_size=64)


# ---------------------------------------------------------------- the two architectures

class ParallelHeads(nn.Module):
    """Gloeckle et al.: heads 2..n, each one transformer block plus its own final RMSNorm, on the
    trunk state (the output of the GPT's first L - 1 blocks). Head 1 is the GPT's last block."""

    def __init__(self, config: GPTConfig, n_heads: int):
        super().__init__()
        if n_heads < 2:
            raise ValueError(f"ParallelHeads: n_heads must be >= 2, got {n_heads}")
        self.blocks = nn.ModuleList(Block(config) for _ in range(n_heads - 1))
        self.norms = nn.ModuleList(RMSNorm(config.d_model, config.norm_eps) for _ in range(n_heads - 1))

    def forward(self, model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
        """idx (B, T) -> [logits of head 1 (B, T, V), head 2, ..., head n]; head k at t predicts t + k."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        z = model.wte(idx)                                                # (B, T, C)
        for block in model.blocks[:-1]:
            z = block(z, pos)                                             # trunk
        E = model.wte.weight                                              # (V, C) shared unembedding
        out = [model.norm_f(model.blocks[-1](z, pos)) @ E.T]              # head 1 = the GPT itself
        for block, norm in zip(self.blocks, self.norms):
            out.append(norm(block(z, pos)) @ E.T)                         # head k >= 2
        return out


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module: two RMSNorms, the projection M (C, 2C), one block, a final RMSNorm."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.d_model
        self.norm_h = RMSNorm(C, config.norm_eps)
        self.norm_e = RMSNorm(C, config.norm_eps)
        self.proj = nn.Linear(2 * C, C, bias=False)                       # M_k
        self.block = Block(config)
        self.norm_out = RMSNorm(C, config.norm_eps)
        nn.init.normal_(self.proj.weight, std=0.02)

    def combine(self, h_prev: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """h'_i = M [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))]: (B, T, C), (B, T, C) -> (B, T, C)."""
        return self.proj(torch.cat([self.norm_h(h_prev), self.norm_e(emb)], -1))

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, *, cache: KVCache | None = None) -> torch.Tensor:
        """The module's state h^k (B, T, C) (before its output norm); with ``cache`` it continues the
        positions already cached (one block: layer 0 of a 1-layer KVCache)."""
        x = self.combine(h_prev, emb)
        if cache is None:
            pos = torch.arange(x.shape[1], device=x.device)
        else:
            pos = cache.seqlens.long()[:, None] + torch.arange(x.shape[1], device=x.device)
        out = self.block(x, pos, cache=cache, layer=0)
        if cache is not None:
            cache.seqlens += x.shape[1]
        return out


class SequentialMTP(nn.Module):
    """DeepSeek-V3's D sequential modules; the main model's embedding and output head are shared."""

    def __init__(self, config: GPTConfig, depth: int = 1, *, detach_shared: bool = False):
        super().__init__()
        if depth < 1:
            raise ValueError(f"SequentialMTP: depth must be >= 1, got {depth}")
        self.modules_ = nn.ModuleList(MTPModule(config) for _ in range(depth))
        self.detach_shared = detach_shared        # an ablation: no MTP gradient into the shared embedding/head

    @property
    def depth(self) -> int:
        return len(self.modules_)

    def forward(self, model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
        """idx (B, T) -> [main logits (B, T, V), depth-1 logits (B, T-1, V), ..., depth D (B, T-D, V)].

        Depth k at position i (0-based, i < T - k) reads h_i^{k-1} and Emb(idx[i + k]) and predicts
        idx[i + k + 1] (the token k + 1 ahead of i)."""
        T = idx.shape[1]
        h = model(idx, return_hidden=True)                                # (B, T, C) main state (normed)
        E = model.wte.weight
        out = [h @ E.T]
        E_mtp = E.detach() if self.detach_shared else E                  # the table as the modules see it
        emb = F.embedding(idx, E_mtp)                                     # (B, T, C) shared embedding
        for k, mod in enumerate(self.modules_, start=1):
            h = mod(h[:, : T - k], emb[:, k:])                            # (B, T - k, C)
            out.append(mod.norm_out(h) @ E_mtp.T)                         # shared output head
        return out


def multi_depth_loss(logits: list[torch.Tensor], tokens: torch.Tensor, weights: list[float]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """sum_k w_k CE_k, CE_k the mean cross-entropy of logits[k] (B, T_k, V) against tokens[:, k+1 : k+1+T_k]
    (tokens (B, T + 1 + extra): the window the inputs came from). Returns (weighted loss, [CE_k])."""
    ces = []
    for k, lg in enumerate(logits):
        tgt = tokens[:, k + 1: k + 1 + lg.shape[1]]
        ces.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1)))
    return sum(w * c for w, c in zip(weights, ces)), ces


# ---------------------------------------------------------------- the weighted multi-depth loss

def check_loss_inputs(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, name: str) -> None:
    if logits.dim() != 4:
        raise ValueError(f"{name}: logits must be (K, B, T, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: logits dtype must be float32, float16 or bfloat16, got {logits.dtype}")
    K, B, T, V = logits.shape
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[0] != B:
        raise ValueError(f"{name}: tokens must be a (B={B}, L) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if weights.shape != (K,) or not weights.dtype.is_floating_point:
        raise ValueError(f"{name}: weights must be a float tensor of shape ({K},), got {tuple(weights.shape)} {weights.dtype}")
    if tokens.device != logits.device or weights.device != logits.device:
        raise ValueError(f"{name}: logits, tokens and weights must be on one device, got "
                         f"{logits.device}, {tokens.device}, {weights.device}")
    counts = depth_counts(K, B, T, tokens.shape[1])
    for k in range(K):
        if counts[k] == 0:
            raise ValueError(f"{name}: depth {k} has no target (T={T}, L={tokens.shape[1]}): drop it")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
        raise ValueError(f"{name}: tokens must lie in [0, V={V})")


def depth_counts(K: int, B: int, T: int, L: int) -> list[int]:
    """n_k: rows of depth k that have a target, row (b, t) needing t + k + 1 < L."""
    return [B * max(0, min(T, L - k - 1)) for k in range(K)]


def mtp_cross_entropy_ref(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w_k / n_k * sum_{b, t: t+k+1 < L} CE(logits[k, b, t], tokens[b, t + k + 1]).

    logits (K, B, T, V): depth 0 is the main head, depth k predicts the token k + 1 ahead;
    tokens (B, L) the window the inputs came from; weights (K,) (DeepSeek-V3: [1, lambda/D, ...])."""
    check_loss_inputs(logits, tokens, weights, "mtp_cross_entropy_ref")
    K, B, T, V = logits.shape
    L = tokens.shape[1]
    total = logits.new_zeros((), dtype=torch.float32)
    for k in range(K):
        rows = min(T, L - k - 1)                                           # positions with a target
        lg = logits[k, :, :rows].float().reshape(-1, V)                    # (B * rows, V)
        tgt = tokens[:, k + 1: k + 1 + rows].reshape(-1)                   # shifted by k + 1
        total = total + weights[k].float() * F.cross_entropy(lg, tgt)      # w_k * mean_k
    return total


@triton.jit
def _mtp_ce_fwd_kernel(logits_ptr, tokens_ptr, weights_ptr, loss_ptr, lse_ptr,
                       s_lk, s_lb, s_lt, s_tb, B, T, L, V,
                       BLOCK_V: tl.constexpr, BROKEN: tl.constexpr):
    """One program per row (k, b, t): lse = logsumexp_v logits, loss_row = (w_k / n_k)(lse - logits[target]).

    The target is tokens[b, t + k + 1] (BROKEN: tokens[b, t + k], the previous depth's target);
    rows without a target store 0. Offsets in int64: the logits pass 2**31 elements at a real size."""
    row = tl.program_id(0)
    t = row % T
    b = (row // T) % B
    k = row // (T * B)
    shift = k + 1
    if BROKEN:
        shift = k
    base = logits_ptr + k.to(tl.int64) * s_lk + b.to(tl.int64) * s_lb + t.to(tl.int64) * s_lt
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)                    # running max per lane
    s = tl.zeros((BLOCK_V,), tl.float32)                                  # running sum of exp(x - m)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        s = s * scale + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    m_all = tl.max(m, 0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), 0))
    valid = t + shift < L
    rows_k = tl.minimum(T, L - k - 1)                                     # n_k / B
    tgt = tl.load(tokens_ptr + b.to(tl.int64) * s_tb + tl.where(valid, t + shift, 0))
    x_t = tl.load(base + tgt).to(tl.float32)
    w = tl.load(weights_ptr + k).to(tl.float32) / (B * rows_k).to(tl.float32)
    loss = tl.where(valid, w * (lse - x_t), 0.0)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _mtp_ce_bwd_kernel(logits_ptr, tokens_ptr, weights_ptr, lse_ptr, grad_out_ptr, grad_ptr,
                       s_lk, s_lb, s_lt, s_gk, s_gb, s_gt, s_tb, B, T, L, V,
                       BLOCK_V: tl.constexpr, BROKEN: tl.constexpr):
    """d loss / d logits[k, b, t, v] = g (w_k / n_k)(softmax_v - [v == target]); 0 on rows without a target."""
    row = tl.program_id(0)
    t = row % T
    b = (row // T) % B
    k = row // (T * B)
    shift = k + 1
    if BROKEN:
        shift = k
    base = logits_ptr + k.to(tl.int64) * s_lk + b.to(tl.int64) * s_lb + t.to(tl.int64) * s_lt
    gbase = grad_ptr + k.to(tl.int64) * s_gk + b.to(tl.int64) * s_gb + t.to(tl.int64) * s_gt
    valid = t + shift < L
    rows_k = tl.minimum(T, L - k - 1)
    tgt = tl.load(tokens_ptr + b.to(tl.int64) * s_tb + tl.where(valid, t + shift, 0))
    w = tl.load(weights_ptr + k).to(tl.float32) / (B * rows_k).to(tl.float32)
    coef = tl.where(valid, w * tl.load(grad_out_ptr).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = coef * (p - tl.where(offs == tgt, 1.0, 0.0))
        tl.store(gbase + offs, g.to(grad_ptr.dtype.element_ty), mask=offs < V)


def default_block_v(V: int) -> int:
    return min(4096, triton.next_power_of_2(V))


def _fwd_args(logits, tokens, weights, loss, lse, *, block_v: int, broken: bool, num_warps: int = 8):
    K, B, T, V = logits.shape
    args = (logits, tokens, weights, loss, lse, logits.stride(0), logits.stride(1), logits.stride(2),
            tokens.stride(0), B, T, tokens.shape[1], V)
    return (K * B * T,), args, dict(BLOCK_V=block_v, BROKEN=broken, num_warps=num_warps)


def _bwd_args(logits, tokens, weights, lse, grad_out, grad, *, block_v: int, broken: bool, num_warps: int = 8):
    K, B, T, V = logits.shape
    args = (logits, tokens, weights, lse, grad_out, grad, logits.stride(0), logits.stride(1), logits.stride(2),
            grad.stride(0), grad.stride(1), grad.stride(2), tokens.stride(0), B, T, tokens.shape[1], V)
    return (K * B * T,), args, dict(BLOCK_V=block_v, BROKEN=broken, num_warps=num_warps)


class _MTPCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, weights, block_v, broken):
        K, B, T, V = logits.shape
        loss = torch.empty(K * B * T, dtype=torch.float32, device=logits.device)
        lse = torch.empty(K * B * T, dtype=torch.float32, device=logits.device)
        grid, args, kw = _fwd_args(logits, tokens, weights, loss, lse, block_v=block_v, broken=broken)
        _mtp_ce_fwd_kernel[grid](*args, **kw)
        ctx.save_for_backward(logits, tokens, weights, lse)
        ctx.block_v, ctx.broken = block_v, broken
        return loss.sum()

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens, weights, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)   # contiguous
        grid, args, kw = _bwd_args(logits, tokens, weights, lse, grad_out.float().contiguous(), grad,
                                   block_v=ctx.block_v, broken=ctx.broken)
        _mtp_ce_bwd_kernel[grid](*args, **kw)
        return grad, None, None, None, None


def mtp_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, *,
                      block_v: int | None = None, broken: bool = False) -> torch.Tensor:
    """The Triton version of :func:`mtp_cross_entropy_ref` (same arguments, same value), differentiable
    in ``logits``. The vocabulary dimension must be contiguous; the others may be strided (views).
    ``broken=True`` scores depth k against the token k ahead instead of k + 1, for the tests."""
    check_loss_inputs(logits, tokens, weights, "mtp_cross_entropy")
    if logits.stride(-1) != 1:
        raise ValueError(f"mtp_cross_entropy: logits must be contiguous in the vocabulary dimension, "
                         f"got stride {logits.stride(-1)}")
    if not isinstance(broken, bool):
        raise ValueError(f"mtp_cross_entropy: broken must be a bool, got {broken!r}")
    V = logits.shape[-1]
    block_v = block_v or default_block_v(V)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"mtp_cross_entropy: block_v must be a power of two >= 16, got {block_v}")
    return _MTPCrossEntropy.apply(logits, tokens.contiguous(), weights.float().contiguous(), block_v, broken)


DEEPSEEK_V3_VOCAB = 129280
DEEPSEEK_V3_HIDDEN = 7168


def launch_job(batch: int, seq: int, depth: int = 1, vocab: int = DEEPSEEK_V3_VOCAB, *, backward: bool = False,
               dtype: torch.dtype = torch.bfloat16, target: str = "sm90"):
    """The GPU launch of the forward (or backward) kernel on meta tensors: K = depth + 1 depths of
    bf16 logits (K, batch, seq, vocab), tokens (batch, seq + depth + 1)."""
    from kernels import inspect as ki

    K = depth + 1
    logits = torch.empty(K, batch, seq, vocab, dtype=dtype, device="meta")
    tokens = torch.empty(batch, seq + depth + 1, dtype=torch.long, device="meta")
    weights = torch.empty(K, device="meta")
    lse = torch.empty(K * batch * seq, device="meta")
    bv = default_block_v(vocab)
    if backward:
        grad = torch.empty_like(logits)
        grid, args, kw = _bwd_args(logits, tokens, weights, lse, torch.empty(1, device="meta"), grad,
                                   block_v=bv, broken=False)
        return ki.launch_job(_mtp_ce_bwd_kernel, *args, target=target, grid=grid, **kw)
    loss = torch.empty(K * batch * seq, device="meta")
    grid, args, kw = _fwd_args(logits, tokens, weights, loss, lse, block_v=bv, broken=False)
    return ki.launch_job(_mtp_ce_fwd_kernel, *args, target=target, grid=grid, **kw)


def compile_jobs() -> dict:
    """DeepSeek-V3's vocabulary (129280), D = 1 (two depths), bf16 logits of 4 x 4096 tokens."""
    return {f"V 129280, D 1, 4x4096 tokens, {'backward' if bw else 'forward'}": launch_job(4, 4096, backward=bw)
            for bw in (False, True)}


# ---------------------------------------------------------------- the MTP module as a draft

@torch.no_grad()
def mtp_speculative_greedy(model: GPT, module: MTPModule, prompt: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, dict]:
    """Greedy decoding of ``max_new_tokens`` after ``prompt`` (1, P), the depth-1 MTP module drafting.

    Each round: the module reads (h_j, t_{j+1}) for the newest confirmed position j and proposes
    t_{j+2}; one forward of the main model over [t_{j+1}, draft] (two tokens, KV cache) gives the
    target's choice after t_{j+1} and, if it equals the draft, also the one after the draft. So a
    round yields 2 tokens when the draft is accepted, 1 when not (the draft's cache slot is then
    dropped). The module's inputs are confirmed states only, so its own KV cache never rolls back.
    Returns (prompt + new tokens (1, P + max_new_tokens), stats)."""
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError(f"mtp_speculative_greedy: prompt must be (1, P), got {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"mtp_speculative_greedy: max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = model.config
    P = prompt.shape[1]
    size = P + max_new_tokens + 2
    cache = KVCache.empty(cfg, 1, max_len=size)
    mcache = KVCache.empty(replace(cfg, n_layer=1), 1, max_len=size)
    E = model.wte.weight                                                 # (V, C) shared head
    h = model(prompt, cache=cache, return_hidden=True)                   # (1, P, C) prefill
    forwards = 1
    nxt = (h[:, -1:] @ E.T).argmax(-1)                                   # (1, 1) token P
    out = [nxt]
    n_new = 1
    pend_h, pend_tok = h, torch.cat([prompt[:, 1:], nxt], 1)             # pairs (h_j, t_{j+1})
    drafted = accepted = 0
    while n_new < max_new_tokens:
        m = module(pend_h, model.wte(pend_tok), cache=mcache)            # (1, n, C)
        draft = (module.norm_out(m[:, -1:]) @ E.T).argmax(-1)             # (1, 1) proposes t_{j+2}
        h2 = model(torch.cat([nxt, draft], 1), cache=cache, return_hidden=True)   # (1, 2, C) verify
        forwards += 1
        drafted += 1
        pred = (h2 @ E.T).argmax(-1)                                     # (1, 2)
        if bool(pred[0, 0] == draft[0, 0]):
            accepted += 1
            out += [draft, pred[:, 1:]]
            n_new += 2
            pend_h, pend_tok = h2, torch.cat([draft, pred[:, 1:]], 1)
            nxt = pred[:, 1:]
        else:
            cache.seqlens -= 1                                           # drop the draft's K/V
            out.append(pred[:, :1])
            n_new += 1
            pend_h, pend_tok = h2[:, :1], pred[:, :1]
            nxt = pred[:, :1]
    tokens = torch.cat([prompt] + out, 1)[:, : P + max_new_tokens]
    return tokens, {"target_forwards": forwards, "drafted": drafted, "accepted": accepted,
                    "new_tokens": max_new_tokens}


def load_run(directory: Path | str = MODEL_DIR) -> tuple[GPT, MTPModule]:
    """The committed sequential-MTP arm: its main model and depth-1 module, eval mode, CPU."""
    directory = Path(directory)
    meta = json.loads((directory / "metrics.json").read_text())
    config = GPTConfig(**meta["config"])
    state = torch.load(directory / "sequential.pt", map_location="cpu", weights_only=True)
    model = GPT(config)
    model.load_state_dict(state["model"])
    mtp = SequentialMTP(config, 1)
    mtp.load_state_dict(state["mtp"])
    return model.eval(), mtp.modules_[0].eval()


# ---------------------------------------------------------------- the committed run

ARMS = {
    # name: (kind, extra depth, weights of [main, extra...])
    "next-token": ("none", 0, [1.0]),
    # the same plain GPT trained 4/3 as many steps: about the FLOPs of the MTP arms, whose extra
    # block adds a fourth to a 3-block model's work per step (a compute-matched baseline)
    "next-token 4/3 steps": ("none", 0, [1.0]),
    "parallel n=2": ("parallel", 1, [1.0, 1.0]),          # Gloeckle et al.: the n head losses summed
    "sequential D=1": ("sequential", 1, [1.0, 0.3]),      # DeepSeek-V3: lambda = 0.3 (its first phase)
}


def build_arm(kind: str, extra: int, config: GPTConfig) -> tuple[GPT, nn.Module | None]:
    model = GPT(config)
    if kind == "none":
        return model, None
    if kind == "parallel":
        return model, ParallelHeads(config, extra + 1)
    if kind == "sequential":
        return model, SequentialMTP(config, extra)
    if kind == "sequential_detached":
        return model, SequentialMTP(config, extra, detach_shared=True)
    raise ValueError(f"build_arm: unknown kind {kind!r}")


def arm_logits(model: GPT, extra_mod: nn.Module | None, x: torch.Tensor) -> list[torch.Tensor]:
    """Logits of every depth for inputs x (B, T): entry k (B, T - k, V) predicts x's token k + 1 ahead."""
    if extra_mod is None:
        return [model(x)]
    out = extra_mod(model, x)
    return [lg[:, : x.shape[1] - k] for k, lg in enumerate(out)]


@torch.no_grad()
def evaluate_depths(model: GPT, extra_mod: nn.Module | None, windows: torch.Tensor, batch: int = 32) -> list[float]:
    """Mean cross-entropy (nats/byte) of each depth over windows (N, T + 1); entry 0 is the next-token loss."""
    sums, counts = None, None
    for i in range(0, len(windows), batch):
        w = windows[i: i + batch]
        logits = arm_logits(model, extra_mod, w[:, :-1])
        if sums is None:
            sums, counts = [0.0] * len(logits), [0] * len(logits)
        for k, lg in enumerate(logits):
            tgt = w[:, k + 1: k + 1 + lg.shape[1]]
            sums[k] += float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="sum"))
            counts[k] += tgt.numel()
    return [s / c for s, c in zip(sums, counts)]


def validation_windows(config: GPTConfig, n: int) -> torch.Tensor:
    """The first n non-overlapping windows of block_size + 1 bytes of the held-out last 10%."""
    from kernels.model import data
    _, val = data.train_val_split(data.encode(data.load_text()))
    T = config.block_size
    return torch.stack([val[j * T: j * T + T + 1] for j in range(n)])


def train_arm(name: str, *, steps: int, batch: int, config: GPTConfig = RUN_CONFIG, max_lr: float = 3e-3,
              min_lr: float = 3e-4, warmup: int = 30, weight_decay: float = 0.1, eval_every: int = 100,
              val_windows: int = 128, progress: bool = True, seed: int = SEED,
              arms: dict | None = None) -> tuple[GPT, nn.Module | None, dict]:
    """Train one arm (``name`` in ``arms``, ARMS by default) from scratch: same seed, same batches, same
    schedule in every arm."""
    from tqdm import tqdm

    from kernels.model import data
    from kernels.model.train import lr_at

    kind, extra, weights = (arms or ARMS)[name]
    torch.manual_seed(seed)
    model, extra_mod = build_arm(kind, extra, config)
    params = list(model.parameters()) + (list(extra_mod.parameters()) if extra_mod is not None else [])
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=max_lr, betas=(0.9, 0.95), eps=1e-8)
    train_tokens, _ = data.train_val_split(data.encode(data.load_text()))
    val = validation_windows(config, val_windows)
    gen = torch.Generator().manual_seed(seed)                 # the same batches in every arm
    log = []
    start = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc=f"training {name}", unit="step", disable=not progress)
    for step in bar:
        lr = lr_at(step - 1, max_lr=max_lr, min_lr=min_lr, warmup=warmup, total=steps)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.get_batch(train_tokens, batch, config.block_size, gen)
        window = torch.cat([x, y[:, -1:]], 1)                                   # (B, T + 1)
        loss, ces = multi_depth_loss(arm_logits(model, extra_mod, x), window, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        row = {"step": step, "train_next": round(ces[0].item(), 5),
               "train_extra": round(ces[1].item(), 5) if len(ces) > 1 else "", "val_next": "", "val_extra": ""}
        if step % eval_every == 0 or step == steps:
            v = evaluate_depths(model, extra_mod, val)
            row["val_next"] = round(v[0], 5)
            row["val_extra"] = round(v[1], 5) if len(v) > 1 else ""
            bar.set_postfix(val=f"{v[0]:.3f}")
        log.append(row)
    model.eval()
    v = evaluate_depths(model, extra_mod, val)
    result = {"arm": name, "kind": kind, "weights": weights, "val_next": v[0],
              "val_extra": v[1] if len(v) > 1 else None, "steps": steps, "train_seconds": round(time.perf_counter() - start, 1),
              "parameters_main": sum(p.numel() for p in model.parameters()),
              "parameters_extra": sum(p.numel() for p in extra_mod.parameters()) if extra_mod is not None else 0,
              "log": log}
    return model, extra_mod, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.speculative.mtp", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=MODEL_DIR)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in ARMS:
        steps = args.steps * 4 // 3 if name == "next-token 4/3 steps" else args.steps
        model, extra_mod, res = train_arm(name, steps=steps, batch=args.batch)
        if ARMS[name][0] == "sequential":      # the draft for the notebook: main model + MTP module
            torch.save({"model": model.state_dict(), "mtp": extra_mod.state_dict()}, args.out / "sequential.pt")
        results.append(res)
        print(f"{name}: next-token val {res['val_next']:.4f} nats/byte ({res['train_seconds']:.0f} s)")
    with open(args.out / "train_log.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arm"] + list(results[0]["log"][0]))
        w.writeheader()
        for r in results:
            for row in r["log"]:
                w.writerow({"arm": r["arm"], **row})
    summary = {"command": f"python -m kernels.speculative.mtp --steps {args.steps} --batch {args.batch}",
               "config": json.loads(RUN_CONFIG.to_json()), "steps": args.steps, "batch": args.batch,
               "seed": SEED, "threads": args.threads, "torch": torch.__version__,
               "val_windows": 128, "arms": [{k: v for k, v in r.items() if k != "log"} for r in results]}
    (args.out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
