"""kernels.moe.router: top-k softmax / sigmoid-with-bias routing (kernel against reference), capacity
and dropped tokens, GShard's random second expert, permutation / un-permutation (kernels.moe.permute),
and the router's AOT jobs derived from the launcher's own arguments."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels.moe import router
from kernels.moe.permute import permute_ref, sort_by_expert, unpermute_ref
from kernels.moe.router import capacity, dropped_fraction, keep_mask, topk_route, topk_route_ref
from kernels.testing import MismatchError, assert_close, nan_canary

CASES = [(1, 8, 2), (37, 8, 2), (100, 60, 6), (9, 256, 8), (13, 5, 5), (20, 3, 1)]


def _logits(T, E, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g, dtype=torch.float64).float() * scale


@pytest.mark.parametrize("T,E,k", CASES)
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_kernel_matches_reference(T, E, k, score):
    u = _logits(T, E, seed=T + E)
    bias = (_logits(1, E, seed=1)[0] * 0.1) if score == "sigmoid" else None
    w, ids = topk_route(nan_canary(u, rows=True), k, score=score, bias=bias)
    w_ref, ids_ref = topk_route_ref(u, k, score=score, bias=bias)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)
    assert torch.allclose(w.sum(-1), torch.ones(T))


def test_unnormalised_softmax_weights_and_fp16_logits():
    u = _logits(33, 12, seed=3).half()
    w, ids = topk_route(u, 3, normalize=False)
    w_ref, ids_ref = topk_route_ref(u, 3, normalize=False)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)
    assert bool((w.sum(-1) < 1).all())


def test_softmax_then_topk_renormalised_equals_softmax_of_topk_logits():
    """Mixtral writes its router as softmax(topk(u)); the same weights as softmax, top-k, renormalise."""
    u = _logits(50, 8, seed=4)
    w, ids = topk_route_ref(u, 2)
    assert_close(w, torch.softmax(u.gather(1, ids), dim=-1))


def test_ties_large_magnitudes_and_empty_batch():
    u = torch.zeros(4, 6)
    w, ids = topk_route(u, 3)
    assert ids.tolist() == [[0, 1, 2]] * 4 and torch.allclose(w, torch.full((4, 3), 1 / 3))
    big = _logits(10, 8, seed=5, scale=1e4)
    w, ids = topk_route(big, 2)
    assert bool(torch.isfinite(w).all()) and torch.equal(ids, topk_route_ref(big, 2)[1])
    w, ids = topk_route(torch.empty(0, 8), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


def test_bias_chooses_but_does_not_weigh():
    """DeepSeek-V3: the bias moves expert 3 into every token's top k; its weight is still its sigmoid score."""
    u = _logits(30, 8, seed=6)
    bias = torch.zeros(8)
    bias[3] = 10.0
    w, ids = topk_route(u, 2, score="sigmoid", bias=bias)
    assert bool((ids == 3).any(-1).all())
    s = torch.sigmoid(u)
    assert_close(w, s.gather(1, ids) / s.gather(1, ids).sum(-1, keepdim=True))


def test_broken_padding_mask_is_caught():
    """Without masking the padding columns (E = 6 in a block of 8), a negative bias lets them win."""
    u = _logits(16, 6, seed=7)
    bias = torch.full((6,), -2.0)
    _, ids_ref = topk_route_ref(u, 2, score="sigmoid", bias=bias)
    _, ids = router._launch(u, 2, "sigmoid", True, bias, 16)
    assert torch.equal(ids, ids_ref)
    _, broken = router._launch(u, 2, "sigmoid", True, bias, 16, mask_pad=False)
    assert not torch.equal(broken, ids_ref) and int(broken.max()) >= 6


