"""kernels.norm: LayerNorm and RMSNorm kernels (forward and backward) and the BatchNorm reference."""
import importlib

import kernels  # noqa: F401  (before triton)
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime
from kernels.norm import (
    batch_norm, batch_norm_ref, layer_norm, layer_norm_backward_ref, layer_norm_ref, rms_norm, rms_norm_backward_ref, rms_norm_ref,
)
from kernels.testing import MismatchError, assert_close, nan_canary

# The modules themselves: the package's names layer_norm and rms_norm are the re-exported functions.
bn_mod = importlib.import_module("kernels.norm.batch_norm")
ln_mod = importlib.import_module("kernels.norm.layer_norm")   # the modules, not the re-exported functions
rms_mod = importlib.import_module("kernels.norm.rms_norm")

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()
SHAPES = [(1, 1), (3, 7), (37, 1000), (2, 5, 4097), (300, 48), (4, 1), (2, 3, 64)]


def _t(shape, dtype=torch.float32, scale=1.0, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(DEVICE, dtype)


def _run(fn, tensors, g):
    """fn(*tensors) and the gradients of <fn, g> for every tensor argument that is not None."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    return (y, *torch.autograd.grad(y, wrt, g))


def _ln_case(shape, dtype, weight=True, bias=True, shift=0.0):
    n = shape[-1]
    x = _t(shape, dtype, scale=2.0, shift=shift)
    w = _t((n,), dtype, seed=1) if weight else None
    b = _t((n,), dtype, seed=2) if bias else None
    g = _t(shape, dtype, seed=3)
    return x, w, b, g


def _check_layer_norm(x, w, b, g, x_in=None, eps=1e-5, name="layer_norm", block_size=None):
    """Kernel vs the reference in float64 (forward and every gradient), within a small multiple of
    PyTorch's own error in x's dtype (the baseline rule: the backward is a reduction over rows)."""
    n = x.shape[-1]
    x_in = x if x_in is None else x_in
    got = _run(lambda a, c, d: layer_norm(a, c, d, eps, block_size=block_size), (x_in, w, b), g)
    dbl = lambda t: None if t is None else t.double()  # noqa: E731
    ref = _run(lambda a, c, d: layer_norm_ref(a, c, d, eps), (dbl(x), dbl(w), dbl(b)), g.double())
    base = _run(lambda a, c, d: F.layer_norm(a, (n,), c, d, eps), (x, w, b), g)
    labels = ["y", "dx"] + (["dw"] if w is not None else []) + (["db"] if b is not None else [])
    for label, a, r, bl in zip(labels, got, ref, base):
        assert a.dtype == x.dtype, label
        assert_close(a, r, dtype=x.dtype, baseline=bl, name=f"{name} {label}")


def _check_rms_norm(x, w, g, x_in=None, eps=1e-6, name="rms_norm", block_size=None, weight_offset=0.0):
    """Kernel vs the float64 reference; ``weight_offset=1.0`` is Gemma's (1 + w), whose PyTorch baseline
    is F.rms_norm with weight 1 + w (autograd's dw through 1 + w is the same sum)."""
    n = x.shape[-1]
    x_in = x if x_in is None else x_in
    got = _run(lambda a, c: rms_norm(a, c, eps, weight_offset=weight_offset, block_size=block_size), (x_in, w), g)
    ref_eps = torch.finfo(x.dtype).eps if eps is None else eps
    dbl = lambda t: None if t is None else t.double()  # noqa: E731
    ref = _run(lambda a, c: rms_norm_ref(a, c, ref_eps, weight_offset), (dbl(x), dbl(w)), g.double())
    base = _run(lambda a, c: F.rms_norm(a, (n,), None if c is None else c + weight_offset, eps), (x, w), g)
    labels = ["y", "dx"] + (["dw"] if w is not None else [])
    for label, a, r, bl in zip(labels, got, ref, base):
        assert a.dtype == x.dtype, label
        assert_close(a, r, dtype=x.dtype, baseline=bl, name=f"{name} {label}")


# ---------------------------------------------------------------------------------------------- LayerNorm

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_forward_backward(shape, dtype):
    _check_layer_norm(*_ln_case(shape, dtype))


@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
def test_layer_norm_optional_affine(weight, bias):
    _check_layer_norm(*_ln_case((13, 77), torch.float32, weight, bias))


@pytest.mark.parametrize("rows", [False, True])
def test_layer_norm_nan_canaries(rows):
    x, w, b, g = _ln_case((9, 300), torch.float32)
    _check_layer_norm(x, w, b, nan_canary(g, rows=rows), x_in=nan_canary(x, rows=rows), name="canary")


def test_layer_norm_large_offset_and_magnitude():
    """x = 1e4 + N(0, 1): E[x^2] - E[x]^2 would cancel catastrophically in fp32; x - mean does not."""
    _check_layer_norm(*_ln_case((16, 500), torch.float32, shift=1e4), name="offset 1e4")
    x, w, b, g = _ln_case((16, 500), torch.float32)
    _check_layer_norm(x * 1e4, w, b, g, name="scale 1e4")


def test_layer_norm_non_contiguous_and_3d_grad():
    x, w, b, g = _ln_case((30, 40), torch.float32)
    _check_layer_norm(x.t(), w[:30].contiguous(), b[:30].contiguous(), g.t(), name="transposed")
    _check_layer_norm(*_ln_case((2, 3, 5, 24), torch.float32), name="4-D")


def test_layer_norm_ref_is_torch_and_gradchecks():
    x, w, b, _ = _ln_case((5, 17), torch.float64)
    assert_close(layer_norm_ref(x, w, b, 1e-5), F.layer_norm(x, (17,), w, b, 1e-5), name="layer_norm_ref")
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda a, c, d: layer_norm_ref(a, c, d, 1e-5), args)


# ---------------------------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_forward_backward(shape, dtype):
    x, w, _, g = _ln_case(shape, dtype)
    _check_rms_norm(x, w, g)


def test_rms_norm_without_weight():
    x, _, _, g = _ln_case((13, 77), torch.float32)
    _check_rms_norm(x, None, g)


@pytest.mark.parametrize("rows", [False, True])
def test_rms_norm_nan_canaries(rows):
    x, w, _, g = _ln_case((9, 300), torch.float32)
    _check_rms_norm(x, w, nan_canary(g, rows=rows), x_in=nan_canary(x, rows=rows), name="canary")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_default_eps_is_dtype_eps(dtype):
    """eps=None means finfo(x.dtype).eps (F.rms_norm's rule); visible on tiny inputs where eps dominates."""
    x, w, _, g = _ln_case((8, 64), torch.float32)
    x = (x * 3e-4).to(dtype)                           # mean(x^2) ~ 1e-7: the same order as fp32's eps
    _check_rms_norm(x, w.to(dtype), g.to(dtype), eps=None, name="eps=None")
    other = rms_norm(x, w.to(dtype), 1e-12)
    assert (other.float() - rms_norm(x, w.to(dtype)).float()).abs().max() > 0.1   # eps matters here


def test_rms_norm_large_magnitudes():
    x, w, _, g = _ln_case((16, 500), torch.float32)
    _check_rms_norm(x * 1e15, w, g, name="x * 1e15")   # x^2 ~ 1e30, still inside fp32's range


def test_rms_norm_3d_training_use():
    """The tiny-GPT pattern: (batch, seq, d) activations, a learned weight, loss backward."""
    x, w, _, g = _ln_case((2, 9, 48), torch.float32)
    _check_rms_norm(x, w, g, name="3-D")


def test_rms_norm_ref_is_torch_and_gradchecks():
    x, w, _, _ = _ln_case((5, 17), torch.float64)
    assert_close(rms_norm_ref(x, w, 1e-6), F.rms_norm(x, (17,), w, 1e-6), name="rms_norm_ref")
    assert_close(rms_norm_ref(x, w), F.rms_norm(x, (17,), w), name="rms_norm_ref eps=None")
    args = [t.clone().requires_grad_() for t in (x, w)]
    assert torch.autograd.gradcheck(lambda a, c: rms_norm_ref(a, c, 1e-6), args)


# ---------------------------------------------------------------------------------------------- Gemma's (1 + w)

def _gemma_case(shape, dtype):
    """x, a Gemma weight (zero at init, trained to small values around it) and g."""
    x, w, _, g = _ln_case(shape, dtype)
    return x, (w.float() * 0.1).to(dtype), g


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,block_size", [((1, 1), None), ((3, 7), None), ((37, 1000), None),
                                              ((2, 3, 300), 64)], ids=str)
