"""kernels/attention/mta.py: the key-query convolution kernel against the reference (tails, several
blocks, one token, non-causal, NaN canaries), the reference against the paper's conv2d route, the
causal leak of the broken variant (mask only after the conv), the GEMM-plus-band form, MTA at identity = standard attention,
head mixing, the pair task and the sm90a build of the 830M layer."""
import kernels  # noqa: F401
import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import attention_ref
from kernels.attention import mta as M
from kernels.testing import nan_canary

DEVICE = runtime.device()


def _scores(B, H, Nq, Nk, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, H, Nq, Nk, generator=g)).to(dtype).to(DEVICE)


def _theta(H, cq, ck, seed=1):
    return torch.randn(H, cq, ck, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("B,H,N,cq,ck", [(1, 2, 100, 3, 5), (2, 1, 37, 2, 3), (1, 1, 1, 3, 5), (1, 1, 45, 6, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference_inside_nan_canaries(B, H, N, cq, ck, dtype):
    s, th = _scores(B, H, N, N, seed=N, dtype=dtype), _theta(H, cq, ck)
    out = M.key_query_conv(nan_canary(s, rows=True), th)
    ref = M.key_query_conv_ref(s, th)
    vis = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), vis) and (out[~vis] == float("-inf")).all()
    tol = 1e-5 * float(th.abs().sum()) * float(s.float().abs().max())
    assert float((out[vis] - ref[vis]).abs().max()) <= tol


def test_non_causal_rectangular():
    s, th = _scores(1, 2, 40, 90, seed=5), _theta(2, 3, 5)
    out = M.key_query_conv(nan_canary(s, rows=True), th, causal=False)
    assert float((out - M.key_query_conv_ref(s, th, causal=False)).abs().max()) <= 1e-4


def test_reference_equals_the_conv2d_route():
    s, th = _scores(2, 3, 50, 50, seed=7).double(), _theta(3, 6, 11).double()
    for causal in (True, False):
        a, b = M.key_query_conv_ref(s, th, causal=causal), M.key_query_conv_conv2d(s, th, causal=causal)
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b)) and float((a[fin] - b[fin]).abs().max()) < 1e-10


@pytest.mark.parametrize("N,cq,ck", [(40, 6, 11), (7, 3, 5), (1, 2, 3)])
def test_gemm_route_equals_the_reference_and_needs_only_the_band(N, cq, ck):
    """The pre-softmax conv as one GEMM (inner dim c_q D) minus a band correction equals the reference;
    the correction vanishes outside c_q - 1 + p diagonals; the GEMM without it (the broken variant,
    Mask_0 ignored) is wrong on every band entry that reads a future logit."""
    g = torch.Generator().manual_seed(N)
    q, k = (torch.randn(2, 3, N, 16, generator=g, dtype=torch.float64) for _ in range(2))
    th = torch.randn(3, cq, ck, generator=g, dtype=torch.float64)
    ref = M.key_query_conv_ref(q @ k.transpose(-1, -2) / 4.0, th)
    out, gemm, fix = M.key_query_conv_gemm(q, k, th, return_parts=True)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)) and float((out[fin] - ref[fin]).abs().max()) < 1e-10
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    band = (j <= i) & (j > i - (cq - 1 + (ck - 1) // 2))
    assert (fix[..., (j <= i) & ~band] == 0).all()
    reads_future = band & (j + (ck - 1) // 2 > i)                       # tap (0, 0) reads S[i, j + p], c > r
    if N > 1:
        assert ((gemm - ref).abs()[..., reads_future] > 1e-6).all()
    noncausal = M.key_query_conv_ref(q @ k.transpose(-1, -2) / 4.0, th, causal=False)
    assert float((M.key_query_conv_gemm(q, k, th, causal=False) - noncausal).abs().max()) < 1e-10
    with pytest.raises(ValueError, match="q and k"):
        M.key_query_conv_gemm(q, k[..., :8], th)


def test_broken_variant_leaks_future_keys_and_the_kernel_does_not():
    """Change only the logits of keys after query i (what future tokens would change): the correct
    kernel's row i is unchanged; masking only after the conv changes it (keys up to i + (c_k-1)/2)."""
    N, i = 48, 20
    s, th = _scores(1, 1, N, N, seed=3), _theta(1, 3, 5)
    s2 = s.clone()
    s2[:, :, :, i + 1:] += 5.0                                          # future keys of query i (and of rows above)
    good = (M.key_query_conv(s, th)[0, 0, i] - M.key_query_conv(s2, th)[0, 0, i])[: i + 1]
    bad = (M.key_query_conv(s, th, broken=True)[0, 0, i] - M.key_query_conv(s2, th, broken=True)[0, 0, i])[: i + 1]
    assert float(good.abs().max()) == 0.0
    leaked = (bad.abs() > 1e-3).nonzero().flatten().tolist()
    assert leaked == list(range(i + 1 - 2, i + 1))                      # the last p = 2 visible keys of row i
    ref_bad = M.key_query_conv_ref(s, th, mask_before=False)             # the broken kernel is that order, exactly
    fin = torch.isfinite(ref_bad)
    assert float((M.key_query_conv(s, th, broken=True)[fin] - ref_bad[fin]).abs().max()) <= 1e-4


def test_identity_mta_is_standard_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g) for _ in range(3))
    th = M.identity_theta(4, 3, 5)
    ref = attention_ref(q, k, v, True)
    for mix in ("pre", "post"):
        out = M.mta_attention_ref(q, k, v, th, torch.eye(2).expand(2, 2, 2), head_mix=mix)
        assert float((out - ref).abs().max()) < 1e-5


def test_post_softmax_head_mixing_with_a_stochastic_matrix_keeps_rows_summing_to_one():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 20, 8, generator=g) for _ in range(3))
    w = torch.softmax(torch.randn(1, 4, 4, generator=g), dim=-1)         # each output head: a convex mix
    _, p = M.mta_attention_ref(q, k, v, _theta(4, 2, 3).cpu(), w, head_mix="post", return_probs=True)
    assert torch.allclose(p.sum(-1), torch.ones(1, 4, 20), atol=1e-5)
    assert (p.triu(1) == 0).all()


