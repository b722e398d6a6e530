"""Dropless MoE: MegaBlocks' block-sparse view of an MoE layer, against capacity-factor dropping.

Shapes: M assignment rows sorted by expert (loads n_e, :mod:`kernels.moe.permute`), E experts of
hidden width F, block size B (MegaBlocks uses 128).

MegaBlocks (Gale et al. 2022) writes the first expert GEMM of every expert at once as one
block-sparse product: the hidden activations H form a matrix of M' x (E F) where M' pads each
expert's rows to a multiple of B, and only the blocks on the block diagonal (expert e's row blocks
times expert e's F/B column blocks) are nonzero:

    topology = {(row block i, column block j): i in e's row blocks, j in e's column blocks}
    H[i, j]  = X_sorted[i] @ [W_1 | ... | W_E][:, j]      for (i, j) in the topology only

Nothing is dropped and the waste is only the padding of each expert to B rows,
sum_e (ceil(n_e / B) B - n_e) < E B. A capacity factor instead pads every expert to
cap = ceil(cf k T / E) rows (E cap rows computed, full or not) and drops the rows past it.
The course's grouped GEMM (:mod:`kernels.moe.grouped_gemm`) computes exactly MegaBlocks' topology:
its tile schedule is the list of nonzero row blocks, each multiplied by its expert's columns.
"""
from __future__ import annotations

import math

import torch

from kernels.moe.router import capacity


def block_topology(offsets: torch.Tensor, d_ff: int, block: int) -> torch.Tensor:
    """(nnz, 2) int64 (row block, column block) of the nonzero blocks of H, row blocks over the
    padded rows (each expert's segment rounded up to ``block``), column blocks over E * d_ff."""
    if d_ff % block:
        raise ValueError(f"block_topology: d_ff={d_ff} must be a multiple of block={block}")
    loads = (offsets[1:] - offsets[:-1]).tolist()
    cols_per_expert = d_ff // block
    blocks, row0 = [], 0
    for e, n in enumerate(loads):
        for i in range(math.ceil(n / block)):
            for j in range(cols_per_expert):
                blocks.append((row0 + i, e * cols_per_expert + j))
        row0 += math.ceil(n / block)
    return torch.tensor(blocks, dtype=torch.long).view(-1, 2)


def pad_rows(x_sorted: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X_padded (M', C) with zero rows, dest (M,) the padded row of each sorted row)."""
    loads = offsets[1:] - offsets[:-1]
    padded = (loads + block - 1) // block * block                               # (E,)
    starts = torch.cumsum(padded, 0) - padded                                   # (E,) first padded row
    expert = torch.repeat_interleave(torch.arange(len(loads)), loads)           # (M,) expert of each row
    dest = starts[expert] + torch.arange(len(expert)) - offsets[:-1][expert]
    out = torch.zeros(int(padded.sum()), x_sorted.shape[1], dtype=x_sorted.dtype)
    out[dest] = x_sorted
    return out, dest


def block_sparse_ref(x_sorted: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, block: int) -> torch.Tensor:
    """MegaBlocks' SDD product in PyTorch: H (M', E F) = X_padded @ [W_1 | ... | W_E], computed on
    the topology's blocks only (the rest stays zero). w (E, C, F); fp32 (fp64 kept)."""
    E, C, F = w.shape
    wide = torch.promote_types(x_sorted.dtype, torch.float32)
    xp, _ = pad_rows(x_sorted.to(wide), offsets, block)
    w_cat = w.to(wide).permute(1, 0, 2).reshape(C, E * F)                      # (C, E F)
    h = torch.zeros(xp.shape[0], E * F, dtype=wide)
    for i, j in block_topology(offsets, F, block).tolist():
        r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
        h[r, c] = xp[r] @ w_cat[:, c]
    return h


def work(loads: list[int], block: int, capacity_factor: float, top_k: int) -> dict[str, int]:
    """Rows computed and rows dropped by the two formulations for one layer's loads (T = sum / k tokens)."""
    M = sum(loads)
    cap = capacity(M // top_k, len(loads), top_k, capacity_factor)
    return {"assignments": M,
            "block-sparse rows": sum(math.ceil(n / block) * block for n in loads),
            "capacity rows": len(loads) * cap,
            "capacity dropped": sum(max(0, n - cap) for n in loads)}
