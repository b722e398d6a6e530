"""kernels.attention.ring: the LSE merge (reference and Triton kernel), the layouts, and the ring over
4 gloo processes, forward and backward, against one-process attention; its broken variants caught,
its bytes equal to the derivation, its sm_90a build spill-free with 64-bit offsets."""
import math

import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels.attention import ring
from kernels.attention.reference import attention_ref
from kernels.dist.launch import launch
from kernels.testing import MismatchError, assert_close, nan_canary


def _merge_inputs(B, H, N, D, dtype_b, seed):
    g = torch.Generator().manual_seed(seed)
    o, o_b = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g).to(dtype_b)
    lse, lse_b = 2 * torch.randn(B, H, N, generator=g), 2 * torch.randn(B, H, N, generator=g)
    lse[..., ::3] = -math.inf
    lse_b[..., ::4] = -math.inf                 # rows 0, 12, ...: both parts empty
    return o, lse, o_b, lse_b


def _kernel_merge(o, lse, o_b, lse_b, broken=None):
    o_acc, lse_acc = nan_canary(o, rows=True), nan_canary(lse, rows=True)
    ring.merge_attention(o_acc, lse_acc, nan_canary(o_b, rows=True), nan_canary(lse_b, rows=True), broken=broken)
    return o_acc, lse_acc


@pytest.mark.parametrize("shape, dtype_b", [((1, 1, 1, 16), torch.float32), ((2, 3, 37, 48), torch.float16),
                                            ((1, 2, 130, 80), torch.float32)])
def test_merge_kernel_matches_the_reference(shape, dtype_b):
    args = _merge_inputs(*shape, dtype_b, seed=sum(shape))
    want_o, want_lse = ring.merge_attention_ref(*(t.double() for t in args))
    base_o, base_lse = ring.merge_attention_ref(*args)
    got_o, got_lse = _kernel_merge(*args)
    assert_close(got_o, want_o, baseline=base_o)
    assert_close(got_lse, want_lse, baseline=base_lse)
    empty = torch.isneginf(want_lse)
    assert empty.any() and (got_o[empty] == 0).all() and not torch.isnan(got_o).any()


def test_merge_kernel_writes_only_its_rows():
    """The zig-zag merge into the second half of the rows leaves the first half untouched."""
    o, lse, o_b, lse_b = _merge_inputs(1, 2, 40, 32, torch.float32, seed=3)
    first = o[:, :, :20].clone()
    ring.merge_attention(o[:, :, 20:], lse[:, :, 20:], o_b[:, :, :20].contiguous(), lse_b[:, :, :20].contiguous())
    assert torch.equal(o[:, :, :20], first)


def test_the_broken_merge_is_caught():
    args = _merge_inputs(1, 2, 70, 32, torch.float32, seed=4)
    with pytest.raises(MismatchError):
        assert_close(_kernel_merge(*args, broken="merge_max")[0], ring.merge_attention_ref(*(t.double() for t in args))[0],
                     baseline=ring.merge_attention_ref(*args)[0])


def test_merging_disjoint_key_sets_is_attention_over_their_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (5, 19, 19))
    sets = torch.randperm(19, generator=g).split([4, 15])
    (oa, la), (ob, lb) = (attention_ref(q, k[:, :, j], v[:, :, j], return_lse=True) for j in sets)
    o, lse = ring.merge_attention_ref(ob, lb, oa, la)
    want_o, want_lse = attention_ref(q, k, v, return_lse=True)
    assert float((o - want_o).abs().max()) < 1e-13 and float((lse - want_lse).abs().max()) < 1e-13


def test_merge_refuses_bad_input():
    o, lse = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4)
    with pytest.raises(TypeError, match="o has dtype torch.float16"):
        ring.merge_attention(o.half(), lse, o, lse)
    with pytest.raises(ValueError, match="o and o_b must be"):
        ring.merge_attention(o, lse, torch.zeros(1, 1, 5, 8), lse)
    with pytest.raises(ValueError, match="lse and lse_b must be"):
        ring.merge_attention(o, torch.zeros(1, 4), o, lse)
    with pytest.raises(ValueError, match="broken must be"):
        ring.merge_attention(o, lse, o, lse, broken="typo")


