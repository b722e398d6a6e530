"""kernels/ptx/wgmma.py and kernels/cuda/wgmma.cu: descriptor bits against CuTe's bit-field union,
the swizzled layouts reconstructed through descriptors, the m64nNk16 accumulator layout, the SASS
(HGMMA on sm90; refused on sm100), and on a GPU the instruction against the emulation."""
import random

import numpy as np
import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.ptx import sass as S
from kernels.ptx import wgmma as W
from kernels.testing import MismatchError, assert_close

_SKIP_CPU = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: wgmma.cu is compiled and its "
                               "SASS asserted on the CPU, but launching it needs a driver and an sm90 (Hopper) device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP_CPU(fn))


def ints(shape, seed):
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).half()


# ---------------------------------------------------------------------------------------------
# Descriptor bits


@pytest.mark.parametrize("seed", range(5))
def test_encode_agrees_with_cutes_bitfield_union_bit_for_bit(seed):
    rng = random.Random(seed)
    for _ in range(200):
        d = W.Descriptor(16 * rng.randrange(1 << 14), 16 * rng.randrange(1 << 14), 16 * rng.randrange(1 << 14),
                         rng.choice(list(W.SWIZZLE_CODE)), rng.randrange(8))
        bits = W.encode(d)
        assert bits == W.cute_union_bits(d)
        assert W.decode(bits) == d


def test_each_field_lands_at_its_documented_bits():
    assert W.encode(W.Descriptor(16, 0, 0)) == 1 << 0
    assert W.encode(W.Descriptor(0, 16, 0)) == 1 << 16
    assert W.encode(W.Descriptor(0, 0, 16)) == 1 << 32
    assert W.encode(W.Descriptor(0, 0, 0, "none", 1)) == 1 << 49
    assert [W.encode(W.Descriptor(0, 0, 0, m)) >> 62 for m in ("none", "128B", "64B", "32B")] == [0, 1, 2, 3]
    top = W.encode(W.Descriptor(16 * (2**14 - 1), 16 * (2**14 - 1), 16 * (2**14 - 1), "32B", 7))
    assert top == (2**14 - 1) | (2**14 - 1) << 16 | (2**14 - 1) << 32 | 7 << 49 | 3 << 62


def test_descriptor_bad_inputs():
    with pytest.raises(ValueError, match="start_address must be a multiple of 16"):
        W.encode(W.Descriptor(8, 0, 0))
    with pytest.raises(ValueError, match="sbo must be"):
        W.encode(W.Descriptor(0, 0, 16 << 14))
    with pytest.raises(ValueError, match="swizzle must be one of"):
        W.encode(W.Descriptor(0, 0, 0, "256B"))
    with pytest.raises(ValueError, match="reserved bits"):
        W.decode(1 << 14)
    with pytest.raises(ValueError, match="64 bits"):
        W.decode(1 << 64)


# ---------------------------------------------------------------------------------------------
# Swizzle and layouts: a tile written by CuTe's atom, read back through a descriptor


@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
@pytest.mark.parametrize("rows", [8, 24, 64])
def test_tiles_reconstruct_through_their_descriptors(mode, rows):
    K = 16 if mode == "none" else W.SWIZZLE_WIDTH[mode] // 2
    tile = ints((rows, K), rows + K)
    smem = torch.zeros(16384, dtype=torch.uint8)
    base = 2048
    lay = W.write_kmajor(smem, base, tile, mode)
    for k0 in range(0, K, 16):      # a swizzled row holds K/16 k16 steps: the start moves 32 bytes each
        d = W.Descriptor(base + 2 * k0, lay["lbo"], lay["sbo"], mode)
        assert torch.equal(W.read_operand(smem, d, rows), tile[:, k0:k0 + 16]), (mode, k0)


