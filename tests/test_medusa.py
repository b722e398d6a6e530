"""Medusa (kernels.speculative.medusa): the tree mask, the Triton tree attention against the dense
masked reference (awkward shapes, NaN canaries, a causal-mask variant caught), one tree forward
equal to a plain forward of every node's path, greedy Medusa decoding equal to plain greedy
decoding, the exact rule leaving the distribution unchanged where typical acceptance does not, the
training script, and the kernel's compile facts at Llama 3 8B's size on sm_90a."""
from __future__ import annotations

import json

import pytest
import torch

import kernels  # noqa: F401  (switches Triton's interpreter on without a GPU)
from kernels import inspect as ki
from kernels.model import load_pretrained
from kernels.model.gpt import KVCache
from kernels.speculative import medusa as M
from kernels.speculative import sampling as S
from kernels.testing import assert_close

ACC = torch.tensor([[.5, .2, .1, .05, .03], [.4, .2, .1, .05, .03], [.3, .2, .1, .05, .03], [.3, .2, .1, .05, .03]])


def test_build_tree_and_mask():
    tree = M.build_tree(ACC, 20)
    par = tree.parent.tolist()
    assert len(tree) == 21 and par[0] == -1 and all(0 <= p < i for i, p in enumerate(par) if i)
    assert all(tree.paths[p] == tree.paths[i][:-1] for i, p in enumerate(par) if i)     # closed under parents
    assert tree.paths[1] == (0,) and (0, 0) in tree.paths                               # the likeliest first
    mask = M.tree_mask_ref(tree.parent)
    for i in range(len(tree)):
        for j in range(len(tree)):
            assert bool(mask[i, j]) == (tree.paths[i][: len(tree.paths[j])] == tree.paths[j])   # j an ancestor of i
    assert M.tree_depth(tree.parent) == int(tree.depth.max()) == 3


def make_case(B, Hq, Hkv, D, T, lens, seed, pad=6, dtype=torch.float32):
    """q, k, v as views into NaN-filled buffers; cache slots past lens[b] + T stay NaN (canaries)."""
    g = torch.Generator().manual_seed(seed)
    S_ = max(lens) + T + 3
    qb = torch.full((B, Hq, T + 2, D + pad), float("nan"), dtype=dtype)
    q = qb[:, :, 1: T + 1, :D]
    q.copy_(torch.randn(B, Hq, T, D, generator=g))
    kb = torch.full((B, Hkv, S_, D + pad), float("nan"), dtype=dtype)
    vb = kb.clone()
    k, v = kb[..., :D], vb[..., :D]
    for b, L in enumerate(lens):
        k[b, :, : L + T] = torch.randn(Hkv, L + T, D, generator=g)
        v[b, :, : L + T] = torch.randn(Hkv, L + T, D, generator=g)
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("B,Hq,Hkv,D,n_nodes,lens,blocks", [
    (2, 4, 2, 24, 20, [37, 5], (16, 32)),         # GQA 2, head dim not a power of two, two query blocks
    (1, 3, 3, 40, 32, [70], (16, 16)),            # no GQA, several key blocks, tree crosses a block edge
    (3, 4, 1, 16, 0, [0, 9, 1], (16, 32)),        # the root alone; an empty prefix
    (1, 8, 2, 32, 40, [100], (32, 64)),           # 41 nodes: a full and a partial query block of 32
])
def test_kernel_matches_reference(B, Hq, Hkv, D, n_nodes, lens, blocks):
    tree = M.build_tree(ACC, n_nodes)
    q, k, v, L = make_case(B, Hq, Hkv, D, len(tree), lens, seed=B * D + n_nodes)
    ref = M.tree_attention_ref(q, k, v, L, tree.parent)
    out = M.tree_attention(q, k, v, L, tree.parent, blocks=blocks)
    assert not torch.isnan(out).any()
    assert_close(out, ref, name="tree_attention")


def test_broken_kernel_is_caught():
    """The causal mask lets a node see its earlier siblings and cousins: far from the reference."""
    tree = M.build_tree(ACC, 20)
    q, k, v, L = make_case(2, 4, 2, 24, len(tree), [37, 5], seed=1)
    ref = M.tree_attention_ref(q, k, v, L, tree.parent)
    bad = M.tree_attention(q, k, v, L, tree.parent, broken=True)
    assert (bad - ref).abs().max() > 0.1
    chain = M.Tree(((),) + tuple((0,) * d for d in range(1, 6)))        # a chain: causal IS the tree mask
    q, k, v, L = make_case(1, 2, 2, 16, len(chain), [7], seed=2)
    assert_close(M.tree_attention(q, k, v, L, chain.parent, broken=True), M.tree_attention_ref(q, k, v, L, chain.parent))


