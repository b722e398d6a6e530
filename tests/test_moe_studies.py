"""The committed MoE studies (kernels.moe.train, models/moe/*.json): every log complete, its first
steps reproduced here, the same arm in two studies logged identically, and the model variants they
train (shared experts, LatentMoE, device-limited routing, capacity, Soft MoE) checked as models."""
import kernels  # noqa: F401  (before triton)

import json

import pytest
import torch

from kernels.model import data
from kernels.moe import train
from kernels.moe.model import MoEConfig, MoEGPT, count_parameters
from kernels.testing import assert_close

STUDIES = [s for s in train.STUDIES if s != "balance"]        # balance: tests/test_load_balancing.py


@pytest.fixture(scope="module", params=STUDIES)
def study(request):
    return request.param, json.loads(train.study_path(request.param).read_text())


def test_log_is_complete(study):
    name, log = study
    steps = log["settings"]["steps"]
    assert [r["method"] for r in log["runs"]] == train.STUDIES[name][1]
    assert set(log["seconds"]) == set(train.STUDIES[name][1]) and log["machine"] and log["command"].endswith(name)
    for r in log["runs"]:
        cfg = train.arm_config(r["method"])
        assert len(r["train_loss"]) == steps and r["val"][-1][0] == steps
        per_step = log["settings"]["batch_size"] * cfg.block_size * cfg.top_k
        if cfg.layer == "topk":                  # a Soft MoE layer's loads are p B per expert: not logged
            assert len(r["loads"]) == steps and all(sum(layer) == per_step for step in r["loads"] for layer in step), r["method"]
        else:
            assert "loads" not in r and {"val_prefix", "val_swapped_future"} <= set(r["final"]), r["method"]
        if cfg.capacity_factor is not None:
            assert len(r["dropped"]) == steps and all(0 <= d <= per_step for step in r["dropped"] for d in step)
        assert "final" in r
    assert train.study_path(name).stat().st_size < 400_000


def test_first_steps_reproduce_the_log(study):
    """Three steps of every arm re-run here give the logged losses and (to a few assignments) loads."""
    _, log = study
    torch.set_num_threads(log["threads"])
    settings = {k: v for k, v in log["settings"].items() if k != "steps"}
    for logged in log["runs"]:
        again = train.run(logged["method"], steps=3, schedule_steps=log["settings"]["steps"], progress=False, **settings)
        assert again["train_loss"] == pytest.approx(logged["train_loss"][:3], abs=1e-3), logged["method"]
        assert ("loads" in again) == ("loads" in logged), logged["method"]
        if "loads" in logged:
            diff = (torch.tensor(again["loads"]) - torch.tensor(logged["loads"][:3])).abs().sum()
            assert int(diff) <= 8, logged["method"]


def test_the_same_arm_in_two_studies_is_logged_identically():
    """experts' top2 and balance's switch are one configuration, seed and batch order."""
    balance = {r["method"]: r for r in json.loads(train.RESULTS.read_text())["runs"]}
    experts = {r["method"]: r for r in json.loads(train.study_path("experts").read_text())["runs"]}
    assert train.ARMS["top2"] == train.ARMS["switch"]
    for key in ("train_loss", "loads", "val"):
        assert experts["top2"][key] == balance["switch"][key], key


def test_checkpoint_is_the_top2_arm():
    model = train.load_checkpoint()
    assert model.config == train.arm_config("top2")
    _, val = data.train_val_split(data.encode(data.load_text()))
    x, y = data.fixed_windows(val, train.VAL_WINDOWS, model.config.block_size)
    logged = {r["method"]: r for r in json.loads(train.study_path("experts").read_text())["runs"]}["top2"]
    assert abs(train.evaluate(model, x, y) - logged["val"][-1][1]) < 1e-4


def test_matched_active_expert_parameters():
    """Every arm of the experts study runs 2 * 3 * 64 * 64 expert weights per token and layer: the
    fine-grained arms as k narrower experts (plus the shared one), LatentMoE as 4 experts of 3 * 32 * 52
    plus its two 64 x 32 projections, which with its 16-expert router is exactly the top-2 arm's count;
    the fine-grained routers (E x 64 weights) add 448 or 512."""
    def expert_active(arm):
        c = train.arm_config(arm)
        return c.top_k * 3 * c.expert_width * c.d_expert + 3 * c.d_model * c.n_shared * c.d_expert \
            + 2 * c.d_model * (c.d_latent or 0) + c.d_model * c.n_experts
    base = expert_active("top2")
    assert expert_active("fine") == expert_active("fine+shared") + 64 == base + 8 * 64
    assert expert_active("latent") == base
    for arm in ("top2", "fine", "fine+shared", "latent"):
        c = train.arm_config(arm)
        assert count_parameters(c)["total"] == sum(p.numel() for p in MoEGPT(c).parameters()), arm


