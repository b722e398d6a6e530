"""Device-limited routing: a token picks M of G expert groups first, then its top k experts inside them.

Shapes: T tokens, E experts in G groups of E/G consecutive experts (group j holds experts
j E/G ... (j+1) E/G - 1, the experts one device or node holds), k experts per token, M groups allowed.

With c = the choice scores (softmax or sigmoid scores, plus the balancing bias if there is one):

    g_j     = max_{i in group j} c_i                   ("max": DeepSeek-V2, and V3's code without a bias)
            or the sum of the 2 largest c_i in j       ("top2": DeepSeek-V3 with its bias)
    allowed = the M groups of largest g_j              (ties to the lower group)
    ids     = the k largest c_i over the experts of the allowed groups
    weights = the unbiased scores of ids, renormalised and scaled as in :func:`kernels.moe.router.topk_route_ref`

DeepSeek-V2 limits each token to M = 3 of 8 device groups for its 6 of 160 routed experts;
DeepSeek-V3 to 4 of 8 node groups for its 8 of 256 (released configurations ``n_limited_groups``).
The bound it buys: a token's k expert copies land on at most M devices (or nodes), so the
all-to-all sends at most M copies of each token instead of up to min(k, G): see
:func:`expected_groups`, the mean number of groups an unrestricted top-k routing touches.

``group_limited_route`` is a Triton kernel (one program per block of tokens, like ``topk_route``):
the group scores, the M group rounds and the k expert rounds all run on one block of scores held in
registers; ``group_limited_route_ref`` is the PyTorch reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.moe.router import _check_route_args, _stable_topk, route_block_t

GROUP_SCORES = ("max", "top2")
MAX_EXPERTS = 512
MAX_GROUPS = 16


# ----------------------------------------------------------------------------------------------
# Reference (PyTorch)


def group_limited_route_ref(logits: torch.Tensor, k: int, n_groups: int, topk_groups: int, *,
                            score: str = "softmax", bias: torch.Tensor | None = None, group_score: str = "max",
                            normalize: bool = True, route_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (T, k) fp32 (fp64 kept) and expert ids (T, k) int64, each token's experts confined to
    ``topk_groups`` of the ``n_groups`` groups."""
    _check_group_args("group_limited_route_ref", logits, k, n_groups, topk_groups, score, bias, group_score, route_scale)
    T, E = logits.shape
    u = logits if logits.dtype == torch.float64 else logits.float()
    scores = torch.softmax(u, dim=-1) if score == "softmax" else torch.sigmoid(u)        # (T, E)
    choose = scores if bias is None else scores + bias.to(u.dtype)                      # (T, E)
    per_group = choose.view(T, n_groups, E // n_groups)                                 # (T, G, E/G)
    if group_score == "max":
        g = per_group.max(dim=-1).values                                                # (T, G)
    else:
        g = per_group.topk(2, dim=-1).values.sum(dim=-1)                                # (T, G)
    allowed = torch.zeros(T, n_groups, dtype=torch.bool, device=logits.device)
    allowed.scatter_(1, _stable_topk(g, topk_groups), True)                             # (T, G)
    choose = choose.masked_fill(~allowed.repeat_interleave(E // n_groups, dim=1), float("-inf"))
    ids = _stable_topk(choose, k)                                                       # (T, k)
    weights = scores.gather(1, ids)
    if normalize or score == "sigmoid":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, ids


def groups_per_token(ids: torch.Tensor, n_experts: int, n_groups: int) -> torch.Tensor:
    """(T,) int64: how many distinct groups (devices, nodes) each token's k experts live on."""
    if n_experts % n_groups:
        raise ValueError(f"groups_per_token: n_experts={n_experts} must be divisible by n_groups={n_groups}")
    groups = ids // (n_experts // n_groups)                                             # (T, k)
    hit = torch.zeros(ids.shape[0], n_groups, dtype=torch.bool, device=ids.device)
    return hit.scatter_(1, groups, True).sum(dim=1)


def expected_groups(n_experts: int, n_groups: int, k: int) -> float:
    """Mean number of distinct groups k experts drawn uniformly without replacement touch:
    G (1 - C(E - E/G, k) / C(E, k)), the traffic of an unrestricted router that spreads evenly."""
    per = n_experts // n_groups
    return n_groups * (1 - math.comb(n_experts - per, k) / math.comb(n_experts, k))


def groups_distribution(n_experts: int, n_groups: int, k: int) -> list[float]:
    """P(k experts drawn uniformly without replacement touch exactly j groups), j = 0..G: choose the j
    groups, then count the k-subsets of their j E/G experts that leave none of them empty
    (inclusion-exclusion over the groups left empty)."""
    if n_experts % n_groups or not 1 <= k <= n_experts:
        raise ValueError(f"groups_distribution: need n_groups | n_experts and 1 <= k <= n_experts, "
                         f"got E={n_experts}, G={n_groups}, k={k}")
    per, total = n_experts // n_groups, math.comb(n_experts, k)
    onto = lambda j: sum((-1) ** i * math.comb(j, i) * math.comb((j - i) * per, k) for i in range(j + 1))  # noqa: E731
    return [math.comb(n_groups, j) * onto(j) / total for j in range(n_groups + 1)]


def _check_group_args(name, logits, k, n_groups, topk_groups, score, bias, group_score, route_scale) -> None:
    _check_route_args(name, logits, k, score, bias, route_scale)
    E = logits.shape[1]
    if n_groups < 1 or E % n_groups:
        raise ValueError(f"{name}: n_groups must divide the E={E} experts, got {n_groups}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"{name}: topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    if k > topk_groups * (E // n_groups):
        raise ValueError(f"{name}: k={k} experts do not fit in topk_groups={topk_groups} groups of {E // n_groups}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"{name}: group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if group_score == "top2" and E // n_groups < 2:
        raise ValueError(f"{name}: group_score='top2' needs at least 2 experts per group, got {E // n_groups}")


# ----------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _group_route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    T, E, stride_t, stride_e, group_size, route_scale,
    K: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, TOP2: tl.constexpr,
    LIMIT: tl.constexpr = True,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                    # (BLOCK_T,)
    cols = tl.arange(0, BLOCK_E)                                                  # (BLOCK_E,) experts
    gcols = tl.arange(0, BLOCK_G)                                                 # (BLOCK_G,) groups
    inside = (rows[:, None] < T) & (cols[None, :] < E)
    offs = rows.to(tl.int64)[:, None] * stride_t + cols[None, :] * stride_e      # int64: T*E may pass 2**31
    u = tl.load(logits_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        p = tl.sigmoid(u)
    else:
        m = tl.max(u, axis=1)
        e = tl.exp(u - m[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(inside, p, 0.0)
    choose = p
    if HAS_BIAS:
        choose = p + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    choose = tl.where(cols[None, :] < E, choose, float("-inf"))                   # padding never wins
    group = cols // group_size                                                    # (BLOCK_E,) padding: group >= G
    # group scores g_j: the max (or the sum of the two largest) choice score in each group
    gscore = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
    for j in tl.static_range(G):
        c_j = tl.where(group[None, :] == j, choose, float("-inf"))                # (BLOCK_T, BLOCK_E)
        best = tl.max(c_j, axis=1)
        if TOP2:
            first = tl.min(tl.where(c_j == best[:, None], cols[None, :], BLOCK_E), axis=1)
            best += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), c_j), axis=1)
        gscore = tl.where(gcols[None, :] == j, best[:, None], gscore)
    # M rounds of arg-max over the groups
    allowed = tl.zeros((BLOCK_T, BLOCK_G), dtype=tl.int32)
    for _ in tl.static_range(M):
        top = tl.max(gscore, axis=1)
        gidx = tl.min(tl.where(gscore == top[:, None], gcols[None, :], BLOCK_G), axis=1)
        hit = gcols[None, :] == gidx[:, None]
        allowed = tl.where(hit, 1, allowed)
        gscore = tl.where(hit, float("-inf"), gscore)
    if LIMIT:                                                                     # experts outside them never win
        ok = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
        for j in tl.static_range(G):
            a_j = tl.max(tl.where(gcols[None, :] == j, allowed, 0), axis=1)       # (BLOCK_T,) 1 if group j allowed
            ok = tl.where((group[None, :] == j) & (a_j[:, None] > 0), 1, ok)
        choose = tl.where(ok > 0, choose, float("-inf"))
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(K):                                                  # k rounds, as in topk_route
        best = tl.max(choose, axis=1)
        idx = tl.min(tl.where(choose == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, p, 0.0), axis=1)                                 # the unbiased score
        total += w
        tl.store(w_ptr + rows.to(tl.int64) * K + j, w * route_scale, mask=rows < T)
        tl.store(ids_ptr + rows.to(tl.int64) * K + j, idx.to(tl.int64), mask=rows < T)
        choose = tl.where(hit, float("-inf"), choose)
    if NORMALIZE:
        for j in tl.static_range(K):
            ptr = w_ptr + rows.to(tl.int64) * K + j
            tl.store(ptr, tl.load(ptr, mask=rows < T, other=1.0) / total, mask=rows < T)


def group_limited_route(logits: torch.Tensor, k: int, n_groups: int, topk_groups: int, *,
                        score: str = "softmax", bias: torch.Tensor | None = None, group_score: str = "max",
                        normalize: bool = True, route_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel version of :func:`group_limited_route_ref`: weights (T, k) fp32, ids (T, k) int64."""
    _check_group_args("group_limited_route", logits, k, n_groups, topk_groups, score, bias, group_score, route_scale)
    E = logits.shape[1]
    if E > MAX_EXPERTS or n_groups > MAX_GROUPS or k > 16:
        raise ValueError(f"group_limited_route: at most {MAX_EXPERTS} experts, {MAX_GROUPS} groups and k = 16 "
                         f"(rows and rounds live in registers), got E={E}, n_groups={n_groups}, k={k}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"group_limited_route: logits must be fp16, bf16 or fp32, got {logits.dtype}")
    return _launch(logits, k, n_groups, topk_groups, score, bias, group_score, normalize or score == "sigmoid",
                   route_scale)


def _launch_args(logits, bias, weights, ids, k, n_groups, topk_groups, score, group_score, normalize, route_scale,
                 *, limit: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_group_route_kernel`, for the launcher and
    :func:`compile_jobs` alike (``bias`` None: the weights buffer stands in, never read)."""
    T, E = logits.shape
    block_t = route_block_t(E)
    args = (logits, bias if bias is not None else weights, weights, ids, T, E, logits.stride(0), logits.stride(1),
            E // n_groups, float(route_scale))
    kwargs = dict(K=k, G=n_groups, M=topk_groups, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(E),
                  BLOCK_G=max(2, triton.next_power_of_2(n_groups)), SIGMOID=score == "sigmoid",
                  HAS_BIAS=bias is not None, NORMALIZE=normalize, TOP2=group_score == "top2", LIMIT=limit,
                  num_warps=4)
    return (triton.cdiv(T, block_t),), args, kwargs


def _launch(logits, k, n_groups, topk_groups, score, bias, group_score, normalize, route_scale, *,
            limit: bool = True):
    """Allocate and launch; ``limit=False`` is the broken variant that computes the allowed groups
    and then forgets to mask the other groups' experts (a plain top-k, over any number of devices)."""
    T, _ = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    bias = bias.float().contiguous() if bias is not None else None
    grid, args, kwargs = _launch_args(logits, bias, weights, ids, k, n_groups, topk_groups, score, group_score,
                                      normalize, route_scale, limit=limit)
    _group_route_kernel[grid](*args, **kwargs)
    return weights, ids


# Released configurations (deepseek-ai/DeepSeek-V3 inference/configs): (E, k, groups, allowed groups,
# score, group score, normalize, route_scale). V2 (config_236B): softmax, no bias, weights not
# renormalised, times 16; V3 (config_671B): sigmoid with the bias, top-2 group sums, times 2.5.
REAL_ROUTERS = {
    "DeepSeek-V2": (160, 6, 8, 3, "softmax", "max", False, 16.0),
    "DeepSeek-V3": (256, 8, 8, 4, "sigmoid", "top2", True, 2.5),
}


def launch_job(name: str, num_tokens: int, dtype: torch.dtype = torch.bfloat16):
    """The AOT job of :func:`group_limited_route` for a real router on ``num_tokens`` tokens (meta tensors)."""
    from kernels import inspect as ki

    E, k, G, M, score, group_score, normalize, scale = REAL_ROUTERS[name]
    logits = torch.empty(num_tokens, E, dtype=dtype, device="meta")
    bias = torch.empty(E, dtype=torch.float32, device="meta") if score == "sigmoid" else None
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device="meta")
    ids = torch.empty(num_tokens, k, dtype=torch.int64, device="meta")
    grid, args, kwargs = _launch_args(logits, bias, weights, ids, k, G, M, score, group_score,
                                      normalize or score == "sigmoid", scale)
    return ki.launch_job(_group_route_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """DeepSeek-V2's and V3's group-limited routers on a 4096-token batch of bf16 logits."""
    return {f"group_limited_route {name} (E={E}, k={k}, {M} of {G} groups), 4096 tokens": launch_job(name, 4096)
            for name, (E, k, G, M, *_rest) in REAL_ROUTERS.items()}
