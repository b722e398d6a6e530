"""Padding masks for batches of different-length sequences, and the positions that go with them.

A batch holds B sequences of lengths n_b <= T in one (B, T) tensor; the other T - n_b slots are
padding. ``pad[b, j]`` True marks slot j of sequence b as padding (PyTorch's key-padding convention,
the one :func:`kernels.attention.mha.masked_attention_ref` takes).

* right padding: sequence b fills slots 0..n_b-1. Natural for training and for an encoder.
* left padding: sequence b fills slots T-n_b..T-1. For generation: every sequence's last real token
  sits in the last slot, so the next-token logits of the whole batch are ``logits[:, -1]`` and each
  new token is appended in the same column for every sequence.

Attention then sees key j from query i iff key j is real and (causal) j <= i:

    visible[b, i, j] = (j <= i) and not pad[b, j]

and the position of slot j is the number of real tokens before it, so that each sequence's first
real token sits at position 0 whatever its padding:

    position[b, j] = (number of real slots <= j) - 1      (clamped at 0 on the padding itself)
"""
from __future__ import annotations

import torch

from kernels.attention.reference import causal_mask


def pad_batch(seqs: list[torch.Tensor], pad_id: int = 0, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id tensors of different lengths into (B, T) ids and a (B, T) bool pad mask (True = padding)."""
    if side not in ("left", "right"):
        raise ValueError(f"pad_batch: side must be 'left' or 'right', got {side!r}")
    if not seqs or any(s.dim() != 1 or s.numel() == 0 for s in seqs):
        raise ValueError("pad_batch: seqs must be a non-empty list of non-empty 1-D tensors")
    T = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=seqs[0].dtype)
    pad = torch.ones(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        cols = slice(T - s.numel(), T) if side == "left" else slice(0, s.numel())
        ids[b, cols], pad[b, cols] = s, False
    return ids, pad


def positions_from_padding(pad: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 positions: each sequence's first real token at 0, padding slots at 0."""
    if pad.dim() != 2 or pad.dtype != torch.bool:
        raise ValueError(f"positions_from_padding: pad must be a (B, T) bool tensor, got {tuple(pad.shape)} {pad.dtype}")
    return ((~pad).long().cumsum(-1) - 1).clamp(min=0)


def visible_keys(pad: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(B, T, T) bool: query i of sequence b may see key j (causal: j <= i; and key j is not padding)."""
    if pad.dim() != 2 or pad.dtype != torch.bool:
        raise ValueError(f"visible_keys: pad must be a (B, T) bool tensor, got {tuple(pad.shape)} {pad.dtype}")
    T = pad.shape[1]
    keys = ~pad[:, None, :]                                             # (B, 1, T)
    return keys & causal_mask(T, T, device=pad.device) if causal else keys.expand(-1, T, -1)
