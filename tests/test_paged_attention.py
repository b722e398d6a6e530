"""kernels.attention.paged: decode attention over a paged KV cache (with an optional sliding window),
checked against its reference and the contiguous decode_attention; and the block allocator."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import paged
from kernels.attention.decode import DecodeTiles, decode_attention, decode_attention_ref
from kernels.attention.paged import gather_pages, paged_decode_attention, paged_decode_attention_ref
from kernels.serving.allocator import BlockAllocator, OutOfPages, fragmentation, slot_mapping
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()
DTYPES = runtime.runtime().check_dtypes


def _case(B, Hq, Hkv, D, P, lens, dtype=torch.float32, seed=0, extra_pages=3):
    """A pool with pages handed out in a shuffled order; slots past each length and unused pages hold NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-L // P) for L in lens]
    width = max(max(need), 1)
    n_pages = sum(need) + extra_pages
    order = torch.randperm(n_pages, generator=g)
    table = torch.zeros(B, width, dtype=torch.int32)
    k = torch.full((n_pages, Hkv, P, D), float("nan"))
    v = torch.full((n_pages, Hkv, P, D), float("nan"))
    used = 0
    for b, L in enumerate(lens):
        ids = order[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = ids.int()
        for i, page in enumerate(ids.tolist()):
            n = min(P, L - i * P)
            k[page, :, :n] = torch.randn(Hkv, n, D, generator=g)
            v[page, :, :n] = torch.randn(Hkv, n, D, generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    to = lambda t: t.to(DEVICE, dtype)     # noqa: E731
    return to(q), to(k), to(v), table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _contiguous(pages, table, lens):
    """The same cache as (B, Hkv, S, D), zeros past each length."""
    S = max(max(lens.tolist()), 1)
    out = torch.zeros(table.shape[0], pages.shape[1], S, pages.shape[3], dtype=pages.dtype, device=pages.device)
    for b, L in enumerate(lens.tolist()):
        out[b, :, :L] = gather_pages(pages, table[b], L)
    return out


CASES = [
    # B, Hq, Hkv, D, P, lens
    (3, 4, 2, 24, 16, [70, 1, 0]),       # several pages + tail, one position, empty; group 2
    (2, 6, 2, 40, 8, [8, 33]),           # exactly one page; group 3, non-power-of-two D
    (4, 8, 1, 16, 4, [5, 4, 13, 2]),     # MQA, pages smaller than the sequences
    (1, 2, 2, 8, 32, [31]),              # one page, not full
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,D,P,lens", CASES)
def test_matches_reference_and_contiguous_decode(B, Hq, Hkv, D, P, lens, dtype):
    q, k, v, table, L = _case(B, Hq, Hkv, D, P, lens, dtype)
    got = paged_decode_attention(nan_canary(q), nan_canary(k), nan_canary(v), table, L)
    assert got.shape == (B, Hq, D) and got.dtype == dtype and not torch.isnan(got).any()
    want = paged_decode_attention_ref(q.double(), k.double(), v.double(), table, L)
    base = paged_decode_attention_ref(q, k, v, table, L)
    assert_close(got, want, dtype=dtype, baseline=base, name="paged_decode_attention")
    kc, vc = _contiguous(k, table, L), _contiguous(v, table, L)
    assert_close(got, decode_attention_ref(q.double(), kc.double(), vc.double(), L), dtype=dtype,
                 baseline=decode_attention_ref(q, kc, vc, L), name="paged vs contiguous reference")
    assert_close(got, decode_attention(q, kc, vc, L), dtype=dtype, baseline=base, name="paged vs decode_attention")
    assert torch.all(got[L == 0] == 0)


@pytest.mark.parametrize("window", [1, 3, 16, 17, 200])
def test_sliding_window_matches_masked_full_attention(window):
    q, k, v, table, L = _case(3, 4, 2, 16, 8, [41, 7, 16])
    got = paged_decode_attention(q, k, v, table, L, window=window)
    want = paged_decode_attention_ref(q.double(), k.double(), v.double(), table, L, window=window)
    assert_close(got, want, dtype=torch.float32, baseline=paged_decode_attention_ref(q, k, v, table, L, window=window))
    # the window's reference is full attention over the contiguous cache with positions < L - W cut
    kc, vc = _contiguous(k, table, L), _contiguous(v, table, L)
    for b, n in enumerate(L.tolist()):
        lo = max(0, n - window)
        direct = decode_attention_ref(q[b:b + 1].double(), kc[b:b + 1, :, lo:n].double(), vc[b:b + 1, :, lo:n].double(),
                                      torch.tensor([n - lo]))
        assert (want[b:b + 1] - direct).abs().max() < 1e-5     # decode_attention_ref computes in fp32


def test_window_skips_pages_before_it():
    """Pages wholly before L - W are never read: filling them with NaN changes nothing."""
    q, k, v, table, L = _case(1, 2, 2, 8, 4, [30])
    k2 = k.clone()
    for i in range(30 // 4 - 2):                       # logical pages 0..4 end before position 22 = 30 - 8
        k2[table[0, i]] = float("nan")
    a = paged_decode_attention(q, k, v, table, L, window=8)
    b = paged_decode_attention(q, k2, v, table, L, window=8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("P,block_s", [(8, 16), (8, 64), (32, 16), (32, 32), (32, 64)])
def test_tiles_smaller_than_equal_to_and_larger_than_a_page(P, block_s):
    """A tile inside one page (block_s <= P) or gathered from block_s / P pages (block_s > P): same answer."""
    q, k, v, table, L = _case(2, 4, 2, 16, P, [71, 3])
    got = paged_decode_attention(q, k, v, table, L, block_s=block_s, window=37)
    assert_close(got, paged_decode_attention_ref(q.double(), k.double(), v.double(), table, L, window=37),
                 dtype=torch.float32, baseline=paged_decode_attention_ref(q, k, v, table, L, window=37))


def _caught(got, q, k, v, table, L):
    """True when the check rejects ``got`` against the reference of the same inputs."""
    try:
        assert_close(got, paged_decode_attention_ref(q.double(), k.double(), v.double(), table, L),
                     dtype=torch.float32, baseline=paged_decode_attention_ref(q, k, v, table, L))
    except MismatchError:
        return True
    return False


def test_broken_variant_without_length_mask_is_caught():
    q, k, v, table, L = _case(2, 4, 2, 16, 8, [19, 3])
    k = k.nan_to_num(0.0)                              # garbage past the length, not NaN: a silent wrong answer
    v = v.nan_to_num(5.0)
    assert _caught(paged_decode_attention(q, k, v, table, L, _broken="length-mask"), q, k, v, table, L)


def test_broken_tile_read_from_one_page_is_caught():
    """A 16-position tile over pages of 4 in a shuffled pool: reading all 16 rows from the tile's first
    page (a kernel that assumes a tile never crosses a page) is caught; each row's own page is right."""
    q, k, v, table, L = _case(2, 4, 2, 16, 4, [19, 30])
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    assert not _caught(paged_decode_attention(q, k, v, table, L, block_s=16), q, k, v, table, L)
    assert _caught(paged_decode_attention(q, k, v, table, L, block_s=16, _broken="one-page-per-tile"), q, k, v, table, L)


def test_broken_group_to_row_mapping_is_caught():
    """Query head h belongs to K/V head h // (Hq / Hkv); rows filled with heads g * Hkv + hk instead are caught."""
    q, k, v, table, L = _case(2, 6, 2, 16, 8, [19, 12])
    assert _caught(paged_decode_attention(q, k, v, table, L, _broken="interleaved-heads"), q, k, v, table, L)


def test_off_by_one_page_table_is_caught():
    q, k, v, table, L = _case(2, 4, 2, 16, 8, [19, 12], extra_pages=4)
    shifted = torch.roll(table, shifts=-1, dims=1)     # logical page i read from entry i + 1
    shifted[shifted < 0] = 0
    got = paged_decode_attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0), shifted, L)
    with pytest.raises(MismatchError):
        assert_close(got, paged_decode_attention_ref(q.double(), k.double(), v.double(), table, L),
                     dtype=torch.float32, baseline=paged_decode_attention_ref(q, k, v, table, L))


def test_bad_inputs_raise_clear_errors():
    q, k, v, table, L = _case(2, 4, 2, 16, 8, [9, 3])
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(q[0], k, v, table, L)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, k[:, :, :6], v[:, :, :6], table, L)
    with pytest.raises(ValueError, match="Hq=4 must be a multiple"):
        paged_decode_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), table, L)
    with pytest.raises(ValueError, match="seqlens must lie"):
        paged_decode_attention(q, k, v, table, torch.tensor([9, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table entries"):
        paged_decode_attention(q, k, v, table + 100, L)
    with pytest.raises(ValueError, match="block_table must be"):
        paged_decode_attention(q, k, v, table.float(), L)
    with pytest.raises(ValueError, match="window must be"):
        paged_decode_attention(q, k, v, table, L, window=0)
    with pytest.raises(TypeError, match="share a dtype"):
        paged_decode_attention(q.double(), k, v, table, L)
    with pytest.raises(ValueError, match="block_s must be"):
        paged_decode_attention(q, k, v, table, L, block_s=8)                 # tl.dot's smallest N and K is 16
    with pytest.raises(ValueError, match="MAX_GROUP"):
        paged_decode_attention(q[:, :1].expand(-1, 2 * 129, -1), k, v, table, L)   # 129 query heads per K/V head
    with pytest.raises(ValueError, match="_broken must be"):
        paged_decode_attention(q, k, v, table, L, _broken="no-mask")


# ---------------------------------------------------------------- the allocator

def test_allocator_counts_and_free_list():
    a = BlockAllocator(6, 4)
    x = a.allocate(4)
    assert a.num_free == 2 and a.pages_for(9) == 3
    a.incref(x[:2])
    a.decref(x)
    assert a.num_free == 4 and a.refcount[x[0]] == 1
    a.decref(x[:2])
    assert a.num_free == 6
    a.check()
    with pytest.raises(OutOfPages, match="7 pages asked, 6 free"):
        a.allocate(7)
    with pytest.raises(ValueError, match="double free"):
        a.decref([0])
    with pytest.raises(ValueError, match="is free"):
        a.incref([0])
    with pytest.raises(ValueError, match="num_pages"):
        BlockAllocator(0, 4)


def test_slot_mapping_and_fragmentation():
    assert slot_mapping([5, 2], [0, 3, 4, 7], 4) == [20, 23, 8, 11]
    f = fragmentation([1, 16, 17], page_size=16, max_len=64)
    assert f["used"] == 34 and f["contiguous"] == 192 and f["paged"] == 64


# ---------------------------------------------------------------- ahead of time, sm_80 and sm_90a, head_dim 128

AOT_ARCHS = ("sm80", "sm90")


def _job(group, page, tiles=None, D=128):
    """The launch paged_decode_attention makes (8 K/V heads, a 4096-token window), on meta tensors."""
    return paged.launch_job(8 * group, 8, D, page_size=page, window=4096, tiles=tiles)


AOT = {"group 4, page 16": (4, 16), "group 8, page 16": (8, 16), "group 8, page 128": (8, 128), "group 1, page 1": (1, 1)}
OVERSIZED = DecodeTiles(block_g=64, block_s=128, block_d=128, num_warps=4, num_stages=3)   # the broken choice


@pytest.fixture(scope="module")
def aot_builds():
    jobs = [_job(g, p) for g, p in AOT.values()] + [_job(64, 16, OVERSIZED)]
    return ki.compile_triton_many(jobs, archs=AOT_ARCHS), jobs


def test_builds_at_real_shapes_run_on_tensor_cores_without_spills(aot_builds):
    builds, _ = aot_builds
    for label, build in zip(AOT, builds):
        for arch in AOT_ARCHS:
            b = build[arch]
            assert b.spills == 0 and b.metadata["stack_bytes"] == 0, f"{label} {arch} spills"
            assert b.families("sass")["HMMA"] > 0 and b.tensor_core == "HMMA", f"{label} {arch}: {b.tensor_core}"


def test_spill_check_catches_an_oversized_tile(aot_builds):
    builds, _ = aot_builds
    for arch in AOT_ARCHS:
        assert builds[-1][arch].spills > 0


def test_ptx_uses_64bit_products_for_page_and_sequence_offsets(aot_builds):
    """page * stride_p (a pool passes 2**31 elements), b * stride_b and hk * stride_h are 64-bit products."""
    builds, jobs = aot_builds
    runtime_args = [n for n, kind in jobs[0].signature.items() if kind != "constexpr"]
    for arg in ("stride_kp", "stride_vp", "stride_kh", "stride_vh", "stride_tb", "stride_qb", "stride_ob"):
        widths = ki.param_product_widths(builds[0]["sm90"], runtime_args.index(arg))
        assert widths == {64}, f"{arg} enters products of widths {widths}"
