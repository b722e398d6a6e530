"""kernels.quant.w8a8: int8 x int8 -> int32 matmul with per-token and per-channel scales, against
the dequantize-then-matmul reference; broken-variant, bad-input and AOT (IMMA/IGMMA, no spills) checks."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import runtime
from kernels.quant.intq import quantize_per_channel, quantize_per_token
from kernels.quant.w8a8 import aot_job, w8a8_matmul, w8a8_matmul_ref
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()


def _case(M, N, K, seed=0, outlier=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    if outlier:
        x[:, 3] *= 60.0
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_channel(w)
    return [t.to(DEVICE) for t in (xq, wq, xs, ws)], x, w


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (5, 7, 9), (70, 90, 200), (130, 65, 64), (33, 129, 300)])
def test_matches_reference(M, N, K):
    (xq, wq, xs, ws), _, _ = _case(M, N, K)
    got = w8a8_matmul(xq, wq, xs, ws)
    assert got.shape == (M, N) and got.dtype == torch.float32
    want = w8a8_matmul_ref(xq, wq, xs, ws)
    assert_close(got, want, dtype=torch.float32)


def test_integer_sum_is_exact_at_the_extremes():
    """All codes at +-127: each sum is K * 127^2 exactly (int32, no float rounding on the way)."""
    K = 257
    xq = torch.full((3, K), 127, dtype=torch.int8, device=DEVICE)
    wq = torch.full((2, K), -127, dtype=torch.int8, device=DEVICE)
    one = torch.ones(3, dtype=torch.float32, device=DEVICE)
    y = w8a8_matmul(xq, wq, one, torch.ones(2, dtype=torch.float32, device=DEVICE))
    assert torch.equal(y, torch.full((3, 2), -K * 127 * 127, dtype=torch.float32, device=DEVICE))


def test_nan_canaries_and_fp16_output():
    (xq, wq, xs, ws), _, _ = _case(45, 70, 100, seed=3)
    got = w8a8_matmul(nan_canary(xq), nan_canary(wq), nan_canary(xs), nan_canary(ws), out_dtype=torch.float16)
    assert got.dtype == torch.float16
    want = w8a8_matmul_ref(xq, wq, xs, ws)
    assert_close(got, want, dtype=torch.float16)


def test_row_strided_input():
    (xq, wq, xs, ws), _, _ = _case(20, 30, 40, seed=4)
    got = w8a8_matmul(nan_canary(xq, rows=True), nan_canary(wq, rows=True), xs, ws)
    assert_close(got, w8a8_matmul_ref(xq, wq, xs, ws), dtype=torch.float32)


def test_close_to_the_float_product():
    """The quantized product stays within the int8 rounding error of the float X W^T."""
    (xq, wq, xs, ws), x, w = _case(64, 48, 128, seed=5)
    y = w8a8_matmul(xq, wq, xs, ws).double().cpu()
    rel = float((y - x @ w.T).norm() / (x @ w.T).norm())
    assert rel < 0.02


def test_broken_scale_indexing_is_caught():
    (xq, wq, xs, ws), _, _ = _case(70, 90, 64, seed=6)
    bad = w8a8_matmul(xq, wq, xs, ws, _scale_by_row=True)
    with pytest.raises(MismatchError):
        assert_close(bad, w8a8_matmul_ref(xq, wq, xs, ws), dtype=torch.float32)


def test_bad_input():
    (xq, wq, xs, ws), _, _ = _case(4, 5, 6)
    with pytest.raises(ValueError, match="xq must be a 2-D int8"):
        w8a8_matmul(xq.float(), wq, xs, ws)
    with pytest.raises(ValueError, match="disagree on K"):
        w8a8_matmul(xq[:, :5], wq, xs, ws)
    with pytest.raises(ValueError, match=r"w_scale must be fp32 of shape \(5,\)"):
        w8a8_matmul(xq, wq, xs, ws[:4])
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        w8a8_matmul(xq, wq, xs.double(), ws)
    with pytest.raises(ValueError, match="out_dtype"):
        w8a8_matmul(xq, wq, xs, ws, out_dtype=torch.int32)


def test_aot_sm80_sm90_integer_tensor_cores_without_spills():
    """At the GPU tiles (128 x 128 x 128, 8 warps), sm80 issues IMMA, sm90 the warpgroup IGMMA; no spills."""
    from kernels.inspect import compile_triton_many

    (builds,) = compile_triton_many([aot_job()], archs=("sm80", "sm90"))
    assert builds["sm80"].families("sass")["IMMA"] > 0
    assert builds["sm90"].families("sass")["IGMMA"] > 0
    for b in builds.values():
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0
