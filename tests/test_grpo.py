"""kernels.rl.grpo: group advantages (kernel), the aggregation of token losses, the GRPO loss, the run."""
import json

import kernels  # noqa: F401  (before triton)
import pytest
import torch

from kernels.rl import grpo, sft
from kernels.rl.grpo import aggregation_weights, group_advantages, group_advantages_ref, grpo_loss, grpo_loss_ref
from kernels.testing import MismatchError, assert_close, nan_canary


@pytest.mark.parametrize("P,G", [(1, 2), (5, 8), (3, 6), (40, 16)])
@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_reference(P, G, scale):
    r = torch.randint(0, 3, (P * G,), generator=torch.Generator().manual_seed(G)).float()
    assert_close(group_advantages(nan_canary(r), G, scale=scale), group_advantages_ref(r, G, scale=scale),
                 name="advantages")


def test_a_group_with_equal_rewards_has_zero_advantage():
    r = torch.tensor([1.0] * 8 + [0.0, 1.0] * 4)
    a = group_advantages(r, 8)
    assert torch.equal(a[:8], torch.zeros(8)) and float(a[8:].abs().min()) > 0.9


def test_broken_advantage_kernel_is_caught():
    r = torch.tensor([0.0, 1.0, 1.0, 1.0])
    with pytest.raises(MismatchError):
        assert_close(group_advantages(r, 4, center=False), group_advantages_ref(r, 4), name="uncentered")


def test_aggregations_weigh_tokens_as_their_formulas_say():
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    assert aggregation_weights(mask, "sequence").tolist() == [[0.5, 0, 0, 0], [0.125] * 4]
    assert torch.allclose(aggregation_weights(mask, "token"), torch.tensor([[0.2, 0, 0, 0], [0.2] * 4]))
    assert aggregation_weights(mask, "constant").tolist() == [[0.125, 0, 0, 0], [0.125] * 4]
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregation_weights(mask, "mean")


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_grpo_loss_kernel_path_matches_reference(aggregation):
    g = torch.Generator().manual_seed(0)
    B, T, G = 12, 5, 4
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64).float()
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64).float()
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64).float()
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    grads = []
    for fn in (grpo_loss, grpo_loss_ref):
        lp = logp.clone().requires_grad_()
        loss = fn(lp, old, ref, rewards, mask, G, aggregation=aggregation)
        loss.backward()
        grads.append((loss, lp.grad))
    assert_close(grads[0][0], grads[1][0], name="loss")
    assert_close(grads[0][1], grads[1][1], name="dlogp")


def test_sequence_normalization_has_a_length_bias():
    """Two wrong answers (A < 0) of lengths 1 and 4 in one group: per token, the long one's gradient is
    4x smaller under sequence-level averaging, equal under token-level and constant (Dr. GRPO)."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]])
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0])
    z = torch.zeros(4, 4)
    for how, ratio in (("sequence", 4.0), ("token", 1.0), ("constant", 1.0)):
        lp = z.clone().requires_grad_()
        grpo_loss(lp, z, z, rewards, mask, 4, aggregation=how, beta=0.0).backward()
        assert abs(float(lp.grad[0, 0] / lp.grad[1, 0]) - ratio) < 1e-5, how


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="group_size must be >= 2 and divide"):
        group_advantages(torch.zeros(10), 3)
    with pytest.raises(ValueError, match="1-D floating-point"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match=r"logp must be \(B, T\)"):
        grpo_loss(torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(3), torch.ones(4, 2), 2)


def test_committed_grpo_run_reproduces_its_first_steps():
    log = sft.read_log(sft.OUT_DIR / "grpo" / "log.csv")
    meta = json.loads((sft.OUT_DIR / "grpo" / "metrics.json").read_text())
    threads = torch.get_num_threads()
    try:
        rerun = grpo.train_grpo(None, steps=meta["steps"], lr=meta["lr"], prompts_per_step=meta["prompts_per_step"],
                                beta=meta["beta"], progress=False, stop_after=1)["log"]
    finally:
        torch.set_num_threads(threads)
    got, want = rerun[1], log[1]
    assert got["reward"] == want["reward"]            # sampled before any update, with the same generator
    assert abs(got["kl"] - want["kl"]) < 1e-3 * max(1.0, want["kl"]) + 1e-5
    assert abs(got["clip_fraction"] - want["clip_fraction"]) < 0.02
