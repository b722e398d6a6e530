import kernels  # noqa: F401  (before triton)

import copy

import pytest
import torch

from kernels import inspect as ki
from kernels.kvcache import eviction as ev
from kernels.model import data, load_pretrained
from kernels.testing import MismatchError, assert_close


def _inputs(hq, hkv, S, n, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, D, generator=g).to(dtype)
    k = torch.randn(hkv, S, D, generator=g).to(dtype)
    v = torch.randn(hkv, S, D, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(S, generator=g)[:n] for _ in range(hkv)]).to(torch.int32)
    return q, k, v, idx


@pytest.mark.parametrize("hq,hkv,S,n,D,block_n", [(4, 2, 50, 37, 32, 16), (8, 2, 40, 5, 24, 16), (4, 4, 70, 64, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(hq, hkv, S, n, D, block_n, dtype):
    q, k, v, idx = _inputs(hq, hkv, S, n, D, dtype)
    out, probs = ev.gather_attend(q, k, v, idx, block_n=block_n)
    ref_out, ref_probs = ev.gather_attend_ref(q, k, v, idx)
    assert_close(out, ref_out, dtype=dtype)
    assert_close(probs, ref_probs, dtype=dtype)
    assert_close(probs.sum(-1), torch.ones(hq), dtype=dtype)


def test_unkept_slots_are_never_read():
    """NaN canaries: every slot of the K/V buffer that idx does not name is NaN; a kernel that read one
    (a mask left out, a wrong row) would return NaN."""
    q, k, v, idx = _inputs(4, 2, 60, 21, 32)
    for hk in range(2):
        unkept = torch.ones(60, dtype=torch.bool)
        unkept[idx[hk].long()] = False
        k[hk, unkept] = float("nan")
        v[hk, unkept] = float("nan")
    out, probs = ev.gather_attend(q, k, v, idx, block_n=16)
    assert not out.isnan().any() and not probs.isnan().any()
    ref_out, ref_probs = ev.gather_attend_ref(q, k, v, idx)
    assert_close(out, ref_out, dtype=torch.float32)
    assert_close(probs, ref_probs, dtype=torch.float32)


@pytest.mark.parametrize("broken", ["no-normalize", "no-rescale"])
def test_broken_kernels_are_caught(broken):
    """no-normalize leaves out 1/l; no-rescale drops the online softmax's exp2(m_old - m_new) factor on l
    and the output, which only matters when a later tile raises the max: the bookkeeping is tested."""
    q, k, v, idx = _inputs(4, 2, 50, 37, 32)
    k[:, idx[:, -1].long()] *= 4                   # a large key in the last tile: the max grows late
    out, probs = ev.gather_attend(q, k, v, idx, block_n=16, _broken=broken)
    ref_out, ref_probs = ev.gather_attend_ref(q, k, v, idx)
    with pytest.raises(MismatchError):
        assert_close(out, ref_out, dtype=torch.float32)
    with pytest.raises(MismatchError):
        assert_close(probs, ref_probs, dtype=torch.float32)


def test_bad_inputs_are_refused():
    q, k, v, idx = _inputs(4, 2, 50, 37, 32)
    with pytest.raises(ValueError, match="idx must lie"):
        ev.gather_attend(q, k, v, idx + 50)
    with pytest.raises(ValueError, match="shapes disagree"):
        ev.gather_attend(q[:3], k, v, idx)
    with pytest.raises(TypeError, match="idx must be"):
        ev.gather_attend(q, k, v, idx.float())
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        ev.select("lru", torch.ones(1, 1, 1, 4, 4), 2)
    with pytest.raises(ValueError, match="sinks"):
        ev.streaming_keep(16, 4, 4)
    with pytest.raises(ValueError, match="pooling"):
        ev.snapkv_keep(torch.ones(1, 2, 10), 5, 2, pooling="median")
    with pytest.raises(ValueError, match="multiple of page"):
        ev.quest_keep(torch.ones(1, 1, 1, 4), torch.ones(1, 16, 4), 12, 8)
    with pytest.raises(ValueError, match="_broken"):
        ev.gather_attend(q, k, v, idx, _broken="typo")


def test_streaming_keeps_sinks_and_recent():
    assert ev.streaming_keep(10, 5, 2).tolist() == [0, 1, 7, 8, 9]
    assert ev.streaming_keep(10, 3, 0).tolist() == [7, 8, 9]


def test_h2o_keeps_heavy_hitters_and_recent():
    scores = torch.tensor([[5.0, 0.1, 3.0, 0.2, 0.0, 0.0, 9.0, 9.0]])
    assert ev.h2o_keep(scores, 4, 2).tolist() == [[0, 2, 6, 7]]


def test_snapkv_pools_votes_and_keeps_the_window():
    votes = torch.zeros(1, 2, 10)
    votes[0, :, 3] = 1.0                          # one strong key; pooling brings its neighbours
    kept = ev.snapkv_keep(votes, 5, 2, pool=3)
    assert kept.tolist() == [[2, 3, 4, 8, 9]]


def test_snapkv_average_pooling_differs_from_max():
    """The reference code's default (average, width 5) favours a dense cluster over one isolated peak;
    max pooling cannot tell them apart."""
    votes = torch.zeros(1, 1, 14)
    votes[0, 0, 2] = 1.0                                        # an isolated peak
    votes[0, 0, 6:11] = 0.9                                     # a cluster of five, centred on 8
    avg = ev.snapkv_keep(votes, 2, 1, pool=5, pooling="avg")
    mx = ev.snapkv_keep(votes, 2, 1, pool=5, pooling="max")
    assert avg.tolist() == [[8, 13]] and mx.tolist()[0][0] in range(0, 5)


def test_h2o_mean_is_flat_under_uniform_attention():
    """Uniform causal attention: the column sum falls with the key's position, the relative mean is 1
    for every key; dividing the column sum by P - j alone would still fall (early rows are larger)."""
    P = 12
    uniform = torch.tril(torch.ones(P, P)) / torch.arange(1, P + 1)[:, None]    # row i: 1/(i+1) on keys 0..i
    probs = uniform.expand(1, 1, 1, P, P)
    acc = ev.accumulated_attention(probs)[0, 0]
    assert torch.all(acc[:-1] > acc[1:])
    assert torch.all((acc / torch.arange(P, 0, -1))[:-1] > (acc / torch.arange(P, 0, -1))[1:])
    assert_close(ev.mean_attention(probs)[0, 0], torch.ones(P), dtype=torch.float32)


def test_quest_bound_is_an_upper_bound_and_picks_the_best_page():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 16, generator=g)                  # (Hkv, G, T, D)
    k = torch.randn(2, 32, 16, generator=g)                    # (Hkv, P, D), 4 pages of 8
    kmin, kmax = ev.page_bounds(k, 8)
    bound = ev.quest_scores(q, kmin, kmax)                     # (Hkv, T, 4)
    true = torch.einsum("hgtd,hpd->hgtp", q, k).view(2, 3, 5, 4, 8).amax(-1).sum(1)   # group sum of each head's max
    assert torch.all(bound >= true - 1e-5)
    k[0, 16:24] = 0.0
    k[0, 16:24, 0] = 50.0                                       # page 2 of head 0: one huge channel
    q[0, :, :, 0] = 1.0
    kept = ev.quest_keep(q, k, 8, 8)                           # one page per query
    assert kept[0].tolist() == [list(range(16, 24))] * 5


def test_quest_slots_drive_the_kernel():
    """One decode step: the slots Quest picks per query are gather_attend's idx."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(4, 16, generator=g), torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    idx = ev.quest_slots(q, k[:, :32], 16, 8)                  # (Hkv, 16): two pages of the 32-token prompt
    assert idx.shape == (2, 16) and all(len(set((row // 8).tolist())) == 2 for row in idx)
    out, _ = ev.gather_attend(q, k, v, idx, block_n=16)
    assert_close(out, ev.gather_attend_ref(q, k, v, idx)[0], dtype=torch.float32)


@pytest.fixture(scope="module")
def model_and_windows():
    m = copy.deepcopy(load_pretrained()).double()      # fp64: two orders of summation agree to 1e-7
    _, val = data.train_val_split(data.encode(data.load_text()))
    return m, torch.stack([val[i * 48: (i + 1) * 48] for i in range(2)]).long()


def test_full_budget_is_the_model(model_and_windows):
    m, w = model_and_windows
    logits, _, _ = ev.compressed_forward(m, w, 32)
    with torch.no_grad():
        # the fp64 model still takes its softmax and RoPE in fp32: compared at fp32's tolerance
        assert_close(logits, m(w), dtype=torch.float32)


@pytest.mark.parametrize("policy", ["streaming", "h2o", "h2o-mean", "snapkv"])
def test_masked_forward_is_the_step_by_step_decode(model_and_windows, policy):
    m, w = model_and_windows
    logits, kept, _ = ev.compressed_forward(m, w[:1, :40], 32, policy, 8)
    steps = ev.step_decode(m, w[0, :40], 32, [kp[0] for kp in kept])
    assert_close(steps, logits[0, 32:], dtype=torch.float64)
    # and a different kept set gives different logits: the comparison can fail
    other = [torch.arange(24, 32).expand(kp.shape[1], 8) for kp in kept]
    if not all(torch.equal(o, kp[0]) for o, kp in zip(other, kept)):
        with pytest.raises(MismatchError):
            assert_close(ev.step_decode(m, w[0, :40], 32, other), logits[0, 32:], dtype=torch.float64)


def test_quest_masked_forward_is_the_step_by_step_decode(model_and_windows):
    """Quest evicts nothing: every decode step chooses its own prompt pages; the masked forward must
    equal the server's loop that picks them per query."""
    m, w = model_and_windows
    logits, kept, _ = ev.compressed_forward(m, w[:1, :40], 32, "quest", 8, page=8)
    assert kept[0].shape == (1, 2, 8, 8)                        # (B, Hkv, decoded rows, budget)
    steps = ev.step_decode(m, w[0, :40], 32, per_query=lambda q, kp: ev.quest_slots(q, kp, 8, 8))
    assert_close(steps, logits[0, 32:], dtype=torch.float64)
    with pytest.raises(MismatchError):                          # the same pages for every step: not Quest
        fixed = [kp[0, :, 0] for kp in kept]
        assert_close(ev.step_decode(m, w[0, :40], 32, fixed), logits[0, 32:], dtype=torch.float64)


def test_compressing_the_cache_changes_the_loss(model_and_windows):
    m, w = model_and_windows
    assert ev.decode_loss(m, w, 32, "window", 4) != ev.decode_loss(m, w, 32, "full")


def test_compile_jobs_at_llama3_8b():
    jobs = ev.compile_jobs()
    assert all(job.grid == (32,) for job in jobs.values())
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm90",))
    for label, b in zip(jobs, builds):
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, f"{label} spills"
