"""kernels/quant/microscaling.py: MX (OCP MX v1.0) and NVFP4 quantization checked against independent
decoders (ml_dtypes' E8M0 and PyTorch's float8 types) and the specification's scale rule; the block-scaled
matmul against dequantize-then-matmul on awkward shapes, a broken variant caught, bad input refused; the
PTX parser for block-scaled tcgen05.mma and mma.sync; the round-up scale rule against TransformerEngine's
conversion; the native builds' loads (16-byte cp.async, the byte-wise element mask caught); the swizzled
scale layout against cuBLAS's offset formula; the CUDA MXFP4 quantizer's two conversion instructions."""
import ml_dtypes
import numpy as np
import pytest
import torch

import kernels  # noqa: F401
from kernels.quant import microscaling as mx
from kernels.quant import minifloat as mf
from kernels.testing import MismatchError, assert_close


def test_e8m0_decode_matches_ml_dtypes():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = mx.decode_e8m0(codes).numpy()
    theirs = codes.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)) and np.isnan(ours).sum() == 1
    ok = ~np.isnan(theirs)
    assert np.array_equal(ours[ok], theirs[ok])
    with pytest.raises(TypeError, match="uint8"):
        mx.decode_e8m0(torch.zeros(3))


@pytest.mark.parametrize("elem", ["e4m3", "e2m1", "e2m3", "e3m2"])
def test_scale_is_spec_rule_and_block_max_lands_in_top_binade(elem):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    codes, scales = mx.quantize_mx(x, elem)
    f = mx.ELEMENTS[elem]
    amax = x.double().reshape(6, 4, 32).abs().amax(-1)
    want = torch.floor(torch.log2(amax)).long() - f.emax + 127          # floor(log2 amax) - emax + bias
    assert torch.equal(scales.long(), want)
    ratio = amax / mx.decode_e8m0(scales).double()
    assert ((ratio >= 2.0 ** f.emax) & (ratio < 2.0 ** (f.emax + 1))).all()


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
def test_mx_elements_are_rne_of_the_scaled_value(elem):
    torch.manual_seed(2)
    x = torch.distributions.StudentT(3.0).sample((4, 256)).float()
    codes, scales = mx.quantize_mx(x, elem)
    s = mx.decode_e8m0(scales).repeat_interleave(32, -1)
    scaled = x / s                                                        # exact: s is a power of two
    if elem == "e4m3":                                                    # PyTorch's own RNE cast, saturated
        ref = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:                                                                 # nearest of the 15 E2M1 values, ties even
        ref = scaled.clamp(-6, 6).numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        ref = torch.from_numpy(ref)
    assert torch.equal(mx.decode_elem(codes, elem), ref)
    assert torch.equal(mx.dequantize_mx(codes, scales, elem), ref * s)


def test_zero_block_and_floor_clamps_where_round_up_does_not():
    x = torch.zeros(1, 64)
    x[0, 32:] = torch.linspace(-5, 7, 32)
    codes, scales = mx.quantize_mx(x, "e2m1")
    assert scales[0, 0] == 0 and (mx.dequantize_mx(codes, scales)[0, :32] == 0).all()
    # amax 7: floor gives X = 1 and clamps 7 to 6; round-up gives X = 2 (7 / 2 = 3.5 rounds to 4: 8)
    _, up = mx.quantize_mx(x, "e2m1", rule="up")
    assert scales[0, 1] == 127 and up[0, 1] == 128 and up[0, 0] == 0
    with pytest.raises(ValueError, match="rule"):
        mx.quantize_mx(x, "e2m1", rule="ceil")


