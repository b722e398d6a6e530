"""kernels.gemm.schedules: the cooperative / ping-pong event model, and the warp-specialized matmul
under the interpreter and in its sm90a build."""
import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.gemm import schedules as S
from kernels.testing import assert_close

DEV = runtime.device()


@pytest.mark.parametrize("tiles, mma, epi", [(8, 1.0, 0.5), (7, 1.0, 0.25), (10, 1.0, 1.0), (1, 2.0, 0.5)])
def test_closed_forms(tiles, mma, epi):
    assert S.makespan(S.simulate("cooperative", tiles, mma, epi)) == pytest.approx(tiles * (mma + epi / 2))
    pp = S.simulate("pingpong", tiles, mma, epi)
    assert S.makespan(pp) == pytest.approx(tiles * mma + epi)          # epilogue hidden under the other group's mma
    assert S.overlapping_mainloops(pp) == 0
    assert S.tensor_core_busy(pp) == pytest.approx(tiles * mma)


def test_pingpong_without_ordered_barrier_is_caught():
    ev = S.simulate("pingpong", 8, 1.0, 0.5, ordered=False)
    assert S.overlapping_mainloops(ev) > 0


def test_bad_parameters():
    with pytest.raises(ValueError, match="schedule"):
        S.simulate("stream", 4, 1.0, 0.5)
    with pytest.raises(ValueError, match="mma"):
        S.simulate("pingpong", 4, 0.0, 0.5)


@pytest.mark.parametrize("m, k, n", [(70, 64, 136), (1, 24, 8), (130, 200, 40)])
def test_matmul_ws_matches_reference(m, k, n):
    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, k, generator=g, dtype=torch.float64).half().to(DEV)
    b = torch.randn(k, n, generator=g, dtype=torch.float64).half().to(DEV)
    assert_close(S.matmul_ws(a, b), a.double() @ b.double(), baseline=a @ b)


def test_matmul_ws_refuses_what_tma_cannot_load():
    with pytest.raises(ValueError, match="16 bytes"):
        S.matmul_ws(torch.zeros(4, 17, dtype=torch.float16), torch.zeros(17, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        S.matmul_ws(torch.zeros(16, 8, dtype=torch.float16).t(), torch.zeros(16, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="share a dtype"):
        S.matmul_ws(torch.zeros(8, 8, dtype=torch.float16), torch.zeros(8, 8))


@pytest.fixture(scope="module")
def ws_builds():
    jobs = {"launch": S.launch_job(4096, 8192, 28672), "8 warps": S.launch_job(4096, 8192, 28672, num_warps=8)}
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90", "sm100"))))


def test_sm90_build_has_a_producer_and_two_consumer_warp_groups(ws_builds):
    """At 4 warps Triton 3.7 builds CUTLASS's cooperative shape on sm90a: a TMA producer group and two
    wgmma consumer groups, each on half of the 128-row tile, with setmaxnreg 40 / 232."""
    b = ws_builds["launch"]["sm90"]
    assert S.partition_roles(b.ttgir) == ["load", "mma", "mma"]
    assert S.setmaxnreg(b.ptx) >= {("dec", 40), ("inc", 232)}
    assert b.families()["UTMALDG"] > 0 and b.tensor_core == "HGMMA" and b.spills == 0


def test_eight_warps_drop_warp_specialization_on_sm90(ws_builds):
    b = ws_builds["8 warps"]["sm90"]
    assert S.partition_roles(b.ttgir) == [] and not S.setmaxnreg(b.ptx)
    assert b.families()["UTMALDG"] > 0 and b.spills == 0                # still TMA, software-pipelined


def test_sm100_build_is_warp_specialized(ws_builds):
    b = ws_builds["launch"]["sm100"]
    assert "mma" in S.partition_roles(b.ttgir) and b.tensor_core == "UTCHMMA" and b.spills == 0
