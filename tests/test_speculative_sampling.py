"""Speculative sampling (kernels.speculative): the rule leaves the target distribution unchanged
(exact rational enumeration, and a chi-square test of the tiny GPT's distributions), two wrong rules
are caught by the same checks, the Triton verification draws the reference's tokens from the same
randoms, and greedy speculative decoding equals plain greedy decoding. The kernel compiles for sm_90a
at Llama 3's vocabulary without spills, with the batch offset multiplied in 64 bits."""
from __future__ import annotations

import random
import re
from fractions import Fraction

import pytest
import torch

import kernels  # noqa: F401  (switches Triton's interpreter on without a GPU)
from kernels import inspect as ki
from kernels.model import load_pretrained
from kernels.serving.sampling import chi_square, row_key
from kernels.speculative import drafts as D
from kernels.speculative import sampling as S


def random_table(seed: int, vocab: int, zero_prob: float = 0.3):
    """next-token distributions as Fractions, one per prefix, some entries exactly zero."""
    r, cache = random.Random(seed), {}

    def fn(prefix):
        if prefix not in cache:
            w = [r.randint(1, 9) for _ in range(vocab)]
            if r.random() < zero_prob:
                w[r.randrange(vocab)] = 0
            cache[prefix] = [Fraction(x, sum(w)) for x in w]
        return cache[prefix]
    return fn


@pytest.mark.parametrize("gamma,length", [(1, 2), (2, 3), (3, 3)])
def test_exact_rule_leaves_the_distribution_unchanged(gamma, length):
    for seed in range(3):
        p, q = random_table(2 * seed, 3), random_table(2 * seed + 1, 3)
        out = S.output_distribution(p, q, (), gamma, length)
        assert out == {k: v for k, v in S.target_distribution(p, (), 3, length).items() if v}


@pytest.mark.parametrize("rule", ["biased", "resample_p"])
def test_wrong_rules_change_the_distribution(rule):
    p, q = random_table(0, 3), random_table(1, 3)
    out = S.output_distribution(p, q, (), 2, 3, rule)
    tgt = S.target_distribution(p, (), 3, 3)
    assert sum(out.values()) == 1                                  # a distribution, but the wrong one
    assert max(abs(out.get(k, 0) - v) for k, v in tgt.items()) > Fraction(1, 100)


def test_closed_form_one_step():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
    assert (S.one_step_output(p, q) - p).abs().max() < 1e-15
    for rule in ("biased", "resample_p"):
        assert (S.one_step_output(p, q, rule) - p).abs().max() > 1e-3
    # the closed form is the first token of the enumeration
    pf = [Fraction(x) for x in p.tolist()]
    qf = [Fraction(x) for x in q.tolist()]
    for rule in S.RULES:
        enum = S.step_distribution(lambda _: pf, lambda _: qf, (), 1, rule)
        first = [float(sum(v for k, v in enum.items() if k[0] == x)) for x in range(50)]
        assert (torch.tensor(first, dtype=torch.float64) - S.one_step_output(p, q, rule)).abs().max() < 1e-12


def test_acceptance_rate_and_expected_tokens_by_simulation():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    for alpha in (0.3, 0.8):
        for gamma in (1, 4):
            acc = torch.rand(n, gamma, generator=g) < alpha               # i.i.d. acceptances
            emitted = torch.where(acc.all(1), gamma, (~acc).int().argmax(1)) + 1
            se = emitted.double().std() / n ** 0.5
            assert abs(emitted.double().mean() - S.expected_tokens(alpha, gamma)) < 5 * se
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    assert float(S.acceptance_rate(p, q)) == 0.5
    assert float(S.expected_tokens(1.0, 3)) == 4.0


def test_rejection_sampling_keeps_one_in_m():
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.full((4,), 0.25, dtype=torch.float64)
    kept, rate = S.rejection_sample(p, q, 40_000, g)
    assert abs(rate - 1 / 1.6) < 0.01                               # M = max p/q = 1.6
    assert chi_square(kept, p)[2] > 1e-3


# ---------------------------------------------------------------- the kernel against the reference

