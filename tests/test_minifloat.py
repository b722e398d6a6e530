"""kernels/quant/minifloat.py: E2M1, E2M3 and E3M2 decoded and encoded on every code and every
rounding midpoint, against ml_dtypes (PyTorch 2.13 converts none of them on the CPU) and the OCP MX
spec's value table; saturation, zeros, refusals; RTN with group scales."""
import ml_dtypes
import numpy as np
import pytest
import torch

from kernels.quant import minifloat as mf

ML = {"e2m1": ml_dtypes.float4_e2m1fn, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}
FMTS = list(ML)


def ml_decode(name, codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ML[name]).astype(np.float32)


def ml_encode(name, x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(ML[name]).view(np.uint8)


@pytest.mark.parametrize("name", FMTS)
def test_every_code_decodes_as_ml_dtypes(name):
    f = mf.FORMATS[name]
    codes = np.arange(1 << f.bits, dtype=np.uint8)
    got = mf.values(name).numpy()
    assert np.array_equal(got.view(np.uint32), ml_decode(name, codes).view(np.uint32))   # -0.0 included


def test_e2m1_is_the_spec_table():
    # OCP MX v1.0, FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    assert mf.values("e2m1").tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


@pytest.mark.parametrize("name,bias,top,sub,emax", [("e2m1", 1, 6.0, 0.5, 2), ("e2m3", 1, 7.5, 0.125, 2),
                                                     ("e3m2", 3, 28.0, 0.0625, 4)])
def test_format_constants(name, bias, top, sub, emax):
    f = mf.FORMATS[name]
    assert (f.bias, f.max, f.min_subnormal, f.emax) == (bias, top, sub, emax)
    assert f.max == float(ml_dtypes.finfo(ML[name]).max)
    assert mf.values(name).abs().max().item() == f.max


@pytest.mark.parametrize("name", FMTS)
def test_encode_every_value_midpoint_and_neighbour(name):
    f = mf.FORMATS[name]
    pos = np.unique(np.abs(mf.values(name).numpy()))
    mids = (pos[:-1] + pos[1:]) / 2
    xs = np.concatenate([pos, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
                         [f.max * 1.01, f.max * 1e6, np.inf, 1e-30, 1e-45, 0.0, f.min_subnormal / 2 * 1.0001]])
    xs = np.concatenate([xs, -xs]).astype(np.float32)
    assert np.array_equal(mf.encode(torch.from_numpy(xs), name).numpy(), ml_encode(name, xs))


@pytest.mark.parametrize("name", FMTS)
def test_encode_random_and_roundtrip(name):
    x = (np.random.default_rng(1).standard_normal(100_000) * 8).astype(np.float32)
    assert np.array_equal(mf.encode(torch.from_numpy(x), name).numpy(), ml_encode(name, x))
    codes = torch.arange(1 << mf.FORMATS[name].bits).to(torch.uint8)
    assert torch.equal(mf.encode(mf.decode(codes, name), name), codes)


def test_ties_go_to_the_even_code():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # 0.25 -> 0 (not 0.5), 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert mf.decode(mf.encode(x, "e2m1"), "e2m1").tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_saturation_and_signed_zero():
    x = torch.tensor([7.0, 1e30, float("inf"), -float("inf"), -0.0, -1e-40])
    assert mf.decode(mf.encode(x, "e2m1"), "e2m1").tolist() == [6, 6, 6, -6, -0.0, -0.0]
    assert torch.signbit(mf.decode(mf.encode(torch.tensor([-0.0]), "e3m2"), "e3m2")).item()


def test_refusals():
    with pytest.raises(ValueError, match="NaN"):
        mf.encode(torch.tensor([1.0, float("nan")]), "e2m1")
    with pytest.raises(TypeError, match="floating-point"):
        mf.encode(torch.tensor([1, 2]), "e2m1")
    with pytest.raises(TypeError, match="uint8"):
        mf.decode(torch.tensor([1, 2]), "e2m1")
    with pytest.raises(ValueError, match="4-bit"):
        mf.decode(torch.tensor([16], dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="fmt must be one of"):
        mf.encode(torch.ones(1), "e1m2")
    with pytest.raises(ValueError, match="divide K"):
        mf.quantize(torch.ones(4, 30), "e2m1", 32)


def test_torch_float4_is_storage_only():
    """torch 2.13 names float4_e2m1fn_x2 but cannot convert to or from it on the CPU; if a later torch can,
    its conversion must agree with this encoder on every packed pair."""
    assert torch.float4_e2m1fn_x2.itemsize == 1
    codes = torch.arange(256, dtype=torch.uint8)                    # every pair of codes, low nibble first
    try:
        got = codes.view(torch.float4_e2m1fn_x2).float()
    except (NotImplementedError, RuntimeError):
        return
    lo, hi = mf.decode(codes & 15, "e2m1"), mf.decode(codes >> 4, "e2m1")
    assert torch.equal(got.reshape(-1), torch.stack([lo, hi], -1).reshape(-1))


@pytest.mark.parametrize("name", FMTS)
def test_group_rtn(name):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * 0.02
    w[2, 32:64] = 0.0                                               # an all-zero group
    codes, s = mf.quantize(w, name, 32)
    assert codes.shape == (6, 96) and s.shape == (6, 3) and s.dtype == torch.float16
    w_hat = mf.dequantize(codes, s, name)
    assert torch.equal(w_hat[2, 32:64], torch.zeros(32))
    f = mf.FORMATS[name]
    # every nonzero group's largest magnitude lands on +-max (the fp16 rounding of s moves w / s by 2^-11)
    top = mf.decode(codes, name).abs().reshape(6, 3, 32).amax(-1)
    nonzero = w.abs().reshape(6, 3, 32).amax(-1) > 0
    assert (top[nonzero] == f.max).all() and (s[~nonzero] == 1).all()
    # RTN error at most half the widest step, s 2^(emax - m) / 2 (plus the top value's fp16 slack)
    half_step = s.float().repeat_interleave(32, 1) * 2.0 ** (f.emax - f.mbits - 1)
    assert ((w_hat - w).abs() <= half_step * 1.001).all()
    assert mf.bits_per_weight(name, 32) == mf.FORMATS[name].bits + 0.5
