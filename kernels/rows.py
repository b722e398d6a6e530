"""Layout helpers shared by the row kernels (softmax, the norms): each program takes whole rows of
a (rows, n) view, so inputs are reshaped to that view and the warps sized by the tile."""
from __future__ import annotations

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a (rows, n) view with unit feature stride when possible, else a contiguous copy."""
    n = x.shape[-1]
    if x.stride(-1) != 1 and n > 1:
        x = x.contiguous()
    rows = x.reshape(-1, n)  # a view when the leading dimensions collapse (e.g. a row-padded buffer)
    if rows.stride(1) != 1 and n > 1:
        rows = rows.contiguous()
    return rows


def num_warps(tile_elements: int) -> int:
    """Warps per program on a GPU: about 256 tile elements per warp (8 per thread), 1 to 8 warps.
    Fewer would hold too many values per thread in registers; the interpreter ignores it."""
    return min(max(tile_elements // 256, 1), 8)
