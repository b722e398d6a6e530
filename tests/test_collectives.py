"""Ring and tree collectives over send/recv against torch.distributed's own, on 3 and 4 gloo
processes (one launch per world size, shared by the module), with the bytes each rank sent equal
to the derivation and each broken variant caught."""
import math

import pytest
import torch

from kernels.dist import collectives as C
from kernels.dist import cost_model as cm
from kernels.dist.launch import launch

SIZES = (1, 3, 4, 7, 100, 1001)      # smaller than p, not divisible by p, divisible, several chunks


@pytest.fixture(scope="module", params=[3, 4], ids=lambda p: f"p{p}")
def run(request):
    p = request.param
    return p, launch(C.check_worker, p, (SIZES,), timeout=120).results


def test_every_collective_equals_torch_distributed(run):
    p, results = run
    for rank, res in enumerate(results):
        for (name, n, dtype), diff in res["diffs"].items():
            bound = 0.0 if dtype == "float64" else 1e-5     # float64 inputs are small integers: exact sums
            assert diff <= bound, f"p={p} rank {rank}: {name} n={n} {dtype}: max |diff| {diff}"


def test_bytes_sent_match_the_derivation(run):
    p, results = run
    for rank, res in enumerate(results):
        for (name, n, dtype), (sent, messages) in res["sent"].items():
            nbytes = n * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            chunk = [c.numel() * nbytes // n for c in torch.empty(n).tensor_split(p)]
            if name == "ring_all_reduce":       # p - 1 chunks out in each phase; the chunk sent depends on rank
                want = sum(chunk[(rank - s - 1) % p] for s in range(p - 1)) + sum(chunk[(rank - s) % p] for s in range(p - 1))
                assert messages == 2 * (p - 1)
                if n % p == 0:
                    assert sent == C.ring_all_reduce_bytes(nbytes, p) == cm.ring_all_reduce_terms(nbytes, p)[1]
            elif name == "ring_reduce_scatter":
                want = sum(chunk[(rank - s - 1) % p] for s in range(p - 1))
                if n % p == 0:
                    assert sent == C.ring_reduce_scatter_bytes(nbytes, p)
            elif name == "ring_all_gather":
                want = (p - 1) * nbytes
                assert sent == C.ring_all_gather_bytes(p * nbytes, p)
            else:
                want = C.tree_all_reduce_bytes(nbytes, p, rank)
            assert sent == want, f"p={p} rank {rank} {name} n={n}: sent {sent}, derived {want}"


def test_ring_all_reduce_sends_2_p_minus_1_over_p_not_p_times_n(run):
    """The misconception: an all-reduce moves the whole buffer to every other rank (n (p - 1) bytes)."""
    p, results = run
    sent, _ = results[0]["sent"][("ring_all_reduce", 100, "float64")] if p == 4 else (None, None)
    if p == 4:
        assert sent == 1200 and sent < 800 * (p - 1)


def test_each_broken_variant_is_caught(run):
    p, results = run
    for rank, res in enumerate(results):
        for name, diff in res["broken"].items():
            if name == "ring_reduce_scatter/short" or name == "tree_all_reduce/overwrite" and rank != 0:
                continue                 # caught on other ranks (below): not every rank's share is wrong
            assert diff >= 1, f"p={p} rank {rank}: {name} not caught (max |diff| {diff})"
    for name in results[0]["broken"]:
        assert max(r["broken"][name] for r in results) >= 1, name


def test_tree_step_count_and_bytes():
    assert C.tree_steps(4) == 4 and C.tree_steps(3) == 4 and C.tree_steps(8) == 6 and C.tree_steps(1) == 0
    assert [C.tree_all_reduce_bytes(10, 4, r) for r in range(4)] == [20, 10, 20, 10]
    assert [C.tree_all_reduce_bytes(10, 3, r) for r in range(3)] == [20, 10, 10]


def test_bad_input_gives_clear_errors():
    with pytest.raises(TypeError, match="ring_all_reduce: x must be a torch.Tensor"):
        C.ring_all_reduce([1.0])
    with pytest.raises(ValueError, match="tree_all_reduce: broken must be None or one of"):
        C.tree_all_reduce(torch.ones(2), broken="nope")
    with pytest.raises(RuntimeError, match="ring_all_gather: no process group"):
        C.ring_all_gather(torch.ones(2))
