"""kernels/attention/linear.py and delta_rule.py: the three forms of linear attention agree in fp64;
the Triton chunked kernel (forward, state and backward) against the fp64 recurrence on awkward shapes
with NaN canaries; a broken variant caught in each pass; bad inputs refused by name; the Gated DeltaNet
chunkwise form against its recurrence; the state-vs-KV-cache counts; the recall run's script; sm_90a builds."""
import kernels  # noqa: F401

import json
from pathlib import Path

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import delta_rule as DR
from kernels.attention import linear as L
from kernels.testing import MismatchError, assert_close

DEVICE = runtime.device()
ROOT = Path(__file__).resolve().parent.parent


def _inputs(B, H, T, dk, dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=g, dtype=torch.float64).to(dtype) for d in (dk, dk, dv)]


def _canary_view(x: torch.Tensor) -> torch.Tensor:
    """x as a non-contiguous view into a NaN-filled buffer (padding in every dim)."""
    B, H, T, D = x.shape
    buf = torch.full((B + 1, H + 2, T + 5, D + 3), float("nan"), dtype=x.dtype, device=DEVICE)
    view = buf[1:, 1:H + 1, 2:T + 2, 1:D + 1]
    view.copy_(x)
    return view


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 8), (64, 16), (100, 32)])
def test_three_forms_agree_in_float64(T, chunk):
    q, k, v = _inputs(2, 3, T, 20, 12, seed=T)
    lam = torch.tensor([1.0, 0.95, 0.3], dtype=torch.float64)
    o_rec, s_rec = L.linear_attention_recurrent_ref(q, k, v, lam)
    o_par = L.linear_attention_parallel_ref(q, k, v, lam)
    o_chk, s_chk = L.linear_attention_chunked_ref(q, k, v, lam, chunk=chunk)
    scale = o_rec.abs().max()
    assert (o_par - o_rec).abs().max() <= 1e-12 * scale
    assert (o_chk - o_rec).abs().max() <= 1e-12 * scale
    assert (s_chk - s_rec).abs().max() <= 1e-12 * s_rec.abs().max()


def test_chunked_without_the_inter_chunk_decay_is_wrong():
    q, k, v = _inputs(1, 1, 40, 8, 8)
    lam = torch.tensor([0.8], dtype=torch.float64)
    o_rec, _ = L.linear_attention_recurrent_ref(q, k, v, lam)
    o_one_chunk, _ = L.linear_attention_chunked_ref(q, k, v, lam, chunk=64)
    assert (o_one_chunk - o_rec).abs().max() <= 1e-12 * o_rec.abs().max()
    # summing the chunks' states with no decay at all is plain linear attention: different at lam < 1
    o_nodecay, _ = L.linear_attention_recurrent_ref(q, k, v, None)
    assert (o_nodecay - o_rec).abs().max() > 0.1 * o_rec.abs().max()