@pytest.mark.parametrize("elem", ["e4m3", "e2m1", "e2m3", "e3m2"])
def test_round_up_rule_is_te_conversion_and_never_clamps(elem):
    # TransformerEngine: e8m0 = round toward +inf of fp32(amax * fp32(1 / max_elem)); checked with numpy
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    f = mx.ELEMENTS[elem]
    amax = x.reshape(6, 8, 32).abs().amax(-1).numpy()
    q = amax.astype(np.float32) * np.float32(1.0 / f.max)
    want = np.ceil(np.log2(q.astype(np.float64))).astype(np.int64) + 127
    codes, scales = mx.quantize_mx(x, elem, rule="up")
    assert np.array_equal(scales.long().numpy(), want)
    ratio = amax / mx.decode_e8m0(scales).double().numpy()
    assert ((ratio > f.max / 2) & (ratio <= f.max)).all()                # (max/2, max]: nothing clamps
    floor_ratio = amax / mx.decode_e8m0(mx.quantize_mx(x, elem)[1]).double().numpy()
    assert (floor_ratio > f.max).any()                                    # the floor rule does clamp here
    # the bound of the round-up rule: |V - X P| <= 2^-(m+1) max|V| (no clamping term)
    m = {"e4m3": 3, "e2m1": 1, "e2m3": 3, "e3m2": 2}[elem]
    err = (mx.dequantize_mx(codes, scales, elem) - x).abs().reshape(6, 8, 32)
    assert (err <= 2.0 ** -(m + 1) * torch.from_numpy(amax)[..., None]).all()


def test_nvfp4_scales_and_values():
    torch.manual_seed(3)
    x = torch.distributions.StudentT(3.0).sample((8, 256)).float()
    codes, s_b, s_t = mx.quantize_nvfp4(x)
    assert s_b.dtype == torch.float8_e4m3fn and s_b.shape == (8, 16) and s_t.dtype == torch.float32
    assert abs(s_t.item() - x.abs().max().item() / (6 * 448)) <= 1e-7 * s_t.item()
    want = (x.double().reshape(8, 16, 16).abs().amax(-1) / 6 / s_t.double()).float()
    assert torch.equal(s_b, want.to(torch.float8_e4m3fn))                 # PyTorch's RNE cast
    assert s_b.float().max() == 448                                       # the largest block uses E4M3's top
    xh = mx.dequantize_nvfp4(codes, s_b, s_t)
    err = (xh - x).abs().reshape(8, 16, 16)
    step = (s_b.float() * s_t).reshape(8, 16, 1)                          # E2M1 spacing near the top is 2 s
    assert (err <= step * 1.0 + 1e-6).all()


def test_bits_per_element():
    assert mx.bits_per_element("mxfp8") == 8.25
    assert mx.bits_per_element("mxfp4") == 4.25
    assert mx.bits_per_element("nvfp4") == 4.5


def test_shared_scale_beats_per_tensor_on_heavy_tails():
    torch.manual_seed(4)
    x = torch.distributions.StudentT(2.5).sample((64, 512)).float()
    x[3, 7] = 400.0                                                       # one outlier
    rel = lambda xh: ((xh - x).norm() / x.norm()).item()
    per_tensor = mf.fake_quantize(x.reshape(1, -1), "e2m1", x.numel()).reshape(x.shape)
    assert rel(mx.fake_quantize(x, "mxfp4")) < 0.5 * rel(per_tensor)
    assert rel(mx.fake_quantize(x, "nvfp4")) < rel(mx.fake_quantize(x, "mxfp4"))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of"):
        mx.quantize_mx(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="NaN"):
        mx.quantize_nvfp4(torch.full((1, 16), float("nan")))
    with pytest.raises(ValueError, match="elem must be"):
        mx.quantize_mx(torch.zeros(1, 32), "e5m2")
    with pytest.raises(ValueError, match="fmt must be"):
        mx.quantize(torch.zeros(1, 32), "mxfp6_e2m3")
    a = mx.quantize(torch.randn(4, 64), "mxfp4")
    with pytest.raises(ValueError, match="K="):
        mx.mx_matmul(a, mx.quantize(torch.randn(4, 128), "mxfp4"), "mxfp4")
    with pytest.raises(ValueError, match="tuple"):
        mx.mx_matmul(a, a[:1], "mxfp4")


