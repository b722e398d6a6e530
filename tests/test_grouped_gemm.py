"""kernels.moe.grouped_gemm: the grouped GEMM over uneven expert loads (gather and sorted forms,
forward and backward) against a per-expert loop, its tile schedule, and its sm90 builds at
Mixtral and DeepSeek-V3 widths."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.moe import grouped_gemm as gg
from kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_ref, tile_schedule
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
BM = gg.TILES["cpu"][0]


def _problem(loads, K, N, k=1, dtype=torch.float32, seed=0):
    """Tokens x (T, K), weights (E, K, N), and a routing whose expert loads are ``loads``."""
    g = torch.Generator().manual_seed(seed)
    E, M = len(loads), sum(loads)
    T = -(-M // k)
    x = torch.randn(T, K, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(E, K, N, generator=g, dtype=torch.float64) / K**0.5).to(dtype)
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(loads).cumsum(0)
    rows = torch.randint(0, T, (M,), generator=g)                  # any token may appear in any expert
    return x, w, offsets, rows


LOADS = {
    "uneven, one empty expert": [7, 0, 40, 1, BM, BM + 1],
    "smaller than one block": [3, 2],
    "all rows to one expert": [0, 0, 75, 0],
}


@pytest.mark.parametrize("label", LOADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gather", [True, False])
def test_forward_matches_per_expert_loop(label, dtype, gather):
    x, w, offsets, rows = _problem(LOADS[label], K=40, N=72, dtype=dtype)
    a = x if gather else x[rows]
    r = rows if gather else None
    got = grouped_gemm(nan_canary(a, rows=True), nan_canary(w), offsets, rows=r)
    want = grouped_gemm_ref(a, w, offsets, r)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_close(got, want.to(dtype))
    else:
        assert_close(got.float(), want, dtype=dtype, baseline=_low_precision_loop(a, w, offsets, r))


def _low_precision_loop(a, w, offsets, rows):
    """PyTorch's own per-expert loop in the low dtype (the baseline of the FlashAttention test rule)."""
    out = torch.zeros(int(offsets[-1]), w.shape[2], dtype=a.dtype)
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            out[lo:hi] = (a[rows[lo:hi]] if rows is not None else a[lo:hi]) @ w[e]
    return out.float()


@pytest.mark.parametrize("gather", [True, False])
def test_backward_matches_autograd_of_the_loop(gather):
    x, w, offsets, rows = _problem([5, 0, 41, 17], K=36, N=50, k=2, seed=3)
    a = x if gather else x[rows]
    r = rows if gather else None
    dy = torch.randn(int(offsets[-1]), 50, generator=torch.Generator().manual_seed(4))
    a1, w1 = a.clone().requires_grad_(), w.clone().requires_grad_()
    (grouped_gemm(a1, w1, offsets, rows=r) * dy).sum().backward()
    a2, w2 = a.double().requires_grad_(), w.double().requires_grad_()
    (grouped_gemm_ref(a2, w2, offsets, r) * dy.double()).sum().backward()
    assert_close(a1.grad, a2.grad.float())
    assert_close(w1.grad, w2.grad.float())
    assert bool((w1.grad[1] == 0).all())                           # the empty expert gets no gradient


def test_schedule_covers_every_row_once_and_never_straddles_experts():
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        E = int(torch.randint(1, 9, (1,), generator=g))
        loads = torch.randint(0, 3 * BM, (E,), generator=g)
        offsets = torch.zeros(E + 1, dtype=torch.long)
        offsets[1:] = loads.cumsum(0)
        M = int(offsets[-1])
        expert, start, end = tile_schedule(offsets, M, BM)
        assert len(expert) == gg.num_tile_slots(M, E, BM)
        covered = torch.zeros(M, dtype=torch.long)
        for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist()):
            assert t - s <= BM and (t == s or offsets[e] <= s < t <= offsets[e + 1])
            covered[s:t] += 1
        assert bool((covered == 1).all())


def test_broken_schedule_is_caught():
    """Tiles of BLOCK_M consecutive sorted rows straddle expert boundaries: caught by the loop reference."""
    x, w, offsets, rows = _problem([7, 30, 3, BM + 5], K=24, N=40)
    want = grouped_gemm_ref(x, w, offsets, rows)
    assert_close(grouped_gemm(x, w, offsets, rows=rows), want)
    with pytest.raises(MismatchError):
        assert_close(grouped_gemm(x, w, offsets, rows=rows, aligned=False), want)


def test_broken_weight_gradient_is_caught():
    """The weight-gradient kernel given another split of the rows (uniform loads) is caught."""
    x, w, offsets, rows = _problem([2, 50, 9], K=20, N=30, seed=6)
    dy = torch.randn(int(offsets[-1]), 30, generator=torch.Generator().manual_seed(7))
    w2 = w.double().requires_grad_()
    (grouped_gemm_ref(x.double(), w2, offsets, rows) * dy.double()).sum().backward()
    assert_close(gg._wgrad(x, rows, dy, offsets, w.shape, w.dtype), w2.grad.float())
    uniform = torch.tensor([0, 20, 40, 61])
    with pytest.raises(MismatchError):
        assert_close(gg._wgrad(x, rows, dy, uniform, w.shape, w.dtype), w2.grad.float())


