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


def test_broken_kernel_without_renormalisation_is_caught():
    q, k, v, idx = _inputs(4, 2, 50, 37, 32)
    out, probs = ev.gather_attend(q, k, v, idx, block_n=16, _normalize=False)
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


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv"])
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


def test_compressing_the_cache_changes_the_loss(model_and_windows):
    m, w = model_and_windows
    assert ev.decode_loss(m, w, 32, "window", 4) != ev.decode_loss(m, w, 32, "full")


def test_compile_jobs_at_llama3_8b():
    jobs = ev.compile_jobs()
    assert all(job.grid == (32,) for job in jobs.values())
    builds = ki.compile_triton_many(list(jobs.values()), archs=("sm90",))
    for label, b in zip(jobs, builds):
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, f"{label} spills"
