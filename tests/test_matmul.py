"""kernels.gemm.matmul: the tiled kernel against the fp32 reference."""
import pytest
import torch
from kernels import runtime
from kernels.gemm import matmul as mm
from kernels.testing import MismatchError, assert_close, nan_canary

DEV = runtime.device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (3, 7, 5), (100, 70, 90), (64, 64, 64), (130, 33, 65)])
def test_matmul_matches_reference(m, k, n, dtype):
    torch.manual_seed(m * 1000 + k * 10 + n)
    a = torch.randn(m, k, device=DEV, dtype=dtype)
    b = torch.randn(k, n, device=DEV, dtype=dtype)
    out = mm.matmul(a, b, block_m=32, block_n=32, block_k=32)
    assert out.dtype == dtype
    # A K-long dot product is a reduction: judge it by the baseline rule against an exact
    # (float64) product, with PyTorch's own product in the same dtype as the baseline.
    exact = a.double() @ b.double()
    assert_close(out, exact, baseline=a @ b, dtype=dtype)
    if dtype == torch.float16:
        assert_close(out, mm.matmul_ref(a, b))  # and one fp16 rounding from the fp32 reference


def test_transposed_and_canaried_inputs():
    torch.manual_seed(1)
    a = nan_canary(torch.randn(45, 70, device=DEV))
    b = nan_canary(torch.randn(33, 70, device=DEV)).t()  # a strided view: column-major B
    assert_close(mm.matmul(a, b, block_m=32, block_n=32, block_k=32), a.double() @ b.double(), baseline=a @ b)


def test_a_kernel_missing_its_k_mask_is_caught_by_the_canaries():
    torch.manual_seed(2)
    # K = 45 with BLOCK_K = 32: the second K step reads 19 columns past each row of A and 19 rows
    # past the end of B; a pad of 1024 elements keeps every stray read inside the NaN canary.
    a, b = nan_canary(torch.randn(40, 45, device=DEV), pad=1024), nan_canary(torch.randn(45, 40, device=DEV), pad=1024)
    broken = mm.matmul_no_k_mask(a, b, block_m=32, block_n=32, block_k=32)
    with pytest.raises(MismatchError, match="NaN"):
        assert_close(broken, a.double() @ b.double(), baseline=a @ b)
    # With K a multiple of BLOCK_K the same kernel is right: the bug hides on friendly shapes.
    a64, b64 = torch.randn(40, 64, device=DEV), torch.randn(64, 40, device=DEV)
    assert_close(mm.matmul_no_k_mask(a64, b64, block_m=32, block_n=32, block_k=32), a64.double() @ b64.double(), baseline=a64 @ b64)


@pytest.mark.parametrize("a, b, match", [
    (torch.zeros(3, 4), torch.zeros(5, 2), "inner dimensions"),
    (torch.zeros(3), torch.zeros(3, 2), "2-D"),
    (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32), "dtype"),
    (torch.zeros(3, 4), torch.zeros(4, 2, dtype=torch.float16), "share a dtype"),
    ([[1.0]], torch.zeros(1, 1), "torch.Tensor"),
])
def test_bad_input_is_refused_clearly(a, b, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mm.matmul(a, b)
