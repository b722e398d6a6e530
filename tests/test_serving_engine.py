"""kernels.serving.engine: greedy outputs of the paged, continuously batched engine equal one-at-a-time
generation token for token, under any batch mix, chunk size, preemption and prefix hit; pages are
all given back."""
import kernels  # noqa: F401

import pytest
import torch

from kernels.model.data import encode
from kernels.model.gpt import load_pretrained
from kernels.serving.engine import Engine, EngineConfig, reference_generate

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
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
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
