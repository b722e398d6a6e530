"""kernels.quant.fp8: the codecs against PyTorch over every code and every rounding midpoint, the
scaling rules (per tensor and row-wise, clamped before the cast), the FP8 GEMM against its reference
(interpreter) and in AOT SASS at Llama-3 sizes, and the three GEMMs of an FP8 training step."""
import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.quant import fp8 as F
from kernels.testing import MismatchError, assert_close, nan_canary, pinned_triton

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
    # E4M3 saturates (module docstring); PyTorch's own cast of an overflow is NaN in 2.11 and +-448 in
    # 2.13, so for E4M3 the reference saturates first (NaN stays NaN) and rounds with PyTorch.
    ref = x if f8.has_inf else x.clamp(-f8.max, f8.max)
    got, want = F.encode(x, fmt), ref.to(f8.torch_dtype).view(torch.uint8)
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


def test_quantize_clamps_before_the_cast():
    """Out-of-range values land on +-max in both formats, whatever the conversion would do on its own."""
    x = torch.tensor([1e6, -1e6, 449.0, 500.0])
    assert F.quantize(x, torch.tensor(1.0), "e4m3").float().tolist() == [448.0, -448.0, 448.0, 448.0]
    assert F.quantize(x * 1e3, torch.tensor(1.0), "e5m2").float().abs().max().item() == 57344.0
    assert torch.isinf(x.mul(1e3).to(torch.float8_e5m2).float()).all()            # the bare cast overflows
    with pytest.raises(RuntimeError, match="overflow"):
        torch.full((2,), 449.0, dtype=torch.float8_e4m3fn)                          # and this path raises


def test_rowwise_scales_map_each_row_amax_to_448():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(9, 40, generator=g) * torch.logspace(-3, 3, 9)[:, None]        # rows six decades apart
    q, s = F.quantize_rowwise(a, "e4m3", dim=1)
    assert s.shape == (9,) and torch.equal(q.float().abs().amax(1), torch.full((9,), 448.0))
    qt, st = F.quantize_current(a)
    row_err = ((q.float() * s[:, None] - a).abs() / a.abs().amax(1, keepdim=True)).max()
    tensor_err = ((qt.float() * st - a).abs() / a.abs().amax(1, keepdim=True)).max()
    assert row_err < 2**-4 < tensor_err                       # one scale per tensor flushes the small rows
    with pytest.raises(ValueError, match="2-D"):
        F.quantize_rowwise(a[0])


@pytest.mark.parametrize("m, k, n", [(1, 17, 130), (70, 45, 90)])
def test_rowwise_fp8_matmul_matches_reference(m, k, n):
    g = torch.Generator().manual_seed(m)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    (aq, sa), (bq, sb) = F.quantize_rowwise(a, dim=1), F.quantize_rowwise(b, dim=0)
    got = F.fp8_matmul(aq.to(DEV), bq.t().contiguous().t().to(DEV), sa.to(DEV), sb.to(DEV))
    assert_close(got, F.fp8_matmul_ref(aq, bq, sa, sb), dtype=torch.float32)
    with pytest.raises(ValueError, match="row-wise"):
        F.fp8_matmul(aq.to(DEV), bq.to(DEV), sa.to(DEV), sb[:2].to(DEV))


def test_mixed_formats_e5m2_times_e4m3():
    """dgrad's operands: an E5M2 gradient times an E4M3 weight, as HYBRID training runs it."""
    g = torch.Generator().manual_seed(9)
    dy, w = torch.randn(33, 70, generator=g) * 1e-4, torch.randn(70, 50, generator=g)
    (gq, sg), (wq, sw) = F.quantize_current(dy, "e5m2"), F.quantize_current(w, "e4m3")
    assert_close(F.fp8_matmul(gq.to(DEV), wq.to(DEV), sg.to(DEV), sw.to(DEV)), F.fp8_matmul_ref(gq, wq, sg, sw),
                 dtype=torch.float32)


def test_training_gemms_operand_layouts():
    """fprop reads both operands K-major as stored; dgrad's B (W) and both of wgrad's are not: on Hopper
    they need a transposed copy (Transformer Engine keeps FP8 transposes for this)."""
    x, w, dy = torch.empty(64, 32), torch.empty(48, 32), torch.empty(64, 48)
    k_major = {name: (a.stride(1) == 1, b.stride(0) == 1) for name, (_, a, b) in F.training_gemms(x, w, dy).items()}
    assert k_major == {"fprop": (True, True), "dgrad": (True, False), "wgrad": (False, False)}
    for _, a, b in F.training_gemms(x, w, dy).values():
        assert a.shape[1] == b.shape[0]


