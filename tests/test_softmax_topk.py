"""kernels.softmax.topk: softmax fused with top-k, the PyTorch pass and the Triton kernel, against
torch.topk(torch.softmax(x)); and kernels.softmax.log_softmax_ref against torch.log_softmax."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.softmax import log_softmax_ref, softmax_ref
from kernels.softmax import topk as tk
from kernels.softmax.topk import softmax_topk, softmax_topk_ref
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf notices in the interpreter


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)   # continuous: no ties among the top k


def _want(x, k):
    return torch.topk(softmax_ref(x), k, dim=-1)


@pytest.mark.parametrize("shape,k,block", [((1, 1), 1, None), ((3, 7), 7, None), ((5, 1000), 5, None),
                                           ((2, 3, 300), 8, 64), ((2, 9), 9, 4), ((3, 5000), 3, 1024)])
def test_kernel_and_reference_match_topk_of_softmax(shape, k, block):
    x = _x(shape)
    want_p, want_i = _want(x, k)
    p, i = softmax_topk(nan_canary(x, rows=True), k, block_size=block)
    assert p.shape == want_p.shape and i.dtype == torch.int64
    assert torch.equal(i, want_i)
    assert_close(p, want_p, name=f"kernel {shape} k={k}")
    rp, ri = softmax_topk_ref(x, k, block=block or 128)
    assert torch.equal(ri, want_i)
    assert_close(rp, want_p, name=f"reference {shape} k={k}")


def test_fp16_and_large_logits():
    """Distinct fp16 logits from 30 to 42: exp(30) overflows fp16, so the shift by the max is what works."""
    g = torch.Generator().manual_seed(0)
    x = torch.stack([30 + torch.randperm(200, generator=g) * 0.0625 for _ in range(4)]).to(DEVICE, torch.float16)
    want_p, want_i = _want(x, 4)
    p, i = softmax_topk(x, 4, block_size=128)
    assert p.dtype == torch.float16
    assert torch.equal(i, want_i)
    assert_close(p, want_p, dtype=torch.float16, name="fp16")


def test_max_in_a_late_block():
    """The row's max arrives in the last block: the running sum must be rescaled and the top-k replaced."""
    x = torch.linspace(-5, 5, 3 * 400).reshape(3, 400).to(DEVICE)
    want_p, want_i = _want(x, 6)
    p, i = softmax_topk(x, 6, block_size=64)
    assert torch.equal(i, want_i)
    assert_close(p, want_p)


@pytest.mark.parametrize("k", [0, 8, 65, 2.0, True])
def test_bad_k_refused(k):
    with pytest.raises(ValueError, match="k must be"):
        softmax_topk(torch.ones(2, 7, device=DEVICE), k)


@triton.jit
def _last_block_only_kernel(x_ptr, p_ptr, i_ptr, n_cols, stride_x, K: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.full((), 0.0, tl.float32)
    top_v = tl.full((BLOCK_K,), float("-inf"), tl.float32)
    top_i = tl.full((BLOCK_K,), -1, tl.int64)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        for r in tl.static_range(K):                 # BROKEN: the running top-k is replaced, not merged
            bj = tl.argmax(x, axis=0)
            top_v = tl.where(ks == r, tl.max(x, axis=0), top_v)
            top_i = tl.where(ks == r, start + bj, top_i)
            x = tl.where(cols == bj, float("-inf"), x)
    tl.store(p_ptr + row * K + ks, tl.exp(top_v - m) / l, mask=ks < K)
    tl.store(i_ptr + row * K + ks, top_i, mask=ks < K)


def test_broken_merge_is_caught(monkeypatch):
    x = _x((4, 300))
    want_p, want_i = _want(x, 5)
    monkeypatch.setattr(tk, "_softmax_topk_kernel", _last_block_only_kernel)
    p, i = softmax_topk(x, 5, block_size=64)
    with pytest.raises(MismatchError):
        assert_close(p, want_p)
    assert not torch.equal(i, want_i)


# ---------------------------------------------------------------------------------------------- log-softmax

def test_log_softmax_reference():
    x = _x((3, 5, 301), torch.float64)
    assert_close(log_softmax_ref(x), torch.log_softmax(x, -1), name="log_softmax")
    assert_close(log_softmax_ref(x, dim=1), torch.log_softmax(x, 1), name="log_softmax dim=1")
    rows = torch.tensor([[0.0, -200.0, -1e4], [float("-inf")] * 3])
    got, want = log_softmax_ref(rows), torch.log_softmax(rows, -1)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    assert_close(got[0], want[0])
    assert torch.isneginf(torch.log(torch.softmax(rows[0], -1))).any()     # the composed form loses them
