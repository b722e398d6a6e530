"""Token permutation: put every (token, expert) assignment next to the others of its expert, and back.

Shapes: T tokens, C width, k experts per token, M = T*k assignments (fewer if a capacity drops
some), E experts.

Assignment ``a = t*k + j`` is token t's j-th choice, expert ``ids[t, j]``. A stable sort of the
flattened ids gives ``order`` (M,): the assignments grouped by expert, in token order inside each
group, and ``offsets`` (E + 1,): expert e's rows are ``order[offsets[e]:offsets[e+1]]``
(offsets[e+1] - offsets[e] is its load, zero allowed). Then

    permute:    x_sorted[r] = x[order[r] // k]                         (M, C)  a gather
    unpermute:  y[t] = sum_j  w[t, j] * y_sorted[inverse[t*k + j]]     (T, C)  a weighted scatter

where ``inverse`` undoes ``order``. The grouped GEMM (:mod:`kernels.moe.grouped_gemm`) can read
x through ``rows = order // k`` directly, so the permuted copy of x is never written.
"""
from __future__ import annotations

import torch


def sort_by_expert(ids: torch.Tensor, num_experts: int,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``order`` (M,) int64 assignment indices grouped by expert, ``offsets`` (E + 1,) int64.

    ``keep`` (T, k) bool drops the assignments a capacity refused (they appear in no group)."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sort_by_expert: ids must be a (T, k) integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"sort_by_expert: expert ids must lie in [0, {num_experts}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    flat = ids.reshape(-1).long()                                          # (T*k,)
    if keep is not None:
        if keep.shape != ids.shape:
            raise ValueError(f"sort_by_expert: keep must have the shape of ids {tuple(ids.shape)}, got {tuple(keep.shape)}")
        flat = torch.where(keep.reshape(-1), flat, num_experts)           # dropped: sorted past the last expert
    order = torch.sort(flat, stable=True).indices                          # (T*k,) grouped by expert
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]  # (E,) loads
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = counts.cumsum(0)
    return order[: int(offsets[-1])], offsets


def permute_ref(x: torch.Tensor, ids: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None):
    """(x_sorted (M, C), order (M,), offsets (E + 1,)): rows of x copied into expert order."""
    order, offsets = sort_by_expert(ids, num_experts, keep)
    return x[order // ids.shape[1]], order, offsets


def unpermute_ref(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(T, C) fp32 (fp64 kept): y[t] = sum over t's kept assignments of weight * expert output.

    ``weights`` (T, k); an assignment missing from ``order`` (dropped) contributes nothing."""
    T, k = weights.shape
    wide = torch.promote_types(y_sorted.dtype, torch.float32)              # fp32, or fp64 kept
    w = weights.reshape(-1)[order].to(wide)                                 # (M,) each row's gate weight
    out = torch.zeros(T, y_sorted.shape[1], dtype=wide, device=y_sorted.device)
    return out.index_add_(0, order // k, y_sorted.to(wide) * w[:, None])   # y[t] += w * y_sorted[r]
