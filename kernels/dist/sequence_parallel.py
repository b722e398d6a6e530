"""Sequence parallelism for the tiny GPT: Megatron's (with tensor parallelism) and DeepSpeed Ulysses.

**Megatron SP** (Korthikanti et al. 2022). Tensor parallelism (:mod:`kernels.dist.tensor_parallel`)
leaves the norms, dropouts and residual adds replicated: every rank holds the whole (B, T, C)
activation there. SP splits those regions along the sequence instead: rank r holds tokens
[r T/t, (r + 1) T/t). Where TP had

    f (identity forward, all-reduce backward)  before the column-parallel linears,
    g (all-reduce forward, identity backward)  after the row-parallel one,

SP has

    g-bar: all-gather along the sequence forward, reduce-scatter backward   (replaces f)
    f-bar: reduce-scatter along the sequence forward, all-gather backward   (replaces g)

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes per layer are
TP's: the activation memory of the norm/dropout regions is divided by t for free. The norm
weights are replicated but each rank's gradient covers its own tokens only: they are all-reduced
over the group (Megatron does the same for its sequence-parallel LayerNorm weights).

**Ulysses** (Jacobs et al. 2023). No weight is split. Every rank holds T/p tokens everywhere; around
attention an all-to-all trades the sequence split for a head split: rank r sends each other rank
the heads it will own, of its own tokens, and receives its heads for every token,

    (B, T/p, H, D)  --all-to-all-->  (B, T, H/p, D)      attention on H/p heads, whole sequence
    (B, T, H/p, D)  --all-to-all-->  (B, T/p, H, D)      back, then W_o

(the all-to-all's backward is the opposite all-to-all). RoPE is applied before the first
all-to-all, at the shard's global positions. With fewer K/V heads than ranks (GQA) each K/V head is
repeated so that every rank receives the one its query heads read. All weights are replicated, so
every gradient is all-reduced over the group, as in data parallelism.

Bytes one rank sends per layer forward (ring collectives; activations (B, T, C), E bytes a value):
Megatron SP: 2 all-gathers + 2 reduce-scatters of (t - 1)/t B T C E each; Ulysses: (p - 1)/p of
its (B, T/p, .) tensors for Q, K, V and the output, i.e. (p - 1)/p^2 B T (2 H_q + 2 H_kv') D E,
H_kv' = max(H_kv, p) the K/V heads after repetition.

``broken``: Megatron SP ``"no_norm_grad_reduce"`` (each rank keeps its partial norm-weight
gradient), ``"gather_backward_slices"`` (the all-gather's backward takes the rank's slice of the
gradient instead of reduce-scattering it); Ulysses ``"local_positions"`` (RoPE at 0..T/p-1).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kernels.dist import all_gather_single, reduce_scatter_single
from kernels.dist import tensor_parallel as tp
from kernels.model.gpt import GPT, rms_norm_torch, rope

BROKEN_MEGATRON = ("no_norm_grad_reduce", "gather_backward_slices")
BROKEN_ULYSSES = ("local_positions",)


def _ledger_add(ledger, where: str, nbytes: int) -> None:
    if ledger is not None:
        ledger[where] = ledger.get(where, 0) + nbytes


# ---------------------------------------------------------------- Megatron SP: the two operators

def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on every rank -> (B, T, C): the shards in rank order along the sequence."""
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                 # (T/t, B, C): sequence leading
    out = torch.empty(t * xs.numel(), dtype=x.dtype)
    all_gather_single(out, xs.flatten(), group=group)
    # contiguous: a transposed view would make each of W_q, W_k, W_v save its own contiguous copy
    return out.view(t * xs.shape[0], *xs.shape[1:]).transpose(0, 1).contiguous()