def test_rms_norm_gemma_offset_forward_backward(shape, block_size, dtype):
    """weight_offset=1.0 (Gemma's x / rms(x) * (1 + w)): y, dx and dw against the float64 reference,
    one block and rows walked in blocks of 64 with a masked tail, inside NaN canaries."""
    x, w, g = _gemma_case(shape, dtype)
    _check_rms_norm(x, w, g, x_in=nan_canary(x, rows=True), block_size=block_size, weight_offset=1.0, name="gemma")


@pytest.mark.parametrize("block_size", [None, 64])
def test_gemma_offset_is_llama_at_one_plus_w_and_dw_is_unchanged(block_size):
    """In fp32 the kernel forms 1 + w exactly as the caller would, so Gemma's norm with w is Llama's with
    1 + w bit for bit: y, dx, and dw, whose formula sum(g * xhat) has no w in it (d(1 + w)/dw = 1)."""
    x, w, g = _gemma_case((6, 300), torch.float32)
    gemma = _run(lambda a, c: rms_norm(a, c, 1e-6, weight_offset=1.0, block_size=block_size), (x, w), g)
    llama = _run(lambda a, c: rms_norm(a, c, 1e-6, block_size=block_size), (x, 1 + w), g)
    for label, a, b in zip(("y", "dx", "dw"), gemma, llama):
        assert torch.equal(a, b), label


