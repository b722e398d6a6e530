"""A rolling-buffer KV cache for sliding-window attention: W slots per sequence, position p in slot p mod W.

With a window of W positions the query at position t attends to keys t - W + 1 .. t. Anything older
is never read again, so the cache needs only W slots: position p is written to slot p mod W,
overwriting position p - W, which has just left every future window. The cache stops growing at W
positions, whatever the length of the conversation (Mistral 7B: W = 4096, Jiang et al. 2023; the
rolling buffer is mistralai/mistral-inference@8598cf58, README).

Attention over the buffer needs no reordering: the keys were rotated by RoPE at their own
positions when they were written, and softmax-weighted sums do not depend on the order of the
keys. So decode attention is the contiguous kernel's over the first min(L, W) slots:

    o_t = decode_attention(q_t, k_buf, v_buf, min(t + 1, W))

Shapes: k, v (B, Hkv, W, D); seqlens (B,) int64: positions written so far (may exceed W).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.decode import decode_attention, decode_attention_ref


def rolling_slot(position: int, window: int) -> int:
    """The slot of ``position`` in a buffer of ``window`` slots."""
    return position % window


@dataclass
class RollingKVCache:
    k: torch.Tensor              # (B, Hkv, W, D)
    v: torch.Tensor
    seqlens: torch.Tensor        # (B,) positions written so far

    @classmethod
    def empty(cls, batch: int, kv_heads: int, window: int, head_dim: int, dtype=torch.float32, device=None):
        if window < 1:
            raise ValueError(f"RollingKVCache: window must be >= 1, got {window}")
        shape = (batch, kv_heads, window, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.int64, device=device))

    @property
    def window(self) -> int:
        return self.k.shape[2]

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write one position per sequence: k_new, v_new (B, Hkv, D) go to slot seqlens mod W."""
        if k_new.shape != (self.k.shape[0], self.k.shape[1], self.k.shape[3]) or v_new.shape != k_new.shape:
            raise ValueError(f"RollingKVCache.append: expected (B, Hkv, D) = {(self.k.shape[0], self.k.shape[1], self.k.shape[3])}, "
                             f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        b = torch.arange(self.k.shape[0], device=self.k.device)
        slot = self.seqlens % self.window
        self.k[b, :, slot] = k_new
        self.v[b, :, slot] = v_new
        self.seqlens += 1

    def filled(self) -> torch.Tensor:
        """min(L, W): the slots that hold a position of the window."""
        return torch.clamp(self.seqlens, max=self.window)

    def attend(self, q: torch.Tensor, *, use_kernels: bool = True) -> torch.Tensor:
        """Decode attention of q (B, Hq, D) over the window (the W most recent positions, or all if fewer)."""
        fn = decode_attention if use_kernels else decode_attention_ref
        return fn(q, self.k, self.v, self.filled())

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
