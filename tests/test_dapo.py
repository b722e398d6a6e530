"""kernels.rl.dapo: the policy-loss kernel (token ratio, GSPO's sequence ratio, GPG's no ratio, ASPO's flip), DAPO's
switches (clip-higher, dynamic sampling, overlong shaping), GPG's advantage, the sm_90a build, the runs."""
import json
import re

import kernels  # noqa: F401  (before triton)
import pytest
import torch

from kernels.inspect import compile_triton_many
from kernels.rl import dapo, sft
from kernels.rl.dapo import (DUAL_CLIP, RATIOS, aggregation_weights, completion_lengths, gpg_advantages_ref, informative_groups,
                             overlong_penalty_ref, policy_loss, policy_loss_ref)
from kernels.rl import task
from kernels.testing import MismatchError, assert_close, nan_canary, pinned_triton


def _inputs(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    return logp, old, adv, mask


def _grads(fn, logp, old, adv, w, mask, **kw):
    lp = logp.clone().requires_grad_()
    loss = fn(lp, old, adv, w, mask, **kw)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("B,T", [(7, 5), (37, 13), (3, 1100), (1, 1)])
@pytest.mark.parametrize("ratio", list(RATIOS))
@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_kernel_matches_autograd_reference(B, T, ratio, aggregation):
    logp, old, adv, mask = _inputs(B, T, seed=B + T)
    w = aggregation_weights(mask, aggregation)
    # the kernel sees row views inside NaN buffers, with NaN on every padding token as well
    pad = mask == 0
    lp_k = nan_canary(logp.masked_fill(pad, float("nan")), rows=True)
    old_k = nan_canary(old.masked_fill(pad, float("nan")), rows=True)
    w_k, m_k = nan_canary(w, rows=True), nan_canary(mask, rows=True)
    lp_view = lp_k.detach().requires_grad_()
    got = policy_loss(lp_view, old_k, adv, w_k, m_k, ratio=ratio)
    got.backward()
    want, want_grad = _grads(policy_loss_ref, logp, old, adv, w, mask, ratio=ratio)
    assert_close(got.detach(), want, name="loss")
    assert_close(lp_view.grad, want_grad, name="dlogp")


@pytest.mark.parametrize("broken,ratio", [("no_length_exponent", "sequence"), ("clip_higher_on_negative", "token"),
                                          ("flip_on_negative", "aspo"), ("no_stop_gradient", "aspo")])
def test_broken_variants_are_caught(broken, ratio):
    B, T = 6, 4
    logp = torch.zeros(B, T)
    old = torch.full((B, T), 0.3)                  # r = e^-0.3 = 0.74: inside (1 - 0.28, 1 - 0.2)
    adv = torch.tensor([-1.0, -0.5, 1.0, -2.0, 0.5, -1.0])
    mask = torch.ones(B, T)
    w = aggregation_weights(mask, "token")
    want = _grads(policy_loss_ref, logp, old, adv, w, mask, ratio=ratio)
    got = _grads(policy_loss, logp, old, adv, w, mask, ratio=ratio, broken=broken)
    with pytest.raises(MismatchError):
        assert_close(got[1], want[1], name=broken)


def test_aspo_kernel_matches_reference_in_every_region():
    """Log-ratios spread wide enough that every ASPO region occurs: for A < 0 hard-clipped (r < 0.8), free and
    dual-clipped (r > 3); for A >= 0 dual-clipped (r < 1/3), free and hard-clipped (r > 1.28); canaries on."""
    B, T = 23, 37
    g = torch.Generator().manual_seed(11)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 1.5 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    adv[0] = 0.0                                                              # A = 0 takes the positive side: no gradient
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    r, m, A = torch.exp(logp - old), mask > 0, adv[:, None].expand(B, T)
    regions = {"neg clipped": (A < 0) & (r < 0.8), "neg free": (A < 0) & (r > 0.8) & (r < DUAL_CLIP),
               "neg dual": (A < 0) & (r > DUAL_CLIP), "pos dual": (A > 0) & (r < 1 / DUAL_CLIP),
               "pos free": (A > 0) & (r > 1 / DUAL_CLIP) & (r < 1.28), "pos clipped": (A > 0) & (r > 1.28)}
    for name, where in regions.items():
        assert int((where & m).sum()) >= 5, name
    w = aggregation_weights(mask, "token")
    pad = mask == 0
    lp_view = nan_canary(logp.masked_fill(pad, float("nan")), rows=True).detach().requires_grad_()
    got, stats = policy_loss(lp_view, nan_canary(old.masked_fill(pad, float("nan")), rows=True), adv,
                             nan_canary(w, rows=True), nan_canary(mask, rows=True), ratio="aspo", return_stats=True)
    got.backward()
    want, want_grad = _grads(policy_loss_ref, logp, old, adv, w, mask, ratio="aspo")
    assert_close(got.detach(), want, name="loss")
    assert_close(lp_view.grad, want_grad, name="dlogp")
    hard = int(((regions["neg clipped"] | regions["pos clipped"]) & m).sum())
    assert abs(stats["clip_fraction"] * m.sum() - hard) < 1e-3                # the stat counts hard-clipped tokens only


def test_aspo_flips_the_positive_weight_and_soft_clips_both_sides():
    """One token per row, gradient -d loss / d logp read through the kernel, against the hand-derived weights:
    A = +1: 1/r on [1/3, 1.28], c = 3 below 1/3 (the gradient kept, its size capped), 0 above 1.28;
    A = -1: -r on [0.8, 3], -c above 3, 0 below 0.8. The token ratio's weight for A = +1 is r instead."""
    r = torch.tensor([0.2, 0.3, 0.5, 0.9, 1.0, 1.2, 1.5, 2.0, 4.0])
    lp, old, mask = torch.log(r)[:, None], torch.zeros(9, 1), torch.ones(9, 1)
    for A in (1.0, -1.0):
        adv = torch.full((9,), A)
        g = -_grads(policy_loss, lp, old, adv, mask, mask, ratio="aspo")[1][:, 0]
        if A > 0:
            want = torch.where(r < 1 / 3, torch.tensor(3.0), torch.where(r <= 1.28, 1 / r, torch.tensor(0.0)))
        else:
            want = torch.where(r > 3, torch.tensor(-3.0), torch.where(r >= 0.8, -r, torch.tensor(0.0)))
        assert torch.allclose(g, want, rtol=1e-5, atol=1e-6), (A, g, want)
    tok = -_grads(policy_loss, lp, old, torch.ones(9), mask, mask, ratio="token")[1][:, 0]
    assert torch.allclose(tok, torch.where(r <= 1.28, r, torch.tensor(0.0)), rtol=1e-5, atol=1e-6)


def test_aspo_on_policy_equals_the_token_ratio():
    """At pi = pi_old every r = 1 = 1/r: ASPO's first update on fresh samples is GRPO's."""
    logp, _, adv, mask = _inputs(9, 6, seed=4)
    w = aggregation_weights(mask, "token")
    assert_close(_grads(policy_loss, logp, logp, adv, w, mask, ratio="aspo")[1],
                 _grads(policy_loss, logp, logp, adv, w, mask, ratio="token")[1], name="on-policy")


def test_clip_higher_widens_only_the_upper_bound():
    """A > 0 with r = 1.25: clipped at eps_high 0.2, free at 0.28. A < 0 with r = 0.75: clipped either way."""
    logp = torch.log(torch.tensor([[1.25], [0.75]]))
    old, mask = torch.zeros(2, 1), torch.ones(2, 1)
    adv = torch.tensor([1.0, -1.0])
    w = aggregation_weights(mask, "token")
    g_sym = _grads(policy_loss, logp, old, adv, w, mask, eps_low=0.2, eps_high=0.2)[1]
    g_dapo = _grads(policy_loss, logp, old, adv, w, mask, eps_low=0.2, eps_high=0.28)[1]
    assert g_sym.flatten().tolist() == [0.0, 0.0]
    assert abs(float(g_dapo[0, 0]) + 0.5 * 1.25) < 1e-6 and float(g_dapo[1, 0]) == 0.0


def test_sequence_ratio_spreads_one_tokens_change_over_the_answer():
    """One token moved (r = 1.5), three not; A > 0. Token ratios clip that token and leave the others; the
    sequence ratio s = 1.5^(1/4) = 1.107 is inside the clip, so every token gets -A s / |o| (times the weight)."""
    logp = torch.tensor([[float(torch.log(torch.tensor(1.5))), 0.0, 0.0, 0.0]])
    old, mask, adv = torch.zeros(1, 4), torch.ones(1, 4), torch.tensor([1.0])
    w = aggregation_weights(mask, "sequence")                                 # 1/4 per token, one answer
    g_tok = _grads(policy_loss, logp, old, adv, w, mask, ratio="token", eps_high=0.2)[1]
    g_seq = _grads(policy_loss, logp, old, adv, w, mask, ratio="sequence", eps_high=0.2)[1]
    s = 1.5 ** 0.25
    assert g_tok.flatten().tolist() == [0.0, -0.25, -0.25, -0.25]
    assert torch.allclose(g_seq, torch.full((1, 4), -s / 4), atol=1e-6)


def test_on_policy_the_two_ratios_give_the_same_gradient():
    """At pi = pi_old every ratio is 1: GSPO's gradient c_i A_i / |o_i| equals GRPO's per-sequence one."""
    logp, _, adv, mask = _inputs(9, 6, seed=3)
    w = aggregation_weights(mask, "sequence")
    g_tok = _grads(policy_loss, logp, logp, adv, w, mask, ratio="token")[1]
    g_seq = _grads(policy_loss, logp, logp, adv, w, mask, ratio="sequence")[1]
    assert_close(g_seq, g_tok, name="on-policy")


def test_gpg_gradient_is_minus_advantage_times_weight():
    logp, old, adv, mask = _inputs(5, 7, seed=1)
    w = aggregation_weights(mask, "token")
    g = _grads(policy_loss, logp, old, adv, w, mask, ratio="none")[1]
    assert_close(g, -adv[:, None] * w, name="gpg")


def test_gpg_advantage_rescales_by_the_informative_share():
    r = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0])                  # 3 groups of 4, one informative
    a = gpg_advantages_ref(r, 4)
    assert a[:4].tolist() == [0.0] * 4 and a[8:].tolist() == [0.0] * 4
    assert torch.allclose(a[4:8], 3 * (r[4:8] - 0.25))                        # alpha = 12 / (12 - 8) = 3