def test_fp8_linear_gradients_follow_the_fp32_ones():
    """Fp8Linear's three GEMMs on FP8 codes: output and both gradients within the formats' error of
    fp32 autograd (E4M3 relative step 2^-3, E5M2 2^-2, averaged over long sums)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g, requires_grad=True)
    w = torch.randn(40, 96, generator=g) * 0.1
    lin = F.Fp8Linear(w)
    dy = torch.randn(64, 40, generator=g) * 1e-3
    y = lin(x)
    y.backward(dy)
    x32 = x.detach().clone().requires_grad_(True)
    w32 = w.clone().requires_grad_(True)
    (x32 @ w32.T).backward(dy)
    for got, want, bound in ((y.detach(), x.detach() @ w.T, 0.05), (x.grad, x32.grad, 0.08), (lin.weight.grad, w32.grad, 0.08)):
        assert float((got - want).norm() / want.norm()) < bound
    assert lin.weight.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32   # fp32 master weight
    with pytest.raises(ValueError, match="fmt"):
        F.Fp8Linear(w, grad_fmt="e3m4")


def test_fp8_linear_backward_reads_dy_in_its_grad_format():
    """dgrad and wgrad run on dY's codes in grad_fmt (E5M2 under HYBRID), exactly: a backward that
    ignored grad_fmt, or cast dY to the other format, would differ from one of the two references."""
    g = torch.Generator().manual_seed(4)
    x, w, dy = torch.randn(32, 48, generator=g), torch.randn(24, 48, generator=g), torch.randn(32, 24, generator=g)
    (xq, sx), (wq, sw) = F.quantize_current(x, "e4m3"), F.quantize_current(w, "e4m3")
    grads = {}
    for fmt in ("e5m2", "e4m3"):
        lin, xx = F.Fp8Linear(w, grad_fmt=fmt), x.clone().requires_grad_(True)
        lin(xx).backward(dy)
        gq, sg = F.quantize_current(dy, fmt)
        assert torch.equal(xx.grad, F.fp8_matmul_ref(gq, wq, sg, sw))                 # dX = dY W
        assert torch.equal(lin.weight.grad, F.fp8_matmul_ref(gq.t(), xq, sg, sx))     # dW = dY^T X
        grads[fmt] = xx.grad
    assert not torch.equal(grads["e5m2"], grads["e4m3"])

def test_fp8_blocks_keeps_embeddings_norms_and_head():
    from kernels.model.gpt import GPT, GPTConfig
    model = F.fp8_blocks(GPT(GPTConfig(n_layer=1)))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Fp8Linear" in kinds and not any(isinstance(m, torch.nn.Linear) for m in model.blocks.modules())
    logits = model(torch.zeros(1, 8, dtype=torch.long))
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.fixture(scope="module")
def builds():
    jobs = dict(F.compile_jobs())
    jobs["N-major B"] = F.launch_job(4096, 14336, 4096, b_k_major=False)
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm89", "sm90", "sm100"))))


def test_fp8_gemm_aot_at_llama3_sizes(builds):
    """GPU_TILE (128 x 128 x 128, 8 warps) as a launch compiles it: QMMA / QGMMA / UTCQMMA, no spills,
    a cp.async pipeline, on sm89, sm90a and sm100a; and no FP8 on sm80."""
    table = ki.resource_table([(label, b) for label, bb in builds.items() for b in bb.values()])
    for label, bb in builds.items():
        assert (bb["sm89"].tensor_core, bb["sm90"].tensor_core, bb["sm100"].tensor_core) == ("QMMA", "QGMMA", "UTCQMMA")
        for b in bb.values():
            assert b.spills == 0 and b.async_copies["LDGSTS"] > 0, f"{label}\n{table}"
    with pytest.raises(ki.CompileError, match="fp8e4nv not supported"):
        ki.compile_triton_many([F.launch_job(4096, 14336, 4096)], archs=("sm80",))


def test_an_n_major_b_is_transposed_in_registers_on_hopper(builds):
    """wgmma's FP8 form reads only K-major operands: a row-major (K, N) B costs byte permutes (PRMT) and
    registers on sm90a, and half the cp.async traffic, against the K-major build."""
    k_major, n_major = builds["Llama-3-8B gate/up prefill, per-tensor"]["sm90"], builds["N-major B"]["sm90"]
    assert n_major.families()["PRMT"] > k_major.families()["PRMT"]
    assert not pinned_triton() or n_major.families()["PRMT"] > 100 > k_major.families()["PRMT"]   # Triton 3.6: 64
    assert n_major.metadata["registers"] > k_major.metadata["registers"]
    assert n_major.async_copies["LDGSTS"] < k_major.async_copies["LDGSTS"]


def test_fp8_training_arms_start_from_the_same_weights():
    """The training comparison's arms differ only in their GEMMs: same initialization at a seed."""
    from kernels.quant import fp8_training as FT
    ref, hybrid = FT.make_model("fp32", 0).state_dict(), FT.make_model("fp8 hybrid", 0).state_dict()
    assert ref.keys() == hybrid.keys() and all(torch.equal(ref[k], hybrid[k]) for k in ref)
    assert not torch.equal(ref["wte.weight"], FT.make_model("fp32", 1).state_dict()["wte.weight"])
    with pytest.raises(ValueError, match="arm"):
        FT.make_model("bf16", 0)
