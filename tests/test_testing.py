"""kernels.testing: the comparator passes what it should and, above all, fails what it should."""
import math

import pytest
import torch

from kernels.testing import (BorrowedReference, MismatchError, TOLERANCES, assert_close, check_cases, max_error,
                             nan_canary, refusing, tolerance)


def test_equal_tensors_pass_and_rounding_passes():
    x = torch.randn(37, 101)
    assert_close(x, x.clone())
    assert_close(x.half(), x)  # one fp16 rounding is within the fp16 tolerance


def test_one_bad_element_is_reported_with_count_index_and_values():
    expected = torch.zeros(3, 7)
    actual = expected.clone()
    actual[2, 5] = 0.5
    with pytest.raises(MismatchError) as err:
        assert_close(actual, expected, name="k")
    msg = str(err.value)
    assert "1 of 21 elements differ" in msg
    assert "worst finite mismatch at index (2, 5)" in msg and "got 0.5" in msg


def test_worst_index_is_the_largest_excess_not_the_first():
    expected = torch.ones(10)
    actual = expected.clone()
    actual[1] += 1e-3
    actual[8] += 1.0
    with pytest.raises(MismatchError, match=r"worst finite mismatch at index \(8,\)"):
        assert_close(actual, expected)


def test_nan_in_result_only_is_caught():
    expected = torch.ones(5)
    actual = expected.clone()
    actual[3] = float("nan")
    with pytest.raises(MismatchError, match=r"NaN: 1 where the reference is not NaN"):
        assert_close(actual, expected)


def test_missing_nan_is_caught_and_matching_nan_passes():
    expected = torch.tensor([1.0, float("nan")])
    with pytest.raises(MismatchError, match="1 NaN of the reference missing"):
        assert_close(torch.tensor([1.0, 0.0]), expected)
    assert_close(expected.clone(), expected)


def test_inf_sign_must_match():
    expected = torch.tensor([float("inf"), 1.0])
    assert_close(expected.clone(), expected)
    with pytest.raises(MismatchError, match="inf: 1 places"):
        assert_close(torch.tensor([-float("inf"), 1.0]), expected)
    with pytest.raises(MismatchError, match="inf"):
        assert_close(torch.tensor([1e30, 1.0]), expected)


def test_shape_mismatch_is_an_error():
    with pytest.raises(MismatchError, match="shape"):
        assert_close(torch.zeros(3), torch.zeros(1, 3))


def test_tolerance_comes_from_the_table_by_dtype():
    e = torch.ones(4)
    step = 5e-4  # inside fp16's rtol (1e-3), outside fp32's (1e-5)
    assert_close((e + step).half(), e)
    with pytest.raises(MismatchError):
        assert_close(e + step, e)
    assert_close(e + step, e, dtype=torch.float16)
    assert tolerance(torch.int32).atol == 0 and tolerance(torch.float16) is TOLERANCES[torch.float16]


def test_baseline_rule_accepts_a_kernel_as_accurate_as_pytorch_and_rejects_a_worse_one():
    torch.manual_seed(0)
    x = torch.randn(64, 1000)
    ref = torch.softmax(x, -1)  # fp32 reference
    pytorch_fp16 = torch.softmax(x.half(), -1)  # PyTorch's own result in the low dtype
    assert_close(pytorch_fp16, ref, baseline=pytorch_fp16)
    err = max_error(pytorch_fp16, ref)
    worse = ref + 4 * err  # a "kernel" four times worse than PyTorch everywhere
    with pytest.raises(MismatchError, match="baseline rule"):
        assert_close(worse.half(), ref, baseline=pytorch_fp16)


def test_baseline_floor_lets_an_exact_baseline_still_allow_rounding():
    e = torch.linspace(-1, 1, 17)
    assert_close(e.half(), e, baseline=e.clone(), dtype=torch.float16)


def test_nan_canary_flat_places_nan_around_a_contiguous_copy():
    x = torch.arange(12.0).view(3, 4)
    v = nan_canary(x, pad=8)
    assert v.is_contiguous() and torch.equal(v, x)
    base = v.untyped_storage()
    flat = torch.tensor([], dtype=x.dtype).set_(base)
    assert flat.numel() == 12 + 16 and torch.isnan(flat[:8]).all() and torch.isnan(flat[-8:]).all()


def test_nan_canary_rows_pads_each_row():
    x = torch.randn(3, 5)
    v = nan_canary(x, pad=4, rows=True)
    assert torch.equal(v, x) and v.stride() == (13, 1) and not v.is_contiguous()
    assert torch.isnan(v.as_strided((3, 13), (13, 1), v.storage_offset() - 4)[:, :4]).all()


def test_a_read_past_the_end_shows_up_as_nan():
    x = nan_canary(torch.ones(10), pad=4)
    past_end = x.as_strided((12,), (1,), x.storage_offset())  # what an unmasked tail load reads
    with pytest.raises(MismatchError, match="NaN"):
        assert_close(past_end[:12].cumsum(0)[-10:], torch.arange(3.0, 13.0))


