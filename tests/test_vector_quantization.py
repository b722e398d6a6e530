"""kernels.quant.incoherence, e8, aqlm: rotations are orthogonal and leave X W^T unchanged, they shrink a
planted outlier's mu; the E8 decoder equals brute force (a D8-only decoder is caught); AQLM's learning
never increases its error, Frobenius or Hessian-weighted; the codebook-decoding kernel equals
dequantize-then-matmul with uint8 and 16-bit codes (first-codebook-only, group-shifted and low-byte
variants caught); bad input; AOT at Llama-3-8B sizes including 1x16 (no spills on sm90a); E8P rounding
equals brute force over its 2^16 points; Block LDLQ (QuIP#)."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels.quant import aqlm, e8, quip
from kernels.quant import incoherence as inc
from kernels.testing import assert_close


@pytest.mark.parametrize("n", [1, 8, 128, 352, 12])
def test_rotations_are_orthogonal(n):
    q = inc.random_orthogonal(n, seed=3)
    assert (q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12


def test_rotating_weights_and_inputs_leaves_the_layer_unchanged():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g, dtype=torch.float64)
    x = torch.randn(7, 40, generator=g, dtype=torch.float64)
    u, v = inc.rotations(w, seed=1)
    w_rot = inc.rotate_weight(w, u, v)
    assert (inc.rotated_matmul(x, w_rot, u, v) - x @ w.T).abs().max() < 1e-12
    assert (inc.unrotate_weight(w_rot, u, v) - w).abs().max() < 1e-12
    # rotating the weights but not the inputs is caught
    assert (x @ w_rot.T @ u - x @ w.T).abs().max() > 0.1


def test_rotation_shrinks_a_planted_outlier():
    w = inc.planted_outliers(128, 128, n_outliers=4, scale=40.0, seed=0)
    u, v = inc.rotations(w, seed=0)
    before, after = inc.mu_weight(w), inc.mu_weight(inc.rotate_weight(w, u, v))
    assert before > 30 and after < 6
    H = torch.diag(torch.arange(1.0, 65.0, dtype=torch.float64))   # eigenvectors on the input channels: mu = 8
    _, v64 = inc.rotations(torch.zeros(1, 64))
    assert abs(inc.mu_hessian(H) - 8) < 1e-9 and abs(inc.mu_hessian(inc.rotate_hessian(H, v64)) - 1) < 1e-6


def test_e8_decoder_equals_brute_force():
    x = torch.rand(3000, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.5
    fast, slow = e8.nearest_e8(x), e8.nearest_e8_brute(x)
    d_fast, d_slow = ((x - fast) ** 2).sum(1), ((x - slow) ** 2).sum(1)
    assert (d_fast - d_slow).abs().max() < 1e-12
    assert bool(((fast.sum(1) % 2 == 0) | ((fast - 0.5).sum(1) % 2 == 0)).all())   # every result is in E8
    # the broken decoder that searches D8 only (forgets the coset D8 + 1/2) is caught
    d8 = e8.nearest_d8(x)
    assert bool((((x - d8) ** 2).sum(1) > d_slow + 1e-9).any())


def test_e8_beats_z8_at_the_same_density():
    """Both lattices have one point per unit volume; E8's MSE per coordinate is its normalized second
    moment 929/12960 = 0.0717 (Conway and Sloane), Z's is 1/12."""
    y = torch.rand(100_000, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 20
    mse = ((y - e8.nearest_e8(y)) ** 2).mean().item()
    assert abs(mse - 929 / 12960) < 0.002 and mse < 0.9 / 12


def test_e8_bad_input():
    with pytest.raises(ValueError, match="last dimension must be 8"):
        e8.nearest_e8(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"\|x_i\| must be <= 1/2"):
        e8.nearest_e8_brute(torch.ones(1, 8))


def _learned(N=32, K=64, g=8, M=2, B=5, iters=4, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return w, *aqlm.learn(w, g, M, B, iters=iters, seed=seed)


def test_learning_never_increases_the_error_and_more_codebooks_help():
    w, q1, e1 = _learned(M=1)
    _, q2, e2 = _learned(M=2)
    for errs in (e1, e2):
        assert all(b <= a + 1e-9 for a, b in zip(errs, errs[1:])), errs
    assert e2[-1] < 0.8 * e1[-1]
    scaled = w / q2.scales[:, None]
    assert abs(((scaled - aqlm.dequantize(q2) / q2.scales[:, None]) ** 2).sum().item() - e2[-1]) < 1e-9


def test_least_squares_codebooks_are_optimal_for_fixed_codes():
    w, q, _ = _learned(M=2, iters=2)
    v = (w / q.scales[:, None]).reshape(-1, 8)
    codes = q.codes.reshape(-1, 2)
    best = aqlm.update_codebooks(v, codes, 32)
    err = lambda cb: ((v - cb[0][codes[:, 0]] - cb[1][codes[:, 1]]) ** 2).sum()   # noqa: E731
    for seed in range(3):
        nudged = best + 1e-3 * torch.randn(best.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert err(best) < err(nudged)


def test_bits_per_weight():
    # 4096 x 4096 at g = 8, M = 2, B = 8: 2 bits of codes + 2 x 256 x 8 fp16 + 4096 fp16 scales
    assert abs(aqlm.bits_per_weight(4096, 4096, 8, 2, 8) - (2 + (2 * 256 * 8 * 16 + 16 * 4096) / 4096 ** 2)) < 1e-12
    # AQLM's 1x16: one 2^16 x 8 fp16 codebook (1 MiB) per matrix is 0.5 bit/weight at 4096 x 4096 and
    # 0.29 over Llama-2-7B's seven projections per layer; 2x8 (two 256 x 8) is 0.0023
    assert aqlm.codebook_bits_per_weight([(4096, 4096)], 8, 1, 16) == 0.5
    layer = sum(N * K for N, K in aqlm.LLAMA2_7B_LAYER)
    assert layer == 4 * 4096 ** 2 + 3 * 11008 * 4096
    assert abs(aqlm.codebook_bits_per_weight(aqlm.LLAMA2_7B_LAYER, 8, 1, 16) - 7 * 2 ** 16 * 8 * 16 / layer) < 1e-12
    assert 0.289 < aqlm.codebook_bits_per_weight(aqlm.LLAMA2_7B_LAYER, 8, 1, 16) < 0.291
    assert 0.0022 < aqlm.codebook_bits_per_weight(aqlm.LLAMA2_7B_LAYER, 8, 2, 8) < 0.0023


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_reads_16_bit_codes(dtype):
    """AQLM's 1x16 format: int16 codes (half of them negative as int16) into a 2^16-row codebook; reading
    only their low byte (as if they were uint8) is caught. x is a view into a NaN-filled buffer: a read
    past its rows or columns would show up as NaN."""
    g = torch.Generator().manual_seed(6)
    N, K = 40, 64
    q = aqlm.Quantized(torch.randint(0, 2 ** 16, (N, K // 8, 1), generator=g),
                       torch.randn(1, 2 ** 16, 8, generator=g, dtype=torch.float64),
                       torch.rand(N, generator=g, dtype=torch.float64) + 0.5)
    codes, books, scales = aqlm.to_kernel_format(q, dtype)
    assert codes.dtype == torch.int16 and bool((codes < 0).any()) and bool((codes.long() & 0xFFFF == q.codes).all())
    buf = torch.full((16, K + 8), float("nan"), dtype=dtype)          # canaries: rows 7.. and columns K..
    x = buf[:7, :K]                                                    # (7, K) view, row stride K + 8
    x.copy_(torch.randn(7, K, generator=g).to(dtype))
    ref = aqlm.aqlm_matmul_ref(x, aqlm.Quantized(q.codes, books.double(), scales.double())).to(dtype)
    y = aqlm.aqlm_matmul(x, codes, books, scales)
    assert not y.isnan().any()
    assert_close(y, ref, dtype=dtype)
    with pytest.raises(AssertionError):
        assert_close(aqlm.aqlm_matmul(x, codes, books, scales, _low_byte=True), ref, dtype=dtype)


def test_hessian_objective_never_increases_and_beats_frobenius():
    g = torch.Generator().manual_seed(7)
    N, K = 24, 32
    w = torch.randn(N, K, generator=g, dtype=torch.float64)
    x = torch.randn(200, K, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, K, dtype=torch.float64)
    x[:, :4] += 2 * x[:, 4:8]                                          # correlated inputs: H not diagonal
    H = x.T @ x
    q_f, _ = aqlm.learn(w, 4, 2, 4, iters=3)
    q_h, errs = aqlm.learn_hessian(w, H, 4, 2, 4, iters=3, start=q_f)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(errs, errs[1:])), errs
    assert errs[0] == aqlm.hessian_error(w, q_f, H) and errs[-1] < 0.7 * errs[0]
    # the H-weighted codebooks are optimal for their codes: any nudge increases the output error
    v = w / q_h.scales[:, None]
    best = aqlm.update_codebooks_hessian(v, q_h.codes, 16, H, q_h.scales ** 2)
    err = lambda cb: aqlm.hessian_error(w, aqlm.Quantized(q_h.codes, cb, q_h.scales), H)   # noqa: E731
    for seed in range(3):
        nudge = 1e-3 * torch.randn(best.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert err(best) < err(best + nudge)
    # the code step is exact coordinate descent: re-picking any one code cannot do better
    codes = aqlm.assign_codes_hessian(v, best, q_h.codes, H)
    base = err_c = aqlm.hessian_error(w, aqlm.Quantized(codes, best, q_h.scales), H)
    for n, j, m in ((0, 0, 0), (5, 3, 1), (23, 7, 0)):
        for c in range(16):
            alt = codes.clone()
            alt[n, j, m] = c
            err_c = min(err_c, aqlm.hessian_error(w, aqlm.Quantized(alt, best, q_h.scales), H))
    assert err_c >= base - 1e-9 * base


@pytest.mark.parametrize("dtype,T,M", [(torch.float32, 5, 2), (torch.float16, 16, 1), (torch.float32, 1, 3)])
def test_kernel_equals_dequantize_then_matmul(dtype, T, M):
    w, q, _ = _learned(N=40, K=64, M=M, B=4, iters=1)
    codes, books, scales = aqlm.to_kernel_format(q, dtype)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = aqlm.aqlm_matmul_ref(x, aqlm.Quantized(codes.long(), books.double(), scales.double()))
    assert_close(aqlm.aqlm_matmul(x, codes, books, scales), ref.to(dtype), dtype=dtype)


@pytest.mark.parametrize("broken", [dict(_first_book_only=True), dict(_group_shift=1)])
def test_broken_kernels_are_caught(broken):
    w, q, _ = _learned(N=40, K=64, M=2, B=4, iters=1)
    codes, books, scales = aqlm.to_kernel_format(q, torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    ref = aqlm.aqlm_matmul_ref(x, aqlm.Quantized(codes.long(), books.double(), scales.double())).float()
    with pytest.raises(AssertionError):
        assert_close(aqlm.aqlm_matmul(x, codes, books, scales, **broken), ref, dtype=torch.float32)


def test_bad_input():
    w, q, _ = _learned(N=40, K=64, M=2, B=4, iters=1)
    codes, books, scales = aqlm.to_kernel_format(q, torch.float32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="K / g = 48/8"):
        aqlm.aqlm_matmul(x[:, :48], codes, books, scales)
    with pytest.raises(ValueError, match="codes must be .* uint8"):
        aqlm.aqlm_matmul(x, codes.long(), books, scales)
    with pytest.raises(ValueError, match=r"2\^B <= 256 for torch.uint8 codes"):
        aqlm.aqlm_matmul(x, codes, torch.zeros(2, 512, 8), scales)
    with pytest.raises(ValueError, match="at most 2\\^16 codewords"):
        aqlm.code_dtype(2 ** 17)
    with pytest.raises(ValueError, match=r"scales must be \(N,\)"):
        aqlm.aqlm_matmul(x, codes, books, scales[:-1])
    with pytest.raises(ValueError, match="group size g=8 does not divide K=60"):
        aqlm.learn(torch.zeros(4, 60), 8, 1, 4)
    with pytest.raises(ValueError, match="B must be in 1..8"):
        aqlm.learn(torch.zeros(4, 64), 8, 1, 9)


@pytest.fixture(scope="module")
def builds():
    jobs = aqlm.compile_jobs()
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_aot_at_llama3_8b_sizes_no_spills(builds):
    table = ki.resource_table([(label, b) for label, bb in builds.items() for b in bb.values()])
    assert len(builds) == 6 and any("M1 B16" in label for label in builds)
    for label, bb in builds.items():
        b = bb["sm90"]
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, f"{label}\n{table}"
        assert b.tensor_core == "HMMA", f"{label}: BLOCK_M = 16 is below wgmma's 64 rows\n{table}"


def test_launch_job_is_the_launch():
    job = aqlm.launch_job(1, 4096, 4096, 8, 2, 8)
    assert job.grid == (1, 64) and job.programs == 64
    spec = job.specialization().splitlines()
    for line in ("T: =1", "stride_xk: =1", "stride_yn: =1", "N: i32 %16", "c_ptr: *u8 %16", "cb_ptr: *fp16 %16"):
        assert line in spec, (line, spec)


def test_e8p_codebook_and_nearest_point():
    table = e8.e8p_abs_table()
    norms = table.pow(2).sum(1)
    assert table.shape == (256, 8) and int((norms <= 10).sum()) == 227 and int((norms == 12).sum()) == 29
    cb = e8.e8p_codebook(table)
    assert cb.shape == (2 ** 16, 8) and torch.unique(cb, dim=0).shape[0] == 2 ** 16
    for t in (0.25, -0.25):                                            # every point is in (D8 + 1/2) + t
        p = cb[(cb - t - 0.5).remainder(1).abs().max(1).values < 1e-12] - t
        assert bool(((p - 0.5).sum(1) % 2 == 0).all()) and p.shape[0] == 2 ** 15
    x = torch.randn(1500, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 1.3
    fast, slow = e8.nearest_e8p(x), cb[torch.cdist(x, cb).argmin(1)]
    assert (((x - fast) ** 2).sum(1) - ((x - slow) ** 2).sum(1)).abs().max() < 1e-12
    # forgetting the parity fix (keeping the signs of x - t) leaves the codebook: caught
    assert torch.cdist(torch.where(x < 0, -1.0, 1.0).double() * (x.abs() - 0.25).abs() + 0.25, cb).min(1).values.max() > 0.1


def test_target_rms_minimises_gaussian_error():
    for name, target in quip.TARGET_RMS.items():
        mid = quip.gaussian_mse(name, target, n=8000)
        assert mid < quip.gaussian_mse(name, target - 0.01, n=8000) and mid < quip.gaussian_mse(name, target + 0.01, n=8000)
    assert quip.gaussian_mse("e8p", 1.03, n=8000) < 0.8 * quip.gaussian_mse("scalar", 1.0, n=8000)


def test_block_ldlq():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(16, 48, generator=g, dtype=torch.float64)
    for name, (fn, block) in quip.ROUNDERS.items():
        nearest = fn(w.reshape(-1, block)).reshape(w.shape)
        # with H = I there is nothing to pass on: Block LDLQ is plain rounding
        assert torch.equal(quip.block_ldlq(w, torch.eye(48, dtype=torch.float64), fn, block, damp=0.0), nearest)
        x = torch.randn(300, 48, generator=g, dtype=torch.float64)
        x[:, 8:] += 0.9 * x[:, :-8].clone()                             # input k correlated with k - 8: across blocks
        H = x.T @ x
        err = lambda q: float(((w - q) @ H * (w - q)).sum())           # noqa: E731
        ldlq, broken = quip.block_ldlq(w, H, fn, block), quip.block_ldlq(w, H, fn, block, feedback=-1.0)
        assert err(ldlq) < 0.8 * err(nearest) and err(broken) > err(nearest), name
    with pytest.raises(ValueError, match="block=8 must divide K=44"):
        quip.block_ldlq(w[:, :44], torch.eye(44), quip.e8p_2bit, 8)
    with pytest.raises(ValueError, match="rounder must be one of"):
        quip.quantize(w, torch.eye(48), "e8")
