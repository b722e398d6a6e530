"""Expert parallelism: the MoE layer's experts spread over p ranks, tokens sent to them by all-to-all.

E experts over p ranks, E/p consecutive experts per rank (rank of expert e = e // (E/p)). Each rank
holds T_r tokens of its own (its share of the batch) and a copy of the router. One MoE layer:

1. route locally: weights, ids = router(x) (T_r, k), the MoE chapter's
   :func:`kernels.moe.router.topk_route_ref`; sort the T_r k assignments by expert
   (:func:`kernels.moe.permute.sort_by_expert`), which also groups them by destination rank;
2. dispatch: exchange the counts (an all-to-all of p integers), then an all-to-all of the rows
   x[token of each assignment] with those uneven splits, and of each row's expert id;
3. compute: the received rows, regrouped by local expert, through those experts' SwiGLU
   (``gemm="ref"``: :func:`kernels.moe.grouped_gemm.grouped_gemm_ref`; ``gemm="triton"``: the
   routing chapter's Triton kernel :func:`kernels.moe.grouped_gemm.grouped_gemm`, which reads the
   received rows through the regrouping permutation instead of copying them);
4. combine: the reverse all-to-all brings every row back to its token's rank, in the order it left,
   and :func:`kernels.moe.permute.unpermute_ref` adds the k outputs of each token with its weights.

The all-to-all's backward is the reverse all-to-all (splits swapped), so gradients flow back to
x, the router and the experts. Expert weights are not replicated: an expert's gradient sums over
every token that reached it, wherever it came from, and is already complete on its rank. The
router is replicated: its gradient is all-reduced over the ranks, as in data parallelism.

Traffic per token and layer, forward: its k assignments each send a C-wide row to their expert's
rank unless that rank is its own (dispatch), and the same rows come back (combine):
2 k C E bytes x (fraction of assignments that leave the rank); (p - 1)/p under uniform routing.
The backward sends the same again. DeepSeek-V3 bounds the slow part of it by routing each token to
experts on at most 4 nodes (device/node-limited routing).

``broken="no_regroup"`` runs the received rows through the experts in arrival order, as if they
were grouped by expert: each source's rows are, but the p sources' blocks interleave the experts,
so some rows meet the wrong expert.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_ref
from kernels.moe.permute import sort_by_expert, unpermute_ref
from kernels.moe.router import topk_route_ref

BROKEN = ("no_regroup",)


def _triton_gemm(a, w, offsets, rows=None):
    """The Triton grouped GEMM with the reference's argument order; returns a's dtype."""
    return grouped_gemm(a, w, offsets, rows=rows)


GEMMS = {"ref": grouped_gemm_ref, "triton": _triton_gemm}


def expert_rank(expert: torch.Tensor, n_experts: int, p: int) -> torch.Tensor:
    """The rank that holds each expert: e // (E/p) (consecutive blocks)."""
    if n_experts % p:
        raise ValueError(f"expert_rank: {n_experts} experts do not split evenly over {p} ranks")
    return expert // (n_experts // p)


class _AllToAllRows(torch.autograd.Function):
    """Rows (M, C) split by ``send_counts`` to ranks 0..p-1; returns the rows received, by source
    rank. Backward: the gradients go back with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send_counts, recv_counts, group, ledger, where):
        ctx.counts, ctx.group, ctx.ledger, ctx.where = (send_counts, recv_counts), group, ledger, where
        return _exchange(rows, send_counts, recv_counts, group, ledger, where + " forward")

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return (_exchange(grad.contiguous(), recv_counts, send_counts, ctx.group, ctx.ledger, ctx.where + " backward"),
                None, None, None, None, None)


def _exchange(rows, send_counts, recv_counts, group, ledger, where):
    out = torch.empty((sum(recv_counts), *rows.shape[1:]), dtype=rows.dtype)
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    if ledger is not None:
        r = dist.get_rank(group)
        off_rank = sum(c for j, c in enumerate(send_counts) if j != r)       # rows that leave this rank
        row_bytes = rows[0].numel() * rows.element_size() if len(rows) else 0
        ledger[where] = ledger.get(where, 0) + off_rank * row_bytes
    return out


def _counts(dest: torch.Tensor, p: int, group) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each rank, rows it receives from each): the counts all-to-all."""
    send = torch.bincount(dest, minlength=p)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return send.tolist(), recv.tolist()


