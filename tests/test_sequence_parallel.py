"""Sequence parallelism of the tiny GPT on 2 gloo processes (one launch for the module,
kernels.dist.sequence_parallel.sp_worker): Megatron SP (t = 2) and Ulysses (p = 2) give the
single-process logits, loss and all gradients; each broken variant is caught; the bytes every
collective sent equal the module's formulas (Megatron SP's equal to tensor parallelism's); and TP + SP
saves fewer bytes per rank than TP alone."""
import pytest
import torch
import torch.nn.functional as F

from kernels.dist import sequence_parallel as sp
from kernels.dist.checkpointing import saved_bytes
from kernels.dist.launch import launch
from kernels.model.gpt import GPTConfig, load_pretrained

P, B, T = 2, 2, 12                 # T/2 = 6 tokens per rank
CFG = GPTConfig()
E = 8                              # float64
# float64 model whose RMSNorm computes in float32 (kernels.model.gpt.rms_norm_torch): the split and the
# one-process model agree to a few float32 roundings, the bound of the tensor/context-parallel tests.
REL = 1e-6
LOSS_TOL = 1e-6


@pytest.fixture(scope="module")
def run():
    return launch(sp.sp_worker, P, (B, T), timeout=120)


@pytest.fixture(scope="module")
def reference():
    idx, targets = sp._batch(B, T)
    model = load_pretrained().double().train()
    single, _ = saved_bytes(lambda: model(idx), model.parameters())
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads, "saved": single,
            "scale": max(float(g.abs().max()) for g in grads.values())}


def _errors(run, reference, label):
    """(max logit error, loss error, max gradient error / max|grad|) of rank 0's gradients."""
    logits = torch.cat([res[label]["logits"] for res in run.results], dim=1)     # contiguous shards
    loss = sum(res[label]["loss"].item() for res in run.results)
    grads = run.results[0][label]["grads"]
    g_err = max(float((grads[n] - reference["grads"][n]).abs().max()) for n in reference["grads"])
    return (float((logits - reference["logits"]).abs().max()), abs(loss - reference["loss"]),
            g_err / reference["scale"])


@pytest.mark.parametrize("label", ["megatron", "ulysses"])
def test_logits_loss_and_gradients_equal_one_process(run, reference, label):
    d_logits, d_loss, d_grad = _errors(run, reference, label)
    assert d_logits <= 10 * REL and d_loss <= LOSS_TOL and d_grad <= REL
    grads0 = run.results[0][label]["grads"]
    assert set(grads0) == set(reference["grads"]) and len(grads0) == 2 + 9 * CFG.n_layer
    for res in run.results[1:]:                                  # every rank holds the same sums
        assert all(torch.equal(res[label]["grads"][n], grads0[n]) for n in grads0)


@pytest.mark.parametrize("label", sp.BROKEN_MEGATRON)
def test_megatron_broken_backward_is_caught_by_the_gradients(run, reference, label):
    d_logits, d_loss, d_grad = _errors(run, reference, label)
    assert d_logits <= 10 * REL and d_loss <= LOSS_TOL          # the forward is untouched
    assert d_grad > 1e-2


def test_ulysses_local_positions_changes_the_logits(run, reference):
    assert _errors(run, reference, "local_positions")[0] > 1.0


def test_collective_bytes_equal_the_formulas(run):
    want_m = sp.megatron_sp_bytes(B, T, CFG.d_model, P, E, layers=CFG.n_layer)
    want_u = sp.ulysses_bytes(B, T, CFG.n_head, CFG.n_kv_head, CFG.head_dim, P, E, layers=CFG.n_layer)
    # by hand: 2 all-gathers + 2 reduce-scatters of (t-1)/t B T C per layer; = TP's 2 ring all-reduces
    assert want_m["forward"] == 4 * CFG.n_layer * B * T * CFG.d_model * E // 2
    assert want_m["forward"] == CFG.n_layer * 2 * (2 * (P - 1) * B * T * CFG.d_model * E // P)
    # Ulysses: Q (4 heads), K, V (2 heads each), output (4 heads), half of each leaves the rank
    assert want_u["forward"] == CFG.n_layer * B * (T // 2) * (4 + 2 + 2 + 4) * CFG.head_dim * E // 2
    for res in run.results:
        lm, lu = res["megatron"]["ledger"], res["ulysses"]["ledger"]
        assert lm["all-gather forward"] + lm["reduce-scatter forward"] == want_m["forward"]
        assert lm["all-gather backward"] + lm["reduce-scatter backward"] == want_m["backward"]
        assert lu["all-to-all forward"] == want_u["forward"] and lu["all-to-all backward"] == want_u["backward"]


def test_sequence_parallel_saves_less_than_tensor_parallel(run, reference):
    saved = [res["saved"] for res in run.results]
    assert saved[0] == saved[1]
    assert saved[0]["sp"] < saved[0]["tp"] < reference["saved"]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="broken"):
        sp.SPGPT(load_pretrained(), broken="nope")
    with pytest.raises(ValueError, match="broken"):
        sp.ulysses_forward(load_pretrained(), torch.zeros(1, 2, dtype=torch.long), broken="nope")