@pytest.mark.parametrize("mode", ["32B", "64B", "128B"])
def test_wrong_swizzle_or_offsets_break_the_reconstruction(mode):
    K = W.SWIZZLE_WIDTH[mode] // 2
    tile = ints((64, K), 5)
    smem = torch.zeros(16384, dtype=torch.uint8)
    lay = W.write_kmajor(smem, 0, tile, mode)
    for wrong in [W.Descriptor(0, lay["lbo"], lay["sbo"], m) for m in W.SWIZZLE_CODE if m != mode] + [
            W.Descriptor(0, lay["lbo"], W.SWIZZLE_WIDTH[mode], mode)]:       # SBO of one row, not eight
        assert not torch.equal(W.read_operand(smem, wrong, 64), tile[:, :16]), wrong


def test_no_swizzle_lbo_and_sbo_swapped_is_caught():
    tile = ints((64, 16), 6)
    smem = torch.zeros(16384, dtype=torch.uint8)
    lay = W.write_kmajor(smem, 0, tile, "none")
    assert lay == {"lbo": 64 * 16, "sbo": 128}
    assert not torch.equal(W.read_operand(smem, W.Descriptor(0, lay["sbo"], lay["lbo"]), 64), tile)


@pytest.mark.parametrize("mode, bits", [("32B", 1), ("64B", 2), ("128B", 3)])
def test_swizzle_agrees_with_cutes_swizzle_functor(mode, bits):
    for addr in range(0, 8192, 2):
        assert W.swizzle(addr, mode) == W.cute_swizzle(addr, bits)
    assert all(W.swizzle(a, "none") == a for a in range(0, 4096, 16))