def test_gemma_reference_gradchecks_and_hand_backward_matches():
    x, w, g = _gemma_case((4, 19), torch.float64)
    args = [t.clone().requires_grad_() for t in (x, w)]
    assert torch.autograd.gradcheck(lambda a, c: rms_norm_ref(a, c, 1e-6, weight_offset=1.0), args)
    _, *auto = _run(lambda a, c: rms_norm_ref(a, c, 1e-6, weight_offset=1.0), (x, w), g)
    for label, hand, a in zip(("dx", "dw"), rms_norm_backward_ref(x, w, g, 1e-6, weight_offset=1.0), auto):
        assert_close(hand, a, name=f"Gemma RMSNorm {label}")


@pytest.mark.parametrize("block_size", [None, 64])
def test_broken_gemma_backward_that_forgets_the_offset_is_caught(monkeypatch, block_size):
    """A backward that scales g by w instead of 1 + w (the forward still right) must fail on dx."""
    x, w, g = _gemma_case((5, 300), torch.float32)
    right = rms_mod.backward_rows
    monkeypatch.setattr(rms_mod, "backward_rows", lambda *a, **k: right(*a, **{**k, "weight_offset": 0.0}))
    with pytest.raises(MismatchError, match="gemma dx"):
        _check_rms_norm(x, w, g, block_size=block_size, weight_offset=1.0, name="gemma")


