"""kernels.gemm ladder, persistent and split-K kernels against torch.matmul; the traffic models;
stream-K's assignment; and the AOT compile of the tiles the launchers choose for real GPUs."""
import math

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.gemm import ladder as L
from kernels.gemm import matmul as mm
from kernels.gemm import persistent as P
from kernels.gemm import splitk as SK
from kernels.testing import MismatchError, assert_close, nan_canary, pinned_triton

DEV = runtime.device()
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(1, 17, 4097), (100, 70, 90), (130, 33, 200)]   # M=1, K=17, N=4097; tails in every dimension


def inputs(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g, dtype=torch.float64).to(DEV, dtype),
            torch.randn(k, n, generator=g, dtype=torch.float64).to(DEV, dtype))


def check(out, a, b):
    """Against the exact product, within twice PyTorch's own error in the same dtype (the reduction rule)."""
    assert_close(out, a.double() @ b.double(), baseline=a @ b, dtype=a.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_grouped_matmul_matches_reference(m, k, n, dtype):
    a, b = inputs(m, k, n, dtype, seed=m + k)
    check(L.matmul(a, b), a, b)


@pytest.mark.parametrize("epilogue", ["relu", "silu"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fused_bias_activation_and_output_dtype(epilogue, out_dtype):
    a, b = inputs(70, 45, 130, torch.float16, seed=3)
    bias = torch.randn(130, dtype=torch.float64).to(DEV, torch.float16)
    out = L.matmul(a, b, bias=bias, epilogue=epilogue, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    tol = torch.float16 if out_dtype == torch.float32 else out_dtype     # one rounding to the output dtype
    assert_close(out, L.matmul_ref(a, b, bias=bias, epilogue=epilogue, out_dtype=out_dtype), dtype=tol)


def test_strided_and_canaried_inputs():
    a = nan_canary(inputs(66, 70, 1, torch.float16)[0], pad=512)
    b = nan_canary(inputs(1, 70, 65, torch.float16, seed=1)[1].t().contiguous(), pad=512).t()   # column-major B
    assert not b.is_contiguous()
    for fn in (L.matmul, P.matmul_persistent, L.matmul_naive):
        check(fn(a, b), a, b)
    check(SK.matmul_splitk(a, b, split_k=3), a, b)


def test_naive_step_matches_reference():
    for m, k, n in [(1, 17, 70), (40, 9, 33)]:
        a, b = inputs(m, k, n, torch.float32, seed=k)
        check(L.matmul_naive(a, b, block=64), a, b)


def test_grouped_order_is_a_permutation_and_the_short_last_band_matters():
    for tm, tn, g in [(5, 3, 2), (9, 4, 8), (1, 7, 8), (16, 16, 8)]:
        order = L.grouped_order(tm, tn, g)
        assert sorted(order) == [(i, j) for i in range(tm) for j in range(tn)]
    assert L.grouped_order(3, 4, 2)[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]   # column by column in a band


def test_broken_tile_mapping_is_caught():
    # 3 tile rows with GROUP_M=4 (interpreter tiles 64x64): the broken map assumes a full band of 4,
    # so some tiles are never written; the output, prefilled with NaN, shows them.
    a, b = inputs(150, 40, 200, torch.float16, seed=5)
    good = L.matmul(a, b, out=torch.full((150, 200), float("nan"), dtype=torch.float16, device=DEV))
    check(good, a, b)
    bad = L.matmul(a, b, out=torch.full((150, 200), float("nan"), dtype=torch.float16, device=DEV), _short_last_group=False)
    with pytest.raises(MismatchError, match="NaN"):
        check(bad, a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_persistent_matches_reference(programs, dtype):
    a, b = inputs(150, 70, 200, dtype, seed=programs)
    check(P.matmul_persistent(a, b, num_programs=programs), a, b)


def test_persistent_schedule_covers_every_tile_once():
    for tiles, progs in [(12, 5), (4096, 132), (3, 8)]:
        sched = P.persistent_schedule(tiles, progs)
        assert sorted(t for s in sched for t in s) == list(range(tiles))
        assert max(map(len, sched)) - min(map(len, sched)) <= 1


def test_broken_persistent_scheduler_is_caught():
    a, b = inputs(150, 40, 200, torch.float16, seed=6)   # 12 tiles over 5 programs: 2 dropped
    nan = lambda: torch.full((150, 200), float("nan"), dtype=torch.float16, device=DEV)
    check(P.matmul_persistent(a, b, num_programs=5, out=nan()), a, b)
    with pytest.raises(MismatchError, match="NaN"):
        check(P.matmul_persistent(a, b, num_programs=5, out=nan(), _all_tiles=False), a, b)


@pytest.mark.parametrize("split_k", [1, 2, 5])
def test_splitk_matches_reference(split_k):
    a, b = inputs(20, 300, 70, torch.float16, seed=split_k)
    check(SK.matmul_splitk(a, b, split_k=split_k), a, b)
    a, b = inputs(1, 17, 65, torch.bfloat16, seed=split_k)          # more splits than K steps: empty splits
    check(SK.matmul_splitk(a, b, split_k=split_k), a, b)


def test_splitk_with_a_floor_chunk_is_caught():
    a, b = inputs(20, 300, 70, torch.float16, seed=9)
    with pytest.raises(MismatchError):
        check(SK.matmul_splitk(a, b, split_k=4, _k_chunk=(300 // 4) // 32 * 32), a, b)   # 64 * 4 < 300


def test_streamk_assignment_and_execution():
    for tiles, iters, sms in [(6, 10, 4), (4096, 64, 132), (64, 64, 132)]:
        segs = SK.streamk_segments(tiles, iters, sms)
        per_tile = [0] * tiles
        for _, t, lo, hi in segs:
            per_tile[t] += hi - lo
        assert per_tile == [iters] * tiles
        work = [0] * sms
        for sm, _, lo, hi in segs:
            work[sm] += hi - lo
        assert max(work) - min(work) <= 1
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(150, 333, generator=g, dtype=torch.float64), torch.randn(333, 70, generator=g, dtype=torch.float64)
    assert_close(SK.streamk_ref(a, b, block_m=64, block_n=64, block_k=32, num_sms=5), a @ b, dtype=torch.float64)
    m = SK.wave_model(64, 64, 132)
    assert m["data_parallel"] == 64 and m["stream_k"] < 40


def test_traffic_models():
    n = 4096
    assert L.l2_bytes("naive", n, n, n) == (2 * n**3 + n * n) * 2
    assert 2 * n**3 / L.l2_bytes("tiled", n, n, n) > 60
    assert L.wave_dram_bytes(n, n, n, group_m=8) < L.wave_dram_bytes(n, n, n, group_m=1)
    with pytest.raises(ValueError, match="unknown step"):
        L.l2_bytes("magic", 1, 1, 1)


@pytest.mark.parametrize("fn", [L.matmul, L.matmul_naive, P.matmul_persistent, SK.matmul_splitk])
@pytest.mark.parametrize("a, b, match", [
    (torch.zeros(3, 4), torch.zeros(5, 2), "inner dimensions"),
    (torch.zeros(3), torch.zeros(3, 2), "2-D"),
    (torch.zeros(2, 3, 4), torch.zeros(4, 2), "2-D"),
    (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32), "dtype"),
    (torch.zeros(3, 4), torch.zeros(4, 2, dtype=torch.float16), "share a dtype"),
    ([[1.0]], torch.zeros(1, 1), "torch.Tensor"),
])
def test_bad_input_is_refused_clearly(fn, a, b, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fn(a, b)


def test_bad_options_are_refused():
    a, b = torch.zeros(3, 4), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="epilogue"):
        L.matmul(a, b, epilogue="gelu")
    with pytest.raises(ValueError, match="bias"):
        L.matmul(a, b, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="num_programs"):
        P.matmul_persistent(a, b, num_programs=0)
    with pytest.raises(ValueError, match="split_k"):
        SK.matmul_splitk(a, b, split_k=0)
    with pytest.raises(ValueError, match="arch"):
        L.tiles_for("sm70")


# ------------------------------------------------------------------------------------------------
# AOT: every launcher's job at Llama-3-70B's sizes, built with launch_job from the launch's own
# arguments (tests/test_inspect_specialization.py checks that derivation against Triton's launch path)

ARCHS = ("sm80", "sm90", "sm100")
TENSOR_CORE = {"sm80": "HMMA", "sm90": "HGMMA", "sm100": "UTCHMMA"}


def gemm_jobs() -> dict:
    return {**L.compile_jobs(), **mm.compile_jobs(), **P.compile_jobs(), **SK.compile_jobs()}


@pytest.fixture(scope="module")
def aot():
    """One subprocess: every compile_jobs() job, the clamped-edge counterexample and the nested persistent loop."""
    jobs = gemm_jobs()
    jobs["clamped"] = L.launch_job(*L.LLAMA3_70B_UP, tiles=L.TILES["sm90"], clamp_edges=True)
    jobs["masked"] = L.launch_job(*L.LLAMA3_70B_UP, tiles=L.TILES["sm90"])
    jobs["persistent nested"] = P.launch_job(*L.LLAMA3_70B_UP, tiles=P.TILES["sm90"], flatten=False)
    jobs["persistent flattened"] = P.launch_job(*L.LLAMA3_70B_UP, tiles=P.TILES["sm90"])
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=ARCHS)))


def test_every_gemm_module_has_compile_jobs_built_from_its_launch():
    jobs = gemm_jobs()
    assert len(jobs) >= 6
    for label, job in jobs.items():
        assert job.attrs is not None and job.grid is not None, label          # derived by launch_job, grid known
        assert job.constexprs.get("stride_ak", 1) == 1                          # contiguous A: unit stride folded


@pytest.mark.parametrize("arch", ARCHS)
def test_aot_jobs_have_no_spills_and_use_the_tensor_cores(aot, arch):
    for label in gemm_jobs():
        build = aot[label][arch]
        if "tiled 128x128x64, 4 warps" in label and arch == "sm80":
            # the start chapter's kernel at 128x128 with its 4 warps: a 128-register accumulator per
            # thread plus the mma.sync fragments does not fit 255 on sm80 (shown in gemm-tiling); a fact of
            # the pinned Triton (Triton 3.6 fits it without spilling)
            assert build.spills > 0 or not pinned_triton()
            continue
        assert build.spills == 0 and build.metadata["stack_bytes"] == 0, (label, arch, build.metadata["registers"])
        if "naive" in label:
            assert build.tensor_core == "-" and build.families()["FFMA" if arch != "sm100" else "FFMA2"] > 0
        else:
            assert build.tensor_core == TENSOR_CORE[arch], (label, arch)
            assert build.async_copies["LDGSTS"] > 0, (label, arch)              # cp.async pipeline, not LDG + STS


def test_the_sm90_tile_is_a_three_stage_pipeline(aot):
    """128x128x64 fp16 is 32 KiB of A + B per stage: 3 buffers on sm90a (wgmma reads shared memory)."""
    assert L.TILES["sm90"][:3] == (128, 128, 64) and L.TILES["sm90"][4:] == (8, 3)
    build = aot["masked"]["sm90"]
    assert build.metadata["num_stages"] == 3 and build.metadata["shared_bytes"] == 3 * 32 * 1024


def test_clamped_edges_take_b_out_of_the_pipeline(aot):
    """The counterexample: clamping B's columns (its unit-stride axis) makes its loads scalar LDG + STS."""
    for arch in ("sm80", "sm90"):
        clamped, masked = aot["clamped"][arch], aot["masked"][arch]
        scalar_sts = lambda b: ki.instructions(b.sass, "sass")["STS.U16"]          # noqa: E731
        assert scalar_sts(clamped) > 0 and scalar_sts(masked) == 0
        assert clamped.async_copies["LDGSTS"] < masked.async_copies["LDGSTS"]
        assert clamped.metadata["shared_bytes"] < masked.metadata["shared_bytes"]


def test_clamped_edges_still_compute_the_right_product():
    a, b = inputs(150, 40, 200, torch.float16, seed=11)
    check(L.matmul(a, b, _clamp_edges=True), a, b)


def test_flattened_tile_loop_overlaps_tiles_on_sm90(aot):
    """A nested tile loop drains its pipeline before each store on sm80 and sm90a; flattened, one
    loop holds the copies, the MMA and the store. sm100a's pipeliner fuses the nest by itself."""
    for arch in ("sm80", "sm90"):
        assert not P.one_loop_over_tiles_and_k(aot["persistent nested"][arch].ttgir)
        assert P.one_loop_over_tiles_and_k(aot["persistent flattened"][arch].ttgir)
        assert "ttg.async_wait" in aot["persistent nested"][arch].ttgir
    assert P.one_loop_over_tiles_and_k(aot["persistent nested"]["sm100"].ttgir)


def test_tile_corners_are_64_bit(aot):
    """row0 * stride_am passes 2**31 at M*K past 2G elements: it is multiplied in 64 bits."""
    job = L.launch_job(*L.LLAMA3_70B_UP, tiles=L.TILES["sm90"])
    runtime_args = [name for name, kind in job.signature.items() if kind != "constexpr"]   # PTX parameter order
    assert 64 in ki.param_product_widths(aot["masked"]["sm90"], runtime_args.index("stride_am"))


# ------------------------------------------------------------------------------------------------
# The CUDA C++ ladder: its SASS here, its numbers on a GPU

from kernels.gemm import cuda_ladder as CL  # noqa: E402
from kernels.ptx import sass as SASS  # noqa: E402


@pytest.fixture(scope="module")
def cuda_ladder_sm80():
    build = ki.compile_cuda("gemm_ladder", arch="sm80")
    return build, {step.kernel: SASS.opcodes(build.sass, step.kernel) for step in CL.STEPS.values()}


def test_cuda_ladder_sass_shows_each_step(cuda_ladder_sm80):
    build, ops = cuda_ladder_sm80
    naive, coalesced = ops["sgemm_naive"], ops["sgemm_coalesced"]
    assert naive == coalesced and naive["LDS"] == 0                      # coalescing is addresses, not instructions
    smem = ops["sgemm_smem"]
    assert smem["BAR.SYNC.DEFER_BLOCKING"] == 2 and smem["STS"] == 2     # stage a tile of A and of B, sync twice
    vec = ops["sgemm_vectorized"]
    assert vec["LDG.E.128"] == 2 and vec["LDS.128"] > 0 and vec["FFMA"] == 8 * 8 * 8   # 8 k steps x 8x8 outer products
    ratio = lambda o: o["FFMA"] / sum(n for op, n in o.items() if op.startswith("LDS"))   # noqa: E731
    assert ratio(ops["sgemm_smem"]) < ratio(ops["sgemm_blocktile_1d"]) < ratio(vec)
    assert all(sum(n for op, n in o.items() if op.split(".")[0] in ("STL", "LDL")) == 0 for o in ops.values())


def test_warp_addresses_show_coalescing():
    lines = lambda addrs: len({a // 128 for a in addrs})                    # noqa: E731  128-byte lines touched
    assert lines(CL.warp_addresses("naive", "A", K=4096, N=4096)) == 32
    assert lines(CL.warp_addresses("coalesced", "B", K=4096, N=4096)) == 1
    assert lines(CL.warp_addresses("coalesced", "A", K=4096, N=4096)) == 1   # one address, broadcast


def test_cuda_ladder_refuses_shapes_it_does_not_tile():
    a = torch.zeros(100, 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        CL.matmul_cuda(a, torch.zeros(64, 128), "2-D blocking, float4")
    with pytest.raises(ValueError, match="step must be one of"):
        CL.matmul_cuda(a, torch.zeros(64, 128), "warp tiling")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA ladder runs only on an NVIDIA GPU")
@pytest.mark.parametrize("step", list(CL.STEPS))
def test_cuda_ladder_matches_torch_on_a_gpu(step):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 384, device="cuda", generator=g)
    b = torch.randn(384, 512, device="cuda", generator=g)
    assert_close(CL.matmul_cuda(a, b, step), a.double() @ b.double(), baseline=a @ b, dtype=torch.float32)
