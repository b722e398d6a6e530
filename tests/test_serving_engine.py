"""kernels.serving.engine: greedy outputs of the paged, continuously batched engine equal one-at-a-time
generation token for token, under any batch mix, chunk size, preemption and prefix hit; sampled
requests in a mixed batch equal their one-at-a-time draws with the same seed; n > 1 forks share
the prompt's pages copy-on-write; stop tokens, log-probs, insert-after-prefill; pages are all given back."""
import kernels  # noqa: F401

import pytest
import torch

from kernels.model.data import encode
from kernels.model.gpt import load_pretrained
from kernels.serving.engine import Engine, EngineConfig, EngineStalled, reference_generate
from kernels.serving import sampling as S
from kernels.serving.sampling import SamplingParams

PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING LEAR:\nBlow, winds, and crack your cheeks!",
           "O", "First Citizen:\nBefore we proceed any further, hear me speak.\n"]
NEW = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is latency-bound: one thread is faster and does not fight other test workers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


@pytest.fixture(scope="module")
def reference(model):
    return {p: reference_generate(model, encode(p).tolist(), NEW) for p in PROMPTS}


def _run(model, config, prompts, new=NEW, stagger=0):
    """Add the prompts (``stagger`` steps apart), run to completion; returns (engine, sequences)."""
    eng = Engine(model, config, record_logits=True)
    seqs = []
    for p in prompts:
        seqs.append(eng.add(encode(p).tolist(), new))
        for _ in range(stagger):
            eng.step()
    eng.run()
    return eng, seqs


def _assert_same(eng, seqs, prompts, reference):
    worst = 0.0
    for s, p in zip(seqs, prompts):
        tokens, gap, ref_logits = reference[p]
        assert s.generated == tokens, f"prompt {p!r}: engine {s.generated} != one-at-a-time {tokens}"
        got = torch.stack(eng.logits[s.id][-NEW:])
        worst = max(worst, float((got - ref_logits).abs().max()))
    # the check is on tokens; it is meaningful because no greedy choice was near a tie
    min_gap = min(r[1] for r in reference.values())
    assert worst < 1e-4 and min_gap > 20 * worst, f"logit diff {worst}, smallest top-2 gap {min_gap}"


def _assert_pages_back(eng):
    eng.allocator.check()
    assert eng.pages_held_by_requests() == 0
    cached = eng.cache.cached_pages if eng.cache is not None else 0
    assert eng.allocator.num_used == cached


@pytest.mark.parametrize("config", [
    EngineConfig(),                                          # whole prompts, everyone in one batch
    EngineConfig(chunk=1, max_tokens=4),                     # prefill one token at a time
    EngineConfig(chunk=7, max_tokens=20, page_size=4),       # chunks that straddle pages, budget shared
    EngineConfig(max_seqs=2),                                # sequences queue for a seat
], ids=["whole", "chunk1", "chunk7", "two-seats"])
def test_equals_one_at_a_time(model, reference, config):
    eng, seqs = _run(model, config, PROMPTS + PROMPTS[::-1], stagger=1)
    _assert_same(eng, seqs, PROMPTS + PROMPTS[::-1], reference)
    _assert_pages_back(eng)
    sizes = {len(step) for step in eng.history}
    assert max(sizes) > 1                                    # batches really mixed sequences


def test_mixed_steps_hold_prefill_and_decode(model, reference):
    eng, seqs = _run(model, EngineConfig(chunk=5, max_tokens=12), PROMPTS, stagger=3)
    mixed = [step for step in eng.history if any(n > 1 for _, _, n, _ in step) and any(n == 1 for _, _, n, _ in step)]
    assert mixed, "no step mixed a prefill chunk with decodes"
    assert all(sum(n for _, _, n, _ in step) <= 12 for step in eng.history)
    _assert_same(eng, seqs, PROMPTS, reference)


