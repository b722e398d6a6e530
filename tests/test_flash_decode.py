"""kernels.attention.flash_decode: split-K decode attention through the split kernel and the combine (both
kernels.attention.decode's), the chapter's references, and the FlashDecoding++ variant."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import runtime
from kernels.attention import (combine_ref, decode_attention, decode_attention_ref, flash_decode, flash_decode_ref,
                               flash_decode_unified_max, split_ref)
from kernels.attention import decode as dec     # the split and combine kernels live with decode_attention
from kernels.softmax import softmax_stats
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()


def _case(B, Hq, Hkv, S, D, dtype, lens, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, D, generator=g) * scale).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    # cache positions past each length hold NaN: reading one would poison the output
    unused = (torch.arange(S, device=DEVICE)[None, :] >= lens[:, None].long())[:, None, :, None]
    return q, k.masked_fill(unused, float("nan")), v.masked_fill(unused, float("nan")), lens


def _wide(t):
    return t.double() if t.dtype == torch.float32 else t.float()


CASES = [
    # B, Hq, Hkv, S,  D,  lens,               num_splits
    (3, 6, 2, 100, 40, [0, 1, 77], 3),        # empty cache, length 1, masked tail; group 3
    (2, 4, 4, 257, 64, [257, 100], 4),        # MHA, odd full length
    (4, 8, 1, 33, 24, [33, 5, 16, 7], 8),     # MQA, more splits than positions in some sequences
    (2, 8, 2, 130, 16, [130, 64], 1),         # one split: plain decode attention + trivial combine
    (1, 2, 2, 1, 8, [1], 2),                  # one position, two splits: one split is empty
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,S,D,lens,num_splits", CASES)
def test_matches_decode_attention_reference(B, Hq, Hkv, S, D, lens, num_splits, dtype):
    q, k, v, L = _case(B, Hq, Hkv, S, D, dtype, lens)
    got = flash_decode(nan_canary(q), nan_canary(k), nan_canary(v), L, num_splits, block_s=16)
    assert got.dtype == dtype and got.shape == (B, Hq, D)
    assert not torch.isnan(got).any()
    want = flash_decode_ref(_wide(q), _wide(k), _wide(v), L)
    # the decode chapter's reference (fp32 computed, returned in the low dtype) is the baseline
    assert_close(got, want, dtype=dtype, baseline=decode_attention_ref(q, k, v, L), name="flash_decode")
    # and it agrees with the single-pass kernel
    assert_close(got, decode_attention(q, k, v, L, num_splits=1), dtype=dtype,
                 baseline=decode_attention_ref(q, k, v, L), name="flash_decode vs decode_attention")


def test_cache_stored_sequence_major_with_splits():
    """A (B, S, Hkv, D) cache viewed as (B, Hkv, S, D): each chunk starts at lo * stride_s with
    stride_s = Hkv * D, not D; lengths 70 and 9 cut into 3 chunks (the second sequence's of 3)."""
    q, k, v, L = _case(2, 4, 2, 70, 16, torch.float32, [70, 9], seed=10)
    k_t = nan_canary(k.transpose(1, 2).contiguous()).transpose(1, 2)
    v_t = nan_canary(v.transpose(1, 2).contiguous()).transpose(1, 2)
    assert not k_t.is_contiguous() and k_t.stride(2) == 2 * 16
    want = flash_decode_ref(q.double(), k.double(), v.double(), L).float()
    assert_close(flash_decode(q, k_t, v_t, L, 3, block_s=16), want, dtype=torch.float32,
                 baseline=decode_attention_ref(q, k, v, L))


def test_reference_agrees_with_decode_attention_ref():
    q, k, v, L = _case(3, 4, 2, 50, 16, torch.float32, [50, 0, 9], seed=1)
    assert_close(flash_decode_ref(q, k, v, L).float(), decode_attention_ref(q, k, v, L))


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_split_and_combine_are_exact(num_splits):
    """The split partials equal softmax_stats of each chunk; combining them equals the unsplit softmax."""
    q, k, v, L = _case(2, 4, 2, 70, 16, torch.float32, [70, 23], seed=2)
    m, l, o = split_ref(q.double(), k.double(), v.double(), L, num_splits)
    x = torch.einsum("bhd,bhsd->bhs", q.double(), k.double().repeat_interleave(2, 1)) / 4.0
    chunk = -(-70 // num_splits)
    m0, l0 = softmax_stats(x[0, :, :chunk])                       # sequence 0, split 0
    assert_close(m[0, :, 0], m0[:, 0])
    assert_close(l[0, :, 0], l0[:, 0])
    assert_close(combine_ref(m, l, o), flash_decode_ref(q.double(), k.double(), v.double(), L))
    km, kl, ko, _ = dec.split_partials(q, k, v, L, num_splits, block_s=16)
    assert_close(km, m.float(), name="m_s")
    assert_close(kl, l.float(), name="l_s")
    assert_close(ko, o.float(), name="o_s")
    assert_close(dec.combine(m.float(), l.float(), o.float()), combine_ref(m, l, o).float(), name="combine kernel")


def test_combine_order_does_not_matter_and_empty_splits_drop_out():
    q, k, v, L = _case(1, 2, 1, 40, 8, torch.float32, [40], seed=3)
    m, l, o = split_ref(q.double(), k.double(), v.double(), L, 4)
    perm = torch.tensor([2, 0, 3, 1], device=DEVICE)
    assert_close(combine_ref(m[..., perm], l[..., perm], o[..., perm, :]), combine_ref(m, l, o))
    pad_m = torch.cat([m, torch.full_like(m[..., :1], float("-inf"))], -1)
    pad_l = torch.cat([l, torch.zeros_like(l[..., :1])], -1)
    pad_o = torch.cat([o, torch.zeros_like(o[..., :1, :])], -2)
    assert_close(combine_ref(pad_m, pad_l, pad_o), combine_ref(m, l, o))
    assert_close(dec.combine(pad_m.float(), pad_l.float(), pad_o.float()), combine_ref(m, l, o).float())


def test_averaging_the_splits_is_wrong():
    """A combine that averages the normalised partial outputs (ignoring l_s and m_s) is caught."""
    q, k, v, L = _case(2, 4, 2, 60, 16, torch.float32, [60, 31], seed=4, scale=3.0)
    m, l, o = split_ref(q.double(), k.double(), v.double(), L, 3)
    with pytest.raises(MismatchError):
        assert_close(o.mean(dim=-2), flash_decode_ref(q.double(), k.double(), v.double(), L))


def test_broken_combine_without_max_rescale_is_caught():
    """Weights l_s instead of l_s e^{m_s - m}: the combine must fail the check."""
    q, k, v, L = _case(2, 2, 1, 64, 16, torch.float32, [64, 40], seed=5, scale=3.0)
    m, l, o, _ = dec.split_partials(q, k, v, L, 4, block_s=16)
    bad = (l[..., None] * o).sum(-2) / l.sum(-1, keepdim=True)
    want = flash_decode_ref(q.double(), k.double(), v.double(), L)
    with pytest.raises(MismatchError):
        assert_close(bad, want.float())
    assert_close(dec.combine(m, l, o), want.float(), dtype=torch.float32, baseline=want.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unified_max_without_fallback_is_exact_in_range(dtype):
    """FlashDecoding++: with scores near phi no split flags, and the plain-sum combine is exact."""
    q, k, v, L = _case(3, 4, 2, 90, 32, dtype, [90, 3, 0], seed=6)
    out, fell = flash_decode_unified_max(nan_canary(q), nan_canary(k), nan_canary(v), L, 4, phi=0.0,
                                         return_fallbacks=True)
    assert not fell.any()
    assert_close(out, flash_decode_ref(_wide(q), _wide(k), _wide(v), L), dtype=dtype,
                 baseline=decode_attention_ref(q, k, v, L))


def test_unified_max_fallback_is_exercised_and_exact():
    """Scores beyond phi + 80 overflow exp(x - phi) with phi = 0: those sequences must fall back.
    Without the fallback the result is inf/NaN (caught); with it, exact."""
    q, k, v, L = _case(3, 4, 2, 80, 16, torch.float32, [80, 50, 20], seed=7)
    q = q.clone()
    q[1] *= 40.0                                        # sequence 1 only: scores ~ 40 * N(0, 1), max > 80
    want = flash_decode_ref(q.double(), k.double(), v.double(), L)
    out, fell = flash_decode_unified_max(q, k, v, L, 4, phi=0.0, return_fallbacks=True)
    assert fell.tolist() == [False, True, False]
    # scores in the hundreds: fp32 rounding of the scores matters; PyTorch's own fp32 result is the baseline
    assert_close(out, want.float(), dtype=torch.float32, baseline=flash_decode_ref(q, k, v, L))
    broken, _ = flash_decode_unified_max(q, k, v, L, 4, phi=0.0, fallback=False, return_fallbacks=True)
    assert not torch.isfinite(broken[1]).all()
    with pytest.raises(MismatchError):
        assert_close(broken, want.float())


def test_unified_max_flags_scores_far_below_phi():
    """A phi far above every score underflows exp(x - phi) to 0: flagged too, then recomputed."""
    q, k, v, L = _case(2, 2, 1, 30, 16, torch.float32, [30, 12], seed=8)
    out, fell = flash_decode_unified_max(q, k, v, L, 2, phi=200.0, return_fallbacks=True)
    assert fell.all()
    want = flash_decode_ref(q.double(), k.double(), v.double(), L).float()
    assert_close(out, want, dtype=torch.float32, baseline=want)


def test_bad_inputs_raise_clear_errors():
    q, k, v, L = _case(2, 4, 2, 16, 8, torch.float32, [16, 3])
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode(q, k, v, L, 0)
    with pytest.raises(ValueError, match="cache_seqlens must lie"):
        flash_decode(q, k, v, torch.tensor([17, 3], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cache_seqlens must be"):
        flash_decode(q, k, v, L.float())
    with pytest.raises(ValueError, match="multiple of Hkv"):
        flash_decode(q[:, :3], k, v, L)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_decode(q.half(), k, v, L)
    with pytest.raises(ValueError, match="q must be"):
        flash_decode(q[0], k, v, L)
    with pytest.raises(ValueError, match="block_s"):
        flash_decode(q, k, v, L, block_s=24)
    with pytest.raises(ValueError, match="phi"):
        flash_decode_unified_max(q, k, v, L, phi=float("inf"))
