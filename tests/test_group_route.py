"""kernels.moe.group_route: device-limited (group-limited) routing, kernel against reference, the
broken variant that forgets the group mask, the traffic bound, and the AOT builds at DeepSeek-V2/V3 sizes."""
import kernels  # noqa: F401  (before triton)

import math

import pytest
import torch

from kernels import inspect as ki
from kernels.moe import group_route as gr
from kernels.moe.group_route import expected_groups, group_limited_route, group_limited_route_ref, groups_per_token
from kernels.moe.router import topk_route_ref
from kernels.testing import assert_close, nan_canary

# (T, E, k, groups, allowed, score, group score, bias): tails, non-power-of-two groups (V2's 20), V3's shape
CASES = [(37, 16, 4, 4, 2, "softmax", "max", False), (9, 256, 8, 8, 4, "sigmoid", "top2", True),
         (21, 160, 6, 8, 3, "softmax", "max", False), (5, 12, 3, 3, 1, "sigmoid", "top2", True),
         (50, 60, 6, 6, 2, "sigmoid", "max", True), (1, 8, 2, 2, 2, "softmax", "max", False)]


def _logits(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g, dtype=torch.float64).float()


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-{c[4]}of{c[3]}-{c[6]}" for c in CASES])
def test_kernel_matches_reference_and_respects_the_limit(case):
    T, E, k, G, M, score, gs, has_bias = case
    u = _logits(T, E, T + E)
    bias = _logits(1, E, 1)[0] * 0.1 if has_bias else None
    w, ids = group_limited_route(nan_canary(u, rows=True), k, G, M, score=score, bias=bias, group_score=gs)
    w_ref, ids_ref = group_limited_route_ref(u, k, G, M, score=score, bias=bias, group_score=gs)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)
    assert int(groups_per_token(ids, E, G).max()) <= M


def test_all_groups_allowed_is_plain_topk():
    u = _logits(40, 32, 3)
    for gs in ("max", "top2"):
        assert torch.equal(group_limited_route_ref(u, 4, 8, 8, group_score=gs)[1], topk_route_ref(u, 4)[1])


def test_group_scores_by_hand():
    """One token, 2 groups of 3: group 0 holds the single best expert, group 1 the better pair.
    'max' (V2) picks group 0, 'top2' (V3) picks group 1."""
    scores = torch.tensor([[0.9, 0.1, 0.1, 0.6, 0.6, 0.1]])
    u = torch.log(scores / (1 - scores))                                  # sigmoid(u) = scores
    assert group_limited_route_ref(u, 2, 2, 1, score="sigmoid", group_score="max")[1].tolist() == [[0, 1]]
    assert group_limited_route_ref(u, 2, 2, 1, score="sigmoid", group_score="top2")[1].tolist() == [[3, 4]]


def test_broken_variant_without_the_group_mask_is_caught():
    """Computing the allowed groups but not masking the others' experts is a plain top-k."""
    u = _logits(64, 16, 4)
    _, ids_ref = group_limited_route_ref(u, 4, 4, 1)
    _, good = gr._launch(u, 4, 4, 1, "softmax", None, "max", True, 1.0)
    _, broken = gr._launch(u, 4, 4, 1, "softmax", None, "max", True, 1.0, limit=False)
    assert torch.equal(good, ids_ref)
    assert not torch.equal(broken, ids_ref) and int(groups_per_token(broken, 16, 4).max()) > 1


