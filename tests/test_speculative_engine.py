"""The serving engine with speculative decoding (EngineConfig.speculative, kernels.speculative.serving):
greedy answers equal plain decoding token for token, under batching, budgets that cut drafts and
stop tokens; a broken verification is caught; the engine's verification (Drafter.verify: processed p,
the drafter's q, the acceptance test, the residual draw) enumerated exactly on toy tables emits the
target's joint to float32 precision, and every wrong rule and broken step misses it by percents; the
speculative keys never coincide across streams, steps and the plain sampler's keys; sampled answers
keep the target's distribution of the first three tokens (chi-square against the exact joint: a
low-power check, 80 % power only at chi-square distance 0.07-0.10, see the speculative-sampling
chapter), and two wrong variants fail it; the KV
cache after rollback equals a fresh prefill of the kept tokens; pages all come back; bad options
are refused by name."""
import kernels  # noqa: F401

import pytest
import torch

from kernels.model.data import encode
from kernels.model.gpt import load_pretrained
from kernels.serving.engine import ACCEPT, DRAFT, RESIDUAL, Engine, EngineConfig, reference_generate, spec_key
from kernels.serving.sampling import SamplingParams, chi_square, processed_probs_ref, row_key
from kernels.speculative.drafts import truncated_copy
from kernels.speculative.sampling import output_distribution, target_distribution
from kernels.speculative.serving import DraftModel, Drafter, PromptLookup, engine_step_distribution, toy_table

PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING LEAR:\nBlow, winds, and crack your cheeks!",
           "First Citizen:\nSpeak.\n\nSecond Citizen:\nSpeak.\n\nFirst Citizen:\n"]
NEW = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


@pytest.fixture(scope="module")
def draft(model):
    return truncated_copy(model, 1)


@pytest.fixture(scope="module")
def reference(model):
    return {p: reference_generate(model, encode(p).tolist(), NEW) for p in PROMPTS}


def _run(model, config, prompts=PROMPTS, new=NEW, params=None, stagger=0):
    eng = Engine(model, config, record_logits=True)
    seqs = []
    for p in prompts:
        seqs.append(eng.add(encode(p).tolist(), new, params=params))
        for _ in range(stagger):
            eng.step()
    eng.run()
    return eng, seqs


def _pages_back(eng):
    eng.allocator.check()
    assert eng.allocator.num_free == eng.config.num_pages and eng.pages_held_by_requests() == 0


@pytest.mark.parametrize("kind", ["prompt lookup", "draft model"])
@pytest.mark.parametrize("config", [dict(), dict(max_tokens=3, page_size=4, stagger=2), dict(num_draft=7, chunk=5),
                                    dict(num_pages=14, page_size=8)],
                         ids=["batch", "tight budget, small pages, staggered", "gamma 7, chunked prefill",
                              "few pages: preemption"])
def test_greedy_equals_plain_decoding(model, draft, reference, kind, config):
    config = dict(config)
    stagger = config.pop("stagger", 0)
    spec = PromptLookup() if kind == "prompt lookup" else DraftModel(draft)
    eng, seqs = _run(model, EngineConfig(speculative=spec, **config), stagger=stagger)
    worst = 0.0
    for s, p in zip(seqs, PROMPTS):
        tokens, gap, ref_logits = reference[p]
        assert s.generated == tokens, f"{kind} {config}: prompt {p!r}: {s.generated} != {tokens}"
        worst = max(worst, float((torch.stack(eng.logits[s.id]) - ref_logits).abs().max()))
    # equality of tokens is meaningful because no greedy choice was near a tie (engine docstring)
    min_gap = min(r[1] for r in reference.values())
    assert worst < 1e-4 and min_gap > 20 * worst, f"logit diff {worst}, smallest top-2 gap {min_gap}"
    st = eng.spec_stats
    assert st.runs > 0 and 0 < st.accepted < st.drafted and st.emitted == st.runs + st.accepted
    runs = [sum(sampled for step in eng.history for i, _, _, sampled in step if i == s.id) for s in seqs]
    assert min(runs) < NEW                                          # target forwards per sequence: NEW when plain
    assert (eng.scheduler.preemptions > 0) == ("num_pages" in config), eng.scheduler.preemptions
    _pages_back(eng)


