"""The alpha-beta (latency-bandwidth) model of a collective, and its fit to measured timings.

One message of n bytes over one link costs  t = alpha + n * beta : alpha the fixed cost of a
message (software, synchronisation, wire latency), beta = 1 / bandwidth the cost per byte. A
collective that runs ``steps`` dependent message rounds and sends ``n_sent`` bytes per rank on its
critical path costs about  steps * alpha + n_sent * beta  (Hockney's model; Thakur, Rabenseifner
and Gropp derive the collectives' terms in it). For p ranks and an n-byte buffer:

  ring all-reduce        2 (p - 1) alpha + 2 (p - 1)/p * n beta
  tree all-reduce        2 ceil(log2 p) (alpha + n beta)      (binomial tree, whole messages)
  ring all-gather        (p - 1) alpha + (p - 1)/p * N beta   (N the gathered bytes)
  ring reduce-scatter    (p - 1) alpha + (p - 1)/p * n beta

Pure arithmetic: nothing here starts a process.
"""
from __future__ import annotations

import math

import torch


def _check_p(p: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int (ranks), got {p!r}")


def ring_all_reduce_terms(n_bytes: float, p: int) -> tuple[int, float]:
    """(steps, bytes per rank): 2 (p - 1) rounds, 2 (p - 1)/p * n bytes."""
    _check_p(p)
    return 2 * (p - 1), 2 * (p - 1) / p * n_bytes


def tree_all_reduce_terms(n_bytes: float, p: int) -> tuple[int, float]:
    """(steps, bytes on the critical path): 2 ceil(log2 p) rounds of whole n-byte messages."""
    _check_p(p)
    steps = 2 * math.ceil(math.log2(p)) if p > 1 else 0
    return steps, steps * n_bytes


def all_gather_terms(out_bytes: float, p: int) -> tuple[int, float]:
    """(steps, bytes per rank) of the ring all-gather of an N-byte result: p - 1, (p - 1)/p * N."""
    _check_p(p)
    return p - 1, (p - 1) / p * out_bytes


def reduce_scatter_terms(n_bytes: float, p: int) -> tuple[int, float]:
    """(steps, bytes per rank) of the ring reduce-scatter of an n-byte input: p - 1, (p - 1)/p * n."""
    return all_gather_terms(n_bytes, p)


TERMS = {"ring": ring_all_reduce_terms, "tree": tree_all_reduce_terms,
         "all_gather": all_gather_terms, "reduce_scatter": reduce_scatter_terms}


def predict(algo: str, n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds: steps * alpha + bytes * beta for ``algo`` in TERMS."""
    if algo not in TERMS:
        raise ValueError(f"predict: algo must be one of {sorted(TERMS)}, got {algo!r}")
    steps, sent = TERMS[algo](n_bytes, p)
    return steps * alpha + sent * beta


def fit_alpha_beta(steps, sent_bytes, seconds) -> tuple[float, float]:
    """Least-squares alpha, beta >= 0 of  seconds ~ steps * alpha + sent_bytes * beta, the error
    RELATIVE to each time (small messages weigh as much as large ones). A parameter the free fit
    makes negative is pinned at 0 and the other refitted."""
    a = torch.tensor([list(steps), list(sent_bytes)], dtype=torch.float64).T       # (m, 2)
    t = torch.tensor(list(seconds), dtype=torch.float64)                          # (m,)
    if a.shape[0] != t.shape[0] or a.shape[0] < 2:
        raise ValueError(f"fit_alpha_beta: need >= 2 points of equal counts, got {a.shape[0]} and {t.shape[0]}")
    if bool((t <= 0).any()):
        raise ValueError("fit_alpha_beta: seconds must be positive")
    w = a / t[:, None]                                                             # rows scaled by 1/t
    one = torch.ones_like(t)
    coef = torch.linalg.lstsq(w, one[:, None]).solution[:, 0]
    if bool((coef < 0).any()):
        keep = int(coef.argmax())
        col = w[:, keep]
        coef = torch.zeros(2, dtype=torch.float64)
        coef[keep] = (col @ one) / (col @ col)
    return float(coef[0]), float(coef[1])


def crossover_bytes(p: int, alpha: float, beta: float) -> float:
    """Message size below which the binomial tree all-reduce beats the ring (0: never; inf: always):
    2 L (alpha + n beta) = 2 (p - 1) alpha + 2 (p - 1)/p n beta,  L = ceil(log2 p)."""
    _check_p(p)
    L = math.ceil(math.log2(p)) if p > 1 else 0
    slope = 2 * L - 2 * (p - 1) / p                                   # beta coefficient, tree minus ring
    gain = 2 * (p - 1) - 2 * L                                        # alpha coefficient, ring minus tree
    if slope <= 0:
        return math.inf
    return gain * alpha / (slope * beta) if beta > 0 else math.inf


def predict_system(system, algo: str, n_bytes: float, with_base: bool = True) -> float:
    """Seconds for ``algo`` over a :class:`kernels.gpu.interconnect.System`: its GPU count as p, the
    per-step latency of its slowest hop as alpha, its time per byte sent (one link's, or the rails'
    split between NICs and NVLink) as beta, plus NCCL's fixed base latency of a call when ``with_base``."""
    from kernels.gpu.interconnect import NCCL_BASE_US
    base = NCCL_BASE_US * 1e-6 if with_base else 0.0
    return base + predict(algo, n_bytes, system.gpus, system.alpha_s, system.beta_s_per_byte)


def bus_bandwidth_gbs(algo_bandwidth_gbs: float, p: int, collective: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth: algorithm bandwidth (bytes / time) times 2 (p - 1)/p for an
    all-reduce, (p - 1)/p for all-gather and reduce-scatter: comparable with the link's speed."""
    factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}
    if collective not in factor:
        raise ValueError(f"bus_bandwidth_gbs: collective must be one of {sorted(factor)}, got {collective!r}")
    return algo_bandwidth_gbs * factor[collective]


def all_to_all_seconds(sent_bytes: float, p: int, node_gpus: int, intra_gbs: float, inter_gbs: float) -> float:
    """Bandwidth-only seconds of an all-to-all in which each of p ranks sends ``sent_bytes`` in
    equal pieces to its p - 1 peers, the ranks filling nodes of ``node_gpus`` GPUs.

    Of the p - 1 pieces, node_gpus - 1 stay in the node (``intra_gbs``, NVLink) and p - node_gpus
    leave it; every GPU of a node sends that share at once, so the node's NICs carry node_gpus
    GPUs' remote bytes and each GPU's share crosses one NIC of ``inter_gbs`` whatever NVLink hop
    (PXN) routes it there. The two legs run concurrently, so the slower sets the time:

        t = max( (g - 1)/(p - 1) * sent / B_intra ,  (p - g)/(p - 1) * sent / B_inter ),  g = min(node_gpus, p).
    """
    _check_p(p)
    if not isinstance(node_gpus, int) or node_gpus < 1:
        raise ValueError(f"all_to_all_seconds: node_gpus must be a positive int, got {node_gpus!r}")
    if p > node_gpus and p % node_gpus:
        raise ValueError(f"all_to_all_seconds: p = {p} ranks do not fill whole nodes of {node_gpus} GPUs")
    if min(intra_gbs, inter_gbs) <= 0:
        raise ValueError(f"all_to_all_seconds: bandwidths must be positive, got {intra_gbs}, {inter_gbs}")
    if p == 1:
        return 0.0
    g = min(node_gpus, p)
    local = (g - 1) / (p - 1) * sent_bytes / (intra_gbs * 1e9)
    remote = (p - g) / (p - 1) * sent_bytes / (inter_gbs * 1e9)
    return max(local, remote)
