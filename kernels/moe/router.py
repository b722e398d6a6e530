"""Top-k routing: which experts a token goes to, with what weight, and which tokens a capacity drops.

Shapes: T tokens, C model width, E experts, k experts per token.

A router is one linear layer, logits u = x W_r^T (T, E). Two scoring rules are in use:

* softmax (Shazeer et al. 2017, GShard, Switch, Mixtral): p = softmax(u) over the E experts, keep
  the k largest; Mixtral renormalises the k kept weights to sum to 1, which is the same as a
  softmax over the k kept logits, softmax(topk(u));
* sigmoid with a selection bias (DeepSeek-V3): s = sigmoid(u) per expert, choose the top k of
  s + b (b is the load-balancing bias, :mod:`kernels.moe.balance`), weight by s / sum of the chosen
  s. The bias decides *which* experts, never *how much* each contributes. DeepSeek-V3 then multiplies
  the k weights by a constant ``route_scale`` (2.5 in its released configuration), so that its routed
  experts add up to 2.5 times the weight of its always-on shared expert.

Capacity (GShard, Switch): an expert holds at most ``capacity = ceil(capacity_factor * k * T / E)``
tokens; assignments past it are dropped (the token's residual connection carries it through).
Who is kept is decided in priority order: every token's first choice before any second choice,
and within one choice rank, earlier tokens first (GShard's rule for top-2). GShard also thins the
second choices at random before the capacity: ``gshard_second_keep`` keeps token t's second expert
with probability min(1, w_2 / threshold), threshold 0.2 (Mesh TensorFlow's "random" policy).

Two older rules are kept as references: Shazeer et al.'s *noisy* top-k (``noisy_topk_ref``, learned
Gaussian noise on the logits before the choice) and expert-choice routing (``expert_choice_ref``,
Zhou et al. 2022: the experts pick tokens, so loads are even by construction).

``topk_route`` is a Triton kernel that does the softmax and the top-k of a block of tokens in one
pass (``topk_route_ref`` is the PyTorch reference): the logits are read once and only (T, k)
weights and indices are written, instead of the (T, E) probabilities.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

SCORES = ("softmax", "sigmoid")


# ----------------------------------------------------------------------------------------------
# References (PyTorch)


def topk_route_ref(logits: torch.Tensor, k: int, *, score: str = "softmax", normalize: bool = True,
                   bias: torch.Tensor | None = None, route_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (T, k) fp32 (fp64 kept) and expert ids (T, k) int64 of the k experts each token goes to.

    softmax: p = softmax(u); keep the k largest p; ``normalize`` divides them by their sum.
    sigmoid: s = sigmoid(u); choose the k largest s + bias; weights s / sum(chosen s).
    Then every weight is multiplied by ``route_scale`` (DeepSeek-V3: 2.5).
    Ties go to the lower expert id (torch.topk on the CPU and the kernel agree on this)."""
    _check_route_args("topk_route_ref", logits, k, score, bias, route_scale)
    u = logits if logits.dtype == torch.float64 else logits.float()
    scores = torch.softmax(u, dim=-1) if score == "softmax" else torch.sigmoid(u)   # (T, E)
    choose = scores if bias is None else scores + bias.to(u.dtype)                       # bias: selection only
    ids = _stable_topk(choose, k)                                                    # (T, k)
    weights = scores.gather(1, ids)                                                  # unbiased scores
    if normalize or score == "sigmoid":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, ids


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, larger first, ties to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :k]


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ceil(capacity_factor * k * T / E) (Switch eq. 3, times k slots)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity: capacity_factor must be positive, got {capacity_factor}")
    return math.ceil(capacity_factor * k * num_tokens / num_experts)


