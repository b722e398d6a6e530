"""Activation memory per transformer layer, and what recomputation (activation checkpointing) buys.

Backward needs tensors the forward made. What autograd keeps for one layer is measured here by
:func:`saved_bytes` (``torch.autograd.graph.saved_tensors_hooks``: every tensor an op saves for its
backward, counted once per storage, parameters left out), and derived by hand in two ledgers:

**Korthikanti et al. (2022), Table 2** (:func:`korthikanti_bytes`), for a GPT-3 layer (LayerNorm,
multi-head attention with dropout on the probabilities, a 4h GELU MLP, dropout after attention and
MLP), 2-byte activations and 1-byte dropout masks; s sequence, b micro-batch, h width, a heads,
t tensor-parallel ranks:

    no parallelism                        s b h (34 + 5 a s / h)
    tensor parallel                       s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel            s b h (34/t + 5 a s / (h t))
    tensor parallel + selective recompute s b h (10 + 24/t)
    tensor + sequence + selective         s b h (34/t)
    full recompute                        s b h (2)            (the layer's input only)
    full recompute, tensor + sequence     s b h (2/t)          (the input is the rank's s/t shard)

34 = LayerNorm inputs 4 + QKV input 2 + Q, K 4 + V 2 + projection input 2 + dropout mask 1 + MLP
input 2 + GELU input 8 + fc2 input 8 + dropout mask 1; 5 a s / h = softmax output 2 + its dropout
mask 1 + dropout output 2 (per score, a s^2 b scores). Selective recomputation keeps everything but
those scores and recomputes softmax(Q K^T) V in the backward. Full recomputation keeps the layer's
input: under tensor parallelism alone it is replicated on every rank (2 s b h, the table's row);
under sequence parallelism each rank holds, and checkpoints, its s/t tokens of it (2 s b h / t).
The paper leaves out small buffers; on this layer they are LayerNorm's mean and 1/std, 2 values
per token per LayerNorm (:func:`paper_layer_extra_bytes`). :class:`PaperLayer` is that layer in PyTorch (dropout through
``torch.native_dropout``, whose mask is bool, as on a GPU; ``F.dropout`` on a CPU multiplies by a
mask of the input's dtype instead); the chapter checks the table against it byte for byte, one
rank of a tensor-parallel layer emulated in one process (each collective replaced by a stand-in
that has its output's shape; the values are not a real run's, the saved bytes are).

**The tiny GPT** (:func:`tiny_gpt_layer_bytes`): RMSNorm written out (it saves its input, 1/rms and
the normalised x), RoPE (cos and sin tables), grouped-query attention whose K/V are repeated to
Hq heads before the products (the repeated copies are what is saved), no dropout, a SwiGLU MLP of
width F (gate, up, silu(gate), the product): per layer, E bytes a value,

    E (10 s b C + 4 s b F + b Hq s^2 + 2 s b + 2 s D) + s^2        (the last: the bool causal mask)

Selective recomputation (:func:`tiny_block_forward`) keeps Q and the un-repeated K, V instead of
the repeated copies, the scores and the mask: E (8 s b C + 2 s b Hkv D + 4 s b F + 2 s b + 2 s D);
full recomputation keeps the block's inputs, x and the int64 positions: E s b C + 8 s.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

RECOMPUTE = ("none", "selective", "full")


# ---------------------------------------------------------------- measuring what autograd keeps

def saved_bytes(fn, params=()) -> tuple[int, list]:
    """(bytes, [(shape, dtype, bytes) per storage]) of the tensors autograd saves while ``fn()`` runs:
    each storage counted once (views of one tensor share it), the storages of ``params`` left out."""
    skip = {q.untyped_storage().data_ptr() for q in params}
    seen: dict[int, tuple] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (tuple(t.shape), t.dtype, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(v[2] for v in seen.values()), list(seen.values())


# ---------------------------------------------------------------- Korthikanti et al.'s formulas

def korthikanti_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False,
                      recompute: str = "none") -> float:
    """Activation bytes of one GPT-3 layer on one rank (Korthikanti et al. 2022, Table 2): 2-byte
    activations, 1-byte dropout masks, ``t`` tensor-parallel ranks, ``sp`` sequence parallelism,
    ``recompute`` "none", "selective" (the attention scores) or "full" (only the layer's input: 2 s b h,
    or 2 s b h / t under sequence parallelism, where the input a rank holds is its sequence shard)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"korthikanti_bytes: recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if not (isinstance(t, int) and t >= 1):
        raise ValueError(f"korthikanti_bytes: t must be a positive int, got {t!r}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    split = 34 / t if sp else 10 + 24 / t
    return sbh * (split + scores)


def paper_layer_extra_bytes(s: int, b: int, *, t: int = 1, sp: bool = False, recompute: str = "none",
                            stat_bytes: int = 2) -> int:
    """What :class:`PaperLayer` saves beyond the formula: LayerNorm's mean and 1/std, one value each
    per token it normalises, for both LayerNorms (``stat_bytes``: 2 for bf16 on a CPU, whose
    LayerNorm keeps them in the input dtype; 4 on a GPU, which keeps them in fp32)."""
    if recompute == "full":
        return 0
    tokens = s * b // t if sp else s * b
    return 2 * 2 * tokens * stat_bytes


class _Standin(torch.autograd.Function):
    """A collective's stand-in for one-rank emulation: the output shape of an all-gather (repeat the
    shard t times along the sequence) or of a reduce-scatter (keep the first 1/t), nothing saved."""

    @staticmethod
    def forward(ctx, x, t, kind):
        ctx.t, ctx.kind = t, kind
        return x.repeat(t, 1, 1) if kind == "gather" else x[: x.shape[0] // t].clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.kind == "gather":
            return g[: g.shape[0] // ctx.t].clone(), None, None
        return g.repeat(ctx.t, 1, 1), None, None


class _GatherLinear(torch.autograd.Function):
    """Megatron's sequence-parallel column linear: the input's sequence shard is all-gathered
    (stand-in) and multiplied, but the *shard* is what is saved; the backward gathers it again."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, t):
        ctx.save_for_backward(x_shard, weight)
        ctx.t = t
        return F.linear(x_shard.repeat(t, 1, 1), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x_shard, weight = ctx.saved_tensors
        x = x_shard.repeat(ctx.t, 1, 1)                                   # the backward's all-gather
        gx = (g @ weight)[: x_shard.shape[0]]
        return gx, g.flatten(0, 1).T @ x.flatten(0, 1), g.sum((0, 1)), None


class PaperLayer(nn.Module):
    """One GPT-3 layer as Korthikanti et al. count it, on one of ``t`` tensor-parallel ranks (a/t heads,
    4h/t MLP units), with ``sp`` sequence parallelism (LayerNorm and dropout regions on s/t tokens).
    Input and output (s, b, h), or (s/t, b, h) under ``sp``; the collectives are stand-ins."""

    def __init__(self, h: int, a: int, *, t: int = 1, sp: bool = False, p_drop: float = 0.1):
        super().__init__()
        if a % t or h % a:
            raise ValueError(f"PaperLayer: need a % t == 0 and h % a == 0, got h={h}, a={a}, t={t}")
        self.h, self.a, self.t, self.sp, self.p = h, a, t, sp, p_drop
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h // t)                 # column-parallel
        self.proj = nn.Linear(h // t, h)                    # row-parallel
        self.fc1 = nn.Linear(h, 4 * h // t)
        self.fc2 = nn.Linear(4 * h // t, h)

    def _dropout(self, x):
        return torch.native_dropout(x, self.p, True)[0]     # saves a bool mask: 1 byte a value

    def _core(self, q, k, v):
        """softmax(Q K^T / sqrt(d) + causal) with dropout, times V: the part selective recomputation redoes."""
        s = q.shape[-2]
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = scores + torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)   # an add saves nothing
        return self._dropout(torch.softmax(scores, dim=-1)) @ v

    def _column(self, linear, x):
        if self.sp:
            return _GatherLinear.apply(x, linear.weight, linear.bias, self.t)
        return linear(x)

    def _row(self, linear, x):
        y = linear(x)                                       # partial sums; the all-reduce is a stand-in
        return _Standin.apply(y, self.t, "scatter") if self.sp else y

    def forward(self, x, recompute: str = "none"):
        if recompute not in ("none", "selective"):
            raise ValueError(f"PaperLayer.forward: recompute must be 'none' or 'selective' "
                             f"(full: checkpoint the whole layer), got {recompute!r}")
        s = x.shape[0] * (self.t if self.sp else 1)
        b, heads, d = x.shape[1], self.a // self.t, self.h // self.a
        qkv = self._column(self.qkv, self.ln1(x)).view(s, b, 3, heads, d)
        q, k, v = (qkv[:, :, i].permute(1, 2, 0, 3) for i in range(3))          # (b, a/t, s, d)
        core = checkpoint(self._core, q, k, v, use_reentrant=False) if recompute == "selective" else self._core(q, k, v)
        x = x + self._dropout(self._row(self.proj, core.permute(2, 0, 1, 3).reshape(s, b, heads * d)))
        y = self._row(self.fc2, F.gelu(self._column(self.fc1, self.ln2(x))))
        return x + self._dropout(y)


def paper_layer_saved(s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False, recompute: str = "none",
                      dtype=torch.bfloat16) -> tuple[int, list]:
    """:func:`saved_bytes` of one forward of :class:`PaperLayer` (seeded), ``recompute="full"``
    checkpointing the whole layer."""
    torch.manual_seed(0)
    layer = PaperLayer(h, a, t=t, sp=sp).to(dtype)
    x = torch.randn(s // t if sp else s, b, h, dtype=dtype, requires_grad=True)
    if recompute == "full":
        return saved_bytes(lambda: checkpoint(layer, x, use_reentrant=False), layer.parameters())
    return saved_bytes(lambda: layer(x, recompute), layer.parameters())


# ---------------------------------------------------------------- the tiny GPT's own ledger

def tiny_gpt_layer_bytes(config, b: int, s: int, bytes_per_value: int = 4, recompute: str = "none") -> int:
    """Bytes one block of the course's tiny GPT (pure-PyTorch path) saves for its backward (module docstring)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"tiny_gpt_layer_bytes: recompute must be one of {RECOMPUTE}, got {recompute!r}")
    C, Fw, Hq, Hkv, D, E = config.d_model, config.d_ff, config.n_head, config.n_kv_head, config.head_dim, bytes_per_value
    if recompute == "full":
        return E * s * b * C + 8 * s                     # the block's input, and the int64 positions
    small = E * (2 * s * b + 2 * s * D)                  # 1/rms of both norms; RoPE's cos, sin for Q and K
    if recompute == "selective":
        return E * (8 * s * b * C + 2 * s * b * Hkv * D + 4 * s * b * Fw) + small
    return E * (10 * s * b * C + 4 * s * b * Fw + b * Hq * s * s) + small + s * s


def tiny_block_forward(block, x: torch.Tensor, positions: torch.Tensor, recompute: str = "none") -> torch.Tensor:
    """One tiny-GPT block, as :meth:`kernels.model.gpt.Block.forward` computes it (pure PyTorch),
    with ``recompute`` "selective" (the attention products and softmax redone in the backward,
    torch.utils.checkpoint around them) or "full" (the whole block)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"tiny_block_forward: recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if recompute == "full":
        return checkpoint(tiny_block_forward, block, x, positions, "none", use_reentrant=False)
    attn = block.attn
    q, k, v = _block_qkv(block, x, positions)
    if recompute == "selective":
        out = checkpoint(attn._attend, q, k, v, 0, False, use_reentrant=False)
    else:
        out = attn._attend(q, k, v, 0, False)
    return _block_rest(block, x, out, recompute_mlp=False)


def _block_qkv(block, x, positions):
    """Q (B, Hq, T, D) and K, V (B, Hkv, T, D) of a tiny-GPT block, RoPE at ``positions``."""
    from kernels.model.gpt import rope

    attn, cfg = block.attn, block.config
    B, T, _ = x.shape
    u = block.norm1(x)
    q = rope(attn.wq(u).view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2), positions, cfg.rope_theta)
    k = rope(attn.wk(u).view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2), positions, cfg.rope_theta)
    v = attn.wv(u).view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
    return q, k, v


def _block_rest(block, x, out, recompute_mlp: bool):
    """The block after attention: W_o, the residual add and norm, the MLP (rerun in the backward
    when ``recompute_mlp``: only its input is kept), the second residual add."""
    from kernels.model.gpt import add_rms_norm_torch

    cfg = block.config
    B, _, T, _ = out.shape
    a = block.attn.wo(out.transpose(1, 2).reshape(B, T, cfg.n_head * cfg.head_dim))
    h, hn = add_rms_norm_torch(x, a, block.norm2.weight, cfg.norm_eps)
    return h + (checkpoint(block.mlp, hn, use_reentrant=False) if recompute_mlp else block.mlp(hn))


RECOMPUTE_MODULES = ("core_attn", "mlp")


def _fused_attention(q, k, v):
    """Causal GQA attention in one fused op (FlashAttention's contract: Q, K, V, the output and the
    rows' log-sum-exp are saved, no s x s scores)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def fused_block_forward(block, x: torch.Tensor, positions: torch.Tensor, recompute_modules=()) -> torch.Tensor:
    """One tiny-GPT block with fused attention (:func:`_fused_attention`) and Megatron-Core's
    ``recompute_modules`` choices: "core_attn" reruns the attention op in the backward (keeping its
    inputs Q, K, V, which its producers keep anyway), "mlp" reruns the MLP (keeping its input)."""
    bad = sorted(set(recompute_modules) - set(RECOMPUTE_MODULES))
    if bad:
        raise ValueError(f"fused_block_forward: recompute_modules must be drawn from {RECOMPUTE_MODULES}, got {bad}")
    q, k, v = _block_qkv(block, x, positions)
    if "core_attn" in recompute_modules:
        out = checkpoint(_fused_attention, q, k, v, use_reentrant=False)
    else:
        out = _fused_attention(q, k, v)
    return _block_rest(block, x, out, recompute_mlp="mlp" in recompute_modules)


# ---------------------------------------------------------------- what recomputation costs

def layer_flops(s: int, b: int, h: int, ffn: int | None = None) -> dict:
    """Matmul FLOPs of one GPT-3 layer's forward: 2 s b h (3h + h + 2 ffn) for the weights
    (QKV, projection, the two MLP matrices; ffn = 4h) and 4 s^2 b h for Q K^T and P V."""
    ffn = 4 * h if ffn is None else ffn
    weights = 2 * s * b * h * (3 * h + h + 2 * ffn)
    scores = 4 * s * s * b * h
    return {"weights": weights, "scores": scores, "forward": weights + scores}


def recompute_flops(s: int, b: int, h: int, recompute: str, *, early_stop: bool = True) -> int:
    """Matmul FLOPs that recomputation adds to one GPT-3 layer's training step. Full: one whole
    forward. Selective: the score products Q K^T and P V (4 s^2 b h), or only Q K^T (2 s^2 b h) with
    ``early_stop``: PyTorch's non-reentrant checkpoint stops replaying the region once the last tensor
    the backward needs is rebuilt (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by
    default), and P V's output is not one of them."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute_flops: recompute must be one of {RECOMPUTE}, got {recompute!r}")
    f = layer_flops(s, b, h)
    if recompute == "selective":
        return f["scores"] // 2 if early_stop else f["scores"]
    return f["forward"] if recompute == "full" else 0


def recompute_overhead(s: int, b: int, h: int, recompute: str, *, early_stop: bool = True) -> float:
    """:func:`recompute_flops` as a fraction of a step without it (forward + backward = 3 forwards)."""
    return recompute_flops(s, b, h, recompute, early_stop=early_stop) / (3 * layer_flops(s, b, h)["forward"])


def counted_flops(fn) -> int:
    """FLOPs torch's FlopCounterMode counts (matmuls) while ``fn()`` runs, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
