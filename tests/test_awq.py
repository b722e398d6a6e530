"""kernels.quant.awq: the scale search never loses to RTN on its objective, scaling protects salient
channels, the folded form equals the fake-quantized weight, and a search without scales is caught."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels.quant import awq, intq
from kernels.quant.w4a16 import w4a16_matmul


def _layer(seed=0, T=256, K=96, N=40, salient=(3, 50)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g, dtype=torch.float64)
    x[:, list(salient)] *= 20.0
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    return x, w


def test_scales_are_normalised():
    s = awq.awq_scales(torch.tensor([0.5, 2.0, 8.0], dtype=torch.float64), 0.5)
    assert torch.allclose(s.max() * s.min(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.equal(awq.awq_scales(torch.rand(7, dtype=torch.float64) + 0.1, 0.0), torch.ones(7, dtype=torch.float64))


@pytest.mark.parametrize("bits,group", [(4, 32), (3, 32), (4, None)])
def test_search_never_loses_to_rtn_and_helps_salient_channels(bits, group):
    x, w = _layer()
    s, alpha, errors = awq.awq_search(x, [w], bits, group)
    assert len(errors) == 20 and errors[0] == pytest.approx(awq.output_error(x, w, awq.rtn(w, bits, group)))
    assert min(errors) == errors[round(alpha * 20)] and alpha > 0 and min(errors) < 0.9 * errors[0]


def test_shared_input_search_scores_all_linears():
    x, w = _layer(seed=1)
    w2 = w.flip(0) * 2
    s, alpha, errors = awq.awq_search(x, [w, w2], 4, 32)
    both = torch.cat([w, w2])
    assert errors[0] == pytest.approx(awq.output_error(x, both, awq.rtn(both, 4, 32)))


def test_search_without_scaling_is_caught():
    """A 'search' that forgets to divide by s after rounding is far from the layer: the check sees it."""
    x, w = _layer(seed=2)
    s, _, _ = awq.awq_search(x, [w], 4, 32)
    right = awq.output_error(x, w, awq.scaled_quantize(w, s, 4, 32))
    wrong = awq.output_error(x, w, awq.rtn(w * s[None, :], 4, 32))
    assert wrong > 100 * right


def test_folded_form_runs_in_the_w4a16_kernel():
    x, w = _layer(seed=3, K=128, N=64)
    s, _, _ = awq.awq_search(x, [w], 4, 32)
    sp, zp = intq.quant_params(w * s, 4, symmetric=False, granularity="group", group_size=32)
    q = intq.quantize_ref(w * s, sp, zp, 4, False)
    y = w4a16_matmul((x[:48] / s).float(), intq.pack_int4(q), sp.float(), zp.to(torch.uint8), 32)
    want = x[:48] @ awq.scaled_quantize(w, s, 4, 32).T
    assert torch.allclose(y.double(), want, rtol=1e-4, atol=1e-4)


def test_rtn_group_must_divide_k():
    with pytest.raises(ValueError, match="group_size=32 does not divide K=40"):
        awq.rtn(torch.zeros(3, 40), 4, 32)


def test_awq_model_on_the_tiny_gpt():
    from kernels.quant import calibration as cal
    model = cal.load_model_f64()
    calib = cal.calibration_tokens(2, 64)
    q, alphas = awq.awq_model(model, calib, 4, 32)
    assert len(alphas) == 16 and all(0 <= a < 1 for a in alphas.values())
    w0, w1 = model.blocks[1].mlp.w_down.weight, q.blocks[1].mlp.w_down.weight
    assert not torch.equal(w0, w1) and (w1 - w0).abs().max() < 0.1
    assert torch.equal(q.wte.weight, model.wte.weight)                            # embedding untouched


def test_duo_scaling():
    """w_bar is |W| over its group's max, averaged over rows (AutoAWQ); duo scales stay normalised. (Unlike
    the plain search, alpha = 0 is s = 1 / w_bar here, not RTN, so duo can lose to RTN on its objective.)"""
    w = torch.tensor([[1.0, -2.0, 4.0, 0.5], [2.0, 2.0, -1.0, 1.0]], dtype=torch.float64)
    want = torch.tensor([(1 / 2 + 2 / 2) / 2, (2 / 2 + 2 / 2) / 2, (4 / 4 + 1 / 1) / 2, (0.5 / 4 + 1 / 1) / 2], dtype=torch.float64)
    assert torch.allclose(awq.weight_absmean(w, 2), want, atol=1e-5)
    x, w = _layer(seed=5)
    s, alpha, errors = awq.awq_search(x, [w], 4, 32, duo=True)
    assert torch.allclose(s.max() * s.min(), torch.tensor(1.0, dtype=torch.float64))
    assert errors[round(alpha * 20)] == min(errors) and 0 <= alpha < 1
    assert not torch.allclose(awq.awq_scales(awq.act_absmean(x), 0.0, awq.weight_absmean(w, 32)), torch.ones(96, dtype=torch.float64))
