"""Multi-head attention as a module: projections, heads, masks, dropout, output projection.

For inputs X_q (B, Nq, C) and X_kv (B, Nk, C) (the same tensor for self-attention):

    Q = X_q W_q^T + b_q      (B, Nq, Hq * D)  -> split into heads (B, Hq, Nq, D)
    K = X_kv W_k^T + b_k     (B, Nk, Hkv * D) -> (B, Hkv, Nk, D)
    V = X_kv W_v^T + b_v     (B, Nk, Hkv * D) -> (B, Hkv, Nk, D)
    head_h = dropout(softmax(Q_h K_g(h)^T / sqrt(D) + mask)) V_g(h),   g(h) = h // (Hq / Hkv)
    out = concat_h(head_h) W_o^T + b_o   (B, Nq, C)

with D = C / Hq. ``n_kv_head = n_head`` is multi-head attention (Vaswani et al. 2017); fewer K/V
heads give grouped-query (GQA) and, with one, multi-query attention (MQA).

Masks are boolean "visible" matrices combined with AND: the causal mask (key j visible to query i
when j <= i + Nk - Nq, so with Nq = Nk the diagonal stays visible) and the key padding mask
(``key_padding_mask[b, j]`` True marks position j of sequence b as padding, PyTorch's convention).
A query row with no visible key gets output 0 before the output projection (PyTorch's
``nn.MultiheadAttention`` returns NaN there).

Dropout, when training, is applied to the attention probabilities after the softmax (rows then no
longer sum to exactly 1, but do in expectation: kept entries are scaled by 1 / (1 - p)), as in
``nn.MultiheadAttention``; the residual dropout of the Transformer block lives outside this module.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.attention.reference import causal_mask


def masked_attention_ref(q, k, v, *, causal: bool = False, key_padding_mask: torch.Tensor | None = None,
                         dropout_p: float = 0.0, training: bool = False, return_probs: bool = False):
    """softmax(q k^T / sqrt(D) + mask) v per head, with dropout on the probabilities; any dtype, computed as given.

    q (B, Hq, Nq, D); k, v (B, Hkv, Nk, D); key_padding_mask (B, Nk) bool, True = padding.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)                     # (B, Hq, Nq, Nk)
    visible = torch.ones(B, 1, Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & causal_mask(Nq, Nk, device=q.device)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(dim=-1, keepdim=True)                             # rows with nothing to see
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_p > 0.0 and training:
        probs = F.dropout(probs, p=dropout_p, training=True)                # after the softmax
    out = probs @ v
    return (out, probs) if return_probs else out


class MultiHeadAttention(nn.Module):
    """Multi-head (and grouped-/multi-query) attention; ``use_kernel=True`` runs the heads through
    :func:`kernels.attention.flash_attention` (causal or no mask, no dropout)."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None = None, *, dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if d_model % n_head:
            raise ValueError(f"MultiHeadAttention: d_model={d_model} must be divisible by n_head={n_head}")
        if n_kv_head < 1 or n_head % n_kv_head:
            raise ValueError(f"MultiHeadAttention: n_head={n_head} must be a multiple of n_kv_head={n_kv_head}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must lie in [0, 1), got {dropout}")
        self.d_model, self.n_head, self.n_kv_head = d_model, n_head, n_kv_head
        self.head_dim = d_model // n_head
        self.dropout = dropout
        self.wq = nn.Linear(d_model, n_head * self.head_dim, bias=bias)
        self.wk = nn.Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.wv = nn.Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_head * self.head_dim, d_model, bias=bias)

    def forward(self, x_q: torch.Tensor, x_kv: torch.Tensor | None = None, *, causal: bool = False,
                key_padding_mask: torch.Tensor | None = None, use_kernel: bool = False) -> torch.Tensor:
        x_kv = x_q if x_kv is None else x_kv
        if x_q.dim() != 3 or x_kv.dim() != 3 or x_q.shape[-1] != self.d_model or x_kv.shape[-1] != self.d_model:
            raise ValueError(f"MultiHeadAttention: inputs must be (B, N, {self.d_model}), got "
                             f"{tuple(x_q.shape)} and {tuple(x_kv.shape)}")
        B, Nq, _ = x_q.shape
        Nk = x_kv.shape[1]
        if key_padding_mask is not None and (key_padding_mask.shape != (B, Nk) or key_padding_mask.dtype != torch.bool):
            raise ValueError(f"MultiHeadAttention: key_padding_mask must be a ({B}, {Nk}) bool tensor, got "
                             f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}")
        D = self.head_dim
        q = self.wq(x_q).view(B, Nq, self.n_head, D).transpose(1, 2)        # (B, Hq, Nq, D)
        k = self.wk(x_kv).view(B, Nk, self.n_kv_head, D).transpose(1, 2)    # (B, Hkv, Nk, D)
        v = self.wv(x_kv).view(B, Nk, self.n_kv_head, D).transpose(1, 2)
        if use_kernel:
            if key_padding_mask is not None or (self.dropout > 0 and self.training):
                raise ValueError("MultiHeadAttention: use_kernel=True supports causal or no mask and no dropout")
            from kernels.attention.flash import flash_attention
            heads = flash_attention(q, k, v, causal)
        else:
            heads = masked_attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                         dropout_p=self.dropout, training=self.training)
        return self.wo(heads.transpose(1, 2).reshape(B, Nq, self.n_head * D))  # concat heads, project

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> "MultiHeadAttention":
        """The same weights as a ``torch.nn.MultiheadAttention`` (packed in_proj, same embed dim for q, k, v)."""
        if not mha._qkv_same_embed_dim:
            raise ValueError("MultiHeadAttention.from_torch: needs kdim == vdim == embed_dim")
        bias = mha.in_proj_bias is not None
        out = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=bias)
        wq, wk, wv = mha.in_proj_weight.detach().chunk(3, dim=0)
        with torch.no_grad():
            out.wq.weight.copy_(wq); out.wk.weight.copy_(wk); out.wv.weight.copy_(wv)
            out.wo.weight.copy_(mha.out_proj.weight)
            if bias:
                bq, bk, bv = mha.in_proj_bias.detach().chunk(3)
                out.wq.bias.copy_(bq); out.wk.bias.copy_(bk); out.wv.bias.copy_(bv)
                out.wo.bias.copy_(mha.out_proj.bias)
        return out
