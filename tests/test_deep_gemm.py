"""kernels.gemm.deep_gemm: block-scaled FP8 GEMM against dequantize-then-matmul, the scale layout,
the emulated accumulation error, and the sm90a build."""
import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.gemm import deep_gemm as D
from kernels.testing import MismatchError, assert_close, nan_canary

DEV = runtime.device()


def make(m, k, n, seed=0, outlier=False):
    g = torch.Generator().manual_seed(seed)
    a, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if outlier:
        a[0, 0] = 1000.0
    return a, w, [t.to(DEV) for t in D.quantize_blockwise(a, w)]


def check(c, q):
    a, w = D.dequantize_blockwise(*q)
    assert_close(c, a.double() @ w.double().t(), baseline=a @ w.t(), dtype=torch.float32)


@pytest.mark.parametrize("m, k, n", [(1, 17, 130), (70, 300, 90), (130, 256, 200)])
def test_deep_gemm_matches_dequantized_reference(m, k, n):
    _, _, q = make(m, k, n, seed=m)
    check(D.deep_gemm(*q, out_dtype=torch.float32), q)
    assert_close(D.deep_gemm(*q), D.deep_gemm_ref(*q), dtype=torch.bfloat16)


def test_scale_layout_and_quantization():
    a, w, (aq, sa, wq, sw) = make(5, 300, 200, outlier=True)
    assert sa.shape == (5, 3) and sw.shape == (2, 3)
    assert aq.float().abs().amax(1).max().item() == 448.0
    A, W = D.dequantize_blockwise(aq, sa, wq, sw)
    floor = sa.repeat_interleave(128, dim=1)[:, :300] * 2.0**-10      # half of the smallest subnormal step
    assert ((A - a).abs() <= a.abs() / 16 + floor).all()             # within E4M3's half step, per slice
    assert sa[0, 0] > 100 * sa[0, 1]                                # the outlier coarsens only its own slice


def test_canaried_inputs():
    _, _, (aq, sa, wq, sw) = make(66, 260, 70, seed=3)
    aq_c = nan_canary(aq.view(torch.uint8), pad=512).view(torch.float8_e4m3fn)
    check(D.deep_gemm(aq_c, sa, wq, sw, out_dtype=torch.float32), (aq, sa, wq, sw))


def test_one_scale_for_all_k_blocks_is_caught():
    _, _, q = make(40, 300, 70, seed=4)
    with pytest.raises(MismatchError):
        check(D.deep_gemm(*q, out_dtype=torch.float32, _per_block_scales=False), q)


def test_bad_input():
    _, _, (aq, sa, wq, sw) = make(4, 130, 8)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        D.deep_gemm(aq.float(), sa, wq, sw)
    with pytest.raises(ValueError, match="2-D"):
        D.deep_gemm(aq[0], sa, wq, sw)
    with pytest.raises(ValueError, match="scale_a"):
        D.deep_gemm(aq, sa[:, :1], wq, sw)
    with pytest.raises(ValueError, match="K differs"):
        D.deep_gemm(aq, sa, wq[:, :100], sw)


def test_promotion_bounds_the_accumulation_error():
    p = torch.rand(64, 2048, generator=torch.Generator().manual_seed(0))
    exact = p.double().sum(1)
    err = lambda s: ((s.double() - exact).abs() / exact).max().item()
    assert err(D.accumulate_emulated(p, promote_every=128)) < 0.2 * err(D.accumulate_emulated(p))
    assert D.chop(torch.tensor([1.0 + 2**-20]), 13).item() == 1.0


def test_sm90_build_qgmma_without_spills():
    ints = ["M", "N", "K", "stride_am", "stride_ak", "stride_wn", "stride_wk", "stride_cm", "stride_cn",
            "stride_sam", "stride_sak", "stride_swn", "stride_swk"]
    sig = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sw_ptr": "*fp32",
           **{k: "i32" for k in ints}}
    bm, bn = D.GPU_TILE
    b = ki.compile_triton(D._deep_gemm_kernel, sig, arch="sm90", num_warps=8,
                          constexprs=dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, PER_BLOCK_SCALES=True))
    assert b.families()["QGMMA"] > 0 and b.spills == 0
