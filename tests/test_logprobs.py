"""kernels.rl.logprobs: token log-probabilities from logits and from the LM head, forward and backward."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch

from kernels import runtime
from kernels.rl.logprobs import (
    fused_linear_token_logprobs, fused_linear_token_logprobs_ref, token_logprobs, token_logprobs_ref,
)
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()


def _data(N, V, C=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (N,), generator=g)
    if C is None:
        return (torch.randn(N, V, generator=g, dtype=torch.float64) * 3).float(), t
    h = torch.randn(N, C, generator=g, dtype=torch.float64).float()
    w = (torch.randn(V, C, generator=g, dtype=torch.float64) * 0.5).float()
    return h, w, t


def _grad(fn, inputs, g_out):
    xs = [x.detach().clone().requires_grad_() for x in inputs[:-1]]
    out = fn(*xs, inputs[-1])
    return out, torch.autograd.grad(out, xs, g_out)


# V: smaller than one block (300 < 512), exactly one, several blocks with a tail (2048-wide blocks)
@pytest.mark.parametrize("N,V", [(1, 7), (37, 300), (5, 2048), (9, 4500)])
def test_token_logprobs_forward_and_backward(N, V):
    x, t = _data(N, V)
    g_out = torch.randn(N, dtype=torch.float64).float()
    got, (dx,) = _grad(token_logprobs, (x, t), g_out)
    want, (dx_ref,) = _grad(token_logprobs_ref, (x, t), g_out)
    assert_close(got, want, name="logp")
    assert_close(dx, dx_ref, name="dlogits")


def test_token_logprobs_reads_only_its_rows():
    """Rows inside NaN-padded buffers: a load past a row's end would turn the answer into NaN."""
    x, t = _data(6, 300)
    got, (dx,) = _grad(token_logprobs, (nan_canary(x, rows=True), t), torch.ones(6))
    want, (dx_ref,) = _grad(token_logprobs_ref, (x, t), torch.ones(6))
    assert_close(got, want, name="logp")
    assert_close(dx, dx_ref, name="dlogits")


def test_large_logits_do_not_overflow():
    x, t = _data(4, 300)
    x = x * 1000
    assert_close(token_logprobs(x, t), token_logprobs_ref(x, t), name="logp at |z| ~ 1e4")


def test_batch_shape_is_kept_and_fp16_is_accepted():
    x, t = _data(12, 300)
    got = token_logprobs(x.view(3, 4, 300).half(), t.view(3, 4))
    assert got.shape == (3, 4) and got.dtype == torch.float32
    assert_close(got, token_logprobs_ref(x.view(3, 4, 300).half(), t.view(3, 4)), dtype=torch.float16)


@pytest.mark.parametrize("N,chunk", [(23, None), (23, 5), (1, 1), (40, 40)])
def test_fused_linear_matches_the_full_logits(N, chunk):
    h, w, t = _data(N, 300, C=24)
    g_out = torch.randn(N, dtype=torch.float64).float()
    got, (dh, dw) = _grad(lambda a, b, c: fused_linear_token_logprobs(a, b, c, chunk), (h, w, t), g_out)
    want, (dh_ref, dw_ref) = _grad(fused_linear_token_logprobs_ref, (h, w, t), g_out)
    assert_close(got, want, name="logp")
    assert_close(dh, dh_ref, name="dhidden")
    assert_close(dw, dw_ref, name="dweight")


def test_broken_backward_is_caught():
    """The variant that drops the one-hot term has the gradient of -lse alone: caught."""
    x, t = _data(9, 300)
    _, (dx,) = _grad(lambda a, b: token_logprobs(a, b, one_hot=False), (x, t), torch.ones(9))
    _, (dx_ref,) = _grad(token_logprobs_ref, (x, t), torch.ones(9))
    with pytest.raises(MismatchError):
        assert_close(dx, dx_ref, name="broken dlogits")


def test_peer_check_against_trl_selective_log_softmax():
    """TRL's selective_log_softmax (trl/trainer/utils.py) is the log_softmax-and-gather TRL's trainers use."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    x, t = _data(3 * 11, 300)
    x, t = x.view(3, 11, 300), t.view(3, 11)
    assert_close(token_logprobs(x, t), trl_utils.selective_log_softmax(x, t), name="ours vs TRL")


def test_bad_inputs_are_refused():
    x, t = _data(4, 300)
    with pytest.raises(ValueError, match="target shape"):
        token_logprobs(x, t[:3])
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 300\)"):
        token_logprobs(x, torch.tensor([0, 1, 2, 300]))
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        token_logprobs(x, t.float())
    with pytest.raises(TypeError, match="supported"):
        token_logprobs(x.double(), t)
    h, w, t = _data(4, 300, C=8)
    with pytest.raises(ValueError, match=r"weight \(V, C\)"):
        fused_linear_token_logprobs(h, w.T, t)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        fused_linear_token_logprobs(h, w, t, 0)
