"""kernels.attention.decode_attention: one query token per sequence over KV caches of different lengths."""
import kernels  # noqa: F401  (before triton)
import math

import pytest
import torch

from kernels import runtime
from kernels.attention import decode_attention, decode_attention_ref
from kernels.attention.decode import _launch
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()


def _case(B, Hq, Hkv, S, D, dtype, lens, seed=0, fill_unused=float("nan")):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE, dtype)
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    # Positions past each sequence's length hold NaN: reading one would poison the output.
    pos = torch.arange(S, device=DEVICE)
    unused = (pos[None, :] >= lens[:, None].long())[:, None, :, None]
    return q, k.masked_fill(unused, fill_unused), v.masked_fill(unused, fill_unused), lens


def _baseline(q, k, v, lens):
    """PyTorch's own attention in the low dtype (SDPA per sequence), for the baseline rule."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        L = int(lens[b])
        if L == 0:
            continue
        kb = k[b, :, :L].repeat_interleave(group, 0)
        vb = v[b, :, :L].repeat_interleave(group, 0)
        out[b] = torch.nn.functional.scaled_dot_product_attention(q[b, :, None], kb, vb)[:, 0]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,S,D,lens", [
    (3, 6, 2, 100, 40, [0, 1, 77]),          # empty cache, length 1, a masked tail; GQA group 3
    (2, 4, 4, 130, 64, [130, 65]),           # MHA, full cache, several blocks
    (4, 8, 1, 33, 24, [33, 5, 16, 17]),      # MQA, lengths at block edges (block_s=16 below)
    (1, 2, 2, 1, 8, [1]),                    # a one-position cache
])
def test_matches_reference(B, Hq, Hkv, S, D, lens, dtype):
    q, k, v, L = _case(B, Hq, Hkv, S, D, dtype, lens)
    block_s = 16 if S == 33 else 64
    got = decode_attention(nan_canary(q), nan_canary(k), nan_canary(v), L, block_s=block_s)
    ref = decode_attention_ref(q.float(), k.float(), v.float(), L)
    assert got.dtype == dtype and got.shape == (B, Hq, D)
    assert not torch.isnan(got).any()
    assert_close(got, ref, dtype=dtype, baseline=_baseline(q, k, v, L), name="decode_attention")


def test_empty_cache_gives_zeros_and_reference_agrees():
    q, k, v, L = _case(2, 4, 2, 16, 8, torch.float32, [0, 0])
    assert torch.equal(decode_attention(q, k, v, L), torch.zeros_like(q))
    assert torch.equal(decode_attention_ref(q, k, v, L), torch.zeros_like(q))


def test_length_one_cache_returns_that_value():
    """With one cached position the softmax weight is 1: the output is that position's value."""
    q, k, v, L = _case(2, 4, 2, 10, 8, torch.float32, [1, 1])
    out = decode_attention(q, k, v, L)
    assert_close(out, v[:, :, 0].repeat_interleave(2, dim=1))


def test_reference_matches_full_attention_on_the_last_row():
    """Decode attention for the query at position L-1 equals row L-1 of causal attention."""
    g = torch.Generator().manual_seed(3)
    Hq, L, D = 4, 12, 16
    q_all, k_all, v_all = (torch.randn(1, Hq, L, D, generator=g).to(DEVICE) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True)
    out = decode_attention(q_all[:, :, -1], k_all, v_all, torch.tensor([L], dtype=torch.int32, device=DEVICE))
    assert_close(out, full[:, :, -1])


def test_non_contiguous_cache_view():
    """A cache stored (B, S, H, D) and viewed as (B, H, S, D): strides, not layout, are honoured."""
    q, k, v, L = _case(2, 4, 2, 40, 16, torch.float32, [40, 7], fill_unused=0.0)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_t.is_contiguous()
    assert_close(decode_attention(q, k_t, v_t, L), decode_attention_ref(q, k, v, L))


def test_large_scores_are_stable():
    q, k, v, L = _case(1, 2, 1, 50, 32, torch.float32, [50], fill_unused=0.0)
    out = decode_attention(q * 30, k * 30, v, L)
    assert torch.isfinite(out).all()
    assert_close(out, decode_attention_ref(q * 30, k * 30, v, L), baseline=_baseline(q * 30, k * 30, v, L))


def test_broken_variant_without_length_mask_is_caught():
    """Reading the whole last block instead of stopping at the sequence's length reads NaN slots."""
    q, k, v, L = _case(3, 6, 2, 100, 40, torch.float32, [0, 1, 77])
    ref = decode_attention_ref(q, k, v, L)
    broken = _launch(q, k, v, L, block_s=64, mask_length=False)
    with pytest.raises(MismatchError):
        assert_close(broken, ref, name="decode_attention without the length mask")


def test_bad_inputs_raise_clear_errors():
    q, k, v, L = _case(2, 4, 2, 16, 8, torch.float32, [3, 4], fill_unused=0.0)
    with pytest.raises(ValueError, match=r"q must be \(B, Hq, D\)"):
        decode_attention(q[0], k, v, L)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(q[:, :3], k, v, L)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        decode_attention(q, k, v, torch.tensor([3, 17], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="cache_seqlens must be a"):
        decode_attention(q, k, v, L.float())
    with pytest.raises(TypeError, match="share a dtype"):
        decode_attention(q, k.half(), v.half(), L)
    with pytest.raises(ValueError, match="v_cache shape"):
        decode_attention(q, k, v[:, :, :8], L)
    with pytest.raises(ValueError, match="block_s"):
        decode_attention(q, k, v, L, block_s=24)


def test_default_block_keeps_the_gpu_product_small(monkeypatch):
    """On a GPU the (group x BLOCK_S x D) product stays at most 8192 values (no register spills);
    the interpreter takes 64 positions per iteration."""
    import triton

    from kernels.attention import decode as dec
    assert dec.default_block_s(4, 128) == (64 if runtime.runtime().interpreted else 16)

    class _GPU:
        interpreted = False
    monkeypatch.setattr(dec.runtime, "runtime", lambda: _GPU())
    for group, d in [(1, 32), (1, 128), (3, 40), (4, 128), (8, 128), (16, 256)]:
        bs = dec.default_block_s(group, d)
        assert bs >= 16 and bs & (bs - 1) == 0
        assert bs == 16 or triton.next_power_of_2(group) * triton.next_power_of_2(d) * bs <= dec.GPU_PRODUCT_ELEMENTS
    assert dec.default_block_s(4, 128) == 16