def test_bad_inputs_are_refused_by_name():
    s, th = _scores(1, 2, 32, 32), _theta(2, 3, 5)
    with pytest.raises(ValueError, match="odd c_k"):
        M.key_query_conv(s, _theta(2, 3, 4))
    with pytest.raises(ValueError, match="theta must be"):
        M.key_query_conv(s, _theta(3, 3, 5))
    with pytest.raises(TypeError, match="theta must be float32"):
        M.key_query_conv(s, th.double())
    with pytest.raises(TypeError, match="dtype"):
        M.key_query_conv(s.to(torch.int32), th)
    with pytest.raises(ValueError, match="causal=True needs Nq == Nk"):
        M.key_query_conv(_scores(1, 2, 20, 32), th)
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two"):
        M.key_query_conv(s, th, blocks=(48, 64, 4))
    with pytest.raises(TypeError, match="broken must be a bool"):
        M.key_query_conv(s, th, broken=1)


def test_pair_task_has_exactly_one_pair_at_the_target():
    ctx, a, b, t = M.pair_task(2000, seed=9)
    pairs = (ctx[:, :-1] == a[:, None]) & (ctx[:, 1:] == b[:, None])
    assert (pairs.sum(-1) == 1).all() and (pairs.float().argmax(-1) + 1 == t).all()
    assert ((ctx[:, 1:] == b[:, None]).sum(-1) >= 2).float().mean() > 0.9   # b is rarely alone


def test_committed_run_and_a_short_slice_of_it():
    res = M.load_pair_run()
    assert min(res["mta"]) >= 0.99 and max(res["standard"]) <= res["ceiling"] + 0.02
    mta, _ = M.train_pair_pointer(mta=True, steps=80, batch=128)
    std, _ = M.train_pair_pointer(mta=False, steps=80, batch=128)
    assert M.pair_accuracy(mta, 1000) > 0.9 > 0.5 > M.pair_accuracy(std, 1000)


@pytest.fixture(scope="module")
def builds():
    jobs = M.compile_jobs()
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_830m_layer_builds_for_sm90a_without_spills_on_cuda_cores(builds):
    for label, b in builds.items():
        fam = b["sm90"].families()
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, label
        assert b["sm90"].tensor_core == "-" and fam["FFMA"] + fam["FMUL"] > 0, label