def test_preemption_by_recompute(model, reference):
    eng, seqs = _run(model, EngineConfig(num_pages=12, page_size=8, chunk=6, max_tokens=16), PROMPTS)
    assert eng.scheduler.preemptions > 0
    _assert_same(eng, seqs, PROMPTS, reference)
    _assert_pages_back(eng)


def test_prefix_hits(model, reference):
    eng = Engine(model, EngineConfig(prefix_cache=True, page_size=4), record_logits=True)
    first = [eng.add(encode(p).tolist(), NEW) for p in PROMPTS]
    eng.run()
    second = [eng.add(encode(p).tolist(), NEW) for p in PROMPTS]
    eng.run()
    assert sum(s.cached_tokens for s in second) > 0 and all(s.cached_tokens == 0 for s in first)
    _assert_same(eng, first, PROMPTS, reference)
    _assert_same(eng, second, PROMPTS, reference)
    _assert_pages_back(eng)
    eng.cache.clear()
    assert eng.allocator.num_used == 0


def test_kernel_path_matches(model, reference):
    """use_kernels: decode attention by the Triton paged kernel (interpreter: few, short steps)."""
    eng = Engine(model, EngineConfig(use_kernels=True, page_size=32), record_logits=True)
    seqs = [eng.add(encode(p).tolist(), 4) for p in PROMPTS[:2]]
    eng.run()
    for s, p in zip(seqs, PROMPTS[:2]):
        assert s.generated == reference[p][0][:4]


def test_abort_returns_pages(model):
    eng = Engine(model, EngineConfig(page_size=4))
    a = eng.add(encode(PROMPTS[4]).tolist(), 20)
    b = eng.add(encode(PROMPTS[0]).tolist(), 20)
    eng.step()
    eng.step()
    assert eng.allocator.num_used > 0
    eng.abort(a)
    eng.abort(b)
    assert eng.allocator.num_used == 0 and not eng.scheduler.has_work()


