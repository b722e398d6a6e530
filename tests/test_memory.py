"""kernels/memory: the Triton copy kernel, its bandwidth benchmark, and the roofline counts."""
import pytest
import torch

import kernels  # noqa: F401
from kernels import bench, runtime
from kernels.gpu import hardware as hw
from kernels.gpu import copy as copy_mod
from kernels.gpu import roofline as rl
from kernels.testing import MismatchError, assert_close, nan_canary

_SKIP_CPU = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: bandwidth is only measured on a GPU")


def GPU(fn):
    return pytest.mark.gpu(_SKIP_CPU(fn))
DEV = runtime.device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,block", [(1, 1024), (1000, 1024), (3001, 1024), (5000, 2048), (4096, 1024)])
def test_copy_awkward_sizes(dtype, n, block):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEV)
    assert_close(copy_mod.copy(x, block=block), copy_mod.copy_ref(x), name=f"copy n={n}")


def test_copy_keeps_shape_and_special_values():
    x = torch.randn(7, 13, 5).to(DEV)
    x[0, 0, 0], x[1, 2, 3], x[6, 12, 4] = float("inf"), float("-inf"), float("nan")
    y = copy_mod.copy(x, block=256)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(x)) and torch.isnan(y[6, 12, 4])


def test_copy_of_a_view_inside_nan_canaries():
    x = nan_canary(torch.randn(2500).to(DEV), pad=64)
    y = copy_mod.copy(x, block=1024)
    assert not torch.isnan(y).any()
    assert torch.equal(y, x)


def test_copy_empty():
    assert copy_mod.copy(torch.empty(0, device=DEV)).numel() == 0


def test_a_grid_that_drops_the_tail_is_caught(monkeypatch):
    x = torch.randn(3000).to(DEV)
    monkeypatch.setattr(copy_mod.triton, "cdiv", lambda a, b: a // b)      # broken: floor, not ceiling
    monkeypatch.setattr(copy_mod.torch, "empty_like", lambda t: torch.full_like(t, float("nan")))
    with pytest.raises(MismatchError):
        assert_close(copy_mod.copy(x, block=1024), copy_mod.copy_ref(x), name="copy without its tail")


def test_copy_bad_inputs():
    with pytest.raises(ValueError, match="contiguous"):
        copy_mod.copy(torch.randn(8, 8).t().to(DEV))
    with pytest.raises(TypeError, match="torch.Tensor"):
        copy_mod.copy([1.0, 2.0])
    with pytest.raises(ValueError, match="power of two"):
        copy_mod.copy(torch.randn(8).to(DEV), block=100)


def test_bench_refuses_on_cpu():
    if runtime.runtime().on_gpu:
        pytest.skip("on a GPU the benchmark runs (see test_bench_copy_on_gpu)")
    with pytest.raises(bench.NoGPUError):
        copy_mod.bench_copy(sizes=(1024,), record=False)


@GPU
def test_bench_copy_on_gpu():
    rows = copy_mod.bench_copy(sizes=(2**24,), record=False)
    peak = hw.gpu({"sm80": "A100", "sm90": "H100", "sm100": "B200", "sm120": "RTX5090"}.get(
        "sm%d%d" % torch.cuda.get_device_capability(), "H100"))
    # a copy cannot beat the datasheet bandwidth of the fastest GPU in the table
    assert 0 < rows[0]["gbs"] <= max(g.hbm_bandwidth_gbs for g in hw.GPUS.values())
    assert rows[0]["bytes"] == 2 * 2**24 * 2 and peak.hbm_bandwidth_gbs > 0


def test_roofline_counts():
    f, b = rl.matmul_counts(4096, 4096, 4096)
    assert rl.intensity((f, b)) == pytest.approx(4096 / 3)
    assert rl.intensity(rl.softmax_counts(4096, 4096)) == pytest.approx(5 / 4)
    assert rl.intensity(rl.rmsnorm_counts(4096, 4096)) == pytest.approx(1.0, rel=1e-3)
    # on the H100 in fp16: softmax is memory-bound, a 4096^3 matmul compute-bound
    h = hw.gpu("H100")
    assert rl.intensity(rl.softmax_counts(4096, 4096)) < hw.ridge_point(h, "fp16") < rl.intensity((f, b))


# ---- the strided copy: coalescing ------------------------------------------------------------


@pytest.mark.parametrize("n,stride", [(1, 1), (3001, 1), (3001, 16), (100, 7), (17, 32)])
def test_strided_copy_matches_reference(n, stride):
    x = nan_canary(torch.randn(n).to(DEV), pad=64)
    y = copy_mod.strided_copy(x, stride, block=256)
    assert y.shape == (-(-n // stride),) and not torch.isnan(y).any()
    assert torch.equal(y, copy_mod.strided_copy_ref(x, stride))


def test_strided_copy_bad_inputs():
    with pytest.raises(ValueError, match="stride must be an int >= 1"):
        copy_mod.strided_copy(torch.randn(8).to(DEV), 0)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        copy_mod.strided_copy(torch.randn(4, 4).to(DEV), 2)


def test_a_stride_ignored_is_caught():
    """Reading x[i] instead of x[i * stride] (a launch that passed stride 1) gives another tensor."""
    x = torch.randn(320).to(DEV)
    with pytest.raises(MismatchError):
        assert_close(copy_mod.strided_copy(x[:20].contiguous(), 1), copy_mod.strided_copy_ref(x, 16))


def test_sass_shows_the_coalesced_and_the_strided_loads():
    """The launch specialises stride 1 to a constant: 16-byte vector loads (LDG.E.128); stride 16
    stays a runtime value: one 2-byte load per element (LDG.E.U16), each in its own sector."""
    from kernels import inspect as ki
    jobs = copy_mod.compile_jobs()
    labels = ["strided copy of 2**29 fp16, stride 1", "strided copy of 2**29 fp16, stride 16"]
    builds = ki.compile_triton_many([jobs[k] for k in labels], archs=("sm90",))
    unit, strided = (ki.instructions(b["sm90"].sass, "sass") for b in builds)
    assert "stride: =1" in jobs[labels[0]].specialization()
    assert unit["LDG.E.128"] >= 1 and not any(op.startswith("LDG.E.U16") for op in unit)
    assert strided["LDG.E.U16"] >= 1 and not any(op.startswith("LDG.E.128") for op in strided)
    # per warp instruction: 32 threads x 16 contiguous bytes = 16 sectors; 32 threads x 2 bytes, 32 bytes apart = 32 sectors
    assert hw.warp_sectors([16 * t for t in range(32)], 16) == 16
    assert hw.warp_sectors([2 * 16 * (8 * t) for t in range(32)], 2) == 32
