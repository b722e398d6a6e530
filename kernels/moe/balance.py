"""Load balancing: the Switch auxiliary loss, the router z-loss, and DeepSeek-V3's bias update.

Shapes: T tokens, E experts, k experts per token. ``load`` (E,) counts the assignments each expert
received in a batch (``kernels.moe.router.tokens_per_expert``).

Switch auxiliary loss (Fedus et al. 2021, eq. 4; Megatron-LM divides the dispatch fraction by k
for top-k routing):

    L_aux = E * sum_i f_i * P_i,   f_i = load_i / (k T)   (no gradient: a count),
                                   P_i = (1/T) sum_t p_{t,i}   (the mean router probability)

It equals 1 when both f and P are uniform; its gradient pushes down the probability of the experts
that receive the most tokens.

Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): L_z = (1/T) sum_t (log sum_i e^{u_{t,i}})^2, which
keeps the router logits u small (their exponentials are what overflow in low precision) without
changing which expert wins.

Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3): no loss at all. Each expert has a
bias b_i added to its score *for the choice only* (:func:`kernels.moe.router.topk_route_ref`);
after every step

    b_i <- b_i + gamma * sign(mean(load) - load_i)

so an overloaded expert becomes harder to pick and an underloaded one easier. DeepSeek-V3 used
gamma = 0.001 for most of its pre-training.

Global statistics. Under data (or expert) parallelism each rank routes its own micro-batch. The
bias update must use the load summed over all ranks (:func:`global_load`, an all-reduce): from a
rank's own load each replica would move its bias its own way and the replicas of one model would
route the same token differently. For the auxiliary loss, Qiu et al. (2025) synchronise f_i across
the micro-batches of a global batch (``switch_aux_loss(..., load=global load)``) instead of
balancing each micro-batch, which at a few sequences per micro-batch means balancing every
sequence and keeps experts from specialising by domain.

Device-level losses (DeepSeek-V2, section 2.2.3). With the E experts split into D groups of E/D
consecutive experts, one group per device, f_j = E/(kT) * load_j and P_j as above:

    device balance:        L_dev  = sum_i f'_i P'_i,   f'_i = mean_{j in group i} f_j,  P'_i = sum_{j in group i} P_j
    communication balance: L_comm = sum_i f''_i P''_i, f''_i = D/(M T) * #tokens sent to device i,  P''_i = P'_i

Both are 1 when even; L_dev leaves experts free to be uneven inside one device (which costs that
device nothing), L_comm counts a token once per device it is sent to, however many of that device's
experts it uses. DeepSeek-V2 weighted the three losses 0.003, 0.05 and 0.02.

Sinkhorn routing (S-BASE, Clark et al. 2022; Megatron-LM's ``sinkhorn`` router type): balance the
*choice* of one batch directly. Scale exp(u) (T, E) alternately so that every token's row sums to 1
and every expert's column to T/E (Sinkhorn-Knopp), choose each token's top k of the scaled matrix,
and weigh by the unscaled softmax. It needs the whole batch, like expert choice: it is a training-time
rule (Megatron routes plain top-k at inference).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def switch_aux_loss(probs: torch.Tensor, ids: torch.Tensor, load: torch.Tensor | None = None) -> torch.Tensor:
    """E * sum_i f_i P_i for probs (T, E) (the full softmax, differentiable) and ids (T, k).

    f_i comes from this batch's ids, or from ``load`` (E,) when given: the assignments counted over
    a whole global batch (Qiu et al.'s global-batch loss; P_i stays this micro-batch's)."""
    if probs.dim() != 2 or ids.dim() != 2 or probs.shape[0] != ids.shape[0]:
        raise ValueError(f"switch_aux_loss: probs (T, E) and ids (T, k) must share T, got {tuple(probs.shape)} "
                         f"and {tuple(ids.shape)}")
    T, E = probs.shape
    k = ids.shape[1]
    if load is None:
        load = torch.bincount(ids.reshape(-1), minlength=E)
    elif load.shape != (E,):
        raise ValueError(f"switch_aux_loss: load must be (E,) = ({E},), got {tuple(load.shape)}")
    f = load.to(probs.dtype) / load.sum().to(probs.dtype)                         # (E,) dispatch fraction
    P = probs.mean(dim=0)                                                         # (E,) mean probability
    return E * (f * P).sum()


def global_load(load: torch.Tensor) -> torch.Tensor:
    """The load summed over every rank of the default process group (a copy; this rank's load
    unchanged when no group is initialised)."""
    total = load.clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """(1/T) sum_t logsumexp(u_t)^2 for router logits (T, E)."""
    if logits.dim() != 2:
        raise ValueError(f"z_loss: logits must be (T, E), got {tuple(logits.shape)}")
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """The new bias: b + rate * sign(mean(load) - load) (an expert at exactly the mean keeps its b)."""
    if bias.shape != load.shape or bias.dim() != 1:
        raise ValueError(f"bias_update: bias and load must both be (E,), got {tuple(bias.shape)} and {tuple(load.shape)}")
    if rate < 0:
        raise ValueError(f"bias_update: rate must be >= 0, got {rate}")
    load = load.to(torch.float64)
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)


def max_violation(load: torch.Tensor) -> float:
    """MaxVio = (max_i load_i - mean load) / mean load (Wang et al. 2024): 0 when perfectly balanced."""
    load = load.to(torch.float64)
    return float((load.max() - load.mean()) / load.mean())


def bias_update_worker(rank: int, world_size: int, logits: torch.Tensor, k: int, rate: float, steps: int,
                       synchronise: bool) -> torch.Tensor:
    """One data-parallel rank of a fixed sigmoid router (``kernels.dist.launch``): it routes its own
    shard of ``logits`` (T, E) for ``steps`` bias updates, from its own load or, ``synchronise``, from
    the all-reduced load. Returns its final bias (E,)."""
    from kernels.moe.router import topk_route_ref

    shard = logits.chunk(world_size)[rank]
    bias = torch.zeros(logits.shape[1])
    for _ in range(steps):
        ids = topk_route_ref(shard, k, score="sigmoid", bias=bias)[1]
        load = torch.bincount(ids.flatten(), minlength=logits.shape[1])
        bias = bias_update(bias, global_load(load) if synchronise else load, rate)
    return bias


def _group_sums(x: torch.Tensor, n_groups: int, name: str) -> torch.Tensor:
    """(..., E) -> (..., D): the sum over each group of E / D consecutive experts."""
    E = x.shape[-1]
    if n_groups < 1 or E % n_groups:
        raise ValueError(f"{name}: n_groups must divide E={E}, got {n_groups}")
    return x.reshape(*x.shape[:-1], n_groups, E // n_groups).sum(-1)


def device_balance_loss(probs: torch.Tensor, ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """DeepSeek-V2's device-level balance loss sum_i f'_i P'_i over ``n_groups`` devices (1 when even)."""
    if probs.dim() != 2 or ids.dim() != 2 or probs.shape[0] != ids.shape[0]:
        raise ValueError(f"device_balance_loss: probs (T, E) and ids (T, k) must share T, got "
                         f"{tuple(probs.shape)} and {tuple(ids.shape)}")
    T, E = probs.shape
    k = ids.shape[1]
    f = torch.bincount(ids.reshape(-1), minlength=E).to(probs.dtype) * E / (k * T)   # (E,) 1 when even
    f_dev = _group_sums(f, n_groups, "device_balance_loss") / (E // n_groups)           # (D,) mean over the group
    P_dev = _group_sums(probs.mean(dim=0), n_groups, "device_balance_loss")             # (D,)
    return (f_dev * P_dev).sum()


def comm_balance_loss(probs: torch.Tensor, ids: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V2's communication balance loss sum_i f''_i P''_i: f''_i counts the tokens sent to
    device i (once per token, whatever the number of its experts there), scaled by D / (M T)."""
    if probs.dim() != 2 or ids.dim() != 2 or probs.shape[0] != ids.shape[0]:
        raise ValueError(f"comm_balance_loss: probs (T, E) and ids (T, k) must share T, got "
                         f"{tuple(probs.shape)} and {tuple(ids.shape)}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"comm_balance_loss: topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    T, E = probs.shape
    hits = torch.zeros(T, E, dtype=probs.dtype, device=probs.device).scatter_(1, ids, 1.0)   # (T, E)
    sent = (_group_sums(hits, n_groups, "comm_balance_loss") > 0).to(probs.dtype)             # (T, D)
    f = sent.sum(0) * n_groups / (topk_groups * T)                                            # (D,)
    return (f * _group_sums(probs.mean(dim=0), n_groups, "comm_balance_loss")).sum()


def sinkhorn_plan(logits: torch.Tensor, *, iters: int = 200, tol: float = 1e-6) -> torch.Tensor:
    """The balanced plan (T, E) fp64: exp(u) scaled so that rows sum to 1 and columns to T / E."""
    if logits.dim() != 2:
        raise ValueError(f"sinkhorn_plan: logits must be (T, E), got {tuple(logits.shape)}")
    T, E = logits.shape
    u = logits.double()
    plan = torch.exp(u - u.max(dim=-1, keepdim=True).values)           # (T, E), rows' maxima at 1
    for _ in range(iters):
        plan = plan / plan.sum(dim=1, keepdim=True)                    # every token: mass 1
        cols = plan.sum(dim=0)                                          # (E,) each expert's mass
        plan = plan * (T / E) / cols                                    # every expert: mass T / E
        if float((plan.sum(dim=1) - 1).abs().max()) < tol:
            break
    return plan


def sinkhorn_route_ref(logits: torch.Tensor, k: int, **plan_options) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (T, k) fp32 and ids (T, k): the top k of :func:`sinkhorn_plan`, weighted by the
    renormalised softmax of the unscaled logits (the plan decides which experts, not how much)."""
    from kernels.moe.router import _stable_topk

    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"sinkhorn_route_ref: k must be in [1, E={logits.shape[-1]}], got {k}")
    ids = _stable_topk(sinkhorn_plan(logits, **plan_options), k)
    w = torch.softmax(logits.double(), dim=-1).gather(1, ids)
    return (w / w.sum(dim=-1, keepdim=True)).float(), ids