def test_no_rows():
    w = torch.randn(2, 8, 8)
    assert grouped_gemm(torch.randn(0, 8), w, torch.zeros(3, dtype=torch.long)).shape == (0, 8)


def test_bad_input_refused():
    x, w, offsets, rows = _problem([3, 4], K=8, N=6)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_gemm(x.half(), w, offsets, rows=rows)
    with pytest.raises(ValueError, match="K=7 columns"):
        grouped_gemm(x[:, :7], w, offsets, rows=rows)
    with pytest.raises(ValueError, match=r"offsets must be int64 of shape \(E \+ 1,\)"):
        grouped_gemm(x, w, offsets[:-1], rows=rows)
    with pytest.raises(ValueError, match="never decrease"):
        grouped_gemm(x, w, torch.tensor([0, 5, 4]), rows=rows[:4])
    with pytest.raises(ValueError, match="index the"):
        grouped_gemm(x, w, offsets, rows=rows + 100)
    with pytest.raises(ValueError, match="pass rows= to gather"):
        grouped_gemm(x[:5], w, offsets)
    with pytest.raises(ValueError, match="w must be a tensor of"):
        grouped_gemm(x, w.double(), offsets, rows=rows)


def test_slot_table_reads_each_expert_from_its_cache_slot():
    """``slot_of`` maps expert e to slot slot_of[e] of a smaller weight buffer (an expert cache)."""
    x, w, offsets, rows = _problem([9, 0, 33, 4], K=24, N=40, seed=8)
    slot_of = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    cache = torch.stack([w[2], w[3], w[0]])                              # slots 0, 1, 2 hold experts 2, 3, 0
    got = gg._forward(x, cache, rows, offsets, int(offsets[-1]), slot_of=slot_of.clamp(min=0))
    assert_close(got, grouped_gemm_ref(x, w, offsets, rows))


# ---------------------------------------------------------------------------------------------- AOT

@pytest.fixture(scope="module")
def sm90_builds():
    jobs = gg.compile_jobs()
    # broken variant for the spill check: a 256 x 256 tile on 4 warps holds 512 fp32 accumulators a thread
    import dataclasses
    fwd = jobs["grouped_gemm forward Mixtral gate+up, 4096 tokens top-2"]
    jobs["grouped_gemm, 256x256 tile"] = dataclasses.replace(fwd, constexprs=dict(fwd.constexprs, BLOCK_M=256, BLOCK_N=256))
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm90",))
    return {label: b["sm90"] for label, b in zip(jobs, builds)}, jobs


def test_compile_jobs_are_derived_from_the_launch():
    """launch_job on the launcher's own arguments (meta tensors at Mixtral's and DeepSeek-V3's widths):
    unit strides become constexprs, widths and row strides carry %16, UPCAST is off as on a GPU."""
    for label, job in gg.compile_jobs().items():
        spec = job.specialization().splitlines()
        assert "stride_ak: =1" in spec and "K: i32 %16" in spec and "N: i32 %16" in spec, label
        assert "stride_am: i32 %16" in spec, label
        assert job.constexprs["UPCAST"] is False and job.constexprs["GATHER"] is ("gate+up" in label), label


def test_sm90_builds_do_not_spill_and_use_wgmma(sm90_builds):
    builds, _ = sm90_builds
    table = ki.resource_table(list(builds.items()))
    for label, b in builds.items():
        if "256x256" in label:
            continue
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, f"{label} spills\n{table}"
        fam = b.families()
        assert fam["HGMMA"] > 0 and fam["LDGSTS"] > 0, f"{label}: {dict(fam)}"
    assert max(K * N for _, K, N in gg.REAL_WIDTHS.values()) < 2**31     # one expert's W: int32 offsets suffice


def test_sm90_spill_check_catches_an_oversized_tile(sm90_builds):
    builds, _ = sm90_builds
    assert builds["grouped_gemm, 256x256 tile"].spills > 0


def _param_widths(build, job, arg):
    """64 if the argument is sign-extended into a 64-bit product in the PTX, 32 if it enters a 32-bit one."""
    runtime_args = [n for n in job.kernel.arg_names if n not in job.constexprs]   # the PTX numbers the runtime args
    return ki.param_product_widths(build, runtime_args.index(arg))


def test_ptx_uses_64bit_products_for_token_rows_and_experts(sm90_builds):
    """row * stride_am passes 2**31 at 524,288 Mixtral tokens (4096 wide); e * stride_we at DeepSeek-V3's
    256 experts of 7168 x 2048: both products are 64-bit in the PTX; inside one expert W's offsets stay 32-bit."""
    builds, jobs = sm90_builds
    label = "grouped_gemm forward Mixtral gate+up, 4096 tokens top-2"
    fwd, job = builds[label], jobs[label]
    assert 524288 * 4096 == 2**31 and 255 * 7168 * 4096 > 2**31
    for arg in ("stride_am", "stride_we", "stride_cm"):
        assert _param_widths(fwd, job, arg) == {64}, arg
    assert 32 in _param_widths(fwd, job, "stride_wk")
