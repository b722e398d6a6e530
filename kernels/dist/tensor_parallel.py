"""Megatron-style tensor parallelism for the course's tiny GPT (kernels.model.gpt).

A linear layer y = x W^T (W: (out, in)) splits two ways over t ranks:

* column-parallel: rank r keeps rows R_r of W (a slice of the outputs): y_r = x W_r^T, no
  communication, the output stays split;
* row-parallel: rank r keeps columns of W (a slice of the inputs) and reads the matching slice of
  x: y = sum_r x_r W_r^T, one all-reduce.

Two conjugate operators put the communication in the right places (Shoeybi et al., 2019):
  f: forward identity,   backward all-reduce  (before a column-parallel layer: every rank's
     partial input-gradient sums to the full one);
  g: forward all-reduce, backward identity    (after a row-parallel layer).
An MLP is column-parallel up (W_gate, W_up split by hidden units), row-parallel down (W_down
split by its inputs): one f, one g. Attention splits by heads: W_q, W_k, W_v column-parallel by
head, W_o row-parallel, one f, one g. Per layer: 2 all-reduces of a (B, T, C) activation forward,
2 backward.

Every f/g adds the bytes it all-reduces to a :class:`Ledger`. ``broken`` selects a wrong f or g,
for the checks that must catch it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kernels.model.gpt import GPT, Attention, Block, rms_norm_torch, rope

BROKEN = ("f_no_backward_reduce", "g_no_forward_reduce")


@dataclass
class Ledger:
    """All-reduces issued by f and g: calls and payload bytes (the tensor's size), by where."""
    calls: dict = field(default_factory=dict)
    payload: dict = field(default_factory=dict)

    def add(self, where: str, t: torch.Tensor) -> None:
        self.calls[where] = self.calls.get(where, 0) + 1
        self.payload[where] = self.payload.get(where, 0) + t.numel() * t.element_size()


class _F(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, ledger, broken):
        ctx.group, ctx.ledger, ctx.broken = group, ledger, broken
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if not ctx.broken:
            dist.all_reduce(grad, group=ctx.group)              # dL/dx = sum_r dL/dx through rank r's shard
            if ctx.ledger is not None:
                ctx.ledger.add("f backward", grad)
        return grad, None, None, None


class _G(torch.autograd.Function):
    """g: all-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group, ledger, broken):
        y = x.contiguous().clone()
        if not broken:
            dist.all_reduce(y, group=group)                     # y = sum_r x_r W_r^T
            if ledger is not None:
                ledger.add("g forward", y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def f(x: torch.Tensor, group=None, ledger: Ledger | None = None, broken: str | None = None) -> torch.Tensor:
    return _F.apply(x, group, ledger, broken == "f_no_backward_reduce")


def g(x: torch.Tensor, group=None, ledger: Ledger | None = None, broken: str | None = None) -> torch.Tensor:
    return _G.apply(x, group, ledger, broken == "g_no_forward_reduce")


def _group_rank(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class ShardedLinear(nn.Module):
    """The slice of a full nn.Linear (weight (out, in)) one rank keeps: rows ``index`` (dim=0,
    column-parallel) or columns ``index`` (dim=1, row-parallel). No communication inside: the
    caller puts f before the column-parallel layers and g after the row-parallel one."""

    def __init__(self, full: nn.Linear, index: torch.Tensor, dim: int):
        super().__init__()
        if full.bias is not None:
            raise ValueError("ShardedLinear: the tiny GPT's linears have no bias; got one")
        self.dim, self.index = dim, index
        self.weight = nn.Parameter(full.weight.detach().index_select(dim, index).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def scatter_grad_into(self, full_shape) -> torch.Tensor:
        """A zero tensor of the full weight's shape with this shard's gradient at its rows/columns
        (summed over ranks, by an all-reduce, it is the full gradient)."""
        out = torch.zeros(full_shape, dtype=self.weight.dtype)
        out.index_add_(self.dim, self.index, self.weight.grad)
        return out


def split_range(n: int, t: int, r: int) -> torch.Tensor:
    """Indices [r n/t, (r + 1) n/t) of n items over t ranks; n must divide by t."""
    if n % t:
        raise ValueError(f"split_range: {n} items do not split evenly over {t} ranks")
    return torch.arange(r * n // t, (r + 1) * n // t)


class ColumnParallelLinear(ShardedLinear):
    """f, then this rank's output rows: y_r = x W_r^T (the output stays split over ranks)."""

    def __init__(self, full: nn.Linear, group=None, ledger: Ledger | None = None, broken: str | None = None):
        r, t = _group_rank(group)
        super().__init__(full, split_range(full.out_features, t, r), dim=0)
        self.group, self.ledger, self.broken = group, ledger, broken

    def forward(self, x):
        return super().forward(f(x, self.group, self.ledger, self.broken))


class RowParallelLinear(ShardedLinear):
    """This rank's input columns on its slice of x, then g: y = sum_r x_r W_r^T."""

    def __init__(self, full: nn.Linear, group=None, ledger: Ledger | None = None, broken: str | None = None):
        r, t = _group_rank(group)
        super().__init__(full, split_range(full.in_features, t, r), dim=1)
        self.group, self.ledger, self.broken = group, ledger, broken

    def forward(self, x):
        return g(super().forward(x), self.group, self.ledger, self.broken)


class TPMLP(nn.Module):
    """SwiGLU over t ranks: f; gate and up column-parallel (d_ff / t hidden units each); the
    product; down row-parallel; g."""

    def __init__(self, mlp, group=None, ledger: Ledger | None = None, broken: str | None = None):
        super().__init__()
        r, t = _group_rank(group)
        hidden = split_range(mlp.w_gate.out_features, t, r)          # this rank's hidden units
        self.w_gate = ShardedLinear(mlp.w_gate, hidden, dim=0)
        self.w_up = ShardedLinear(mlp.w_up, hidden, dim=0)
        self.w_down = ShardedLinear(mlp.w_down, hidden, dim=1)
        self.group, self.ledger, self.broken = group, ledger, broken

    def forward(self, u):
        u = f(u, self.group, self.ledger, self.broken)                # (B, T, C), same on every rank
        hidden = F.silu(self.w_gate(u)) * self.w_up(u)                 # (B, T, d_ff / t)
        return g(self.w_down(hidden), self.group, self.ledger, self.broken)   # (B, T, C), summed


def head_split(n_head: int, n_kv_head: int, t: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query heads, key/value heads) of rank r. Query heads split evenly; each rank keeps the K/V
    heads its query heads read, so with fewer K/V heads than ranks a K/V head is replicated."""
    q_heads = split_range(n_head, t, r)
    group = n_head // n_kv_head
    kv_heads = torch.unique(q_heads // group)
    return q_heads, kv_heads


def _head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()


class TPAttention(nn.Module):
    """Causal GQA attention over t ranks, split by heads: f; W_q, W_k, W_v keep this rank's heads
    (column-parallel); attention runs on those heads alone; W_o keeps their columns (row-parallel); g."""

    def __init__(self, attn: Attention, group=None, ledger: Ledger | None = None, broken: str | None = None):
        super().__init__()
        cfg = attn.config
        r, t = _group_rank(group)
        q_heads, kv_heads = head_split(cfg.n_head, cfg.n_kv_head, t, r)
        D = cfg.head_dim
        self.wq = ShardedLinear(attn.wq, _head_rows(q_heads, D), dim=0)
        self.wk = ShardedLinear(attn.wk, _head_rows(kv_heads, D), dim=0)
        self.wv = ShardedLinear(attn.wv, _head_rows(kv_heads, D), dim=0)
        self.wo = ShardedLinear(attn.wo, _head_rows(q_heads, D), dim=1)
        self.hq, self.hkv, self.D, self.theta = len(q_heads), len(kv_heads), D, cfg.rope_theta
        self._attend = attn._attend                                    # the model's own softmax(q k^T) v
        self.group, self.ledger, self.broken = group, ledger, broken

    def forward(self, x, positions):
        B, T, _ = x.shape
        x = f(x, self.group, self.ledger, self.broken)
        q = self.wq(x).view(B, T, self.hq, self.D).transpose(1, 2)      # (B, Hq/t, T, D)
        k = self.wk(x).view(B, T, self.hkv, self.D).transpose(1, 2)     # (B, Hkv local, T, D)
        v = self.wv(x).view(B, T, self.hkv, self.D).transpose(1, 2)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        out = self._attend(q, k, v, 0, False)                           # (B, Hq/t, T, D)
        partial = self.wo(out.transpose(1, 2).reshape(B, T, self.hq * self.D))
        return g(partial, self.group, self.ledger, self.broken)        # (B, T, C)


class TPBlock(nn.Module):
    """The pre-norm block with TP attention and TP MLP; the two RMSNorms are replicated."""

    def __init__(self, block: Block, group=None, ledger: Ledger | None = None, broken: str | None = None):
        super().__init__()
        self.eps = block.config.norm_eps
        self.norm1 = nn.Parameter(block.norm1.weight.detach().clone())
        self.norm2 = nn.Parameter(block.norm2.weight.detach().clone())
        self.attn = TPAttention(block.attn, group, ledger, broken)
        self.mlp = TPMLP(block.mlp, group, ledger, broken)

    def forward(self, x, positions):
        h = x + self.attn(rms_norm_torch(x, self.norm1, self.eps), positions)
        return h + self.mlp(rms_norm_torch(h, self.norm2, self.eps))


class TPGPT(nn.Module):
    """The whole tiny GPT with every block tensor-parallel; embedding (tied LM head) and final norm replicated."""

    def __init__(self, model: GPT, group=None, ledger: Ledger | None = None, broken: str | None = None):
        super().__init__()
        if broken is not None and broken not in BROKEN:
            raise ValueError(f"TPGPT: broken must be None or one of {BROKEN}, got {broken!r}")
        self.eps = model.config.norm_eps
        self.wte = nn.Parameter(model.wte.weight.detach().clone())
        self.blocks = nn.ModuleList(TPBlock(b, group, ledger, broken) for b in model.blocks)
        self.norm_f = nn.Parameter(model.norm_f.weight.detach().clone())

    def forward(self, idx):
        positions = torch.arange(idx.shape[1])
        x = F.embedding(idx, self.wte)                                  # (B, T, C)
        for block in self.blocks:
            x = block(x, positions)
        return rms_norm_torch(x, self.norm_f, self.eps) @ self.wte.T    # (B, T, V)


def full_grads(tp: TPGPT, model: GPT, group=None) -> dict[str, torch.Tensor]:
    """The TP model's gradients in the single-process model's names and shapes: shards scattered
    into zeros and all-reduced over the TP group (replicated K/V heads add up, as they must);
    replicated parameters as they are."""
    out = {"wte.weight": tp.wte.grad, "norm_f.weight": tp.norm_f.grad}
    for i, (b, full) in enumerate(zip(tp.blocks, model.blocks)):
        out[f"blocks.{i}.norm1.weight"], out[f"blocks.{i}.norm2.weight"] = b.norm1.grad, b.norm2.grad
        for part, names in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("w_gate", "w_up", "w_down"))):
            for n in names:
                shard = getattr(getattr(b, part), n)
                whole = shard.scatter_grad_into(getattr(getattr(full, part), n).weight.shape)
                dist.all_reduce(whole, group=group)
                out[f"blocks.{i}.{part}.{n}.weight"] = whole
    return out


# ---------------------------------------------------------------- the chapter's experiment (one launch)

def _compare(model: GPT, idx, targets, group, broken=None) -> dict:
    """Logits, loss and every gradient of the TP model against the single-process model (float64)."""
    ledger = Ledger()
    tp = TPGPT(model, group, ledger, broken)
    logits = tp(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    model.zero_grad()
    ref_logits = model(idx)
    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
    grads = full_grads(tp, model, group)
    ref = dict(model.named_parameters())
    grad_err = {n: (gr - ref[n].grad).abs().max().item() for n, gr in grads.items()}
    shard_params = sum(p.numel() for n, p in tp.named_parameters() if n.startswith("blocks"))
    return {"logits": (logits - ref_logits).abs().max().item(), "grads": grad_err,
            "grad_scale": max(p.grad.abs().max().item() for p in model.parameters()),
            "calls": dict(ledger.calls), "payload": dict(ledger.payload), "block_params_per_rank": shard_params}


def tp_worker(rank: int, world: int, batch: int, seq: int) -> dict:
    """TP over 2 ranks (groups {0,1}, {2,3}) and over all 4, the trained tiny GPT in float64, one
    batch of Shakespeare; then each broken operator at t = 4."""
    from kernels.model import data
    from kernels.model.gpt import load_pretrained

    model = load_pretrained().double().train()
    tokens = data.encode(data.load_text()[:20000])
    idx, targets = data.get_batch(tokens, batch, seq, torch.Generator().manual_seed(0))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {2: _compare(model, idx, targets, pairs[rank // 2]), 4: _compare(model, idx, targets, None)}
    for b in BROKEN:
        out[b] = _compare(model, idx, targets, None, broken=b)
    return out
