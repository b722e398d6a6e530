"""kernels.attention.decode_attention: one query token per sequence over KV caches of different lengths."""
import kernels  # noqa: F401  (before triton)
import math

import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention import decode_attention, decode_attention_ref
from kernels.attention.decode import _kv_offset, _launch
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
    with pytest.raises(ValueError, match="block_s must be a power of two >= 8"):
        decode_attention(q, k, v, L, block_s=4)


def test_default_block_keeps_the_gpu_product_small():
    """On a GPU the (group x BLOCK_S x D) product stays at most 8192 values (no register spills:
    tests/test_flash_decode.py compiles these tiles for sm_90a); the interpreter takes 64."""
    import triton

    from kernels.attention import decode as dec
    assert dec.default_block_s(4, 128) == (64 if runtime.runtime().interpreted else 16)
    for group, d in [(1, 32), (1, 128), (3, 40), (4, 128), (8, 128), (16, 64)]:
        bs = dec.gpu_block_s(group, d)
        assert bs >= dec.MIN_BLOCK_S and bs & (bs - 1) == 0
        assert triton.next_power_of_2(group) * triton.next_power_of_2(d) * bs <= dec.GPU_PRODUCT_ELEMENTS
    assert (dec.gpu_block_s(4, 128), dec.gpu_block_s(8, 128), dec.gpu_block_s(1, 32)) == (16, 8, 128)


def test_grid_is_one_program_per_sequence_and_kv_head():
    from kernels.attention.decode import decode_grid
    assert decode_grid(1, 8) == (1, 8)        # Llama-3-8B at batch 1: 8 programs, whatever the cache length
    assert decode_grid(32, 8) == (32, 8)


# ----------------------------------------------------------------------------------------------
# int64 offsets, proved without allocating a cache of 2**32 elements: the interpreter computes in
# numpy with the kernel's own integer types, so an int32 product wraps there as it would on a GPU.

@triton.jit
def _offset_probe(out_ptr, stride_b, stride_h, WIDE: tl.constexpr):
    """out[b, hk] = element offset of K/V head hk of sequence b: the kernels' helper (WIDE) or int32."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    if WIDE:
        off = _kv_offset(b, hk, stride_b, stride_h)
    else:
        off = b * stride_b + hk * stride_h                 # what the kernels computed before: int32
    tl.store(out_ptr + b * tl.num_programs(1) + hk, off.to(tl.int64))


def _probe(B, Hkv, S, D, wide):
    """Offsets the kernels would use for a contiguous (B, Hkv, S, D) cache: only the strides are passed."""
    out = torch.zeros(B, Hkv, dtype=torch.int64, device=DEVICE)
    _offset_probe[(B, Hkv)](out, Hkv * S * D, S * D, WIDE=wide)
    return out


def test_batch_offsets_are_int64():
    """Batch 32 of Llama-3-8B-like caches of 131072 positions: sequence 31 starts at 31 * 2**27 > 2**31."""
    B, Hkv, S, D = 32, 8, 131072, 128
    want = torch.tensor([[b * Hkv * S * D + h * S * D for h in range(Hkv)] for b in range(B)], dtype=torch.int64)
    assert int(want.max()) > 2**31
    assert torch.equal(_probe(B, Hkv, S, D, wide=True).cpu(), want)
    wrapped = _probe(B, Hkv, S, D, wide=False).cpu()      # the int32 version wraps: the test can fail
    assert not torch.equal(wrapped, want) and int(wrapped.min()) < 0
