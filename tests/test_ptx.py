"""kernels/ptx: ldmatrix and mma.m16n8k16 fragment layouts, cp.async groups and the pipeline model,
the CUDA kernels' SASS, and (on a GPU) the kernels against the emulation and torch."""
import numpy as np
import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.ptx import cp_async as ca
from kernels.ptx import fragments as F
from kernels.ptx import sass as S
from kernels.ptx.mbarrier import Deadlock, MBarrier, MBarrierError
from kernels.testing import MismatchError, assert_close

ARCHS = ("sm80", "sm90", "sm100", "sm120")
_SKIP_CPU = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: the CUDA kernels are compiled and "
                         "their SASS asserted on the CPU, but launching them needs a driver and a device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP_CPU(fn))


def small_ints(shape, seed, lo=-4, hi=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).half()


def random_half(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).half()


# ---------------------------------------------------------------------------------------------
# mma.m16n8k16 layouts


@pytest.mark.parametrize("op", ["a", "b", "c"])
def test_layouts_are_bijections(op):
    F.check_layout(F.mma_layout(op), op)


def test_layout_formulas_at_named_points():
    a, b, c = F.mma_layout("a"), F.mma_layout("b"), F.mma_layout("c")
    # lane 5: groupID 1, threadID_in_group 1
    assert [tuple(x) for x in a[5]] == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert [tuple(x) for x in b[5]] == [(2, 1), (3, 1), (10, 1), (11, 1)]
    assert [tuple(x) for x in c[5]] == [(1, 2), (1, 3), (9, 2), (9, 3)]
    assert tuple(c[31, 3]) == (15, 7)


@pytest.mark.parametrize("seed", range(4))
def test_mma_reconstructs_the_product_exactly_from_32_threads(seed):
    A, B = small_ints((16, 16), seed), small_ints((16, 8), seed + 100)
    C = small_ints((16, 8), seed + 200).float()
    D = F.mma_from_matrices(A, B, C)
    assert torch.equal(D, A.float() @ B.float() + C)


@pytest.mark.parametrize("seed", range(3))
def test_mma_random_fp16_inputs(seed):
    A, B = random_half((16, 16), seed), random_half((16, 8), seed + 7)
    assert_close(F.mma_from_matrices(A, B), A.float() @ B.float(), dtype=torch.float32)


def test_mma_adversarial_one_hot_inputs_find_every_position():
    # A = e_i e_k^T, B = e_k e_j^T: D is one 1 at (i, j). Every (i, k) and every (k, j) pair is visited.
    for i in range(16):
        for k in range(16):
            A = torch.zeros(16, 16, dtype=torch.float16)
            A[i, k] = 1
            B = torch.zeros(16, 8, dtype=torch.float16)
            B[k, (i + k) % 8] = 1
            want = torch.zeros(16, 8)
            want[i, (i + k) % 8] = 1
            assert torch.equal(F.mma_from_matrices(A, B), want), (i, k)


def test_mma_extreme_values():
    A = torch.full((16, 16), 65504.0, dtype=torch.float16)      # fp16 max
    B = torch.eye(16, 8, dtype=torch.float16)
    D = F.mma_from_matrices(A, B)
    assert torch.equal(D, torch.full((16, 8), 65504.0))          # fp32 accumulator does not overflow
    A[3, 4] = float("nan")
    D = F.mma_from_matrices(A, B)
    # NaN * 0 is NaN: the NaN reaches every dot product of its row, and no other
    assert torch.isnan(D[3]).all() and torch.isnan(D).sum() == 8
    big = torch.full((16, 16), 65504.0, dtype=torch.float16)
    assert torch.equal(F.mma_from_matrices(big, big[:, :8]), torch.full((16, 8), 16 * 65504.0**2))


def _swap(layout, i, j):
    wrong = layout.copy()
    wrong[:, [i, j]] = wrong[:, [j, i]]
    return wrong