def test_bad_input_refused():
    u = _logits(4, 8)
    with pytest.raises(ValueError, match="k must be in"):
        topk_route(u, 9)
    with pytest.raises(ValueError, match=r"\(T, E\)"):
        topk_route(u[0], 2)
    with pytest.raises(ValueError, match="score must be"):
        topk_route(u, 2, score="relu")
    with pytest.raises(ValueError, match="bias must have shape"):
        topk_route(u, 2, score="sigmoid", bias=torch.zeros(7))
    with pytest.raises(ValueError, match="at most 512 experts"):
        topk_route(_logits(2, 600), 2)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        topk_route(u.double(), 2)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        capacity(10, 4, 2, 0.0)
    with pytest.raises(ValueError, match="route_scale must be positive"):
        topk_route(u, 2, route_scale=0.0)
    with pytest.raises(ValueError, match=r"\(T, 2\) top-2"):
        router.gshard_second_keep(torch.rand(4, 3))
    with pytest.raises(ValueError, match="threshold must be positive"):
        router.gshard_second_keep(torch.rand(4, 2), threshold=0)


def test_route_scale_multiplies_the_weights_after_normalising():
    """DeepSeek-V3: sigmoid weights renormalised to 1, then times 2.5 (kernel and reference)."""
    u = _logits(21, 256, seed=8)
    bias = _logits(1, 256, seed=9)[0] * 0.05
    w, ids = topk_route(u, 8, score="sigmoid", bias=bias, route_scale=2.5)
    w_ref, ids_ref = topk_route_ref(u, 8, score="sigmoid", bias=bias, route_scale=2.5)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)
    assert torch.allclose(w.sum(-1), torch.full((21,), 2.5))
    w1, _ = topk_route_ref(u, 8, score="sigmoid", bias=bias)
    assert_close(w_ref, 2.5 * w1)


def test_gshard_random_second_expert():
    """The second expert is kept with probability min(1, w2 / 0.2): always when w2 >= 0.2, at the
    rate w2 / 0.2 below it; the first choice always."""
    g = torch.Generator().manual_seed(10)
    T = 20000
    w = torch.stack([torch.full((T,), 0.95), torch.full((T,), 0.05)], dim=1)     # w2 = 0.05: kept 25% of the time
    keep = router.gshard_second_keep(w, generator=g)
    assert bool(keep[:, 0].all())
    assert abs(float(keep[:, 1].float().mean()) - 0.25) < 0.02
    strong = torch.tensor([[0.6, 0.4]] * 100)
    assert bool(router.gshard_second_keep(strong, generator=g).all())


def test_capacity_and_priority_order():
    """capacity = ceil(cf * k T / E); first choices are kept before any second choice."""
    assert capacity(4096, 8, 2, 1.25) == 1280 and capacity(10, 4, 2, 1.0) == 5
    ids = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])       # expert 0: three first choices, one second
    keep = keep_mask(ids, 3, 3)
    assert keep.tolist() == [[True, True], [True, True], [True, True], [True, False]]
    assert abs(dropped_fraction(ids, 3, 1.0) - 1 / 8) < 1e-12      # capacity ceil(8/3) = 3: one of 8 dropped


def test_dropped_fraction_falls_with_capacity_factor():
    g = torch.Generator().manual_seed(0)
    ids = topk_route_ref(torch.randn(512, 8, generator=g) + torch.linspace(0, 2, 8), 2)[1]
    drops = [dropped_fraction(ids, 8, cf) for cf in (0.5, 1.0, 1.5, 4.0)]
    assert drops[0] >= 0.5 and drops == sorted(drops, reverse=True) and drops[-1] == 0.0


def test_permute_and_unpermute_round_trip():
    g = torch.Generator().manual_seed(1)
    T, C, E, k = 23, 5, 6, 2
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    w, ids = topk_route_ref(torch.randn(T, E, generator=g), k)
    xs, order, offsets = permute_ref(x, ids, E)
    assert offsets[-1] == T * k and torch.equal(offsets[1:] - offsets[:-1], torch.bincount(ids.flatten(), minlength=E))
    assert bool((ids.flatten()[order][1:] >= ids.flatten()[order][:-1]).all())     # grouped by expert
    y = unpermute_ref(xs, order, w.double())                                        # identity experts
    assert_close(y, x * w.double().sum(-1, keepdim=True))
    keep = keep_mask(ids, E, 3)
    order_k, offsets_k = sort_by_expert(ids, E, keep)
    assert len(order_k) == int(keep.sum()) and int((offsets_k[1:] - offsets_k[:-1]).max()) <= 3
    with pytest.raises(ValueError, match="expert ids must lie"):
        sort_by_expert(ids + E, E)