@pytest.mark.parametrize("dtype", runtime.runtime().check_dtypes, ids=str)
@pytest.mark.parametrize("B,H,T,dk,dv,chunk,block_v", [
    (2, 3, 37, 20, 24, 16, 16),     # tails in T, d_k and d_v, two d_v blocks
    (1, 2, 1, 16, 16, 16, None),     # a single token
    (1, 2, 70, 64, 48, 32, None),    # three chunks, the last short
])
def test_kernel_forward_backward_match_the_fp64_recurrence(B, H, T, dk, dv, chunk, block_v, dtype):
    q, k, v = _inputs(B, H, T, dk, dv, seed=T)
    lam = torch.tensor([1.0, 0.9, 0.6][:H], dtype=torch.float64)
    do = torch.randn(B, H, T, dv, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [_canary_view(x.to(dtype)).requires_grad_() for x in (q, k, v)]
    o, s = L.linear_attention(*leaves, lam.float(), chunk=chunk, block_v=block_v, return_state=True)
    o.backward(_canary_view(do.to(dtype)))

    ref = [x.to(dtype).double().requires_grad_() for x in (q, k, v)]       # same rounded inputs, fp64
    o_ref, s_ref = L.linear_attention_recurrent_ref(*ref, lam)
    o_ref.backward(do.to(dtype).double())
    low = [x.to(dtype).requires_grad_() for x in (q, k, v)]                 # PyTorch in the low dtype
    o_low = ((low[0] @ low[1].transpose(-1, -2)) * _decay_matrix(lam, T).to(dtype)) @ low[2]
    o_low.backward(do.to(dtype))
    assert_close(o, o_ref, dtype=dtype, baseline=o_low, name="o")
    w = (lam.view(-1, 1) ** (T - 1 - torch.arange(T)).double()).to(dtype)[None, :, :, None]   # lam^(T-1-t)
    s_low = (low[1].detach() * w).transpose(-1, -2) @ low[2].detach()          # S_T = K^T diag(lam^(T-1-t)) V
    assert_close(s, s_ref, dtype=dtype, baseline=s_low, name="state")
    for name, a, r, b in zip("qkv", leaves, ref, low):
        assert_close(a.grad, r.grad, dtype=dtype, baseline=b.grad, name=f"d{name}")


def _decay_matrix(lam, T):
    t = torch.arange(T)
    gap = (t[:, None] - t[None, :]).double()
    return torch.where(gap >= 0, lam.view(-1, 1, 1) ** gap.clamp(min=0), torch.zeros(()))


@pytest.mark.parametrize("which", [0, 1])
def test_broken_variant_is_caught_in_each_pass(which):
    """BROKEN reads the state without lam^(i+1): with lam = 1 it is invisible (so the check uses lam < 1)."""
    q, k, v = _inputs(1, 2, 50, 16, 16, seed=3)
    lam = torch.tensor([0.9, 0.7], dtype=torch.float64)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    broken = (1, 0) if which == 0 else (0, 1)
    o = L.linear_attention(*leaves, lam.float(), chunk=16, _broken=broken)
    o.sum().backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, _ = L.linear_attention_recurrent_ref(*ref, lam)
    o_ref.sum().backward()
    with pytest.raises(MismatchError):
        assert_close(o if which == 0 else leaves[0].grad, o_ref if which == 0 else ref[0].grad, dtype=torch.float32)
    # and at lam = 1 the same bug passes: a check with no decay could not have caught it
    plain = [x.float() for x in (q, k, v)]
    assert torch.equal(L.linear_attention(*plain, None, chunk=16, _broken=(1, 0)), L.linear_attention(*plain, None, chunk=16))


def test_bad_inputs_are_refused_by_name():
    q, k, v = (x.float() for x in _inputs(1, 2, 20, 16, 16))
    with pytest.raises(ValueError, match="decay must be a tensor of shape"):
        L.linear_attention(q, k, v, torch.ones(3))
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\]"):
        L.linear_attention(q, k, v, torch.tensor([1.0, 1.5]))
    with pytest.raises(ValueError, match="decay is a fixed"):
        L.linear_attention(q, k, v, torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match="share a dtype"):
        L.linear_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        L.linear_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="k shape"):
        L.linear_attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="v must be"):
        L.linear_attention(q, k, v[:, :, :10])
    with pytest.raises(ValueError, match="4-D"):
        L.linear_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        L.linear_attention(q, k, v, chunk=24)
    with pytest.raises(ValueError, match="block_v must be"):
        L.linear_attention(q, k, v, block_v=8)
    with pytest.raises(ValueError, match="head dim d_k"):
        L.linear_attention(*(torch.zeros(1, 1, 4, 300),) * 2, torch.zeros(1, 1, 4, 8))


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_gated_delta_rule_chunked_equals_recurrent_in_float64(chunk):
    g = torch.Generator().manual_seed(chunk)
    q, k, v = _inputs(2, 2, 45, 12, 10, seed=chunk)
    k = torch.nn.functional.normalize(k, dim=-1)
    alpha = 0.5 + 0.5 * torch.rand(2, 2, 45, generator=g, dtype=torch.float64)
    beta = torch.rand(2, 2, 45, generator=g, dtype=torch.float64)
    o1, s1 = DR.gated_delta_rule_ref(q, k, v, alpha, beta)
    o2, s2 = DR.gated_delta_rule_chunked_ref(q, k, v, alpha, beta, chunk=chunk)
    assert (o1 - o2).abs().max() <= 1e-12 * o1.abs().max()
    assert (s1 - s2).abs().max() <= 1e-12 * s1.abs().max()


def test_delta_rule_overwrites_where_linear_attention_adds():
    """Write key k with value a, then with value b: the delta rule (beta = 1) reads back b, linear attention a + b."""
    k = torch.tensor([[[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[2.0, 0.0], [0.0, 5.0]]]], dtype=torch.float64)
    ones = torch.ones(1, 1, 2, dtype=torch.float64)
    o_delta, _ = DR.gated_delta_rule_ref(k, k, v, ones, ones)
    o_lin, _ = L.linear_attention_recurrent_ref(k, k, v)
    assert o_delta[0, 0, -1].tolist() == [0.0, 5.0] and o_lin[0, 0, -1].tolist() == [2.0, 5.0]


