"""kernels/ptx/tcgen05.py and kernels/cuda/tcgen05.cu: the instruction and shared-memory descriptors
against CuTe's bit-field unions, the TMEM allocator and address rules, the emulated MMA (unswizzled and
with the 128B/64B/32B swizzles) and tcgen05.ld layout, the CTA pair, the SASS (UTCHMMA, LDTM on sm100), and on a GPU the kernel."""
import random

import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.ptx import sass as S
from kernels.ptx import tcgen05 as C
from kernels.ptx import wgmma as W
from kernels.testing import assert_close

_SKIP = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: tcgen05.cu is compiled and its SASS "
                           "asserted on the CPU, but launching it needs a driver and an sm100 (B200/GB200) device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP(fn))


def ints(shape, seed):
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).half()


# ---------------------------------------------------------------------------------------------
# Descriptors


@pytest.mark.parametrize("seed", range(3))
def test_instruction_descriptor_agrees_with_cute_bit_for_bit(seed):
    rng = random.Random(seed)
    for _ in range(200):
        m = rng.choice([64, 128, 256])
        n = rng.randrange(16 if m == 256 else 8, 257, 16 if m == 256 else 8)
        d = C.InstrDesc(m, n, rng.choice([torch.float16, torch.bfloat16]), rng.choice([torch.float16, torch.float32]),
                        rng.random() < 0.5, rng.random() < 0.5)
        assert C.encode_idesc(d) == C.cute_idesc_bits(d)
        assert C.decode_idesc(C.encode_idesc(d)) == d


def test_instruction_descriptor_named_fields():
    assert C.encode_idesc(C.InstrDesc(128, 64)) == 1 << 4 | 8 << 17 | 8 << 24
    assert C.encode_idesc(C.InstrDesc(64, 8, d_dtype=torch.float16)) == 1 << 17 | 4 << 24
    assert C.encode_idesc(C.InstrDesc(128, 8, torch.bfloat16)) >> 7 & 0x3F == 0b001001
    with pytest.raises(ValueError, match="M must be 64, 128 or 256"):
        C.encode_idesc(C.InstrDesc(96, 64))
    with pytest.raises(ValueError, match="multiple of 8"):
        C.encode_idesc(C.InstrDesc(256, 24))
    with pytest.raises(ValueError, match="kind::f16"):
        C.encode_idesc(C.InstrDesc(128, 64, torch.float32))


@pytest.mark.parametrize("seed", range(3))
def test_smem_descriptor_agrees_with_cute_and_moves_sm90s_layout_code(seed):
    rng = random.Random(seed)
    for _ in range(200):
        d = W.Descriptor(16 * rng.randrange(1 << 14), 16 * rng.randrange(1 << 14), 16 * rng.randrange(1 << 14),
                         rng.choice(["none", "32B", "64B", "128B"]), rng.randrange(8))
        bits = C.encode_smem_desc(d)
        assert bits == C.cute_smem_bits(d) and C.decode_smem_desc(bits) == d
        assert bits >> 61 == 2 * (W.encode(d) >> 62)        # sm90's 2-bit code, one bit lower, doubled
    with pytest.raises(ValueError, match="version 1"):
        C.decode_smem_desc(W.encode(W.Descriptor(0, 16, 128)))


# ---------------------------------------------------------------------------------------------
# Tensor memory


def test_tmem_allocation_rules():
    t = C.TensorMemory()
    assert t.alloc(128, "a") == C.taddr(0, 0)
    assert t.alloc(32, "b") == C.taddr(0, 128)
    assert t.alloc(64, "c") == C.taddr(0, 192)            # aligned to its size: 160 is not a multiple of 64
    assert t.alloc(256, "d") == C.taddr(0, 256)
    with pytest.raises(RuntimeError, match="would block"):
        t.alloc(64, "e")
    t.dealloc(C.taddr(0, 0), 128)
    assert t.alloc(64, "e") == 0
    for bad in (16, 48, 1024):
        with pytest.raises(ValueError, match="power of two from 32 to 512"):
            t.alloc(bad)
    with pytest.raises(RuntimeError, match="not all allocated"):
        C.TensorMemory().dealloc(0, 32)