def test_bad_input_is_refused():
    tree = M.build_tree(ACC, 8)
    q, k, v, L = make_case(1, 4, 2, 16, len(tree), [5], seed=0)
    with pytest.raises(ValueError, match="parent must hold"):
        M.tree_attention(q, k, v, L, torch.flip(tree.parent, [0]))
    with pytest.raises(ValueError, match="lens must be"):
        M.tree_attention(q, k, v, L.long(), tree.parent)
    with pytest.raises(ValueError, match="Hq=4 must be a multiple"):
        k3 = torch.zeros(1, 3, k.shape[2], 16)
        M.tree_attention(q, k3, k3, L, tree.parent)
    with pytest.raises(ValueError, match="share a dtype"):
        M.tree_attention(q, k.double().float().half(), v, L, tree.parent)
    with pytest.raises(ValueError, match="lens \\+ T must fit"):
        M.tree_attention(q, k, v, L + 100, tree.parent)
    with pytest.raises(ValueError, match="blocks must be"):
        M.tree_attention(q, k, v, L, tree.parent, blocks=(24, 32))
    with pytest.raises(ValueError, match="broken must be"):
        M.tree_attention(q, k, v, L, tree.parent, broken=1)


# ---------------------------------------------------------------- on the tiny GPT

@pytest.fixture(scope="module")
def model():
    return load_pretrained()


@pytest.fixture(scope="module")
def heads():
    return M.load_heads()


@pytest.fixture(scope="module")
def tree():
    m = M.load_metrics()
    counts = torch.tensor(m["rank_counts"], dtype=torch.float64)[1:]
    return M.build_tree(counts / torch.tensor(m["n_scored"][1:])[:, None])


def test_tree_forward_equals_a_plain_forward_of_each_path(model, tree):
    prompt = list(b"KING LEAR:\nWhat says ")
    cache = KVCache.empty(model.config, 1, max_len=128 + len(tree))
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    toks = torch.randint(0, 256, (len(tree),), generator=torch.Generator().manual_seed(0))
    logits, _ = M.tree_forward(model, toks, tree, cache)
    par = tree.parent.tolist()
    plain = []
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path, j = [int(toks[j])] + path, par[j]
        with torch.no_grad():
            plain.append(model(torch.tensor([prompt + path]))[0, -1])
    plain = torch.stack(plain)                                         # 4 layers of fp32 sums in another order:
    assert (logits - plain).abs().max() < 1e-4                        # logits are O(10), so 1e-5 relative
    assert torch.equal(logits.argmax(-1), plain.argmax(-1))
    cache.seqlens[:] = len(prompt)
    tri, _ = M.tree_forward(model, toks, tree, cache, attention="triton")
    assert (tri - logits).abs().max() < 1e-4
    assert int(cache.seqlens[0]) == len(prompt)                        # the tree is not kept by itself


def test_greedy_medusa_equals_plain_greedy(model, heads, tree):
    for prompt in (list(b"ROMEO:\nWhat is the"), list(b"HAMLET:\nTo be, or not")):
        ref = M.plain_generate(model, prompt, 60)
        out, forwards, accepted = M.medusa_generate(model, heads, prompt, 60, tree)
        assert out == ref
        assert forwards == 1 + len(accepted) and forwards < 60 and sum(accepted) + forwards >= 60


def test_a_causal_tree_mask_breaks_the_verification(model, heads, tree):
    """With the causal mask, nodes see their siblings: the tree's logits, and the greedy choices made
    from them, are no longer those of each path."""
    prompt = list(b"ROMEO:\nWhat is the")
    cache = KVCache.empty(model.config, 1, max_len=128 + len(tree))
    with torch.no_grad():
        h = model(torch.tensor([prompt]), cache=cache, return_hidden=True)[0, -1]
    top = heads(h, model.wte.weight).topk(10, -1).indices
    toks = torch.tensor([int((h @ model.wte.weight.T).argmax())] +
                        [int(top[tree.depth[i] - 1, tree.rank[i]]) for i in range(1, len(tree))])
    good, _ = M.tree_forward(model, toks, tree, cache)
    bad, _ = M.tree_forward(model, toks, tree, cache, attention="broken")
    assert (bad - good).abs().max() > 1.0
    assert not torch.equal(bad.argmax(-1), good.argmax(-1))


