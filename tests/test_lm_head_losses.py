"""kernels.model.lm_head_losses: perplexity, soft targets (distillation), the token mean under
gradient accumulation."""
import math

import kernels  # noqa: F401  (before triton)
import pytest
import torch
import torch.nn.functional as F

from kernels.model.lm_head_losses import (
    accumulate_head_gradient, bits_per_byte, distillation_kl_ref, perplexity, soft_target_cross_entropy_ref,
)
from kernels.testing import MismatchError, assert_close


def test_perplexity_of_a_uniform_guess_is_the_vocabulary():
    V = 256
    logits = torch.zeros(10, V, dtype=torch.float64)
    nats = float(F.cross_entropy(logits, torch.arange(10)))
    assert math.isclose(perplexity(nats), V, rel_tol=1e-12)
    assert math.isclose(bits_per_byte(nats * 10, 10), 8.0, rel_tol=1e-12)   # one byte, 256 choices: 8 bits
    with pytest.raises(ValueError, match="n_bytes"):
        bits_per_byte(1.0, 0)


def test_bits_per_byte_does_not_depend_on_how_the_text_was_cut():
    """The same total nats over 12 bytes, cut into 12 byte tokens or 3 four-byte tokens: per-token
    perplexities differ by the fourth power, bits per byte agree."""
    total = 12 * 1.5
    per_byte, per_4byte = perplexity(total / 12), perplexity(total / 3)
    assert math.isclose(per_4byte, per_byte ** 4, rel_tol=1e-12)
    assert bits_per_byte(total, 12) == pytest.approx(1.5 / math.log(2))


def _logits(seed=0, N=7, V=33, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, V, generator=g, dtype=torch.float64) * scale,
            torch.randn(N, V, generator=g, dtype=torch.float64) * scale)


@pytest.mark.parametrize("T", [1.0, 2.0, 4.0])
def test_soft_targets_match_pytorch_and_their_gradient(T):
    s, t = _logits()
    s.requires_grad_()
    loss = soft_target_cross_entropy_ref(s, t, T)
    p = torch.softmax(t / T, -1)
    assert_close(loss, F.cross_entropy(s / T, p) * T * T)                      # PyTorch's probability targets
    kl = F.kl_div(torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1), log_target=True, reduction="batchmean")
    assert_close(distillation_kl_ref(s, t, T), kl * T * T)
    entropy = -(p * p.log()).sum(-1).mean() * T * T
    assert_close(loss, distillation_kl_ref(s, t, T) + entropy)                 # H(p, q) = KL(p || q) + H(p)
    (grad,) = torch.autograd.grad(loss, s)
    assert_close(grad, T * (torch.softmax(s / T, -1) - p) / s.shape[0])       # T^2 (q - p) / T, mean over rows
    (grad_kl,) = torch.autograd.grad(distillation_kl_ref(s, t, T), s)
    assert_close(grad_kl, grad)                                                # same slope: the entropy is constant


def test_one_hot_teacher_gives_the_ordinary_loss_and_a_wrong_scale_is_caught():
    s, _ = _logits(1)
    y = torch.randint(0, 33, (7,), generator=torch.Generator().manual_seed(2))
    one_hot_teacher = F.one_hot(y, 33).double() * 1e4                          # softmax = one-hot to 1e-4000
    assert_close(soft_target_cross_entropy_ref(s, one_hot_teacher), F.cross_entropy(s, y))
    s.requires_grad_()
    t = _logits(3)[1]
    (good,) = torch.autograd.grad(soft_target_cross_entropy_ref(s, t, 4.0), s)
    (no_t2,) = torch.autograd.grad(soft_target_cross_entropy_ref(s, t, 4.0) / 16, s)   # forgot the T^2
    with pytest.raises(MismatchError):
        assert_close(no_t2, good, name="without T^2")


def test_soft_targets_bad_inputs():
    s, t = _logits()
    with pytest.raises(ValueError, match="same shape"):
        soft_target_cross_entropy_ref(s, t[:, :5])
    with pytest.raises(ValueError, match="temperature"):
        soft_target_cross_entropy_ref(s, t, 0.0)


def _micro_batches(counts, V=11, C=6, seed=0):
    """Micro-batches of 8 tokens each, of which counts[i] are not ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in counts:
        y = torch.randint(0, V, (8,), generator=g)
        y[n:] = -100
        out.append((torch.randn(8, C, generator=g, dtype=torch.float64), y))
    return out


def _full_batch_gradient(w, mbs):
    w = w.detach().clone().requires_grad_()
    h, y = torch.cat([m[0] for m in mbs]), torch.cat([m[1] for m in mbs])
    F.cross_entropy(h @ w.T, y).backward()                                     # the mean over every token
    return w.grad


def test_global_token_count_gives_the_full_batch_gradient_and_the_mean_of_means_does_not():
    w = torch.randn(11, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    uneven = _micro_batches([8, 1])
    full = _full_batch_gradient(w, uneven)
    assert_close(accumulate_head_gradient(w, uneven, normalize="global"), full)
    with pytest.raises(MismatchError):
        assert_close(accumulate_head_gradient(w, uneven, normalize="micro_mean"), full, name="mean of means")
    even = _micro_batches([5, 5], seed=1)                                      # equal counts: the two agree
    assert_close(accumulate_head_gradient(w, even, normalize="micro_mean"), _full_batch_gradient(w, even))
    with pytest.raises(ValueError, match="normalize"):
        accumulate_head_gradient(w, even, normalize="mean")
