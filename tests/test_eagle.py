"""EAGLE (kernels.speculative.eagle): the Triton EAGLE-2 expansion step against the PyTorch reference
(awkward shapes, ties, NaN canaries, a variant that forgets the parent's log-prob caught, bad input
refused), the draft's tree mask against plain causal runs of each path, training-time test equal
to drafting at decoding time, greedy EAGLE decoding (chain, static tree, dynamic tree; PyTorch and
Triton) equal to plain greedy decoding, the committed drafts and the training script, and the
kernel's compile facts at Llama 3's vocabulary on sm_90a."""
from __future__ import annotations

import json

import pytest
import torch

import kernels  # noqa: F401  (switches Triton's interpreter on without a GPU)
from kernels import inspect as ki
from kernels.model import load_pretrained
from kernels.speculative import eagle as G


def make_logp(M, V, seed, pad=5, ties=False):
    """log-probs (M, V) as a view into a NaN-filled buffer (canaries right of every row)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(M, V, generator=g)
    if ties:
        z = (z * 2).round() / 2                                   # many equal values
    buf = torch.full((M + 1, V + pad), float("nan"))
    logp = buf[1:, :V]
    logp.copy_(torch.log_softmax(z, -1))
    cum = -torch.rand(M, generator=g) * 3
    if ties:
        cum = torch.zeros(M)
    return logp, cum


@pytest.mark.parametrize("M,V,k,m,block", [
    (5, 300, 4, 7, 128),          # several blocks and a tail
    (1, 256, 10, 3, 256),         # one node (the root), one block
    (13, 1000, 3, 39, 256),       # keep every child
    (7, 257, 5, 12, 64),          # a one-element tail
])
def test_expand_matches_reference(M, V, k, m, block):
    logp, cum = make_logp(M, V, seed=M * V + k)
    ref = G.tree_expand_ref(logp, cum, k, m)
    out = G.tree_expand(logp, cum, k, m, block_v=block)
    for a, b in zip(out, ref):
        assert torch.equal(a, b.to(a.dtype))


def test_expand_ties_go_to_the_lower_index():
    logp, cum = make_logp(6, 200, seed=3, ties=True)
    ref = G.tree_expand_ref(logp, cum, 6, 20)
    out = G.tree_expand(logp, cum, 6, 20, block_v=64)
    for a, b in zip(out, ref):
        assert torch.equal(a, b.to(a.dtype))


def test_broken_expand_is_caught():
    """Children scored by their own log-prob: another set of nodes is kept."""
    logp, cum = make_logp(6, 300, seed=4)
    cum = torch.tensor([0.0, -0.5, -1.0, -4.0, -6.0, -8.0])
    ref = G.tree_expand_ref(logp, cum, 4, 8)
    bad = G.tree_expand(logp, cum, 4, 8, broken=True, block_v=128)
    assert not torch.equal(bad[2], ref[2])
    assert set(zip(bad[0].tolist(), bad[1].tolist())) != set(zip(ref[0].tolist(), ref[1].tolist()))


def test_bad_input_is_refused():
    logp, cum = make_logp(3, 50, seed=0)
    with pytest.raises(ValueError, match="logp"):
        G.tree_expand(logp.double(), cum, 2, 2)
    with pytest.raises(ValueError, match="cum"):
        G.tree_expand(logp, cum[:2], 2, 2)
    with pytest.raises(ValueError, match="k must"):
        G.tree_expand(logp, cum, 0, 2)
    with pytest.raises(ValueError, match="m must"):
        G.tree_expand(logp, cum, 2, 7)
    with pytest.raises(ValueError, match="contiguous"):
        G.tree_expand(logp.t().contiguous().t(), cum, 2, 2)
    with pytest.raises(ValueError, match="broken"):
        G.tree_expand(logp, cum, 2, 2, broken=1)
    with pytest.raises(ValueError, match="block_v"):
        G.tree_expand(logp, cum, 2, 2, block_v=100)


# ---------------------------------------------------------------- the draft on the tiny GPT

@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_pretrained()


@pytest.fixture(scope="module")
def draft():
    return G.load_draft("draft")


def test_draft_tree_mask_equals_a_causal_run_of_each_path(model, draft):
    """Drafting a tree in one pass of the draft (prefix + nodes, ancestor mask) gives every node the
    feature a plain causal run of prefix + that node's path gives."""
    E = model.wte.weight.detach()
    x = torch.tensor(list(b"KING LEAR:\nWhat says "))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        f = model(x[None, :-1], return_hidden=True)[0]            # f_0..f_{n-1}; x_n is the root
        n = f.shape[0]
        parent = [-1, -1, 0, 0, 2, 1, 4]                           # node parents (-1: the prefix's end)
        depth = [1, 1, 2, 2, 3, 2, 4]
        node_in = torch.randn(len(parent), f.shape[1], generator=g)
        node_tok = torch.randint(0, 256, (len(parent),), generator=g)
        _, g_nodes = G.draft_run(draft, E, f, x, node_in, node_tok, parent, depth)
        u_prefix = draft.fuse(f, E[x[1:]])
        for i in range(len(parent)):
            chain, j = [], i
            while j >= 0:
                chain.append(j)
                j = parent[j]
            chain = chain[::-1]
            seq = torch.cat([u_prefix, draft.fuse(node_in[chain], E[node_tok[chain]])])
            T = seq.shape[0]
            ref = draft(seq[None], torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril())[0, -1]
            assert T == n + depth[i]
            assert torch.allclose(g_nodes[i], ref, atol=1e-5), i