@pytest.mark.parametrize("weight", [True, False])
def test_hand_derived_backwards_equal_autograd(weight):
    """The backward formulas written out in PyTorch (the ones the kernels implement) against autograd, float64."""
    x, w, b, g = _ln_case((2, 6, 33), torch.float64, weight=weight)
    _, *auto = _run(lambda a, c, d: layer_norm_ref(a, c, d, 1e-5), (x, w, b), g)
    hand = [t for t in layer_norm_backward_ref(x, w, g, 1e-5) if t is not None]
    for label, h, a in zip(("dx", "dw", "db") if weight else ("dx", "db"), hand, auto):
        assert_close(h, a, name=f"layer norm {label}")
    _, *auto = _run(lambda a, c: rms_norm_ref(a, c, 1e-6), (x, w), g)
    hand = [t for t in rms_norm_backward_ref(x, w, g, 1e-6) if t is not None]
    for label, h, a in zip(("dx", "dw"), hand, auto):
        assert_close(h, a, name=f"rms norm {label}")


# ---------------------------------------------------------------------------------------------- rows in several blocks

# A forced block of 128 columns walks rows of 300 features in three blocks (the last one masked):
# the two-pass forwards and the tiled backward (dot products, then dx and the weight partials).
TILED = [((5, 300), torch.float32), ((2, 3, 257), torch.float16), ((7, 128), torch.float32)]


@pytest.mark.parametrize("shape,dtype", TILED, ids=str)
def test_layer_norm_in_column_blocks(shape, dtype):
    _check_layer_norm(*_ln_case(shape, dtype), block_size=128, name="blocks of 128")


@pytest.mark.parametrize("shape,dtype", TILED, ids=str)
def test_rms_norm_in_column_blocks(shape, dtype):
    x, w, _, g = _ln_case(shape, dtype)
    _check_rms_norm(x, w, g, block_size=128, name="blocks of 128")


def test_column_blocks_nan_canaries_offset_and_no_affine():
    x, w, b, g = _ln_case((6, 300), torch.float32)
    kw = {"block_size": 64, "name": "canary, blocks of 64"}
    _check_layer_norm(x, w, b, nan_canary(g, rows=True), x_in=nan_canary(x, rows=True), **kw)
    _check_rms_norm(x, w, nan_canary(g, rows=True), x_in=nan_canary(x, rows=True), **kw)
    _check_layer_norm(x, None, None, g, block_size=64, name="no affine, blocks of 64")
    _check_rms_norm(x, None, g, block_size=64, name="no weight, blocks of 64")
    # mean 1e4, std 1: the blockwise merge of (count, mean, M2) keeps the variance exact
    _check_layer_norm(*_ln_case((16, 500), torch.float32, shift=1e4), block_size=128, name="offset 1e4, blocks")


def test_real_wide_rows_take_the_tiled_path():
    """Widths past the launch rule's one-block limits, at its own block sizes: 20000 features go in
    two forward blocks of 16384 and three backward blocks of 8192."""
    from kernels.rows import BACKWARD, FORWARD, row_launch

    assert not row_launch(20000, torch.float16, FORWARD).one_block
    assert row_launch(20000, torch.float16, BACKWARD).col_blocks == 3
    x, w, b, g = _ln_case((3, 20000), torch.float16)
    _check_layer_norm(x, w, b, g, name="n=20000")
    _check_rms_norm(x, w, g, name="n=20000")


# ---------------------------------------------------------------------------------------------- BatchNorm

