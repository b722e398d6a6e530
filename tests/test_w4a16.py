"""kernels.quant.w4a16: packed int4 weights dequantized group-wise inside the kernel, against
dequantize-then-matmul; broken nibble order caught; bad input; AOT (HMMA/HGMMA, no spills)."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import runtime
from kernels.quant import intq
from kernels.quant.w4a16 import aot_job, w4a16_matmul, w4a16_matmul_ref
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()


def _case(M, N, K, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    s, z = intq.quant_params(w, 4, symmetric=False, granularity="group", group_size=group)
    q = intq.quantize_ref(w, s, z, 4, False)
    return (x.to(DEVICE, dtype), intq.pack_int4(q).to(DEVICE), s.to(DEVICE, dtype), z.to(torch.uint8).to(DEVICE))


CASES = [(1, 1, 128, 128), (5, 70, 256, 128), (33, 130, 384, 128), (17, 9, 64, 32), (40, 65, 96, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K,group", CASES)
def test_matches_dequantize_then_matmul(M, N, K, group, dtype):
    x, p, s, z = _case(M, N, K, group, dtype)
    got = w4a16_matmul(nan_canary(x), nan_canary(p), nan_canary(s), nan_canary(z), group)
    assert got.shape == (M, N) and got.dtype == dtype
    want = w4a16_matmul_ref(x, p, s, z, group)
    baseline = (x.double() @ _dequant(p, s, z, group).to(dtype).double().T).to(dtype)   # PyTorch in the low dtype
    assert_close(got, want, dtype=dtype, baseline=baseline)


def _dequant(p, s, z, group):
    return intq.dequantize_ref(intq.unpack_int4(p), s.double(), z.double())


def test_dequantized_weight_is_the_quantized_grid():
    """The reference's weight is s (q - z) for every one of the 16 codes in every group."""
    N, K, group = 3, 256, 128
    q = torch.arange(16, dtype=torch.uint8).repeat(N, K // 16)
    s = torch.tensor([[0.5, 0.25]] * N, dtype=torch.float64)
    z = torch.tensor([[8, 3]] * N, dtype=torch.uint8)
    eye = torch.eye(K, dtype=torch.float64)
    w = w4a16_matmul_ref(eye, intq.pack_int4(q), s, z, group).T                   # (N, K)
    want = torch.cat([0.5 * (q[:, :128].double() - 8), 0.25 * (q[:, 128:].double() - 3)], 1)
    assert torch.equal(w, want)
    got = w4a16_matmul(eye.float(), intq.pack_int4(q), s.float(), z, group).T
    assert torch.equal(got.double(), want)


def test_row_strided_input():
    x, p, s, z = _case(20, 30, 256, 128, torch.float32, seed=3)
    got = w4a16_matmul(nan_canary(x, rows=True), nan_canary(p, rows=True), s, z, 128)
    assert_close(got, w4a16_matmul_ref(x, p, s, z, 128), dtype=torch.float32)


def test_swapped_nibbles_are_caught():
    x, p, s, z = _case(8, 64, 256, 128, torch.float32, seed=4)
    bad = w4a16_matmul(x, p, s, z, 128, _swap_nibbles=True)
    with pytest.raises(MismatchError):
        assert_close(bad, w4a16_matmul_ref(x, p, s, z, 128), dtype=torch.float32)


def test_bad_input():
    x, p, s, z = _case(4, 8, 256, 128, torch.float32)
    with pytest.raises(ValueError, match="group_size=128 does not divide K=192"):
        w4a16_matmul(x[:, :192], p[:, :96], s[:, :1], z[:, :1], 128)
    with pytest.raises(ValueError, match=r"w_packed must be \(N, K / 2\)"):
        w4a16_matmul(x, p[:, :127], s, z, 128)
    with pytest.raises(ValueError, match=r"w_packed must be \(N, K / 2\)"):
        w4a16_matmul(x[:, :255], p, s, z, 128)                                     # odd K cannot be packed
    with pytest.raises(ValueError, match="power of two"):
        w4a16_matmul(x, p, s, z, 96)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_matmul(x, p, s[:, :1], z, 128)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        w4a16_matmul(x, p, s, z.to(torch.int32), 128)
    with pytest.raises(ValueError, match="two codes per byte"):
        w4a16_matmul(x, p.to(torch.int8), s, z, 128)
    with pytest.raises(ValueError, match="x must be a 2-D fp16 or fp32"):
        w4a16_matmul(x.double(), p, s, z, 128)


def test_aot_sm80_sm90_dequantize_into_fp16_tensor_cores_without_spills():
    """Group 128, 64 x 64 x 128 tiles: the unpacked fp16 weights feed HMMA (sm80) and HGMMA (sm90a); no spills."""
    from kernels.inspect import compile_triton_many

    (builds,) = compile_triton_many([aot_job()], archs=("sm80", "sm90"))
    assert builds["sm80"].families("sass")["HMMA"] > 0
    assert builds["sm90"].families("sass")["HGMMA"] > 0
    for b in builds.values():
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0
