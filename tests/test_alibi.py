"""kernels.position.alibi: the slopes for any head count (the paper's rule), the explicit bias and
its reference attention, and the train-short-test-long experiment (kernels.position.extrapolation).
The ALiBi option of flash_attention is tested in tests/test_flash_attention.py."""
import kernels  # noqa: F401  (before triton)

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.position import extrapolation as ex
from kernels.position.alibi import alibi_attention_ref, alibi_bias, alibi_slopes
from kernels.testing import MismatchError, assert_close


def test_slopes_for_powers_of_two():
    assert alibi_slopes(8).tolist() == [2.0 ** -h for h in range(1, 9)]          # the paper's 1/2 .. 1/256
    assert_close(alibi_slopes(16), torch.tensor([2.0 ** (-h / 2) for h in range(1, 17)], dtype=torch.float64))
    assert alibi_slopes(1).tolist() == [2.0 ** -8]


@pytest.mark.parametrize("n", [3, 5, 6, 12, 20, 112])
def test_slopes_for_other_head_counts(n):
    """The nearest lower power of two p gives p slopes; the other n - p are every other slope of the
    2p sequence: geometric exponents -8h/p and -8(2h - 1)/(2p), all distinct, all in (0, 1)."""
    p = 2 ** int(math.log2(n))
    want = [2.0 ** (-8 * h / p) for h in range(1, p + 1)] + [2.0 ** (-8 * (2 * h - 1) / (2 * p)) for h in range(1, n - p + 1)]
    got = alibi_slopes(n)
    assert_close(got, torch.tensor(want, dtype=torch.float64))
    assert len(set(got.tolist())) == n and bool(((got > 0) & (got < 1)).all())


def test_slopes_reject_bad_counts():
    with pytest.raises(ValueError, match="positive integer"):
        alibi_slopes(0)


def test_bias_is_linear_in_distance_and_zero_on_the_diagonal():
    slopes = alibi_slopes(4)
    b = alibi_bias(slopes, 5, 5)
    assert b.shape == (4, 5, 5)
    assert b[:, torch.arange(5), torch.arange(5)].abs().max() == 0
    assert_close(b[2, 4, 1], -slopes[2] * 3)
    b = alibi_bias(slopes, 2, 6)                                     # queries at positions 4 and 5
    assert_close(b[0, 0], -slopes[0] * torch.tensor([4.0, 3, 2, 1, 0, 1], dtype=torch.float64))


def test_reference_equals_sdpa_with_the_bias_as_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 11, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = alibi_slopes(4)
    mask = alibi_bias(slopes, 11, 11).masked_fill(~torch.ones(11, 11, dtype=torch.bool).tril(), float("-inf"))
    assert_close(alibi_attention_ref(q, k, v, slopes), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    with pytest.raises(MismatchError):                                # the bias with the wrong sign is another function
        assert_close(alibi_attention_ref(q, k, v, -slopes), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_bias_shift_invariance():
    """Like RoPE, ALiBi depends only on i - j: a query block at the end of a longer key range sees the same
    bias as the same block alone (the bottom-right alignment)."""
    slopes = alibi_slopes(2)
    assert_close(alibi_bias(slopes, 3, 10)[:, :, 7:], alibi_bias(slopes, 3, 3))


# ----------------------------------------------------------------------------------------------
# Train short, test long


def test_forward_modes_differ_and_reject_unknown():
    torch.manual_seed(0)
    model = ex.GPT(ex.CONFIG).eval()
    idx = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        outs = {m: ex.forward(model, idx, m) for m in ex.MODES}
    assert not torch.allclose(outs["rope"], outs["nope"]) and not torch.allclose(outs["alibi"], outs["nope"])
    with pytest.raises(ValueError, match="mode"):
        ex.forward(model, idx, "sinusoidal")


def test_forward_returns_the_attention_probabilities_it_uses():
    """probs (V = I) are causal rows summing to 1, leave the logits unchanged, and carry the bias:
    the ALiBi model's probabilities differ from the same weights' NoPE probabilities."""
    torch.manual_seed(0)
    model = ex.GPT(ex.CONFIG).eval()
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        got = {m: [] for m in ("alibi", "nope")}
        logits = {m: ex.forward(model, idx, m, probs=got[m]) for m in got}
        assert torch.equal(logits["alibi"], ex.forward(model, idx, "alibi"))
    for p in got["alibi"]:
        assert p.shape == (2, ex.CONFIG.n_head, 12, 12)
        assert torch.allclose(p.sum(-1), torch.ones(2, ex.CONFIG.n_head, 12))
        assert torch.all(p.triu(1) == 0)
    assert len(got["alibi"]) == ex.CONFIG.n_layer
    assert not torch.allclose(got["alibi"][0], got["nope"][0])


def test_a_few_training_steps_lower_the_loss():
    _, losses = ex.train("alibi", steps=6)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_committed_checkpoints_reproduce_their_results():
    res = ex.results()
    for mode in ex.MODES:
        stored = res["models"][mode]["val_loss"]["128"]
        assert abs(ex.evaluate(ex.load(mode), mode, 128) - stored) < 1e-3


def test_alibi_extrapolates_and_rope_does_not():
    """The chapter's claims, from the committed results: at 8x the training length ALiBi's loss stays
    within 0.1 nats of its loss at the training length while RoPE's rises by more than 0.5; at the
    training length RoPE < ALiBi < NoPE, at 512 tokens ALiBi < NoPE < RoPE."""
    v = {m: r["val_loss"] for m, r in ex.results()["models"].items()}
    assert abs(v["alibi"]["512"] - v["alibi"]["64"]) < 0.1
    assert v["rope"]["512"] > v["rope"]["64"] + 0.5
    assert v["rope"]["64"] < v["alibi"]["64"] < v["nope"]["64"]
    assert v["alibi"]["512"] < v["nope"]["512"] < v["rope"]["512"]
