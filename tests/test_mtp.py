"""Multi-token prediction (kernels.speculative.mtp): the Triton weighted multi-depth cross-entropy
and its gradient against PyTorch autograd (awkward shapes, strided views into NaN-filled buffers, a
variant that scores each depth against the wrong shift caught, bad inputs refused by name); the two
architectures' shapes and causality; greedy decoding with the MTP module as the draft equal to plain
greedy decoding, its cached drafts equal to an uncached replay; a short slice of the training run;
and the kernels' compile facts at DeepSeek-V3's vocabulary on sm_90a."""
from __future__ import annotations

import json

import pytest
import torch

import kernels  # noqa: F401  (switches Triton's interpreter on without a GPU)
from kernels import inspect as ki
from kernels.speculative import mtp as M
from kernels.testing import MismatchError, assert_close


def make_case(K, B, T, V, L, seed, dtype=torch.float32):
    """logits (K, B, T, V) as a view into a NaN-filled buffer (padding on every side), tokens (B, L)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((K + 1, B + 1, T + 3, V + 7), float("nan"), dtype=dtype)
    logits = buf[1:, :B, 2:T + 2, 3:V + 3]
    logits.copy_((torch.randn(K, B, T, V, generator=g) * 4).to(dtype))
    tokens = torch.randint(0, V, (B, L), generator=g)
    weights = torch.rand(K, generator=g) + 0.1
    return logits, tokens, weights


@pytest.mark.parametrize("K,B,T,V,L,block_v", [
    (2, 3, 7, 77, 8, 32),      # L = T + 1: depth 1 has T - 1 targeted rows; V spans 3 blocks with a tail
    (3, 2, 5, 130, 9, 64),     # L > T + 2: every row of every depth has a target
    (1, 1, 1, 19, 2, 16),      # one row
    (4, 2, 6, 50, 6, 16),      # the deepest depth has T - 3 rows; L < T + 1: the main depth loses a row too
])
def test_loss_and_gradient_match_autograd(K, B, T, V, L, block_v):
    logits, tokens, weights = make_case(K, B, T, V, L, seed=K * 100 + V)
    a = logits.detach().clone().requires_grad_()
    ref = M.mtp_cross_entropy_ref(a, tokens, weights)
    ref.backward(torch.tensor(1.7))
    x = logits.detach().clone().requires_grad_()
    out = M.mtp_cross_entropy(logits, tokens, weights, block_v=block_v)   # the view itself, NaN around it
    assert_close(out, ref.detach(), name="mtp_cross_entropy")
    out2 = M.mtp_cross_entropy(x, tokens, weights, block_v=block_v)
    out2.backward(torch.tensor(1.7))
    assert_close(x.grad, a.grad, name="d loss / d logits")
    rows_without_target = [(k, t) for k in range(K) for t in range(T) if t + k + 1 >= L]
    for k, t in rows_without_target:
        assert bool((x.grad[k, :, t] == 0).all())


def test_bf16_logits():
    logits, tokens, weights = make_case(2, 2, 9, 61, 10, seed=3, dtype=torch.bfloat16)
    ref = M.mtp_cross_entropy_ref(logits.float(), tokens, weights)
    assert_close(M.mtp_cross_entropy(logits, tokens, weights, block_v=16), ref, dtype=torch.bfloat16)


def test_wrong_shift_is_caught():
    logits, tokens, weights = make_case(2, 3, 7, 77, 8, seed=11)
    ref = M.mtp_cross_entropy_ref(logits, tokens, weights)
    with pytest.raises(MismatchError):
        assert_close(M.mtp_cross_entropy(logits, tokens, weights, block_v=32, broken=True), ref)


def test_bad_inputs_refused_by_name():
    logits, tokens, weights = make_case(2, 2, 4, 20, 5, seed=0)
    with pytest.raises(ValueError, match="logits must be"):
        M.mtp_cross_entropy(logits[0], tokens, weights)
    with pytest.raises(ValueError, match="dtype"):
        M.mtp_cross_entropy(logits.double(), tokens, weights)
    with pytest.raises(ValueError, match="tokens must be"):
        M.mtp_cross_entropy(logits, tokens.int(), weights)
    with pytest.raises(ValueError, match="weights must be"):
        M.mtp_cross_entropy(logits, tokens, weights[:1])
    with pytest.raises(ValueError, match="depth 1 has no target"):
        M.mtp_cross_entropy(logits, tokens[:, :2], weights)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V=20\)"):
        M.mtp_cross_entropy(logits, tokens + 20, weights)
    with pytest.raises(ValueError, match="contiguous in the vocabulary"):
        M.mtp_cross_entropy(logits.transpose(2, 3).contiguous().transpose(2, 3), tokens, weights)
    with pytest.raises(ValueError, match="block_v"):
        M.mtp_cross_entropy(logits, tokens, weights, block_v=24)
    with pytest.raises(ValueError, match="broken must be a bool"):
        M.mtp_cross_entropy(logits, tokens, weights, broken=1)


def test_architectures_shapes_and_causality():
    cfg = M.GPTConfig(n_layer=2, d_model=32, n_head=2, n_kv_head=1, d_ff=64, block_size=16)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 12))
    for kind in ("parallel", "sequential"):
        model, extra = M.build_arm(kind, 2, cfg)
        out = M.arm_logits(model, extra, x)
        assert [tuple(o.shape) for o in out] == [(2, 12, 256), (2, 11, 256), (2, 10, 256)]
        x2 = x.clone()
        x2[:, 8:] = (x2[:, 8:] + 1) % 256                 # change the future from position 8 on
        out2 = M.arm_logits(model, extra, x2)
        for k, (a, b) in enumerate(zip(out, out2)):
            # depth k at position i reads tokens up to i + k (sequential) or i (parallel)
            seen = 8 - (k if kind == "sequential" else 0)
            assert torch.equal(a[:, :seen], b[:, :seen]), (kind, k)
            assert not torch.equal(a[:, seen:], b[:, seen:]), (kind, k)
        assert torch.equal(out[0], model(x))              # depth 0 is the plain GPT


def test_detached_module_sends_no_gradient_into_the_shared_table():
    """The ablation arm's forward equals the plain sequential arm's; its depth-1 loss reaches the trunk
    (and through the trunk the input rows of the tokens it read) but not the table as the module's
    input or output head, whose gradient touches every row in the plain arm (so the check can fail)."""
    cfg = M.GPTConfig(n_layer=2, d_model=32, n_head=2, n_kv_head=1, d_ff=64, block_size=16)
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = {}
    for kind in ("sequential", "sequential_detached"):
        torch.manual_seed(0)
        model, extra = M.build_arm(kind, 1, cfg)
        out = M.arm_logits(model, extra, x)
        out[1].square().mean().backward()                                  # a depth-1 loss only
        grads[kind] = (out, model.wte.weight.grad, model.blocks[0].attn.wq.weight.grad)
    (a, ga, ta), (b, gb, tb) = grads["sequential"], grads["sequential_detached"]
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    unread = torch.ones(256, dtype=torch.bool)
    unread[x.unique()] = False                                             # rows the trunk never reads
    assert ga[unread].abs().sum() > 0 and gb[unread].abs().sum() == 0
    assert gb[~unread].abs().sum() > 0 and ta.abs().sum() > 0 and tb.abs().sum() > 0


@pytest.fixture(scope="module")
def run():
    return M.load_run()


def test_speculative_greedy_equals_plain_and_replays(run):
    model, module = run
    prompts = M.validation_windows(model.config, 4)[:, :20]
    for prompt in prompts:
        prompt = prompt[None]
        toks, st = M.mtp_speculative_greedy(model, module, prompt, 30)
        assert torch.equal(toks, model.generate(prompt, 30))
        # every round yields 1 + (accepted) tokens after the prefill's one; the last may be cut
        assert st["drafted"] == st["target_forwards"] - 1
        assert 30 <= 1 + st["drafted"] + st["accepted"] <= 31
        # replay without caches: the module's depth-1 guesses over the final sequence
        seq = M.SequentialMTP(model.config, 1)
        seq.modules_[0] = module
        d = seq(model, toks)[1].argmax(-1)[0]                                   # d[j] guesses toks[j + 2]
        j, acc, n = prompt.shape[1] - 1, 0, 0
        while j + 2 < toks.shape[1] and n < st["drafted"]:
            n += 1
            if d[j] == toks[0, j + 2]:
                acc, j = acc + 1, j + 2
            else:
                j += 1
        assert acc == st["accepted"]


def test_training_slice_runs_and_learns():
    _, extra, res = M.train_arm("sequential D=1", steps=6, batch=2, eval_every=3, val_windows=4, progress=False,
                                config=M.GPTConfig(n_layer=2, d_model=32, n_head=2, n_kv_head=1, d_ff=64, block_size=16))
    assert res["val_extra"] is not None and len(res["log"]) == 6
    assert res["log"][-1]["val_next"] < 5.6                       # below uniform (ln 256 = 5.55) after 6 steps
    meta = json.loads((M.MODEL_DIR / "metrics.json").read_text())
    assert [a["arm"] for a in meta["arms"]] == list(M.ARMS)


@pytest.fixture(scope="module")
def aot():
    jobs = M.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_compiles_without_spills_at_deepseek_v3_vocab(aot):
    jobs, builds = aot
    assert len(jobs) == 2
    for label, b in builds.items():
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, label
        assert jobs[label].programs == 2 * 4 * 4096                 # one program per (depth, row)
        runtime_args = [n for n, kind in jobs[label].signature.items() if kind != "constexpr"]
        # the logits hold 2 * 4 * 4096 * 129280 = 4.2e9 elements: the depth offset k * s_lk must be a 64-bit product
        assert ki.param_product_widths(b["sm90"], runtime_args.index("s_lk")) == {64}, label