def test_128b_swizzle_makes_column_reads_conflict_free():
    # 8 rows of 128 bytes reading the same logical 16-byte chunk: without swizzle all hit the same
    # 4 banks; with the 128B swizzle they cover all 32 banks once
    for chunk in range(8):
        plain = {((r * 128 + 16 * chunk) // 4) % 32 for r in range(8)}
        swz = {(W.swizzle(r * 128 + 16 * chunk, "128B") // 4 + j) % 32 for r in range(8) for j in range(4)}
        assert len(plain) == 1 and len(swz) == 32


def test_read_operand_bad_inputs():
    with pytest.raises(ValueError, match="1-D uint8"):
        W.read_operand(torch.zeros(16, dtype=torch.int16), W.Descriptor(0, 128, 256), 8)
    with pytest.raises(ValueError, match="past the"):
        W.read_operand(torch.zeros(256, dtype=torch.uint8), W.Descriptor(0, 1024, 128), 64)
    with pytest.raises(ValueError, match="K must be 64"):
        W.write_kmajor(torch.zeros(8192, dtype=torch.uint8), 0, ints((8, 32), 0), "128B")


def test_read_through_names_the_descriptor_mistake():
    tile = ints((64, 16), 7)
    assert torch.equal(W.read_through(tile, "none"), tile)
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
    unshifted = lambda s, l, b, m: s | (l >> 4) << 16 | (b >> 4) << 32 | code[m] << 62   # noqa: E731
    with pytest.raises(W.DescriptorError, match=r"k16 step 0: the descriptor for start 2048, LBO 1024, SBO 128, none "
                                                r"decodes to start 32768, .* reads byte 34815, past the 16384-byte shared "
                                                r"memory: the start address field holds the byte value itself"):
        W.read_through(tile, "none", encode_fn=unshifted)
    packed = lambda s, l, b, m: (s >> 4) | (l >> 4) << 14 | (b >> 4) << 28 | code[m] << 62   # noqa: E731
    with pytest.raises(W.DescriptorError, match=r"reserved bits set: 0x80000000 \(bit 31\): the fields are 14 bits at "
                                                r"bits 0, 16 and 32"):
        W.read_through(tile, "none", encode_fn=packed)
    with pytest.raises(W.DescriptorError, match=r"decodes to start 2048, LBO 16384, SBO 128, none, and it reads byte"):
        W.read_through(tile, "none", offsets_fn=lambda mode, rows: (16384, 128))   # LBO past the image, not unshifted
    assert isinstance(W.DescriptorError("x"), ValueError)


# ---------------------------------------------------------------------------------------------
# Accumulator layout and the emulated instruction


@pytest.mark.parametrize("n", [8, 24, 64, 256])
def test_accumulator_layout_is_a_bijection(n):
    lay = W.accumulator_layout(n).reshape(-1, 2)
    assert len({tuple(x) for x in lay}) == 64 * n
    assert lay[:, 0].max() == 63 and lay[:, 1].max() == n - 1


def test_accumulator_layout_at_named_points():
    lay = W.accumulator_layout(64)
    assert [tuple(x) for x in lay[0, :4]] == [(0, 0), (0, 1), (8, 0), (8, 1)]
    assert tuple(lay[37, 5]) == (16 + 1, 8 + 2 + 1)      # warp 1, g 1, q 1, register 5
    assert tuple(lay[127, 31]) == (63, 63)
    # each warp's 16 rows repeat mma.m16n8's C layout: the same columns for the same lane
    assert np.array_equal(lay[:32, :4, 1], lay[96:, :4, 1]) and np.array_equal(lay[96:, :4, 0] - 48, lay[:32, :4, 0])


def test_emulated_wgmma_matches_the_reference():
    A, Bt = ints((64, 16), 1), ints((40, 16), 2)
    smem = torch.zeros(8192, dtype=torch.uint8)
    la = W.write_kmajor(smem, 0, A, "none")
    lb = W.write_kmajor(smem, 4096, Bt, "none")
    frags = W.wgmma(smem, W.encode(W.Descriptor(0, la["lbo"], la["sbo"])),
                    W.encode(W.Descriptor(4096, lb["lbo"], lb["sbo"])), 40)
    assert torch.equal(W.from_accumulator(frags), W.wgmma_ref(A, Bt))


def test_gemm_sw128_matches_the_reference_and_catches_a_wrong_swizzle():
    A, Bt = torch.randn(64, 64, dtype=torch.float64).half(), torch.randn(64, 64, dtype=torch.float64).half()
    assert_close(W.gemm_sw128(A, Bt), A.double() @ Bt.double().T, dtype=torch.float32, baseline=W.wgmma_ref(A, Bt))
    for mode in ("none", "32B", "64B"):
        with pytest.raises(MismatchError):
            assert_close(W.gemm_sw128(A, Bt, mode), W.wgmma_ref(A, Bt), dtype=torch.float32, name=mode)


def test_a_wrong_accumulator_layout_is_caught():
    lay = W.accumulator_layout(64).copy()
    lay[:, [1, 2]] = lay[:, [2, 1]]                 # d1 and d2 swapped
    D = torch.randn(64, 64)
    assert not torch.equal(W.from_accumulator(W.to_accumulator(D), lay), D)
    with pytest.raises(ValueError, match="multiple of 8"):
        W.accumulator_layout(12)
    with pytest.raises(ValueError, match="64 x 64"):
        W.gemm_sw128(torch.zeros(64, 32).half(), torch.zeros(64, 64).half())


# ---------------------------------------------------------------------------------------------
# SASS


@pytest.fixture(scope="module")
def sm90():
    return ki.compile_cuda("wgmma", arch="sm90")


def test_wgmma_sass_sm90(sm90):
    ptx = ki.families(sm90.ptx, "ptx")
    assert ptx["wgmma.mma_async"] == 5 and ptx["wgmma.fence"] == 2 and ptx["wgmma.commit_group"] == 2
    hgmma = [ln for ln in sm90.sass.splitlines() if "HGMMA." in ln]
    assert len(hgmma) == 5 and all("HGMMA.64x64x16.F32" in ln and "gdesc[" in ln for ln in hgmma)
    for kernel in ("wgmma_image", "wgmma_gemm_sw128"):
        ops = S.opcodes(sm90.sass, kernel)
        assert ops["WARPGROUP.ARRIVE"] == 1 and ops["WARPGROUP.DEPBAR.LE"] == 1
        assert sm90.metadata["resources"][kernel]["LOCAL"] == 0
    assert S.opcodes(sm90.sass, "wgmma_gemm_sw128")["HGMMA.64"] == 4     # four k16 steps


def test_wgmma_register_a_fp8_and_pipelined_forms_sass():
    b = ki.compile_cuda("wgmma_forms", arch="sm90")
    rs = [l for l in S.listing(b.sass, "wgmma_rs_m64n64k16") if l.startswith("HGMMA")]
    assert len(rs) == 1 and rs[0].split()[2].startswith("R") and "gdesc" in rs[0].split()[3]   # A: a register, B: a descriptor
    fp8 = [l for l in S.listing(b.sass, "wgmma_fp8_m64n64k32") if "GMMA" in l]
    assert len(fp8) == 1 and fp8[0].startswith("QGMMA.64x64x32.F32.E4M3.E4M3 ")
    waits = [l for l in S.listing(b.sass, "wgmma_pipelined") if l.startswith("WARPGROUP.DEPBAR.LE")]
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in waits and waits[-1] == "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    for k in ("wgmma_rs_m64n64k16", "wgmma_fp8_m64n64k32", "wgmma_pipelined"):
        assert b.metadata["resources"][k]["LOCAL"] == 0
    with pytest.raises(ki.CompileError, match="Arguments mismatch for instruction 'wgmma.mma_async'"):
        ki.compile_cuda("wgmma_forms", arch="sm90", flags=("-DWGMMA_FP8_TRANS",))   # fp8 has no transpose


@pytest.mark.parametrize("arch", ["sm100", "sm120"])
def test_wgmma_is_refused_off_hopper(arch):
    with pytest.raises(ki.CompileError, match="not supported on .target"):
        ki.compile_cuda("wgmma", arch=arch)


# ---------------------------------------------------------------------------------------------
# GPU


@GPU
@pytest.mark.parametrize("mode", ["none", "32B", "64B", "128B"])
def test_gpu_wgmma_image_matches_the_emulation(mode):
    from kernels import cuda_launch
    import ctypes

    mod = cuda_launch.load("wgmma", arch="sm90")
    K = 16 if mode == "none" else W.SWIZZLE_WIDTH[mode] // 2
    A, Bt = ints((64, K), 11), ints((64, K), 12)
    smem = torch.zeros(16384, dtype=torch.uint8)
    la = W.write_kmajor(smem, 0, A, mode)
    lb = W.write_kmajor(smem, 8192, Bt, mode)
    da = W.encode(W.Descriptor(0, la["lbo"], la["sbo"], mode))
    db = W.encode(W.Descriptor(8192, lb["lbo"], lb["sbo"], mode))
    out = torch.empty(128 * 32, device="cuda")
    mod.launch("wgmma_image", 1, 128, smem.cuda(), 1024, ctypes.c_uint64(da), ctypes.c_uint64(db), out)
    assert torch.equal(out.cpu().reshape(128, 32), W.wgmma(smem, da, db, 64))


@GPU
@pytest.mark.parametrize("mode", [1, 3])
def test_gpu_gemm_sw128(mode):
    from kernels import cuda_launch

    mod = cuda_launch.load("wgmma", arch="sm90")
    A, Bt = ints((64, 64), 21), ints((64, 64), 22)
    D = torch.empty(64, 64, device="cuda")
    mod.launch("wgmma_gemm_sw128", 1, 128, A.cuda(), Bt.cuda(), D, mode)
    assert torch.equal(D.cpu(), W.wgmma_ref(A, Bt)) == (mode == 1)    # mode 3 (32B) is the broken variant
