"""kernels.moe.soft_moe: the softmax-mix kernel (dispatch and combine) against its reference, its
broken tail mask caught, the Soft MoE layer's properties, its non-causality, and its AOT builds."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.moe import soft_moe as sm
from kernels.moe.model import MoEConfig, MoEGPT
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
SHAPES = [(2, 37, 40, 24), (1, 5, 16, 70), (3, 64, 64, 128), (1, 1, 8, 16)]     # (B, m, d, s)


def _problem(B, m, d, s, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, m, s, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, m, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(B, s, d, generator=g, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_and_combine_match_the_reference(shape, dtype):
    logits, x, slots = _problem(*shape, dtype)
    for scores, values in ((logits.transpose(1, 2), x), (logits, slots)):        # dispatch, combine
        got = sm.soft_mix(nan_canary(scores.contiguous()) if scores.is_contiguous() else scores, nan_canary(values))
        want = sm.soft_mix_ref(scores, values)
        if dtype == torch.float32:
            assert_close(got, want)
        else:
            low = (torch.softmax(scores.float(), -1).to(dtype) @ values).float()
            assert_close(got.float(), want, dtype=dtype, baseline=low)


def test_dispatch_weights_sum_over_tokens_combine_over_slots():
    logits, x, _ = _problem(2, 9, 4, 6, torch.float64)
    ones = torch.ones(2, 9, 1, dtype=torch.float64)
    assert_close(sm.soft_mix_ref(logits.transpose(1, 2), ones), torch.ones(2, 6, 1, dtype=torch.float64))
    assert_close(sm.soft_mix_ref(logits, torch.ones(2, 6, 1, dtype=torch.float64)), ones)


def test_large_logits_are_stable():
    logits, x, _ = _problem(1, 40, 16, 20, torch.float32)
    got = sm.soft_mix(logits.transpose(1, 2) * 200, x)
    assert bool(torch.isfinite(got).all())
    assert_close(got, sm.soft_mix_ref(logits.transpose(1, 2) * 200, x))


def test_broken_tail_mask_is_caught():
    """Positions past J read as logit 0 take a share of the softmax when J is not a multiple of the block."""
    logits, x, _ = _problem(2, 37, 40, 24, torch.float32)
    scores = logits.transpose(1, 2)
    out = torch.empty(2, 24, 40)
    grid, args, kwargs = sm._launch_args(scores, x, out, sm.CPU_TILE, mask_tail=False)
    sm._soft_mix_kernel[grid](*args, **kwargs)
    with pytest.raises(MismatchError):
        assert_close(out, sm.soft_mix_ref(scores, x))


def test_soft_moe_layer_kernel_path_and_one_token_decode():
    """The layer's kernel path equals its reference; a single token fills every slot with itself, so
    every expert runs on it (the layer is dense at decode)."""
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(layer="soft", slots_per_expert=4, d_model=32, d_expert=24, block_size=16))
    layer = model.moe_layers[0]
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        assert_close(layer(x, use_kernels=True), layer(x))
        one = torch.randn(1, 1, 32)
        slots = sm.soft_mix_ref((one @ layer.phi).transpose(1, 2), one)          # (1, s, d)
    assert torch.allclose(slots, one.expand_as(slots))


def test_a_future_token_changes_a_past_output():
    torch.manual_seed(0)
    soft = MoEGPT(MoEConfig(layer="soft", slots_per_expert=4, block_size=16)).eval()
    topk = MoEGPT(MoEConfig(block_size=16)).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 256
    with torch.no_grad():
        for model, leaks in ((soft, True), (topk, False)):
            diff = (model(idx)[0, :12] - model(changed)[0, :12]).abs().max()
            assert bool(diff > 1e-4) is leaks


def test_bad_input_refused():
    with pytest.raises(ValueError, match="3-D floating-point"):
        sm.soft_mix(torch.rand(3, 4), torch.rand(1, 4, 2))
    with pytest.raises(ValueError, match="disagree"):
        sm.soft_mix(torch.rand(1, 3, 4), torch.rand(1, 5, 2))
    with pytest.raises(ValueError, match="J = 0"):
        sm.soft_mix(torch.rand(1, 3, 0), torch.rand(1, 0, 2))
    with pytest.raises(ValueError, match="must be"):
        MoEGPT(MoEConfig(layer="soft")).moe_layers[0](torch.rand(5, 64))
    with pytest.raises(ValueError, match="takes none of"):
        MoEConfig(layer="soft", balance="switch")


def test_aot_builds_use_tensor_cores_without_spills():
    jobs = sm.compile_jobs()
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))
    for label, b in zip(jobs, builds):
        assert b["sm80"].tensor_core == "HMMA" and b["sm90"].tensor_core == "HGMMA", label
        assert all(x.spills == 0 for x in b.values()), label
        assert "stride_vd: =1" in jobs[label].specialization().splitlines()
