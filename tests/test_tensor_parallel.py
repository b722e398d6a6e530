"""Tensor parallelism of the tiny GPT on 2 and 4 gloo processes (one launch for the module): logits
and every gradient equal the single-process model, the all-reduces are the 2 + 2 per layer the
derivation counts, and a wrong f or g is caught."""
import pytest
import torch
import torch.nn as nn

from kernels.dist import tensor_parallel as tp
from kernels.dist.launch import launch
from kernels.model.gpt import GPTConfig

B, T = 3, 37                       # T not a power of two, below the 128-token block
CFG = GPTConfig()
# The model's RMSNorm computes in float32 inside the float64 model (kernels.model.gpt.rms_norm_torch),
# so TP and single-process runs agree to a few float32 roundings of the largest value, not to float64's.
REL = 1e-6


@pytest.fixture(scope="module")
def results():
    return launch(tp.tp_worker, 4, (B, T), timeout=180).results


@pytest.mark.parametrize("t", [2, 4])
def test_logits_and_gradients_equal_the_single_process_model(results, t):
    for rank, res in enumerate(results):
        r = res[t]
        assert r["logits"] <= REL * 10, f"t={t} rank {rank}: logits max |diff| {r['logits']}"
        bad = {n: e for n, e in r["grads"].items() if e > REL * r["grad_scale"]}
        assert not bad, f"t={t} rank {rank}: gradients off: {bad}"
        assert len(r["grads"]) == 2 + 9 * CFG.n_layer          # every parameter of the model compared


@pytest.mark.parametrize("t", [2, 4])
def test_two_all_reduces_per_layer_each_way(results, t):
    payload = B * T * CFG.d_model * 8                            # one (B, T, C) float64 activation
    r = results[0][t]
    assert r["calls"] == {"g forward": 2 * CFG.n_layer, "f backward": 2 * CFG.n_layer}
    assert r["payload"] == {"g forward": 2 * CFG.n_layer * payload, "f backward": 2 * CFG.n_layer * payload}


def test_parameters_per_rank():
    C, D, ff, L = CFG.d_model, CFG.head_dim, CFG.d_ff, CFG.n_layer
    sharded = L * (2 * C * CFG.n_head * D + 2 * C * CFG.n_kv_head * D + 3 * C * ff)
    norms = L * 2 * C
    assert sharded + norms == 738304
    # t=2: everything sharded halves; t=4: each rank keeps 1 of the 2 K/V heads (replicated, not quartered)
    kv = L * 2 * C * CFG.n_kv_head * D
    assert (sharded // 2 + norms, (sharded - kv) // 4 + kv // 2 + norms) == (369664, 201728)


def test_parameters_per_rank_measured(results):
    assert results[0][2]["block_params_per_rank"] == 369664
    assert results[0][4]["block_params_per_rank"] == 201728


def test_each_broken_operator_is_caught(results):
    for rank, res in enumerate(results):
        f_bad, g_bad = res["f_no_backward_reduce"], res["g_no_forward_reduce"]
        assert f_bad["logits"] <= REL * 10                        # f is the identity forward: logits still right
        assert max(f_bad["grads"].values()) > 100 * REL * f_bad["grad_scale"]   # but gradients are not
        assert g_bad["logits"] > 1.0


def test_head_split():
    q, kv = tp.head_split(4, 2, 4, 3)
    assert q.tolist() == [3] and kv.tolist() == [1]              # K/V head 1 replicated on ranks 2 and 3
    q, kv = tp.head_split(8, 2, 2, 1)
    assert q.tolist() == [4, 5, 6, 7] and kv.tolist() == [1]
    assert tp._head_rows(torch.tensor([1]), 3).tolist() == [3, 4, 5]


def test_bad_input():
    with pytest.raises(ValueError, match="352 items do not split evenly over 3 ranks"):
        tp.split_range(352, 3, 0)
    with pytest.raises(ValueError, match="broken must be None or one of"):
        tp.TPGPT(None, broken="nope")
    with pytest.raises(ValueError, match="have no bias"):
        tp.ShardedLinear(nn.Linear(4, 4), torch.arange(2), 0)
