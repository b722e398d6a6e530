"""kernels.rl.rft: the verifier as a filter, the pass@k estimator (kernel vs exact binomials), the run."""
import json
import math

import kernels  # noqa: F401  (before triton)
import pytest
import torch

from kernels.inspect import compile_triton_many, param_product_widths
from kernels.rl import rft, sft, task
from kernels.rl.rft import pass_at_k, pass_at_k_exact, pass_at_k_ref
from kernels.testing import MismatchError, assert_close, nan_canary


def _problems(P, n_lo, n_hi, seed):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(n_lo, n_hi + 1, (P,), generator=g)
    c = torch.minimum((torch.rand(P, generator=g) * (n + 1)).long(), n)
    c[:3] = torch.stack([torch.tensor(0), n[1], n[2] - 1])      # none correct, all correct, one wrong
    return n, c


def test_reference_matches_exact_binomials():
    n, c = _problems(40, 100, 200, 0)
    ref = pass_at_k_ref(n, c, 100)
    exact = torch.tensor([[pass_at_k_exact(int(a), int(b), k) for k in range(1, 101)] for a, b in zip(n, c)],
                         dtype=torch.float64)
    assert float((ref - exact).abs().max()) < 1e-12
    assert math.comb(200, 100) > 1e58            # the binomials themselves overflow float32 (and float64 at n > 1030)


@pytest.mark.parametrize("P,n_lo,n_hi,k_max,blocks", [(1, 1, 1, 1, None), (77, 40, 70, 40, (16, 16)),
                                                      (33, 50, 64, 50, (32, 32)), (500, 128, 128, 128, None)])
def test_kernel_matches_reference(P, n_lo, n_hi, k_max, blocks):
    n, c = _problems(P, n_lo, n_hi, P) if P > 2 else (torch.tensor([1]), torch.tensor([1]))
    got = pass_at_k(nan_canary(n), nan_canary(c.int()), k_max, blocks=blocks)
    assert_close(got, pass_at_k_ref(n, c, k_max).float(), name="pass@k")
    assert bool((got[:, 0] - c / n).abs().max() < 1e-6)          # pass@1 = c / n
    assert bool((got[:, 1:] >= got[:, :-1] - 1e-6).all())       # non-decreasing in k


def test_broken_biased_estimator_is_caught():
    n, c = _problems(20, 20, 40, 3)
    with pytest.raises(MismatchError):
        assert_close(pass_at_k(n, c, 20, biased=True), pass_at_k_ref(n, c, 20).float(), name="biased")
    assert_close(pass_at_k(n, c, 20, biased=True), rft.pass_at_k_biased(n, c, 20).float(), name="biased vs formula")


def test_unbiased_in_expectation_and_plug_in_is_not():
    """E over c ~ Binomial(n, p) of the estimator is 1 - (1-p)^k exactly; the plug-in falls short."""
    n, p, k = 20, 0.1, 10
    pmf = torch.tensor([math.comb(n, c) * p**c * (1 - p) ** (n - c) for c in range(n + 1)], dtype=torch.float64)
    cs = torch.arange(n + 1)
    unbiased = float(pmf @ pass_at_k_ref(torch.full((n + 1,), n), cs, k)[:, k - 1])
    plug_in = float(pmf @ rft.pass_at_k_biased(torch.full((n + 1,), n), cs, k)[:, k - 1])
    assert abs(unbiased - (1 - (1 - p) ** k)) < 1e-12 and plug_in < unbiased - 0.05


def test_bad_inputs_are_refused():
    n, c = torch.tensor([10, 12]), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="c must be a 1-D int32 or int64"):
        pass_at_k(n, c.float(), 2)
    with pytest.raises(ValueError, match="same shape"):
        pass_at_k(n, c[:1], 2)
    with pytest.raises(ValueError, match="k_max=11 exceeds the smallest n=10"):
        pass_at_k(n, c, 11)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(n, torch.tensor([11, 0]), 2)
    with pytest.raises(ValueError, match="k_max must be a positive int"):
        pass_at_k(n, c, 0)
    with pytest.raises(ValueError, match="blocks must be two powers of two"):
        pass_at_k(n, c, 2, blocks=(24, 16))


def test_filter_keeps_distinct_correct_answers():
    pairs = torch.tensor([[12, 30]] * 3 + [[5, 5]] * 3)
    ids = lambda s: [*s.encode(), task.END] + [task.END] * (task.MAX_ANSWER - len(s) - 1)  # noqa: E731
    comp = torch.tensor([ids("42"), ids("42"), ids("41"), ids("10"), ids("1"), ids("100")])
    comp[1, -1] = ord("7")                                       # after END: ignored by the verifier and the filter
    assert rft.keep_correct(comp, pairs, 3) == [(12, 30, "42"), (5, 5, "10")]
    assert rft.keep_correct(comp, pairs, 3, distinct=False) == [(12, 30, "42"), (12, 30, "42"), (5, 5, "10")]