def test_bad_requests(model):
    eng = Engine(model, EngineConfig(num_pages=4, page_size=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add([], 5)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        eng.add([1, 2], 0)
    with pytest.raises(ValueError, match="exceed the model's context of 128"):
        eng.add([1] * 120, 20)
    with pytest.raises(ValueError, match="more KV pages than the whole cache"):
        eng.add([1] * 10, 10)
    with pytest.raises(ValueError, match="token ids"):
        eng.add([300], 1)
    assert eng.allocator.num_used == 0


def test_broken_engine_is_caught(model, reference):
    """A runner that writes every new key one slot late produces different tokens: the check sees it."""
    eng = Engine(model, EngineConfig())
    forward = eng.runner.forward

    def late(works):
        out = forward(works)
        for layer in range(len(eng.runner.k_pages)):
            eng.runner.k_pages[layer].copy_(torch.roll(eng.runner.k_pages[layer], 1, dims=2))
        return out
    eng.runner.forward = late
    seqs = [eng.add(encode(p).tolist(), NEW) for p in PROMPTS]
    eng.run()
    assert any(s.generated != reference[p][0] for s, p in zip(seqs, PROMPTS))


SAMPLED = [SamplingParams(),
           SamplingParams(temperature=1.0, seed=1),
           SamplingParams(temperature=0.8, top_k=5, seed=2),
           SamplingParams(temperature=1.2, top_p=0.9, seed=3),
           SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.05, seed=4)]


@pytest.fixture(scope="module")
def sampled_reference(model):
    return [reference_generate(model, encode(p).tolist(), NEW, params=q, seed=q.seed or 0)[0]
            for p, q in zip(PROMPTS, SAMPLED)]


@pytest.mark.parametrize("config,order", [(EngineConfig(chunk=5, max_tokens=12, page_size=4), 1),
                                          (EngineConfig(num_pages=12, page_size=8, chunk=6, max_tokens=16), -1)],
                         ids=["mixed-steps", "preempting-reversed"])
def test_sampled_requests_in_a_mixed_batch_equal_their_draws_alone(model, sampled_reference, config, order):
    """Each request's parameters and seed, in one batch with the others (arrival order, preemption
    and chunking varied): every answer equals the one-at-a-time generation with the same seed."""
    eng = Engine(model, config)
    idx = list(range(len(PROMPTS)))[::order]
    seqs = {}
    for i in idx:
        seqs[i] = eng.add(encode(PROMPTS[i]).tolist(), NEW, params=SAMPLED[i])
        eng.step()
    eng.run()
    for i in idx:
        assert seqs[i].generated == sampled_reference[i], f"request {i} ({SAMPLED[i]})"
    assert len({tuple(v) for v in sampled_reference}) == len(PROMPTS)
    assert any(len({w[0] for w in step}) >= 3 for step in eng.history)
    _assert_pages_back(eng)


def _poisoned(**kwargs) -> SamplingParams:
    """Sampling parameters past SamplingParams' own checks (as a server bug would let through): top_k = 2**31
    overflows the sampler's int32 tensor."""
    params = SamplingParams(**kwargs)
    object.__setattr__(params, "top_k", 2 ** 31)
    return params


@pytest.mark.parametrize("stage", ["sampler", "forward"])
def test_a_failing_request_fails_alone(model, sampled_reference, stage):
    """A poisoned request in a batch of healthy ones (greedy and seeded, arriving before and after it):
    a step that raises in the sampler (top_k past int32) or in the forward (a token id past the
    vocabulary) fails that request only, with reason "error" and its pages back; every other request
    completes with the answer it gets alone. Engine.run() reports the failure once the others are done."""
    eng = Engine(model, EngineConfig(chunk=5, max_tokens=12, page_size=4))
    seqs = {i: eng.add(encode(PROMPTS[i]).tolist(), NEW, params=SAMPLED[i]) for i in (0, 1, 2)}
    if stage == "sampler":
        bad = eng.add(encode("O").tolist(), params=_poisoned(temperature=1.0, seed=5, n=2, max_tokens=NEW))
    else:
        bad = eng.add(encode("O").tolist(), NEW, params=SAMPLED[1])
        bad.tokens[0] = bad.prompt[0] = model.config.vocab_size      # the embedding lookup raises
    eng.step()
    seqs.update({i: eng.add(encode(PROMPTS[i]).tolist(), NEW, params=SAMPLED[i]) for i in (3, 4)})
    with pytest.raises(RuntimeError, match=rf"1 request\(s\) failed: request {bad.group}: "
                                           rf"{'RuntimeError' if stage == 'sampler' else 'IndexError'}"):
        eng.run()
    assert bad.finished and bad.finish_reason == "error" and all(c.finish_reason == "error" for c in bad.children)
    for i, seq in seqs.items():
        assert seq.finish_reason == "length" and seq.generated == sampled_reference[i], f"request {i}"
    assert any(len({w[0] for w in step}) >= 3 for step in eng.history) and not eng.failures
    _assert_pages_back(eng)


def test_without_isolation_the_poison_fails_everyone(model):
    """The check above can fail: the batched sampler on its own raises for the whole batch."""
    eng = Engine(model, EngineConfig())
    eng._sample = lambda seqs, logits: (seqs, logits, eng.sampler(logits, [
        S.SampleRow(q.params, q.seed, q.choice, len(q.generated)) for q in seqs]))
    eng.add(encode(PROMPTS[0]).tolist(), 4, params=SAMPLED[1])
    eng.add(encode("O").tolist(), params=_poisoned(temperature=1.0, seed=5, max_tokens=4))
    with pytest.raises(RuntimeError, match="overflow"):
        eng.step()


def test_n_choices_fork_and_share_the_prompt_copy_on_write(model):
    prompt = encode(PROMPTS[2]).tolist()                                   # 46 tokens: the last page partial
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, n=3)
    eng = Engine(model, EngineConfig(page_size=8, chunk=16, max_tokens=32))
    copies = []
    copy = eng.runner.cache.copy
    eng.runner.cache.copy = lambda pairs: (copies.extend(pairs), copy(pairs))
    seq = eng.add(prompt, 12, params=params)
    while not seq.children:
        eng.step()
    choices = [seq, *seq.children]
    full = len(prompt) // 8
    assert [eng.allocator.refcount[p] for p in seq.table[:full]] == [3] * full       # shared, not copied
    eng.run()
    assert len(copies) == 2                                                 # the partial page, by two of three
    for q in choices:
        want = reference_generate(model, prompt, 12, params=params, seed=7, choice=q.choice)[0]
        assert q.generated == want and q.finish_reason == "length"
    assert len({tuple(q.generated) for q in choices}) == 3
    _assert_pages_back(eng)


