"""kernels.serving.rolling_cache: the rolling buffer equals full attention with a window mask, step by step
past the window, through the contiguous Triton kernel; and the paged kernel's window agrees."""
import kernels  # noqa: F401

import pytest
import torch

from kernels.attention.decode import decode_attention_ref
from kernels.attention.paged import paged_decode_attention
from kernels.serving.rolling_cache import RollingKVCache, rolling_slot
from kernels.testing import MismatchError, assert_close


def _stream(B, Hq, Hkv, D, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, B, Hq, D, generator=g), torch.randn(T, B, Hkv, D, generator=g),
            torch.randn(T, B, Hkv, D, generator=g))


def _windowed_full(q, k_all, v_all, t, window):
    """Full attention of the query at position t over keys max(0, t - W + 1) .. t (the mask's reference)."""
    lo = max(0, t - window + 1)
    k = k_all[lo:t + 1].permute(1, 2, 0, 3)                      # (B, Hkv, n, D)
    v = v_all[lo:t + 1].permute(1, 2, 0, 3)
    return decode_attention_ref(q.double(), k.double(), v.double(), torch.full((q.shape[0],), t + 1 - lo))


@pytest.mark.parametrize("window", [1, 5, 8])
def test_rolling_buffer_equals_masked_full_attention(window):
    B, Hq, Hkv, D, T = 2, 4, 2, 16, 19
    qs, ks, vs = _stream(B, Hq, Hkv, D, T)
    cache = RollingKVCache.empty(B, Hkv, window, D)
    for t in range(T):
        cache.append(ks[t], vs[t])
        want = _windowed_full(qs[t], ks, vs, t, window)
        got = cache.attend(qs[t], use_kernels=t % 6 == 0)          # the Triton kernel on some steps
        assert_close(got, want.float(), dtype=torch.float32, baseline=cache.attend(qs[t], use_kernels=False))
    assert int(cache.seqlens[0]) == T and cache.nbytes() == 2 * B * Hkv * window * D * 4


def test_slot_order_does_not_matter_but_keeping_the_oldest_is_caught():
    """Any fixed rotation of the slots gives the same window (attention ignores key order); a buffer that
    stops writing when full (keeping the first W positions instead of the last W) is caught."""
    B, Hq, Hkv, D, T, W = 1, 2, 1, 8, 12, 4
    qs, ks, vs = _stream(B, Hq, Hkv, D, T, seed=1)
    want = _windowed_full(qs[T - 1], ks, vs, T - 1, W).float()
    rotated, frozen = RollingKVCache.empty(B, Hkv, W, D), RollingKVCache.empty(B, Hkv, W, D)
    for t in range(T):
        rotated.seqlens += 1                                     # slot (p + 1) mod W
        rotated.append(ks[t], vs[t])
        rotated.seqlens -= 1
        if t < W:
            frozen.append(ks[t], vs[t])
        else:
            frozen.seqlens += 1                                  # broken: counts the position, drops its K, V
    assert_close(rotated.attend(qs[T - 1], use_kernels=False), want, dtype=torch.float32)
    with pytest.raises(MismatchError):
        assert_close(frozen.attend(qs[T - 1], use_kernels=False), want, dtype=torch.float32)


def test_paged_window_agrees_with_rolling_buffer():
    B, Hq, Hkv, D, T, W, P = 1, 4, 2, 16, 23, 6, 4
    qs, ks, vs = _stream(B, Hq, Hkv, D, T, seed=2)
    pages = -(-T // P)
    kp = ks.permute(1, 2, 0, 3)[0]                                # (Hkv, T, D)
    k_pages = torch.zeros(pages, Hkv, P, D)
    v_pages = torch.zeros(pages, Hkv, P, D)
    for p in range(T):
        k_pages[p // P, :, p % P] = ks[p, 0]
        v_pages[p // P, :, p % P] = vs[p, 0]
    assert kp.shape == (Hkv, T, D)
    table = torch.arange(pages, dtype=torch.int32)[None]
    cache = RollingKVCache.empty(B, Hkv, W, D)
    for t in range(T):
        cache.append(ks[t], vs[t])
    got = paged_decode_attention(qs[T - 1], k_pages, v_pages, table, torch.tensor([T], dtype=torch.int32), window=W)
    assert_close(got, cache.attend(qs[T - 1], use_kernels=False), dtype=torch.float32)


def test_slots_and_errors():
    assert [rolling_slot(p, 4) for p in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="window must be >= 1"):
        RollingKVCache.empty(1, 1, 0, 8)
    with pytest.raises(ValueError, match="expected"):
        RollingKVCache.empty(1, 2, 4, 8).append(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))
