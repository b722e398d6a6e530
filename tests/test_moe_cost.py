"""kernels.moe.cost (the train-and-serve ledger, checked against the papers' totals) and
kernels.moe.dropless (MegaBlocks' block-sparse topology, equal to the grouped GEMM's result)."""
import kernels  # noqa: F401  (before triton)

import math

import pytest
import torch

from kernels.moe import cost, dropless
from kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_ref
from kernels.testing import assert_close


def test_parameter_totals_match_the_papers():
    """Mixtral 8x7B: 46.7B parameters, 12.9B per token (Jiang et al. 2024); DeepSeek-V3: 671B, 37B."""
    assert round(cost.MIXTRAL.total_params() / 1e9, 1) == 46.7
    assert round(cost.MIXTRAL.active_params() / 1e9, 1) == 12.9
    assert round(cost.DEEPSEEK_V3.total_params() / 1e9) == 671
    assert 37 <= cost.DEEPSEEK_V3.active_params() / 1e9 < 38


def test_decode_bytes_fall_with_batch_and_experts_touched():
    s = cost.MIXTRAL
    assert s.experts_touched(1) == 2 and math.isclose(s.experts_touched(10**4), 8)
    per_token = [s.decode_bytes_per_token(b, 0) for b in (1, 8, 64)]
    assert per_token == sorted(per_token, reverse=True)
    assert s.decode_bytes_per_token(1, 0) == pytest.approx(2 * s.active_params())


def test_all_to_all_bytes():
    assert cost.MIXTRAL.all_to_all_bytes_per_token() == 32 * 2 * 4096 * 4
    assert cost.DEEPSEEK_V3.all_to_all_bytes_per_token(1, 2) == 58 * 8 * 7168 * 3


def _sorted_problem(loads, C, F, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(loads)
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(loads).cumsum(0)
    return (torch.randn(int(offsets[-1]), C, generator=g, dtype=torch.float64),
            torch.randn(E, C, F, generator=g, dtype=torch.float64), offsets)


def test_block_sparse_product_equals_the_grouped_gemm():
    loads, B = [5, 0, 19, 16, 1], 8
    x, w, offsets = _sorted_problem(loads, 12, 16)
    h = dropless.block_sparse_ref(x, w, offsets, B)                                   # (M', E F)
    _, dest = dropless.pad_rows(x, offsets, B)
    expert = torch.repeat_interleave(torch.arange(len(loads)), offsets[1:] - offsets[:-1])
    cols = expert[:, None] * 16 + torch.arange(16)                                     # each row's expert columns
    assert_close(h[dest[:, None], cols], grouped_gemm_ref(x, w, offsets))
    assert_close(h[dest[:, None], cols].float(), grouped_gemm(x.float(), w.float(), offsets))
    off_diagonal = torch.ones_like(h, dtype=torch.bool)
    off_diagonal[dest[:, None], cols] = False
    assert bool((h[off_diagonal] == 0).all())


def test_topology_counts_and_work():
    loads, B = [5, 0, 19, 16, 1], 8
    _, _, offsets = _sorted_problem(loads, 4, 16)
    topo = dropless.block_topology(offsets, 16, B)
    assert len(topo) == sum(math.ceil(n / B) for n in loads) * 2
    w = dropless.work(loads, B, 1.0, top_k=1)
    assert w["block-sparse rows"] == 8 + 24 + 16 + 8 and w["capacity rows"] == 5 * 9
    assert w["capacity dropped"] == (19 - 9) + (16 - 9)
    with pytest.raises(ValueError, match="multiple of block"):
        dropless.block_topology(offsets, 12, B)
