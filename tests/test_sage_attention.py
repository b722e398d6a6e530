"""kernels/attention/sage.py: the INT8 Q K^T / FP8 P V kernel with K smoothing (against exact attention
on its own quantized inputs, within the P-rounding bound), the broken variant without smoothing on keys
with a per-channel offset, the quantizers of SageAttention 2, 2++ and 3, and the sm89/sm90/sm120 builds."""
import kernels  # noqa: F401
import math

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import attention_ref
from kernels.attention import flash3 as F3
from kernels.attention import sage as S
from kernels.testing import nan_canary

DEVICE = runtime.device()


def _qkv(B, Hq, Hkv, Nq, Nk, D, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64) + offset * torch.randn(1, Hkv, 1, D, generator=g,
                                                                                            dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    return [t.half().to(DEVICE) for t in (q, k, v)]


CASES = [(1, 2, 1, 100, 150, 64), (2, 4, 2, 37, 64, 32), (1, 2, 2, 64, 1, 16), (1, 1, 1, 130, 70, 128)]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D", CASES)
@pytest.mark.parametrize("smooth", [True, False])
def test_kernel_is_exact_attention_on_its_quantized_inputs_up_to_p_rounding(B, Hq, Hkv, Nq, Nk, D, smooth):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, seed=Nq, offset=2.0)
    o = S.sage_attention(q, k, v, smooth_k=smooth)
    bm, bn, _ = S.CPU_BLOCKS if runtime.runtime().interpreted else S.GPU_BLOCKS
    qd, kd, vd = S.dequantized_inputs(q, k, v, block_m=bm, block_n=bn, smooth=smooth)
    ref = attention_ref(qd, kd, vd)
    err = float((o.double() - ref).abs().max())
    assert err <= F3.p_rounding_bound(vd.abs().max(), Nk, p_scale=S.P_SCALE), err


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D", [(1, 2, 1, 100, 150, 64), (2, 4, 2, 37, 64, 32), (1, 1, 1, 130, 130, 128)])
def test_causal_kernel_is_exact_causal_attention_on_its_quantized_inputs(B, Hq, Hkv, Nq, Nk, D):
    """Causal (bottom-right) within the same P-rounding bound, K smoothed over all keys (exact under the
    mask: a per-row constant); the same output against the non-causal reference fails the bound."""
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, seed=Nq + 1, offset=2.0)
    o = S.sage_attention(q, k, v, causal=True)
    bm, bn, _ = S.CPU_BLOCKS if runtime.runtime().interpreted else S.GPU_BLOCKS
    qd, kd, vd = S.dequantized_inputs(q, k, v, block_m=bm, block_n=bn)
    bound = F3.p_rounding_bound(vd.abs().max(), Nk, p_scale=S.P_SCALE)
    assert float((o.double() - attention_ref(qd, kd, vd, True)).abs().max()) <= bound
    assert float((o.double() - attention_ref(qd, kd, vd, False)).abs().max()) > bound


def test_smoothing_leaves_causal_attention_unchanged():
    q, k, v = _qkv(1, 2, 1, 40, 50, 32, offset=5.0)
    a = attention_ref(q.double(), k.double(), v.double(), True)
    b = attention_ref(q.double(), S.smooth_k(k.double()), v.double(), True)
    assert float((a - b).abs().max()) < 1e-12


def test_smoothing_leaves_attention_unchanged():
    q, k, v = _qkv(1, 2, 1, 40, 50, 32, offset=5.0)
    a = attention_ref(q.double(), k.double(), v.double())
    b = attention_ref(q.double(), S.smooth_k(k.double()), v.double())
    assert float((a - b).abs().max()) < 1e-12


def test_no_smoothing_is_caught_on_keys_with_a_channel_offset():
    """A per-channel offset 16x the spread of K: with smoothing the INT8 error stays at the FP8 P V floor
    (within 1.25x of attention with exact Q K^T and the same P, V formats); without it, it does not."""
    q, k, v = _qkv(1, 2, 1, 128, 128, 64, seed=3, offset=16.0)
    ref = attention_ref(q.double(), k.double(), v.double())
    e4 = lambda x: x.float().to(torch.float8_e4m3fn).double()                            # noqa: E731
    floor = S.relative_l1(S.quantized_attention_ref(
        q, k, v, p_fn=lambda p: e4(p * 448) / 448,
        v_fn=lambda x: (lambda s: e4(x / s) * s)(x.abs().amax(2, keepdim=True) / 448)), ref)
    good = S.relative_l1(S.sage_attention(q, k, v), ref)
    bad = S.relative_l1(S.sage_attention(q, k, v, smooth_k=False), ref)
    assert good <= 1.25 * floor < bad