def test_overlong_penalty_follows_dapo():
    pen = overlong_penalty_ref(torch.tensor([1, 4, 5, 6, 7, 16, 17, 20, 21]), 20, 4)
    assert pen.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.25, -1.0, -1.0]
    comp = torch.tensor([[ord("5"), task.END, 0, 0, 0, 0], [ord("1")] * 5 + [task.END], [ord("1")] * 6])
    assert completion_lengths(comp).tolist() == [2, 6, 7]
    assert overlong_penalty_ref(completion_lengths(comp), dapo.L_MAX, dapo.L_CACHE).tolist() == [0.0, -1.0, -1.0]


def test_dynamic_sampling_keeps_groups_with_mixed_rewards():
    r = torch.tensor([0.0, 0, 0, 1, 1, 1, 0, 1, 0])
    assert informative_groups(r, 3).tolist() == [False, False, True]


def test_bad_inputs_are_refused():
    z, m, a = torch.zeros(4, 3), torch.ones(4, 3), torch.zeros(4)
    with pytest.raises(ValueError, match="ratio must be one of"):
        policy_loss(z, z, a, m, m, ratio="seq")
    with pytest.raises(ValueError, match="broken must be one of"):
        policy_loss(z, z, a, m, m, broken="yes")
    with pytest.raises(ValueError, match=r"advantages must be a floating-point \(B,\)"):
        policy_loss(z, z, torch.zeros(4, 3), m, m)
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(z, z, a, m, torch.ones(4, 2))
    with pytest.raises(TypeError, match="old must be a float32"):
        policy_loss(z, z.double(), a, m, m)
    with pytest.raises(ValueError, match="eps_low must be in"):
        policy_loss(z, z, a, m, m, eps_low=1.5)
    with pytest.raises(ValueError, match="dual_clip applies to ratio='aspo' only"):
        policy_loss(z, z, a, m, m, ratio="token", dual_clip=3.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(z, z, a, m, m, ratio="aspo", dual_clip=1.0)
    with pytest.raises(ValueError, match="need 0 < l_cache <= l_max"):
        overlong_penalty_ref(torch.tensor([3]), 4, 5)


def _program_id_widened(ttgir: str) -> bool:
    ids = re.findall(r"(%[\w]+) = tt\.get_program_id", ttgir)
    uses = [line for pid in ids for line in ttgir.splitlines()
            if re.search(rf"{pid}\b", line) and "tt.get_program_id" not in line]
    return bool(ids) and all("arith.extsi" in u and "to i64" in u for u in uses)


def test_sm90_builds_at_real_size_do_not_spill():
    jobs = dapo.compile_jobs()
    builds = compile_triton_many(list(jobs.values()), archs=("sm90",))
    for (label, job), b in zip(jobs.items(), builds):
        b = b["sm90"]
        assert job.grid == (512 * 16 // 2,), label                            # 2 rows of 1024-token chunks
        assert b.arch.nvcc_arch == "sm_90a"
        # spill-free under the pinned Triton; Triton 3.6 (the lent GPUs, `make compat`) spills 3 registers
        # in the sequence-ratio build, which README "Other versions" records
        assert (b.spills == 0 and b.metadata["stack_bytes"] == 0) or not pinned_triton(), label
        assert _program_id_widened(b.ttgir), label
        fam = b.families("sass")
        if "none" not in label:
            assert fam["MUFU"] > 0, label                                     # the ratio's exp on the SFU


def test_committed_runs_reproduce_their_first_step():
    # the sequence-ratio and ASPO kernels, DAPO's switches; at 64 prompts: DAPO, GPG's path (no ratio, its advantage),
    # GSPO's and ASPO's
    for arm in ("gspo", "aspo", "dapo", "batch64/dapo", "batch64/gpg", "batch64/gspo", "batch64/aspo"):
        run = dapo.OUT_DIR / arm / "seed0"
        meta = json.loads((run / "metrics.json").read_text())
        want = sft.read_log(run / "log.csv")[1]                                # row 0 is the step-0 evaluation
        threads = torch.get_num_threads()
        try:
            got = dapo.train_arm(meta["arm"], None, steps=meta["steps"], prompts_per_step=meta["prompts_per_step"],
                                 lr=meta["lr"], warmup=meta["warmup"], seed=meta["seed"], progress=False,
                                 stop_after=1)["log"][1]
        finally:
            torch.set_num_threads(threads)
        assert got["reward"] == want["reward"] and got["prompts_drawn"] == want["prompts_drawn"], arm
        assert abs(got["kl"] - want["kl"]) < 1e-3 * max(1.0, want["kl"]) + 1e-5, arm
        assert abs(got["clip_fraction"] - want["clip_fraction"]) < 0.02, arm


def test_token_ratio_equals_the_ppo_kernel_with_decoupled_clip():
    """RATIO 0 is the GRPO chapter's path (kernels.rl.ppo with clip_eps_high, beta 0): same loss, same gradient."""
    from kernels.rl.ppo import ppo_loss

    logp, old, adv, mask = _inputs(11, 6, seed=5)
    w = aggregation_weights(mask, "token")
    ours = _grads(policy_loss, logp, old, adv, w, mask, ratio="token", eps_low=0.2, eps_high=0.28)
    lp = logp.clone().requires_grad_()
    loss = ppo_loss(lp, old, old, adv[:, None].expand_as(lp), w, clip_eps=0.2, clip_eps_high=0.28, beta=0.0)
    loss.backward()
    assert_close(ours[0], loss.detach(), name="loss")
    assert_close(ours[1], lp.grad, name="dlogp")