def test_tmem_address_and_ld_lane_restriction():
    assert C.taddr(96, 40) == 96 << 16 | 40
    t = C.TensorMemory()
    base = t.alloc(32)
    t.cells[:, :32] = torch.arange(128 * 32, dtype=torch.float32).reshape(128, 32)
    got = t.ld_32x32b(base + C.taddr(64, 0), warp=6, num=32)      # warp 6 is sub-partition 2: lanes 64..95
    assert torch.equal(got, t.cells[64:96, :32])
    with pytest.raises(ValueError, match="warp 1 may access TMEM lanes 32..63 only"):
        t.ld_32x32b(base, warp=1, num=8)
    with pytest.raises(RuntimeError, match="not allocated"):
        t.ld_32x32b(base + 32, warp=0, num=8)


def test_layout_owner_covers_the_accumulator_once():
    own = C.tmem_layout_owner()
    assert own.shape == (128, 64, 2)
    assert {(int(w), int(t)) for w, t in own[:, 0]} == {(w, t) for w in range(4) for t in range(32)}


# ---------------------------------------------------------------------------------------------
# MMA


@pytest.mark.parametrize("K", [16, 48, 64])
def test_tcgen05_gemm_is_exact_on_small_integers(K):
    A, Bt = ints((128, K), K), ints((64, K), K + 1)
    assert torch.equal(C.tcgen05_gemm(A, Bt), C.tcgen05_ref(A, Bt))


def test_tcgen05_gemm_random_inputs():
    A = torch.randn(128, 64, dtype=torch.float64).half()
    Bt = torch.randn(64, 64, dtype=torch.float64).half()
    assert_close(C.tcgen05_gemm(A, Bt), A.double() @ Bt.double().T, dtype=torch.float32, baseline=C.tcgen05_ref(A, Bt))


def test_a_wrong_instruction_descriptor_is_caught():
    A, Bt = ints((128, 32), 1), ints((64, 32), 2)
    narrow = C.tcgen05_gemm(A, Bt, C.encode_idesc(C.InstrDesc(128, 32)))   # N = 32: half the columns never written
    assert torch.isnan(narrow[:, 32:]).all() and torch.equal(narrow[:, :32], C.tcgen05_ref(A, Bt)[:, :32])
    with pytest.raises(NotImplementedError, match="M = 128"):
        C.tcgen05_gemm(A, Bt, C.encode_idesc(C.InstrDesc(64, 64)))
    with pytest.raises(ValueError, match="A must be 128 x K"):
        C.tcgen05_gemm(ints((128, 24), 0), ints((64, 24), 0))


def test_cta_pair_splits_b_and_keeps_each_ctas_rows():
    A, Bt = ints((256, 16), 3), ints((128, 16), 4)
    D, per_cta = C.pair_mma(A, Bt)
    ref = C.tcgen05_ref(A, Bt)
    assert torch.equal(torch.cat(D), ref)
    assert per_cta == {"A bytes": 128 * 16 * 2, "B bytes": 64 * 16 * 2}    # half of B per CTA
    with pytest.raises(ValueError, match="256 rows"):
        C.pair_mma(ints((128, 16), 0), Bt)


# ---------------------------------------------------------------------------------------------
# SASS


@pytest.fixture(scope="module")
def sm100():
    return ki.compile_cuda("tcgen05", arch="sm100")


def test_tcgen05_sass_sm100(sm100):
    ptx = ki.families(sm100.ptx, "ptx")          # four kernels: tcgen05_gemm and tcgen05_gemm_sw{128,64,32}
    assert ptx["tcgen05.alloc"] == 4 and ptx["tcgen05.dealloc"] == 4 and ptx["tcgen05.commit"] == 4
    assert ptx["tcgen05.mma"] >= 4 and ptx["tcgen05.ld"] == 16
    ops = S.opcodes(sm100.sass, "tcgen05_gemm")
    assert ops["UTCHMMA"] >= 1 and ops["LDTM"] == 4 and ops["UTCBAR"] == 1
    assert ops["UTCATOMSWS.FIND_AND_SET.ALIGN"] >= 1               # the allocation
    utc = [ln for ln in sm100.sass.splitlines() if "UTCHMMA" in ln]
    assert all("tmem[" in ln and "gdesc[" in ln and "idesc[" in ln for ln in utc)
    assert sm100.metadata["resources"]["tcgen05_gemm"]["LOCAL"] == 0


@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_tcgen05_is_refused_off_sm100(arch):
    with pytest.raises(ki.CompileError, match="not supported on .target"):
        ki.compile_cuda("tcgen05", arch=arch)


# ---------------------------------------------------------------------------------------------
# GPU


