"""kernels.rows.tanh, the one tanh of the course's kernels (the attention and logit soft-caps), and the
soft-cap's reference and argument check: accurate near zero (where 2 sigmoid(2u) - 1 is not), checked
against float64 from 1e-30 to 20. tests/test_loss.py checks it through the loss kernel's soft-cap."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.rows import TANH_POLY_LIMIT, check_cap, softcap_ref, tanh

SERIES_BELOW = float(TANH_POLY_LIMIT.value)   # below: the odd series; above: the exponential form

DEVICE = runtime.device()


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, SIGMOID_FORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if SIGMOID_FORM:
        y = 2.0 * tl.sigmoid(2.0 * x) - 1.0              # the form issue 49 found imprecise near zero
    else:
        y = tanh(x)
    tl.store(out_ptr + offs, y, mask=offs < n)


def _kernel_tanh(u: torch.Tensor, sigmoid_form: bool = False) -> torch.Tensor:
    out = torch.empty_like(u)
    _tanh_kernel[(triton.cdiv(u.numel(), 4096),)](u, out, u.numel(), SIGMOID_FORM=sigmoid_form, BLOCK=4096)
    return out


def _worst_relative(got: torch.Tensor, u: torch.Tensor) -> float:
    want = torch.tanh(u.double())
    return float(((got.double() - want).abs() / want.abs()).max())


def _points(lo: float, hi: float, n: int = 4000) -> torch.Tensor:
    """n points spread log-uniformly over [lo, hi], both signs, fp32."""
    mag = torch.logspace(torch.log10(torch.tensor(lo)), torch.log10(torch.tensor(hi)), n, dtype=torch.float64)
    return torch.cat([mag, -mag]).float().to(DEVICE)


@pytest.mark.parametrize("lo,hi", [(1e-30, 1e-6), (1e-6, 1e-2), (1e-2, SERIES_BELOW * 0.999)])
def test_series_side_is_within_twice_torchs_own_error(lo, hi):
    u = _points(lo, hi)
    ours, theirs = _worst_relative(_kernel_tanh(u), u), _worst_relative(torch.tanh(u), u)
    assert ours <= 2 * max(theirs, 2.0**-24), (ours, theirs)


@pytest.mark.parametrize("lo,hi", [(SERIES_BELOW, 1.0), (1.0, 20.0)])
def test_exponential_side_is_within_3e_7(lo, hi):
    u = _points(lo, hi)
    assert _worst_relative(_kernel_tanh(u), u) < 3e-7


def test_limits_and_odd_symmetry():
    u = torch.tensor([0.0, -0.0, 30.0, 1e4, float("inf"), -float("inf"), float("nan")], device=DEVICE)
    got = _kernel_tanh(u)
    assert got[0] == 0 and got[1] == 0 and bool((got[2:5] == 1).all()) and got[5] == -1 and got[6].isnan()
    x = _points(1e-4, 10.0)
    assert torch.equal(_kernel_tanh(-x), -_kernel_tanh(x))


def test_the_sigmoid_form_is_caught():
    """2 sigmoid(2u) - 1 fails the near-zero check by orders of magnitude (about 1e-1 relative at 1e-6)."""
    u = _points(1e-6, 1e-2)
    theirs = _worst_relative(torch.tanh(u), u)
    assert _worst_relative(_kernel_tanh(u, sigmoid_form=True), u) > 100 * 2 * theirs


def test_softcap_ref_and_check_cap():
    x = torch.tensor([-1e4, -3.0, 0.0, 3.0, 1e4], dtype=torch.float64)
    y = softcap_ref(x, 50.0)
    assert bool((y.abs() <= 50).all()) and torch.allclose(y[1:4], x[1:4], rtol=2e-3)   # tanh(200) is 1 in fp64
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            check_cap(bad, "f")
    assert check_cap(50, "f") == 50.0
