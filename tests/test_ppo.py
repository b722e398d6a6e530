"""kernels.rl.ppo (clipped surrogate + value loss + KL estimators, fused) and kernels.rl.gae."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch

from kernels.rl.gae import gae, gae_ref
from kernels.rl.ppo import kl_estimate_ref, ppo_loss, ppo_loss_ref
from kernels.testing import MismatchError, assert_close, nan_canary


def _batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = lambda s=1.0: (torch.randn(B, T, generator=g, dtype=torch.float64) * s).float()  # noqa: E731
    logp = -d().abs()
    t = {"logp": logp, "old": logp + d(0.3), "ref": logp + d(0.3), "adv": d(),
         "w": torch.rand(B, T, generator=g, dtype=torch.float64).float()}
    t.update(values=d(), returns=d())
    t["old_values"] = t["values"] + d(0.3)
    return t


def _both(t, value, **kw):
    out = []
    for fn in (ppo_loss, ppo_loss_ref):
        lp = t["logp"].clone().requires_grad_()
        v = t["values"].clone().requires_grad_()
        extra = dict(values=v, old_values=t["old_values"], returns=t["returns"]) if value else {}
        loss = fn(lp, t["old"], t["ref"], t["adv"], t["w"], **extra, **kw)
        loss.backward()
        out.append((loss, lp.grad, v.grad))
    return out


# 1 token (less than one block), 3 x 37, and 1100 x 3 = 3300 tokens: four programs with a tail
@pytest.mark.parametrize("B,T", [(1, 1), (3, 37), (1100, 3)])
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
@pytest.mark.parametrize("value", [False, True])
def test_kernel_matches_autograd_reference(B, T, kl, value):
    t = _batch(B, T)
    (l1, g1, v1), (l2, g2, v2) = _both(t, value, beta=0.1, kl=kl, clip_eps=0.2, clip_eps_high=0.28)
    assert_close(l1, l2, name="loss")
    assert_close(g1, g2, name="dlogp")
    if value:
        assert_close(v1, v2, name="dvalues")


def test_kernel_reads_only_its_tokens():
    t = _batch(3, 37)
    lp = nan_canary(t["logp"]).requires_grad_()
    loss = ppo_loss(lp, nan_canary(t["old"]), nan_canary(t["ref"]), nan_canary(t["adv"]), nan_canary(t["w"]), beta=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert_close(loss, ppo_loss_ref(t["logp"], t["old"], t["ref"], t["adv"], t["w"], beta=0.1), name="loss")


def test_clipped_tokens_get_no_gradient():
    """A > 0 and r above 1 + eps: the clipped term is the max, so the token's gradient is 0; A < 0 and r
    above 1 + eps: the unclipped term is the max (the pessimistic bound keeps penalizing)."""
    logp = torch.log(torch.tensor([[1.5, 1.5, 1.0]])).requires_grad_()
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, stats = ppo_loss(logp, old, old, adv, torch.ones(1, 3), return_stats=True)
    loss.backward()
    assert logp.grad[0, 0] == 0 and abs(float(logp.grad[0, 1]) - 1.5) < 1e-6 and abs(float(logp.grad[0, 2]) + 1) < 1e-6
    assert abs(stats["clip_fraction"] - 1 / 3) < 1e-6


@pytest.mark.parametrize("broken", [{"pessimistic": False}, {"ref_kl": False}])
def test_broken_variants_are_caught(broken):
    """Clipping on the wrong side (min instead of max) and the KL to pi_old instead of pi_ref."""
    t = _batch(3, 37)
    want = ppo_loss_ref(t["logp"], t["old"], t["ref"], t["adv"], t["w"], beta=0.1)
    got = ppo_loss(t["logp"], t["old"], t["ref"], t["adv"], t["w"], beta=0.1, **broken)
    with pytest.raises(MismatchError):
        assert_close(got, want, name=str(broken))


def test_kl_estimators_are_unbiased_or_not_as_the_note_says():
    """Samples of pi = N(0, 1), pi_ref = N(0.3, 1): KL = 0.045. k1 and k3 are unbiased, k3 never negative;
    k2 is biased but close for nearby distributions (Schulman 2020)."""
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp = -0.5 * x ** 2
    ref = -0.5 * (x - 0.3) ** 2
    true = 0.3 ** 2 / 2
    k1, k2, k3 = (kl_estimate_ref(logp, ref, k) for k in ("k1", "k2", "k3"))
    assert abs(float(k1.mean()) - true) < 3e-3 and abs(float(k3.mean()) - true) < 3e-3
    assert float(k1.min()) < 0 <= float(k3.min())
    assert abs(float(k2.mean()) - true) < 0.01
    with pytest.raises(ValueError, match="kl must be one of"):
        kl_estimate_ref(logp, ref, "k4")


def test_bad_inputs_are_refused():
    t = _batch(2, 5)
    with pytest.raises(ValueError, match="old_logp|has shape"):
        ppo_loss(t["logp"], t["old"][:, :3], t["ref"], t["adv"], t["w"])
    with pytest.raises(ValueError, match="kl must be one of"):
        ppo_loss(t["logp"], t["old"], t["ref"], t["adv"], t["w"], kl="k9")
    with pytest.raises(ValueError, match="go together"):
        ppo_loss(t["logp"], t["old"], t["ref"], t["adv"], t["w"], values=t["values"])
    with pytest.raises(TypeError, match="floating-point"):
        ppo_loss(t["logp"], t["old"].long(), t["ref"], t["adv"], t["w"])


def test_gae_on_a_hand_made_trajectory():
    """Three tokens, reward 1 at the end, values 0.5, 0.6, 0.7: lambda = 1 gives return - value,
    lambda = 0 gives the one-step TD errors (gamma = 1)."""
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    a1, R1 = gae(r, v, m, 1.0, 1.0)
    a0, _ = gae(r, v, m, 1.0, 0.0)
    assert torch.allclose(a1, torch.tensor([[0.5, 0.4, 0.3]])) and torch.allclose(R1, torch.ones(1, 3))
    assert torch.allclose(a0, torch.tensor([[0.1, 0.1, 0.3]]))


@pytest.mark.parametrize("B,T", [(1, 1), (70, 5), (130, 9)])
def test_gae_kernel_matches_reference_with_padding(B, T):
    g = torch.Generator().manual_seed(B)
    r = torch.randn(B, T, generator=g, dtype=torch.float64).float()
    v = torch.randn(B, T, generator=g, dtype=torch.float64).float()
    m = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    for got, want in zip(gae(r, v, m, 0.9, 0.8), gae_ref(r, v, m, 0.9, 0.8)):
        assert_close(got, want, name="gae")
    broken = gae(r, v, m, 0.9, 0.8, bootstrap=False)[0]
    if T > 1:
        with pytest.raises(MismatchError):
            assert_close(broken, gae_ref(r, v, m, 0.9, 0.8)[0], name="gae without bootstrap")
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(r, v, m, 1.5, 0.9)


def test_token_rewards_put_the_task_reward_on_the_last_real_token():
    from kernels.rl.ppo_run import token_rewards
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    z = torch.zeros(2, 4)
    r = token_rewards(torch.tensor([1.0, 0.5]), z + 0.1, z, mask, kl_coef=0.5)
    assert torch.allclose(r, torch.tensor([[-0.05, 0.95, 0, 0], [-0.05, -0.05, -0.05, 0.45]]))


def test_committed_ppo_run_reproduces_its_first_step():
    import json

    from kernels.rl import ppo_run, sft
    log = sft.read_log(sft.OUT_DIR / "ppo" / "log.csv")
    meta = json.loads((sft.OUT_DIR / "ppo" / "metrics.json").read_text())
    threads = torch.get_num_threads()
    try:
        got = ppo_run.train_ppo(None, steps=meta["steps"], progress=False, stop_after=1)["log"][1]
    finally:
        torch.set_num_threads(threads)
    assert got["reward"] == log[1]["reward"] and abs(got["value_error"] - log[1]["value_error"]) < 1e-4