WRONG_MMA = {
    # a2,a3 are row g+8 and a4,a5 are column +8: swapping them is the classic misreading
    "a: a2/a3 swapped with a4/a5": ("a", lambda: _swap(_swap(F.mma_layout("a"), 2, 4), 3, 5)),
    "b: groupID as k, not n": ("b", lambda: np.stack([F.mma_layout("b")[..., 1] + 8 * (np.arange(4)[None] // 2),
                                                     F.mma_layout("b")[..., 0] % 8], -1)),
    "c: c1 and c2 swapped": ("c", lambda: _swap(F.mma_layout("c"), 1, 2)),
}


@pytest.mark.parametrize("case", list(WRONG_MMA))
def test_a_wrong_mma_layout_is_caught(case):
    op, make = WRONG_MMA[case]
    wrong = make()
    A, B = random_half((16, 16), 1), random_half((16, 8), 2)
    # fragments distributed by the wrong layout, multiplied by the hardware's (the ISA's) layout
    frags = {"a": F.to_fragments(A, "a"), "b": F.to_fragments(B, "b")}
    if op in frags:
        frags[op] = F.to_fragments(A if op == "a" else B, op, wrong)
    d = F.mma_m16n8k16(frags["a"], frags["b"])
    D = F.from_fragments(d, "c", wrong if op == "c" else None)
    with pytest.raises(MismatchError):
        assert_close(D, A.float() @ B.float(), dtype=torch.float32, name=case)


def test_check_layout_names_the_mapping_mistake():
    bad = F.mma_layout("c").copy()
    bad[0, 0] = bad[0, 1]                           # slot 0 of lane 0 doubles slot 1's element; (0, 0) is orphaned
    with pytest.raises(ValueError, match=r"lane 0, slot 0 and lane 0, slot 1 both hold element \(0, 1\), which is held "
                                         r"2 times, and element \(0, 0\) is held by no \(lane, slot\)"):
        F.check_layout(bad, "c")
    bad = F.mma_layout("b").copy()
    bad[3, 1] = (16, 0)
    with pytest.raises(ValueError, match=r"lane 3, slot 1 is mapped to \(16, 0\), outside the 16x8 B: over the warp "
                                         r"your rows run 0\.\.16, B's run 0\.\.15") as info:
        F.check_layout(bad, "b")
    assert "np.int64" not in str(info.value)              # plain integers, not numpy reprs
    swapped = np.stack([np.arange(32) % 4, 2 * (np.arange(32) // 4)], -1)[:, None, :] + np.array([[0, 0], [0, 1], [8, 0], [8, 1]])
    with pytest.raises(ValueError, match=r"columns run 0\.\.15, C's run 0\.\.7 \(groupID = lane // 4 runs 0\.\.7"):
        F.check_layout(swapped, "c")                   # groupID and threadID_in_group swapped: columns overrun


def test_mma_bad_inputs():
    with pytest.raises(ValueError, match="a_frag must be torch.float16"):
        F.mma_m16n8k16(torch.zeros(32, 8), torch.zeros(32, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="operand a must be"):
        F.to_fragments(torch.zeros(8, 16), "a")
    with pytest.raises(ValueError, match="operand must be"):
        F.mma_layout("e")


# ---------------------------------------------------------------------------------------------
# ldmatrix


def _smem(seed=0):
    # 512 distinct 16-bit values so that every element is identifiable
    return torch.randperm(512, generator=torch.Generator().manual_seed(seed)).to(torch.int16)


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_against_a_direct_reading_of_the_isa(num, trans):
    smem = _smem(num)
    # rows scattered through shared memory, 16-byte aligned, in a shuffled order
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(7))[:32] * 8
    regs = F.ldmatrix(smem, rows.tolist(), num, trans)
    assert regs.shape == (32, num, 2)
    for lane in range(32):
        for r in range(num):
            mat = torch.stack([smem[int(rows[8 * r + q]):int(rows[8 * r + q]) + 8] for q in range(8)])  # matrix r
            for j in range(2):
                want = mat[2 * (lane % 4) + j, lane // 4] if trans else mat[lane // 4, 2 * (lane % 4) + j]
                assert regs[lane, r, j] == want


def test_ldmatrix_ignores_addresses_of_unused_lanes():
    smem = _smem()
    addrs = [8 * i for i in range(32)]
    base = F.ldmatrix(smem, addrs, 1)
    addrs2 = addrs[:8] + [0] * 24
    assert torch.equal(F.ldmatrix(smem, addrs2, 1), base)


def test_ldmatrix_x4_and_x2_trans_give_mma_fragments():
    A, B = random_half((16, 16), 3), random_half((16, 8), 4)
    assert torch.equal(F.ldmatrix_a_fragments(A), F.to_fragments(A, "a"))
    assert torch.equal(F.ldmatrix_b_fragments(B), F.to_fragments(B, "b"))
    d = F.mma_m16n8k16(F.ldmatrix_a_fragments(A), F.ldmatrix_b_fragments(B))
    assert_close(F.from_fragments(d, "c"), A.float() @ B.float(), dtype=torch.float32)


def test_a_wrong_ldmatrix_layout_is_caught():
    B = random_half((16, 8), 5)
    smem = B.contiguous().view(-1)
    # forgetting .trans: the non-transposed load of a k-major B tile
    wrong = F.ldmatrix(smem, F.b_tile_addresses(), 2, trans=False).reshape(32, 4)
    assert not torch.equal(wrong, F.to_fragments(B, "b"))
    # a layout with the two halves of each register swapped
    lay = F.ldmatrix_layout(4)[:, :, ::-1].copy()
    A = random_half((16, 16), 6)
    regs = F.ldmatrix(A.view(-1), F.a_tile_addresses(), 4, layout=lay).reshape(32, 8)
    d = F.mma_m16n8k16(regs, F.to_fragments(B, "b"))
    with pytest.raises(MismatchError):
        assert_close(F.from_fragments(d, "c"), A.float() @ B.float(), dtype=torch.float32)


def test_ldmatrix_bad_inputs():
    smem = _smem()
    with pytest.raises(ValueError, match="num must be 1, 2 or 4"):
        F.ldmatrix(smem, [0] * 32, 3)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        F.ldmatrix(smem, [4] + [0] * 31, 1)
    with pytest.raises(ValueError, match="outside shared memory"):
        F.ldmatrix(smem, [512] + [0] * 31, 1)
    with pytest.raises(ValueError, match="one entry per lane"):
        F.ldmatrix(smem, [0] * 8, 1)
    with pytest.raises(ValueError, match="16-bit"):
        F.ldmatrix(smem.float(), [0] * 32, 1)


def test_pack_halves_puts_element_zero_in_the_low_half():
    x = torch.tensor([1.0, 2.0], dtype=torch.float16)
    w = int(F.pack_halves(x)[0]) & 0xFFFFFFFF
    assert w & 0xFFFF == 0x3C00 and w >> 16 == 0x4000
    assert torch.equal(F.unpack_halves(F.pack_halves(x)), x)


# ---------------------------------------------------------------------------------------------
# cp.async groups and the pipeline model


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n_tiles", [1, 2, 7])
def test_pipelined_tile_sums(stages, n_tiles):
    x = torch.randn(n_tiles, 48, generator=torch.Generator().manual_seed(stages * 10 + n_tiles))
    for eager in (False, True):
        assert_close(ca.pipelined_tile_sums(x, stages, eager=eager), ca.tile_sums_ref(x), dtype=torch.float32)


def test_a_too_weak_wait_is_caught_by_the_lazy_schedule_and_hidden_by_the_eager_one():
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(MismatchError):
        assert_close(ca.pipelined_tile_sums(x, 3, wait=2), ca.tile_sums_ref(x), dtype=torch.float32)
    # the same bug passes when copies happen to land at once: why the emulation defers them
    assert_close(ca.pipelined_tile_sums(x, 3, wait=2, eager=True), ca.tile_sums_ref(x), dtype=torch.float32)


def test_src_size_zero_fills_the_tail_and_reads_nothing_past_it():
    unit = ca.AsyncCopyUnit()
    dst = torch.full((4,), float("nan"))
    unit.cp_async(dst, torch.tensor([1.0, 2.0, 3.0, float("nan")]), src_bytes=12)
    unit.wait_all()
    assert torch.equal(dst, torch.tensor([1.0, 2.0, 3.0, 0.0]))
    with pytest.raises(ValueError, match="src_bytes"):
        unit.cp_async(dst, torch.zeros(4), src_bytes=6)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    n = 2 * 64 + 37                                   # a tail inside tile 2; tiles 3 and 4 entirely past n
    x.view(-1)[n:] = float("nan")                     # canaries: any byte read past n poisons a sum
    for stages in (2, 3):
        assert_close(ca.pipelined_tile_sums(x, stages, n=n), ca.tile_sums_ref(x, n), dtype=torch.float32)
    # the unmasked copy (no src-size) is the broken variant: it reads the canaries
    with pytest.raises(MismatchError):
        assert_close(ca.pipelined_tile_sums(x, 3), ca.tile_sums_ref(x, n), dtype=torch.float32)
    with pytest.raises(ValueError, match="n must be"):
        ca.pipelined_tile_sums(x, 3, n=x.numel() + 1)


def test_mbarrier_arrive_tracks_every_earlier_copy_committed_or_not():
    unit = ca.AsyncCopyUnit()
    dst = torch.zeros(3, 4)
    src = torch.arange(12.0).reshape(3, 4)
    unit.cp_async(dst[0], src[0])
    unit.commit_group()
    unit.cp_async(dst[1], src[1])                          # not committed: tracked all the same
    bar = MBarrier(1)
    unit.mbarrier_arrive(bar, noinc=True)
    unit.cp_async(dst[2], src[2])                          # issued after the arrive: not tracked
    assert not bar.try_wait_parity(0) and dst.abs().sum() == 0   # lazy: nothing has landed, no arrival yet
    unit.wait_mbarrier(bar, 0)
    assert torch.equal(dst[:2], src[:2]) and dst[2].abs().sum() == 0 and bar.try_wait_parity(0)
    with pytest.raises(Deadlock, match="would never return"):
        unit.wait_mbarrier(bar, 1)                         # the next phase has no arrival coming
    with pytest.raises(MBarrierError, match="count must be"):
        MBarrier(0)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_mbarrier_pipeline_and_its_broken_variant(stages):
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(stages))
    for eager in (False, True):
        assert_close(ca.mbarrier_tile_sums(x, stages, eager=eager), ca.tile_sums_ref(x), dtype=torch.float32)
    # arriving before the copy is issued: the lazy schedule reads a slot whose tile has not landed
    with pytest.raises(MismatchError):
        assert_close(ca.mbarrier_tile_sums(x, stages, arrive_first=True), ca.tile_sums_ref(x), dtype=torch.float32)
    assert_close(ca.mbarrier_tile_sums(x, stages, arrive_first=True, eager=True), ca.tile_sums_ref(x),
                 dtype=torch.float32)


def test_group_semantics():
    unit = ca.AsyncCopyUnit()
    src = torch.arange(12.0).reshape(3, 4)
    dst = torch.zeros(3, 4)
    for i in range(3):
        unit.cp_async(dst[i], src[i])
        unit.commit_group()
    assert unit.pending == 3 and dst.abs().sum() == 0      # nothing has landed yet (lazy)
    unit.wait_group(1)                                     # the two oldest groups complete
    assert torch.equal(dst[:2], src[:2]) and dst[2].abs().sum() == 0 and unit.pending == 1
    unit.commit_group()                                    # an empty group counts as a group
    assert unit.pending == 2
    unit.wait_all()
    assert torch.equal(dst, src) and unit.pending == 0
    with pytest.raises(ValueError):
        unit.wait_group(-1)
    with pytest.raises(ValueError, match="differs"):
        unit.cp_async(dst[0], src[0, :2])
    with pytest.raises(ValueError, match="stages >= 2"):
        ca.pipelined_tile_sums(src, 1)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
def test_timeline_matches_the_steady_state_formula(stages):
    kw = dict(latency=800.0, transfer=100.0, compute=250.0)
    n = 240
    tl = ca.pipeline_timeline(n, stages, **kw)
    period = (tl.compute_start[-1] - tl.compute_start[n // 2]) / (n - 1 - n // 2)
    assert period == pytest.approx(ca.steady_state_period(stages, **kw), rel=0.02)
    for i in range(n):                       # causality: compute waits for its copy, copies for their issue
        assert tl.compute_start[i] >= tl.copy_done[i] - 1e-9
        assert tl.copy_done[i] >= tl.copy_issue[i] + kw["latency"] - 1e-9


def test_one_more_stage_never_hurts_and_stops_helping_once_compute_bound():
    kw = dict(latency=800.0, transfer=100.0, compute=250.0)
    totals = [ca.pipeline_timeline(64, s, **kw).total for s in range(1, 9)]
    assert all(b <= a + 1e-9 for a, b in zip(totals, totals[1:]))
    # latency / (S - 1) <= compute from S = 5 on: the period is the compute time
    assert ca.steady_state_period(5, **kw) == 250.0 == ca.steady_state_period(8, **kw)


def test_timeline_bad_inputs():
    with pytest.raises(ValueError):
        ca.pipeline_timeline(0, 2, latency=1, transfer=1, compute=1)
    with pytest.raises(ValueError, match="latency"):
        ca.pipeline_timeline(4, 2, latency=-1, transfer=1, compute=1)


# ---------------------------------------------------------------------------------------------
# SASS of the CUDA kernels, read from nvcc's output for each architecture


@pytest.fixture(scope="module")
def cuda_builds():
    return {(name, arch): ki.compile_cuda(name, arch=arch) for name in ("cp_async", "ldmatrix", "mma") for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_cp_async_sass(cuda_builds, arch):
    b = cuda_builds[("cp_async", arch)]
    ptx = ki.families(b.ptx, "ptx")
    assert ptx["cp.async.commit_group"] >= 2 and ptx["cp.async.wait_group"] >= 2
    assert b.ptx.count("cp.async.cg.shared.global.L2::128B") >= 2       # with a src-size operand, in every kernel
    ops = S.opcodes(b.sass, "cp_async_tile_sums")
    # .cg 16-byte copies bypass L1; .L2::128B is LTC128B; a src-size operand is the ZFILL form
    assert ops["LDGSTS.E.BYPASS.LTC128B.128.ZFILL"] >= 2
    assert ops["LDGDEPBAR"] >= 2                    # commit_group
    assert ops["DEPBAR.LE"] >= 2                    # wait_group N: wait until <= N outstanding
    fn = S.split_functions(b.sass)["cp_async_tile_sums"]
    sass = "\n".join(line for line in fn.splitlines() if "DEPBAR.LE" in line)
    assert "SB0, 0x1" in sass and "SB0, 0x0" in sass  # wait_group 1 (STAGES-2) and wait_group 0
    assert ca.staged_registers(fn) == set() and not any(op.startswith("LDG.") for op in ops)


@pytest.mark.parametrize("arch", ARCHS)
def test_register_staged_copy_passes_through_registers(cuda_builds, arch):
    b = cuda_builds[("cp_async", arch)]
    ops = S.opcodes(b.sass, "staged_tile_sums")
    assert ops["LDG.E.128.CONSTANT"] >= 2 and ops["STS.128"] >= 2 and not any(op.startswith("LDGSTS") for op in ops)
    # the register an LDG.128 fills is the one an STS.128 stores: the bytes go through the register file
    assert ca.staged_registers(S.split_functions(b.sass)["staged_tile_sums"])


@pytest.mark.parametrize("arch", ARCHS)
def test_cp_async_mbarrier_arrive_replaces_the_groups(cuda_builds, arch):
    b = cuda_builds[("cp_async", arch)]
    ops = S.opcodes(b.sass, "cp_async_mbarrier_tile_sums")
    arrive = [op for op in ops if op.startswith("ARRIVES.LDGSTSBAR.64")]
    assert arrive and ops["LDGSTS.E.BYPASS.LTC128B.128"] >= 2
    assert ops["LDGDEPBAR"] == 0 and ops["DEPBAR.LE"] == 0      # no commit groups, no group waits
    assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in b.ptx


@pytest.mark.parametrize("arch", ARCHS)
def test_ldmatrix_sass_per_kernel(cuda_builds, arch):
    sass = cuda_builds[("ldmatrix", arch)].sass
    want = {"ldmatrix_x1": "LDSM.16.M88", "ldmatrix_x2": "LDSM.16.M88.2", "ldmatrix_x4": "LDSM.16.M88.4",
            "ldmatrix_x1_trans": "LDSM.16.MT88", "ldmatrix_x2_trans": "LDSM.16.MT88.2", "ldmatrix_x4_trans": "LDSM.16.MT88.4"}
    for kernel, opcode in want.items():
        ldsm = {k: v for k, v in S.opcodes(sass, kernel).items() if k.startswith("LDSM")}
        assert ldsm == {opcode: 1}, (kernel, ldsm)


@pytest.mark.parametrize("arch", ARCHS)
def test_mma_sass_per_kernel(cuda_builds, arch):
    b = cuda_builds[("mma", arch)]
    assert ki.families(b.ptx, "ptx")["mma.sync"] >= 3  # one per kernel; nvcc unrolls mma_gemm's k loop
    assert S.opcodes(b.sass, "mma_m16n8k16_fragments")["HMMA.16816.F32"] == 1
    tile = S.opcodes(b.sass, "mma_m16n8k16_tile")
    assert tile["HMMA.16816.F32"] == 1 and tile["LDSM.16.M88.4"] == 1 and tile["LDSM.16.MT88.2"] == 1
    assert S.opcodes(b.sass, "mma_gemm")["HMMA.16816.F32"] >= 1


def test_split_functions_errors():
    with pytest.raises(ValueError, match="Function"):
        S.split_functions("no functions here")


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown architecture"):
        ki.compile_cuda("mma", arch="sm70")


# ---------------------------------------------------------------------------------------------
# stmatrix and movmatrix (kernels/cuda/stmatrix.cu), and the 8-bit transposing ldmatrix


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_stmatrix_writes_back_what_ldmatrix_read(num, trans):
    smem = torch.randperm(512, generator=torch.Generator().manual_seed(num)).to(torch.int16)
    rows = (torch.randperm(64, generator=torch.Generator().manual_seed(9))[:32] * 8).tolist()
    regs = F.ldmatrix(smem, rows, num, trans)
    out = F.stmatrix(torch.full((512,), -1, dtype=torch.int16), rows, regs, trans)
    touched = [rows[lane] + j for lane in range(8 * num) for j in range(8)]
    assert torch.equal(out[touched], smem[touched])
    assert (out[sorted(set(range(512)) - set(touched))] == -1).all()          # nothing else written


def test_stmatrix_x4_stores_an_a_fragment_as_a_row_major_tile():
    A = small_ints((16, 16), 21)
    out = F.stmatrix(torch.zeros(256, dtype=torch.float16), F.a_tile_addresses(), F.to_fragments(A, "a").reshape(32, 4, 2))
    assert torch.equal(out.reshape(16, 16), A)
    wrong = F.stmatrix(torch.zeros(256, dtype=torch.float16), F.a_tile_addresses(), F.to_fragments(A, "a").reshape(32, 4, 2),
                       trans=True)
    assert not torch.equal(wrong.reshape(16, 16), A)


def test_movmatrix_is_the_transposing_load_in_registers():
    M = torch.randperm(64, generator=torch.Generator().manual_seed(4)).to(torch.int16)
    rows = [8 * (lane % 8) for lane in range(32)]
    plain, transposed = F.ldmatrix(M, rows, 1)[:, 0], F.ldmatrix(M, rows, 1, trans=True)[:, 0]
    assert torch.equal(F.movmatrix(plain), transposed)
    assert torch.equal(F.movmatrix(F.movmatrix(plain)), plain)
    assert not torch.equal(F.movmatrix(plain), plain)


def test_stmatrix_and_movmatrix_bad_inputs():
    with pytest.raises(ValueError, match="regs must be"):
        F.stmatrix(torch.zeros(512, dtype=torch.int16), [0] * 32, torch.zeros(32, 4))
    with pytest.raises(ValueError, match="stmatrix: lane 3's row address 4"):
        F.stmatrix(torch.zeros(512, dtype=torch.int16), [0, 8, 16, 4] + [0] * 28, torch.zeros(32, 1, 2))
    with pytest.raises(ValueError, match="movmatrix: regs must be"):
        F.movmatrix(torch.zeros(32, 4))


def test_stmatrix_movmatrix_and_8bit_ldmatrix_sass():
    for arch in ("sm90", "sm100", "sm120"):
        sass = ki.compile_cuda("stmatrix", arch=arch).sass
        found = {k: {op: n for op, n in S.opcodes(sass, k).items() if op.startswith(("STSM", "MOVM", "STS"))}
                 for k in ("stmatrix_x4", "stmatrix_x4_trans", "movmatrix_trans")}
        assert found["stmatrix_x4"].get("STSM.16.M88.4") == 1 and found["stmatrix_x4_trans"].get("STSM.16.MT88.4") == 1
        assert found["movmatrix_trans"] == {"MOVM.16.MT88": 1}
    with pytest.raises(ki.CompileError, match="'stmatrix' requires .target sm_90"):
        ki.compile_cuda("stmatrix", arch="sm80")
    for arch in ("sm100", "sm120"):
        ops = S.opcodes(ki.compile_cuda("ldmatrix_b8", arch=arch).sass, "ldmatrix_b8_m16n16_trans")
        assert ops["LDSM.8.MT1616"] == 1
    with pytest.raises(ki.CompileError, match="'.m16n16' not supported on .target 'sm_90a'"):
        ki.compile_cuda("ldmatrix_b8", arch="sm90")


# ---------------------------------------------------------------------------------------------
# The accumulator reused as A (P in registers), the 8-bit m16n8k32 layouts, mma.sp: SASS and layouts


def _s_and_v(seed):
    Q, K, V = small_ints((16, 16), seed), small_ints((16, 16), seed + 1), small_ints((16, 8), seed + 2)
    kt = K.T.contiguous()
    q = F.to_fragments(Q, "a")
    s_left = F.mma_m16n8k16(q, F.to_fragments(kt[:, :8].contiguous(), "b"))
    s_right = F.mma_m16n8k16(q, F.to_fragments(kt[:, 8:].contiguous(), "b"))
    return Q, K, V, s_left, s_right


@pytest.mark.parametrize("seed", range(3))
def test_accumulators_are_the_next_a_fragment(seed):
    Q, K, V, s_left, s_right = _s_and_v(10 * seed)
    P = (Q.double() @ K.double().T).half()                   # exact: small integers
    assert torch.equal(F.c_to_a(s_left, s_right), F.to_fragments(P, "a"))
    o = F.mma_m16n8k16(F.c_to_a(s_left, s_right), F.to_fragments(V, "b"))
    assert torch.equal(F.from_fragments(o, "c"), (P.double() @ V.double()).float())


def test_an_interleaved_c_to_a_is_caught():
    Q, K, V, s_left, s_right = _s_and_v(7)
    wrong = torch.cat([s_left[:, :2], s_right[:, :2], s_left[:, 2:], s_right[:, 2:]], dim=1).half()
    P = (Q.double() @ K.double().T).half()
    assert not torch.equal(wrong, F.to_fragments(P, "a"))
    with pytest.raises(ValueError, match="c_left must be float32"):
        F.c_to_a(s_left.half(), s_right)


@pytest.mark.parametrize("op", ["a", "b"])
def test_8bit_k32_layout_is_the_16bit_layout_in_bytes(op):
    lay = F.mma_k32_layout(op)
    rows, cols = (16, 32) if op == "a" else (32, 8)
    assert sorted(r * cols + c for r, c in lay.reshape(-1, 2).tolist()) == list(range(rows * cols))
    assert F.register_bytes(lay, op, 1) == F.register_bytes(F.mma_layout(op), op, 2)
    r, q = (1, 2) if op == "a" else (0, 1)                   # two registers exchanged: a plausible misreading
    wrong = lay.copy()
    wrong[:, 4 * r:4 * r + 4], wrong[:, 4 * q:4 * q + 4] = lay[:, 4 * q:4 * q + 4], lay[:, 4 * r:4 * r + 4]
    assert F.register_bytes(wrong, op, 1) != F.register_bytes(F.mma_layout(op), op, 2)


def test_mma_k32_layout_bad_operand():
    with pytest.raises(ValueError, match="operand must be 'a' or 'b'"):
        F.mma_k32_layout("c")


@pytest.fixture(scope="module")
def reuse_builds():
    out = {("mma_reuse", arch): ki.compile_cuda("mma_reuse", arch=arch) for arch in ("sm80", "sm90", "sm120")}
    out.update({("mma_k32", arch): ki.compile_cuda("mma_k32", arch=arch) for arch in ("sm89", "sm90", "sm120")})
    return out


def test_p_in_registers_sass(reuse_builds):
    for arch in ("sm80", "sm90", "sm120"):
        ops = S.opcodes(reuse_builds[("mma_reuse", arch)].sass, "mma_p_in_registers")
        assert ops["HMMA.16816.F32"] == 3
        assert sum(n for op, n in ops.items() if op.startswith("F2FP") and op.endswith("PACK_AB")) == 4   # 8 f32 -> 4 f16x2
        assert not any(op.startswith(("SHFL", "LDS", "STS", "LDSM")) for op in ops), sorted(ops)     # no lane exchange


def test_fp8_and_sparse_k32_sass(reuse_builds):
    for arch in ("sm89", "sm120"):                            # native fp8 mma.sync
        ops = S.opcodes(reuse_builds[("mma_k32", arch)].sass, "mma_fp8_m16n8k32")
        assert ops["QMMA.16832.F32.E4M3.E4M3"] == 1 and not any(op.startswith("HMMA") for op in ops)
    ops = S.opcodes(reuse_builds[("mma_k32", "sm90")].sass, "mma_fp8_m16n8k32")
    assert ops["HMMA.16816.F32"] == 2 and ops["F2FP.F16.E4M3.UNPACK_B"] >= 8 and "QMMA.16832.F32.E4M3.E4M3" not in ops
    for arch in ("sm89", "sm90", "sm120"):
        assert S.opcodes(reuse_builds[("mma_k32", arch)].sass, "mma_sp_m16n8k32")["HMMA.SP.16832.F32"] == 1
    with pytest.raises(ki.CompileError, match="FP8 floating point type' requires .target sm_89"):
        ki.compile_cuda("mma_k32", arch="sm80")


# ---------------------------------------------------------------------------------------------
# On a GPU: the real instructions against the emulation and torch


@GPU
def test_gpu_mma_fragments_match_the_emulation():
    from kernels import cuda_launch

    mod = cuda_launch.load("mma")
    A, B = random_half((16, 16), 11), random_half((16, 8), 12)
    C = torch.randn(16, 8, generator=torch.Generator().manual_seed(13))
    a = F.pack_halves(F.to_fragments(A, "a")).cuda()
    b = F.pack_halves(F.to_fragments(B, "b")).cuda()
    c = F.to_fragments(C, "c").contiguous().cuda()
    d = torch.empty(32, 4, device="cuda")
    mod.launch("mma_m16n8k16_fragments", 1, 32, a, b, c, d)
    # the emulation rounds the exact sum once; the tensor core's own summation order and rounding
    # differ, so random inputs are checked by the baseline rule against torch's fp32 product
    want = F.mma_m16n8k16(F.to_fragments(A, "a"), F.to_fragments(B, "b"), F.to_fragments(C, "c"))
    base = F.to_fragments(A.float() @ B.float() + C, "c")
    assert_close(d.cpu(), want, dtype=torch.float32, baseline=base)
    # exactly representable inputs: the fragments must match the emulation bit for bit
    A, B, C = small_ints((16, 16), 14), small_ints((16, 8), 15), small_ints((16, 8), 16).float()
    a = F.pack_halves(F.to_fragments(A, "a")).cuda()
    b = F.pack_halves(F.to_fragments(B, "b")).cuda()
    mod.launch("mma_m16n8k16_fragments", 1, 32, a, b, F.to_fragments(C, "c").contiguous().cuda(), d)
    assert torch.equal(d.cpu(), F.mma_m16n8k16(F.to_fragments(A, "a"), F.to_fragments(B, "b"), F.to_fragments(C, "c")))
    assert torch.equal(F.from_fragments(d.cpu(), "c"), A.float() @ B.float() + C)


@GPU
def test_gpu_mma_tile_and_gemm_match_torch():
    from kernels import cuda_launch

    mod = cuda_launch.load("mma")
    A, B = small_ints((16, 16), 21), small_ints((16, 8), 22)
    C = small_ints((16, 8), 23).float()
    D = torch.empty(16, 8, device="cuda")
    mod.launch("mma_m16n8k16_tile", 1, 32, A.cuda(), B.cuda(), C.cuda(), D)
    assert torch.equal(D.cpu(), A.float() @ B.float() + C)
    M, N, K = 48, 24, 80
    A, B = random_half((M, K), 24).cuda(), random_half((K, N), 25).cuda()
    D = torch.empty(M, N, device="cuda")
    mod.launch("mma_gemm", (N // 8, M // 16), 32, A, B, D, M, N, K)
    exact = A.cpu().double() @ B.cpu().double()
    assert_close(D.cpu(), exact, dtype=torch.float32, baseline=A.cpu().float() @ B.cpu().float())


@GPU
@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_gpu_ldmatrix_matches_the_emulation(num, trans):
    from kernels import cuda_launch

    mod = cuda_launch.load("ldmatrix")
    smem = _smem(num)
    rows = (torch.randperm(64, generator=torch.Generator().manual_seed(3))[:32] * 8).int()
    out = torch.zeros(32 * num, dtype=torch.int32, device="cuda")
    mod.launch(f"ldmatrix_x{num}" + ("_trans" if trans else ""), 1, 32, smem.cuda(), rows.cuda(), out)
    want = F.pack_halves(F.ldmatrix(smem, rows.tolist(), num, trans).reshape(32, 2 * num))
    assert torch.equal(out.cpu().reshape(32, num), want)


@GPU
@pytest.mark.parametrize("n_tiles, tail", [(1, 0), (2, 300), (9, 1), (9, 511)])
def test_gpu_cp_async_tile_sums(n_tiles, tail):
    from kernels import cuda_launch

    mod = cuda_launch.load("cp_async")
    blocks, tile = 5, 512
    n = n_tiles * tile - tail                      # elements read per block; the rest are NaN canaries
    x = torch.randn(blocks, n_tiles, tile, device="cuda")
    x.view(blocks, -1)[:, n:] = float("nan")
    out = torch.empty(blocks, n_tiles, device="cuda")
    mod.launch("cp_async_tile_sums", blocks, 128, x, out, n_tiles, n)
    rows = x.cpu().reshape(blocks, -1).clone()
    rows[:, n:] = 0.0
    tiles = rows.reshape(-1, tile)
    assert_close(out.cpu().reshape(-1), tiles.double().sum(1), dtype=torch.float32, baseline=ca.tile_sums_ref(tiles))
    for b in range(blocks):
        assert_close(ca.pipelined_tile_sums(x.cpu()[b], 3, n=n), tiles[b * n_tiles:(b + 1) * n_tiles].double().sum(1),
                     dtype=torch.float32, baseline=ca.tile_sums_ref(x.cpu()[b], n))


@GPU
@pytest.mark.parametrize("kernel", ["staged_tile_sums", "cp_async_mbarrier_tile_sums"])
@pytest.mark.parametrize("n_tiles", [1, 2, 9])
def test_gpu_cp_async_variants(kernel, n_tiles):
    from kernels import cuda_launch

    mod = cuda_launch.load("cp_async")
    blocks, tile = 5, 512
    x = torch.randn(blocks, n_tiles, tile, device="cuda")
    out = torch.empty(blocks, n_tiles, device="cuda")
    mod.launch(kernel, blocks, 128, x, out, n_tiles)
    tiles = x.cpu().reshape(-1, tile)
    assert_close(out.cpu().reshape(-1), tiles.double().sum(1), dtype=torch.float32, baseline=ca.tile_sums_ref(tiles))


# ---------------------------------------------------------------------------------------------
# ptxas probes: what each architecture accepts


EXPECTED_SUPPORT = {  # sm_80, sm_90a, sm_100a, sm_120a, as the PTX ISA's target notes say
    "ldmatrix": "YYYY", "mma.sync f16": "YYYY", "cp.async": "YYYY", "mma.sync bf16": "YYYY", "mma.sync tf32": "YYYY",
    "wgmma": ".Y..", "wgmma fp8": ".Y..", "TMA": ".YYY", "clusters": ".YYY", "distributed smem": ".YYY",
    "setmaxnreg": ".YYY", "tcgen05.mma": "..Y.", "TMEM": "..Y.", "two-CTA MMA": "..Y.", "FP6/FP4 tcgen05": "..Y.",
    "FP4 convert": "..YY", "FP6/FP4 mma.sync": "...Y",
}


def test_support_matrix_matches_the_documented_targets():
    from kernels.ptx import probe as P

    matrix = P.support_matrix()
    assert set(matrix) == set(EXPECTED_SUPPORT)
    got = {k: "".join("Y" if p.accepted else "." for p in row.values()) for k, row in matrix.items()}
    assert got == EXPECTED_SUPPORT
    assert "not supported on .target 'sm_120a'" in matrix["wgmma"]["sm_120a"].message


def test_probe_rejects_a_made_up_instruction(monkeypatch):
    from kernels.ptx import probe as P

    fake = P.Feature("fake", "sm80", "not an instruction", "mma.sync.aligned.m99n8k16.row.col.f32.f16.f16.f32 {f0};", "x")
    monkeypatch.setattr(P, "FEATURES", P.FEATURES + (fake,))
    assert not P.probe("fake", "sm80").accepted
    assert not P.support_matrix(archs=("sm80",), keys=["fake"])["fake"]["sm_80"].accepted
    with pytest.raises(KeyError, match="unknown feature"):
        P.probe("nope", "sm80")
    with pytest.raises(ValueError, match="unknown architecture"):
        P.probe("cp.async", "sm70")


# ---------------------------------------------------------------------------------------------
# mma_gemm, bank conflicts, the lab's mapping check


def test_emulated_gemm_matches_torch():
    A, B = random_half((48, 80), 31), random_half((80, 24), 32)
    assert_close(F.mma_gemm(A, B), A.double() @ B.double(), dtype=torch.float32, baseline=A.float() @ B.float())
    with pytest.raises(ValueError, match="M % 16"):
        F.mma_gemm(random_half((20, 16), 0), random_half((16, 8), 0))


def test_bank_conflicts():
    assert F.ldmatrix_bank_conflicts([16 * r for r in range(32)]) == 1          # packed rows
    assert F.ldmatrix_bank_conflicts([128 * r for r in range(32)]) == 8         # 128-byte row stride
    assert F.ldmatrix_bank_conflicts([128 * r + 16 * (r % 8) for r in range(32)]) == 1  # XOR-style swizzle
    assert F.ldmatrix_bank_conflicts([64 * r for r in range(32)]) == 4


def test_product_through_mapping_accepts_the_isa_and_rejects_a_wrong_mapping():
    A, B = small_ints((16, 16), 41), small_ints((16, 8), 42)
    isa_a = lambda lane, i: tuple(F.mma_layout("a")[lane, i])  # noqa: E731
    assert torch.equal(F.product_through_mapping(A, B, a_index=isa_a), A.float() @ B.float())
    wrong_c = lambda lane, i: ((lane >> 2) + 8 * (i % 2), 2 * (lane % 4) + i // 2)  # noqa: E731
    assert not torch.equal(F.product_through_mapping(A, B, c_index=wrong_c), A.float() @ B.float())
    with pytest.raises(ValueError, match="held"):
        F.product_through_mapping(A, B, b_index=lambda lane, i: (0, 0))
    with pytest.raises(TypeError, match="must return"):
        F.product_through_mapping(A, B, b_index=lambda lane, i: 3)


def test_matmul_needs_divisibility_hints_for_cp_async():
    # the foundation's quick compile saw no LDGSTS: the strides were not known to be multiples of 16
    from kernels.gemm.matmul import _matmul_kernel

    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
           "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32", "stride_cm": "i32", "stride_cn": "i32"}
    tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
    plain = ki.compile_triton(_matmul_kernel, sig, arch="sm80", constexprs=tiles)
    assert plain.families("sass")["LDGSTS"] == 0


def test_missing_ptxas_is_a_clear_error(monkeypatch):
    from kernels.ptx import probe as P

    def missing(name):
        raise ki.ToolMissingError(f"{name} not found: install the pip package ...")

    monkeypatch.setattr(P.kinspect, "tool", missing)
    with pytest.raises(ki.ToolMissingError, match="ptxas not found"):
        P.probe("cp.async", "sm80")


def test_cuda_launch_without_a_gpu_says_so():
    from kernels import cuda_launch

    if runtime.runtime().on_gpu:
        pytest.skip("a GPU is present: the loader is exercised by the GPU tests")
    with pytest.raises(cuda_launch.NoCudaError, match="no CUDA GPU"):
        cuda_launch.load("mma")


def test_cuda_launch_argument_checks():
    from kernels import cuda_launch

    assert cuda_launch._dim3(4) == (4, 1, 1) and cuda_launch._dim3((2, 3)) == (2, 3, 1)
    with pytest.raises(ValueError, match="grid and block"):
        cuda_launch._dim3((0, 1))
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_launch._argument(torch.zeros(2))
    with pytest.raises(TypeError, match="cannot pass"):
        cuda_launch._argument("text")
    assert cuda_launch._argument(3).value == 3 and abs(cuda_launch._argument(0.5).value - 0.5) < 1e-9


@GPU
def test_gpu_occupancy_calculator_agrees_with_the_driver():
    from kernels import cuda_launch
    from kernels.gpu import hardware as hw

    arch = cuda_launch.device_arch()
    table = {g.arch: g for g in hw.GPUS.values()}
    if arch not in table:
        pytest.skip(f"this GPU ({arch}) has no entry in kernels.gpu.hardware")
    g = table[arch]
    mod = cuda_launch.load("cp_async")
    regs = mod.attribute("cp_async_tile_sums", "registers")
    smem = mod.attribute("cp_async_tile_sums", "shared_bytes")
    for threads in (128,):
        for dynamic in (0, 16 * 1024, 40 * 1024):   # static + dynamic stays under the 48 KiB default limit
            want = mod.max_active_blocks("cp_async_tile_sums", threads, dynamic)
            assert hw.occupancy(g, threads, regs, smem + dynamic).blocks_per_sm == want, (threads, dynamic, regs, smem)


@GPU
def test_gpu_p_in_registers_matches_the_emulation():
    from kernels import cuda_launch

    mod = cuda_launch.load("mma_reuse")
    Q, K, V, s_left, s_right = _s_and_v(3)
    kt = K.T.contiguous()
    kf = torch.cat([F.pack_halves(F.to_fragments(kt[:, :8].contiguous(), "b")),
                    F.pack_halves(F.to_fragments(kt[:, 8:].contiguous(), "b"))], dim=1)
    out = torch.empty(32, 4, device="cuda")
    mod.launch("mma_p_in_registers", 1, 32, F.pack_halves(F.to_fragments(Q, "a")).cuda(), kf.contiguous().cuda(),
               F.pack_halves(F.to_fragments(V, "b")).cuda(), out)
    assert torch.equal(out.cpu(), F.mma_m16n8k16(F.c_to_a(s_left, s_right), F.to_fragments(V, "b")))


@GPU
def test_gpu_stmatrix_and_movmatrix_match_the_emulation():
    from kernels import cuda_launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("stmatrix needs sm90 or later")
    mod = cuda_launch.load("stmatrix")
    smem = torch.randperm(512, generator=torch.Generator().manual_seed(2)).to(torch.int16)
    rows = (torch.randperm(64, generator=torch.Generator().manual_seed(3))[:32] * 8).tolist()
    for kernel, trans in (("stmatrix_x4", False), ("stmatrix_x4_trans", True)):
        regs = F.ldmatrix(smem, rows, 4, trans)
        out = torch.empty(512, dtype=torch.int16, device="cuda")
        mod.launch(kernel, 1, 32, regs.contiguous().view(torch.int32).reshape(32, 4).cuda(),
                   torch.tensor(rows, dtype=torch.int32).cuda(), out)
        want = F.stmatrix(torch.full((512,), -1, dtype=torch.int16), rows, regs, trans)
        assert torch.equal(out.cpu(), want)
    plain = F.ldmatrix(smem[:64], [8 * (lane % 8) for lane in range(32)], 1)[:, 0]
    got = torch.empty(32, dtype=torch.int32, device="cuda")
    mod.launch("movmatrix_trans", 1, 32, plain.contiguous().view(torch.int32).reshape(32).cuda(), got)
    assert torch.equal(got.cpu().view(torch.int16).reshape(32, 2), F.movmatrix(plain))
