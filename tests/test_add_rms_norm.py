"""kernels.norm.add_rms_norm: fused residual add + RMSNorm, forward and backward."""
import importlib

import kernels  # noqa: F401  (before triton)
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime
from kernels.norm import add_rms_norm, add_rms_norm_ref
from kernels.norm.add_rms_norm import _AddRMSNorm

arn_mod = importlib.import_module("kernels.norm.add_rms_norm")   # the module, not the re-exported function
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()
SHAPES = [(1, 1), (3, 7), (37, 130), (2, 5, 96), (5, 1000)]
EPS = 1e-5


def _t(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def _grads(fn, x, r, w, gh, gy):
    """(h, y, dx, dr, dw) for the loss <h, gh> + <y, gy>."""
    x, r, w = (t.detach().clone().requires_grad_() for t in (x, r, w))
    h, y = fn(x, r, w)
    dx, dr, dw = torch.autograd.grad((h * gh).sum() + (y * gy).sum(), (x, r, w))
    return h, y, dx, dr, dw


def _unfused_torch(x, r, w, weight_offset=0.0):
    h = x + r
    return h, F.rms_norm(h, (h.shape[-1],), None if w is None else w + weight_offset, EPS)


def _case(shape, dtype):
    n = shape[-1]
    return (_t(shape, dtype, 0, 2.0), _t(shape, dtype, 1), _t((n,), dtype, 2), _t(shape, dtype, 3), _t(shape, dtype, 4))


def _check(x, r, w, gh, gy, block_size=None, x_in=None, r_in=None, weight_offset=0.0):
    """Kernel (h, y and every gradient) against the float64 reference within PyTorch's own error;
    ``weight_offset=1.0``: Gemma's (1 + w)."""
    dtype = x.dtype
    x_in, r_in = (x if x_in is None else x_in), (r if r_in is None else r_in)
    got = _grads(lambda a, b, c: add_rms_norm(a, b, c, EPS, weight_offset=weight_offset, block_size=block_size),
                 x_in, r_in, w, gh, gy)
    # reference: the two operations in float64 from the same (rounded) h
    h_dt = x + r
    ref = _grads(lambda a, b, c: add_rms_norm_ref(a, b, c, EPS, weight_offset), x.double(), r.double(), w.double(),
                 gh.double(), gy.double())
    base = _grads(lambda a, b, c: _unfused_torch(a, b, c, weight_offset), x, r, w, gh, gy)
    assert torch.equal(got[0], h_dt), "h must be exactly x + residual in x's dtype"
    for label, a, e, b in zip(["h", "y", "dx", "dresidual", "dw"], got, ref, base):
        assert a.dtype == dtype, label
        if label == "h":
            continue
        assert_close(a, e, dtype=dtype, baseline=b, name=f"add_rms_norm {label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward_match_reference(shape, dtype):
    _check(*_case(shape, dtype))


@pytest.mark.parametrize("shape,dtype", [((5, 300), torch.float32), ((2, 3, 257), torch.float16)], ids=str)
def test_rows_in_column_blocks(shape, dtype):
    """A forced block of 128 walks each row in blocks, the last one masked (forward and backward)."""
    _check(*_case(shape, dtype), block_size=128)


def test_column_blocks_inside_nan_canaries():
    x, r, w, gh, gy = _case((6, 300), torch.float32)
    _check(x, r, w, gh, gy, block_size=64, x_in=nan_canary(x, rows=True), r_in=nan_canary(r, rows=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_canary_rows_and_tail(dtype):
    """Inputs as row-padded views of NaN buffers: a load past the row end would poison the row."""
    x, r, w, _, _ = _case((9, 77), dtype)
    h, y = add_rms_norm(nan_canary(x, rows=True), nan_canary(r), w, EPS)
    hr, yr = add_rms_norm_ref(x, r, w, EPS)
    assert not torch.isnan(y).any() and not torch.isnan(h).any()
    assert_close(y, yr, dtype=dtype, baseline=_unfused_torch(x, r, w)[1])


def test_no_weight_and_large_values():
    x = _t((6, 50), torch.float32, 0, 1e4)
    r = _t((6, 50), torch.float32, 1, 1e4)
    h, y = add_rms_norm(x, r, None, EPS)
    assert_close(y, add_rms_norm_ref(x, r, None, EPS)[1])
    assert_close(h, x + r)


def test_gradcheck_float64_reference_agrees_with_fp32_kernel():
    """The backward formula (dh + norm backward) checked once more against autograd in float64."""
    x, r, w, gh, gy = _case((4, 33), torch.float32)
    got = _grads(lambda a, b, c: add_rms_norm(a, b, c, EPS), x, r, w, gh, gy)
    ref = _grads(_unfused_torch, x.double(), r.double(), w.double(), gh.double(), gy.double())
    for a, e in zip(got, ref):
        assert_close(a, e.float(), dtype=torch.float32)


def test_broken_variant_without_residual_gradient_is_caught():
    """Dropping the residual path's dh from the backward (a classic bug) must fail the check."""
    x, r, w, gh, gy = _case((37, 130), torch.float32)
    broken = _grads(lambda a, b, c: _AddRMSNorm.apply(a, b, c, EPS, None, False), x, r, w, gh, gy)
    ref = _grads(_unfused_torch, x.double(), r.double(), w.double(), gh.double(), gy.double())
    assert_close(broken[1], ref[1].float())            # the forward is still right
    with pytest.raises(MismatchError):
        assert_close(broken[2], ref[2].float(), name="dx without dh")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,block_size", [((3, 7), None), ((37, 130), None), ((2, 3, 300), 64)], ids=str)
def test_gemma_offset_forward_backward(shape, block_size, dtype):
    """weight_offset=1.0 (Gemma's (1 + w), w small around its zero init): h, y and every gradient against
    the float64 reference, one block and rows in blocks of 64 (masked tail), inside NaN canaries."""
    x, r, w, gh, gy = _case(shape, dtype)
    w = (w.float() * 0.1).to(dtype)
    _check(x, r, w, gh, gy, block_size=block_size, x_in=nan_canary(x, rows=True), r_in=nan_canary(r, rows=True),
           weight_offset=1.0)


def test_gemma_dw_is_the_plain_dw_at_one_plus_w():
    """fp32: Gemma's add+norm with w equals the plain one with 1 + w bit for bit, dw included
    (d(1 + w)/dw = 1, so dw = sum dy * hhat either way)."""
    x, r, w, gh, gy = _case((9, 77), torch.float32)
    gemma = _grads(lambda a, b, c: add_rms_norm(a, b, c, EPS, weight_offset=1.0), x, r, w, gh, gy)
    plain = _grads(lambda a, b, c: add_rms_norm(a, b, c + 1, EPS), x, r, w, gh, gy)
    for label, a, b in zip(("h", "y", "dx", "dresidual", "dw"), gemma, plain):
        assert torch.equal(a, b), label


def test_broken_gemma_backward_that_forgets_the_offset_is_caught(monkeypatch):
    x, r, w, gh, gy = _case((37, 130), torch.float32)
    right = arn_mod.backward_rows
    monkeypatch.setattr(arn_mod, "backward_rows", lambda *a, **k: right(*a, **{**k, "weight_offset": 0.0}))
    with pytest.raises(MismatchError, match="add_rms_norm dx"):
        _check(x, r, w, gh, gy, weight_offset=1.0)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(x, torch.randn(4, 9, device=DEVICE), None)
    with pytest.raises(TypeError, match="residual has dtype"):
        add_rms_norm(x, torch.randn(4, 8, dtype=torch.float16, device=DEVICE), None)
    with pytest.raises(ValueError, match="weight must have shape"):
        add_rms_norm(x, torch.randn(4, 8, device=DEVICE), torch.ones(7, device=DEVICE))
    with pytest.raises(TypeError, match="x has dtype"):
        add_rms_norm(x.long(), x.long(), None)
    with pytest.raises(ValueError, match="eps"):
        add_rms_norm(x, x, None, -1.0)
    with pytest.raises(ValueError, match="weight_offset must be a finite number"):
        add_rms_norm(x, x, torch.zeros(8, device=DEVICE), weight_offset=float("nan"))
    with pytest.raises(ValueError, match="needs a weight"):
        add_rms_norm(x, x, None, weight_offset=1.0)


@triton.jit
def _tiled_normalizes_x_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr, n, stride_x, stride_r, stride_h, stride_y,
                               eps, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ss = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row * stride_x + c, mask=c < n, other=0.0)
        r = tl.load(r_ptr + row * stride_r + c, mask=c < n, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + c, h, mask=c < n)
        ss += h.to(tl.float32) * h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / n + eps)
    for start in range(0, n, BLOCK_N):
        c = start + cols
        y = tl.load(x_ptr + row * stride_x + c, mask=c < n, other=0.0).to(tl.float32) * rstd   # BROKEN: x, not h
        y = y * tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=c < n)
    tl.store(rstd_ptr + row, rstd)


def test_broken_tiled_forward_that_normalizes_x_is_caught(monkeypatch):
    case = _case((4, 300), torch.float32)
    _check(*case, block_size=128)
    monkeypatch.setattr(arn_mod, "_add_rms_norm_fwd_tiled_kernel", _tiled_normalizes_x_kernel)
    with pytest.raises(MismatchError, match="add_rms_norm y"):
        _check(*case, block_size=128)