@pytest.mark.parametrize("fmt", mx.MATMUL_FORMATS)
@pytest.mark.parametrize("M,N,K", [(1, 1, 64), (37, 45, 160), (70, 33, 96)])
def test_matmul_matches_reference_and_broken_is_caught(fmt, M, N, K):
    torch.manual_seed(M * 1000 + N)
    g = torch.Generator().manual_seed(M * 1000 + N)
    vec = mx.FORMATS[fmt][1]
    odd = (torch.arange(K) // vec) % 2                                    # odd blocks 16x larger: their scales differ
    A = torch.distributions.StudentT(3.0).sample((M, K)).float() * 3 * 16.0 ** odd
    B = torch.randn(N, K, generator=g) * 0.05
    a, b = mx.quantize(A, fmt), mx.quantize(B, fmt)
    ref = mx.mx_matmul_ref(mx.unpack(a, fmt), mx.unpack(b, fmt), fmt).float()
    assert_close(mx.mx_matmul(a, b, fmt), ref, dtype=torch.float32)
    if K >= 2 * mx.FORMATS[fmt][1]:                                       # two scale blocks to confuse
        with pytest.raises(MismatchError):
            assert_close(mx.mx_matmul(a, b, fmt, _broken=True), ref, dtype=torch.float32)


def test_block_scaled_ptx_parser():
    ptx = ("\ttcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%r1], %rd2, %rd3, %r4, [%r5], [%r6], p;\n"
           "\ttcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1], %rd2, %rd3, %r4, [%r5], [%r6], p;\n"
           "\ttcgen05.mma.cta_group::1.kind::f16 [%r1], %rd2, %rd3, %r4, p;\n"
           "\tmma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0 "
           "{%f1}, {%r1}, {%r2}, {%f2}, %r3, {0, 0}, %r4, {0, 0};\n")
    assert mx.block_scaled_mmas(ptx) == [("mxf4nvf4", "4X"), ("mxf8f6f4", "1X"), ("mxf4nvf4", "2X")]


def test_inspect_counts_block_scaled_mma():
    # kernels.inspect's PTX regex once dropped these lines: scale_vec::4X ends in an upper-case X
    from kernels import inspect as ki
    line = "\ttcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%r1], %rd2, %rd3, %r4, p;\n"
    assert ki.instructions(line, "ptx") == {"tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X": 1}


@pytest.fixture(scope="module")
def builds():
    from kernels import inspect as ki
    jobs = mx.compile_jobs()
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm100", "sm90"), errors="keep")))


def test_compile_jobs_are_the_launch():
    for label, job in mx.compile_jobs().items():
        assert job.attrs and job.grid and job.programs >= 148, label        # launch_job; a B200 filled
        assert not job.constexprs["DECODE"] and not job.constexprs["BROKEN"]


def test_sm100_builds_one_block_scaled_mma_kind_per_format(builds):
    from kernels import inspect as ki
    want = {"mxfp8": (("mxf8f6f4", "1X"), "UTCQMMA"), "mxfp4": (("mxf4", "2X"), "UTCOMMA"),
            "nvfp4": (("mxf4nvf4", "4X"), "UTCOMMA")}
    for label, bb in builds.items():
        fmt = label.rsplit(", ", 1)[1]
        b = bb["sm100"]
        assert not isinstance(b, Exception), (label, b)
        assert b.spills == 0, label
        assert set(mx.block_scaled_mmas(b.ptx)) == {want[fmt][0]}, label
        assert b.tensor_core == want[fmt][1], label
        assert not [o for o in ki.instructions(b.sass, "sass") if "HMMA" in o or "HGMMA" in o], label


def test_sm100_operand_loads_are_16_byte_cp_async(builds):
    # every global load of the K loop is a cp.async (LDGSTS): 16 bytes for the codes, none byte-wide
    for label, bb in builds.items():
        loads = mx.global_loads(bb["sm100"].sass)
        assert loads["LDGSTS"][16] >= 16 and not loads["LDG"][1], (label, loads)


def test_element_mask_loads_bytes_and_is_caught():
    # the broken mask counts elements (k0 + 2 kb < K): Triton cannot prove 16 equal mask bits in a row
    from kernels import inspect as ki
    jobs = [mx.launch_job(4096, 14336, 4096, fmt, _element_mask=True) for fmt in ("mxfp4", "nvfp4")]
    for (b,) in (tuple(bb.values()) for bb in ki.compile_triton_many(jobs, archs=("sm100",))):
        loads = mx.global_loads(b.sass)
        assert loads["LDG"][1] >= 128 and not loads["LDGSTS"], loads


def test_sm120_builds_block_scaled_mma_sync_without_spills():
    from kernels import inspect as ki
    jobs = mx.compile_jobs("sm120", mx.REAL_SHAPES[:1])
    want = {"mxfp8": ("QMMA", ("mxf8f6f4", "1X")), "mxfp4": ("OMMA", ("mxf4nvf4", "2X")),
            "nvfp4": ("OMMA", ("mxf4nvf4", "4X"))}
    for (label, job), bb in zip(jobs.items(), ki.compile_triton_many(list(jobs.values()), archs=("sm120",))):
        b = bb["sm120"]
        assert b.spills == 0 and (b.tensor_core, *set(mx.block_scaled_mmas(b.ptx))) == want[label.rsplit(", ", 1)[1]]
        assert not mx.global_loads(b.sass)["LDG"][1], label


def test_sm90_has_no_block_scaled_mma(builds):
    from kernels import inspect as ki
    for label, bb in builds.items():
        b = bb["sm90"]
        if label.endswith("nvfp4"):                                           # refused by Triton's compiler
            assert isinstance(b, ki.CompileError), label
        else:                                                                 # upcast to bf16, then wgmma
            assert not isinstance(b, Exception) and b.tensor_core == "HGMMA" and not mx.block_scaled_mmas(b.ptx)


def test_swizzle_scales_is_the_cublas_layout():
    torch.manual_seed(6)
    s = torch.randint(0, 255, (200, 12), dtype=torch.uint8)               # 200 rows, 12 scale columns
    flat = mx.swizzle_scales(s)
    assert flat.numel() == 256 * 12                                        # rows padded to 2 x 128
    r, c = torch.meshgrid(torch.arange(200), torch.arange(12), indexing="ij")
    offset = (r // 128 * 3 + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
    assert torch.equal(flat[offset], s)
    assert not torch.equal(s.reshape(-1), flat[: s.numel()])               # row-major is not the layout
    e4m3 = torch.rand(128, 4).to(torch.float8_e4m3fn)                      # NVFP4 scales: same bytes, same layout
    assert torch.equal(mx.swizzle_scales(e4m3), mx.swizzle_scales(e4m3.view(torch.uint8)))
    with pytest.raises(ValueError, match="one-byte"):
        mx.swizzle_scales(torch.zeros(4, 4))


def test_cuda_quantizer_compiles_to_the_two_conversions():
    from kernels import inspect as ki
    for arch in ("sm100a", "sm120a"):
        b = ki.compile_cuda("mxfp4_quantize", arch=arch)
        ops = ki.instructions(b.sass, "sass")
        assert b.spills == 0
        assert ops["F2FP.SATFINITE.E8.F32.PACK_AB_MERGE_C.RP"] == 1 and ops["F2FP.SATFINITE.E2M1.F32.PACK_AB_MERGE_C"] == 1
        assert "cvt.rp.satfinite.ue8m0x2.f32" in b.ptx and "cvt.rn.satfinite.e2m1x2.f32" in b.ptx
    with pytest.raises(ki.CompileError):                                   # Hopper has neither instruction
        ki.compile_cuda("mxfp4_quantize", arch="sm90a")


def test_decode_launch_on_other_gpus_has_no_tensor_core_and_no_spills():
    # what mx_matmul launches on Hopper and Ampere: the DECODE path at DECODE_TILE, fp32 FMAs on CUDA cores
    from kernels import inspect as ki
    jobs = [mx.launch_job(4096, 14336, 4096, fmt, decode=True, target="sm90") for fmt in mx.MATMUL_FORMATS]
    for job, bb in zip(jobs, ki.compile_triton_many(jobs, archs=("sm80", "sm90"))):
        assert job.constexprs["DECODE"] and job.num_warps == mx.DECODE_TILE[3]
        for arch, b in bb.items():
            assert b.spills == 0 and b.tensor_core == "-", (arch, b.spills, b.tensor_core)
