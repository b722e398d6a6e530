"""kernels.inspect: AOT compilation for four architectures, nvcc, and reading the instructions.

The builds are jobs derived from a launch (``launch_job`` on meta tensors at Llama-3-70B's up
projection, as ``kernels.gemm.matmul.matmul`` launches it); the hand-written signature path
(``compile_triton``) stays supported and is tested below for its errors and for what it loses."""
import pytest

from kernels import inspect as ki
from kernels.gemm import matmul as mm
from kernels.gemm.matmul import _matmul_kernel

MATMUL_SIGNATURE = {
    "a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
    "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_cn": "i32",
}
TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}


@pytest.fixture(scope="module")
def matmul_builds():
    job = mm.launch_job(4096, 8192, 28672, block=(TILES["BLOCK_M"], TILES["BLOCK_N"], TILES["BLOCK_K"]))
    return ki.compile_triton_many([job], archs=("sm80", "sm90", "sm100", "sm120"))[0]


@pytest.mark.parametrize("arch, ptx_family, sass_family", [
    ("sm80", "mma.sync", "HMMA"),
    ("sm90", "wgmma.mma_async", "HGMMA"),
    ("sm100", "tcgen05.mma", "UTCHMMA"),
    ("sm120", "mma.sync", "HMMA"),
])
def test_fp16_dot_lowers_to_each_generations_tensor_core_instruction(matmul_builds, arch, ptx_family, sass_family):
    build = matmul_builds[arch]
    assert build.arch.name == arch
    assert ki.families(build.ptx, "ptx")[ptx_family] > 0
    assert build.families("sass")[sass_family] > 0
    others = {"mma.sync", "wgmma.mma_async", "tcgen05.mma"} - {ptx_family}
    assert not any(ki.families(build.ptx, "ptx")[o] for o in others), f"{arch} also used {others}"
    assert build.metadata["num_warps"] == 4 and build.metadata["shared_bytes"] > 0
    assert isinstance(build.metadata["registers"], int) and 0 < build.metadata["registers"] <= 255
    assert "ttg." in build.ttgir


def test_tensor_memory_is_reported_on_sm100_only(matmul_builds):
    assert matmul_builds["sm100"].metadata["tmem_columns"] > 0
    assert matmul_builds["sm90"].metadata["tmem_columns"] == 0


def test_a_hand_written_signature_still_compiles_but_loses_the_launchs_pipeline(matmul_builds):
    """Every integer a plain i32 (no %16, no folded unit stride): the backward-compatible path. The
    compiler can no longer prove 16-byte rows, so the cp.async pipeline of the launch's build is gone."""
    hand = ki.compile_triton(_matmul_kernel, MATMUL_SIGNATURE, arch="sm90", constexprs=TILES)
    assert hand.families("sass")["HGMMA"] > 0
    assert hand.async_copies["LDGSTS"] == 0 < matmul_builds["sm90"].async_copies["LDGSTS"]


def test_saxpy_sass_shows_what_its_ptx_asked_for():
    build = ki.compile_cuda("saxpy", arch="sm80")
    ptx, sass = ki.instructions(build.ptx, "ptx"), ki.families(build.sass, "sass")
    assert ptx["fma.rn.f32"] == 1 and sass["FFMA"] == 1           # one fused multiply-add, as written
    assert ki.families(build.ptx, "ptx")["ld.global"] == 2 and sass["LDG"] == 2   # x[i] and y[i]
    assert ki.families(build.ptx, "ptx")["st.global"] == 1 and sass["STG"] == 1   # y[i]
    assert build.metadata["resources"]["saxpy"]["REG"] > 0


def test_arch_names_are_parsed_and_unknown_ones_refused():
    assert ki.parse_arch("sm_90a").nvcc_arch == "sm_90a"
    assert ki.parse_arch(100).nvcc_arch == "sm_100a"
    assert ki.parse_arch("SM80").nvcc_arch == "sm_80"
    for bad in ("sm75", "sm_999", "hopper", 70):
        with pytest.raises(ValueError, match="unknown architecture"):
            ki.parse_arch(bad)


def test_missing_tool_names_the_pip_package(monkeypatch):
    monkeypatch.setattr(ki, "_tool_dirs", lambda: [])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ki.ToolMissingError, match="nvidia-cuda-nvcc"):
        ki.tool("nvcc")


def test_failing_cuda_compile_carries_nvcc_message(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(ki.CompileError, match="undefined_name"):
        ki.compile_cuda(bad, arch="sm80")


def test_missing_cuda_source_lists_what_exists():
    with pytest.raises(FileNotFoundError, match="saxpy"):
        ki.cuda_source("no_such_kernel")


def test_failing_triton_compile_names_the_kernel():
    with pytest.raises(ki.CompileError, match="_matmul_kernel"):
        ki.compile_triton(_matmul_kernel, MATMUL_SIGNATURE, arch="sm90", constexprs={**TILES, "BLOCK_K": 3})


def test_signature_must_cover_every_argument():
    sig = dict(MATMUL_SIGNATURE)
    del sig["M"]
    with pytest.raises(ki.CompileError, match="'M'"):
        ki.compile_triton(_matmul_kernel, sig, arch="sm80", constexprs=TILES)


def test_instruction_parsing_on_known_text():
    ptx = """
    .reg .b32 %r<4>;
    @%p1 bra $L__BB0_2;
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
    tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd1, %rd2, %r3, %p1; // comment
    $L__BB0_2:
    ret;
    """
    fam = ki.families(ptx, "ptx")
    assert fam == {"bra": 1, "mma.sync": 1, "cp.async.bulk.tensor": 1, "tcgen05.mma": 1, "ret": 1}
    sass = "        /*0070*/               @P0 EXIT ;\n        /*0080*/  HMMA.16816.F32 R4, R8, R12, R4 ;\n"
    assert ki.instructions(sass, "sass") == {"EXIT": 1, "HMMA.16816.F32": 1}
    with pytest.raises(ValueError):
        ki.instructions(ptx, "cubin")