@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5), (2, 3, 4, 5)], ids=str)
def test_batch_norm_training_and_running_stats(shape):
    c = shape[1]
    w, b = _t((c,), seed=1), _t((c,), seed=2)
    rm, rv = torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)
    rm_t, rv_t = rm.clone(), rv.clone()
    for step in range(3):
        x = _t(shape, scale=2.0, shift=1.0, seed=10 + step)
        y = batch_norm_ref(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        y_t = F.batch_norm(x, rm_t, rv_t, w, b, training=True, momentum=0.1, eps=1e-5)
        assert_close(y, y_t, name=f"train step {step}")
        assert_close(rm, rm_t, name="running_mean")
        assert_close(rv, rv_t, name="running_var (unbiased)")
    x = _t(shape, seed=99)
    assert_close(batch_norm_ref(x, rm, rv, w, b, training=False), F.batch_norm(x, rm_t, rv_t, w, b, training=False),
                 name="eval")


def test_batch_norm_train_depends_on_batch_eval_does_not():
    x = _t((6, 4), seed=5)
    rm, rv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    alone = batch_norm_ref(x[:3], rm.clone(), rv.clone(), training=True)[0]
    together = batch_norm_ref(x, rm.clone(), rv.clone(), training=True)[0]
    assert (alone - together).abs().max() > 1e-2       # sample 0's output moved with its batch mates
    assert torch.equal(batch_norm_ref(x[:3], rm, rv)[0], batch_norm_ref(x, rm, rv)[0])


def test_batch_norm_gradcheck_and_errors():
    x = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: batch_norm_ref(a, None, None, c, training=True), (x, w))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        batch_norm_ref(torch.randn(1, 3), None, None, training=True)
    with pytest.raises(ValueError, match="needs running_mean"):
        batch_norm_ref(torch.randn(4, 3), None, None, training=False)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        batch_norm_ref(torch.randn(4, 3), None, None, torch.ones(4), training=True)
    with pytest.raises(TypeError, match="floating-point"):
        batch_norm_ref(torch.ones(4, 3, dtype=torch.int32), None, None, training=True)


@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5), (2, 3, 4, 5), (1, 2, 3000), (37, 5, 2)], ids=str)
def test_batch_norm_kernel_train_eval_running_stats(shape):
    """The forward-only Triton BatchNorm against F.batch_norm, inputs inside a NaN canary."""
    c = shape[1]
    w, b = _t((c,), seed=1), _t((c,), seed=2)
    rm, rv = torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)
    rm_t, rv_t = rm.clone(), rv.clone()
    for step in range(2):
        x = _t(shape, scale=2.0, shift=1.0, seed=20 + step)
        y = batch_norm(nan_canary(x), rm, rv, w, b, training=True)
        assert_close(y, F.batch_norm(x, rm_t, rv_t, w, b, training=True), name=f"train step {step}")
        assert_close(rm, rm_t, name="running_mean")
        assert_close(rv, rv_t, name="running_var")
    x = _t(shape, seed=30)
    assert_close(batch_norm(x, rm, rv, w, b), F.batch_norm(x, rm_t, rv_t, w, b), name="eval")
    assert_close(batch_norm(x, None, None, training=True), F.batch_norm(x, None, None, training=True), name="no stats")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_norm_kernel_dtypes_and_layouts(dtype):
    x = _t((6, 4, 3, 5), dtype, scale=3.0, shift=-2.0).permute(0, 1, 3, 2)     # non-contiguous
    w, b = _t((4,), dtype, seed=1), _t((4,), dtype, seed=2)
    y = batch_norm(x, None, None, w, b, training=True)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, batch_norm_ref(x, None, None, w, b, training=True), dtype=dtype, name=f"batch_norm {dtype}")


def test_batch_norm_kernel_errors():
    x = torch.randn(4, 3, device=DEVICE)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        batch_norm(torch.ones(4, 3, dtype=torch.int64, device=DEVICE), None, None, training=True)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        batch_norm(torch.ones(3, device=DEVICE), None, None, training=True)
    with pytest.raises(ValueError, match=r"weight must be a tensor of shape \(3,\)"):
        batch_norm(x, None, None, torch.ones(4, device=DEVICE), training=True)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        batch_norm(torch.ones(1, 3, device=DEVICE), None, None, training=True)
    with pytest.raises(ValueError, match="needs running_mean"):
        batch_norm(x, None, None)
    with pytest.raises(ValueError, match="both running_mean and running_var"):
        batch_norm(x, torch.zeros(3, device=DEVICE), None, training=True)
    with pytest.raises(ValueError, match="forward-only"):
        batch_norm(x.clone().requires_grad_(), None, None, training=True)


