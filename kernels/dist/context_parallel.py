"""Context parallelism: the tiny GPT with its sequence split over p ranks in every layer.

Everything in a transformer layer except attention works token by token, so a rank that holds
n / p tokens of every sequence runs the embeddings, norms, projections, RoPE (at the tokens'
*global* positions) and the MLP on them alone. Attention needs every earlier key; two ways to get it:

* ``mode="ring"``: :func:`kernels.attention.ring.ring_attention`, K/V passed around a ring,
  overlapping each step's compute (Liu et al. 2023; Megatron-Core's context parallelism);
* ``mode="allgather"``: all-gather K and V of the whole sequence first, then attend with the local
  queries under a mask built from global positions (Llama 3's choice: its K/V are small next to Q
  under GQA, and any mask, e.g. per-document, is easy; Grattafiori et al. 2024, section 3.3.2).
  The all-gather's backward is a reduce-scatter of dK, dV.

Both use the zig-zag layout (rank r holds chunks r and 2p - 1 - r of 2p), which gives every rank the
same causal work. The weights are replicated, so each rank's weight gradient covers only its tokens
and the gradients are summed over the group (an all-reduce, as in data parallelism): the loss is
the sum of the local tokens' losses divided by the tokens of the whole batch.

Bytes of K/V one rank sends per layer forward, n tokens, p ranks, H_kv heads of dimension D:
ring (p - 1) * 2 (n/p) H_kv D; all-gather the same, (p - 1)/p * 2 n H_kv D. They differ in when the
bytes move (the ring hides them behind compute) and in memory (the all-gather holds all n keys).

``broken``: ``"local_positions"`` rotates with positions 0..n/p-1 of the shard (RoPE is wrong
for every chunk but rank 0's first: under zig-zag its second chunk, at the end of the sequence, is
wrong too); ``"no_grad_allreduce"`` keeps each rank's partial weight gradient.

:func:`transport_bytes` prices the four ways Megatron-Core / TransformerEngine move K/V under CP
(``cp_comm_type``): ``p2p`` (the ring), ``all_gather``, ``a2a`` (Ulysses inside CP: heads for
sequence, p capped by the query heads, K/V heads repeated beyond H_kv) and ``a2a+p2p`` (a2a inside
groups of ``inner`` ranks, a ring of K/V between the p/inner groups).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.attention import ring
from kernels.dist import all_gather_single, reduce_scatter_single
from kernels.model.gpt import add_rms_norm_torch, rope

MODES = ("ring", "allgather")
BROKEN = ("local_positions", "no_grad_allreduce")
TRANSPORTS = ("p2p", "all_gather", "a2a", "a2a+p2p")


def transport_bytes(kind: str, n: int, p: int, hq: int, hkv: int, d: int, e: int, inner: int | None = None) -> int:
    """Bytes one rank sends per layer, forward, for one sequence of n tokens over p CP ranks
    (hq query and hkv K/V heads of d, e bytes a value).

    p2p         (p - 1) 2 (n/p) hkv d e                       K/V blocks round the ring
    all_gather  (p - 1)/p 2 n hkv d e                         the same bytes, all K/V held
    a2a         (p - 1)/p (n/p) (2 hq + 2 hkv') d e           Q, K, V in and O out; hkv' = max(hkv, p)
    a2a+p2p     a2a over ``inner`` ranks on the group's n/c tokens (c = p/inner groups), then a ring
                of c - 1 steps of the group's K/V heads, 2 (n/c) (hkv'/inner) d e each
    """
    from kernels.dist.sequence_parallel import ulysses_bytes

    if kind not in TRANSPORTS:
        raise ValueError(f"transport_bytes: kind must be one of {TRANSPORTS}, got {kind!r}")
    if n % (2 * p):
        raise ValueError(f"transport_bytes: n = {n} must split into 2p = {2 * p} equal chunks")
    if kind == "p2p":
        return (p - 1) * 2 * (n // p) * hkv * d * e
    if kind == "all_gather":
        return (p - 1) * 2 * n * hkv * d * e // p
    a = p if kind == "a2a" else inner
    if not isinstance(a, int) or a < 1 or p % a or hq % a:
        raise ValueError(f"transport_bytes: the a2a group ({a}) must divide p = {p} and the {hq} query heads")
    c = p // a
    kv_heads = max(hkv, a)                                               # K/V heads repeated up to one a rank
    a2a = ulysses_bytes(1, n // c, hq, hkv, d, a, e)["forward"]
    ring_part = (c - 1) * 2 * (n // c) * (kv_heads // a) * d * e
    return a2a + ring_part


class _AllGatherSeq(torch.autograd.Function):
    """Forward: every rank's shard (..., n/p, D) stacked into (p, ..., n/p, D); backward: each
    rank's share of the gradient summed over ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        p = dist.get_world_size(group)
        out = torch.empty(p * x.numel(), dtype=x.dtype, device=x.device)
        all_gather_single(out, x.contiguous().flatten(), group=group)
        out = out.view(p, *x.shape)
        if ledger is not None:
            ledger["allgather_forward"] = ledger.get("allgather_forward", 0) + (p - 1) * x.numel() * x.element_size()
        ctx.group, ctx.ledger = group, ledger
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty(grad[0].numel(), dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(mine, grad.contiguous().flatten(), group=ctx.group)
        mine = mine.view(grad.shape[1:])
        if ctx.ledger is not None:
            p = grad.shape[0]
            ctx.ledger["allgather_backward"] = (ctx.ledger.get("allgather_backward", 0)
                                                + (p - 1) * mine.numel() * mine.element_size())
        return mine, None, None


def allgather_attention(q, k, v, pos, group=None, ledger=None):
    """Local queries q (B, Hq, n/p, D) at global positions ``pos`` against the all-gathered K/V of
    every rank, causal over global positions."""
    p = dist.get_world_size(group)
    k_all = _AllGatherSeq.apply(k, group, ledger)                     # (p, B, Hkv, n/p, D)
    v_all = _AllGatherSeq.apply(v, group, ledger)
    pos_all = [torch.empty_like(pos) for _ in range(p)]
    dist.all_gather(pos_all, pos, group=group)                        # where every rank's keys sit
    k_all = torch.cat(list(k_all), dim=2)                             # (B, Hkv, n, D), rank order
    v_all = torch.cat(list(v_all), dim=2)
    key_pos = torch.cat(pos_all)
    group_size = q.shape[1] // k.shape[1]
    k_all, v_all = k_all.repeat_interleave(group_size, 1), v_all.repeat_interleave(group_size, 1)
    s = (q @ k_all.transpose(-1, -2)) / math.sqrt(q.shape[-1])          # (B, Hq, n/p, n)
    s = s.masked_fill(key_pos[None, :] > pos[:, None], float("-inf"))   # key j visible iff pos_j <= pos_i
    return torch.softmax(s, dim=-1) @ v_all


def cp_attention(attn, x, pos, mode, group=None, ledger=None, traffic=None):
    """The tiny GPT's attention (its weights) on this rank's tokens x (B, n/p, C) at positions ``pos``."""
    cfg = attn.config
    B, n, _ = x.shape
    q = attn.wq(x).view(B, n, cfg.n_head, cfg.head_dim).transpose(1, 2)        # (B, Hq, n/p, D)
    k = attn.wk(x).view(B, n, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)     # (B, Hkv, n/p, D)
    v = attn.wv(x).view(B, n, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
    q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)          # RoPE at global positions
    if mode == "ring":
        out = ring.ring_attention(q, k, v, causal=True, layout="zigzag", impl="torch", group=group, traffic=traffic)
    else:
        out = allgather_attention(q, k, v, pos, group, ledger)
    return attn.wo(out.transpose(1, 2).reshape(B, n, cfg.n_head * cfg.head_dim))


def cp_forward(model, idx, pos, mode: str, group=None, ledger=None, traffic=None) -> torch.Tensor:
    """Logits (B, n/p, V) of this rank's tokens idx (B, n/p) at global positions ``pos`` (n/p,)."""
    if mode not in MODES:
        raise ValueError(f"cp_forward: mode must be one of {MODES}, got {mode!r}")
    x = model.wte(idx)
    for block in model.blocks:
        a = cp_attention(block.attn, block.norm1(x), pos, mode, group, ledger, traffic)
        h, hn = add_rms_norm_torch(x, a, block.norm2.weight, block.config.norm_eps)
        x = h + block.mlp(hn)
    return model.norm_f(x) @ model.wte.weight.T


def cp_loss(model, idx, targets, mode: str, group=None, ledger=None, traffic=None, broken=None):
    """(the local tokens' share of the batch-mean cross-entropy, this rank's logits). Summed over
    the group (its backward included) it is the single-process loss."""
    if broken is not None and broken not in BROKEN:
        raise ValueError(f"cp_loss: broken must be None or one of {BROKEN}, got {broken!r}")
    p, r = dist.get_world_size(group), dist.get_rank(group)
    n = idx.shape[1]
    mine, tgt = ring.shard(idx, p, r, "zigzag", dim=1), ring.shard(targets, p, r, "zigzag", dim=1)
    pos = (ring.positions(n, p, r, "zigzag") if broken != "local_positions" else torch.arange(n // p)).to(idx.device)
    logits = cp_forward(model, mine, pos, mode, group, ledger, traffic)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") / targets.numel()
    return loss, logits


def allreduce_grads(model, group=None) -> None:
    """Sum every weight gradient over the group: each rank's covers its own tokens only."""
    for q in model.parameters():
        dist.all_reduce(q.grad, group=group)


# ---------------------------------------------------------------- the chapter's experiment (one launch)

def cp_worker(rank: int, p: int, batch: int, seq: int) -> dict:
    """Both modes, then each broken variant with the ring, on the trained tiny GPT in float64 and one
    batch of Shakespeare. Returns per case this rank's logits (zig-zag shard), the summed loss, the
    summed gradients and the bytes sent."""
    from kernels.model import data
    from kernels.model.gpt import load_pretrained

    tokens = data.encode(data.load_text()[:20000])
    idx, targets = data.get_batch(tokens, batch, seq, torch.Generator().manual_seed(0))
    out = {}
    for label, mode, broken in (("ring", "ring", None), ("allgather", "allgather", None),
                                ("local_positions", "ring", "local_positions"),
                                ("no_grad_allreduce", "ring", "no_grad_allreduce")):
        model = load_pretrained().double().train()
        ledger, traffic = {}, ring.RingTraffic()
        loss, logits = cp_loss(model, idx, targets, mode, ledger=ledger, traffic=traffic, broken=broken)
        loss.backward()
        if broken != "no_grad_allreduce":
            allreduce_grads(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        out[label] = {"logits": logits.detach(), "loss": float(total), "ledger": ledger, "traffic": traffic,
                      "grads": {n: q.grad.clone() for n, q in model.named_parameters()}}
    return out
