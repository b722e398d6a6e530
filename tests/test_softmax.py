"""kernels.softmax: the fused and online Triton kernels, their backward, and the PyTorch references."""
import math

import kernels  # noqa: F401  (before triton)
import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.softmax import online as sm
from kernels.softmax.broken import softmax_without_rescale
from kernels.softmax import (
    merge_softmax_stats, naive_softmax_ref, online_softmax_ref, softmax, softmax_ref, softmax_stats,
)
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes          # fp32, fp16 (and bf16 on a GPU)
DEVICE = runtime.device()
# Rows shorter than a block, several rows per program, exactly one block, several blocks with a tail.
SHAPES = [(1, 1), (3, 7), (37, 1000), (2, 5, 4097), (5,), (4, 3, 1), (2, 4096), (3, 8200)]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf/NaN notices in the interpreter


def _x(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def _grads(fn, x, g):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, g)
    return y, dx


# ---------------------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_reference(shape, dtype):
    x = _x(shape, dtype)
    y = softmax(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, softmax_ref(x), dtype=dtype, name=f"softmax {shape}")


@pytest.mark.parametrize("shape,block", [((37, 300), 64), ((3, 129), 128), ((2, 3, 257), 16), ((4, 1), 1)])
def test_online_path_forced_by_small_blocks(shape, block):
    """Rows longer than block_size go through the online kernel: several blocks and a masked tail."""
    x = _x(shape)
    assert_close(softmax(x, block_size=block), softmax_ref(x), name=f"online softmax block {block}")


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_any_dim(dim):
    x = _x((6, 33, 5))
    assert_close(softmax(x, dim=dim), softmax_ref(x, dim=dim), name=f"softmax dim={dim}")


@pytest.mark.parametrize("make", [lambda x: x.t(), lambda x: x[:, ::2], lambda x: x[1:, 3:]], ids=["t", "step", "slice"])
def test_non_contiguous_input(make):
    x = make(_x((40, 70)))
    assert not x.is_contiguous()
    assert_close(softmax(x), softmax_ref(x), name="non-contiguous")
    assert_close(softmax(x, block_size=16), softmax_ref(x), name="non-contiguous, online")


@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("rows", [False, True])
def test_nan_canaries(rows, block):
    """Inputs inside NaN-filled buffers: a load past the end of a row (or of the tensor) shows up as NaN."""
    x = _x((9, 200))
    xc = nan_canary(x, rows=rows)
    assert_close(softmax(xc, block_size=block), softmax_ref(x), name=f"canary rows={rows}")


