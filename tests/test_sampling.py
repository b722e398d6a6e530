"""kernels.serving.sampling: the Triton sampler draws the reference's tokens from the same keys, both
match the target distribution by a chi-square test (a top-p that keeps one token too few fails it),
greedy is exactly argmax, keys make draws reproducible, bad input is refused by name, and the kernel
compiles for sm_90a at real vocabularies without spills and with a 64-bit row offset."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels.serving import sampling as S
from kernels.serving.sampling import SamplingParams
from kernels.testing import nan_canary

MIXED = [SamplingParams(),                                                   # greedy
         SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.7, top_k=5),
         SamplingParams(temperature=1.3, top_p=0.8),
         SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05),
         SamplingParams(temperature=0.5, top_k=1),
         SamplingParams(temperature=2.0, min_p=0.3),
         SamplingParams(temperature=1.0, top_k=400)]                          # k >= V: off


def _rows(R, V, seed=0, scale=2.0):
    return torch.randn(R, V, generator=torch.Generator().manual_seed(seed)) * scale


def _args(params, keys=None):
    t, k, tp, mp = S._row_params(params)
    if keys is None:
        keys = torch.tensor([S.row_key(1000 + r, 0, 3) for r in range(len(params))], dtype=torch.int64)
    return t, k, tp, mp, keys


def test_philox_known_answer_and_uniforms_inside_the_open_interval():
    # Random123's known-answer test for philox4x32-10: key 0, counter 0 -> first word 0x6627e8d5
    # (Salmon et al. 2011; DEShawResearch/random123, tests/kat_vectors)
    assert int(S.philox_randint_ref(torch.tensor([0]), 1)[0, 0]) == 0x6627E8D5
    u = S.uniform_ref(torch.tensor([7, 2 ** 62 + 5]), 4096)
    assert u.min() > 0 and u.max() < 1 and u.dtype == torch.float32
    assert abs(float(u.mean()) - 0.5) < 0.02


@pytest.mark.parametrize("V,block_v", [(37, None), (300, 64), (256, None)],
                         ids=["V37-one-tile", "V300-five-tiles", "V256"])
def test_kernel_draws_the_reference_tokens(V, block_v):
    params = MIXED * 2
    logits = _rows(len(params), V, seed=V)
    args = _args(params, torch.tensor([S.row_key(r, r % 3, r) for r in range(len(params))], dtype=torch.int64))
    want, want_kept = S.sample_ref(logits, *args, num_samples=4)
    got, got_kept = S.sample(nan_canary(logits, rows=True), *args, num_samples=4, block_v=block_v)
    assert torch.equal(got_kept, want_kept), (got_kept, want_kept)
    assert torch.equal(got, want)
    q = S.processed_probs_ref(logits, params)
    assert torch.equal(want_kept, (q > 0).sum(-1).int())                       # kept = support of q
    assert bool((q.gather(1, got) > 0).all())                                  # every draw is a kept token


def test_greedy_is_exactly_argmax_first_index_on_ties():
    logits = _rows(5, 50, seed=3)
    logits[1, [7, 30]] = logits[1].max() + 1.0                                 # a tie: the first index wins
    params = [SamplingParams()] * 5
    got, kept = S.sample(logits, *_args(params), block_v=16)
    assert torch.equal(got[:, 0], logits.argmax(-1)) and got[1, 0] == 7 and bool((kept == 1).all())
    sampler_tokens = S.Sampler(use_kernels=False)(logits, [S.SampleRow(p, 0, 0, 0) for p in params]).tokens
    assert sampler_tokens == logits.argmax(-1).tolist()


CHI_CASES = {
    "temperature 0.9": SamplingParams(temperature=0.9),
    "top-k 6": SamplingParams(temperature=1.0, top_k=6),
    "top-p 0.85": SamplingParams(temperature=1.0, top_p=0.85),
    "top-k 12 + top-p 0.9 + min-p 0.02": SamplingParams(temperature=1.2, top_k=12, top_p=0.9, min_p=0.02),
}
N_DRAWS = 8192


@pytest.fixture(scope="module")
def chi_row():
    return _rows(1, 41, seed=11, scale=1.0)                                   # 41 tokens, a flat-ish row


@pytest.mark.parametrize("label", list(CHI_CASES))
def test_chi_square_against_the_target_distribution(chi_row, label):
    params = CHI_CASES[label]
    q = S.processed_probs_ref(chi_row, [params])[0]
    args = _args([params], torch.tensor([S.row_key(99, 0, 0)], dtype=torch.int64))
    for name, draw in (("kernel", S.sample), ("reference", S.sample_ref)):
        tokens, _ = draw(chi_row, *args, num_samples=N_DRAWS)
        stat, dof, p = S.chi_square(tokens[0], q)
        assert dof >= 2 and p > 1e-3, f"{name} {label}: chi2 {stat:.1f} on {dof} dof, p = {p:.2e}"


@pytest.mark.parametrize("label", ["top-p 0.85", "top-k 12 + top-p 0.9 + min-p 0.02"])
def test_chi_square_catches_a_top_p_one_token_short(chi_row, label):
    params = CHI_CASES[label]
    q = S.processed_probs_ref(chi_row, [params])[0]
    args = _args([params], torch.tensor([S.row_key(99, 0, 0)], dtype=torch.int64))
    tokens, kept = S.sample(chi_row, *args, num_samples=N_DRAWS, short_top_p=True)
    assert int(kept) == int((q > 0).sum()) - 1
    stat, dof, p = S.chi_square(tokens[0], q)
    assert p < 1e-9, f"the broken sampler passed: chi2 {stat:.1f}, p = {p:.2e}"


def test_chi_square_sees_a_sample_outside_the_support():
    q = torch.tensor([0.5, 0.5, 0.0])
    assert S.chi_square(torch.tensor([0, 1] * 50 + [2]), q)[2] == 0.0


def test_keys_make_draws_reproducible_and_distinct():
    logits = _rows(1, 64, seed=5, scale=0.5).expand(6, 64).contiguous()
    params = [SamplingParams(temperature=1.0)] * 6
    keys = torch.tensor([S.row_key(1, 0, 0), S.row_key(1, 0, 0), S.row_key(1, 1, 0), S.row_key(1, 0, 1),
                         S.row_key(2, 0, 0), S.row_key(3, 0, 0)], dtype=torch.int64)
    a, _ = S.sample_ref(logits, *_args(params, keys), num_samples=8)
    assert torch.equal(a[0], a[1])                                             # same seed, choice, step
    assert len({tuple(r.tolist()) for r in a[1:]}) == 5                        # any of them changed: new draws
    assert len({S.row_key(s, c, t) for s in range(4) for c in range(4) for t in range(64)}) == 4 * 4 * 64


def test_sampler_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = _rows(3, 30, seed=8)
    rows = [S.SampleRow(SamplingParams(temperature=0.8, logprobs=3), 5, 0, 0),
            S.SampleRow(SamplingParams(logprobs=0), 5, 0, 0),
            S.SampleRow(SamplingParams(temperature=1.0), 5, 0, 0)]
    out = S.Sampler()(logits, rows)
    lp = torch.log_softmax(logits, -1)
    assert abs(out.logprobs[0] - float(lp[0, out.tokens[0]])) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == lp[0].topk(3).indices.tolist()
    assert out.top_logprobs[1] == [] and out.logprobs[2] is None and out.top_logprobs[2] is None
    with pytest.raises(FloatingPointError, match="NaN"):
        S.Sampler()(torch.full((3, 30), float("nan")), rows)


def test_bad_inputs_are_refused_by_name():
    logits = _rows(2, 10)
    args = list(_args([SamplingParams(temperature=1.0)] * 2))
    with pytest.raises(ValueError, match="logits must be"):
        S.sample(logits[0], *args)
    with pytest.raises(ValueError, match="top_k must be"):
        S.sample(logits, args[0], args[1].long(), *args[2:])
    with pytest.raises(ValueError, match="keys must be"):
        S.sample(logits, *args[:4], args[4][:1])
    with pytest.raises(ValueError, match="num_samples must be a power of two"):
        S.sample(logits, *args, num_samples=3)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        S.sample(logits.t().contiguous().t(), *args)
    for kwargs, name in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                         (dict(min_p=1.5), "min_p"), (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"),
                         (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"),
                         (dict(stop_token_ids=[1]), "stop_token_ids"), (dict(temperature=float("nan")), "temperature")):
        with pytest.raises(ValueError, match=f"SamplingParams: {name} must be"):
            SamplingParams(**kwargs)


# ---------------------------------------------------------------- ahead of time, at real vocabularies

@pytest.fixture(scope="module")
def aot():
    jobs = S.compile_jobs()
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))
    return jobs, dict(zip(jobs, builds))


def test_compiles_without_spills_at_real_vocabularies(aot):
    jobs, builds = aot
    assert len(jobs) == 2
    for label, b in builds.items():
        for arch in ("sm80", "sm90"):
            assert b[arch].spills == 0 and b[arch].metadata["stack_bytes"] == 0, f"{label} {arch} spills"
        assert jobs[label].programs == 64                                      # one program per row


def test_row_offset_is_a_64bit_product(aot):
    """r * stride_row passes 2**31 at a batch of 17000 rows of Llama 3's vocabulary: the PTX multiplies
    stride_row in 64 bits."""
    jobs, builds = aot
    label = next(iter(jobs))
    runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
    assert ki.param_product_widths(builds[label]["sm90"], runtime_args.index("stride_row")) == {64}


def test_tiny_temperatures_are_greedy_and_top_k_fits_int32():
    """Below GREEDY_BELOW = 1e-5, 1/T or logit/T overflows fp32 (1e-39: every z is inf, z - max z NaN, the
    server answered NUL bytes): such rows are greedy, in the reference, the kernel and the Sampler. The
    broken arithmetic is real: the same rows scaled by 1/T in fp32 are NaN. top_k above int32 is refused."""
    logits = _rows(4, 40, seed=9)
    tiny = [SamplingParams(temperature=t, top_k=5) for t in (1e-39, 1e-38, 5e-324, 9.9e-6)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=1e-5).greedy
    raw = logits * (1.0 / torch.tensor([[1e-39]], dtype=torch.float32))
    assert torch.isnan(raw - raw.max(-1, keepdim=True).values).any()      # what the old path computed
    t, k, tp, mp, keys = _args(tiny)
    assert bool((t == 0).all())
    assert torch.equal(S.sample_ref(logits, *_args(tiny))[0][:, 0], logits.argmax(-1))
    assert torch.equal(S.sample(logits, *_args(tiny))[0][:, 0], logits.argmax(-1))
    direct = torch.tensor([1e-39, 1e-38, 3e-38, 1e-6])                    # tensors that skip SamplingParams
    assert torch.equal(S.sample(logits, direct, k, tp, mp, keys)[0][:, 0], logits.argmax(-1))
    rows = [S.SampleRow(p, 7, 0, 0) for p in tiny]
    assert S.Sampler()(logits, rows).tokens == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1.0, top_k=S.TOP_K_MAX).top_k == 2 ** 31 - 1
    with pytest.raises(ValueError, match=r"SamplingParams: top_k must be None or an int in \[0, 2147483647\]"):
        SamplingParams(temperature=1.0, top_k=2 ** 31)