def test_reads_views_inside_nan_canaries():
    q, k, v = _qkv(1, 2, 1, 70, 90, 32, seed=4)
    o = S.sage_attention(*(nan_canary(t, rows=True) for t in (q, k, v)))
    assert not torch.isnan(o).any()
    assert torch.equal(o, S.sage_attention(q, k, v))


def test_int8_quantizer_rounds_half_away_and_keeps_the_block_max():
    x = torch.tensor([[[[1.0, -0.5], [0.25, 127.0 / 254]]]])        # amax 1: s = 1/127
    codes, s = S.quantize_int8_blocks(x, 2)
    assert torch.equal(codes, torch.tensor([[[[127, -64], [32, 64]]]], dtype=torch.int8))
    assert torch.allclose(s, torch.tensor([[[1 / 127]]]))


def test_per_thread_groups_follow_the_fragment_layout():
    g = S.per_thread_groups(256, block=128, warps=4)
    assert len(torch.unique(g)) == 2 * 4 * 8                       # 32 scales per 128-row block
    assert g[0] == g[8] == g[16] == g[24] and g[0] != g[1] and g[32] != g[0]   # rows g, g+8, ... of a warp


def test_nvfp4_grid_and_scales():
    x = torch.tensor([0.0, 0.24, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 0.5, 1.0, 1.5, 2.0, 4.0])
    y = S.fake_quant_nvfp4(x[None], block=16)[0]
    assert torch.equal(y, torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -6.0, 0.5, 1.0, 1.5, 2.0, 4.0],
                                       dtype=torch.float64))       # ties to the even code
    with pytest.raises(ValueError, match="multiple of block"):
        S.fake_quant_nvfp4(torch.zeros(1, 10))


def test_q_smoothing_is_exact_without_a_quantizer():
    x = torch.randn(1, 1, 70, 16, dtype=torch.float64)
    assert torch.allclose(S.smoothed(lambda t: t, 32)(x), x, atol=1e-12)


def test_bad_inputs_are_refused_by_name():
    q, k, v = _qkv(1, 2, 1, 32, 32, 64)
    with pytest.raises(ValueError, match="causal with Nq=40 > Nk=32"):
        S.sage_attention(*_qkv(1, 2, 1, 40, 32, 64), causal=True)
    with pytest.raises(ValueError, match="head dim D=48"):
        S.sage_attention(*_qkv(1, 2, 1, 32, 32, 48))
    with pytest.raises(TypeError, match="dtype"):
        S.sage_attention(q.to(torch.int8), k, v)
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two"):
        S.sage_attention(q, k, v, blocks=(48, 64, 4))


@pytest.fixture(scope="module")
def builds():
    """The kernel and its folded broken variant for sm89, sm90a and sm120, in one batched compile."""
    jobs = {**S.compile_jobs(), **S.compile_jobs(two_level=False)}
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm89", "sm90", "sm120"))))


def test_builds_use_int8_and_fp8_tensor_cores_without_spills(builds):
    expect = {"sm89": "IMMA+QMMA", "sm90": "IGMMA+QGMMA", "sm120": "IMMA+QMMA"}
    for label, b in builds.items():
        for arch, want in expect.items():
            assert b[arch].tensor_core == want, (label, arch)
            assert b[arch].spills == 0 and b[arch].metadata["stack_bytes"] == 0, (label, arch)


def test_fp8_pv_accumulates_in_two_levels_on_every_target(builds):
    """SageAttention2's two levels: each block's FP8 P V dot starts from a zero accumulator and the
    fp32 add happens outside the MMA. The folded source (acc * alpha + tl.dot(p8, v)) is the broken
    variant: Triton folds the add into the dot on sm89 and sm120, and the checker must see it."""
    (two, two_b), (folded, folded_b) = builds.items()
    assert "folded" in folded and "folded" not in two
    for arch in ("sm89", "sm90", "sm120"):
        assert S.fp8_dot_accumulators(two_b[arch].ttgir) == [True], arch
    for arch in ("sm89", "sm120"):
        assert S.fp8_dot_accumulators(folded_b[arch].ttgir) == [False], arch


def test_fp8_dot_is_refused_on_sm80():
    from kernels.inspect import CompileError
    job = next(iter(S.compile_jobs().values()))
    with pytest.raises(CompileError):
        ki.compile_triton_many([job], archs=("sm80",))
