"""kernels.moe.balance and the small MoE (kernels.moe.model, kernels.moe.train): the Switch auxiliary
loss, the router z-loss, DeepSeek-V3's bias update, the model's kernel path, and the committed
training results, whose first steps are re-run here."""
import kernels  # noqa: F401  (before triton)
import json

import pytest
import torch

from kernels.moe import balance, train
from kernels.moe.balance import bias_update, max_violation, switch_aux_loss, z_loss
from kernels.moe.model import MoEConfig, MoEGPT, count_parameters
from kernels.moe.router import topk_route, topk_route_ref
from kernels.testing import assert_close


def test_switch_aux_loss_is_one_when_balanced_and_larger_when_not():
    T, E = 64, 8
    uniform = torch.full((T, E), 1 / E)
    ids = torch.arange(2 * T).remainder(E).view(T, 2)                   # every expert 16 assignments
    assert abs(float(switch_aux_loss(uniform, ids)) - 1.0) < 1e-6
    skewed = torch.softmax(torch.linspace(0, 3, E).repeat(T, 1), dim=-1)
    ids_skewed = topk_route_ref(torch.log(skewed), 2)[1]
    assert float(switch_aux_loss(skewed, ids_skewed)) > 2.0


def test_switch_aux_loss_matches_megatron_form():
    """E / (k T^2) * sum_i count_i * sum_t p_ti: Megatron-LM's arrangement of the same formula."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(50, 6, generator=g, dtype=torch.float64)
    p = torch.softmax(u, -1)
    ids = topk_route_ref(u, 2)[1]
    counts = torch.bincount(ids.flatten(), minlength=6).double()
    assert_close(switch_aux_loss(p, ids), 6 / (2 * 50**2) * (counts * p.sum(0)).sum())


def test_aux_loss_gradient_lowers_the_overloaded_expert():
    u = torch.zeros(40, 4, dtype=torch.float64)
    u[:, 0] = 1.0                                                        # expert 0 wins every token
    u.requires_grad_()
    ids = topk_route_ref(u.detach(), 1)[1]
    switch_aux_loss(torch.softmax(u, -1), ids).backward()
    assert bool((u.grad[:, 0] > 0).all()) and bool((u.grad[:, 1:] < 0).all())   # descent lowers u_0


def test_z_loss_formula_and_shift():
    """Routing is unchanged by adding a constant to every logit; the z-loss is not: it pins the scale."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(30, 8, generator=g, dtype=torch.float64)
    assert_close(z_loss(u), torch.logsumexp(u, -1).pow(2).mean().float())
    assert torch.equal(topk_route_ref(u, 2)[1], topk_route_ref(u + 5, 2)[1])
    assert float(z_loss(u + 5)) > 5 * float(z_loss(u))


def test_bias_update_sign_rule():
    b = torch.zeros(4)
    new = bias_update(b, torch.tensor([10, 2, 4, 0]), 0.01)
    assert new.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])        # mean load 4: expert 2 keeps its bias
    assert max_violation(torch.tensor([4, 4, 4, 4])) == 0.0 and max_violation(torch.tensor([8, 0, 0, 0])) == 3.0


def test_bias_update_balances_a_skewed_router():
    """A fixed, skewed sigmoid router: the bias update alone brings MaxVio from above 1 to below 0.15."""
    g = torch.Generator().manual_seed(2)
    u = torch.randn(1024, 8, generator=g) + torch.linspace(-1, 1, 8)
    bias = torch.zeros(8)
    start = max_violation(torch.bincount(topk_route(u, 2, score="sigmoid", bias=bias)[1].flatten(), minlength=8))
    for _ in range(200):
        ids = topk_route_ref(u, 2, score="sigmoid", bias=bias)[1]
        bias = bias_update(bias, torch.bincount(ids.flatten(), minlength=8), 0.01)
    load = torch.bincount(topk_route(u, 2, score="sigmoid", bias=bias)[1].flatten(), minlength=8)
    assert start > 1.0 and max_violation(load) < 0.15