def _scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums on every rank -> (B, T/t, C): this rank's tokens, summed over ranks."""
    t = dist.get_world_size(group)
    xs = x.transpose(0, 1).contiguous()                                 # (T, B, C)
    out = torch.empty(xs.numel() // t, dtype=x.dtype)
    reduce_scatter_single(out, xs.flatten(), group=group)
    return out.view(xs.shape[0] // t, *xs.shape[1:]).transpose(0, 1).contiguous()


class _GatherFromSP(torch.autograd.Function):
    """g-bar: all-gather along the sequence forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, ledger, broken):
        ctx.group, ctx.ledger, ctx.broken = group, ledger, broken
        out = _gather_seq(x, group)
        t = dist.get_world_size(group)
        _ledger_add(ledger, "all-gather forward", (t - 1) * x.numel() * x.element_size())
        return out

    @staticmethod
    def backward(ctx, grad):
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if ctx.broken == "gather_backward_slices":
            return grad.chunk(t, dim=1)[r].contiguous(), None, None, None    # wrong: misses the other ranks' share
        out = _scatter_seq(grad, ctx.group)
        _ledger_add(ctx.ledger, "reduce-scatter backward", (t - 1) * out.numel() * out.element_size())
        return out, None, None, None


class _ScatterToSP(torch.autograd.Function):
    """f-bar: reduce-scatter along the sequence forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        ctx.group, ctx.ledger = group, ledger
        out = _scatter_seq(x, group)
        t = dist.get_world_size(group)
        _ledger_add(ledger, "reduce-scatter forward", (t - 1) * out.numel() * out.element_size())
        return out

    @staticmethod
    def backward(ctx, grad):
        t = dist.get_world_size(ctx.group)
        _ledger_add(ctx.ledger, "all-gather backward", (t - 1) * grad.numel() * grad.element_size())
        return _gather_seq(grad.contiguous(), ctx.group), None, None


def gather_from_sp(x, group=None, ledger=None, broken=None):
    return _GatherFromSP.apply(x, group, ledger, broken)


def scatter_to_sp(x, group=None, ledger=None):
    return _ScatterToSP.apply(x, group, ledger)


# ---------------------------------------------------------------- Megatron SP: the model

class SPAttention(nn.Module):
    """Heads split as in TP (:class:`kernels.dist.tensor_parallel.TPAttention`), the input gathered
    from the sequence shards and the output reduce-scattered back to them."""

    def __init__(self, attn, group=None, ledger=None, broken=None):
        super().__init__()
        cfg = attn.config
        r, t = dist.get_rank(group), dist.get_world_size(group)
        q_heads, kv_heads = tp.head_split(cfg.n_head, cfg.n_kv_head, t, r)
        rows = lambda heads: (heads[:, None] * cfg.head_dim + torch.arange(cfg.head_dim)).flatten()  # noqa: E731
        self.wq = tp.ShardedLinear(attn.wq, rows(q_heads), dim=0)
        self.wk = tp.ShardedLinear(attn.wk, rows(kv_heads), dim=0)
        self.wv = tp.ShardedLinear(attn.wv, rows(kv_heads), dim=0)
        self.wo = tp.ShardedLinear(attn.wo, rows(q_heads), dim=1)
        self.hq, self.hkv, self.D, self.theta = len(q_heads), len(kv_heads), cfg.head_dim, cfg.rope_theta
        self._attend = attn._attend
        self.group, self.ledger, self.broken = group, ledger, broken

    def forward(self, x_shard):
        x = gather_from_sp(x_shard, self.group, self.ledger, self.broken)    # (B, T, C)
        B, T, _ = x.shape
        positions = torch.arange(T)
        q = rope(self.wq(x).view(B, T, self.hq, self.D).transpose(1, 2), positions, self.theta)
        k = rope(self.wk(x).view(B, T, self.hkv, self.D).transpose(1, 2), positions, self.theta)
        v = self.wv(x).view(B, T, self.hkv, self.D).transpose(1, 2)
        out = self._attend(q, k, v, 0, False)                                 # (B, Hq/t, T, D)
        partial = self.wo(out.transpose(1, 2).reshape(B, T, self.hq * self.D))   # (B, T, C), partial sum
        return scatter_to_sp(partial, self.group, self.ledger)               # (B, T/t, C), summed


class SPMLP(nn.Module):
    """SwiGLU split by hidden units as in TP, gathered in and reduce-scattered out."""

    def __init__(self, mlp, group=None, ledger=None, broken=None):
        super().__init__()
        r, t = dist.get_rank(group), dist.get_world_size(group)
        hidden = tp.split_range(mlp.w_gate.out_features, t, r)
        self.w_gate = tp.ShardedLinear(mlp.w_gate, hidden, dim=0)
        self.w_up = tp.ShardedLinear(mlp.w_up, hidden, dim=0)
        self.w_down = tp.ShardedLinear(mlp.w_down, hidden, dim=1)
        self.group, self.ledger, self.broken = group, ledger, broken

    def forward(self, u_shard):
        u = gather_from_sp(u_shard, self.group, self.ledger, self.broken)    # (B, T, C)
        hidden = F.silu(self.w_gate(u)) * self.w_up(u)                       # (B, T, d_ff / t)
        return scatter_to_sp(self.w_down(hidden), self.group, self.ledger)  # (B, T/t, C)


class SPGPT(nn.Module):
    """The tiny GPT under TP + Megatron SP: embedding, norms, residual stream and LM head on the
    rank's T/t tokens; attention and MLP tensor-parallel in between."""

    def __init__(self, model: GPT, group=None, ledger=None, broken=None):
        super().__init__()
        if broken is not None and broken not in BROKEN_MEGATRON:
            raise ValueError(f"SPGPT: broken must be None or one of {BROKEN_MEGATRON}, got {broken!r}")
        self.eps, self.group, self.broken = model.config.norm_eps, group, broken
        self.wte = nn.Parameter(model.wte.weight.detach().clone())
        self.norms = nn.ParameterList()
        self.layers = nn.ModuleList()
        for b in model.blocks:
            self.norms.extend([nn.Parameter(b.norm1.weight.detach().clone()),
                               nn.Parameter(b.norm2.weight.detach().clone())])
            self.layers.append(nn.ModuleList([SPAttention(b.attn, group, ledger, broken),
                                              SPMLP(b.mlp, group, ledger, broken)]))
        self.norm_f = nn.Parameter(model.norm_f.weight.detach().clone())

    def forward(self, idx_shard):
        x = F.embedding(idx_shard, self.wte)                                  # (B, T/t, C)
        for i, (attn, mlp) in enumerate(self.layers):
            h = x + attn(rms_norm_torch(x, self.norms[2 * i], self.eps))
            x = h + mlp(rms_norm_torch(h, self.norms[2 * i + 1], self.eps))
        return rms_norm_torch(x, self.norm_f, self.eps) @ self.wte.T         # (B, T/t, V)

    def reduce_replicated_grads(self) -> None:
        """Sum the gradients of the replicated weights (embedding, norms) over the group."""
        if self.broken == "no_norm_grad_reduce":
            return
        for q in [self.wte, self.norm_f, *self.norms]:
            dist.all_reduce(q.grad, group=self.group)

    def full_grads(self, model: GPT) -> dict[str, torch.Tensor]:
        """Gradients in the single-process names: shards scattered into zeros and summed over the
        group (a K/V head held by two ranks adds its two partial gradients)."""
        out = {"wte.weight": self.wte.grad, "norm_f.weight": self.norm_f.grad}
        for i, ((attn, mlp), full) in enumerate(zip(self.layers, model.blocks)):
            out[f"blocks.{i}.norm1.weight"] = self.norms[2 * i].grad
            out[f"blocks.{i}.norm2.weight"] = self.norms[2 * i + 1].grad
            for part, names, mine in (("attn", ("wq", "wk", "wv", "wo"), attn), ("mlp", ("w_gate", "w_up", "w_down"), mlp)):
                for n in names:
                    whole = getattr(mine, n).scatter_grad_into(getattr(getattr(full, part), n).weight.shape)
                    dist.all_reduce(whole, group=self.group)
                    out[f"blocks.{i}.{part}.{n}.weight"] = whole
        return out


# ---------------------------------------------------------------- Ulysses

class _AllToAll(torch.autograd.Function):
    """Split x along ``split_dim`` into p pieces, send piece j to rank j, and concatenate what
    arrives along ``cat_dim`` (rank order). The backward is the same exchange with the dims swapped."""

    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group, ledger):
        ctx.dims, ctx.group, ctx.ledger = (split_dim, cat_dim), group, ledger
        return _all_to_all(x, split_dim, cat_dim, group, ledger, "all-to-all forward")

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, cat_dim, split_dim, ctx.group, ctx.ledger, "all-to-all backward"), None, None, None, None


