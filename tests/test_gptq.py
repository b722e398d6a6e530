"""kernels.quant.gptq: the Cholesky/lazy-batch form equals brute-force OBS, error feedback matters
(its absence is RTN and is caught), enumeration lower-bounds it, codes pack for W4A16, bad input."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels.quant import awq, gptq, intq
from kernels.quant.calibration import hessian


def _layer(N=7, K=40, T=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, K, generator=g, dtype=torch.float64) @ torch.randn(K, K, generator=g, dtype=torch.float64)
    return torch.randn(N, K, generator=g, dtype=torch.float64), hessian(X)


@pytest.mark.parametrize("bits,group,order,block", [(4, None, False, 128), (3, 8, False, 16), (3, 8, True, 16),
                                                    (2, 20, False, 7), (4, None, True, 1)])
def test_equals_brute_force_obs(bits, group, order, block):
    W, H = _layer()
    fast = gptq.gptq_quantize(W, H, bits, group, block_size=block, act_order=order)
    assert (fast - gptq.obs_ref(W, H, bits, group, act_order=order)).abs().max() < 1e-9


def test_blocks_do_not_change_the_result():
    W, H = _layer(seed=1)
    ref = gptq.gptq_quantize(W, H, 3, 8, block_size=40)
    for b in (1, 3, 16):
        assert (gptq.gptq_quantize(W, H, 3, 8, block_size=b) - ref).abs().max() < 1e-10


def test_beats_rtn_and_forgetting_the_feedback_is_caught():
    W, H = _layer(seed=2)
    good = gptq.layer_error(W, gptq.gptq_quantize(W, H, 3, 8), H).sum()
    broken = gptq.gptq_quantize(W, H, 3, 8, error_feedback=False)
    assert torch.equal(broken, awq.rtn(W, 3, 8))
    assert good < 0.8 * gptq.layer_error(W, broken, H).sum()


def test_enumeration_lower_bounds_everything():
    W, H = _layer(N=3, K=6, seed=3)
    opt = gptq.layer_error(W, gptq.best_on_grid(W, H, 2), H)
    for other in (gptq.gptq_quantize(W, H, 2, damp=0.0), awq.rtn(W, 2, None)):
        assert bool((opt <= gptq.layer_error(W, other, H) + 1e-12).all())
    with pytest.raises(ValueError, match="too large"):
        gptq.best_on_grid(torch.zeros(1, 12), torch.eye(12), 2)


def test_dead_inputs_are_zeroed():
    W, H = _layer(seed=4)
    H[5, :] = 0
    H[:, 5] = 0
    assert bool((gptq.gptq_quantize(W, H, 4, 8)[:, 5] == 0).all())


@pytest.mark.parametrize("order", [False, True])
def test_codes_pack_into_the_w4a16_format(order):
    from kernels.quant.w4a16 import w4a16_matmul
    g = torch.Generator().manual_seed(5)
    X = torch.randn(60, 64, generator=g, dtype=torch.float64)
    W = torch.randn(24, 64, generator=g, dtype=torch.float64)
    Wq, q, s, z = gptq.gptq_quantize(W, hessian(X), 4, 32, act_order=order, return_codes=True)
    assert q.dtype == torch.uint8 and s.shape == (24, 2) and torch.equal(intq.dequantize_ref(q, s, z), Wq)
    y = w4a16_matmul(X.float(), intq.pack_int4(q), s.float(), z.to(torch.uint8), 32)
    assert torch.allclose(y.double(), X @ Wq.T, rtol=1e-4, atol=1e-4)


def test_bad_input():
    W, H = _layer()
    with pytest.raises(ValueError, match="group_size=16 does not divide K=40"):
        gptq.gptq_quantize(W, H, 4, 16)
    with pytest.raises(ValueError, match=r"H must be \(K, K\)"):
        gptq.gptq_quantize(W, H[:-1, :-1], 4)
    with pytest.raises(ValueError, match="bits must be"):
        gptq.gptq_quantize(W, H, 5)


def test_gptq_model_beats_rtn_on_the_tiny_gpt():
    from kernels.quant import calibration as cal
    model = cal.load_model_f64()
    calib = cal.calibration_tokens(8)
    g = cal.validation_loss(gptq.gptq_model(model, calib, 3, 32), 8)
    r = cal.validation_loss(awq.rtn_model(model, 3, 32), 8)
    assert g < r
