"""kernels/ptx/tma.py and kernels/cuda/tma.cu: tensor-map rules, boxes with out-of-bounds fill, the
swizzled shared-memory image read back through a wgmma descriptor, multicast, the Triton tensor
descriptor (interpreter and AOT), the SASS per target, and on a GPU the kernel against the emulation."""
import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.ptx import probe as P
from kernels.ptx import sass as S
from kernels.ptx import tma as T
from kernels.ptx import wgmma as W
from kernels.ptx.mbarrier import MBarrier
from kernels.testing import nan_canary

_SKIP_CPU = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: tma.cu is compiled and its SASS "
                               "asserted on the CPU, but launching it needs a driver and an sm90+ device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP_CPU(fn))


def halves(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).half()


# ---------------------------------------------------------------------------------------------
# Tensor maps: the driver's rules


def test_encode_tiled_arguments_are_innermost_first():
    x = halves((100, 72), 0)
    args = T.encode_tiled(x, (64, 32), swizzle="64B", oob_fill="nan", address=4096).arguments()
    assert args == {"tensorDataType": 6, "tensorRank": 2, "globalAddress": 4096, "globalDim": [72, 100],
                    "globalStrides": [144], "boxDim": [32, 64], "elementStrides": [1, 1], "interleave": 0,
                    "swizzle": 2, "l2Promotion": 0, "oobFill": 1}


@pytest.mark.parametrize("kwargs, match", [
    (dict(box=(64, 300)), "boxDim sides must be 1..256"),
    (dict(box=(64, 4)), "multiple of 16 bytes"),
    (dict(box=(8, 128), swizzle="128B"), "inner side <= 128"),
    (dict(box=(8, 64), swizzle="32B"), "inner side <= 32"),
    (dict(box=(8, 64), address=8), "16-byte aligned"),
    (dict(box=(8, 64), swizzle="256B"), "swizzle must be one of"),
    (dict(box=(8,)), "one size per dimension"),
])
def test_encode_tiled_refuses_what_the_driver_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        T.encode_tiled(halves((100, 256), 1), **kwargs)


def test_encode_tiled_refuses_unaligned_strides_and_nan_fill_for_integers():
    with pytest.raises(ValueError, match="globalStrides"):
        T.encode_tiled(torch.zeros(10, 12, dtype=torch.float16), (8, 8), address=0)   # 24-byte rows
    with pytest.raises(ValueError, match="floating-point"):
        T.encode_tiled(torch.zeros(8, 16, dtype=torch.int32), (8, 4), oob_fill="nan", address=0)


# ---------------------------------------------------------------------------------------------
# Boxes