def test_all_neg_inf_rows_match_torch():
    """A row of all -inf is 0/0: NaN everywhere, as torch.softmax gives. A row that is -inf in its first
    blocks and finite later is exact (the early blocks contribute 0, not NaN)."""
    x = torch.randn(4, 5000)
    x[0] = float("-inf")                    # all -inf: NaN
    x[1, :4500] = float("-inf")             # -inf in the whole first block, finite after
    x[2, ::2] = float("-inf")               # scattered -inf: exact zeros there
    x = x.to(DEVICE)
    want = torch.softmax(x, dim=-1)
    assert torch.isnan(want[0]).all() and not torch.isnan(want[1:]).any()
    for block in (None, 1024):              # 5000 > 4096: online path both times
        assert_close(softmax(x, block_size=block), want, name=f"-inf rows, block {block}")
    short = x[:, 4400:4500].contiguous()    # 100 columns: the single-block path, row 1 all -inf here
    assert_close(softmax(short), torch.softmax(short, dim=-1), name="-inf rows, one block")
    assert torch.isnan(softmax(short)[:2]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_magnitudes(dtype):
    """Logits far beyond exp's range: the shifted kernel is exact, the naive formula overflows to NaN."""
    big = 6e4 if dtype == torch.float16 else 1e4
    x = (torch.rand(5, 300) * big).to(DEVICE, dtype)
    assert_close(softmax(x), softmax_ref(x), dtype=dtype, name="large logits")
    assert_close(softmax(x, block_size=64), softmax_ref(x), dtype=dtype, name="large logits, online")
    assert torch.isnan(naive_softmax_ref(x)).any(dim=-1).all()     # every row has inf/inf entries


def test_empty_and_single_element():
    assert softmax(torch.empty(0, 5, device=DEVICE)).shape == (0, 5)
    assert softmax(torch.empty(3, 0, device=DEVICE)).shape == (3, 0)
    assert torch.equal(softmax(torch.tensor([[-7.0]], device=DEVICE)), torch.ones(1, 1, device=DEVICE))


# ---------------------------------------------------------------------------------------------- references

def test_naive_overflow_thresholds():
    """exp overflows just above log(max): 11.09 in fp16, 88.72 in fp32; shifting by the max avoids it."""
    for dtype, limit in ((torch.float16, 11.09), (torch.float32, 88.72)):
        assert math.isclose(math.log(torch.finfo(dtype).max), limit, abs_tol=0.01)
        ok = torch.tensor([limit - 0.05, 0.0], dtype=dtype)
        bad = torch.tensor([limit + 0.05, 0.0], dtype=dtype)
        assert torch.isfinite(naive_softmax_ref(ok)).all()
        assert torch.isnan(naive_softmax_ref(bad)).any()
        assert torch.isfinite(torch.softmax(bad.float(), 0)).all()


def test_shift_invariance():
    x = _x((4, 50), torch.float64)
    for c in (-100.0, 3.0, 500.0):
        assert_close(softmax_ref(x + c), softmax_ref(x), name=f"shift by {c}")


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_online_reference_equals_softmax(block):
    x = _x((3, 5, 301), torch.float64)
    assert_close(online_softmax_ref(x, block=block), softmax_ref(x), name=f"online ref block {block}")
    assert_close(online_softmax_ref(x, dim=1, block=2), softmax_ref(x, dim=1), name="online ref dim=1")


def test_online_reference_neg_inf_rows():
    x = torch.randn(3, 40, dtype=torch.float64)
    x[0] = float("-inf")
    x[1, :30] = float("-inf")
    assert_close(online_softmax_ref(x, block=8), torch.softmax(x, -1), name="online ref -inf rows")


def test_merge_is_exact_associative_and_commutative():
    x = _x((2, 90), torch.float64, scale=20.0)
    parts = [softmax_stats(p) for p in (x[:, :10], x[:, 10:47], x[:, 47:])]
    m_all, l_all = softmax_stats(x)
    left = merge_softmax_stats(*merge_softmax_stats(*parts[0], *parts[1]), *parts[2])
    right = merge_softmax_stats(*parts[0], *merge_softmax_stats(*parts[1], *parts[2]))
    swapped = merge_softmax_stats(*parts[2], *merge_softmax_stats(*parts[1], *parts[0]))
    for name, (m, l) in (("left", left), ("right", right), ("swapped", swapped)):
        assert torch.equal(m, m_all), name
        assert_close(l, l_all, name=f"merged sum ({name})")


def test_merge_identity_is_neg_inf_zero():
    m, l = softmax_stats(torch.tensor([[1.0, 2.0]], dtype=torch.float64))
    empty = (torch.tensor([[float("-inf")]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))
    assert merge_softmax_stats(m, l, *empty) == (m, l)
    m2, l2 = merge_softmax_stats(*empty, *empty)
    assert torch.isneginf(m2).all() and (l2 == 0).all()      # (-inf, 0), not NaN


def test_references_gradcheck_float64():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: softmax_ref(t), (x,))
    assert torch.autograd.gradcheck(lambda t: online_softmax_ref(t, block=4), (x,))


# ---------------------------------------------------------------------------------------------- backward

@pytest.mark.parametrize("shape,block", [((1, 1), None), ((3, 7), None), ((37, 1000), None), ((2, 5, 4097), None),
                                         ((6, 300), 64), ((2, 3, 5), None)])
def test_backward_matches_autograd_fp32(shape, block):
    x = _x(shape)
    g = _x(shape, seed=1)
    y, dx = _grads(lambda t: softmax(t, block_size=block), x, g)
    _, dx_ref = _grads(softmax_ref, x.double(), g.double())
    _, dx_torch = _grads(lambda t: torch.softmax(t, -1), x, g)
    assert_close(dx, dx_ref, dtype=torch.float32, baseline=dx_torch, name="dx")


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_backward_low_precision(dtype):
    x, g = _x((7, 500), dtype), _x((7, 500), dtype, seed=1)
    _, dx = _grads(softmax, x, g)
    _, dx_ref = _grads(softmax_ref, x, g.float())
    _, dx_torch = _grads(lambda t: torch.softmax(t, -1), x, g)
    assert dx.dtype == dtype
    assert_close(dx, dx_ref, dtype=dtype, baseline=dx_torch, name=f"dx {dtype}")


def test_backward_other_dim_and_canary_gradient():
    x = _x((5, 40, 3))
    g = nan_canary(_x((5, 40, 3), seed=2))
    _, dx = _grads(lambda t: softmax(t, dim=1), x, g)
    _, dx_ref = _grads(lambda t: softmax_ref(t, dim=1), x.double(), g.double())
    assert_close(dx, dx_ref, dtype=torch.float32, name="dx dim=1")


def test_3d_training_use():
    """The tiny-GPT pattern: a 3-D attention-score tensor, softmax on the last dim, loss backward."""
    s = _x((2, 4, 24, 24)).requires_grad_()
    loss = (softmax(s) ** 2).sum()
    loss.backward()
    s2 = s.detach().double().requires_grad_()
    (softmax_ref(s2) ** 2).sum().backward()
    assert_close(s.grad, s2.grad, dtype=torch.float32, name="4-D grad")


# ---------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("x,dim,err,match", [
    (torch.arange(6).reshape(2, 3), -1, TypeError, "dtype torch.int64"),
    (torch.ones(2, 3, dtype=torch.float64), -1, TypeError, "float64"),
    (torch.tensor(1.0), -1, ValueError, "0-d"),
    (torch.ones(2, 3), 2, ValueError, "dim=2 is out of range"),
    ([1.0, 2.0], -1, TypeError, "torch.Tensor"),
])
def test_bad_input_refused(x, dim, err, match):
    with pytest.raises(err, match=match):
        softmax(x, dim=dim)