# ---------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm"])
def test_bad_input_refused(fn):
    f = {"layer_norm": layer_norm, "rms_norm": rms_norm}[fn]
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        f(torch.ones(4, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        f(x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        f(x, torch.ones(1, 8, device=DEVICE))
    with pytest.raises(TypeError, match="weight has dtype torch.float16 but x has torch.float32"):
        f(x, torch.ones(8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="0-d"):
        f(torch.tensor(1.0, device=DEVICE))
    with pytest.raises(ValueError, match="no features"):
        f(torch.ones(3, 0, device=DEVICE))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        f(x, block_size=100)
    with pytest.raises(TypeError, match="torch.Tensor"):
        f([[1.0, 2.0]])
    with pytest.raises(ValueError, match="eps"):
        f(x, None, -1.0) if fn == "rms_norm" else f(x, None, None, -1.0)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        layer_norm(x, None, torch.ones(9, device=DEVICE))


def test_bad_weight_offset_refused():
    x, w = torch.randn(4, 8, device=DEVICE), torch.zeros(8, device=DEVICE)
    for bad in (float("nan"), float("inf"), "1", True, None):
        with pytest.raises(ValueError, match="weight_offset must be a finite number"):
            rms_norm(x, w, weight_offset=bad)
    with pytest.raises(ValueError, match="needs a weight"):
        rms_norm(x, None, weight_offset=1.0)


# ---------------------------------------------------------------------------------------------- broken variants are caught

@triton.jit
def _ln_one_pass_variance_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, n, stride_x, stride_y, eps,
                                 HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n
    var = tl.sum(x * x, axis=1) / n - mean * mean        # BROKEN: E[x^2] - E[x]^2 cancels in fp32
    rstd = 1.0 / tl.sqrt(tl.maximum(var, 0.0) + eps)
    y = (x - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rows < n_rows)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _ln_bwd_no_mean_kernel(x_ptr, w_ptr, g_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                           n_rows, n, stride_x, stride_g, stride_dx, n_tiles,
                           HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rows < n_rows, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        gw = g * w[None, :]
        c1 = tl.sum(gw * xhat, axis=1) / n
        dx = (gw - xhat * c1[:, None]) * rstd[:, None]   # BROKEN: the -mean(gw) term is missing
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_subtracts_mean_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n, stride_x, stride_y, eps,
                               HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                               W_OFFSET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(mask, x - (tl.sum(x, axis=1) / n)[:, None], 0.0)   # BROKEN: RMSNorm does not centre
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
    y = x * rstd[:, None] * tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_no_col_mask_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n, stride_x, stride_y, eps,
                            HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                            W_OFFSET: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n)
    row_only = (rows[:, None] < n_rows) & (cols[None, :] < BLOCK_N)   # BROKEN: sums lanes past the row
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_only, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
    y = x * rstd[:, None] * tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_bwd_no_projection_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_part_ptr, dres_ptr,
                                  n_rows, n, stride_x, stride_g, stride_dx, stride_dres, n_tiles,
                                  HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, ADD_DRES: tl.constexpr,
                                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        dx = g * w[None, :] * rstd[:, None]              # BROKEN: treats rstd as a constant
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += g * x * rstd[:, None]
    tl.store(dw_part_ptr + pid * n + cols, tl.sum(dw_acc, axis=0), mask=cols < n)


@triton.jit
def _bn_biased_running_var_kernel(x_ptr, mean_ptr, rstd_ptr, rmean_ptr, rvar_ptr, N, C, L, eps, momentum,
                                  UPDATE_RUNNING: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    c = tl.program_id(0)
    ns = tl.arange(0, BLOCK_N)
    ls = tl.arange(0, BLOCK_L)
    s1 = tl.zeros((BLOCK_N, BLOCK_L), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        for l0 in range(0, L, BLOCK_L):
            mask = ((n0 + ns)[:, None] < N) & ((l0 + ls)[None, :] < L)
            s1 += tl.load(x_ptr + (n0 + ns)[:, None] * C * L + c * L + (l0 + ls)[None, :], mask=mask, other=0.0)
    mean = tl.sum(tl.sum(s1, axis=1), axis=0) / (N * L)
    s2 = tl.zeros((BLOCK_N, BLOCK_L), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        for l0 in range(0, L, BLOCK_L):
            mask = ((n0 + ns)[:, None] < N) & ((l0 + ls)[None, :] < L)
            x = tl.load(x_ptr + (n0 + ns)[:, None] * C * L + c * L + (l0 + ls)[None, :], mask=mask, other=0.0)
            d = tl.where(mask, x - mean, 0.0)
            s2 += d * d
    var = tl.sum(tl.sum(s2, axis=1), axis=0) / (N * L)
    tl.store(mean_ptr + c, mean)
    tl.store(rstd_ptr + c, 1.0 / tl.sqrt(var + eps))
    if UPDATE_RUNNING:
        tl.store(rmean_ptr + c, (1.0 - momentum) * tl.load(rmean_ptr + c) + momentum * mean)
        tl.store(rvar_ptr + c, (1.0 - momentum) * tl.load(rvar_ptr + c) + momentum * var)  # BROKEN: biased


def test_broken_batch_norm_running_variance_is_caught(monkeypatch):
    x = _t((4, 3, 2), seed=7)                               # 8 values per channel: unbiased = 8/7 biased
    rm, rv = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    rm_t, rv_t = rm.clone(), rv.clone()
    F.batch_norm(x, rm_t, rv_t, training=True)
    monkeypatch.setattr(bn_mod, "_batch_norm_stats_kernel", _bn_biased_running_var_kernel)
    y = batch_norm(x, rm, rv, training=True)
    assert_close(y, F.batch_norm(x, None, None, training=True), name="output is still right")
    with pytest.raises(MismatchError, match="running_var"):
        assert_close(rv, rv_t, name="running_var")


def test_broken_one_pass_variance_is_caught(monkeypatch):
    case = _ln_case((16, 500), torch.float32, shift=1e4)
    _check_layer_norm(*case)
    monkeypatch.setattr(ln_mod, "_layer_norm_fwd_kernel", _ln_one_pass_variance_kernel)
    with pytest.raises(MismatchError):
        _check_layer_norm(*case)


def test_broken_layer_norm_backward_is_caught(monkeypatch):
    case = _ln_case((10, 64), torch.float32)
    monkeypatch.setattr(ln_mod, "_layer_norm_bwd_kernel", _ln_bwd_no_mean_kernel)
    with pytest.raises(MismatchError, match="dx"):
        _check_layer_norm(*case)


def test_broken_rms_norm_that_subtracts_the_mean_is_caught(monkeypatch):
    x, w, _, g = _ln_case((10, 64), torch.float32, shift=0.5)
    monkeypatch.setattr(rms_mod, "_rms_norm_fwd_kernel", _rms_subtracts_mean_kernel)
    with pytest.raises(MismatchError, match="rms_norm y"):
        _check_rms_norm(x, w, g)


def test_broken_rms_norm_without_mask_is_caught_by_canary(monkeypatch):
    x, w, _, g = _ln_case((6, 100), torch.float32)      # BLOCK_N = 128: 28 lanes past each row end
    monkeypatch.setattr(rms_mod, "_rms_norm_fwd_kernel", _rms_no_col_mask_kernel)
    with pytest.raises(MismatchError):
        _check_rms_norm(x, w, g, x_in=nan_canary(x, rows=True))


@triton.jit
def _rms_tiled_drops_tail_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n, stride_x, stride_y, eps,
                                 HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ss = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n - BLOCK_N + 1, BLOCK_N):     # BROKEN: the partial last block is not summed
        x = tl.load(x_ptr + row * stride_x + start + cols).to(tl.float32)
        ss += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / n + eps)
    for start in range(0, n, BLOCK_N):
        c = start + cols
        y = tl.load(x_ptr + row * stride_x + c, mask=c < n, other=0.0).to(tl.float32) * rstd
        y = y * tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=c < n)
    tl.store(rstd_ptr + row, rstd)


def test_broken_tiled_rms_norm_that_drops_the_tail_block_is_caught(monkeypatch):
    x, w, _, g = _ln_case((4, 300), torch.float32)
    _check_rms_norm(x, w, g, block_size=128)
    monkeypatch.setattr(rms_mod, "_rms_norm_fwd_tiled_kernel", _rms_tiled_drops_tail_kernel)
    with pytest.raises(MismatchError, match="rms_norm y"):
        _check_rms_norm(x, w, g, block_size=128)


def test_broken_rms_norm_backward_is_caught(monkeypatch):
    x, w, _, g = _ln_case((10, 64), torch.float32)
    monkeypatch.setattr(rms_mod, "_rms_norm_bwd_kernel", _rms_bwd_no_projection_kernel)
    with pytest.raises(MismatchError, match="dx"):
        _check_rms_norm(x, w, g)


# ---------------------------------------------------------------------------------------------- BatchNorm backward, moment merge

def test_batch_norm_backward_reference_equals_autograd():
    from kernels.norm import batch_norm_backward_ref, batch_norm_ref
    g_ = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 4, 5, generator=g_, dtype=torch.float64) * 2 + 1
    w, b = torch.randn(3, generator=g_, dtype=torch.float64), torch.randn(3, generator=g_, dtype=torch.float64)
    g = torch.randn(x.shape, generator=g_, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    auto = torch.autograd.grad(batch_norm_ref(*leaves[:1], None, None, *leaves[1:], training=True), leaves, g)
    for label, hand, a in zip(("dx", "dw", "db"), batch_norm_backward_ref(x, w, g), auto):
        assert_close(hand, a, name=f"BatchNorm {label}")
    # the same formula with the LayerNorm-style row means instead of channel means is wrong here
    from kernels.norm import layer_norm_backward_ref
    wrong = layer_norm_backward_ref(x.movedim(1, -1), w, g.movedim(1, -1))[0].movedim(-1, 1)
    with pytest.raises(MismatchError):
        assert_close(wrong, auto[0])


def test_merge_moments_is_exact_and_beats_one_pass():
    from kernels.norm import merge_moments, moments
    g_ = torch.Generator().manual_seed(6)
    x = torch.randn(3, 1000, generator=g_, dtype=torch.float64) + 1e4
    parts = [moments(p) for p in torch.split(x, [1, 300, 699], dim=-1)]
    n, mean, m2 = merge_moments(*merge_moments(*parts[0], *parts[1]), *parts[2])
    n2, mean2, m22 = merge_moments(*parts[2], *merge_moments(*parts[1], *parts[0]))
    want_n, want_mean, want_m2 = moments(x)
    for got in ((n, mean, m2), (n2, mean2, m22)):
        assert torch.equal(got[0], want_n)
        assert_close(got[1], want_mean, name="merged mean")
        assert_close(got[2], want_m2, name="merged M2")
    empty = tuple(torch.zeros(3, 1, dtype=torch.float64) for _ in range(3))
    assert all(torch.equal(a, b) for a, b in zip(merge_moments(*empty, n, mean, m2), (n, mean, m2)))
    x32 = x.float()
    fused = [moments(p) for p in torch.split(x32, 250, dim=-1)]
    acc = fused[0]
    for p in fused[1:]:
        acc = merge_moments(*acc, *p)
    assert ((acc[2] / 1000 - x.var(-1, unbiased=False, keepdim=True)).abs() < 1e-2).all()
    one_pass = (x32 * x32).mean(-1, keepdim=True) - x32.mean(-1, keepdim=True) ** 2
    assert ((one_pass - x.var(-1, unbiased=False, keepdim=True)).abs() > 0.1).any()