def test_broken_bias_update_is_caught():
    """The sign reversed (raising the bias of overloaded experts) makes the imbalance worse, not better."""
    g = torch.Generator().manual_seed(3)
    u = torch.randn(512, 8, generator=g) + torch.linspace(-0.5, 0.5, 8)
    bias = torch.zeros(8)
    load0 = torch.bincount(topk_route_ref(u, 2, score="sigmoid")[1].flatten(), minlength=8)
    for _ in range(100):
        load = torch.bincount(topk_route_ref(u, 2, score="sigmoid", bias=bias)[1].flatten(), minlength=8)
        bias = bias - (bias_update(bias, load, 0.01) - bias)              # the wrong sign
    assert max_violation(load) > max_violation(load0)


def test_global_batch_loss_takes_f_from_the_global_load():
    """Four micro-batches, each routed to its own two experts: globally perfectly balanced (L = 1 with
    the global f), while every micro-batch alone is maximally unbalanced (L = E / k = 4)."""
    E, T = 8, 64
    micro = []
    for j in range(4):
        ids = torch.tensor([[2 * j, 2 * j + 1]] * T)
        probs = torch.zeros(T, E, dtype=torch.float64)
        probs[:, 2 * j: 2 * j + 2] = 0.5
        micro.append((probs, ids))
    total = sum(torch.bincount(ids.flatten(), minlength=E) for _, ids in micro)
    local = sum(float(switch_aux_loss(p, i)) for p, i in micro) / 4
    global_ = sum(float(switch_aux_loss(p, i, load=total)) for p, i in micro) / 4
    assert abs(local - 4.0) < 1e-9 and abs(global_ - 1.0) < 1e-9
    with pytest.raises(ValueError, match="load must be"):
        switch_aux_loss(micro[0][0], micro[0][1], load=total[:4])


def test_bias_update_from_the_all_reduced_load_keeps_replicas_identical():
    """Two gloo ranks whose shards prefer different experts: from their own loads their biases part;
    from the all-reduced load they stay equal."""
    from kernels.dist.launch import launch

    g = torch.Generator().manual_seed(4)
    u = torch.randn(512, 8, generator=g) + torch.linspace(-1, 1, 8)
    u[:256] += torch.linspace(1.5, -1.5, 8)
    local = launch(balance.bias_update_worker, 2, (u, 2, 0.01, 50, False)).results
    synced = launch(balance.bias_update_worker, 2, (u, 2, 0.01, 50, True)).results
    assert float((local[0] - local[1]).abs().max()) > 0.1
    assert torch.equal(synced[0], synced[1])
    assert torch.equal(balance.global_load(torch.tensor([3, 1])), torch.tensor([3, 1]))   # no group: unchanged


def test_bad_input_refused():
    with pytest.raises(ValueError, match="must share T"):
        switch_aux_loss(torch.rand(4, 3), torch.zeros(5, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(T, E\)"):
        z_loss(torch.rand(3))
    with pytest.raises(ValueError, match="both be"):
        bias_update(torch.zeros(3), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="rate must be"):
        bias_update(torch.zeros(3), torch.zeros(3), -1.0)
    with pytest.raises(ValueError, match="balance must be one of"):
        MoEConfig(balance="sinkhorn")
    with pytest.raises(ValueError, match="method must be one of"):
        train.run("sinkhorn", steps=1, schedule_steps=1, **{k: v for k, v in train.DEFAULTS.items() if k != "steps"})


@pytest.mark.parametrize("bal", ["switch+z", "bias"])
def test_model_kernel_path_matches_pure_pytorch(bal):
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(balance=bal, n_experts=6, d_model=32, d_expert=24, block_size=16))
    model.moe_layers[0].bias.copy_(torch.linspace(-0.05, 0.05, 6))
    x = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        want = model(x)
        loads = [layer.last_load.clone() for layer in model.moe_layers]
        got = model(x, use_kernels=True)                     # router kernel + grouped GEMM kernels
    assert all(torch.equal(a, layer.last_load) for a, layer in zip(loads, model.moe_layers))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_parameter_count_formula():
    cfg = MoEConfig()
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in MoEGPT(cfg).parameters())


