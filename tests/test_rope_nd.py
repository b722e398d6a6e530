"""kernels.position.rope_nd: axial 2D RoPE and 3D M-RoPE tables, driven through the fused rope kernel."""
import kernels  # noqa: F401  (before triton)

import itertools

import pytest
import torch

from kernels.position import rope, rope_cos_sin, rope_frequencies, rope_ref
from kernels.position.rope_nd import (QWEN2_VL_SECTIONS, axial_2d_frequencies, axis_of_pair, grid_positions,
                                      mrope_positions, nd_cos_sin)
from kernels.testing import MismatchError, assert_close, nan_canary


def _score_fn(inv_freq, sections, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64) for _ in range(2))

    def score(pq, pk):                                        # pq, pk: (A,) coordinates
        cos, sin = nd_cos_sin(inv_freq, sections, torch.stack([pq, pk], 1), dtype=torch.float64)
        rq = rope_ref(q, q, cos, sin, torch.tensor([0]))[0]
        rk = rope_ref(k, k, cos, sin, torch.tensor([1]))[1]
        return float((rq * rk).sum())
    return score


def test_axial_2d_scores_depend_only_on_the_displacement():
    """Every pair of patches of a 4 x 5 grid: same (dr, dc) -> same score, also after moving the grid."""
    inv, sections = axial_2d_frequencies(16)
    score = _score_fn(inv, sections, 16)
    by_disp = {}
    cells = list(itertools.product(range(4), range(5)))
    for (r1, c1), (r2, c2) in itertools.product(cells, cells):
        s = score(torch.tensor([r1, c1]), torch.tensor([r2, c2]))
        s_moved = score(torch.tensor([r1 + 7, c1 + 3]), torch.tensor([r2 + 7, c2 + 3]))
        assert abs(s - s_moved) < 1e-9
        by_disp.setdefault((r1 - r2, c1 - c2), []).append(s)
    assert max(max(v) - min(v) for v in by_disp.values()) < 1e-9
    assert len(by_disp) == 7 * 9


def test_raster_1d_positions_make_above_depend_on_the_width():
    """Flattened (raster) 1D RoPE: the patch directly above is W positions back, so its score changes with W."""
    inv, _ = rope_frequencies(16)
    score = _score_fn(inv, [8], 16)
    above = [score(torch.tensor([W * 2 + 1]), torch.tensor([W * 1 + 1])) for W in (4, 5)]
    assert abs(above[0] - above[1]) > 1e-3
    inv2, sections = axial_2d_frequencies(16)
    score2 = _score_fn(inv2, sections, 16)
    assert abs(score2(torch.tensor([2, 1]), torch.tensor([1, 1])) - score2(torch.tensor([2, 3]), torch.tensor([1, 3]))) < 1e-9


def test_mrope_on_text_is_plain_rope():
    inv, _ = rope_frequencies(128, 1e6)
    pos = mrope_positions([("text", 50)])
    cos, sin = nd_cos_sin(inv, QWEN2_VL_SECTIONS, pos)
    c1, s1 = rope_cos_sin(inv, 50)
    assert torch.equal(cos, c1) and torch.equal(sin, s1)


def test_mrope_positions_follow_qwen2_vl():
    pos = mrope_positions([("text", 2), ("image", 2, 3), ("text", 2), ("video", 2, 1, 2)])
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert pos[:, 8:10].tolist() == [[5, 6]] * 3                       # one past the image's largest (4)
    assert pos[:, 10:].tolist() == [[7, 7, 8, 8], [7, 7, 7, 7], [7, 8, 7, 8]]
    with pytest.raises(ValueError, match="unknown segment"):
        mrope_positions([("audio", 3)])


def test_sections_match_transformers_qwen2_vl_recomposition():
    mod = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    emb = mod.Qwen2VLRotaryEmbedding.__new__(mod.Qwen2VLRotaryEmbedding)
    emb.mrope_section = list(QWEN2_VL_SECTIONS)
    inv, _ = rope_frequencies(128, 1e6)
    pos = mrope_positions([("text", 3), ("video", 2, 3, 4), ("text", 2)])
    freqs = pos.double()[..., None] * inv                               # (3, N, 64), one table per axis
    hf = emb.recomposition_frequencies(freqs[:, None])[0]              # (N, 128): half-split layout
    cos, _ = nd_cos_sin(inv, QWEN2_VL_SECTIONS, pos, dtype=torch.float64)
    assert_close(torch.cat([cos, cos], -1), hf.cos())
    assert axis_of_pair(QWEN2_VL_SECTIONS).bincount().tolist() == [16, 24, 24]


@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_with_per_token_tables(interleaved):
    inv, _ = rope_frequencies(32, 1e6)
    pos = mrope_positions([("text", 3), ("image", 3, 4), ("text", 2)])  # 17 tokens
    cos, sin = nd_cos_sin(inv, [4, 6, 6], pos)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 17, 4, 32, generator=g)
    k = torch.randn(1, 17, 2, 32, generator=g)
    got = rope(nan_canary(q), nan_canary(k), cos, sin, interleaved=interleaved)
    want = rope_ref(q, k, cos, sin, interleaved=interleaved)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    flat_cos, flat_sin = rope_cos_sin(inv, 17)                          # 1D positions: a different function
    with pytest.raises(MismatchError):
        assert_close(rope(q, k, flat_cos, flat_sin, interleaved=interleaved)[0], want[0])


def test_bad_inputs_raise_clear_errors():
    inv, _ = rope_frequencies(16)
    with pytest.raises(ValueError, match="must sum to D/2 = 8"):
        nd_cos_sin(inv, [4, 3], grid_positions(2, 2)[1:])
    with pytest.raises(ValueError, match=r"\(axes, N\)"):
        nd_cos_sin(inv, [4, 4], grid_positions(2, 2))
    with pytest.raises(ValueError, match="divisible by 4"):
        axial_2d_frequencies(18)