def test_multi_answer_filter_keeps_each_accepted_string_once():
    pairs = torch.tensor([[12, 30]] * 4)
    ids = lambda s: [*s.encode(), task.END] + [task.END] * (task.MAX_ANSWER - len(s) - 1)  # noqa: E731
    comp = torch.tensor([ids("43"), ids("41"), ids("43"), ids("44")])
    assert rft.accepted(12, 30, 1) == {b"41", b"42", b"43"} and rft.accepted(0, 0, 1) == {b"0", b"1"}
    assert rft.rewards_within(comp, pairs, 1).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert rft.keep_correct(comp, pairs, 4, tol=1) == [(12, 30, "43"), (12, 30, "41")]
    assert len(rft.keep_correct(comp, pairs, 4, tol=1, distinct=False)) == 3


def test_tolerance_zero_is_the_task_reward():
    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, 100, (300, 2), generator=g)
    comp = torch.randint(48, 58, (300, task.MAX_ANSWER), generator=g)     # random digits ...
    comp[:, 2] = task.END                                                 # ... two of them, then END
    comp[:100, :2] = torch.tensor([[ord(c) for c in f"{a + b:02d}"[-2:]] for a, b in pairs[:100].tolist()])
    assert torch.equal(rft.rewards_within(comp, pairs, 0), task.rewards(comp, pairs))
    assert rft.rewards_within(comp, pairs, 0).sum() > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_committed_run_reproduces_its_first_samples(seed):
    meta = json.loads((rft.OUT / f"seed{seed}.json").read_text())
    threads = torch.get_num_threads()
    try:
        got = rft.run(None, tol=meta["tol"], train_prompts=meta["train_prompts"], k=meta["k"], seed=seed,
                      progress=False, stop_after_collect=125)
    finally:
        torch.set_num_threads(threads)
    assert got["c"] == meta["collect"]["c"][:125] and got["first"] == meta["collect"]["first"][:125]
    n = {}
    for a, b, _ in got["kept"]:
        n[(a, b)] = n.get((a, b), 0) + 1
    assert list(n.values()) == [d for d in meta["collect"]["distinct_per_prompt"][:125] if d]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_committed_temperature_runs_reproduce_their_first_samples(seed):
    """rft.collect_temperature's collection at each temperature: its first 125 prompts re-sampled from the SFT
    model with the run's generator give the stored per-prompt counts and distinct kept strings exactly."""
    meta = json.loads((rft.OUT / f"seed{seed}-temperature.json").read_text())
    pool = task.split_pairs()[0][:meta["train_prompts"]][:125]
    base = sft.load_sft()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in meta["temperatures"]:
            got = rft.sample_groups(base, pool, meta["k"], torch.Generator().manual_seed(seed), tol=meta["tol"],
                                    temperature=t)
            want = meta["runs"][str(t)]["collect"]
            assert got["c"] == want["c"][:125], t
            assert rft._distinct_per_prompt(got["kept"], pool) == want["distinct_per_prompt"][:125], t
    finally:
        torch.set_num_threads(threads)


def test_committed_second_round_reproduces_its_first_samples():
    """rft.second_round, seed 0: the round-1 model rebuilt (whole collection, 60 fine-tuning steps) samples the
    first 125 training prompts of round 2's collection with the stored counts and distinct kept strings."""
    meta = json.loads((rft.OUT / "seed0-round2.json").read_text())
    threads = torch.get_num_threads()
    try:
        got = rft.second_round(None, tol=meta["tol"], train_prompts=meta["train_prompts"], k=meta["k"],
                               steps=meta["steps"], lr=meta["lr"], seed=0, progress=False, stop_after_collect=125)
    finally:
        torch.set_num_threads(threads)
    pool = task.split_pairs()[0][:125]
    assert got["c"] == meta["collect"]["c"][:125]
    assert rft._distinct_per_prompt(got["kept"], pool) == meta["collect"]["distinct_per_prompt"][:125]


@pytest.fixture(scope="module")
def builds():
    jobs = rft.compile_jobs()
    return dict(zip(jobs, (b["sm90"] for b in compile_triton_many(list(jobs.values()), archs=("sm90",)))))


def test_sm90_builds_do_not_spill_and_offsets_are_64_bit(builds):
    for label, b in builds.items():
        assert b.arch.nvcc_arch == "sm_90a"
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        assert b.families("sass")["MUFU"] > 0, label            # the division 1 - k / i: MUFU.RCP
        assert 64 in param_product_widths(b, 4), label           # rows * K in 64 bits
