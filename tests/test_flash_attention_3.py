"""kernels/attention/flash3.py: the warp-specialised FlashAttention forward on tensor descriptors (fp16
and FP8 with block quantization and the Hadamard rotation), its broken variants, the ping-pong model,
and the sm_90a build at Llama-3-70B's size."""
import kernels  # noqa: F401  (before triton)
import math
import re

import pytest
import torch
import triton
import triton.language as tl

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import attention_ref
from kernels.quant import calibration
from kernels.attention import flash3 as F3
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()
GPU = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA sm90+ GPU: the kernel is checked on the "
                         "interpreter and compiled for sm_90a here, but timing it needs a driver")


def _qkv(B, Hq, Hkv, Nq, Nk, D, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


CASES = [
    (1, 2, 1, 100, 100, 64, True),      # GQA 2, two key blocks with a masked tail, causal
    (1, 4, 2, 37, 150, 32, False),      # fewer queries than one block, three key blocks
    (2, 2, 2, 70, 45, 64, True),        # Nq > Nk causal: the first 25 rows see no key (output 0)
    (1, 2, 2, 16, 80, 128, False),      # D = 128, one 16-row query tile
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal", CASES)
def test_fp16_matches_reference(B, Hq, Hkv, Nq, Nk, D, causal):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, seed=Nq)
    o, lse = F3.flash_attention_3(q, k, v, causal, return_lse=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal, return_lse=True)
    assert_close(o, ref, dtype=torch.float16, baseline=attention_ref(q, k, v, causal, upcast=False))
    assert_close(lse, ref_lse.float(), dtype=torch.float32, baseline=ref_lse.float())


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v = _qkv(1, 2, 1, 70, 45, 64, seed=3)
    o, lse = F3.flash_attention_3(q, k, v, True, return_lse=True)
    assert bool((o[:, :, :25] == 0).all()) and bool(torch.isneginf(lse[:, :, :25]).all())
    assert bool(torch.isfinite(lse[:, :, 25:]).all())


def test_reads_views_inside_nan_canaries():
    """Every row sits between NaN: a load past a row, or a key tile read past Nk and not masked, shows."""
    q, k, v = _qkv(1, 2, 1, 90, 110, 64, seed=4)
    views = [nan_canary(t, rows=True) for t in (q, k, v)]
    o = F3.flash_attention_3(*views)
    assert_close(o, attention_ref(q.double(), k.double(), v.double()), dtype=torch.float16,
                 baseline=attention_ref(q, k, v, upcast=False))


def test_forgetting_the_rescale_is_caught():
    q, k, v = _qkv(1, 2, 1, 64, 150, 64, seed=5)
    ref = attention_ref(q.double(), k.double(), v.double())
    with pytest.raises(MismatchError):
        assert_close(F3.flash_attention_3(q, k, v, _rescale=False), ref, dtype=torch.float16,
                     baseline=attention_ref(q, k, v, upcast=False))


def test_warp_specialize_flag_does_not_change_the_result():
    q, k, v = _qkv(1, 2, 1, 64, 100, 32, seed=6)
    a = F3.flash_attention_3(q, k, v, warp_specialize=True)
    b = F3.flash_attention_3(q, k, v, warp_specialize=False)
    assert torch.equal(a, b)


def test_bad_inputs_are_refused_by_name():
    q, k, v = _qkv(1, 2, 1, 32, 32, 64)
    with pytest.raises(TypeError, match="q has dtype"):
        F3.flash_attention_3(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="head dim D=48"):
        F3.flash_attention_3(*_qkv(1, 2, 1, 32, 32, 48))
    with pytest.raises(ValueError, match="16-byte aligned"):
        F3.flash_attention_3(q[..., 1:33], k[..., 1:33], v[..., 1:33])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        F3.flash_attention_3(*_qkv(1, 3, 2, 32, 32, 64))
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        F3.flash_attention_3(q, k, v, block_m=48, block_n=64)
    with pytest.raises(ValueError, match="sm_scale"):
        F3.flash_attention_3(q, k, v, sm_scale=float("nan"))


# ----------------------------------------------------------------------------------------------
# FP8


def test_rotation_is_orthogonal_and_keeps_scores():
    M = F3.random_rotation(64, seed=1)
    assert torch.allclose(M @ M.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    H = F3.hadamard_matrix(8)
    assert torch.equal(H @ H.T, 8 * torch.eye(8, dtype=torch.float64))
    q, k, _ = _qkv(1, 1, 1, 20, 30, 64, dtype=torch.float64)
    assert torch.allclose((q @ M) @ (k @ M).transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-10)
    with pytest.raises(ValueError, match="power of two"):
        F3.hadamard_matrix(12)


def test_block_quantization_codes_equal_the_bit_exact_encoder():
    from kernels.quant import fp8 as Q

    x = torch.randn(1, 2, 100, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 7
    codes, scales = F3.quantize_blocks(x, 64)
    assert scales.shape == (1, 2, 2)
    per_row = scales.repeat_interleave(64, dim=2)[:, :, :100, None]
    expect = Q.encode((x.float() / per_row), "e4m3")
    assert torch.equal(codes.view(torch.uint8), expect)
    back = F3.dequantize_blocks(codes, scales, 64)
    assert float((back - x).abs().max() / x.abs().max()) < 2 ** -4     # half an E4M3 unit at the top


def _recorded_o_proj_input(q, k, v):
    """Causal GQA attention of (q, k, v), heads concatenated: (windows * T, Hq * D), as o_proj reads it."""
    o = attention_ref(q, k, v, True)
    return o.transpose(1, 2).reshape(-1, o.shape[1] * o.shape[3])


def test_smollm2_inputs_reproduce_the_attention_output_the_extraction_recorded():
    """The Q, K, V rebuilt from block 12's input and weights give, through causal attention, the input of
    o_proj that transformers computed offline (stats.json: its largest per-channel value and channel);
    with Llama's default rope_theta 10000 instead of SmolLM2's 100000 the same check fails."""
    from kernels.model.gpt import rope
    from kernels.quant import calibration

    recorded = calibration.smollm2_stats()["linears"]["layers.12.self_attn.o_proj"]
    q, k, v = calibration.smollm2_attention_inputs()
    assert q.shape == (3, 9, 128, 64) and k.shape == v.shape == (3, 3, 128, 64)
    a = _recorded_o_proj_input(q, k, v).abs().amax(0)
    assert (round(float(a.max()), 3), int(a.argmax())) == (recorded["max"], recorded["top_channel"])
    assert round(float(a.max() / a.median()), 2) == recorded["max_over_median"]
    layer = calibration.smollm2_layers()["qkv"]
    y = (layer.x @ layer.w.T).reshape(3, 128, 15, 64).transpose(1, 2)
    pos = torch.arange(128)
    wrong = _recorded_o_proj_input(rope(y[:, :9].float(), pos, 10000.0).double(),
                                   rope(y[:, 9:12].float(), pos, 10000.0).double(), y[:, 12:])
    assert round(float(wrong.abs().amax(0).max()), 3) != recorded["max"]


def test_fp8_rotation_lowers_the_error_on_smollm2():
    """Real outlier channels (SmolLM2-135M block 12, first window): the Hadamard rotation lowers the FP8
    kernel's RMSE against float64 attention by more than 1.2x; per-block scales alone do not."""
    q, k, v = (t[:1].half().to(DEVICE) for t in calibration.smollm2_attention_inputs())
    ref = attention_ref(q.double(), k.double(), v.double())
    rmse = {}
    for rotate, block_quant in ((False, False), (False, True), (True, True)):
        o = F3.flash_attention_3_fp8(F3.prepare_fp8(q, k, v, rotate=rotate, block_quant=block_quant))
        rmse[rotate, block_quant] = float(((o.double() - ref) ** 2).mean().sqrt())
    assert rmse[False, True] > 1.2 * rmse[True, True]
    assert abs(rmse[False, True] / rmse[False, False] - 1) < 0.1


@triton.jit
def _round_probe(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, F3._round_e4m3(tl.load(x_ptr + i)))


def test_in_kernel_rounding_is_round_to_nearest_even():
    """Every E4M3 midpoint from 0 to 448 and values around them round as PyTorch's cast does."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()     # codes 0..126
    mid = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([grid, mid, mid * (1 + 1e-6), mid * (1 - 1e-6), torch.tensor([500.0, 1e-9, 0.0])])
    n = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel())).to(DEVICE)
    out = torch.empty_like(x)
    _round_probe[(1,)](x, out, N=n)
    # The kernel saturates at 448 (its docstring); PyTorch's own cast of an overflow changed between
    # versions (NaN in 2.11, 448 in 2.13), so the reference saturates first and rounds with PyTorch.
    assert torch.equal(out.cpu(), x.cpu().clamp(max=448.0).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal", CASES[:3])
@pytest.mark.parametrize("rotate,block_quant", [(True, True), (False, False)])
def test_fp8_within_the_p_rounding_bound(B, Hq, Hkv, Nq, Nk, D, causal, rotate, block_quant):
    """Against exact attention on the kernel's own (dequantized, rotated) inputs, the kernel differs only
    by the E4M3 rounding of 2^8 P, bounded by p_rounding_bound."""
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, seed=Nk)
    inp = F3.prepare_fp8(q, k, v, rotate=rotate, block_quant=block_quant)
    o = F3.flash_attention_3_fp8(inp, causal)
    dq, dk, dv = inp.dequantized()
    ref = attention_ref(dq.double(), dk.double(), dv.double(), causal)
    err = float((o.double() - ref).abs().max())
    assert err <= F3.p_rounding_bound(dv.abs().max(), Nk)
    assert err > 0                                      # P really was rounded


def test_fp8_forgetting_the_v_scale_is_caught():
    q, k, v = _qkv(1, 2, 1, 64, 100, 64, seed=8)
    inp = F3.prepare_fp8(q, k, v)
    dq, dk, dv = inp.dequantized()
    ref = attention_ref(dq.double(), dk.double(), dv.double())
    bad = F3.flash_attention_3_fp8(inp, _scale_v=False)
    assert float((bad.double() - ref).abs().max()) > 10 * F3.p_rounding_bound(dv.abs().max(), 100)


def test_fp8_input_checks():
    q, k, v = _qkv(1, 2, 1, 64, 100, 64)
    inp = F3.prepare_fp8(q, k, v)
    with pytest.raises(TypeError, match="Fp8Inputs"):
        F3.flash_attention_3_fp8((inp.q, inp.k, inp.vt))
    import dataclasses
    with pytest.raises(ValueError, match="k_scale must be contiguous float32"):
        F3.flash_attention_3_fp8(dataclasses.replace(inp, k_scale=inp.k_scale[..., :1]))
    with pytest.raises(TypeError, match="out_dtype"):
        F3.flash_attention_3_fp8(inp, out_dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# The schedule model


def test_schedule_closed_forms():
    g0, sm, g1, n = 512.0, 700.0, 512.0, 12
    serial = F3.schedule("serial", n, g0, sm, g1)
    assert F3.makespan(serial) == n * (g0 + sm + g1)
    intra = F3.schedule("intra", n, g0, sm, g1)
    assert F3.makespan(intra) == g0 + n * (sm + g1)          # each GEMM0 after the first hides under a softmax
    pp = F3.schedule("pingpong", n, g0, sm, g1)
    assert F3.overlapping_gemms(pp) == 0
    # two groups, twice the rows: steady state one (GEMM1 + GEMM0 + softmax) per block per group
    assert F3.makespan(pp) < 2 * F3.makespan(serial)
    assert F3.tensor_core_busy(pp) / F3.makespan(pp) > F3.tensor_core_busy(serial) / F3.makespan(serial)
    for ev in (serial, intra, pp):
        assert F3.unit_utilisation(ev) <= 1                 # the SM's exp2/FP32 units never over-subscribed


def test_pingpong_shares_the_sms_softmax_units():
    """The softmax is priced at the whole SM's MUFU/FP32 rate, so the two groups' softmaxes take turns:
    the makespan is at least the softmax work of both groups (the issue-39 case: 16 blocks of the sm_90a
    build's 512/1296/512 clocks need 41,472 clocks of those units)."""
    n, g, sm = 16, 512.0, 1296.0
    pp = F3.schedule("pingpong", n, g, sm, g)
    assert F3.unit_utilisation(pp) == 1.0 and F3.makespan(pp) >= 2 * n * sm
    assert F3.tensor_core_busy(pp) / F3.makespan(pp) < 0.78
    softmaxes = sorted((e.start, e.end) for e in pp if e.kind == "softmax")
    assert all(a[1] <= b[0] for a, b in zip(softmaxes, softmaxes[1:]))   # one at a time, in order


def test_unshared_softmax_units_are_caught():
    broken = F3.schedule("pingpong", 16, 512.0, 1296.0, 512.0, shared_units=False)
    assert F3.unit_utilisation(broken) == 2.0               # two softmaxes at once, each at the SM's full rate
    assert F3.makespan(broken) < 2 * 16 * 1296.0            # shorter than the units' work: impossible


def test_pingpong_without_its_barrier_is_caught():
    broken = F3.schedule("pingpong", 8, 512.0, 700.0, 512.0, ordered=False)
    assert F3.overlapping_gemms(broken) > 0
    with pytest.raises(ValueError, match="kind must be"):
        F3.schedule("coop", 4, 1.0, 1.0, 1.0)


# ----------------------------------------------------------------------------------------------
# The sm_90a build at Llama-3-70B's size


@pytest.fixture(scope="module")
def builds():
    jobs = F3.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_sm90a_build_is_warp_specialised_with_tma_and_wgmma(builds):
    jobs, out = builds
    for label, b in out.items():
        b = b["sm90"]
        assert b.metadata["num_warps"] == 12, label            # producer + two consumer partitions of 4 warps
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        assert b.async_copies["UTMALDG"] >= 3 and b.async_copies["LDGSTS"] == 0, label   # Q, K, V by TMA
        assert b.tensor_core == ("QGMMA" if "FP8" in label else "HGMMA"), label
        setmax = {ln.split()[0] + " " + ln.split()[-1].rstrip(";") for ln in b.ptx.splitlines() if "setmaxnreg" in ln}
        assert "setmaxnreg.dec.sync.aligned.u32 40" in setmax and "setmaxnreg.inc.sync.aligned.u32 232" in setmax
        assert 3 * 128 * b.metadata["registers"] == 128 * 40 + 2 * 128 * 232     # the split conserves the pool


def test_the_two_consumer_partitions_are_identical(builds):
    """Triton 3.7.1's sm90 warp specialization of this loop at 64-row tiles replicates the consumer:
    both partitions run the same operations on the one Q tile. If a Triton upgrade partitions the
    rows instead (FA3's two 64-row warp groups), this test fails and the chapter must be revised."""
    _, out = builds
    for b in out.values():
        parts = F3.warp_partitions(b["sm90"].ttgir)
        assert sorted(parts) == ["default", "partition0", "partition1"]
        assert parts["partition0"] == parts["partition1"]
        assert "ttng.warp_group_dot" not in parts["default"] and "ttng.async_tma_copy_global_to_local" in parts["default"]
        assert parts["partition0"].count("ttng.warp_group_dot") == 2
        assert len(re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<1x64x128x", b["sm90"].ttgir)) == 1


def test_lse_offset_is_64_bit(builds):
    jobs, out = builds
    label = next(iter(jobs))
    runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
    assert 64 in ki.param_product_widths(out[label]["sm90"], runtime_args.index("Nq"))


def test_loop_costs_from_the_build(builds):
    jobs, out = builds
    fp16, fp8 = (out[k]["sm90"] for k in jobs)
    c16 = F3.loop_costs(fp16, block_m=64, block_n=128, head_dim=128)
    c8 = F3.loop_costs(fp8, block_m=64, block_n=128, head_dim=128, fp8=True)
    assert c16.mma == 16 and c8.mma == 8          # 2 x 8 HGMMA.64x128x16, 2 x 4 QGMMA.64x128x32 per block
    assert c16.mufu == c8.mufu == 66              # 64 exp2 of P per thread plus 2 of alpha
    assert c16.gemm0 == 512.0 and c8.gemm0 == 256.0


@GPU
def test_gpu_matches_reference_in_bf16():
    q, k, v = _qkv(2, 8, 2, 1000, 1000, 128, dtype=torch.bfloat16)
    assert_close(F3.flash_attention_3(q, k, v, True), attention_ref(q.double(), k.double(), v.double(), True),
                 dtype=torch.bfloat16, baseline=attention_ref(q, k, v, True, upcast=False))