@GPU
@pytest.mark.parametrize("K", [16, 64])
def test_gpu_tcgen05_gemm(K):
    from kernels import cuda_launch
    import ctypes

    if cuda_launch.device_arch() != "sm100":
        pytest.skip("tcgen05 needs sm100")
    mod = cuda_launch.load("tcgen05")
    A, Bt = ints((128, K), 5), ints((64, K), 6)
    D = torch.empty(128, 64, device="cuda")
    mod.launch("tcgen05_gemm", 1, 128, A.cuda(), Bt.cuda(), D, K, ctypes.c_uint32(C.encode_idesc(C.InstrDesc(128, 64))))
    assert torch.equal(D.cpu(), C.tcgen05_gemm(A, Bt))
    mod.launch("tcgen05_gemm", 1, 128, A.cuda(), Bt.cuda(), D, K, ctypes.c_uint32(C.encode_idesc(C.InstrDesc(128, 32))))
    assert not torch.equal(D.cpu(), C.tcgen05_ref(A, Bt))          # the wrong descriptor


def test_relinquish_alloc_permit_forbids_a_later_alloc_but_keeps_the_columns():
    t = C.TensorMemory()
    base = t.alloc(128, "CTA 0")
    t.relinquish_alloc_permit("CTA 0")
    with pytest.raises(RuntimeError, match="relinquish_alloc_permit"):
        t.alloc(32, "CTA 0")
    assert t.owner[base:base + 128] == ["CTA 0"] * 128        # still held until dealloc
    assert t.alloc(32, "CTA 1") == C.taddr(0, 128)            # another CTA still allocates
    t.dealloc(base, 128)


def test_pair_kernel_sass_issue_model():
    b = ki.compile_cuda("tcgen05_pair", arch="sm100")
    ops = S.opcodes(b.sass, "tcgen05_pair_gemm")
    assert ops["UTCHMMA.2CTA"] == 1 and "UTCHMMA" not in ops                 # one pair MMA, no 1-CTA MMA
    assert ops["UTCBAR.2CTA.MULTICAST"] == 1                                 # commit to both CTAs' barriers
    assert ops["UTCATOMSWS.2CTA.FIND_AND_SET.ALIGN"] >= 1 and ops["LDTM"] == 4
    assert b.metadata["resources"]["tcgen05_pair_gemm"]["LOCAL"] == 0
    one = S.opcodes(ki.compile_cuda("tcgen05", arch="sm100").sass, "tcgen05_gemm")
    assert "UTCHMMA.2CTA" not in one and one["UTCBAR"] == 1                   # the broken comparison: cta_group::1
    with pytest.raises(ki.CompileError, match="not supported on .target 'sm_90a'"):
        ki.compile_cuda("tcgen05_pair", arch="sm90")


@GPU
def test_gpu_tcgen05_pair_gemm():
    from kernels import cuda_launch
    import ctypes

    if cuda_launch.device_arch() != "sm100":
        pytest.skip("tcgen05 needs sm100")
    mod = cuda_launch.load("tcgen05_pair")
    A, Bt = ints((256, 16), 7), ints((64, 16), 8)
    D = torch.empty(256, 64, device="cuda")
    mod.launch("tcgen05_pair_gemm", 2, 128, A.cuda(), Bt.cuda(), D, ctypes.c_uint32(C.encode_idesc(C.InstrDesc(256, 64))))
    assert torch.equal(D.cpu(), C.tcgen05_ref(A, Bt))


def test_tcgen05_st_is_ld_backwards():
    t = C.TensorMemory()
    base = t.alloc(32, "cta")
    regs = torch.arange(128 * 4, dtype=torch.float32).reshape(4, 32, 4)
    for w in range(4):
        t.st_32x32b(base | (32 * w) << 16, w, regs[w])
    for w in range(4):
        assert torch.equal(t.ld_32x32b(base | (32 * w) << 16, w, 4), regs[w])
    assert torch.equal(t.cells[:, :4], regs.reshape(128, 4))          # thread t of warp w -> lane 32 w + t
    with pytest.raises(ValueError, match="warp 1 may access TMEM lanes 32..63 only"):
        t.st_32x32b(base, 1, regs[0])
    with pytest.raises(RuntimeError, match="not allocated"):
        t.st_32x32b(base | 40, 0, regs[0])