def test_bad_block_size_refused():
    with pytest.raises(ValueError, match="power of two"):
        softmax(torch.ones(2, 3, device=DEVICE), block_size=48)


# ---------------------------------------------------------------------------------------------- broken variants are caught

@triton.jit
def _no_max_kernel(x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x)                                   # BROKEN: no max subtraction
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _no_mask_kernel(x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    row_mask = (rows[:, None] < n_rows) & (cols[None, :] < BLOCK_N)   # BROKEN: reads past the row end
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _no_dot_bwd_kernel(y_ptr, g_ptr, dx_ptr, n_rows, n_cols, stride_y, stride_g, stride_dx,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = (rows[:, None] < n_rows) & (c[None, :] < n_cols)
        y = tl.load(y_ptr + rows[:, None] * stride_y + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * stride_dx + c[None, :], (y * g).to(dx_ptr.dtype.element_ty), mask=mask)  # BROKEN


def test_broken_no_max_subtraction_is_caught(monkeypatch):
    x = _x((5, 300), scale=40.0)                      # logits up to ~150: exp overflows fp32
    assert_close(softmax(x), softmax_ref(x))           # the real kernel passes
    monkeypatch.setattr(sm, "_softmax_kernel", _no_max_kernel)
    with pytest.raises(MismatchError):
        assert_close(softmax(x), softmax_ref(x))


def test_broken_missing_mask_is_caught_by_canary(monkeypatch):
    x = _x((6, 100))                                  # BLOCK_N = 128: 28 lanes past each row end
    monkeypatch.setattr(sm, "_softmax_kernel", _no_mask_kernel)
    with pytest.raises(MismatchError):
        assert_close(softmax(nan_canary(x, rows=True)), softmax_ref(x))


def test_broken_online_without_rescale_is_caught():
    """kernels.softmax.broken (the chapter shows the same kernel): the running sum not rescaled."""
    x = torch.linspace(-3, 3, 4 * 300).reshape(4, 300).to(DEVICE)   # increasing: the max grows every block
    assert_close(softmax(x, block_size=64), softmax_ref(x))
    with pytest.raises(MismatchError):
        assert_close(softmax_without_rescale(x, block_size=64), softmax_ref(x))
    flipped = x.flip(-1).contiguous()                                 # the max in the first block: no rescale needed
    assert_close(softmax_without_rescale(flipped, block_size=64), softmax_ref(flipped))


def test_broken_backward_is_caught(monkeypatch):
    x, g = _x((4, 50)), _x((4, 50), seed=3)
    _, dx_ref = _grads(softmax_ref, x.double(), g.double())
    monkeypatch.setattr(sm, "_softmax_bwd_kernel", _no_dot_bwd_kernel)
    _, dx = _grads(softmax, x, g)
    with pytest.raises(MismatchError):
        assert_close(dx, dx_ref, dtype=torch.float32)
