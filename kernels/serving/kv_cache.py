"""Where the engine's keys and values live: one pool of pages per layer, and the four things done to it.

    k[layer], v[layer]   (num_pages, Hkv, page_size, D)

``write`` puts a step's new keys and values into their slots (page, offset), ``gather`` reads a
sequence's first L positions back contiguously (prefill chunks attend to them), ``decode`` runs
paged decode attention for a batch of single-token queries, ``copy`` duplicates pages (the
scheduler's copy-on-write before a forked sequence writes into a shared page). The runner
(kernels.serving.engine.PagedRunner) touches the cache only through these, so another storage
(quantized pages with their scales, an offloaded tier) is a subclass that overrides them; the
allocator, the scheduler and the radix cache only ever see page ids.
"""
from __future__ import annotations

import torch

from kernels.attention.paged import gather_pages, paged_decode_attention, paged_decode_attention_ref


class PagedKVCache:
    def __init__(self, n_layer: int, num_pages: int, n_kv_head: int, page_size: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None):
        shape = (num_pages, n_kv_head, page_size, head_dim)                  # (pages, Hkv, P, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.page_size = page_size

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, Hkv, D) of N new positions into slots (pages[i], offsets[i])."""
        self.k[layer][pages, :, offsets] = k
        self.v[layer][pages, :, offsets] = v

    def gather(self, layer: int, table_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of one sequence: k, v (Hkv, length, D)."""
        return gather_pages(self.k[layer], table_row, length), gather_pages(self.v[layer], table_row, length)

    def decode(self, layer: int, q: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor, *,
               use_kernels: bool) -> torch.Tensor:
        """Decode attention of q (B, Hq, D) over each sequence's first lens[b] positions."""
        attend = paged_decode_attention if use_kernels else paged_decode_attention_ref
        return attend(q, self.k[layer], self.v[layer], block_table, lens)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Page src -> page dst in every layer, for each (src, dst): gathered before written, so a
        page that is both a destination and a later source is read before it changes."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for pool in self.k + self.v:
            pool[dst] = pool[src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
