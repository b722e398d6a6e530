"""kernels/gpu/warp_specialize.py and kernels/cuda/warp_specialize.cu: the warp-specialised Triton
matmul (interpreter result, AOT split with setmaxnreg on sm90), the register-split rules, the
timeline model, the CUDA kernel's SASS, and on a GPU the kernel against the reference."""
import re

import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.gpu import warp_specialize as WS
from kernels.ptx import sass as S
from kernels.testing import assert_close, nan_canary

_SKIP = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: the kernels are compiled and their "
                           "SASS asserted on the CPU, but launching them needs a driver and an sm90+ device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP(fn))


def halves(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).half()


@pytest.mark.parametrize("shape", [(100, 200, 136), (64, 64, 128), (7, 24, 8), (130, 72, 264)])
def test_ws_matmul_matches_the_reference(shape):
    M, K, N = shape
    a, b = halves((M, K), M), halves((K, N), N)
    assert_close(WS.ws_matmul(a, b), a.double() @ b.double(), dtype=torch.float32, baseline=WS.ws_matmul_ref(a, b))


def test_ws_matmul_reads_views_inside_canaries():
    a, b = halves((70, 88), 1), halves((88, 40), 2)
    av, bv = nan_canary(a, rows=True), nan_canary(b, rows=True)
    if (av.stride(0) * 2) % 16 or (bv.stride(0) * 2) % 16:
        pytest.skip("the canary buffer's row stride is not TMA-aligned")
    assert_close(WS.ws_matmul(av, bv), a.double() @ b.double(), dtype=torch.float32, baseline=WS.ws_matmul_ref(a, b))


def test_nan_padding_is_a_caught_broken_variant():
    a, b = halves((64, 104), 3), halves((104, 128), 4)       # K = 104: the second K block runs past the edge
    bad = WS.ws_matmul(a, b, padding="nan")
    assert torch.isnan(bad).all()
    assert not torch.isnan(WS.ws_matmul(a, b)).any()


def test_ws_matmul_bad_inputs():
    with pytest.raises(ValueError, match="a must be a 2-D float16"):
        WS.ws_matmul(torch.zeros(8, 8), torch.zeros(8, 8).half())
    with pytest.raises(ValueError, match="inner dimensions differ"):
        WS.ws_matmul(torch.zeros(8, 16).half(), torch.zeros(24, 8).half())
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        WS.ws_matmul(torch.zeros(8, 12).half(), torch.zeros(12, 8).half())


@pytest.fixture(scope="module")
def ws_builds():
    """The launch's AOT builds (WS.compile_jobs: 128- and 64-row tiles, specialised and plain) for
    sm90, and the specialised 128-row launch for sm100: two compile calls, both cached on disk."""
    jobs = WS.compile_jobs()
    builds = {label: r["sm90"] for label, r in zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",)))}
    builds["sm100"] = ki.compile_triton_many([jobs["128x128x64 warp-specialized"]], archs=("sm100",))[0]["sm100"]
    return builds


def hgmma(build):
    return sum(n for op, n in ki.instructions(build.sass, "sass").items() if op.startswith("HGMMA"))


def test_aot_sm90_splits_registers_with_setmaxnreg(ws_builds):
    ws, plain = ws_builds["128x128x64 warp-specialized"], ws_builds["128x128x64 plain loop"]
    assert ws.metadata["num_warps"] == 12 and plain.metadata["num_warps"] == 4   # producer + 2 consumer partitions
    assert ws.spills == 0 and plain.spills == 0
    ptx = {ln.split()[-1].rstrip(";") for ln in ws.ptx.splitlines() if "setmaxnreg.dec" in ln}
    assert "40" in ptx and any("setmaxnreg.inc" in ln and "232" in ln for ln in ws.ptx.splitlines())
    ops = ki.instructions(ws.sass, "sass")
    assert ops["USETMAXREG.DEALLOC.CTAPOOL"] >= 1 and ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] >= 1
    assert ops["UTMALDG.2D"] >= 2 and ops["HGMMA.64"] >= 1
    assert ki.instructions(plain.sass, "sass")["USETMAXREG.DEALLOC.CTAPOOL"] == 0
    regs = ws.metadata["registers"]
    assert 384 * regs == 128 * 40 + 256 * 232 == 64512                # the split conserves the pool
    # the idle and outside-the-region budgets: workers wait at 120, the default group holds 256
    assert 128 * 256 + 256 * 120 <= 384 * regs


def test_128_row_tile_is_split_between_the_consumers(ws_builds):
    """Each consumer's wgmma covers 64 of the 128 rows, from its own A buffer (the producer loads the
    two halves); both read the one B tile; the tensor-core work equals the plain build's."""
    ws, plain = ws_builds["128x128x64 warp-specialized"], ws_builds["128x128x64 plain loop"]
    dots = WS.consumer_dots(ws.ttgir)
    assert [(d.m, d.n, d.k) for d in dots] == [(64, 128, 64)] * 2
    assert dots[0].a_buffer != dots[1].a_buffer and dots[0].b_buffer == dots[1].b_buffer
    listing = WS.partition_listing(ws.ttgir)
    assert "default: TMA load  a[pid_m*128, k*64] -> " + dots[0].a_buffer in listing
    assert "default: TMA load  a[pid_m*128 + 64, k*64] -> " + dots[1].a_buffer in listing
    assert "partition1: TMA store c[pid_m*128 + 64, pid_n*128]" in listing
    assert hgmma(ws) == hgmma(plain) == 8