def test_nan_canary_keeps_requires_grad_and_handles_integers():
    x = torch.randn(4, requires_grad=True)
    assert nan_canary(x).requires_grad
    ints = nan_canary(torch.arange(5, dtype=torch.int32), pad=2)
    assert torch.equal(ints, torch.arange(5, dtype=torch.int32))
    with pytest.raises(ValueError):
        nan_canary(x, pad=0)


def test_check_cases_names_the_failing_case():
    good = check_cases(torch.exp, torch.exp, [torch.zeros(2), (torch.ones(3),)])
    assert good == 2
    wrong = lambda x: torch.exp(x) + (x.numel() > 2)  # noqa: E731 - wrong only on the second case
    with pytest.raises(MismatchError, match=r"case 1 \(inputs \(3,\)\)"):
        check_cases(wrong, torch.exp, [torch.zeros(2), torch.ones(3)])
    with pytest.raises(MismatchError, match="expected two tensors"):
        check_cases(lambda x: None, torch.exp, [torch.zeros(2)])


def test_a_function_that_is_the_reference_itself_is_refused():
    """`from kernels.x import f` in the task cell binds the learner's name to the reference: check_cases is
    handed the reference itself, which no rebinding of names can refuse; `own` compares the function
    (and what it wraps) with the references first."""
    import functools

    from kernels.kvcache import eviction

    for borrow in (eviction.streaming_keep, functools.partial(eviction.streaming_keep)):
        with pytest.raises(BorrowedReference, match=r"your function is the course's reference "
                                                    r"kernels\.kvcache\.eviction\.streaming_keep; write it yourself"):
            check_cases(borrow, eviction.streaming_keep, [(32, 8, 4)], refuse=[eviction.streaming_keep])
    with pytest.raises(BorrowedReference, match=r"your function is torch\.softmax"):
        check_cases(torch.softmax, torch.softmax, [(torch.randn(2, 3), -1)], refuse=["torch.softmax"])
    written = lambda P, b, s: torch.cat([torch.arange(s), torch.arange(P - b + s, P)])   # noqa: E731
    assert check_cases(written, eviction.streaming_keep, [(32, 8, 4)], refuse=[eviction.streaming_keep]) == 1


def test_a_library_function_that_is_the_answer_is_refused_under_each_name_given_then_restored():
    x = torch.randn(3, 5)
    names = ["torch.softmax", "torch.nn.functional.softmax", "torch.Tensor.softmax"]
    for borrow in (lambda x: torch.softmax(x, -1), lambda x: torch.nn.functional.softmax(x, -1), lambda x: x.softmax(-1)):
        with pytest.raises(BorrowedReference, match=r"your function calls torch\.(nn\.functional\.|Tensor\.)?softmax, "
                                                    r"which computes this task's answer in one call; write it yourself"):
            check_cases(borrow, lambda x: torch.softmax(x, -1), [x], refuse=names)
    assert check_cases(lambda x: torch.exp(x) / torch.exp(x).sum(-1, keepdim=True), lambda x: torch.softmax(x, -1), [x],
                       refuse=names) == 1                     # written out, it passes
    assert "softmax" not in vars(torch.Tensor)                   # the method is the base class's again
    assert torch.allclose(x.softmax(-1), torch.nn.functional.softmax(x, -1))
    with pytest.raises(ValueError, match="names no importable function"):
        with refusing(["no_such_module.f"]):
            pass


def test_max_error_ignores_matching_non_finite_values():
    a = torch.tensor([1.0, math.inf, 2.0])
    assert max_error(a, torch.tensor([1.5, math.inf, 2.0])) == 0.5


def test_stable_digits_prints_only_digits_every_cpu_agrees_on():
    from kernels.testing import stable_digits

    assert stable_digits(1.6263, 2) == "1.63" and stable_digits(-0.4212, 1) == "-0.4"
    with pytest.raises(AssertionError, match="rounding boundary"):
        stable_digits(1.62500003, 2)                 # 1.625 +- a last bit: 1.62 on one CPU, 1.63 on another
    with pytest.raises(AssertionError):
        stable_digits(float("nan"), 2)
    with pytest.raises(ValueError, match="digits and margin"):
        stable_digits(1.0, -1)


class _FakeKernel:
    """kernel[grid](out): fills out with 1, as a Triton launch would write it."""

    def __getitem__(self, grid):
        return lambda out: out.fill_(1.0)


_fake_kernel = _FakeKernel()


def _launches(n):
    out = torch.empty(n)
    _fake_kernel[(1,)](out)
    return out


def _no_launch(n):
    return torch.ones(n)


def test_launching_refuses_a_launcher_that_computes_in_pytorch_and_restores_the_kernel():
    from kernels.testing import launching

    assert check_cases(launching(_launches, "_fake_kernel"), torch.ones, [3]) == 1
    with pytest.raises(MismatchError, match="_no_launch never launched _fake_kernel: the result must come from your Triton kernel"):
        check_cases(launching(_no_launch, "_fake_kernel"), torch.ones, [3])
    assert isinstance(_fake_kernel, _FakeKernel)                 # the stand-in is gone after the call