def test_layouts_shard_and_unshard():
    x = torch.arange(48).view(1, 1, 48, 1)
    for layout in ring.LAYOUTS:
        shards = [ring.shard(x, 4, r, layout) for r in range(4)]
        assert torch.equal(ring.unshard(shards, layout), x)
        assert all(torch.equal(ring.positions(48, 4, r, layout), s.flatten()) for r, s in enumerate(shards))
    assert ring.chunk_ids(4, 1, "zigzag") == [1, 6]
    with pytest.raises(ValueError, match="do not split into 8 equal chunks"):
        ring.shard(torch.zeros(1, 1, 12, 1), 4, 0, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring.chunk_ids(4, 0, "striped")


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zigzag_balances_the_causal_work(p):
    n = 64
    work = {lay: [[ring.block_work(r, (r - s) % p, p, n, lay, True) for s in range(p)] for r in range(p)]
            for lay in ring.LAYOUTS}
    assert sum(map(sum, work["zigzag"])) == sum(map(sum, work["contiguous"]))
    assert all(w[s] == n * n // 2 for w in work["zigzag"] for s in range(1, p))
    contiguous_time = sum(max(w[s] for w in work["contiguous"]) for s in range(p))
    assert contiguous_time == n * (n + 1) // 2 + (p - 1) * n * n      # the last rank: a full block every step


def test_ring_timeline_and_threshold():
    assert ring.ring_timeline(4, 1.0, 0.5)["makespan"] == 4.0
    assert ring.ring_timeline(4, 1.0, 2.0)["makespan"] == 7.0
    assert ring.ring_timeline(4, 1.0, 2.0, overlap=False)["makespan"] == 10.0
    n_star = ring.overlap_threshold_tokens(32, 8, peak_tflops=1000, link_gbs=50)
    st = ring.step_times(round(n_star), 32, 8, 128, peak_tflops=1000, link_gbs=50, alpha_s=0.0)
    assert abs(st["compute_s"] / st["comm_s"] - 1) < 1e-3
    with pytest.raises(ValueError, match="p must be a positive int"):
        ring.ring_timeline(0, 1.0, 1.0)


def test_ring_attention_refuses_bad_input():
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match="must be a multiple of Hkv"):
        ring.ring_attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8))
    with pytest.raises(ValueError, match="n=5 is odd"):
        ring.ring_attention(torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
    with pytest.raises(ValueError, match="impl must be one of"):
        ring.ring_attention(q, torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), impl="cuda")
    with pytest.raises(RuntimeError, match="no process group"):
        ring.ring_attention(q, torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8))


SHAPE = (1, 4, 2, 40, 16)                      # B, Hq, Hkv (GQA), N (10 per rank, chunks of 5), D
BASE = dict(shape=SHAPE, dtype="float64", layout="zigzag", causal=True, impl="torch")
CASES = {"contiguous": dict(BASE, layout="contiguous"), "zigzag": BASE, "full": dict(BASE, causal=False),
         "flash": dict(BASE, dtype="float32", impl="flash"),
         "merge_max": dict(BASE, broken="merge_max"), "causal_every_step": dict(BASE, broken="causal_every_step"),
         "dkv_stays": dict(BASE, broken="dkv_stays")}


@pytest.fixture(scope="module")
def ring_run():
    return launch(ring.chapter_worker, 4, (CASES,), timeout=300, start_timeout=120)