def test_training_time_test_is_what_decoding_sees(model, draft):
    """Step j of the TTT unroll at position t equals the draft's chain after the target's f_0..f_t
    with the true next tokens drafted: training sees what decoding sees."""
    E = model.wte.weight.detach()
    x = G.eval_windows(1)[:, :40]
    with torch.no_grad():
        f = model(x, return_hidden=True)
        gs = G.ttt_features(draft, f, x, E, 3)
        t = 20
        feats, toks = f[0, : t + 1], x[0, : t + 2]                # f_0..f_t, x_0..x_{t+1}
        g_root, _ = G.draft_run(draft, E, feats, toks, feats[:0], toks[:0], [], [])
        assert torch.allclose(g_root, gs[0][0, t], atol=1e-5)
        node_in, prev = [], g_root
        for j in (1, 2):
            node_in.append(prev)
            _, g = G.draft_run(draft, E, feats, toks, torch.stack(node_in), x[0, t + 2: t + 2 + j],
                               list(range(-1, j - 1)), list(range(1, j + 1)))
            prev = g[-1]
            assert torch.allclose(prev, gs[j][0, t], atol=1e-5)


PROMPTS = [list(b"ROMEO:\nWhat is the"), list(b"HAMLET:\nTo be, or not")]


@pytest.mark.parametrize("mode,attention,expand", [
    ("chain", "ref", "ref"), ("dynamic", "ref", "ref"), ("dynamic", "triton", "triton"), ("static", "ref", "ref"),
])
def test_greedy_eagle_equals_plain_greedy(model, draft, mode, attention, expand):
    for p in PROMPTS[: 1 if attention == "triton" else 2]:
        ref = model.generate(torch.tensor([p]), 24)[0].tolist()
        out, fw, acc = G.eagle_generate(model, draft, p, 24, mode=mode, depth=3, topk=3, n_nodes=8,
                                        tree=G.static_tree(3, [2, 2, 1]), attention=attention, expand=expand)
        assert out == ref
        assert fw == 1 + len(acc) and sum(acc) + len(acc) >= 24 - 1


def test_bad_decoding_options_are_refused(model, draft):
    with pytest.raises(ValueError, match="mode"):
        G.eagle_generate(model, draft, PROMPTS[0], 8, mode="beam")
    with pytest.raises(ValueError, match="tree"):
        G.eagle_generate(model, draft, PROMPTS[0], 8, mode="static")
    with pytest.raises(ValueError, match="exceed"):
        G.eagle_generate(model, draft, PROMPTS[0], 120)