def test_64_row_tile_replicates_the_consumer(ws_builds):
    """The check above catches a build that does not divide the tile: at 64 rows Triton 3.7.1 gives
    both consumers the same A buffer and the same output rows, and the SASS has twice the plain HGMMA."""
    ws, plain = ws_builds["64x128x64 warp-specialized"], ws_builds["64x128x64 plain loop"]
    dots = WS.consumer_dots(ws.ttgir)
    assert len(dots) == 2 and dots[0].a_buffer == dots[1].a_buffer and dots[0].m == 64
    assert hgmma(ws) == 2 * hgmma(plain) == 8
    stores = [ln.split(": ", 1)[1] for ln in WS.partition_listing(ws.ttgir) if "TMA store" in ln]
    assert stores == ["TMA store c[pid_m*64, pid_n*128]"] * 2


def test_sm100_split_is_a_load_warp_an_mma_warp_and_the_epilogue(ws_builds):
    """Blackwell: the accumulator lives in TMEM, one MMA warp issues tcgen05.mma, a load warp issues
    TMA, and the kernel's own 4 warps read TMEM in the epilogue after the region."""
    from kernels.gemm.schedules import partition_roles, setmaxnreg

    b = ws_builds["sm100"]
    assert partition_roles(b.ttgir) == ["other", "mma", "load"]
    assert re.search(r"partition0\(.*num_warps\(1\)", b.ttgir) and re.search(r"partition1\(.*num_warps\(2\)", b.ttgir)
    assert b.metadata["num_warps"] == 8 and b.metadata["tmem_columns"] >= 128 and b.spills == 0
    assert ("dec", 24) in setmaxnreg(b.ptx) and b.tensor_core == "UTCHMMA"
    assert "ttng.tmem_load" in b.ttgir.split("ttg.warp_specialize(")[1].split("} : (")[1]   # after the region


def test_register_split_rules():
    s = WS.register_split(40, 232)
    assert s.total == 64512
    with pytest.raises(ValueError, match="multiple of 8 from 24 to 256"):
        WS.register_split(36, 232)
    with pytest.raises(ValueError, match="multiple of 8"):
        WS.register_split(16, 232)
    with pytest.raises(ValueError, match="exceed the 65536"):
        WS.register_split(40, 248)


def test_timeline_specialised_matches_plain_when_issuing_is_free():
    for stages in (1, 2, 3, 5):
        a = WS.timeline(20, load=1500, compute=1000, issue=0, stages=stages, specialized=True)
        b = WS.timeline(20, load=1500, compute=1000, issue=0, stages=stages, specialized=False)
        assert a.computes == b.computes
    assert WS.timeline(20, load=1500, compute=1000, issue=300, stages=3).total < \
        WS.timeline(20, load=1500, compute=1000, issue=300, stages=3, specialized=False).total


def test_timeline_steady_state():
    t = WS.timeline(40, load=1500, compute=1000, issue=0, stages=3)
    period = t.computes[-1][0] - t.computes[-2][0]
    assert period == 1000                                          # compute-bound: load / stages < compute
    t = WS.timeline(40, load=4000, compute=1000, issue=0, stages=2)
    assert t.computes[-1][0] - t.computes[-3][0] == 5000           # latency-bound: stages tiles per load + compute
    p = WS.timeline(40, load=1500, compute=1000, issue=300, stages=3, specialized=False)
    assert p.computes[20][0] - p.computes[19][0] == 1300           # plain warps pay the issue every tile
    with pytest.raises(ValueError):
        WS.timeline(0, load=1, compute=1, issue=0)


@pytest.fixture(scope="module")
def builds():
    return {arch: ki.compile_cuda("warp_specialize", arch=arch) for arch in ("sm90", "sm100")}


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_cuda_sass_has_the_register_split(builds, arch):
    b = builds[arch]
    assert b.metadata["resources"]["ws_ring_sums"]["REG"] == 168
    lines = [ln for ln in S.split_functions(b.sass)["ws_ring_sums"].splitlines() if "USETMAXREG" in ln]
    assert any("DEALLOC.CTAPOOL 0x28" in ln for ln in lines)        # setmaxnreg.dec 40
    assert any("TRY_ALLOC.CTAPOOL" in ln and "0xe8" in ln for ln in lines)   # setmaxnreg.inc 232
    ops = S.opcodes(b.sass, "ws_ring_sums")
    assert ops["UBLKCP.S.G"] >= 1 and ops["SYNCS.PHASECHK.TRANS64.TRYWAIT"] >= 2 and ops["SYNCS.EXCH.64"] == 8


def test_setmaxnreg_needs_sm90():
    with pytest.raises(ki.CompileError, match="requires .target sm_90"):
        ki.compile_cuda("warp_specialize", arch="sm80")


@GPU
@pytest.mark.parametrize("n_tiles", [1, 5, 17])
def test_gpu_ws_ring_sums(n_tiles):
    from kernels import cuda_launch

    mod = cuda_launch.load("warp_specialize")
    x = torch.randn(n_tiles, 2048, device="cuda")
    out = torch.empty(n_tiles, device="cuda")
    mod.launch("ws_ring_sums", 1, 384, x, out, n_tiles)
    assert_close(out.cpu(), x.cpu().double().sum(1), dtype=torch.float32, baseline=x.cpu().sum(1))


@GPU
def test_gpu_ws_matmul():
    a, b = halves((300, 520), 5).cuda(), halves((520, 260), 6).cuda()
    assert_close(WS.ws_matmul(a, b).cpu(), a.cpu().double() @ b.cpu().double(), dtype=torch.float32,
                 baseline=WS.ws_matmul_ref(a, b).cpu())