def _reference(case, seed, upcast=True):
    q, k, v, do = ring.case_inputs(case, seed)
    if upcast:
        q, k, v, do = (t.double() for t in (q, k, v, do))
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = attention_ref(q, k, v, causal=case["causal"], upcast=upcast)
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _gathered(run, label):
    layout = CASES[label]["layout"]
    return {key: ring.unshard([res[label][key] for res in run.results], layout) for key in ("o", "dq", "dk", "dv")}


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("label", ["contiguous", "zigzag", "full"])
def test_the_ring_equals_one_process_in_float64(ring_run, label):
    seed = list(CASES).index(label)
    got, want = _gathered(ring_run, label), _reference(CASES[label], seed)
    assert all(_rel(got[key], want[key]) < 1e-12 for key in got)


def test_ring_flash_attention_is_within_pytorchs_own_error(ring_run):
    seed = list(CASES).index("flash")
    got, want = _gathered(ring_run, "flash"), _reference(CASES["flash"], seed)
    baseline = _reference(CASES["flash"], seed, upcast=False)
    for key in got:
        assert_close(got[key], want[key], baseline=baseline[key], factor=4.0, name=key)


def test_broken_rings_are_caught(ring_run):
    for label in ("merge_max", "causal_every_step", "dkv_stays"):
        seed = list(CASES).index(label)
        got, want = _gathered(ring_run, label), _reference(CASES[label], seed)
        wrong = {key: _rel(got[key], want[key]) > 1e-3 for key in got}
        assert wrong["dk"] and wrong["dv"], label
        assert wrong["o"] == (label != "dkv_stays"), label


def test_the_bytes_sent_equal_the_derivation(ring_run):
    B, _, Hkv, N, D = SHAPE
    for label, value_bytes in (("zigzag", 8), ("flash", 4)):
        want = ring.ring_bytes(N // 4, Hkv, D, 4, value_bytes=value_bytes, grad_bytes=value_bytes if value_bytes == 8 else 4,
                               batch=B)
        for res in ring_run.results:
            t = res[label]["traffic"]
            assert (t.forward_bytes, t.backward_bytes, t.forward_messages, t.backward_messages) == \
                (want["forward"], want["backward"], 3, 7)


def test_merge_builds_for_sm90a_without_spills_and_with_64_bit_offsets():
    jobs = ring.compile_jobs()
    job = jobs["merge Llama-3-405B, 128k over CP=16, D=128"]
    assert job.grid == (128, 128)
    build = ki.compile_triton_many([job], archs=("sm90a",))[0]["sm90"]
    assert build.spills == 0
    assert all(ki.param_product_widths(build, i) == {64} for i in range(4, 14))     # the 10 runtime strides


def _pairs_computed(r, p, n, layout):
    """Every (query position, key position) pair rank r evaluates over the ring, from block_plan alone."""
    pairs = []
    q_pos = ring.positions(n, p, r, layout).tolist()
    for src in range(p):
        plan = ring.block_plan(r, src, p, n // p, layout, True)
        if plan is None:
            continue
        qs, ks, c = plan
        k_pos = ring.positions(n, p, src, layout).tolist()
        for a in range(qs.start, qs.stop):
            for b in range(ks.start, ks.stop):
                if not c or b - ks.start <= a - qs.start:
                    pairs.append((q_pos[a], k_pos[b]))
    return pairs


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_block_plan_covers_every_causal_pair_once(p, layout):
    """p = 2 and odd p, the edges the 4-rank ring does not exercise: the plans of every step, taken
    together, evaluate each causal (query, key) pair of the rank's queries exactly once."""
    n = 2 * p * 3
    for r in range(p):
        got = _pairs_computed(r, p, n, layout)
        want = {(i, j) for i in ring.positions(n, p, r, layout).tolist() for j in range(i + 1)}
        assert len(got) == len(set(got)) and set(got) == want, (r, layout)


def test_a_plan_that_drops_the_diagonal_mask_is_caught(monkeypatch):
    real = ring.block_plan
    monkeypatch.setattr(ring, "block_plan", lambda *a: (lambda pl: pl and (pl[0], pl[1], False))(real(*a)))
    got = _pairs_computed(0, 3, 18, "zigzag")
    assert len(set(got)) > len({(i, j) for i in ring.positions(18, 3, 0, "zigzag").tolist() for j in range(i + 1)})