def test_tcgen05_moves_sass():
    b = ki.compile_cuda("tcgen05_moves", arch="sm100")
    ops = S.opcodes(b.sass, "tcgen05_st_ld")
    assert ops["STTM"] == 1 and ops["LDTM"] == 1
    ops = S.opcodes(b.sass, "tcgen05_scaled_mma")
    assert ops["UTCCP.T.S"] == 8 and ops["UTCQMMA"] == 1 and "UTCHMMA" not in ops
    mma = next(l for l in S.listing(b.sass, "tcgen05_scaled_mma") if l.startswith("UTCQMMA"))
    plain = next(l for l in S.listing(ki.compile_cuda("tcgen05", arch="sm100").sass, "tcgen05_gemm") if l.startswith("UTCHMMA"))
    assert mma.count("tmem[") == plain.count("tmem[") + 1 == 3           # one more TMEM operand: the scales
    for k in ("tcgen05_st_ld", "tcgen05_scaled_mma"):
        assert b.metadata["resources"][k]["LOCAL"] == 0


@GPU
def test_gpu_tcgen05_st_ld_round_trip():
    from kernels import cuda_launch

    if cuda_launch.device_arch() != "sm100":
        pytest.skip("tcgen05 needs sm100")
    mod = cuda_launch.load("tcgen05_moves")
    x = torch.randint(0, 2**31 - 1, (128, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    out = torch.zeros(128, 4, dtype=torch.int32, device="cuda")
    mod.launch("tcgen05_st_ld", 1, 128, x.cuda(), out)
    assert torch.equal(out.cpu(), x)


# ---------------------------------------------------------------------------------------------
# Swizzled operands


@pytest.mark.parametrize("mode", ["128B", "64B", "32B"])
def test_swizzled_operands_through_the_emulation(mode):
    K = W.SWIZZLE_WIDTH[mode] // 2                    # one swizzle atom per 8 rows: K = W / 2
    A, Bt = ints((128, K), 11), ints((64, K), 12)
    assert torch.equal(C.tcgen05_gemm(A, Bt, swizzle=mode), C.tcgen05_ref(A, Bt))
    for wrong in sorted({"none", "32B", "64B", "128B"} - {mode}):     # descriptors naming another layout: caught
        assert not torch.equal(C.tcgen05_gemm(A, Bt, swizzle=mode, desc_swizzle=wrong), C.tcgen05_ref(A, Bt))
    with pytest.raises(ValueError, match=f"K must be {K}"):
        C.tcgen05_gemm(ints((128, 2 * K), 0), ints((64, 2 * K), 0), swizzle=mode)


def test_swizzled_kernels_sass_carry_the_emulations_descriptors(sm100):
    for mode in ("128B", "64B", "32B"):
        w = W.SWIZZLE_WIDTH[mode]
        name = f"tcgen05_gemm_sw{w}"
        hi = C.encode_smem_desc(W.Descriptor(0, 16, 8 * w, mode)) >> 32   # SBO, version 1, layout code
        words = C.sass_descriptor_high_words(S.listing(sm100.sass, name))
        assert len(words) == w // 32 and set(words) == {(hi, hi)}         # one UTCHMMA per k16 step
        assert C.decode_smem_desc(hi << 32) == W.Descriptor(0, 0, 8 * w, mode)
        assert sm100.metadata["resources"][name]["LOCAL"] == 0
    plain = C.sass_descriptor_high_words(S.listing(sm100.sass, "tcgen05_gemm"))
    assert set(plain) == {(0x4008, 0x4008)}                               # the comparison: SBO 128, layout 0
    assert C.decode_smem_desc(0x4008 << 32).swizzle == "none"


@GPU
@pytest.mark.parametrize("mode", ["128B", "64B", "32B"])
def test_gpu_tcgen05_gemm_swizzled(mode):
    from kernels import cuda_launch
    import ctypes

    if cuda_launch.device_arch() != "sm100":
        pytest.skip("tcgen05 needs sm100")
    mod = cuda_launch.load("tcgen05")
    w = W.SWIZZLE_WIDTH[mode]
    A, Bt = ints((128, w // 2), 13), ints((64, w // 2), 14)
    image, _ = C.swizzled_image(A, Bt, mode)
    idesc = ctypes.c_uint32(C.encode_idesc(C.InstrDesc(128, 64)))
    D = torch.empty(128, 64, device="cuda")
    mod.launch(f"tcgen05_gemm_sw{w}", 1, 128, image.cuda(), D, idesc)
    assert torch.equal(D.cpu(), C.tcgen05_gemm(A, Bt, swizzle=mode))
    flat = torch.zeros_like(image)                                        # the broken variant: not swizzled
    W.write_kmajor(flat, 0, A, "none")
    W.write_kmajor(flat, C.B_OFFSET, Bt, "none")
    mod.launch(f"tcgen05_gemm_sw{w}", 1, 128, flat.cuda(), D, idesc)
    assert not torch.equal(D.cpu(), C.tcgen05_ref(A, Bt))
