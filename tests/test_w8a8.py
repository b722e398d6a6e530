"""kernels.quant.w8a8: int8 x int8 -> int32 matmul with per-token and per-channel scales, against
the dequantize-then-matmul reference (split-K at decode too); the fused RMSNorm + per-token
quantization against PyTorch; broken-variant, bad-input and AOT (IMMA/IGMMA, cp.async, no spills) checks."""
import kernels  # noqa: F401  (before triton)

import re

import pytest
import torch

from kernels import runtime
from kernels.quant.intq import quantize_per_channel, quantize_per_token
from kernels import inspect as ki
from kernels.quant import w8a8 as W
from kernels.quant.w8a8 import w8a8_matmul, w8a8_matmul_ref
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


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (5, 7, 9), (70, 90, 200), (130, 65, 64), (33, 129, 300), (1, 130, 1000)])
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


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two fp32 tensors in units in the last place (same-sign values)."""
    return int((a.cpu().view(torch.int32).long() - b.cpu().view(torch.int32).long()).abs().max())


@pytest.mark.parametrize("M,N,K,splits", [(37, 129, 200, (None, 1, 2)), (2, 70, 640, (1, 2, 5, 10))])
def test_split_k_is_exact(M, N, K, splits):
    """Every split, the default one included (4 at M = 37 under the interpreter), gives the same bits:
    the exact integer product (int64 on the host) scaled once in fp32, fl(fl(fl(acc) a_m) w_n) (equation 1'),
    for fp32 and fp16 outputs; that is within 1 ulp of the exact product scaled in float64 and rounded
    once to fp32. The old epilogue (each partial scaled, the fp32 partials summed) is not."""
    (xq, wq, xs, ws), _, _ = _case(M, N, K, seed=7)
    assert W.choose_split_k(M, N, K, W.tile_for(M, on_gpu=False)) > 1
    acc = W.integer_product(xq, wq)
    exact = W.scale_epilogue(acc, xs.cpu(), ws.cpu())
    float64_scaled = (acc.double() * xs.cpu().double()[:, None] * ws.cpu().double()[None, :]).float()
    assert _ulps(exact, float64_scaled) <= 1 and (exact * float64_scaled >= 0).all()
    for split in splits:
        assert torch.equal(w8a8_matmul(xq, wq, xs, ws, split_k=split).cpu(), exact), split
    assert torch.equal(w8a8_matmul(xq, wq, xs, ws, out_dtype=torch.float16, split_k=splits[-1]).cpu(),
                       W.scale_epilogue(acc, xs.cpu(), ws.cpu(), torch.float16))
    broken = w8a8_matmul(xq, wq, xs, ws, split_k=splits[-1], _scale_partials=True).cpu()
    assert not torch.equal(broken, exact) and _ulps(broken, exact) > 16


def test_split_k_at_decode():
    """M = 1 splits K (the rule of kernels.quant.w4a16.split_for); a split that does not divide the K
    steps is refused, and so is a K whose int32 sums could overflow."""
    tile = W.tile_for(1, on_gpu=False)
    assert W.choose_split_k(1, 130, 1000, tile) == 16 and W.choose_split_k(1, 4096, 4096, W.DECODE_TILE) == 4
    (xq, wq, xs, ws), _, _ = _case(2, 70, 640, seed=7)
    with pytest.raises(ValueError, match="split_k must be a positive int dividing the 10 K steps"):
        w8a8_matmul(xq, wq, xs, ws, split_k=3)
    big = torch.zeros(1, W.MAX_K + 1, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="would overflow the int32 accumulator: at most 131071"):
        w8a8_matmul(big, big, xs[:1], ws[:1])


def _rms_case(M, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2
    x[:, K // 3] *= 30                                                # an outlier channel
    return x, torch.rand(K, generator=g) + 0.5


@pytest.mark.parametrize("M,K,dtype", [(1, 1, torch.float32), (7, 300, torch.float32), (33, 128, torch.float16),
                                       (4, 1000, torch.float32)])
def test_rms_norm_quant_matches_pytorch(M, K, dtype):
    x, gain = _rms_case(M, K, seed=K)
    x = x.to(dtype)
    q, s = W.rms_norm_quant(nan_canary(x.to(DEVICE), rows=True), gain.to(DEVICE))
    q_ref, s_ref = W.rms_norm_quant_ref(x, gain)
    assert_close(s, s_ref, dtype=torch.float32)
    # the norm's sum runs in another order than PyTorch's: a code may move by one where h / s sits at a tie
    assert (q.cpu().int() - q_ref.int()).abs().max() <= 1 and (q.cpu() != q_ref).float().mean() < 0.01


def test_rms_norm_quant_rounds_half_to_even():
    """A row whose norm is exactly 1 and whose scale is exactly 1: the codes of the ties k + 1/2 are even."""
    K = 8
    x = torch.ones(1, K)
    gain = torch.tensor([127.0, 0.5, 1.5, 2.5, -3.5, 10.5, 0.25, 126.5])
    q, s = W.rms_norm_quant(x.to(DEVICE), gain.to(DEVICE), eps=1e-30)
    assert s.item() == 1.0
    assert q.cpu().tolist() == [[127, 0, 2, 2, -4, 10, 0, 126]] == torch.round(gain)[None].int().tolist()


def test_rms_norm_quant_broken_scale_is_caught():
    x, gain = _rms_case(9, 200, seed=3)
    q, s = W.rms_norm_quant(x.to(DEVICE), gain.to(DEVICE), _scale_before_norm=True)
    _, s_ref = W.rms_norm_quant_ref(x, gain)
    with pytest.raises(MismatchError):
        assert_close(s, s_ref, dtype=torch.float32)


def test_rms_norm_quant_bad_input():
    x, gain = _rms_case(3, 16, seed=0)
    with pytest.raises(ValueError, match="gain must be a contiguous"):
        W.rms_norm_quant(x, gain[:8])
    with pytest.raises(ValueError, match="x must be a 2-D fp16 or fp32"):
        W.rms_norm_quant(x.double(), gain)
    with pytest.raises(ValueError, match="unit stride"):
        W.rms_norm_quant(x.t(), gain[:3])
    with pytest.raises(ValueError, match="eps must be positive"):
        W.rms_norm_quant(x, gain, eps=0.0)


@pytest.fixture(scope="module")
def builds():
    jobs = W.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))))


def test_aot_at_llama3_sizes_integer_tensor_cores_pipelined_without_spills(builds):
    """As a GPU launch compiles them (kernels.inspect.launch_job): IMMA on sm80, IGMMA on sm90a at prefill
    (IMMA at decode, BLOCK_M = 16), cp.async stages, no spills; the fused norm + quantization spill-free."""
    _, compiled = builds
    table = ki.resource_table([(label, b) for label, bb in compiled.items() for b in bb.values()])
    for label, bb in compiled.items():
        for arch, b in bb.items():
            assert b.spills == 0 and b.metadata["stack_bytes"] == 0, f"{label} {arch}\n{table}"
        if label.startswith("rms_norm_quant"):
            continue
        assert bb["sm80"].tensor_core == "IMMA"
        assert bb["sm90"].tensor_core == ("IMMA" if "decode" in label else "IGMMA"), label
        assert all(b.async_copies["LDGSTS"] > 0 for b in bb.values()), f"{label}\n{table}"


def test_hinted_k_is_what_pipelines():
    """The old hand-written signature left K unhinted (k < K blocks 16-byte loads): no cp.async at all.
    The launch's own specialization marks K %16 and the loads become LDGSTS."""
    job = W.launch_job(4096, 14336, 4096)
    assert "K: i32 %16" in job.specialization().splitlines()
    unhinted = W.launch_job(4096, 14336, 4096 + 8)                     # K = 4104: not a multiple of 16
    assert "K: i32" in unhinted.specialization().splitlines()
    hinted_b, unhinted_b = (b["sm90"] for b in ki.compile_triton_many([job, unhinted], archs=("sm90",)))
    assert hinted_b.async_copies["LDGSTS"] > 0 and unhinted_b.async_copies["LDGSTS"] == 0


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


def test_ptx_uses_64bit_token_offsets(builds):
    """m * stride_xm passes 2**31 at 262,144 tokens of Llama-3-70B's 8192-wide input: a 64-bit product."""
    jobs, compiled = builds
    label = "Llama-3-70B gate/up prefill, fp16 out"
    assert 262144 * 8192 == 2**31
    for arg in ("stride_xm", "stride_wn", "stride_ym"):
        assert _param_widths(compiled[label]["sm90"], jobs[label], arg) == {64}, arg