def test_prefix_loss_equals_teacher_forcing_for_a_causal_model():
    model = train.load_checkpoint()
    _, val = data.train_val_split(data.encode(data.load_text()))
    x, y = data.fixed_windows(val, 2, model.config.block_size)
    assert abs(train.prefix_loss(model, x, y) - train.evaluate(model, x, y)) < 1e-5


@pytest.mark.parametrize("arm", ["fine+shared", "latent", "devices2", "cf1.0"])
def test_variant_kernel_path_matches_pytorch(arm):
    torch.manual_seed(0)
    cfg = train.arm_config(arm, MoEConfig(block_size=16))
    model = MoEGPT(cfg)
    x = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        want = model(x)
        got = model(x, use_kernels=True)
    assert_close(got, want)


def test_capacity_drops_what_exceeds_it():
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(capacity_factor=0.5, block_size=16))
    model(torch.randint(0, 256, (2, 16)))
    layer = model.moe_layers[0]
    cap = -(-0.5 * 2 * 32 // 8)
    assert layer.last_dropped == int((layer.last_load - cap).clamp(min=0).sum()) and layer.last_dropped >= 32


def test_bad_config_refused():
    for kwargs, message in [(dict(router_score="relu"), "router_score"), (dict(n_groups=3), "n_groups must divide"),
                            (dict(n_groups=4, topk_groups=5), "topk_groups"), (dict(d_latent=64), "d_latent"),
                            (dict(capacity_factor=0.0), "capacity_factor"), (dict(layer="hash"), "layer must be"),
                            (dict(n_shared=-1), "n_shared"), (dict(n_groups=4, topk_groups=1, top_k=3), "do not fit"),
                            (dict(soft_layers=1), "layer='soft' only"), (dict(soft_normalize=True), "layer='soft' only"),
                            (dict(layer="soft", soft_layers=3), "soft_layers must be in"),
                            (dict(layer="soft", soft_layers=0), "soft_layers must be in")]:
        with pytest.raises(ValueError, match=message):
            MoEConfig(**kwargs)
    with pytest.raises(ValueError, match="method must be one of"):
        train.arm_config("hash")
    with pytest.raises(ValueError, match="study must be one of"):
        train.study_path("hash")


def test_soft_arms_match_in_expert_flops_and_differ_as_described():
    """soft and soft-paper run the same 128 slots per 64-token window through experts of the same width
    (the top-2 arm's expert FLOPs); soft-paper has them as 128 one-slot experts, normalised logits, and
    Soft MoE in the last block only, the first block a dense SwiGLU of width 2F; parameter counts exact."""
    course, paper = train.arm_config("soft"), train.arm_config("soft-paper")
    assert course.n_experts * course.slots_per_expert == paper.n_experts * paper.slots_per_expert == 2 * 64
    assert (paper.slots_per_expert, paper.soft_normalize, paper.n_dense) == (1, True, 1) and course.n_dense == 0
    model = MoEGPT(paper)
    assert model.blocks[0].moe is None and model.blocks[0].mlp.w_gate.weight.shape == (2 * paper.d_expert, 64)
    assert len(model.moe_layers) == 1 and model.moe_layers[0].scale is not None
    for cfg in (course, paper):
        assert count_parameters(cfg)["total"] == sum(p.numel() for p in MoEGPT(cfg).parameters())


def test_swapped_future_is_teacher_forcing_for_a_causal_model_and_not_for_soft_moe():
    """The control of the soft-moe chapter: with an unrelated future after the true past, the causal
    top-2 model's loss is unchanged; the committed Soft MoE's rises (its slots read the future)."""
    _, val = data.train_val_split(data.encode(data.load_text()))
    x, y = data.fixed_windows(val, 3, 64)
    causal, soft = train.load_checkpoint(), train.load_checkpoint(train.SOFT_CHECKPOINT)
    assert abs(train.swapped_future_loss(causal, x, y) - train.evaluate(causal, x, y)) < 1e-5
    assert train.swapped_future_loss(soft, x, y) > train.evaluate(soft, x, y) + 0.05