def test_state_and_kv_counts():
    assert L.kv_cache_bytes_per_token(**L.LLAMA3_8B) == 131072              # 128 KiB per token in bf16
    kv, state = L.qwen3_next_bytes(1)
    assert kv == 12 * 2 * 2 * 256 * 2
    assert state == 36 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 2
    assert L.qwen3_next_bytes(100_000)[1] == state                          # the state does not grow


def test_recall_script_runs_a_short_slice(tmp_path):
    res = L.recall_experiment(tmp_path / "r.json", kinds=("linear",), pairs=(4,), steps=5)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["accuracy"] == res["accuracy"] and 0.0 <= saved["accuracy"]["linear"]["4"] <= 1.0
    committed = json.loads((ROOT / L.RECALL_RESULTS).read_text())
    assert set(committed["accuracy"]) == {"softmax", "linear", "delta"}
    with pytest.raises(ValueError, match="kind must be"):
        L.RecallModel("rnn", 4, 4, 8, 4)


@pytest.fixture(scope="module")
def builds():
    jobs = {label: job for label, job in L.compile_jobs().items() if "float16" in label and "bfloat" not in label}
    jobs.update(DR.compile_jobs())
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm80", "sm90"))))


def test_sm90a_and_a100_builds_without_spills(builds):
    assert len(builds) == 4
    for label, b in builds.items():
        a100 = "A100 launch" in label
        b = b["sm80" if a100 else "sm90"]
        if a100:
            assert b.spills == 0 and b.tensor_core == "HMMA", label                 # mma.sync, chunk 32
            continue
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        if label.startswith("linear attention"):
            assert b.tensor_core == "HGMMA", (label, b.tensor_core)    # wgmma: 64-row chunks fill its tiles
        else:                                                           # one token: mat-vec work on CUDA cores
            assert b.tensor_core == "-", (label, b.tensor_core)


@pytest.mark.parametrize("dtype", runtime.runtime().check_dtypes, ids=str)
def test_gated_delta_rule_kernel_matches_the_fp64_recurrence_and_carries_its_state(dtype):
    """Two halves with the state carried equal the whole run; d_v = 40 spans two 32-row blocks, d_k = 20 a tail."""
    B, H, T, dk, dv = 2, 2, 23, 20, 40
    g = torch.Generator().manual_seed(7)
    q, k, v = _inputs(B, H, T, dk, dv, seed=7)
    k = torch.nn.functional.normalize(k, dim=-1)
    alpha = 0.6 + 0.4 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64)
    low = [x.to(dtype) for x in (q, k, v)] + [alpha.float(), beta.float()]
    views = [_canary_view(x) for x in low[:3]] + [_canary_view(x[..., None])[..., 0] for x in low[3:]]
    o_ref, s_ref = DR.gated_delta_rule_ref(*(x.double() for x in low))
    o_base, s_base = DR.gated_delta_rule_ref(*low[:3], *(x.to(dtype) for x in low[3:]))   # PyTorch in dtype (fp32 math)
    o, s = DR.gated_delta_rule_recurrent(*views)
    assert_close(o, o_ref, dtype=dtype, baseline=o_base.to(dtype), name="o")
    assert_close(s, s_ref, dtype=torch.float32, name="state")
    h = 11
    o1, s1 = DR.gated_delta_rule_recurrent(*(x[:, :, :h] for x in views))
    o2, s2 = DR.gated_delta_rule_recurrent(*(x[:, :, h:] for x in views), initial_state=s1)
    assert torch.equal(torch.cat([o1, o2], 2), o) and torch.equal(s2, s)


def test_gated_delta_rule_kernel_broken_variant_and_bad_inputs():
    q, k, v = (x.float() for x in _inputs(1, 2, 15, 16, 16, seed=2))
    k = torch.nn.functional.normalize(k, dim=-1)
    alpha = torch.full((1, 2, 15), 0.8)
    beta = torch.full((1, 2, 15), 0.7)
    o_ref, _ = DR.gated_delta_rule_ref(*(x.double() for x in (q, k, v, alpha, beta)))
    assert_close(DR.gated_delta_rule_recurrent(q, k, v, alpha, beta)[0], o_ref, dtype=torch.float32)
    with pytest.raises(MismatchError):
        assert_close(DR.gated_delta_rule_recurrent(q, k, v, alpha, beta, _broken=1)[0], o_ref, dtype=torch.float32)
    with pytest.raises(ValueError, match="alpha and beta must be"):
        DR.gated_delta_rule_recurrent(q, k, v, alpha[..., :3], beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        DR.gated_delta_rule_recurrent(q, k, v, alpha, beta, initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="beta has dtype"):
        DR.gated_delta_rule_recurrent(q, k, v, alpha, beta.long())