def test_zero_filled_mask_breaks_the_limit_under_negative_biases():
    """The variant that shipped (Hugging Face's DeepseekV3TopkRouter, older vLLM/SGLang grouped_topk):
    disallowed experts set to 0.0, not -inf, before the final top-k. With V3's sigmoid scores and
    negative selection biases an allowed expert's biased score is below 0, so a masked one wins and
    the token leaves its M groups; the kernel and the reference (-inf) never do."""
    g = torch.Generator().manual_seed(11)
    u = torch.randn(128, 256, generator=g)
    bias = -0.9 + 0.1 * torch.randn(256, generator=g)
    _, ids = group_limited_route(u, 8, 8, 4, score="sigmoid", bias=bias, group_score="top2")
    _, ids_ref = group_limited_route_ref(u, 8, 8, 4, score="sigmoid", bias=bias, group_score="top2")
    assert torch.equal(ids, ids_ref) and int(groups_per_token(ids, 256, 8).max()) <= 4
    biased = torch.sigmoid(u) + bias                                              # (T, E)
    allowed_groups = biased.view(128, 8, 32).topk(2, dim=-1).values.sum(-1).topk(4, dim=-1).indices
    allowed = torch.zeros(128, 8, dtype=torch.bool).scatter_(1, allowed_groups, True)
    zero_filled = biased.masked_fill(~allowed.repeat_interleave(32, dim=1), 0.0).topk(8, dim=-1).indices
    assert int(groups_per_token(zero_filled, 256, 8).max()) > 4
    neg_inf = biased.masked_fill(~allowed.repeat_interleave(32, dim=1), float("-inf")).topk(8, dim=-1).indices
    assert torch.equal(neg_inf.sort(-1).values, ids.sort(-1).values)             # the same scores, masked right


def test_expected_groups_formula():
    """Exact for k = 1 (one group) and k = E (all groups); a Monte Carlo check in between; V3's
    unrestricted 8 of 256 experts land on 5.29 of 8 nodes on average, above its bound of 4."""
    assert expected_groups(16, 4, 1) == 1 and math.isclose(expected_groups(16, 4, 16), 4)
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(20000, 256, generator=g).argsort(dim=1)[:, :8]
    assert abs(float(groups_per_token(ids, 256, 8).double().mean()) - expected_groups(256, 8, 8)) < 0.02
    assert 5.2 < expected_groups(256, 8, 8) < 5.4


def test_groups_distribution_against_monte_carlo_and_its_mean():
    """The exact distribution sums to 1, has expected_groups as its mean, puts everything on 1 group for
    k = 1 and none on fewer than ceil(k / (E/G)) groups; a Monte Carlo histogram agrees (V3 and Kimi
    K2's 384 experts on 2 nodes). The broken count without inclusion-exclusion (subsets of j groups,
    empty ones included) does not sum to 1."""
    for E, G, k in ((256, 8, 8), (384, 2, 8), (16, 4, 5)):
        dist = gr.groups_distribution(E, G, k)
        assert math.isclose(sum(dist), 1) and math.isclose(sum(j * p for j, p in enumerate(dist)), expected_groups(E, G, k))
        assert all(p == 0 for p in dist[: -(-k // (E // G))])
        ids = torch.rand(20000, E, generator=torch.Generator().manual_seed(E)).argsort(dim=1)[:, :k]
        hist = torch.bincount(groups_per_token(ids, E, G), minlength=G + 1).double() / 20000
        assert float((hist - torch.tensor(dist)).abs().max()) < 0.015
        naive = [math.comb(G, j) * math.comb(j * (E // G), k) / math.comb(E, k) for j in range(G + 1)]
        assert sum(naive) > 1.001
    assert gr.groups_distribution(16, 4, 1)[1] == 1
    with pytest.raises(ValueError, match="groups_distribution"):
        gr.groups_distribution(10, 4, 2)


def test_bad_input_refused():
    u = _logits(4, 16, 0)
    with pytest.raises(ValueError, match="n_groups must divide"):
        group_limited_route(u, 2, 5, 1)
    with pytest.raises(ValueError, match="topk_groups must be in"):
        group_limited_route(u, 2, 4, 5)
    with pytest.raises(ValueError, match="do not fit"):
        group_limited_route(u, 6, 4, 1)
    with pytest.raises(ValueError, match="group_score must be one of"):
        group_limited_route(u, 2, 4, 2, group_score="mean")
    with pytest.raises(ValueError, match="at least 2 experts per group"):
        group_limited_route_ref(u, 2, 16, 4, group_score="top2")
    with pytest.raises(ValueError, match="divisible"):
        groups_per_token(torch.zeros(2, 2, dtype=torch.long), 15, 4)


def test_aot_builds_at_deepseek_sizes():
    jobs = gr.compile_jobs()
    for label, job in jobs.items():
        spec = job.specialization().splitlines()
        assert "stride_e: =1" in spec and "T: i32 %16" in spec, label
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))
    for label, b in zip(jobs, builds):
        for arch, build in b.items():
            assert build.spills == 0 and build.metadata["stack_bytes"] == 0, f"{label} {arch}"