def make_batch(B, G, V, seed, *, same=False, sharp=2.0, pad=0):
    """p (B, G+1, V), q (B, G, V) as views into buffers whose padding holds 1.0 (a canary that would
    win every draw), draft tokens drawn from q, uniforms, Philox keys."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, G + 1, V, generator=g) * sharp, -1)
    q = p[:, :G].clone() if same else torch.softmax(torch.randn(B, G, V, generator=g) * sharp, -1)
    if pad:
        pb = torch.ones(B, G + 1, V + pad)
        qb = torch.ones(B, G, V + pad)
        pb[..., :V], qb[..., :V] = p, q
        p, q = pb[..., :V], qb[..., :V]
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    u = ((torch.randint(0, 2 ** 24, (B, G), generator=g).float() + 0.5) / 2 ** 24)
    keys = torch.tensor([row_key(seed, 0, b) for b in range(B)], dtype=torch.int64)
    return p, q, draft, u, keys


@pytest.mark.parametrize("B,G,V,block_v,same", [(7, 3, 37, None, False), (5, 5, 300, 128, False),
                                                (4, 1, 129, 64, False), (6, 4, 50, None, True)])
@pytest.mark.parametrize("rule", S.RULES)
def test_kernel_matches_reference(B, G, V, block_v, same, rule):
    args = make_batch(B, G, V, seed=B * V + G, same=same, pad=5)
    n_ref, tok_ref = S.verify_ref(*args, rule=rule)
    n, tok = S.verify(*args, rule=rule, block_v=block_v)
    assert torch.equal(n, n_ref) and torch.equal(tok, tok_ref)
    assert int(tok.max()) < V                                       # no canary index drawn
    if same:
        assert bool((n == G).all())                                 # q = p: every draft accepted, a bonus token


def test_the_broken_kernels_are_caught():
    args = make_batch(32, 3, 40, seed=3, sharp=1.0)
    n_ref, tok_ref = S.verify_ref(*args)
    for rule in ("biased", "resample_p"):
        n, tok = S.verify(*args, rule=rule)
        assert not torch.equal(tok, tok_ref), rule


def test_chi_square_on_the_tiny_gpt():
    """p: the tiny GPT after a prompt; q: its first block alone (a truncated copy). The verdicts are far
    from their thresholds (with this seed: exact about 0.99, the wrong rules below 1e-40), so a
    last-bit change of p on another CPU cannot flip them. The kernel draws the reference's tokens
    (test_kernel_matches_reference), so the verdict holds for it too."""
    model = load_pretrained()
    draft_model = D.truncated_copy(model, 1)
    idx = torch.tensor([list(b"ROMEO:\nWhat is the ")])
    with torch.no_grad():
        p1 = torch.softmax(model(idx)[0, -1], -1)
        q1 = torch.softmax(draft_model(idx)[0, -1], -1)
    B, V = 4000, p1.numel()
    g = torch.Generator().manual_seed(11)
    p = torch.stack([p1, p1])[None].expand(B, 2, V)
    q = q1[None, None].expand(B, 1, V)
    draft = torch.multinomial(q1, B, replacement=True, generator=g)[:, None]
    u = (torch.randint(0, 2 ** 24, (B, 1), generator=g).float() + 0.5) / 2 ** 24
    keys = torch.tensor([row_key(13, 0, b) for b in range(B)], dtype=torch.int64)
    pv = {rule: chi_square(S.verify_ref(p, q, draft, u, keys, rule=rule)[1][:, 0], p1)[2] for rule in S.RULES}
    assert pv["exact"] > 0.01 and pv["biased"] < 1e-6 and pv["resample_p"] < 1e-6, pv


def test_bad_input_is_refused():
    p, q, draft, u, keys = make_batch(2, 3, 10, seed=0)
    with pytest.raises(ValueError, match="q must be"):
        S.verify(p, q[:, :2], draft, u, keys)
    with pytest.raises(ValueError, match="p must be"):
        S.verify(p.double(), q, draft, u, keys)
    with pytest.raises(ValueError, match="draft tokens must lie"):
        S.verify(p, q, draft + 10, u, keys)
    with pytest.raises(ValueError, match="u must lie"):
        S.verify(p, q, draft, torch.zeros_like(u), keys)
    with pytest.raises(ValueError, match="keys must be"):
        S.verify(p, q, draft, u, keys.int())
    with pytest.raises(ValueError, match="rule must be"):
        S.verify(p, q, draft, u, keys, rule="greedy")


# ---------------------------------------------------------------- drafts and greedy speculative decoding

def test_prompt_lookup():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert D.prompt_lookup(toks, 2) == [5, 6]                       # the latest earlier "1 2 3"
    assert D.prompt_lookup([7, 8, 7], 3) == [8, 7]                  # falls back to a 1-gram
    assert D.prompt_lookup([1, 2, 3], 3) == []
    with pytest.raises(ValueError, match="num_draft"):
        D.prompt_lookup(toks, 0)


def test_ngram_pool_chains_continuations():
    pool = D.NgramPool(3)
    assert pool.draft([5, 6, 7, 5, 6], 4) == [7, 5, 6, 7]


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


def test_speculative_greedy_equals_plain_greedy(model):
    prompt = list(b"ROMEO:\nWhat is the")
    ref = model.generate(torch.tensor([prompt]), 40)[0].tolist()
    for gamma in (1, 4):
        out, forwards, accepted = D.speculative_greedy(model, prompt, 40, lambda t: D.prompt_lookup(t, gamma), gamma)
        assert out == ref
        assert forwards == 1 + len(accepted) and sum(accepted) + forwards == 40
    jac, jf = D.jacobi_greedy(model, prompt, 40, 4)
    assert jac == ref and jf <= 40


def test_a_wrong_verification_is_caught(model):
    """Keeping one rejected draft token too many breaks the equality with plain greedy decoding."""
    prompt = list(b"ROMEO:\nWhat is the")
    ref = model.generate(torch.tensor([prompt]), 30)[0].tolist()
    always = lambda t: [ord("e")] * 3                                # noqa: E731 (a bad draft, mostly rejected)
    out, _, _ = D.speculative_greedy(model, prompt, 30, always, 3)
    assert out == ref
    bad = D.speculative_greedy(model, prompt, 30, always, 3, _keep_rejected=True)[0]
    assert bad != ref


def test_truncated_copy_shares_the_first_blocks(model):
    draft = D.truncated_copy(model, 2)
    assert draft.config.n_layer == 2 and torch.equal(draft.blocks[1].mlp.w_up.weight, model.blocks[1].mlp.w_up.weight)
    with pytest.raises(ValueError, match="n_layer"):
        D.truncated_copy(model, 5)


# ---------------------------------------------------------------- ahead of time, at Llama 3's vocabulary

@pytest.fixture(scope="module")
def aot():
    jobs = S.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_compiles_without_spills(aot):
    jobs, builds = aot
    assert len(jobs) == 4
    for label, b in builds.items():
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, label
        assert jobs[label].programs == int(label.split("batch ")[1])      # one program per sequence


def test_batch_offset_is_a_64bit_product(aot):
    """b * stride_pb = b * (gamma+1) * V passes 2**31 from b = 1861 at gamma 8 and V = 128256."""
    jobs, builds = aot
    for label in jobs:
        runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
        assert ki.param_product_widths(builds[label]["sm90"], runtime_args.index("stride_pb")) == {64}


def _loop_body(sass: str) -> list[str]:
    """The opcodes of the longest loop in a SASS listing: from the target of its backward branch to
    the branch. Raises if the listing has no backward branch."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*[^;]*);", sass)]
    back = [(at, int(t, 16)) for at, text in ins for t in re.findall(r"\bBRA(?:\.U)?\s+0x([0-9a-f]+)", text)
            if int(t, 16) < at]
    if not back:
        raise ValueError("no backward branch: no loop in this listing")
    end, start = max(back, key=lambda b: b[0] - b[1])
    return [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for at, text in ins if start <= at <= end]


def test_the_vocabulary_loop_is_instruction_bound(aot):
    """The chapter's time estimate: one iteration of the vocabulary loop (1024 tokens, 8 per thread)
    issues more than 1500 SASS instructions per warp (Philox and the logarithms per token, in software:
    no MUFU) against four 128-bit loads per thread, with 4 warps, so one program per sequence is bound by issue, not by its share of
    HBM bandwidth. The loop finder itself refuses a listing without a loop."""
    jobs, builds = aot
    for label in jobs:
        body = _loop_body(builds[label]["sm90"].sass)
        assert len(body) > 1500, (label, len(body))
        assert sum(op.startswith("LDG.E.128") for op in body) == 4, label
        assert not any(op.startswith("MUFU") for op in body), label       # the logarithms are FFMA polynomials
        assert jobs[label].num_warps == 4, label                          # one warp per scheduler of the SM
    with pytest.raises(ValueError, match="no loop"):
        _loop_body("/*0000*/ MOV R1, c[0x0][0x28] ;\n/*0010*/ EXIT ;\n/*0020*/ BRA 0x20;\n")