def test_a_broken_verification_is_caught(model, draft, reference):
    """Emitting the rejected draft instead of the target's token changes greedy answers."""
    eng, seqs = _run(model, EngineConfig(speculative=DraftModel(draft, broken="keep_rejected")))
    assert eng.spec_stats.accepted < eng.spec_stats.drafted          # there were rejections to get wrong
    assert sum(s.generated != reference[p][0] for s, p in zip(seqs, PROMPTS)) >= 2


def test_stop_tokens_inside_an_accepted_run(model, draft, reference):
    """A stop token among the accepted drafts ends the answer there, as in plain decoding."""
    p = PROMPTS[0]
    ref = reference[p][0]
    stop = ref[NEW // 2]
    params = SamplingParams(max_tokens=NEW, stop_token_ids=(stop,))
    plain, [a] = _run(model, EngineConfig(), [p], params=params)
    spec, [b] = _run(model, EngineConfig(speculative=DraftModel(draft), num_draft=6), [p], params=params)
    assert a.generated == b.generated == ref[:ref.index(stop) + 1] and b.finish_reason == "stop"
    _pages_back(spec)


def test_accepted_counts_only_emitted_drafts(model, reference):
    """SpecStats.accepted counts the accepted drafts that reach the answer. With the target as its own
    draft every draft is accepted; the stop token is placed inside a run with accepted drafts after
    it, which are dropped and not counted (counting every accepted draft gives accepted == drafted)."""
    G = 6
    p = PROMPTS[0]
    ref = reference[p][0]
    # the first token whose first occurrence i sits in a run's drafts with at least one draft after it:
    # index 0 comes from the prefill, run r emits indices 1 + (G + 1) r ... (G + 1)(r + 1), the last the bonus
    i = next(i for i in range(1, NEW) if ref.index(ref[i]) == i and (i - 1) % (G + 1) < G - 1)
    params = SamplingParams(max_tokens=NEW, stop_token_ids=(ref[i],))
    eng, [b] = _run(model, EngineConfig(speculative=DraftModel(model), num_draft=G), [p], params=params)
    st = eng.spec_stats
    assert b.generated == ref[:i + 1] and b.finish_reason == "stop"
    full_runs = (i - 1) // (G + 1)                                   # runs that emitted G drafts and a bonus
    assert st.runs == full_runs + 1 and st.drafted == G * st.runs and st.emitted == i
    assert st.accepted == i - full_runs < st.drafted, st
    _pages_back(eng)


def test_kv_after_rollback_equals_a_fresh_prefill(model, draft):
    """After every verification the computed positions hold what a prefill of those tokens writes,
    and the sequence holds exactly the pages its computed positions need."""
    eng = Engine(model, EngineConfig(speculative=DraftModel(draft), num_draft=5, page_size=4))
    seq = eng.add(encode(PROMPTS[1]).tolist(), NEW)
    rejected = 0
    while not seq.finished:
        before = len(seq.tokens)
        eng.step()
        run = eng.history[-1][0][2]                                  # tokens the target ran: 1 + drafts
        if seq.finished or run == len(seq.prompt):
            continue
        assert len(seq.table) == eng.allocator.pages_for(seq.num_computed)
        assert seq.num_computed == len(seq.tokens) - 1
        rejected += len(seq.tokens) - before < run
        fresh = Engine(model, EngineConfig(page_size=4))
        f = fresh.add(seq.tokens[:seq.num_computed], 2)               # still running after its prefill
        fresh.step()
        for layer in range(model.config.n_layer):
            k0, v0 = eng.runner.cache.gather(layer, torch.tensor(seq.table, dtype=torch.int32), seq.num_computed)
            k1, v1 = fresh.runner.cache.gather(layer, torch.tensor(f.table, dtype=torch.int32), seq.num_computed)
            assert float((k0 - k1).abs().max()) < 1e-4 and float((v0 - v1).abs().max()) < 1e-4
    assert rejected >= 2                                             # rollbacks happened and were checked
    _pages_back(eng)


# ---------------------------------------------------------------- sampled requests: exactly

TOY_P, TOY_Q = toy_table(0, total=4), toy_table(1, total=4)      # vocabulary 3, prefix-dependent, zeros
TOY_PARAMS = SamplingParams(temperature=0.7)                     # logits T log p: processing must undo T


def _engine_vs_target(drafter, gamma, length):
    """Largest |P_engine(s) - p(s)| over sequences s of ``length`` tokens, P_engine through drafter.verify."""
    step = lambda p_fn, q_fn, prefix, g, rule: engine_step_distribution(drafter, p_fn, q_fn, prefix, g,  # noqa: E731
                                                                        TOY_PARAMS)
    got = output_distribution(TOY_P, TOY_Q, (), gamma, length, step=step)
    want = target_distribution(TOY_P, (), 3, length)
    assert abs(sum(got.values()) - 1) < 1e-9
    return max(abs(got.get(s, 0.0) - float(want[s])) for s in want.keys() | got.keys())


def test_engine_verification_is_exact_by_enumeration():
    """Every sequence of 3 tokens that repeated gamma-2 steps emit, probability against the target's
    joint: equal to float32 precision (the probabilities are processed in float32)."""
    assert _engine_vs_target(Drafter(), 2, 3) < 1e-7


@pytest.mark.parametrize("wrong", [dict(rule="biased"), dict(rule="resample_p"), dict(broken="raw_p"),
                                   dict(broken="keep_rejected")],
                         ids=["accept iff p >= q", "resample from p", "p without temperature", "keep the rejected draft"])
def test_wrong_engine_verification_misses_the_target_exactly(wrong):
    assert _engine_vs_target(Drafter(**wrong), 2, 2) > 1e-2


def test_speculative_keys_never_coincide():
    """The three streams of spec_key and the plain sampler's row_key give distinct keys over seeds,
    choices and token indices: no two draws share their uniforms."""
    keys = [spec_key(seed, c, t, s) for seed in range(8) for c in range(2) for t in range(64)
            for s in (DRAFT, ACCEPT, RESIDUAL)] + [row_key(seed, c, t) for seed in range(8) for c in range(2)
                                                   for t in range(64)]
    assert len(set(keys)) == len(keys) == 4 * 8 * 2 * 64


# ---------------------------------------------------------------- sampled requests

PROMPT = "ROMEO:\nWhat is the"
SAMPLED = SamplingParams(temperature=0.9, top_k=4, max_tokens=4)


@pytest.fixture(scope="module")
def exact_joint(model):
    """P(t1, t2, t3) of plain sampling with SAMPLED (top-4 at temperature 0.9): 64 cells."""
    prompt = encode(PROMPT).tolist()
    with torch.no_grad():
        probs = lambda ctx: processed_probs_ref(model(torch.tensor(ctx))[:, -1], [SAMPLED] * len(ctx))  # noqa: E731
        p1 = probs([prompt])[0]
        firsts = p1.nonzero()[:, 0].tolist()
        p2 = probs([prompt + [a] for a in firsts])
        pairs = [(a, b) for i, a in enumerate(firsts) for b in p2[i].nonzero()[:, 0].tolist()]
        p3 = probs([prompt + [a, b] for a, b in pairs])
    return {(a, b, c): float(p1[a] * p2[firsts.index(a), b] * p3[j, c])
            for j, (a, b) in enumerate(pairs) for c in p3[j].nonzero()[:, 0].tolist()}


def _chi_square(model, spec, joint, n):
    eng = Engine(model, EngineConfig(speculative=spec, num_draft=2, max_seqs=256, max_tokens=4096, num_pages=512))
    seqs = [eng.add(encode(PROMPT).tolist(), params=SamplingParams(temperature=0.9, top_k=4, max_tokens=4, seed=s))
            for s in range(n)]
    eng.run()
    cells = list(joint)
    index = {c: i for i, c in enumerate(cells)}
    samples = torch.tensor([index.get(tuple(s.generated[:3]), len(cells)) for s in seqs])   # last: impossible
    _pages_back(eng)
    return chi_square(samples, torch.tensor([joint[c] for c in cells] + [0.0])), eng.spec_stats


def test_sampled_output_keeps_the_target_distribution(model, draft, exact_joint):
    assert len(exact_joint) == 64 and abs(sum(exact_joint.values()) - 1) < 1e-5
    (stat, dof, pval), st = _chi_square(model, DraftModel(draft), exact_joint, 400)
    assert dof >= 10 and pval > 1e-3, (stat, dof, pval)
    assert 0.2 * st.drafted < st.accepted < st.drafted                # drafts were both accepted and rejected


@pytest.mark.parametrize("wrong, n", [(dict(broken="raw_p"), 100), (dict(rule="resample_p"), 200)],
                         ids=["p without temperature and top-k", "resample from p"])
def test_wrong_sampled_verification_is_caught(model, draft, exact_joint, wrong, n):
    (stat, dof, pval), _ = _chi_square(model, DraftModel(draft, **wrong), exact_joint, n)
    assert pval < 1e-6, (stat, dof, pval)


def test_sampled_answer_depends_only_on_the_seed(model, draft):
    """Alone or in a batch, with the Triton verification (use_kernels) or the reference: same tokens."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=7)
    spec = DraftModel(draft)
    _, [alone] = _run(model, EngineConfig(speculative=spec), [PROMPTS[0]], new=10, params=params)
    eng = Engine(model, EngineConfig(speculative=spec))
    others = [eng.add(encode(p).tolist(), params=SamplingParams(temperature=1.0, max_tokens=10, seed=i))
              for i, p in enumerate(PROMPTS[1:])]
    mixed = eng.add(encode(PROMPTS[0]).tolist(), params=params)
    eng.run()
    assert others and mixed.generated == alone.generated
    drafter = DraftModel(draft)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, model.config.vocab_size, generator=g) * 3                   # (B, k+1, V)
    ps = [SamplingParams(temperature=0.7, top_k=9), SamplingParams(), SamplingParams(temperature=1.2, top_p=0.8)]
    drafts = torch.stack([processed_probs_ref(logits[b, :3], [ps[b]] * 3).argmax(-1) for b in range(3)])
    u = torch.rand(3, 3, generator=g).clamp(1e-6, 1 - 1e-6)
    keys = torch.tensor([11, 12, 13])
    q = [None, None, torch.softmax(torch.randn(3, model.config.vocab_size, generator=g), -1)]
    ref = drafter.verify(logits, ps, drafts, q, u, keys)
    tri = drafter.verify(logits, ps, drafts, q, u, keys, use_kernels=True)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])


def test_bad_options_are_refused_by_name(model, draft):
    with pytest.raises(TypeError, match="EngineConfig.speculative"):
        Engine(model, EngineConfig(speculative=object()))
    with pytest.raises(ValueError, match="num_draft"):
        Engine(model, EngineConfig(speculative=PromptLookup(), num_draft=0))
    with pytest.raises(ValueError, match="prefix_cache"):
        Engine(model, EngineConfig(speculative=PromptLookup(), prefix_cache=True))
    eng = Engine(model, EngineConfig(speculative=PromptLookup()))
    with pytest.raises(ValueError, match="n=2 choices"):
        eng.add([1, 2, 3], params=SamplingParams(n=2, temperature=1.0))
    with pytest.raises(ValueError, match="logprobs"):
        eng.add([1, 2, 3], params=SamplingParams(logprobs=2))
    with pytest.raises(ValueError, match="rule"):
        PromptLookup(rule="lenient")
    with pytest.raises(ValueError, match="broken"):
        DraftModel(draft, broken="sometimes")
    with pytest.raises(TypeError, match="DraftModel: model"):
        DraftModel("gpt")
    logits, drafts, u = torch.zeros(1, 2, 5), torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), 0.5)
    args = (logits, [SamplingParams(temperature=1.0)], drafts, [None], u, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="residual_u is for the reference"):
        Drafter().verify(*args, use_kernels=True, residual_u=torch.full((1, 5), 0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual_u must be a"):
        Drafter().verify(*args, residual_u=torch.full((1, 4), 0.5, dtype=torch.float64))

    class TooLong(Drafter):
        def propose(self, tokens, num_draft, params, keys):
            return [0] * (num_draft + 1), None

    eng = Engine(model, EngineConfig(speculative=TooLong()))
    eng.add([1, 2, 3], 8)
    with pytest.raises(ValueError, match="propose"):
        eng.run()
