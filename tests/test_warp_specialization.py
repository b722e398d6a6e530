"""kernels/gpu/warp_specialize.py and kernels/cuda/warp_specialize.cu: the warp-specialised Triton
matmul (interpreter result, AOT split with setmaxnreg on sm90), the register-split rules, the
timeline model, the CUDA kernel's SASS, and on a GPU the kernel against the reference."""
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


SIG = {"a_desc": "tensordesc<fp16[64, 64]>", "b_desc": "tensordesc<fp16[64, 128]>", "c_ptr": "*fp32",
       "M": "i32", "N": "i32", "K": "i32"}


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


def test_aot_sm90_splits_registers_with_setmaxnreg():
    jobs = [ki.TritonJob(WS._ws_matmul_kernel, SIG, constexprs=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, STAGES=3,
                                                                     SPECIALIZE=s), num_warps=4) for s in (True, False)]
    ws, plain = [r["sm90"] for r in ki.compile_triton_many(jobs, archs=("sm90",))]
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