def test_broken_unpermute_is_caught():
    """Summing the experts' outputs without the gate weights is a different function."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 4, generator=g, dtype=torch.float64)
    w, ids = topk_route_ref(torch.randn(9, 5, generator=g), 2)
    xs, order, _ = permute_ref(x, ids, 5)
    with pytest.raises(MismatchError):
        assert_close(unpermute_ref(xs, order, torch.ones_like(w).double()), unpermute_ref(xs, order, w.double()))


# ---------------------------------------------------------------------------------------------- AOT

def test_compile_jobs_come_from_the_launcher_arguments():
    """The jobs are launch_job's derivation from _launch_args at real sizes: T = 4096 and DeepSeek-V3's
    E = 256 carry %16, Mixtral's E = 8 does not, the unit expert stride is a constexpr 1."""
    jobs = router.compile_jobs()
    mixtral = jobs["topk_route Mixtral 8x7B (E=8, k=2, softmax), 4096 tokens"].specialization().splitlines()
    v3 = jobs["topk_route DeepSeek-V3 (E=256, k=8, sigmoid), 4096 tokens"].specialization().splitlines()
    assert "T: i32 %16" in mixtral and "E: i32" in mixtral and "stride_e: =1" in mixtral
    assert "E: i32 %16" in v3 and "stride_t: i32 %16" in v3 and "route_scale: fp32" in v3


def test_router_builds_do_not_spill_at_real_sizes():
    jobs = router.compile_jobs()
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))
    for label, b in zip(jobs, builds):
        for arch, build in b.items():
            assert build.spills == 0 and build.metadata["stack_bytes"] == 0, f"{label} {arch} spills"


def test_noisy_topk_without_noise_is_plain_topk_and_noise_spreads_a_collapsed_router():
    """softplus(v) -> 0 for v -> -inf: no noise, Shazeer's gate is the renormalised top-k softmax.
    With noise, an expert that never wins on the clean logits receives tokens."""
    u = _logits(200, 8, seed=11)
    w, ids = router.noisy_topk_ref(u, torch.full_like(u, -60.0), 2, generator=torch.Generator().manual_seed(0))
    w_ref, ids_ref = topk_route_ref(u, 2)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)
    collapsed = torch.zeros(200, 8)
    collapsed[:, :2] = 3.0                                               # experts 0 and 1 win every token
    assert set(topk_route_ref(collapsed, 2)[1].flatten().tolist()) == {0, 1}
    _, noisy = router.noisy_topk_ref(collapsed, torch.full_like(u, 1.0), 2, generator=torch.Generator().manual_seed(1))
    assert int((torch.bincount(noisy.flatten(), minlength=8)[2:] > 0).sum()) == 6
    with pytest.raises(ValueError, match="noise_logits must have the shape"):
        router.noisy_topk_ref(u, u[:, :4], 2)


def test_expert_choice_loads_are_exact_and_some_tokens_get_no_expert():
    u = _logits(64, 8, seed=12) + torch.linspace(0, 2, 8)
    gates, ids = router.expert_choice_ref(u, 16)                         # c = k T / E with k = 2
    assert gates.shape == ids.shape == (8, 16)
    assert torch.equal(torch.bincount(ids.flatten(), minlength=64).sum(), torch.tensor(128))
    for e in range(8):                                                   # each expert's c best tokens, best first
        col = torch.softmax(u.double(), -1)[:, e]
        assert torch.equal(ids[e], torch.sort(col, descending=True, stable=True).indices[:16])
        assert_close(gates[e], col[ids[e]].float())
    picks = torch.bincount(ids.flatten(), minlength=64)
    assert int((picks == 0).sum()) > 0 and int(picks.max()) > 2
    with pytest.raises(ValueError, match="per_expert must be in"):
        router.expert_choice_ref(u, 65)
