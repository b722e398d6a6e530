"""DFlash-style block drafting (kernels.speculative.dflash): the Triton block attention against two
references (awkward shapes, NaN canaries, GQA), the causal-inside-the-block and context-leak variants
caught, inputs refused by name, greedy block-speculative decoding equal to plain greedy decoding, the
exact rule with a parallel drafter's per-position marginals, the committed run, and the kernel's
compile facts at Qwen3-8B's attention shape on sm_90a."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

import kernels  # noqa: F401  (switches Triton's interpreter on without a GPU)
from kernels import inspect as ki
from kernels.model import load_pretrained
from kernels.speculative import dflash as DF
from kernels.speculative import sampling as S
from kernels.testing import assert_close


def make_case(B, H, Hkv, D, K, lens, seed, pad=5, dtype=torch.float32):
    """q, k, v as views into NaN-filled buffers; key slots past lens[b] + K stay NaN (canaries)."""
    g = torch.Generator().manual_seed(seed)
    S_ = max(lens) + K + 3
    qb = torch.full((B, H, K + 2, D + pad), float("nan"), dtype=dtype)
    q = qb[:, :, 1: K + 1, :D]
    q.copy_(torch.randn(B, H, K, D, generator=g))
    kb = torch.full((B, Hkv, S_, D + pad), float("nan"), dtype=dtype)
    vb = kb.clone()
    k, v = kb[..., :D], vb[..., :D]
    for b, L in enumerate(lens):
        k[b, :, : L + K] = torch.randn(Hkv, L + K, D, generator=g)
        v[b, :, : L + K] = torch.randn(Hkv, L + K, D, generator=g)
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("B,H,Hkv,D,K,lens,block_n", [
    (2, 4, 2, 24, 8, [37, 5], 16),        # GQA 2, head dim not a power of two, several key tiles
    (1, 3, 3, 40, 7, [70], 64),           # no GQA, K not a power of two, the block crosses a tile edge
    (3, 4, 1, 16, 16, [0, 9, 1], 32),     # an empty context; block of 16
    (1, 2, 2, 32, 1, [3], 16),            # a block of one slot
])
def test_kernel_matches_reference(B, H, Hkv, D, K, lens, block_n):
    q, k, v, L = make_case(B, H, Hkv, D, K, lens, seed=B * D + K)
    ref = DF.block_attention_ref(q, k, v, L)
    out = DF.block_attention(q, k, v, L, block_n=block_n)
    assert not torch.isnan(out).any()
    assert_close(out, ref, name="block_attention")


def test_reference_equals_dense_mask():
    """Equal context lengths: the slot-count reference is the dense attention with block_mask_ref."""
    q, k, v, L = make_case(2, 4, 2, 16, 8, [11, 11], seed=3)
    dense = DF.masked_attention_dense(q, k[:, :, :19], v[:, :, :19], DF.block_mask_ref(11, 8))
    assert_close(DF.block_attention_ref(q, k, v, L), dense)
    assert bool(DF.block_mask_ref(11, 8).all()) and not bool(DF.block_mask_ref(11, 8, "causal").all())


def test_broken_variants_are_caught():
    q, k, v, L = make_case(2, 4, 2, 24, 8, [37, 5], seed=1)
    ref = DF.block_attention_ref(q, k, v, L)
    causal = DF.block_attention(q, k, v, L, variant="causal")
    dense_causal = torch.stack([DF.masked_attention_dense(q[b:b + 1], k[b:b + 1, :, :l + 8], v[b:b + 1, :, :l + 8],
                                                          DF.block_mask_ref(l, 8, "causal"))[0]
                                for b, l in enumerate([37, 5])])
    assert_close(causal, dense_causal)                             # it IS the causal mask ...
    assert (causal[:, :, :-1] - ref[:, :, :-1]).abs().max() > 0.1   # ... and far from the block's
    assert_close(causal[:, :, -1], ref[:, :, -1])                   # the last slot sees everything either way
    leak = DF.block_attention(q, k, v, L, variant="leak")           # reads the canaries past L_b + K
    assert torch.isnan(leak[1]).all() and not torch.isnan(ref).any()


def test_bad_input_is_refused():
    q, k, v, L = make_case(1, 4, 2, 16, 8, [5], seed=0)
    with pytest.raises(ValueError, match="lens must be"):
        DF.block_attention(q, k, v, L.long())
    with pytest.raises(ValueError, match="H=4 query heads must be a multiple"):
        k3 = torch.zeros(1, 3, k.shape[2], 16)
        DF.block_attention(q, k3, k3, L)
    with pytest.raises(ValueError, match="k must be torch.float32"):
        DF.block_attention(q, k.half(), v, L)
    with pytest.raises(ValueError, match="lens\\[b\\] \\+ K=8 <= S"):
        DF.block_attention(q, k, v, L + 100)
    with pytest.raises(ValueError, match="block_n must be"):
        DF.block_attention(q, k, v, L, block_n=24)
    with pytest.raises(ValueError, match="variant must be"):
        DF.block_attention(q, k, v, L, variant="bidirectional")
    with pytest.raises(ValueError, match="q must be float32"):
        DF.block_attention(q.double(), k.double(), v.double(), L)


# ---------------------------------------------------------------- on the tiny GPT

@pytest.fixture(scope="module")
def model():
    return load_pretrained()


@pytest.fixture(scope="module")
def drafter():
    return DF.load_drafter()


def test_drafter_forward_triton_equals_ref(model, drafter):
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 13, model.config.d_model, generator=g)
    first = torch.tensor([5, 77])
    E = model.wte.weight.detach()
    with torch.no_grad():
        ref = drafter(ctx, first, E)
        assert_close(drafter(ctx, first, E, attention="triton"), ref, name="drafter logits")
        assert (drafter(ctx, first, E, attention="causal") - ref).abs().max() > 1e-2


def test_block_speculative_equals_plain_greedy(model, drafter):
    for p in DF.eval_prompts(2):
        plain = DF.plain_greedy(model, p, 40)
        out, fw, dr, acc = DF.dflash_greedy(model, drafter, p, 40)
        assert out == plain
        assert fw == 1 + len(acc) and dr <= len(acc) and sum(a + 1 for a in acc) == 39
        out2, fw2, dr2, acc2 = DF.ar_draft_greedy(model, DF_truncated(model), p, 40, drafter.block - 1)
        assert out2 == plain and fw2 == 1 + len(acc2) and sum(a + 1 for a in acc2) == 39
    with pytest.raises(ValueError, match="exceed block_size"):
        DF.dflash_greedy(model, drafter, [1] * 100, 40)
    with pytest.raises(ValueError, match="non-empty prompt"):
        DF.dflash_greedy(model, drafter, [], 4)


def DF_truncated(model):
    from kernels.speculative.drafts import truncated_copy
    return truncated_copy(model, 1)


def _rand_dist(g, V):
    w = [int(x) + 1 for x in torch.randint(0, 6, (V,), generator=g)]
    return [Fraction(x, sum(w)) for x in w]


def test_parallel_marginals_keep_the_rule_exact():
    """A parallel drafter's q_j (computed once per block) does not depend on d_<j; with q_j(d_j) in the
    rule, four tokens of repeated blocks are distributed exactly as the target's; the biased rule is not."""
    g = torch.Generator().manual_seed(0)
    V, gamma = 3, 2
    ptab: dict = {}
    qtab: dict = {}

    def p_fn(prefix):
        if prefix not in ptab:
            ptab[prefix] = _rand_dist(g, V)
        return ptab[prefix]

    def marg_fn(prefix):
        if prefix not in qtab:
            qtab[prefix] = [_rand_dist(g, V) for _ in range(gamma)]
        return qtab[prefix]

    want = S.target_distribution(p_fn, (0,), V, 4)
    got = DF.block_output_distribution(p_fn, marg_fn, (0,), gamma, 4)
    assert {s: w for s, w in got.items() if w} == {s: w for s, w in want.items() if w}
    bad = DF.block_output_distribution(p_fn, marg_fn, (0,), gamma, 4, rule="biased")
    assert any(bad.get(s, 0) != w for s, w in want.items())


def test_committed_run_and_short_run(model, drafter, tmp_path):
    m = DF.load_metrics()
    assert m["block"] == drafter.block == DF.BLOCK and m["steps"] >= 100
    assert DF.main(["--steps", "2", "--batch", "4", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["steps"] == 2 and DF.load_drafter(tmp_path).block == DF.BLOCK


# ---------------------------------------------------------------- ahead of time, at a real model's size

@pytest.fixture(scope="module")
def aot():
    jobs = DF.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_compiles_without_spills(aot):
    jobs, builds = aot
    table = ki.resource_table([(label, b["sm90"]) for label, b in builds.items()])
    for label, b in builds.items():
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, f"{label}\n{table}"
        assert b["sm90"].tensor_core == "HMMA" and b["sm90"].async_copies["LDGSTS"] > 0, f"{label}\n{table}"
    assert jobs["Qwen3-8B (GQA 32/8), block 16, context 4096"].programs == 32       # one program per head


def test_batch_offset_is_a_64bit_product(aot):
    jobs, builds = aot
    for label in jobs:
        runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
        assert ki.param_product_widths(builds[label]["sm90"], runtime_args.index("stride_kb")) == {64}