def test_stop_token_finishes_with_stop(model, reference):
    p = PROMPTS[4]
    tokens = reference[p][0]
    nl = ord("\n")
    assert nl in tokens
    eng = Engine(model, EngineConfig())
    a = eng.add(encode(p).tolist(), NEW, params=SamplingParams(stop_token_ids=(nl,)))
    b = eng.add(encode(p).tolist(), NEW, params=SamplingParams(stop_token_ids=(255,)))
    eng.run()
    assert a.generated == tokens[:tokens.index(nl) + 1] and a.finish_reason == "stop"
    assert b.generated == tokens and b.finish_reason == "length"
    _assert_pages_back(eng)


def test_logprobs_are_the_model_log_softmax(model, reference):
    p = PROMPTS[1]
    eng = Engine(model, EngineConfig())
    seq = eng.add(encode(p).tolist(), NEW, params=SamplingParams(logprobs=3))
    eng.run()
    lp = torch.log_softmax(reference[p][2], dim=-1)
    for t, (chosen, top) in enumerate(seq.logprobs):
        assert abs(chosen - float(lp[t, seq.generated[t]])) < 1e-4
        assert [tok for tok, _ in top][0] == seq.generated[t] and len(top) == 3


def test_kernel_sampler_path_matches(model, sampled_reference):
    """use_kernels: the Triton paged decode and the Triton sampler (interpreter: few tokens)."""
    eng = Engine(model, EngineConfig(use_kernels=True, page_size=32))
    seqs = [eng.add(encode(PROMPTS[i]).tolist(), 3, params=SAMPLED[i]) for i in (3, 4)]
    eng.run()
    for s, i in zip(seqs, (3, 4)):
        assert s.generated == sampled_reference[i][:3]


def test_insert_after_prefill_lets_a_batch_share_its_system_prompt(model):
    """Eight requests with one system prompt arrive together; a budget of 64 tokens admits them over
    several steps. Inserting whole pages after each prefill (SGLang's cache_unfinished_req) lets the
    later ones hit; inserting only at the end cannot."""
    system = "SYSTEM: Speak as in a tragedy, and briefly.\n"
    prompts = [system + q for q in ("Who?", "Why?", "Speak.", "Go.", "Stay.", "Hark!", "Alas.", "Fly!")]
    hits = {}
    for after in (True, False):
        eng = Engine(model, EngineConfig(page_size=4, prefix_cache=True, cache_after_prefill=after, max_tokens=64))
        seqs = [eng.add(encode(p).tolist(), 6) for p in prompts]
        eng.run()
        hits[after] = sum(s.cached_tokens for s in seqs)
        for s, p in zip(seqs, prompts):
            assert s.generated == reference_generate(model, encode(p).tolist(), 6)[0]
        _assert_pages_back(eng)
    assert hits[False] == 0 and hits[True] >= 5 * (len(system) // 4 * 4)


def test_a_stalled_scheduler_is_reported_not_spun_on(model):
    eng = Engine(model, EngineConfig())
    eng.add([1, 2, 3], 2)
    eng.scheduler.schedule = lambda: []
    with pytest.raises(EngineStalled, match="1 waiting"):
        eng.step()