def ep_moe_forward(layer, x: torch.Tensor, group=None, ledger=None, broken=None, gemm: str = "ref") -> torch.Tensor:
    """The MoE layer (a :class:`kernels.moe.model.MoELayer`, its router and all its experts' weights
    read only for this rank's experts) on this rank's tokens x (T_r, C). Returns (T_r, C).
    ``gemm`` picks the experts' grouped GEMM: "ref" (PyTorch) or "triton" (the routing chapter's kernel)."""
    if broken is not None and broken not in BROKEN:
        raise ValueError(f"ep_moe_forward: broken must be None or one of {BROKEN}, got {broken!r}")
    if gemm not in GEMMS:
        raise ValueError(f"ep_moe_forward: gemm must be one of {sorted(GEMMS)}, got {gemm!r}")
    cfg = layer.config
    p, r = dist.get_world_size(group), dist.get_rank(group)
    E, k, per = cfg.n_experts, cfg.top_k, cfg.n_experts // p
    weights, ids = topk_route_ref(layer.router(x), k, score=cfg.score)        # (T_r, k) each
    order, _ = sort_by_expert(ids, E)                                         # assignments by expert, so by rank
    expert_of = ids.reshape(-1)[order]                                        # (M,) expert of each sorted row
    dest = expert_rank(expert_of, E, p)
    send_counts, recv_counts = _counts(dest, p, group)
    if ledger is not None:
        ledger["rows computed here"] = ledger.get("rows computed here", 0) + sum(recv_counts)
    rows = _AllToAllRows.apply(x[order // k], send_counts, recv_counts, group, ledger, "dispatch")   # (M_in, C)
    got_expert = torch.empty(sum(recv_counts), dtype=torch.long)
    dist.all_to_all_single(got_expert, expert_of, output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    local = got_expert - r * per                                              # 0..E/p-1
    by_expert = torch.sort(local, stable=True).indices                        # regroup the received rows
    if broken == "no_regroup":
        by_expert = torch.arange(len(local))
    offsets = torch.zeros(per + 1, dtype=torch.long)
    offsets[1:] = torch.bincount(local, minlength=per).cumsum(0)
    w_gu = layer.w_gate_up[r * per: (r + 1) * per]                            # this rank's experts only
    w_down = layer.w_down[r * per: (r + 1) * per]
    gu = GEMMS[gemm](rows, w_gu, offsets, by_expert)                          # (M_in, 2F) in expert order
    h = F.silu(gu[:, : cfg.d_expert]) * gu[:, cfg.d_expert:]
    y_sorted = GEMMS[gemm](h, w_down, offsets)
    y_in = torch.empty_like(y_sorted).index_copy(0, by_expert, y_sorted)      # back to arrival order
    y = _AllToAllRows.apply(y_in, recv_counts, send_counts, group, ledger, "combine")    # (M, C) as sent
    return unpermute_ref(y, order, weights).to(x.dtype)


def assignments_leaving(ids: torch.Tensor, n_experts: int, p: int, rank: int) -> int:
    """How many of a rank's assignments go to an expert on another rank (the rows it sends)."""
    return int((expert_rank(ids.reshape(-1), n_experts, p) != rank).sum())


def traffic_per_token(k: int, d_model: int, bytes_per_value: float, p: int) -> float:
    """Forward bytes per token under uniform routing: dispatch + combine of k rows, (p - 1)/p of them leave."""
    return 2 * k * d_model * bytes_per_value * (p - 1) / p


# ---------------------------------------------------------------- the chapter's experiment (one launch)

def make_layer(seed: int = 0):
    """A MoE layer of the MoE chapter's config (8 experts, top-2, width 64), float64, seeded."""
    from kernels.moe.model import MoEConfig, MoELayer

    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig()).double()
    with torch.no_grad():
        for q in layer.parameters():
            q.normal_(0, 0.2)
    return layer


def tokens(p: int, per_rank: int, d_model: int, seed: int = 1) -> torch.Tensor:
    """(p * per_rank, C) float64 tokens; rank r holds rows [r per_rank, (r + 1) per_rank)."""
    return torch.randn(p * per_rank, d_model, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def ep_worker(rank: int, p: int, per_rank: int) -> dict:
    """EP forward and backward of :func:`make_layer` on this rank's tokens (a fixed upstream
    gradient): in float64 with the reference GEMM ("ep"), with the broken regrouping, and in float32
    through the Triton grouped GEMM ("triton", the interpreter on a CPU). Returns outputs, input
    gradients, the gradients of this rank's experts, the router's (all-reduced), the bytes sent and
    the rows that left."""
    out = {}
    for label, broken, gemm, dtype in (("ep", None, "ref", torch.float64),
                                       ("no_regroup", "no_regroup", "ref", torch.float64),
                                       ("triton", None, "triton", torch.float32)):
        layer = make_layer().to(dtype)
        x_all = tokens(p, per_rank, layer.config.d_model).to(dtype)
        g_all = tokens(p, per_rank, layer.config.d_model, seed=2).to(dtype)
        x = x_all[rank * per_rank: (rank + 1) * per_rank].clone().requires_grad_(True)
        ledger = {}
        y = ep_moe_forward(layer, x, None, ledger, broken, gemm)
        y.backward(g_all[rank * per_rank: (rank + 1) * per_rank])
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)
        per = layer.config.n_experts // p
        _, ids = topk_route_ref(layer.router(x.detach()), layer.config.top_k, score=layer.config.score)
        out[label] = {"y": y.detach(), "dx": x.grad, "router": router, "ledger": ledger,
                      "w_gate_up": layer.w_gate_up.grad[rank * per: (rank + 1) * per].clone(),
                      "w_down": layer.w_down.grad[rank * per: (rank + 1) * per].clone(),
                      "leaving": assignments_leaving(ids, layer.config.n_experts, p, rank)}
    return out