@pytest.mark.parametrize("coords", [(0, 0), (40, 50), (64, 96), (-8, -5), (200, 0), (0, 100)])
@pytest.mark.parametrize("fill", ["zero", "nan"])
def test_load_box_reads_inside_and_fills_outside(coords, fill):
    x = halves((100, 72), 3)
    tm = T.encode_tiled(x, (32, 16), oob_fill=fill, address=0)
    box = T.load_box(tm, x, coords)
    c, r = coords
    want = torch.full((32, 16), float("nan") if fill == "nan" else 0.0, dtype=x.dtype)
    for i in range(32):
        for j in range(16):
            if 0 <= r + i < 100 and 0 <= c + j < 72:
                want[i, j] = x[r + i, c + j]
    assert torch.equal(box.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
def test_swizzled_box_reads_back_through_a_wgmma_descriptor(mode):
    cols = 16 if mode == "none" else W.SWIZZLE_WIDTH[mode] // 2
    x = halves((80, cols), 4)
    tm = T.encode_tiled(x, (64, cols), swizzle=mode, address=0)
    smem = torch.zeros(16384, dtype=torch.uint8)
    bar = MBarrier(1)
    bar.arrive_expect_tx(tm.box_bytes)
    T.tma_load(tm, x, (0, 40), smem, 2048, bar)       # rows 40..103: 24 rows past the end, zero-filled
    assert bar.state() == (1, 1, 0)                   # the whole box's bytes were paid, fill included
    box = T.load_box(tm, x, (0, 40))
    assert torch.equal(box[:40], x[40:]) and not box[40:].any()
    if mode == "none":   # packed rows of 32 bytes: 8-row core matrices are not contiguous, read row by row
        assert torch.equal(smem[2048:2048 + tm.box_bytes].view(torch.float16).reshape(64, cols), box)
        return
    for k0 in range(0, cols, 16):
        d = W.Descriptor(2048 + 2 * k0, 16, 8 * W.SWIZZLE_WIDTH[mode], mode)
        assert torch.equal(W.read_operand(smem, d, 64), box[:, k0:k0 + 16])


def test_swizzle_codes_differ_between_tma_and_wgmma():
    assert T.SWIZZLE["128B"] == 3 and W.SWIZZLE_CODE["128B"] == 1
    assert T.SWIZZLE["32B"] == 1 and W.SWIZZLE_CODE["32B"] == 3


def test_wrong_swizzle_in_the_descriptor_misreads_a_tma_tile():
    x = halves((64, 64), 5)
    tm = T.encode_tiled(x, (64, 64), swizzle="128B", address=0)
    smem = torch.zeros(16384, dtype=torch.uint8)
    bar = MBarrier(1)
    bar.arrive_expect_tx(tm.box_bytes)
    T.tma_load(tm, x, (0, 0), smem, 0, bar)
    # the TMA enum value of 128B (3) put into a wgmma descriptor means 32B there
    assert not torch.equal(W.read_operand(smem, W.Descriptor(0, 16, 1024, "32B"), 64), x[:, :16])


def test_multicast_writes_every_cta_in_the_mask_and_pays_each_barrier():
    x = halves((64, 64), 6)
    tm = T.encode_tiled(x, (32, 64), swizzle="128B", address=0)
    smems = [torch.zeros(4096, dtype=torch.uint8) for _ in range(4)]
    bars = [MBarrier(1) for _ in range(4)]
    for b in bars:
        b.arrive_expect_tx(tm.box_bytes)
    T.tma_load_multicast(tm, x, (0, 32), smems, 0, bars, 0b0101)
    assert [b.phase for b in bars] == [1, 0, 1, 0]
    assert torch.equal(smems[0], smems[2]) and not smems[1].any() and not smems[3].any()
    with pytest.raises(ValueError, match="cta_mask"):
        T.tma_load_multicast(tm, x, (0, 0), smems, 0, bars, 0b10000)


def test_tma_load_bad_inputs():
    x = halves((64, 64), 7)
    tm = T.encode_tiled(x, (64, 64), swizzle="128B", address=0)
    with pytest.raises(ValueError, match="1024-byte aligned"):
        T.tma_load(tm, x, (0, 0), torch.zeros(16384, dtype=torch.uint8), 512, MBarrier(1))
    with pytest.raises(ValueError, match="coords needs 2"):
        T.load_box(tm, x, (0,))
    narrow = T.encode_tiled(x, (64, 32), swizzle="128B", address=0)
    with pytest.raises(NotImplementedError, match="inner box == swizzle span"):
        T.smem_image(narrow, T.load_box(narrow, x, (0, 0)))


# ---------------------------------------------------------------------------------------------
# Triton's tensor descriptor


@pytest.mark.parametrize("shape", [(100, 72), (64, 64), (7, 24), (130, 200)])
@pytest.mark.parametrize("padding", ["zero", "nan"])
def test_box_copy_through_a_tensor_descriptor(shape, padding):
    x = halves(shape, shape[0])
    fill = float("nan") if padding == "nan" else 0.0
    out = T.box_copy(x, (64, 64), padding)
    assert torch.equal(out.nan_to_num(7.0), T.box_copy_ref(x, (64, 64), fill).nan_to_num(7.0))


def test_box_copy_reads_a_view_inside_canaries():
    x = halves((70, 40), 9)
    view = nan_canary(x, pad=64, rows=True)           # rows inside a NaN-filled buffer
    if (view.stride(0) * 2) % 16:
        pytest.skip("the canary buffer's row stride is not TMA-aligned")
    out = T.box_copy(view, (32, 32))
    assert torch.equal(out, T.box_copy_ref(x, (32, 32)))     # no canary NaN leaks into the boxes


def test_a_box_copy_that_ignores_the_fill_is_caught():
    x = halves((70, 40), 10)
    wrong = T.box_copy(x, (64, 64), "nan")           # the NaN fill standing in for a missing zero fill
    assert not torch.equal(wrong.nan_to_num(7.0), T.box_copy_ref(x, (64, 64)))


def test_box_copy_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        T.box_copy(torch.zeros(4, 4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 16"):
        T.box_copy(torch.zeros(4, 12, dtype=torch.float16))
    with pytest.raises(ValueError, match="padding must be"):
        T.box_copy(torch.zeros(8, 16, dtype=torch.float16), padding="inf")


def test_triton_descriptor_aot_uses_tma_without_spills():
    [builds] = ki.compile_triton_many([ki.TritonJob(T._box_copy_kernel, {"in_desc": "tensordesc<fp16[128, 64]>",
                                                     "out_ptr": "*fp16", "out_cols": "i32"},
                                                     constexprs={"BLOCK_M": 128, "BLOCK_N": 64})], archs=("sm90",))
    b = builds["sm90"]
    ops = ki.instructions(b.sass, "sass")
    assert ops["UTMALDG.2D"] == 1 and ops["SYNCS.EXCH.64"] == 1 and ops["SYNCS.PHASECHK.TRANS64.TRYWAIT"] >= 1
    assert ki.families(b.ptx, "ptx")["cp.async.bulk.tensor"] == 1
    assert b.spills == 0 and b.metadata["shared_bytes"] == 128 * 64 * 2 + 8   # the box and one mbarrier


# ---------------------------------------------------------------------------------------------
# Store and 1-D bulk copies


@pytest.mark.parametrize("mode, cols", [("none", 24), ("32B", 16), ("64B", 32), ("128B", 64)])
@pytest.mark.parametrize("coords", [(0, 0), (0, 40), (0, -8), (8, 70)])
def test_tma_store_writes_inside_and_clips_outside(mode, cols, coords):
    x = halves((75, cols + 8), 20)[:, :cols].contiguous()
    tm = T.encode_tiled(x, (16, cols if mode != "none" else 16), swizzle=mode, address=0)
    box = halves(tuple(reversed(tm.box_dim)), 21)
    smem = torch.zeros(4096, dtype=torch.uint8)
    smem[1024: 1024 + tm.box_bytes] = T.smem_image(tm, box)
    assert torch.equal(T.box_from_image(tm, smem[1024: 1024 + tm.box_bytes], x.dtype), box)
    got = torch.full_like(x, float("nan"))
    T.tma_store(tm, got, coords, smem, 1024)
    want = torch.full_like(x, float("nan"))
    c, r = coords
    for i in range(box.shape[0]):
        for j in range(box.shape[1]):
            if 0 <= r + i < x.shape[0] and 0 <= c + j < x.shape[1]:
                want[r + i, c + j] = box[i, j]
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_tma_store_that_writes_the_whole_box_is_caught():
    """A store that forgot to clip (writing the filled rows past the edge) is not the emulation."""
    x = halves((40, 16), 22)
    tm = T.encode_tiled(x, (32, 16), address=0)
    smem = T.smem_image(tm, halves((32, 16), 23))
    big = torch.full((64, 16), float("nan"), dtype=x.dtype)
    T.tma_store(tm, big[:40], (0, 24), smem, 0)
    assert big[40:].isnan().all()                       # rows 40..55 of the box were not written past the tensor
    unclipped = big.clone()
    unclipped[24:56] = T.box_from_image(tm, smem, x.dtype)
    assert not torch.equal(unclipped.nan_to_num(7.0), big.nan_to_num(7.0))


def test_tma_reduce_add_adds_inside_and_clips_outside():
    x = torch.randint(-8, 9, (40, 16), generator=torch.Generator().manual_seed(24)).half()
    tm = T.encode_tiled(x, (32, 16), address=0)
    box = torch.randint(-8, 9, (32, 16), generator=torch.Generator().manual_seed(25)).half()
    smem = T.smem_image(tm, box)
    got = x.clone()
    T.tma_store(tm, got, (0, 24), smem, 0, add=True)
    T.tma_store(tm, got, (0, 24), smem, 0, add=True)          # twice: each element gains 2 x its box value
    want = x.clone()
    want[24:40] += 2 * box[:16]
    assert torch.equal(got, want)
    overwritten = x.clone()
    T.tma_store(tm, overwritten, (0, 24), smem, 0)            # the plain store is not the reduction
    assert not torch.equal(overwritten, want)


def test_tma_reduce_and_cache_hint_sass():
    for arch in ("sm90", "sm100", "sm120"):
        lines = S.listing(ki.compile_cuda("tma_reduce", arch=arch).sass, "tma_reduce_add_box")
        red = [l for l in lines if l.startswith("UTMAREDG")]
        assert len(red) == 1 and red[0].startswith("UTMAREDG.2D.ADD") and "desc[" in red[0]      # the L2 policy operand
        store = [l for l in S.listing(ki.compile_cuda("tma", arch=arch).sass, "tma_store_box") if l.startswith("UTMASTG")]
        assert store and "desc[" not in store[0]                                                  # no hint, no operand
        assert any(l.startswith("DEPBAR.LE SB0, 0x0") for l in lines)                            # wait_group.read 0


@pytest.mark.parametrize("size, addrs, match", [(100, (0, 16), "multiple of 16"), (0, (0, 16), "multiple of 16"),
                                                (64, (0, 24), "16-byte aligned")])
def test_bulk_copy_rules(size, addrs, match):
    T.check_bulk_copy(64, 0, 16)
    with pytest.raises(ValueError, match=match):
        T.check_bulk_copy(size, *addrs)


# ---------------------------------------------------------------------------------------------
# SASS of the CUDA kernel


@pytest.fixture(scope="module")
def builds():
    return {arch: ki.compile_cuda("tma", arch=arch) for arch in ("sm90", "sm100", "sm120")}


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120"])
def test_tma_sass(builds, arch):
    b = builds[arch]
    assert ki.families(b.ptx, "ptx")["cp.async.bulk.tensor"] == 3          # load, multicast load, store
    one = S.opcodes(b.sass, "tma_load_box")
    assert one["UTMALDG.2D"] == 1 and one["SYNCS.ARRIVE.TRANS64"] == 1 and one["SYNCS.EXCH.64"] == 1
    multi = S.opcodes(b.sass, "tma_multicast_box")
    assert multi["UCGABAR_ARV"] == 2 and multi["UCGABAR_WAIT"] == 2          # barrier.cluster arrive / wait
    store, bulk = S.opcodes(b.sass, "tma_store_box"), S.opcodes(b.sass, "bulk_copy_1d")
    assert store["UTMACCTL.PF"] == 1 and store["FENCE.VIEW.ASYNC.S"] == 1 and store["UTMASTG.2D"] == 1   # prefetch, fence, store
    assert store["DEPBAR.LE"] == 1                                                # cp.async.bulk.wait_group.read 0
    assert bulk["UBLKCP.S.G"] == 1 and bulk["UBLKCP.G.S"] == 1 and bulk["CALL.ABS.NOINC"] == 0
    if arch == "sm120":     # no multicast instruction; peer-CTA destinations go through a called routine
        assert not any(k.startswith("UTMALDG") for k in multi) and multi["CALL.ABS.NOINC"] == 1
        assert one["CALL.ABS.NOINC"] == 1 and "SR_CgaCtaId" in S.split_functions(b.sass)["tma_load_box"]
    else:
        assert multi["UTMALDG.2D.MULTICAST"] == 1 and one["CALL.ABS.NOINC"] == multi["CALL.ABS.NOINC"] == 0


def test_ptxas_advises_against_multicast_on_sm120_only():
    notes = {arch: P.advisories(P.MULTICAST_TMA, arch) for arch in ("sm90", "sm100", "sm120")}
    assert notes["sm90"] == notes["sm100"] == []
    assert len(notes["sm120"]) == 1 and "substantially reduced performance" in notes["sm120"][0]
    with pytest.raises(ki.CompileError, match="ptxas refused"):
        P.advisories("not.an.instruction;", "sm90")


def test_tma_kernel_needs_sm90():
    with pytest.raises(ki.CompileError, match="__cluster_dims__ is not supported for this GPU architecture"):
        ki.compile_cuda("tma", arch="sm80")


# ---------------------------------------------------------------------------------------------
# GPU


@GPU
@pytest.mark.parametrize("mode", ["none", "64B", "128B"])
@pytest.mark.parametrize("coords", [(0, 0), (0, 40)])
def test_gpu_tma_box_matches_the_emulation(mode, coords):
    from kernels import cuda_launch

    cols = 64 if mode != "64B" else 32
    x = halves((80, cols), 12).cuda()
    tm = T.encode_tiled(x, (64, cols), swizzle=mode)
    mod = cuda_launch.load("tma")
    out = torch.zeros(tm.box_bytes, dtype=torch.uint8, device="cuda")
    mod.launch("tma_load_box", 1, 128, cuda_launch.encode_tensor_map(tm.arguments()), out, coords[0], coords[1],
               tm.box_bytes)
    assert torch.equal(out.cpu(), T.smem_image(tm, T.load_box(tm, x.cpu(), coords)))


@GPU
def test_gpu_tma_multicast_fills_both_ctas():
    from kernels import cuda_launch

    if cuda_launch.device_arch() not in ("sm90", "sm100"):
        pytest.skip("multicast TMA is an sm90/sm100 instruction")
    x = halves((64, 64), 13).cuda()
    tm = T.encode_tiled(x, (64, 64), swizzle="128B")
    mod = cuda_launch.load("tma")
    out = torch.zeros(2, tm.box_bytes, dtype=torch.uint8, device="cuda")
    mod.launch("tma_multicast_box", 2, 128, cuda_launch.encode_tensor_map(tm.arguments()), out, 0, 0, tm.box_bytes)
    want = T.smem_image(tm, T.load_box(tm, x.cpu(), (0, 0)))
    assert torch.equal(out[0].cpu(), want) and torch.equal(out[1].cpu(), want)


@GPU
@pytest.mark.parametrize("mode, coords", [("128B", (0, 0)), ("64B", (0, 40)), ("none", (8, -8))])
def test_gpu_tma_store_matches_the_emulation(mode, coords):
    from kernels import cuda_launch

    cols = {"none": 64, "64B": 32, "128B": 64}[mode]
    x = halves((72, cols), 24).cuda()
    tm = T.encode_tiled(x, (64, cols if mode != "none" else 32), swizzle=mode)
    image = T.smem_image(tm, halves(tuple(reversed(tm.box_dim)), 25))
    want = x.cpu().clone()
    T.tma_store(tm, want, coords, image, 0)
    cuda_launch.load("tma").launch("tma_store_box", 1, 128, cuda_launch.encode_tensor_map(tm.arguments()),
                                   image.cuda(), coords[0], coords[1], tm.box_bytes)
    assert torch.equal(x.cpu(), want)


@GPU
def test_gpu_bulk_copy_1d_round_trip():
    from kernels import cuda_launch

    src = torch.arange(4096, dtype=torch.int32, device="cuda")          # 16 KiB
    dst = torch.full_like(src, -1)
    cuda_launch.load("tma").launch("bulk_copy_1d", 1, 128, src, dst, 4000 * 4)
    assert torch.equal(dst[:4000], src[:4000]) and (dst[4000:] == -1).all()
