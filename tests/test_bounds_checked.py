"""kernels.testing.bounds_checked: under Triton's interpreter, a lane that a mask leaves on must address
an element of one of the launch's tensors. In-bounds kernels pass, a stray unmasked load or store is
caught (and not performed), a masked-off lane is never flagged, whatever address it holds."""
import kernels  # noqa: F401  (before triton)
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from kernels import runtime
from kernels.testing import MismatchError, OutOfBounds, bounds_checked, check_cases, nan_canary

pytestmark = [
    pytest.mark.skipif(runtime.runtime().on_gpu, reason="the bounds check hooks Triton's interpreter (CPU runs)"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]
BLOCK = 64


@triton.jit
def sums_masked(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, axis=0))


@triton.jit
def sums_masked_after_load(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)                                  # the stray lanes are zeroed only afterwards
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.where(offs < n, x, 0.0), axis=0))


@triton.jit
def far_masked_off(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    far = tl.where(offs < n, offs, offs + (1 << 30))           # masked-off lanes point 4 GiB past x
    tl.store(out_ptr + offs, tl.load(x_ptr + far, mask=offs < n, other=1.0), mask=offs < n)


@triton.jit
def copy_unmasked(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def rows_unmasked(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * stride + cols)      # lanes cols >= n fall between the rows
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.where(cols < n, x, 0.0), axis=0))


def block_sums(kernel):
    def run(x):
        out = torch.empty(triton.cdiv(x.numel(), BLOCK))
        kernel[(out.numel(),)](x, out, x.numel(), BLOCK=BLOCK)
        return out
    return run


def block_sums_ref(x):
    return torch.nn.functional.pad(x, (0, (-x.numel()) % BLOCK)).view(-1, BLOCK).sum(1)


def test_an_in_bounds_kernel_passes_and_leaves_no_report():
    cases = [(nan_canary(torch.randn(n)),) for n in (64, 100, 1)]
    assert check_cases(block_sums(sums_masked), block_sums_ref, cases) == 3
    with bounds_checked() as lanes:
        block_sums(sums_masked)(torch.randn(100))
    assert lanes.report is None


@pytest.mark.parametrize("canary", [True, False])
def test_an_unmasked_load_whose_lanes_are_never_used_is_caught(canary):
    x = torch.randn(100)
    case = [(nan_canary(x) if canary else x,)]
    assert torch.allclose(block_sums(sums_masked_after_load)(case[0][0]), block_sums_ref(x))   # right sums: values cannot tell
    with pytest.raises(OutOfBounds, match=r"the result is right, but lane 36 of your tl\.load in sums_masked_after_load, "
                                          r"line \d+ \(`x = tl\.load\(x_ptr \+ offs\)`\), program 1, reads element 100 of "
                                          r"x_ptr, past its end \(x_ptr holds 100 elements\); 28 of its 64 lanes"):
        check_cases(block_sums(sums_masked_after_load), block_sums_ref, case)


def test_a_masked_off_lane_is_never_flagged_wherever_it_points():
    x, out = torch.randn(10), torch.zeros(BLOCK)
    with bounds_checked() as lanes:
        far_masked_off[(1,)](x, out, 10, BLOCK=BLOCK)
    assert lanes.report is None and torch.equal(out[:10], x)


def test_stray_lanes_are_not_accessed_loads_read_poison_and_stores_are_skipped():
    buf = torch.full((2 * BLOCK,), 7.0)
    x, out = buf[:40], torch.zeros(BLOCK)                      # x's neighbours hold 7, not NaN
    with bounds_checked() as lanes:
        copy_unmasked[(1,)](x, out, BLOCK=BLOCK)
    assert torch.equal(out[:40], x) and out[40:].isnan().all()   # stray lanes read NaN, not the 7s beside x
    assert "lane 40 of your tl.load" in lanes.report
    ints, got = torch.arange(40, dtype=torch.int32), torch.zeros(BLOCK, dtype=torch.int32)
    with bounds_checked():
        copy_unmasked[(1,)](ints, got, BLOCK=BLOCK)
    assert (got[40:] == torch.iinfo(torch.int32).min).all()
    dst = torch.full((2 * BLOCK,), float("nan"))
    with bounds_checked() as lanes:
        copy_unmasked[(1,)](torch.randn(BLOCK), dst[:40], BLOCK=BLOCK)
    assert dst[40:].isnan().all(), "a stray lane of a store was written"
    assert "lane 40 of your tl.store" in lanes.report and "writes element 40 of out_ptr, past its end" in lanes.report


def test_a_read_between_the_rows_of_a_strided_view_is_caught():
    x = nan_canary(torch.randn(3, 40), pad=16, rows=True)      # rows 72 apart, 40 elements each
    with bounds_checked() as lanes:
        rows_unmasked[(3,)](x, torch.empty(3), 40, x.stride(0), BLOCK=BLOCK)
    assert "reads column 40 of a row of x_ptr, past the row's end (40 columns; the row stride 72" in lanes.report


def test_a_wrong_result_carries_the_stray_lane_in_its_report_and_the_hooks_come_off():
    wrong = lambda x: block_sums(sums_masked_after_load)(x) + 1   # noqa: E731
    with pytest.raises(MismatchError, match=r"(?s)elements differ.*out of bounds: lane 36 of your tl\.load"):
        check_cases(wrong, block_sums_ref, [(torch.randn(100),)])
    assert interpreter.InterpreterBuilder.create_masked_load.__name__ == "create_masked_load"
    assert interpreter.GridExecutor._init_args_hst.__name__ == "_init_args_hst"