def keep_mask(expert_ids: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """(T, k) bool: which assignments fit in their expert's ``cap`` slots.

    Priority: choice rank first (all first choices, then all second choices ...), token order
    second. An assignment's slot is the number of assignments to the same expert ahead of it."""
    T, k = expert_ids.shape
    order = expert_ids.t().reshape(-1)                                  # (k*T,) choice-major priority
    onehot = torch.nn.functional.one_hot(order, num_experts)            # (k*T, E)
    slot = (onehot.cumsum(0) - 1).gather(1, order[:, None])[:, 0]       # 0-based position in its expert
    return (slot < cap).view(k, T).t()


def tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many assignments each expert receives (its load)."""
    return torch.bincount(expert_ids.reshape(-1), minlength=num_experts)


def dropped_fraction(expert_ids: torch.Tensor, num_experts: int, capacity_factor: float) -> float:
    """Fraction of the T*k assignments that do not fit at ``capacity_factor``."""
    cap = capacity(expert_ids.shape[0], num_experts, expert_ids.shape[1], capacity_factor)
    return 1.0 - float(keep_mask(expert_ids, num_experts, cap).float().mean())


def gshard_second_keep(weights: torch.Tensor, threshold: float = 0.2,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """(T, 2) bool: GShard's random routing of the second expert. The first choice is always kept;
    the second with probability min(1, w_2 / threshold), w_2 its weight after renormalising the two
    (Mesh TensorFlow's ``moe_second_policy="random"``, threshold 0.2). A token whose second expert
    matters little is then usually sent to one expert only, which saves capacity."""
    if weights.dim() != 2 or weights.shape[1] != 2:
        raise ValueError(f"gshard_second_keep: weights must be (T, 2) top-2 weights, got {tuple(weights.shape)}")
    if threshold <= 0:
        raise ValueError(f"gshard_second_keep: threshold must be positive, got {threshold}")
    w2 = weights[:, 1] / weights.sum(dim=-1)                                # renormalised second weight
    u = torch.rand(weights.shape[0], generator=generator, dtype=torch.float64, device=weights.device)
    return torch.stack([torch.ones_like(w2, dtype=torch.bool), u < w2.double() / threshold], dim=1)


def noisy_topk_ref(clean_logits: torch.Tensor, noise_logits: torch.Tensor, k: int, *,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shazeer et al.'s noisy top-k gating (2017, eqs. 3-5): weights (T, k) fp32 and ids (T, k).

    H = u + n * softplus(v), n ~ N(0, 1) per token and expert, with u = x W_g (``clean_logits``) and
    v = x W_noise (``noise_logits``, learned: how much noise each expert's score gets); the k largest
    H are kept and softmaxed, the others get weight 0. The noise lets an expert that would never win
    receive some tokens (and so some gradient) while the router is young."""
    _check_route_args("noisy_topk_ref", clean_logits, k, "softmax", None)
    if noise_logits.shape != clean_logits.shape:
        raise ValueError(f"noisy_topk_ref: noise_logits must have the shape of clean_logits "
                         f"{tuple(clean_logits.shape)}, got {tuple(noise_logits.shape)}")
    u = clean_logits.double()
    n = torch.randn(u.shape, generator=generator, dtype=torch.float64, device=u.device)
    h = u + n * torch.nn.functional.softplus(noise_logits.double())                   # (T, E) noisy logits
    ids = _stable_topk(h, k)                                                            # (T, k)
    return torch.softmax(h.gather(1, ids), dim=-1).float(), ids


def expert_choice_ref(logits: torch.Tensor, per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-choice routing (Zhou et al. 2022): every expert picks its ``per_expert`` tokens.

    S = softmax(u) over the experts (T, E); expert e takes the ``per_expert`` tokens with the largest
    S[:, e] (ties to the lower token index). Returns gates (E, c) fp32 = those S values and token ids
    (E, c) int64. Every expert's load is exactly c by construction; a token may be picked by several
    experts or by none, and whether it is picked depends on the other tokens of the batch."""
    _check_route_args("expert_choice_ref", logits, 1, "softmax", None)
    T = logits.shape[0]
    if not 1 <= per_expert <= T:
        raise ValueError(f"expert_choice_ref: per_expert must be in [1, T={T}], got {per_expert}")
    scores = torch.softmax(logits.double(), dim=-1).t()                                # (E, T)
    ids = _stable_topk(scores, per_expert)                                              # (E, c)
    return scores.gather(1, ids).float(), ids


def _check_route_args(name: str, logits, k, score, bias, route_scale: float = 1.0) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{name}: logits must be a (T, E) tensor, got {getattr(logits, 'shape', type(logits))}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"{name}: logits must be floating point, got {logits.dtype}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"{name}: k must be in [1, E={logits.shape[1]}], got {k}")
    if score not in SCORES:
        raise ValueError(f"{name}: score must be one of {SCORES}, got {score!r}")
    if bias is not None and (bias.shape != (logits.shape[1],)):
        raise ValueError(f"{name}: bias must have shape (E,) = ({logits.shape[1]},), got {tuple(bias.shape)}")
    if not route_scale > 0:
        raise ValueError(f"{name}: route_scale must be positive, got {route_scale}")


# ----------------------------------------------------------------------------------------------
# The kernel: softmax or sigmoid, then k rounds of argmax, one program per block of tokens


@triton.jit
def _topk_route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    T, E, stride_t, stride_e, route_scale,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, MASK_PAD: tl.constexpr = True,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                    # (BLOCK_T,)
    cols = tl.arange(0, BLOCK_E)                                                  # (BLOCK_E,)
    inside = (rows[:, None] < T) & (cols[None, :] < E)
    offs = rows.to(tl.int64)[:, None] * stride_t + cols[None, :] * stride_e      # int64: T*E may pass 2**31
    u = tl.load(logits_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        p = tl.sigmoid(u)                                                         # s = 1 / (1 + e^-u)
    else:
        m = tl.max(u, axis=1)                                                     # p = e^(u - m) / sum e^(u - m)
        e = tl.exp(u - m[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(inside, p, 0.0)
    choose = p
    if HAS_BIAS:
        choose = p + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    if MASK_PAD:                                                                  # padding columns never win
        choose = tl.where(cols[None, :] < E, choose, float("-inf"))
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(K):                                                  # k rounds: take the max, remove it
        best = tl.max(choose, axis=1)                                             # (BLOCK_T,)
        is_best = choose == best[:, None]
        idx = tl.min(tl.where(is_best, cols[None, :], BLOCK_E), axis=1)           # ties: lowest expert id
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, p, 0.0), axis=1)                                 # the unbiased score
        total += w
        tl.store(w_ptr + rows.to(tl.int64) * K + j, w * route_scale, mask=rows < T)
        tl.store(ids_ptr + rows.to(tl.int64) * K + j, idx.to(tl.int64), mask=rows < T)
        choose = tl.where(hit, float("-inf"), choose)
    if NORMALIZE:                                                                 # scale * w_j / sum of the k kept
        for j in tl.static_range(K):
            ptr = w_ptr + rows.to(tl.int64) * K + j
            tl.store(ptr, tl.load(ptr, mask=rows < T, other=1.0) / total, mask=rows < T)


MAX_EXPERTS = 512   # one row of logits lives in registers: BLOCK_T * BLOCK_E fp32 values per program


def route_block_t(num_experts: int) -> int:
    """Tokens per program: at most 2048 logits a program (16 per thread at 4 warps) and at most 32
    tokens, so that a 4096-token batch starts at least 128 programs (an H100 has 132 SMs) even
    with Mixtral's 8 experts; at least one token."""
    return max(1, min(32, 2048 // triton.next_power_of_2(num_experts)))


def topk_route(logits: torch.Tensor, k: int, *, score: str = "softmax", normalize: bool = True,
               bias: torch.Tensor | None = None, route_scale: float = 1.0,
               block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel version of :func:`topk_route_ref`: weights (T, k) fp32, ids (T, k) int64."""
    _check_route_args("topk_route", logits, k, score, bias, route_scale)
    T, E = logits.shape
    if E > MAX_EXPERTS:
        raise ValueError(f"topk_route: at most {MAX_EXPERTS} experts (a row is held in registers), got E={E}")
    if k > 16:
        raise ValueError(f"topk_route: k must be at most 16 (the rounds are unrolled), got {k}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"topk_route: logits must be fp16, bf16 or fp32, got {logits.dtype}")
    return _launch(logits, k, score, normalize or score == "sigmoid", bias, block_t or route_block_t(E),
                   route_scale=route_scale)


def _launch_args(logits, bias, weights, ids, k, score, normalize, block_t, *, route_scale: float = 1.0,
                 mask_pad: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_topk_route_kernel`, for :func:`topk_route` and
    for :func:`compile_jobs` alike (``bias`` None: the weights buffer stands in, never read)."""
    T, E = logits.shape
    args = (logits, bias if bias is not None else weights, weights, ids, T, E, logits.stride(0), logits.stride(1),
            float(route_scale))
    kwargs = dict(K=k, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(E), SIGMOID=score == "sigmoid",
                  HAS_BIAS=bias is not None, NORMALIZE=normalize, MASK_PAD=mask_pad, num_warps=4)
    return (triton.cdiv(T, block_t),), args, kwargs


def _launch(logits, k, score, normalize, bias, block_t, *, route_scale: float = 1.0, mask_pad: bool = True):
    """Allocate and launch; ``mask_pad=False`` is the broken variant that lets the padding columns
    of a non-power-of-two expert count compete (with sigmoid scores and a negative bias they win)."""
    T, _ = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    bias = bias.float().contiguous() if bias is not None else None
    grid, args, kwargs = _launch_args(logits, bias, weights, ids, k, score, normalize, block_t,
                                      route_scale=route_scale, mask_pad=mask_pad)
    _topk_route_kernel[grid](*args, **kwargs)
    return weights, ids


# (E, k, score, route_scale) of real routers, from their released configurations: Mixtral 8x7B
# (8 experts, top-2, softmax) and DeepSeek-V3 (256 experts, top-8, sigmoid with the balancing bias,
# weights times 2.5). Group-limited routing (DeepSeek-V3's 4 of 8 groups) is kernels.moe.group_route.
REAL_ROUTERS = {"Mixtral 8x7B": (8, 2, "softmax", 1.0), "DeepSeek-V3": (256, 8, "sigmoid", 2.5)}


def launch_job(name: str, num_tokens: int, dtype: torch.dtype = torch.bfloat16):
    """The AOT job of :func:`topk_route` on ``num_tokens`` router logits of a real router (meta tensors)."""
    from kernels import inspect as ki

    E, k, score, scale = REAL_ROUTERS[name]
    logits = torch.empty(num_tokens, E, dtype=dtype, device="meta")
    bias = torch.empty(E, dtype=torch.float32, device="meta") if score == "sigmoid" else None
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device="meta")
    ids = torch.empty(num_tokens, k, dtype=torch.int64, device="meta")
    grid, args, kwargs = _launch_args(logits, bias, weights, ids, k, score, True, route_block_t(E), route_scale=scale)
    return ki.launch_job(_topk_route_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The router kernel of Mixtral 8x7B and DeepSeek-V3 on a 4096-token batch of bf16 logits."""
    return {f"topk_route {name} (E={E}, k={k}, {score}), 4096 tokens": launch_job(name, 4096)
            for name, (E, k, score, _) in REAL_ROUTERS.items()}
