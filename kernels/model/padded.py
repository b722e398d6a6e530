"""Batched forward and greedy decoding of the tiny GPT on padded batches, in plain PyTorch.

The model's own forward (kernels.model.gpt) assumes every sequence of a batch is real from slot 0.
Here the same parameters run a batch with a key-padding mask (kernels.attention.masks): every
attention masks the padding keys, and positions count from each sequence's first real token.

    h = x + W_o Attn(RoPE(W_q u), RoPE(W_k u), W_v u; causal and not padding),  u = RMSNorm_1(x)
    out = h + MLP(RMSNorm_2(h))

A padding query sees no key (left padding: it comes before every real token); its attention output
is 0 (masked_attention_ref's convention) and its logits are never read.
"""
from __future__ import annotations

import torch

from kernels.attention.masks import pad_batch, positions_from_padding
from kernels.attention.mha import masked_attention_ref
from kernels.model.gpt import GPT, add_rms_norm_torch, rope


def _attention(block, u: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    att, cfg = block.attn, block.config
    B, T, _ = u.shape
    q = att.wq(u).view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)       # (B, Hq, T, D)
    k = att.wk(u).view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)    # (B, Hkv, T, D)
    v = att.wv(u).view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    out = masked_attention_ref(q, k, v, causal=True, key_padding_mask=pad)   # (B, Hq, T, D)
    return att.wo(out.transpose(1, 2).reshape(B, T, cfg.n_head * cfg.head_dim))


def forward_padded(model: GPT, idx: torch.Tensor, pad: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) of ``model`` for ids idx (B, T) with padding pad (B, T) bool (True = padding).

    ``positions`` defaults to :func:`positions_from_padding` (each sequence starts at 0).
    """
    if idx.shape != pad.shape or pad.dtype != torch.bool:
        raise ValueError(f"forward_padded: idx {tuple(idx.shape)} and pad {tuple(pad.shape)} {pad.dtype} "
                         "must be (B, T) ids and a (B, T) bool mask")
    if idx.shape[1] > model.config.block_size:
        raise ValueError(f"forward_padded: {idx.shape[1]} slots exceed block_size={model.config.block_size}")
    positions = positions_from_padding(pad) if positions is None else positions
    x = model.wte(idx)                                                       # (B, T, C)
    for block in model.blocks:
        a = _attention(block, block.norm1(x), positions, pad)
        h, hn = add_rms_norm_torch(x, a, block.norm2.weight, block.config.norm_eps)
        x = h + block.mlp(hn)
    return model.norm_f(x) @ model.wte.weight.T                              # (B, T, V)


@torch.no_grad()
def generate_left_padded(model: GPT, prompts: list[torch.Tensor], max_new_tokens: int) -> list[torch.Tensor]:
    """Greedy continuation of prompts of different lengths, as one left-padded batch (no KV cache):
    every step reads the logits of the last slot and appends one column."""
    idx, pad = pad_batch(prompts, side="left")
    for _ in range(max_new_tokens):
        nxt = forward_padded(model, idx, pad)[:, -1].argmax(-1, keepdim=True)  # (B, 1): last slot of every row
        idx = torch.cat([idx, nxt], dim=1)
        pad = torch.cat([pad, torch.zeros_like(nxt, dtype=torch.bool)], dim=1)
    return [row[~p] for row, p in zip(idx, pad)]