# ---------------------------------------------------------------------------------------------- results

@pytest.fixture(scope="module")
def results():
    return json.loads(train.RESULTS.read_text())


def test_results_are_complete(results):
    steps = results["settings"]["steps"]
    cfg = MoEConfig()
    assert [r["method"] for r in results["runs"]] == list(train.METHODS)
    for r in results["runs"]:
        assert len(r["train_loss"]) == len(r["loads"]) == steps
        per_step = results["settings"]["batch_size"] * cfg.block_size * cfg.top_k
        assert all(sum(layer) == per_step for step in r["loads"] for layer in step)
        assert r["val"][-1][0] == steps
    assert train.RESULTS.stat().st_size < 400_000


def test_first_steps_reproduce_the_log(results):
    """Three steps of every method re-run here give the logged losses and (to a few assignments) loads."""
    torch.set_num_threads(results["threads"])
    settings = {k: v for k, v in results["settings"].items() if k != "steps"}
    for logged in results["runs"]:
        again = train.run(logged["method"], steps=3, schedule_steps=results["settings"]["steps"], progress=False,
                          **settings)
        assert again["train_loss"] == pytest.approx(logged["train_loss"][:3], abs=1e-3), logged["method"]
        diff = (torch.tensor(again["loads"]) - torch.tensor(logged["loads"][:3])).abs().sum()
        assert int(diff) <= 8, logged["method"]


def test_device_and_communication_balance_losses():
    """DeepSeek-V2's device-level losses: 1 when even; an imbalance inside one device is invisible to
    the device loss but not to the expert-level one; a token counts once per device it is sent to."""
    T, E, D = 64, 8, 4
    even = torch.full((T, E), 1 / E, dtype=torch.float64)
    ids = torch.arange(2 * T).remainder(E).view(T, 2)                   # experts (2t, 2t + 1) mod 8
    assert abs(float(balance.device_balance_loss(even, ids, D)) - 1) < 1e-12
    inside = torch.stack([torch.arange(T).remainder(D) * 2] * 2, 1)    # only the first expert of each device ...
    inside[:, 1] = (inside[:, 0] + 2) % E                               # ... and of the next device
    probs = torch.zeros(T, E, dtype=torch.float64).scatter_(1, inside, 0.5)
    assert abs(float(balance.device_balance_loss(probs, inside, D)) - 1) < 1e-12
    assert float(switch_aux_loss(probs, inside)) > 1.9
    # each token's two experts on one device: sent to 1 device, M = 1 allowed -> 1; told M = 2 -> 1/2
    same_device = torch.stack([torch.arange(T).remainder(D) * 2, torch.arange(T).remainder(D) * 2 + 1], 1)
    assert abs(float(balance.comm_balance_loss(even, same_device, D, 1)) - 1) < 1e-12
    assert abs(float(balance.comm_balance_loss(even, same_device, D, 2)) - 0.5) < 1e-12
    with pytest.raises(ValueError, match="n_groups must divide"):
        balance.device_balance_loss(even, ids, 3)


def test_sinkhorn_plan_is_balanced_and_its_routing_evens_a_skewed_router():
    g = torch.Generator().manual_seed(5)
    u = torch.randn(1024, 8, generator=g) + torch.linspace(-1, 1, 8)
    plan = balance.sinkhorn_plan(u)
    assert torch.allclose(plan.sum(1), torch.ones(1024, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(plan.sum(0), torch.full((8,), 128.0, dtype=torch.float64), atol=1e-3)
    plain = torch.bincount(topk_route_ref(u, 2)[1].flatten(), minlength=8)
    w, ids = balance.sinkhorn_route_ref(u, 2)
    assert max_violation(plain) > 1.0 and max_violation(torch.bincount(ids.flatten(), minlength=8)) < 0.1
    assert torch.allclose(w.sum(-1), torch.ones(1024))
    balanced = torch.randn(1024, 8, generator=g)                         # an even router: few choices move
    moved = (balance.sinkhorn_route_ref(balanced, 2)[1] != topk_route_ref(balanced, 2)[1]).any(-1).float().mean()
    assert float(moved) < 0.3