def test_committed_drafts_and_training_script(tmp_path, model):
    """The committed chain accuracies are those of the committed drafts on the held-out windows; the
    trained draft beats an untrained one; a short run of the script still works."""
    m = G.load_metrics()
    x = G.eval_windows(8)
    E = model.wte.weight.detach()
    with torch.no_grad():
        f = G.target_features(model, x)
    full = G.eval_windows()
    for name, run in m["runs"].items():
        d = G.load_draft(name)
        if name == "draft":
            hits, totals = G.chain_accuracy(d, G.target_features(model, full), full, E)
            assert hits == run["chain_hits"] and totals == run["chain_totals"]
    trained = G.chain_accuracy(G.load_draft("draft"), f, x, E)[0][0]
    untrained = G.chain_accuracy(G.EagleDraft(model.config), f, x, E)[0][0]
    assert trained > 2 * untrained
    assert G.main(["--steps", "2", "--windows", "8", "--batch", "4", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["steps"] == 2 and set(written["runs"]) == {"draft", "draft_ttt"}
    assert G.load_draft("draft_ttt", tmp_path).fc.weight.shape == (128, 256)


def test_feature_only_ablation_ignores_the_token_and_its_runs_are_the_committed_ones(model):
    """FeatureOnlyDraft's input does not depend on the token (the full draft's does), it starts from the
    full draft's seeded initialisation, and a committed ablation draft reproduces its stored counts."""
    from kernels.speculative import eagle_ablation as A

    torch.manual_seed(3)
    full = G.EagleDraft(model.config)
    torch.manual_seed(3)
    ablated = A.FeatureOnlyDraft(model.config)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), ablated.state_dict().values()))
    f, e1, e2 = torch.randn(3, 2, 5, model.config.d_model).unbind(0)
    assert torch.equal(ablated.fuse(f, e1), ablated.fuse(f, e2))
    assert not torch.allclose(full.fuse(f, e1), full.fuse(f, e2))
    stored = json.loads((A.OUT_DIR / "feature_only-seed2.json").read_text())
    x = G.eval_windows()
    hits, totals = G.chain_accuracy(A.load("feature_only", 2), G.target_features(model, x), x, model.wte.weight.detach())
    assert [hits, totals] == [stored["chain_hits"], stored["chain_totals"]]
    with pytest.raises(ValueError, match="arm"):
        A.main(["wrong:0"])


def test_wide_medusa_has_the_drafts_capacity_and_its_runs_are_the_committed_ones(model):
    """WideMedusaHeads: within 0.01 % of the EAGLE draft's parameter count, every head starts as the
    base model's own head (as Medusa's do); a committed run's first training step is reproduced from
    the code (the seeded windows and minibatch), and its stored heads reproduce its stored rank counts."""
    from kernels.speculative import eagle_capacity as C
    from kernels.speculative import medusa as M

    n_draft = sum(p.numel() for p in G.EagleDraft(model.config).parameters())
    wide = C.WideMedusaHeads(model.config.d_model)
    n_wide = sum(p.numel() for p in wide.parameters())
    assert abs(n_wide - n_draft) < 1e-4 * n_draft and n_draft > 3 * sum(p.numel() for p in M.MedusaHeads(128).parameters())
    E = model.wte.weight.detach()
    h = torch.randn(2, 3, model.config.d_model)
    assert torch.equal(wide(h, E), (h @ E.T)[:, :, None].expand(-1, -1, M.N_HEADS, -1))
    stored = json.loads((C.OUT_DIR / "wide-seed1.json").read_text())
    assert stored["parameters"] == n_wide and stored["command"].endswith("wide:1")
    _, log = M.train_heads(model, 1, n_windows=C.WINDOWS, batch=C.BATCH, seed=1, heads_cls=C.WideMedusaHeads,
                           progress=False)
    assert log[0] == pytest.approx(stored["first_step_losses"], rel=1e-5)
    x = M.eval_windows()
    assert M.rank_accuracy(model, C.load("wide", 1), x).tolist() == stored["rank_counts"]
    with pytest.raises(ValueError, match="arm"):
        C.main(["wrong:0"])


# ---------------------------------------------------------------- ahead of time, at a real vocabulary

@pytest.fixture(scope="module")
def aot():
    jobs = G.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_compiles_without_spills(aot):
    jobs, builds = aot
    table = ki.resource_table([(label, b["sm90"]) for label, b in builds.items()])
    for label, b in builds.items():
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, f"{label}\n{table}"
        assert b["sm90"].tensor_core == "-", f"{label}\n{table}"                   # a reduction: no MMA
        fam = b["sm90"].families()
        assert fam["SHFL"] > 0 and fam["LDG"] > 0, f"{label} {sorted(fam)}"        # warp-shuffle max over loaded tiles
    assert [j.programs for j in jobs.values()] == [10, 64, 1]              # one program per frontier node; one to select


def test_row_offset_is_a_64bit_product(aot):
    """row * stride_m = row * 128256 passes 2**31 from row 16745 on."""
    jobs, builds = aot
    for label in list(jobs)[:2]:
        runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
        assert ki.param_product_widths(builds[label]["sm90"], runtime_args.index("stride_m")) == {64}