def _all_to_all(x, split_dim, cat_dim, group, ledger, where):
    p = dist.get_world_size(group)
    if x.shape[split_dim] % p:
        raise ValueError(f"all-to-all: dimension {split_dim} of size {x.shape[split_dim]} does not split over {p} ranks")
    send = torch.stack(x.chunk(p, dim=split_dim)).contiguous()           # (p, ...): piece j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    _ledger_add(ledger, where, (p - 1) * send[0].numel() * send.element_size())
    return torch.cat(list(recv), dim=cat_dim)


def all_to_all(x, split_dim: int, cat_dim: int, group=None, ledger=None) -> torch.Tensor:
    return _AllToAll.apply(x, split_dim, cat_dim, group, ledger)


def ulysses_attention(attn, x, group=None, ledger=None, broken=None):
    """The tiny GPT's attention on this rank's tokens x (B, T/p, C), heads exchanged for tokens around it."""
    cfg = attn.config
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if cfg.n_head % p:
        raise ValueError(f"ulysses_attention: {cfg.n_head} query heads do not split over {p} ranks")
    B, n, _ = x.shape
    pos = torch.arange(r * n, (r + 1) * n) if broken != "local_positions" else torch.arange(n)
    q = rope(attn.wq(x).view(B, n, cfg.n_head, cfg.head_dim).transpose(1, 2), pos, cfg.rope_theta)
    k = rope(attn.wk(x).view(B, n, cfg.n_kv_head, cfg.head_dim).transpose(1, 2), pos, cfg.rope_theta)
    v = attn.wv(x).view(B, n, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)         # (B, Hkv, T/p, D)
    if cfg.n_kv_head < p:                                                        # GQA: one K/V head per rank at least
        k, v = (t.repeat_interleave(p // cfg.n_kv_head, dim=1) for t in (k, v))
    q, k, v = (all_to_all(t, 1, 2, group, ledger) for t in (q, k, v))            # (B, H/p, T, D)
    out = attn._attend(q, k, v, 0, False)                                        # causal, whole sequence
    out = all_to_all(out, 2, 1, group, ledger)                                   # (B, Hq, T/p, D)
    return attn.wo(out.transpose(1, 2).reshape(B, n, cfg.n_head * cfg.head_dim))


def ulysses_forward(model: GPT, idx_shard, group=None, ledger=None, broken=None) -> torch.Tensor:
    """Logits (B, T/p, V) of this rank's contiguous token shard; weights are the model's own."""
    if broken is not None and broken not in BROKEN_ULYSSES:
        raise ValueError(f"ulysses_forward: broken must be None or one of {BROKEN_ULYSSES}, got {broken!r}")
    x = model.wte(idx_shard)
    for block in model.blocks:
        h = x + ulysses_attention(block.attn, block.norm1(x), group, ledger, broken)
        x = h + block.mlp(block.norm2(h))
    return model.norm_f(x) @ model.wte.weight.T


# ---------------------------------------------------------------- the bytes, derived

def megatron_sp_bytes(batch: int, seq: int, d_model: int, t: int, bytes_per_value: int, layers: int = 1) -> dict:
    """Bytes one rank sends per step: per layer 2 all-gathers and 2 reduce-scatters of (B, T, C)
    forward, the same backward, each (t - 1)/t of the tensor."""
    one = (t - 1) * batch * seq * d_model * bytes_per_value // t
    return {"forward": 4 * one * layers, "backward": 4 * one * layers}


def ulysses_bytes(batch: int, seq: int, n_head: int, n_kv_head: int, head_dim: int, p: int,
                  bytes_per_value: int, layers: int = 1) -> dict:
    """Bytes one rank sends per step: per layer all-to-alls of Q, K, V (K/V heads repeated up to p)
    and of the output, each sending (p - 1)/p of a (B, T/p, heads, D) tensor; the same backward."""
    kv = max(n_kv_head, p)
    per_layer = (p - 1) * batch * (seq // p) * (2 * n_head + 2 * kv) * head_dim * bytes_per_value // p
    return {"forward": per_layer * layers, "backward": per_layer * layers}


# ---------------------------------------------------------------- the chapter's experiment (one launch)

def _batch(batch: int, seq: int):
    from kernels.model import data
    tokens = data.encode(data.load_text()[:20000])
    return data.get_batch(tokens, batch, seq, torch.Generator().manual_seed(0))


def _megatron(model, idx, targets, broken=None) -> dict:
    t, r = dist.get_world_size(), dist.get_rank()
    ledger = {}
    sp = SPGPT(model, None, ledger, broken)
    mine, tgt = idx.chunk(t, dim=1)[r], targets.chunk(t, dim=1)[r]
    logits = sp(mine)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") / targets.numel()
    loss.backward()
    sp.reduce_replicated_grads()
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": sp.full_grads(model), "ledger": ledger}


def _ulysses(model, idx, targets, broken=None) -> dict:
    p, r = dist.get_world_size(), dist.get_rank()
    ledger = {}
    model.zero_grad()
    mine, tgt = idx.chunk(p, dim=1)[r], targets.chunk(p, dim=1)[r]
    logits = ulysses_forward(model, mine, None, ledger, broken)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") / targets.numel()
    loss.backward()
    grads = {}
    for n, q in model.named_parameters():                                    # replicated weights: sum
        g = q.grad.clone()
        dist.all_reduce(g)
        grads[n] = g
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads, "ledger": ledger}


def saved_per_rank(model, idx) -> dict:
    """Bytes autograd saves on this rank for one forward of the whole model: tensor parallel
    (:class:`kernels.dist.tensor_parallel.TPGPT`) against TP + sequence parallel (:class:`SPGPT`)."""
    from kernels.dist.checkpointing import saved_bytes

    t, r = dist.get_world_size(), dist.get_rank()
    tp_model, sp_model = tp.TPGPT(model), SPGPT(model)
    return {"tp": saved_bytes(lambda: tp_model(idx), tp_model.parameters())[0],
            "sp": saved_bytes(lambda: sp_model(idx.chunk(t, dim=1)[r]), sp_model.parameters())[0]}


def sp_worker(rank: int, world: int, batch: int, seq: int) -> dict:
    """Megatron SP (t = world) and Ulysses (p = world) on the trained tiny GPT in float64, one batch
    of Shakespeare, then each broken variant, and the bytes each rank saves for the backward under
    TP and under TP + SP. Logits are this rank's contiguous token shard; losses this rank's share
    of the batch mean; gradients summed, in the single-process names."""
    from kernels.model.gpt import load_pretrained

    idx, targets = _batch(batch, seq)
    model = load_pretrained().double().train()
    out = {"megatron": _megatron(model, idx, targets), "ulysses": _ulysses(model, idx, targets),
           "saved": saved_per_rank(model, idx)}
    for b in BROKEN_MEGATRON:
        out[b] = _megatron(model, idx, targets, broken=b)
    for b in BROKEN_ULYSSES:
        out[b] = _ulysses(model, idx, targets, broken=b)
    return out
