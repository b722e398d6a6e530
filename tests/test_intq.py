"""kernels.quant.intq: integer grids, scales and zero points at every granularity, int4 packing, checked on all codes."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels.quant import intq


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True), (4, False), (3, False), (2, True)])
def test_every_code_round_trips(bits, symmetric):
    """Every code of the grid, dequantized with any scale and zero point, quantizes back to itself."""
    lo, hi = intq.qrange(bits, symmetric)
    codes = torch.arange(lo, hi + 1).to(torch.int8 if symmetric else torch.uint8)[None, :]          # (1, 2^b or 2^b - 1)
    s = torch.tensor([[0.037]], dtype=torch.float64)
    z = torch.tensor([[0.0 if symmetric else float(2 ** (bits - 1))]], dtype=torch.float64)
    x = intq.dequantize_ref(codes, s, z)
    assert torch.equal(intq.quantize_ref(x, s, z, bits, symmetric), codes)


def test_qrange():
    assert intq.qrange(8, True) == (-127, 127) and intq.qrange(8, False) == (0, 255)
    assert intq.qrange(4, True) == (-7, 7) and intq.qrange(4, False) == (0, 15)
    with pytest.raises(ValueError, match="bits must be"):
        intq.qrange(5, True)


@pytest.mark.parametrize("granularity,group_size,shape", [("tensor", None, (1, 1)), ("channel", None, (6, 1)),
                                                         ("group", 32, (6, 3))])
@pytest.mark.parametrize("symmetric", [True, False])
def test_error_bounded_by_half_a_step(granularity, group_size, shape, symmetric):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 6, dtype=torch.float64)[:, None]
    s, z = intq.quant_params(x, 4, symmetric=symmetric, granularity=granularity, group_size=group_size)
    assert s.shape == shape and z.shape == shape
    xh = intq.fake_quantize(x, 4, symmetric=symmetric, granularity=granularity, group_size=group_size)
    step = intq._expand(s, x.shape)
    assert bool(((xh - x).abs() <= step / 2 + 1e-12).all())
    if not symmetric:                                                        # zero stays exactly zero
        assert torch.equal(intq.fake_quantize(torch.zeros(2, 64, dtype=torch.float64), 4, symmetric=False,
                                              granularity="group", group_size=32), torch.zeros(2, 64, dtype=torch.float64))


def test_finer_granularity_is_never_worse():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 256, generator=g, dtype=torch.float64)
    x[:, 7] *= 30                                                            # one outlier column
    err = {gr: float((intq.fake_quantize(x, 4, granularity=gr, group_size=32) - x).pow(2).mean())
           for gr in ("tensor", "channel", "group")}
    assert err["group"] < err["channel"] <= err["tensor"]


def test_all_zero_group_gets_unit_scale():
    s, z = intq.quant_params(torch.zeros(3, 8), 8, granularity="channel")
    assert torch.equal(s, torch.ones(3, 1)) and torch.equal(z, torch.zeros(3, 1))


def test_group_size_must_divide_k():
    with pytest.raises(ValueError, match="group_size=128 does not divide K=352"):
        intq.quant_params(torch.randn(4, 352), 4, granularity="group", group_size=128)
    with pytest.raises(ValueError, match="positive group_size"):
        intq.quant_params(torch.randn(4, 352), 4, granularity="group")
    with pytest.raises(ValueError, match="granularity must be"):
        intq.quant_params(torch.randn(4, 352), 4, granularity="row")
    with pytest.raises(ValueError, match="2-D"):
        intq.quant_params(torch.randn(4), 4)


@pytest.mark.parametrize("signed", [False, True])
def test_pack_all_256_code_pairs(signed):
    """Every pair of 4-bit codes packs into the byte (low = even element) and unpacks back."""
    lo, hi = (-8, 7) if signed else (0, 15)
    a, b = torch.meshgrid(torch.arange(lo, hi + 1), torch.arange(lo, hi + 1), indexing="ij")
    q = torch.stack([a.flatten(), b.flatten()], 1).to(torch.int8)          # (256, 2)
    p = intq.pack_int4(q)
    assert p.shape == (256, 1) and p.dtype == torch.uint8
    assert sorted(p.flatten().tolist()) == list(range(256))                 # a bijection onto the bytes
    assert torch.equal(p[:, 0].to(torch.int32), (q[:, 0].to(torch.int32) & 15) | ((q[:, 1].to(torch.int32) & 15) << 4))
    assert torch.equal(intq.unpack_int4(p, signed=signed), q)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="even length"):
        intq.pack_int4(torch.zeros(4, 7, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"fit 4 bits"):
        intq.pack_int4(torch.tensor([[3, 16]], dtype=torch.int8))
    with pytest.raises(ValueError, match="integer codes"):
        intq.pack_int4(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="uint8"):
        intq.unpack_int4(torch.zeros(2, 2, dtype=torch.int8))


def test_per_token_scales_are_fp32_and_exact():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 40, generator=g, dtype=torch.float64)
    q, s = intq.quantize_per_token(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5,)
    assert torch.equal(q.abs().amax(1), torch.full((5,), 127, dtype=torch.int8))  # each row's max hits 127
    assert bool(((q.double() * s.double()[:, None] - x).abs() <= s.double()[:, None] / 2 + 1e-12).all())
    with pytest.raises(ValueError, match="2-D floating-point"):
        intq.quantize_per_token(torch.zeros(3, dtype=torch.float64))


def test_bits_per_weight():
    assert intq.bits_per_weight(4, 128) == 4 + 20 / 128
    assert intq.bits_per_weight(8, None) == 8.0
