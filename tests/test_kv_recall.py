"""The multi-needle recall task and its three committed models (kernels/kvcache/recall.py), on which the
kv-eviction chapter ranks the eviction policies."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels.kvcache import eviction as ev
from kernels.kvcache import recall as rc

CHANCE = 1 / rc.VALUES          # the key is given by the question; the value is not


@pytest.fixture(scope="module")
def models():
    return [rc.load(s) for s in rc.SEEDS]


@pytest.fixture(scope="module")
def prompts():
    return rc.held_out()


def test_generator_answer_is_recoverable():
    """Every answer is the context's one fact with the asked key, at the needle position the generator
    reports; the question list asks the answer block's keys in order; only the answers are targets."""
    x, y, needle_pos = rc.recall_batch(64, torch.Generator().manual_seed(3))
    ans = rc.answer_positions()
    facts = x[:, ans + 1]
    assert torch.equal(rc.lookup_answers(x), facts)
    assert torch.equal(x.gather(1, needle_pos), facts)
    assert bool((needle_pos < rc.CONTEXT).all())
    assert torch.equal(x[:, rc.CONTEXT:rc.CONTEXT + rc.ASKED], x[:, ans])
    assert torch.equal((facts - rc.FACT0) // rc.VALUES, x[:, ans] - rc.KEY0)      # each fact binds its key
    context = x[:, :rc.CONTEXT]
    assert bool(((context >= rc.FACT0).sum(1) == rc.NEEDLES).all())
    for row in context:
        keys = (row[row >= rc.FACT0] - rc.FACT0) // rc.VALUES
        assert len(keys.unique()) == rc.NEEDLES                                      # keys distinct in a context
    target = torch.full_like(y, -100)
    target[:, ans] = facts
    assert torch.equal(y, target)


def test_lookup_is_not_the_identity():
    """The solver must read the context: with the facts of another context it does not find the answers."""
    x, _, _ = rc.recall_batch(64, torch.Generator().manual_seed(4))
    other, _, _ = rc.recall_batch(64, torch.Generator().manual_seed(5))
    swapped = x.clone()
    swapped[:, :rc.CONTEXT] = other[:, :rc.CONTEXT]
    assert (rc.lookup_answers(swapped) == x[:, rc.answer_positions() + 1]).float().mean() < 0.2


def test_training_rerun_reproduces_the_committed_log():
    """The first 20 steps of seed 0, re-run, give the losses metrics.json logged (rounded to 5 decimals)."""
    _, losses = rc.train(0, steps=20, progress=False)
    logged = rc.metrics()["seeds"]["0"]["first_losses"]
    assert max(abs(a - b) for a, b in zip(losses, logged)) < 1e-4
    assert losses[-1] < losses[0]


def test_full_cache_beats_chance_and_matches_the_log(models, prompts):
    x, _, needle_pos = prompts
    for seed, model in zip(rc.SEEDS, models):
        for cut, P in rc.CUTS.items():
            r = rc.recall(model, x, needle_pos, P)
            acc = r["correct"].float().mean().item()
            assert acc > 0.95 > 10 * CHANCE, (seed, cut, acc)
            assert acc == rc.metrics()["seeds"][str(seed)]["full_cache_accuracy"][cut]
            assert bool(r["kept"].all()) and not bool(r["lost"].any())


def test_window_keeps_exactly_the_needles_in_its_window(models, prompts):
    """The bookkeeping of recall(): a window of 8 over the 64-token context reads positions 56..63 only, and
    the answers whose needle lies there are right while the others are guesses."""
    x, _, needle_pos = prompts
    r = rc.recall(models[0], x, needle_pos, rc.CUTS["question after the cut"], "window", 8)
    assert torch.equal(r["kept"], needle_pos >= 56) and torch.equal(r["lost"], needle_pos < 56)
    assert r["correct"][r["kept"]].float().mean() > 0.95
    assert r["correct"][r["lost"]].float().mean() < 2 * CHANCE


def _decode_accuracy(model, x, keep) -> float:
    """Token-by-token decode (ev.step_decode) after the 64-token context, with the prompt slots keep(i) (budget,)
    kept by every layer and K/V head of sequence i; the share of right answers."""
    P = rc.CUTS["question after the cut"]
    ans = rc.answer_positions()
    right = []
    for i in range(x.shape[0]):
        slots = keep(i).expand(model.config.n_kv_head, -1)
        logits = ev.step_decode(model, x[i], P, [slots] * model.config.n_layer)         # (T - P, V): row t - P predicts t + 1
        right.append(logits[ans - P].argmax(-1) == x[i, ans + 1])
    return torch.cat(right).float().mean().item()


def test_an_eviction_that_drops_the_needles_fails_recall(models, prompts):
    """The broken variant: a cache of 16 that keeps every needle answers; one of the same size that keeps
    anything but the asked needles can only guess. So the model's answers do come from the early token."""
    x, _, needle_pos = prompts
    x, needle_pos = x[:6], needle_pos[:6]
    context = x[:, :rc.CONTEXT]

    def with_needles(i):
        needles = (context[i] >= rc.FACT0).nonzero()[:, 0]                               # all 12, asked or not
        others = (context[i] < rc.FACT0).nonzero()[:, 0][: 16 - len(needles)]
        return torch.cat([needles, others]).sort().values

    def without_asked(i):
        allowed = torch.ones(rc.CONTEXT, dtype=torch.bool)
        allowed[needle_pos[i]] = False
        return allowed.nonzero()[:, 0][-16:]

    assert _decode_accuracy(models[0], x, with_needles) > 0.95
    assert _decode_accuracy(models[0], x, without_asked) < 3 * CHANCE


def test_bad_inputs_are_refused(models, prompts):
    x, _, needle_pos = prompts
    with pytest.raises(ValueError, match="n must be"):
        rc.recall_batch(0, torch.Generator())
    with pytest.raises(ValueError, match="prompt_len"):
        rc.recall(models[0], x, needle_pos, 50)
    with pytest.raises(ValueError, match="needle_pos"):
        rc.recall(models[0], x, needle_pos[:, :3], 64)
