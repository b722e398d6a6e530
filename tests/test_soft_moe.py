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


def test_normalised_logits_are_scaled_cosines():
    """slot_logits with a scale is scale * cos(x_t, phi_j), whatever the norms of x and phi; the
    broken variant that normalises phi over the slots instead of over d is caught."""
    g = torch.Generator().manual_seed(2)
    x, phi, scale = torch.randn(2, 7, 16, generator=g, dtype=torch.float64), torch.randn(16, 5, generator=g, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)
    dots = torch.einsum("bmd,ds->bms", x, phi)                                       # (2, 7, 5), term by term
    norms = ((x * x).sum(-1) + sm.NORM_EPS).sqrt()[..., None] * ((phi * phi).sum(0) + sm.NORM_EPS).sqrt()
    want = scale * dots / norms                                                     # scale * cos, eps as vmoe's
    assert_close(sm.slot_logits(x, phi, scale), want)
    rescaled = sm.slot_logits(x * 10, phi * 10, scale)                              # the norms (nearly) drop out:
    assert float((rescaled - want).abs().max()) < 1e-6 and float((x @ phi).abs().max()) > 1   # eps is all that remains
    assert_close(sm.slot_logits(x, phi), x @ phi)                                   # no scale: the raw product
    broken = scale * (x / x.norm(dim=-1, keepdim=True)) @ (phi / phi.norm(dim=1, keepdim=True))
    with pytest.raises(MismatchError):
        assert_close(broken, want)


def test_normalised_layer_kernel_path_and_last_layer_only_model():
    """The normalised layer's kernel path equals its reference; with Soft MoE in the last block only,
    the first (dense) block stays causal and only the final outputs read the future."""
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(layer="soft", n_experts=32, slots_per_expert=1, soft_normalize=True, soft_layers=1,
                             block_size=16)).eval()
    layer = model.moe_layers[0]
    x = torch.randn(2, 11, 64)
    with torch.no_grad():
        assert_close(layer(x, use_kernels=True), layer(x))
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda _m, _a, out: seen.append(out))
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 256
    with torch.no_grad():
        logits = model(idx), model(changed)
    hook.remove()
    assert float((seen[0][0, :12] - seen[1][0, :12]).abs().max()) == 0.0               # block 0: causal
    assert float((logits[0][0, :12] - logits[1][0, :12]).abs().max()) > 1e-4           # the Soft MoE block: not


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
