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


def test_block_n_that_straddles_two_weight_scales_is_refused():
    _, _, q = make(8, 256, 300)
    with pytest.raises(ValueError, match="BLOCK_N=256 does not divide 128"):
        D.deep_gemm(*q, block_mn=(64, 256))
    for bad in ((64, 96), (8, 64), [64, 64], (64.0, 64)):
        with pytest.raises(ValueError, match="block_mn"):
            D.deep_gemm(*q, block_mn=bad)


def test_the_refusal_guards_a_real_wrong_answer():
    """Launched past the check, BLOCK_N=256 applies block row 0's weight scale to columns 128-255 too."""
    _, _, q = make(8, 256, 300, seed=5)
    aq, sa, wq, sw = q
    sw = sw.clone()
    sw[1] *= 4.0                                                    # block rows must differ for the bug to show
    c = torch.empty(8, 300, dtype=torch.float32, device=DEV)
    grid, args, kwargs = D._launch_args(aq, wq, c, sa, sw, block_mn=(16, 256))
    D._deep_gemm_kernel[grid](*args, **kwargs)
    with pytest.raises(MismatchError):
        check(c, (aq, sa, wq, sw))
    check(D.deep_gemm(aq, sa, wq, sw, out_dtype=torch.float32, block_mn=(16, 128)), (aq, sa, wq, sw))


@pytest.fixture(scope="module")
def builds():
    jobs = D.compile_jobs()
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90", "sm100"))))


def test_gpu_tile_compiles_pipelined_without_spills(builds):
    """DeepSeek-V3's up projection with the launcher's GPU tile, as a launch compiles it."""
    bm, bn = D.GPU_TILE
    label = next(k for k in builds if f"{bm}x{bn}x128" in k)
    sm90, sm100 = builds[label]["sm90"], builds[label]["sm100"]
    assert D.GPU_TILE == (128, 128)
    assert sm90.tensor_core == "QGMMA" and sm100.tensor_core == "UTCQMMA"
    for b in (sm90, sm100):
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0
        assert b.async_copies["LDGSTS"] > 0 and b.metadata["num_stages"] == 3
    assert sm90.metadata["shared_bytes"] == 3 * 2 * 128 * 128        # 3 buffers of a 128x128 A and W tile, fp8
    assert all(job.attrs and job.grid for job in D.compile_jobs().values())


def test_ue8m0_scales_are_powers_of_two_and_never_overflow_e4m3():
    a, w, (aq, sa, wq, sw) = make(9, 300, 140, seed=7, outlier=True)
    _, _, (aq8, sa8, wq8, sw8) = (a, w, D.quantize_blockwise(a, w, ue8m0=True))
    for s in (sa8, sw8):
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)          # exponent only
    assert aq8.float().abs().max() <= 448 and aq8.float().abs().amax(1).min() > 224   # amax lands in (224, 448]
    assert (sa8 >= sa).all() and (sa8 < 2 * sa).all()                    # rounded up, by less than 2x
    check(D.deep_gemm(aq8, sa8, wq8, sw8, out_dtype=torch.float32), (aq8, sa8, wq8, sw8))
