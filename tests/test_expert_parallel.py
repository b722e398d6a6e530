"""Expert parallelism on 2 gloo processes (one launch for the module, kernels.dist.expert_parallel.ep_worker):
dispatch and combine with uneven all-to-all splits give the single-process MoE layer's outputs, input
gradients, expert gradients and (all-reduced) router gradient; the bytes each rank sent are the rows
that left it; the variant that does not regroup the received rows is caught."""
import pytest
import torch

from kernels.dist import expert_parallel as ep
from kernels.dist.launch import launch

P, PER = 2, 7                      # 7 tokens a rank, top-2 of 8 experts: 14 assignments a rank
REL = 1e-12                        # float64 on both sides; only the summation order differs


@pytest.fixture(scope="module")
def run():
    return launch(ep.ep_worker, P, (PER,), timeout=120)


@pytest.fixture(scope="module")
def reference():
    layer = ep.make_layer()
    x = ep.tokens(P, PER, layer.config.d_model).requires_grad_(True)
    y = layer(x)
    y.backward(ep.tokens(P, PER, layer.config.d_model, seed=2))
    return {"y": y.detach(), "dx": x.grad, "w_gate_up": layer.w_gate_up.grad, "w_down": layer.w_down.grad,
            "router": layer.router.weight.grad, "layer": layer}


def _gathered(run, label, key):
    return torch.cat([res[label][key] for res in run.results])


def _rel(got, want):
    return float((got - want).abs().max()) / float(want.abs().max())


def test_outputs_and_every_gradient_equal_one_process(run, reference):
    for key in ("y", "dx", "w_gate_up", "w_down"):
        assert _rel(_gathered(run, "ep", key), reference[key]) < REL, key
    for res in run.results:                                    # the replicated router, all-reduced
        assert _rel(res["ep"]["router"], reference["router"]) < REL


def test_no_regroup_is_caught(run, reference):
    assert _rel(_gathered(run, "no_regroup", "y"), reference["y"]) > 1e-3


def test_bytes_are_the_rows_that_leave(run, reference):
    cfg = reference["layer"].config
    row = cfg.d_model * 8
    leaving = [res["ep"]["leaving"] for res in run.results]
    assert 0 < sum(leaving) < P * PER * cfg.top_k                  # uneven, some rows stay, some leave
    for r, res in enumerate(run.results):
        ledger = res["ep"]["ledger"]
        assert ledger["dispatch forward"] == leaving[r] * row == ledger["combine backward"]
        # what this rank combines back is what the other rank dispatched to it
        assert ledger["combine forward"] == leaving[1 - r] * row == ledger["dispatch backward"]
    assert sum(res["ep"]["ledger"]["rows computed here"] for res in run.results) == P * PER * cfg.top_k


def test_expert_rank_and_uniform_traffic():
    assert ep.expert_rank(torch.arange(8), 8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="do not split evenly"):
        ep.expert_rank(torch.arange(6), 6, 4)
    ids = torch.tensor([[0, 7], [3, 4]])                         # rank 0 of 2 holds experts 0-3
    assert ep.assignments_leaving(ids, 8, 2, 0) == 2
    # uniform routing: (p - 1)/p of the k rows leave, there and back, C values of E bytes each
    assert ep.traffic_per_token(8, 7168, 1, 64) == 2 * 8 * 7168 * 63 / 64


def test_triton_grouped_gemm_on_the_received_rows(run, reference):
    """The same layer in float32 with the routing chapter's Triton grouped GEMM (interpreted) on each
    rank's received rows: outputs and every gradient within float32 rounding of the float64 layer."""
    for key in ("y", "dx", "w_gate_up", "w_down"):
        assert _rel(_gathered(run, "triton", key), reference[key]) < 1e-5, key
    assert _gathered(run, "triton", "y").dtype == torch.float32
    with pytest.raises(ValueError, match="gemm must be one of"):
        ep.ep_moe_forward(reference["layer"], torch.zeros(1, 64, dtype=torch.float64), gemm="cutlass")
