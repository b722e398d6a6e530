"""CUTLASS's sm90 cooperative and ping-pong GEMMs, compiled with the course's nvcc: the committed
facts (models/cutlass-sm90/facts.json, read by the cutlass-schedulers chapter) are what the compiler
says now. One nvcc run for the module (~30 s of front end); skipped, with the reason, when the
CUTLASS headers (pip nvidia-cutlass) are not installed."""
import pytest

from kernels import inspect as ki
from kernels.gemm import cutlass_sm90 as C


@pytest.fixture(scope="module")
def compiled():
    try:
        C.cutlass_include()
    except ki.ToolMissingError as err:
        pytest.skip(str(err))
    return C.compile_facts()


def test_committed_facts_are_what_nvcc_says(compiled):
    assert compiled == C.load_facts(), "models/cutlass-sm90/facts.json is stale: run `python -m kernels.gemm.cutlass_sm90`"


def test_the_committed_facts_show_both_schedules():
    facts = C.load_facts()["schedules"]
    for schedule in C.SCHEDULES:
        f = facts[schedule]
        assert f["threads"] == 384                                    # one producer + two consumer warp groups
        assert f["setmaxnreg"] == [["dec", 40], ["inc", 232]]         # CUTLASS's Load/MmaRegisterRequirement
        assert 168 * 384 <= 65536 and f["registers_at_launch"] == 168  # 64K registers / 384 threads, rounded down to 8
        assert 40 * 128 + 2 * 232 * 128 <= 65536                      # after setmaxnreg: still the SM's register file
        assert f["wgmma_shapes"] == ["m64n128k16"] and f["HGMMA"] > 0 and f["UTMALDG"] > 0 and f["spills"] == 0
        assert f["shared_bytes"] <= 227 * 1024                        # sm90's opt-in shared memory per block
    assert facts["Cooperative"]["tile"] == [128, 128, 64] and facts["Pingpong"]["tile"] == [64, 128, 64]


def test_the_tiles_are_the_ones_the_source_instantiates():
    text = ki.cuda_source("cutlass_sm90_gemm").read_text()
    for schedule, shape in C._TILES.items():
        assert f"Sm90Gemm<{shape}, cutlass::gemm::KernelTmaWarpSpecialized{schedule}," in text
