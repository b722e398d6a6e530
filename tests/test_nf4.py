"""kernels/quant/nf4.py: the NF4 table from normal quantiles equals bitsandbytes' published table bit
for bit; codes are the nearest entry; double quantization's error and bit count; the W4A16 NF4 kernel
against dequantize-then-matmul on awkward shapes with NaN canaries, split-K, a broken variant caught,
bad input refused; AOT builds at Llama-3 sizes without spills, the lookup as warp shuffles."""
import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels.quant import minifloat as mf
from kernels.quant import nf4
from kernels.quant.intq import pack_int4, unpack_int4
from kernels.testing import MismatchError, assert_close, nan_canary


def test_table_is_bitsandbytes_bit_for_bit():
    assert torch.equal(nf4.normal_float(4), torch.tensor(nf4.BNB_NF4, dtype=torch.float32))
    t = nf4.NF4
    assert t[7] == 0 and (t[:7] < 0).all() and (t[8:] > 0).all() and t[0] == -1 and t[15] == 1
    assert (t.diff() > 0).all()
    assert abs(nf4.OFFSET - (1 - 1 / 30 + 1 - 1 / 32) / 2) < 1e-7


def test_other_widths_keep_an_exact_zero():
    for bits in (2, 3, 5):
        t = nf4.normal_float(bits)
        assert t.numel() == 2**bits and (t == 0).sum() == 1 and t.max() == 1
    with pytest.raises(ValueError, match="bits must be"):
        nf4.normal_float(1)


def test_codes_are_the_nearest_entry_ties_down():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 128, generator=g)
    codes, absmax = nf4.quantize(w, 64)
    scaled = (w / absmax.repeat_interleave(64, 1)).double()
    dist = (scaled[..., None] - nf4.NF4.double()).abs()            # (5, 128, 16)
    nearest = dist.argmin(-1)                                       # first minimum: the lower entry on a tie
    assert torch.equal(codes.long(), nearest)
    mid = float((nf4.NF4[8] + nf4.NF4[9]) / 2)                      # exactly between two entries
    c, _ = nf4.quantize(torch.tensor([[mid, 1.0]]), 2)
    assert c.tolist() == [[8, 15]]
    assert torch.equal(nf4.quantize(torch.zeros(2, 64), 64)[1], torch.ones(2, 1))


def test_double_quantization_error_and_bits():
    g = torch.Generator().manual_seed(1)
    absmax = torch.rand(40, 13, generator=g) * 0.1 + 0.02            # 520 scales: three blocks of 256
    codes, s2, mean = nf4.double_quantize(absmax)
    assert codes.shape == absmax.shape and codes.dtype == torch.uint8 and s2.shape == (3,)
    back = nf4.double_dequantize(codes, s2, mean)
    # E4M3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal by 2^-10 s2
    c = (absmax - mean).reshape(-1)
    per_block = s2.repeat_interleave(256)[: c.numel()]
    bound = torch.maximum(c.abs() * 2**-4, per_block * 2**-10)
    assert ((back.reshape(-1) - absmax.reshape(-1)).abs() <= bound * 1.0001).all()
    assert nf4.bits_per_weight(64) == 4.5
    assert abs(nf4.bits_per_weight(64, double_quant=True) - 4.127) < 5e-4     # QLoRA: 0.127 bits of scales


def case(M, N, K, group, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    codes, absmax = nf4.quantize(torch.randn(N, K, generator=g) * 0.05, group)
    return x, pack_int4(codes), absmax


@pytest.mark.parametrize("M,N,K,group", [(1, 1, 64, 64), (1, 130, 512, 64), (5, 70, 256, 64),
                                         (33, 130, 384, 128), (17, 9, 64, 32), (20, 40, 256, 16)])
def test_kernel_matches_dequantize_then_matmul(M, N, K, group):
    x, p, s = case(M, N, K, group, seed=M + N)
    got = nf4.nf4_matmul(nan_canary(x), nan_canary(p), nan_canary(s), group)
    assert_close(got, nf4.nf4_matmul_ref(x, p, s, group), dtype=torch.float32)


def test_lookup_from_memory_gives_the_same_product():
    x, p, s = case(9, 70, 256, 64, seed=6)
    assert torch.equal(nf4.nf4_matmul(x, p, s, 64, lookup="memory"), nf4.nf4_matmul(x, p, s, 64))
    with pytest.raises(ValueError, match="lookup must be one of"):
        nf4.nf4_matmul(x, p, s, 64, lookup="shared")


def test_kernel_fp16_and_explicit_split():
    x, p, s = case(3, 64, 512, 64, seed=2, dtype=torch.float16)
    want = nf4.nf4_matmul_ref(x, p, s, 64)
    torch_fp16 = x @ nf4.dequantize(unpack_int4(p), s).half().T       # PyTorch's own fp16 product
    for split in (1, 2, 8):
        assert_close(nf4.nf4_matmul(x, p, s, 64, split_k=split), want, dtype=torch.float16, baseline=torch_fp16)


def test_fp4_table_runs_in_the_same_kernel():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 128, generator=g) * 0.05, torch.randn(4, 128, generator=g)
    codes, s = mf.quantize(w, "e2m1", 32)                            # scales s = absmax / 6
    table = mf.values("e2m1")                                       # the 16 E2M1 values in code order
    got = nf4.nf4_matmul(x, pack_int4(codes), s, 32, table=table)
    assert_close(got, x.double() @ mf.dequantize(codes, s, "e2m1").double().T, dtype=torch.float32)


def test_broken_variant_is_caught():
    x, p, s = case(8, 64, 256, 64, seed=4)
    with pytest.raises(MismatchError):
        assert_close(nf4.nf4_matmul(x, p, s, 64, _one_scale=True), nf4.nf4_matmul_ref(x, p, s, 64), dtype=torch.float32)


def test_bad_input_is_refused():
    x, p, s = case(2, 16, 128, 64, seed=5)
    for call, match in [(lambda: nf4.nf4_matmul(x.long(), p, s, 64), "x must be"),
                        (lambda: nf4.nf4_matmul(x, p[:, :32], s, 64), "w_packed must be"),
                        (lambda: nf4.nf4_matmul(x, p, s[:, :1], 64), "absmax must be"),
                        (lambda: nf4.nf4_matmul(x, p, s, 48), "group_size"),
                        (lambda: nf4.nf4_matmul(x, p, s, 64, table=torch.zeros(8)), "table must be"),
                        (lambda: nf4.nf4_matmul(x, p, s, 64, split_k=3), "split_k")]:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.fixture(scope="module")
def builds():
    jobs = nf4.compile_jobs()
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))))


def test_compile_jobs_are_the_launch():
    for label, job in nf4.compile_jobs().items():
        assert job.attrs and job.grid and job.programs >= 132, label        # launch_job, an H100 filled
        assert job.constexprs["GROUP"] == 64 and not job.constexprs["ONE_SCALE"]


def test_aot_builds_at_llama_sizes(builds):
    for label, bb in builds.items():
        for arch, b in bb.items():
            assert b.spills == 0 and b.async_copies["LDGSTS"] > 0, (label, arch)
        fam = bb["sm90"].families()
        assert fam["SHFL"] >= 32, label                                 # the lookup: a warp shuffle per weight
        assert bb["sm90"].tensor_core == ("HMMA" if "decode" in label else "HGMMA"), label
        # row offsets of x and W are 64-bit products (parameters 8 and 10: stride_xm, stride_wn)
        assert ki.param_product_widths(bb["sm90"], 8) == {64} and ki.param_product_widths(bb["sm90"], 10) == {64}
