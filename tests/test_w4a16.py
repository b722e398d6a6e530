"""kernels.quant.w4a16: packed int4 weights dequantized group-wise inside the kernel, against
dequantize-then-matmul; split-K at decode (the rule, the grid against 132 SMs, a dropped partial
caught); broken nibble order caught; bad input; AOT at Llama-3 sizes (no spills, cp.async, int64 offsets)."""
import kernels  # noqa: F401  (before triton)

import re

import pytest
import torch

from kernels import runtime
from kernels.quant import intq
from kernels import inspect as ki
from kernels.quant import w4a16 as W
from kernels.quant.w4a16 import w4a16_matmul, w4a16_matmul_ref
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()


def _case(M, N, K, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    s, z = intq.quant_params(w, 4, symmetric=False, granularity="group", group_size=group)
    q = intq.quantize_ref(w, s, z, 4, False)
    return (x.to(DEVICE, dtype), intq.pack_int4(q).to(DEVICE), s.to(DEVICE, dtype), z.to(torch.uint8).to(DEVICE))


CASES = [(1, 1, 128, 128), (1, 130, 512, 128), (5, 70, 256, 128), (33, 130, 384, 128), (17, 9, 64, 32),
         (40, 65, 96, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K,group", CASES)
def test_matches_dequantize_then_matmul(M, N, K, group, dtype):
    x, p, s, z = _case(M, N, K, group, dtype)
    got = w4a16_matmul(nan_canary(x), nan_canary(p), nan_canary(s), nan_canary(z), group)
    assert got.shape == (M, N) and got.dtype == dtype
    want = w4a16_matmul_ref(x, p, s, z, group)
    baseline = (x.double() @ _dequant(p, s, z, group).to(dtype).double().T).to(dtype)   # PyTorch in the low dtype
    assert_close(got, want, dtype=dtype, baseline=baseline)


def _dequant(p, s, z, group):
    return intq.dequantize_ref(intq.unpack_int4(p), s.double(), z.double())


def test_dequantized_weight_is_the_quantized_grid():
    """The reference's weight is s (q - z) for every one of the 16 codes in every group."""
    N, K, group = 3, 256, 128
    q = torch.arange(16, dtype=torch.uint8).repeat(N, K // 16)
    s = torch.tensor([[0.5, 0.25]] * N, dtype=torch.float64)
    z = torch.tensor([[8, 3]] * N, dtype=torch.uint8)
    eye = torch.eye(K, dtype=torch.float64)
    w = w4a16_matmul_ref(eye, intq.pack_int4(q), s, z, group).T                   # (N, K)
    want = torch.cat([0.5 * (q[:, :128].double() - 8), 0.25 * (q[:, 128:].double() - 3)], 1)
    assert torch.equal(w, want)
    got = w4a16_matmul(eye.float(), intq.pack_int4(q), s.float(), z, group).T
    assert torch.equal(got.double(), want)


def test_row_strided_input():
    x, p, s, z = _case(20, 30, 256, 128, torch.float32, seed=3)
    got = w4a16_matmul(nan_canary(x, rows=True), nan_canary(p, rows=True), s, z, 128)
    assert_close(got, w4a16_matmul_ref(x, p, s, z, 128), dtype=torch.float32)


def test_swapped_nibbles_are_caught():
    x, p, s, z = _case(8, 64, 256, 128, torch.float32, seed=4)
    bad = w4a16_matmul(x, p, s, z, 128, _swap_nibbles=True)
    with pytest.raises(MismatchError):
        assert_close(bad, w4a16_matmul_ref(x, p, s, z, 128), dtype=torch.float32)


def test_bad_input():
    x, p, s, z = _case(4, 8, 256, 128, torch.float32)
    with pytest.raises(ValueError, match="group_size=128 does not divide K=192"):
        w4a16_matmul(x[:, :192], p[:, :96], s[:, :1], z[:, :1], 128)
    with pytest.raises(ValueError, match=r"w_packed must be \(N, K / 2\)"):
        w4a16_matmul(x, p[:, :127], s, z, 128)
    with pytest.raises(ValueError, match=r"w_packed must be \(N, K / 2\)"):
        w4a16_matmul(x[:, :255], p, s, z, 128)                                     # odd K cannot be packed
    with pytest.raises(ValueError, match="power of two"):
        w4a16_matmul(x, p, s, z, 96)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_matmul(x, p, s[:, :1], z, 128)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        w4a16_matmul(x, p, s, z.to(torch.int32), 128)
    with pytest.raises(ValueError, match="two codes per byte"):
        w4a16_matmul(x, p.to(torch.int8), s, z, 128)
    with pytest.raises(ValueError, match="x must be a 2-D fp16 or fp32"):
        w4a16_matmul(x.double(), p, s, z, 128)


def test_split_k_rule_fills_the_sms():
    """At decode the output tiles alone leave SMs idle: S doubles until tiles * S >= 132 (chunks whole)."""
    assert W.choose_split_k(1, 4096, 4096, 128) == 4                  # 64 tiles -> 256 programs
    assert W.choose_split_k(1, 1024, 4096, 128) == 16                 # 16 tiles (a K/V projection)
    assert W.choose_split_k(1, 14336, 4096, 128) == 1                 # 224 tiles already fill the GPU
    assert W.choose_split_k(4096, 4096, 4096, 128) == 1               # prefill
    assert W.choose_split_k(1, 64, 384, 128) == 1                     # 3 K steps do not halve
    for label, M, N, K in W.REAL_SHAPES:
        plan = W.launch_plan(M, N, K)
        assert plan["programs"] >= 132, (label, plan)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_every_split_gives_the_same_product(split):
    x, p, s, z = _case(3, 70, 512, 128, torch.float32, seed=5)
    got = w4a16_matmul(x, p, s, z, 128, split_k=split)
    assert_close(got, w4a16_matmul_ref(x, p, s, z, 128), dtype=torch.float32)


def _exact_case(M, N, K, group, dtype, seed=0):
    """Integer activations in [-8, 8], codes and zero points in [0, 15], power-of-two scales 2^-3 .. 1: every
    product and every partial sum is a multiple of 2^-3 below 2^16, exact in fp32 (x and W are exact in fp16;
    an fp16 output is rounded once, from the exact fp32 sum, as the float64 product is)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (M, K), generator=g).double()
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s = 2.0 ** -torch.randint(0, 4, (N, K // group), generator=g).double()
    z = torch.randint(0, 16, (N, K // group), generator=g, dtype=torch.uint8)
    return x.to(DEVICE, dtype), intq.pack_int4(q).to(DEVICE), s.to(DEVICE, dtype), z.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_split_k_is_exact_where_fp32_sums_are(dtype):
    """Where every partial sum is exact in fp32, the default split (4 at M = 1, N = 130, K = 512) and every
    other split give the float64 product rounded once to the output dtype, bit for bit; a reduction that
    drops its last partial does not."""
    M, N, K = 1, 130, 512
    x, p, s, z = _exact_case(M, N, K, 128, dtype, seed=8)
    assert W.choose_split_k(M, N, K, 128) == 4
    want = w4a16_matmul_ref(x, p, s, z, 128).to(dtype)
    assert want.abs().max() < 2 ** 16                                 # |sum| <= K * 8 * 15: 19 bits with the 2^-3 step
    for split in (None, 1, 2, 4):
        assert torch.equal(w4a16_matmul(x, p, s, z, 128, split_k=split), want), split
    assert not torch.equal(w4a16_matmul(x, p, s, z, 128, _drop_partial=True), want)


def test_a_split_k_reduction_that_drops_a_partial_is_caught():
    x, p, s, z = _case(1, 130, 512, 128, torch.float32, seed=6)
    assert W.choose_split_k(1, 130, 512, 128) == 4
    bad = w4a16_matmul(x, p, s, z, 128, _drop_partial=True)
    with pytest.raises(MismatchError):
        assert_close(bad, w4a16_matmul_ref(x, p, s, z, 128), dtype=torch.float32)


def test_split_k_must_divide_the_k_steps():
    x, p, s, z = _case(1, 8, 384, 128, torch.float32)
    with pytest.raises(ValueError, match="split_k must be a positive int dividing the 3 K steps"):
        w4a16_matmul(x, p, s, z, 128, split_k=2)


@pytest.fixture(scope="module")
def builds():
    jobs = W.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))))


def test_aot_at_llama3_sizes_no_spills_pipelined_tensor_cores(builds):
    """Every launch of REAL_SHAPES as a GPU would compile it: no spills, cp.async stages, HMMA at decode
    (BLOCK_M = 16 is below wgmma's 64 rows) and HGMMA at prefill on sm90a."""
    _, compiled = builds
    table = ki.resource_table([(label, b) for label, bb in compiled.items() for b in bb.values()])
    for label, bb in compiled.items():
        for arch, b in bb.items():
            assert b.spills == 0 and b.metadata["stack_bytes"] == 0, f"{label} {arch}\n{table}"
            assert b.async_copies["LDGSTS"] > 0, f"{label} {arch}\n{table}"
        assert bb["sm80"].tensor_core == "HMMA"
        assert bb["sm90"].tensor_core == ("HMMA" if "decode" in label else "HGMMA"), label


def test_launch_job_is_the_launch():
    """The AOT job carries the launcher's specialization: unit strides folded, N and strides %16, M = 1 at decode."""
    spec = W.launch_job(1, 4096, 4096).specialization()
    for line in ("M: =1", "stride_xk: =1", "stride_wk: =1", "stride_sg: =1", "stride_yn: =1", "N: i32 %16",
                 "stride_wn: i32 %16", "y_ptr: *fp32 %16"):
        assert line in spec.splitlines(), (line, spec)
    assert "y_ptr: *fp16 %16" in W.launch_job(4096, 4096, 4096).specialization()   # no split: y itself


def _param_widths(build, job, arg):
    """kernels.inspect.param_product_widths, plus mad.wide.s32 (a 32 x 32 -> 64-bit product that the
    helper does not list yet) read as 64."""
    index = [n for n in job.kernel.arg_names if n not in job.constexprs].index(arg)
    widths = ki.param_product_widths(build, index)
    name = build.metadata["name"]
    reg = re.search(rf"ld\.param\.[bsu]32\s+(%r\d+), \[{name}_param_{index}\];", build.ptx)
    if reg and re.search(rf"mad\.wide\.s32\s+%rd\d+, (?:[^;]*, )?{reg.group(1)}\b", build.ptx):
        widths.add(64)
    return widths


def test_ptx_uses_64bit_row_offsets(builds):
    """Token rows (x, y) and the split index are 64-bit products: 4096 tokens of Llama-3-70B's 28672-wide
    down input is 117M elements, and a million-token prefill passes 2**31."""
    jobs, compiled = builds
    label = "Llama-3-70B down prefill, g128"
    for arg in ("stride_xm", "stride_wn", "stride_ym"):
        assert _param_widths(compiled[label]["sm90"], jobs[label], arg) == {64}, arg
