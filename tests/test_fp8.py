"""kernels.quant.fp8: the codecs against PyTorch over every code and every rounding midpoint, the
scaling rules, and the FP8 GEMM against its reference (interpreter) and in AOT SASS."""
import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.quant import fp8 as F
from kernels.testing import MismatchError, assert_close, nan_canary

DEV = runtime.device()
CODES = torch.arange(256, dtype=torch.uint8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_decode_matches_torch_on_all_256_codes(fmt):
    want = CODES.view(F.FORMATS[fmt].torch_dtype).float()
    got = F.decode(CODES, fmt)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_matches_torch_at_codes_midpoints_and_beyond(fmt):
    f8 = F.FORMATS[fmt]
    vals = CODES.view(f8.torch_dtype).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2                                   # ties: round to even
    up, down = mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(float("-inf")))
    g = torch.Generator().manual_seed(0)
    x = torch.cat([vals, mids, up, down, torch.randn(20000, generator=g) * f8.max / 4,
                   torch.randn(2000, generator=g) * 1e-5, torch.tensor([float("inf"), -float("inf"), float("nan"),
                                                                      1e30, -1e30, 0.0, -0.0, 1e-45])])
    got, want = F.encode(x, fmt), x.to(f8.torch_dtype).view(torch.uint8)
    assert torch.equal(got, want), x[got != want][:5]
    assert torch.equal(F.encode(vals, fmt), vals.to(f8.torch_dtype).view(torch.uint8))


def test_format_facts():
    assert F.decode(torch.tensor([0x7E], dtype=torch.uint8), "e4m3").item() == 448.0
    assert F.decode(torch.tensor([0x01], dtype=torch.uint8), "e4m3").item() == 2.0**-9
    assert F.decode(torch.tensor([0x7B], dtype=torch.uint8), "e5m2").item() == 57344.0
    assert F.decode(torch.tensor([0x7C], dtype=torch.uint8), "e5m2").item() == float("inf")


def test_codec_errors():
    with pytest.raises(TypeError, match="uint8"):
        F.decode(torch.zeros(3), "e4m3")
    with pytest.raises(ValueError, match="fmt"):
        F.encode(torch.zeros(3), "e3m4")
    with pytest.raises(TypeError, match="floating"):
        F.encode(torch.zeros(3, dtype=torch.int32))


def test_amax_scaling_maps_amax_to_the_largest_code():
    x = torch.tensor([0.5, -3.0, 1e-3])
    q, s = F.quantize_current(x)
    assert q.float().abs().max().item() == 448.0 and torch.allclose(q.float() * s, x, rtol=0.07)
    assert F.amax_scale(0.0).item() == 1.0


def test_delayed_scaling_uses_history_and_saturates_on_a_spike():
    ds = F.DelayedScaling("e4m3", history_len=4)
    x = torch.linspace(-1, 1, 101)
    ds(x)                                             # step 0: scale 1 (no history)
    _, s1 = ds(x)
    assert s1.item() == pytest.approx(1 / 448)
    q, _ = ds(10 * x)                                 # a spike: old scale, saturates at 448
    assert q.float().abs().max().item() == 448.0 and (q.float().abs() == 448).sum() > 10
    for _ in range(4):
        ds(x)
    assert ds.scale().item() == pytest.approx(1 / 448)   # the spike left the 4-step window
    with pytest.raises(ValueError, match="history_len"):
        F.DelayedScaling(history_len=0)


def _inputs(m, k, n, fmt="e4m3", seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    (aq, sa), (bq, sb) = F.quantize_current(a, fmt), F.quantize_current(b, fmt)
    return aq.to(DEV), bq.to(DEV), sa.to(DEV), sb.to(DEV)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("m, k, n", [(1, 17, 130), (70, 45, 90), (130, 100, 65)])
def test_fp8_matmul_matches_reference(m, k, n, fmt):
    aq, bq, sa, sb = _inputs(m, k, n, fmt, seed=m)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = F.fp8_matmul(aq, bq, sa, sb, out_dtype=out_dtype)
        # fp8 products are exact in fp32; the sums differ only in order. bf16: one rounding (the
        # interpreter's downcast is not round-to-nearest-even, within the bf16 tolerance)
        assert_close(got, F.fp8_matmul_ref(aq, bq, sa, sb), dtype=out_dtype)


def test_fp8_matmul_canaried_and_strided():
    aq, bq, sa, sb = _inputs(66, 70, 40, seed=3)
    a = nan_canary(aq.view(torch.uint8), pad=512).view(torch.float8_e4m3fn)    # NaN code 0xFF... as uint8 min: 0
    bt = bq.t().contiguous().t()                                               # column-major B
    assert_close(F.fp8_matmul(a, bt, sa, sb), F.fp8_matmul_ref(aq, bq, sa, sb), dtype=torch.float32)


def test_broken_dequantization_is_caught():
    aq, bq, sa, sb = _inputs(40, 64, 40, seed=4)
    with pytest.raises(MismatchError):
        assert_close(F.fp8_matmul(aq, bq, sa, sb, _dequant="divide"), F.fp8_matmul_ref(aq, bq, sa, sb), dtype=torch.float32)


def test_fp8_matmul_bad_input():
    aq, bq, sa, sb = _inputs(4, 8, 4)
    with pytest.raises(TypeError, match="float8"):
        F.fp8_matmul(aq.float(), bq, sa, sb)
    with pytest.raises(ValueError, match="2-D"):
        F.fp8_matmul(aq[0], bq, sa, sb)
    with pytest.raises(ValueError, match="inner"):
        F.fp8_matmul(aq, bq[:5], sa, sb)
    with pytest.raises(ValueError, match="scale_b"):
        F.fp8_matmul(aq, bq, sa, sb.double())


SIG = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
       **{k: "i32" for k in ["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn"]}}


def test_fp8_gemm_aot_qgmma_on_sm90_no_spills_and_no_fp8_on_sm80():
    bm, bn, bk, w = F.GPU_TILE
    tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DEQUANT="multiply")
    builds = ki.compile_triton_many([ki.TritonJob(F._fp8_matmul_kernel, SIG, constexprs=tile, num_warps=w)],
                                    archs=("sm89", "sm90", "sm100"))[0]
    assert builds["sm89"].families()["QMMA"] > 0
    assert builds["sm90"].families()["QGMMA"] > 0
    assert builds["sm100"].families()["UTCQMMA"] > 0
    assert all(b.spills == 0 for b in builds.values())
    with pytest.raises(ki.CompileError, match="fp8e4nv not supported"):
        ki.compile_triton(F._fp8_matmul_kernel, SIG, arch="sm80", constexprs=tile, num_warps=w)