def test_exact_rule_keeps_p_typical_does_not(model):
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        p = torch.softmax(torch.randn(40, generator=g, dtype=torch.float64) * 2, 0)
        cands = torch.randperm(40, generator=g)[:3].tolist()
        assert M.tv_distance(M.exact_children_output(p, cands), p) < 1e-12
        # one candidate: the same as speculative sampling with a one-hot draft (kernels.speculative.sampling)
        q = torch.nn.functional.one_hot(torch.tensor(cands[0]), 40).double()
        spec = S.emitted_distribution(S.accept_probability_ref(p, q), S.residual_ref(p, q), q)
        assert (spec - M.exact_children_output(p, cands[:1])).abs().max() < 1e-12
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    typ = M.typical_children_output(p, [0], eps=0.3, delta=0.3)
    assert torch.equal(typ, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))      # always the candidate
    assert M.tv_distance(typ, p) == pytest.approx(0.5)
    assert torch.equal(M.typical_children_output(p, [2], eps=0.1, delta=0.3), torch.tensor([0.0, 0.0, 1.0],
                                                                                       dtype=torch.float64))
    # H(p) = 1.03 nats: the threshold min(eps, delta e^-H) is 0.107 at delta 0.3, 0.25 at delta 0.7
    assert torch.equal(M.typical_children_output(p, [2], eps=0.3, delta=0.7), p)       # 0.2 < 0.25: rejected
    # both pass min(0.09, 0.3 e^-H) = 0.09: the more likely one is emitted, not the first by rank
    assert torch.equal(M.typical_children_output(p, [1, 0], eps=0.09, delta=0.3),
                       torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_typical_keeps_the_longest_path_then_the_most_likely():
    """The authors' selection: the deepest node whose whole path passes, ties by summed log p."""
    tree = M.Tree(((), (0,), (1,), (0, 0)))                              # root; two children; a grandchild of 1
    tokens = torch.tensor([9, 5, 6, 7])
    p_all = torch.full((4, 10), 0.1, dtype=torch.float64)
    p_all[0] = torch.tensor([0.0] * 5 + [0.3, 0.5] + [0.2 / 3] * 3, dtype=torch.float64)   # 5 and 6 both pass
    p_all[1, 7] = 0.9
    p_all[1] /= p_all[1].sum()                                          # 7 after 5: passes
    assert M.typical_best_node(p_all, tokens, tree, 0.09, 0.3) == 3       # longer beats more likely
    p_all[1] = 0.1
    p_all[1, 7], p_all[1, 0] = 0.01, 0.19                               # 7 after 5: 0.01 < 0.3 e^-H ~ 0.03
    assert M.typical_best_node(p_all, tokens, tree, 0.09, 0.3) == 2       # same length: the likelier (0.5)
    p_all[0, 5], p_all[0, 6] = 0.5, 0.3
    assert M.typical_best_node(p_all, tokens, tree, 0.09, 0.3) == 1
    p_all[0, 5:7] = 0.01
    p_all[0] /= p_all[0].sum()
    assert M.typical_best_node(p_all, tokens, tree, 0.09, 0.3) == 0       # nothing passes: the root


def test_sampling_rules_run(model, heads, tree):
    prompt = list(b"ROMEO:\nWhat is the")
    for rule in ("exact", "typical"):
        out, forwards, acc = M.medusa_generate(model, heads, prompt, 30, tree, rule=rule, temperature=0.8,
                                               generator=torch.Generator().manual_seed(1))
        assert len(out) == len(prompt) + 30 and out[: len(prompt)] == prompt and forwards == 1 + len(acc)
    with pytest.raises(ValueError, match="rule 'greedy' goes with temperature 0"):
        M.medusa_generate(model, heads, prompt, 10, tree, rule="exact")
    with pytest.raises(ValueError, match="exceed"):
        M.medusa_generate(model, heads, prompt, 120, tree)


def test_committed_heads_and_training_script(tmp_path, model, heads):
    """The committed metrics are those of the committed heads on the held-out windows, every head
    beats the untrained one (W = 0: the base head, one position late), and a short run still works."""
    m = M.load_metrics()
    x = M.eval_windows()
    counts = M.rank_accuracy(model, heads, x)
    assert counts.tolist() == m["rank_counts"] and M.n_scored(x).tolist() == m["n_scored"]
    untrained = M.rank_accuracy(model, M.MedusaHeads(model.config.d_model), x)
    assert bool((counts[1:, 0] > 2 * untrained[1:, 0]).all())
    assert M.main(["--steps", "3", "--windows", "16", "--batch", "4", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["steps"] == 3 and len(written["rank_counts"]) == M.N_HEADS + 1
    assert M.load_heads(tmp_path).n_heads == M.N_HEADS


# ---------------------------------------------------------------- ahead of time, at a real model's size

@pytest.fixture(scope="module")
def aot():
    jobs = M.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_compiles_without_spills_on_tensor_cores(aot):
    jobs, builds = aot
    table = ki.resource_table([(label, b["sm90"]) for label, b in builds.items()])
    for label, b in builds.items():
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, f"{label}\n{table}"
        assert b["sm90"].tensor_core == "HGMMA" and b["sm90"].async_copies["LDGSTS"] > 0, f"{label}\n{table}"
        assert jobs[label].programs == 32                          # 1 query block of 64 nodes x 32 heads


def test_batch_offset_is_a_64bit_product(aot):
    """b * stride_kb = b * Hkv * S * D passes 2**31 from b = 512 at Llama 3 8B's 8 x 4160 x 128."""
    jobs, builds = aot
    for label in jobs:
        runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
        assert ki.param_product_widths(builds[label]["sm90"], runtime_args.index("stride_kb")) == {64}
