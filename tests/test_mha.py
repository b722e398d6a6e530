"""kernels.attention.mha: the multi-head attention module against torch.nn.MultiheadAttention."""
import kernels  # noqa: F401  (before triton)

import copy

import pytest
import torch
import torch.nn as nn

from kernels.attention.mha import MultiHeadAttention, masked_attention_ref
from kernels import runtime
from kernels.testing import MismatchError, assert_close

DEVICE = runtime.device()


def _pair(d_model=48, heads=6, seed=0, bias=True):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(d_model, heads, batch_first=True, bias=bias).double()
    ours = MultiHeadAttention.from_torch(ref).double()
    return ref, ours


@pytest.mark.parametrize("causal,padding", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_torch_multihead_attention(causal, padding):
    ref, ours = _pair()
    x = torch.randn(3, 11, 48, dtype=torch.float64)
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[1, 7:] = True                       # right padding: every query still sees itself or earlier keys
    pad[2, 10:] = True
    attn_mask = torch.ones(11, 11, dtype=torch.bool).triu(1) if causal else None   # torch: True = hidden
    want, _ = ref(x, x, x, attn_mask=attn_mask, key_padding_mask=pad if padding else None, need_weights=False)
    got = ours(x, causal=causal, key_padding_mask=pad if padding else None)
    assert_close(got, want)


def test_cross_attention_and_no_bias():
    ref, ours = _pair(bias=False, seed=1)
    xq, xkv = torch.randn(2, 5, 48, dtype=torch.float64), torch.randn(2, 9, 48, dtype=torch.float64)
    want, _ = ref(xq, xkv, xkv, need_weights=False)
    assert_close(ours(xq, xkv), want)


def test_kernel_path_matches_reference_path_gqa():
    torch.manual_seed(2)
    m = MultiHeadAttention(64, 4, 2).to(DEVICE)
    x = torch.randn(2, 37, 64).to(DEVICE)
    m64 = copy.deepcopy(m).double()
    for causal in (False, True):
        with torch.no_grad():
            assert_close(m(x, causal=causal, use_kernel=True), m64(x.double(), causal=causal),
                         dtype=torch.float32, baseline=m(x, causal=causal))


def test_diagonal_visible_and_padding_hidden():
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    pad = torch.tensor([[False] * 4 + [True] * 2])
    _, p = masked_attention_ref(q, k, v, causal=True, key_padding_mask=pad, return_probs=True)
    assert (p.diagonal(dim1=-2, dim2=-1)[..., :4] > 0).all()        # each real token sees itself
    assert torch.equal(p[..., 4:], torch.zeros_like(p[..., 4:]))    # nobody sees padding
    assert torch.equal(p.triu(1), torch.zeros_like(p))              # nobody sees the future


def test_dropout_after_softmax_keeps_row_sums_in_expectation():
    q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(3)
    sums = torch.stack([masked_attention_ref(q, k, v, dropout_p=0.25, training=True, return_probs=True)[1].sum(-1)
                        for _ in range(2000)])
    assert abs(float(sums.mean()) - 1.0) < 0.02
    _, p_eval = masked_attention_ref(q, k, v, dropout_p=0.25, training=False, return_probs=True)
    assert_close(p_eval.sum(-1), torch.ones(1, 1, 4, dtype=torch.float64))


def test_missing_scale_is_caught():
    """Scores not divided by sqrt(D): a different function, and the check says so."""
    ref, ours = _pair(seed=4)
    x = torch.randn(2, 8, 48, dtype=torch.float64)
    want, _ = ref(x, x, x, need_weights=False)
    scale = ours.head_dim ** 0.5
    with torch.no_grad():
        ours.wq.weight.mul_(scale); ours.wq.bias.mul_(scale)     # q scaled up by sqrt(D) = the scale forgotten
    with pytest.raises(MismatchError):
        assert_close(ours(x), want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(50, 6)
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        MultiHeadAttention(48, 6, 4)
    m = MultiHeadAttention(48, 6)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 48), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="use_kernel"):
        m(torch.randn(2, 5, 48), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool), use_kernel=True)
    with pytest.raises(ValueError, match=r"\(B, N, 48\)"):
        m(torch.randn(2, 5, 40))
