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
"""
from __future__ import annotations

import torch


def switch_aux_loss(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i P_i for probs (T, E) (the full softmax, differentiable) and ids (T, k)."""
    if probs.dim() != 2 or ids.dim() != 2 or probs.shape[0] != ids.shape[0]:
        raise ValueError(f"switch_aux_loss: probs (T, E) and ids (T, k) must share T, got {tuple(probs.shape)} "
                         f"and {tuple(ids.shape)}")
    T, E = probs.shape
    k = ids.shape[1]
    f = torch.bincount(ids.reshape(-1), minlength=E).to(probs.dtype) / (k * T)   # (E,) dispatch fraction
    P = probs.mean(dim=0)                                                         # (E,) mean probability
    return E * (f * P).sum()


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
