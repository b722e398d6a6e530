"""kernels.gemm ladder, persistent and split-K kernels against torch.matmul; the traffic models;
stream-K's assignment; and the AOT compile of the tiles the launchers choose for real GPUs."""
import math

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.gemm import ladder as L
from kernels.gemm import persistent as P
from kernels.gemm import splitk as SK
from kernels.testing import MismatchError, assert_close, nan_canary

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
# AOT: the tiles the launchers pick for real GPUs compile with no spills

INTS = ["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn"]


def _sig(ptrs, dtype="*fp16"):
    return {**{p: dtype for p in ptrs}, **{i: "i32" for i in INTS}}


@pytest.fixture(scope="module")
def aot_builds():
    jobs = []
    for arch in ("sm80", "sm90", "sm100"):
        bm, bn, bk, g, w, st = L.TILES[arch]
        jobs.append(ki.TritonJob(L._matmul_grouped_kernel, _sig(["a_ptr", "b_ptr", "c_ptr", "bias_ptr"]),
                                 constexprs=dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, HAS_BIAS=True,
                                                 EPILOGUE="silu", UPCAST=False, SHORT_LAST_GROUP=True), num_warps=w, num_stages=st))
        bm, bn, bk, g, w, st = P.TILES[arch]
        jobs.append(ki.TritonJob(P._matmul_persistent_kernel, _sig(["a_ptr", "b_ptr", "c_ptr"], "*bf16"),
                                 constexprs=dict(NUM_PROGRAMS=132, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g,
                                                 UPCAST=False, ALL_TILES=True), num_warps=w, num_stages=st))
    builds = ki.compile_triton_many(jobs, archs=("sm80", "sm90", "sm100"))
    return {(arch, kind): builds[2 * i + j][arch] for i, arch in enumerate(("sm80", "sm90", "sm100"))
            for j, kind in enumerate(("grouped", "persistent"))}


@pytest.mark.parametrize("arch, family", [("sm80", "HMMA"), ("sm90", "HGMMA"), ("sm100", "UTCHMMA")])
@pytest.mark.parametrize("kind", ["grouped", "persistent"])
def test_aot_tiles_have_no_spills_and_use_the_tensor_cores(aot_builds, arch, family, kind):
    build = aot_builds[(arch, kind)]
    assert build.spills == 0 and build.metadata["stack_bytes"] == 0, (arch, kind, build.metadata["registers"])
    assert build.families()[family] > 0


def test_the_128x128x64_tile_at_8_warps_is_the_sm90_choice():
    assert L.TILES["sm90"][:3] == (128, 128, 64) and L.TILES["sm90"][4] == 8


def test_splitk_and_naive_kernels_compile_for_sm90():
    naive, split = ki.compile_triton_many([
        ki.TritonJob(L._matmul_naive_kernel, _sig(["a_ptr", "b_ptr", "c_ptr"]), constexprs=dict(BLOCK_M=64, BLOCK_N=64)),
        ki.TritonJob(SK._matmul_splitk_kernel,
                     {"a_ptr": "*fp16", "b_ptr": "*fp16", "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                      "K_CHUNK": "i32", "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32"},
                     constexprs=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, UPCAST=False)),
    ], archs=("sm90",))
    assert naive["sm90"].families()["FFMA"] > 0 and "HGMMA" not in naive["sm90"].families()
    assert split["sm90"].spills == 0 and split["sm90"].families()["HGMMA"] > 0
