"""kernels.attention.decode_attention: one query token per sequence over KV caches of different lengths,
in one pass or split across programs (the split kernel, the combine, the choice of the split count)."""
import kernels  # noqa: F401  (before triton)
import math

import pytest
import torch
import triton
import triton.language as tl

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import choose_num_splits, decode_attention, decode_attention_ref, flash_decode
from kernels.attention import decode as dec
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
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,lens", [
    (3, 6, 2, 100, 40, [0, 1, 77]),          # empty cache, length 1, a masked tail; GQA group 3
    (2, 4, 4, 130, 64, [130, 65]),           # MHA, full cache, several blocks
    (4, 8, 1, 33, 24, [33, 5, 16, 17]),      # MQA, lengths at block edges (block_s=16 below)
    (1, 2, 2, 1, 8, [1]),                    # a one-position cache: with splits, all but one are empty
])
def test_matches_reference(B, Hq, Hkv, S, D, lens, num_splits, dtype):
    """Single pass (1, and None under the interpreter) and split (3, 8): with 8 splits, 33 positions
    make chunks of 5 and an empty eighth split, 17 make chunks of 3 and two empty ones, 5 leave
    three empty, 1 leaves seven."""
    q, k, v, L = _case(B, Hq, Hkv, S, D, dtype, lens)
    block_s = 16 if S == 33 else 64
    got = decode_attention(nan_canary(q), nan_canary(k), nan_canary(v), L, num_splits=num_splits, block_s=block_s)
    ref = decode_attention_ref(q.float(), k.float(), v.float(), L)
    assert got.dtype == dtype and got.shape == (B, Hq, D)
    assert not torch.isnan(got).any()
    assert_close(got, ref, dtype=dtype, baseline=_baseline(q, k, v, L), name=f"decode_attention, {num_splits} splits")


@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_cache_gives_zeros_and_reference_agrees(num_splits):
    q, k, v, L = _case(2, 4, 2, 16, 8, torch.float32, [0, 0])
    assert torch.equal(decode_attention(q, k, v, L, num_splits=num_splits), torch.zeros_like(q))
    assert torch.equal(decode_attention_ref(q, k, v, L), torch.zeros_like(q))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_length_one_cache_returns_that_value(num_splits):
    """With one cached position the softmax weight is 1: the output is that position's value."""
    q, k, v, L = _case(2, 4, 2, 10, 8, torch.float32, [1, 1])
    out = decode_attention(q, k, v, L, num_splits=num_splits)
    assert_close(out, v[:, :, 0].repeat_interleave(2, dim=1))


def test_reference_matches_full_attention_on_the_last_row():
    """Decode attention for the query at position L-1 equals row L-1 of causal attention."""
    g = torch.Generator().manual_seed(3)
    Hq, L, D = 4, 12, 16
    q_all, k_all, v_all = (torch.randn(1, Hq, L, D, generator=g).to(DEVICE) for _ in range(3))
    full = torch.nn.functional.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True)
    out = decode_attention(q_all[:, :, -1], k_all, v_all, torch.tensor([L], dtype=torch.int32, device=DEVICE))
    assert_close(out, full[:, :, -1])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_non_contiguous_cache_view(num_splits):
    """A cache stored (B, S, H, D) and viewed as (B, H, S, D): strides, not layout, are honoured;
    with splits each chunk starts at lo * stride_s, stride_s = Hkv * D, not D."""
    q, k, v, L = _case(2, 4, 2, 40, 16, torch.float32, [40, 7], fill_unused=0.0)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_t.is_contiguous() and k_t.stride(2) == 2 * 16
    got = decode_attention(q, k_t, v_t, L, num_splits=num_splits, block_s=16)
    assert_close(got, decode_attention_ref(q, k, v, L))


def test_large_scores_are_stable():
    q, k, v, L = _case(1, 2, 1, 50, 32, torch.float32, [50], fill_unused=0.0)
    out = decode_attention(q * 30, k * 30, v, L)
    assert torch.isfinite(out).all()
    assert_close(out, decode_attention_ref(q * 30, k * 30, v, L), baseline=_baseline(q * 30, k * 30, v, L))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_broken_variant_without_length_mask_is_caught(num_splits):
    """Reading the whole last tile instead of stopping at the sequence's (or the chunk's) end reads
    NaN slots, or the next chunk's positions twice; the same launch with the mask passes."""
    q, k, v, L = _case(3, 6, 2, 100, 40, torch.float32, [0, 1, 77])
    ref = decode_attention_ref(q, k, v, L)
    broken = _launch(q, k, v, L, num_splits=num_splits, block_s=16, mask_length=False)
    with pytest.raises(MismatchError):
        assert_close(broken, ref, name="decode_attention without the length mask")
    assert_close(_launch(q, k, v, L, num_splits=num_splits, block_s=16, mask_length=True), ref)


def test_broken_split_is_caught_without_nan():
    """With a finite cache (zeros past the lengths), the unmasked split kernel still fails: a tile that
    runs past its chunk counts the next chunk's keys twice."""
    q, k, v, L = _case(2, 4, 2, 100, 16, torch.float32, [100, 90], fill_unused=0.0)
    broken = _launch(q, k, v, L, num_splits=3, block_s=16, mask_length=False)   # chunks of 34 and 30
    assert torch.isfinite(broken).all()
    with pytest.raises(MismatchError):
        assert_close(broken, decode_attention_ref(q, k, v, L), name="split without the chunk mask")


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
    with pytest.raises(ValueError, match="block_s must be a power of two >= 16"):
        decode_attention(q, k, v, L, block_s=8)
    q_big = torch.zeros(2, 129, 8, device=DEVICE)
    k_one = torch.zeros(2, 1, 16, 8, device=DEVICE)
    with pytest.raises(ValueError, match="at most MAX_GROUP=128"):
        decode_attention(q_big, k_one, k_one, L)
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match=r"decode_attention: num_splits must be an int in \[1, 64\]"):
            decode_attention(q, k, v, L, num_splits=bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,lens", [
    (2, 71, 1, 90, 64, [90, 37]),            # Falcon-7B's group of 71 (MQA): 128 tensor-core rows, 57 padding
    (1, 128, 1, 70, 32, [70]),               # a full 128-row group
    (2, 48, 2, 40, 16, [40, 1]),             # 24 per K/V head: 32 rows
])
def test_large_groups_match_reference(B, Hq, Hkv, S, D, lens, num_splits, dtype):
    """The group on the tensor-core M axis: the padding rows must neither leak into the output nor
    into a neighbour's (the kernel stores only the group's rows)."""
    q, k, v, L = _case(B, Hq, Hkv, S, D, dtype, lens)
    got = decode_attention(nan_canary(q), nan_canary(k), nan_canary(v), L, num_splits=num_splits, block_s=16)
    assert not torch.isnan(got).any()
    assert_close(got, decode_attention_ref(q.float(), k.float(), v.float(), L), dtype=dtype,
                 baseline=_baseline(q, k, v, L), name=f"decode_attention, group {Hq // Hkv}")


# ----------------------------------------------------------------------------------------------
# Several new queries per sequence (q (B, Hq, T, D)): a speculative verification of T - 1 drafts, or a
# prefill chunk, whose keys are the cache's last T positions; query t sees keys 0 .. L - T + t.

def _new_query_case(B, Hq, Hkv, S, D, T, dtype, lens, seed=0):
    q, k, v, L = _case(B, Hq, Hkv, S, D, dtype, lens, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(B, Hq, T, D, generator=g).to(DEVICE, dtype), k, v, L


def _sdpa_new_queries(q, k, v, lens):
    """SDPA per sequence with the equivalent boolean mask (key j visible to query t iff j <= L - T + t),
    in q's dtype: the independent reference and PyTorch's own error for the baseline rule."""
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(lens[b])
        kb, vb = (x[b, :, :L].repeat_interleave(group, 0) for x in (k, v))
        mask = torch.arange(L, device=q.device)[None, :] <= (L - T + torch.arange(T, device=q.device))[:, None]
        out[b] = torch.nn.functional.scaled_dot_product_attention(q[b], kb, vb, attn_mask=mask)
    return out


NEW_QUERY_CASES = [
    (3, 6, 2, 60, 40, 5, [5, 37, 60]),       # group 3 x 5 queries = 15 rows; a cache of exactly T; masked tails
    (2, 4, 1, 20, 16, 2, [2, 13]),           # MQA, group 4 x 2 = 8 rows; caches shorter than one 16-block
    (1, 2, 2, 33, 8, 1, [33]),               # T = 1 in the four-dimensional form
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,T,lens", NEW_QUERY_CASES)
def test_new_queries_match_reference(B, Hq, Hkv, S, D, T, lens, num_splits, dtype):
    """With 3 splits a 5-position cache makes chunks of 2: queries 0 and 1 (positions 0, 1) see
    nothing of the last two chunks, whose partials for them are empty rows the combine drops."""
    q, k, v, L = _new_query_case(B, Hq, Hkv, S, D, T, dtype, lens)
    got = decode_attention(nan_canary(q), nan_canary(k), nan_canary(v), L, num_splits=num_splits, block_s=16)
    ref = decode_attention_ref(q.float(), k.float(), v.float(), L)
    assert got.shape == (B, Hq, T, D) and got.dtype == dtype and not torch.isnan(got).any()
    assert_close(ref, _sdpa_new_queries(q.double(), k.double(), v.double(), L).float(), dtype=torch.float32)
    assert_close(got, ref, dtype=dtype, baseline=_sdpa_new_queries(q, k, v, L),
                 name=f"decode_attention, {T} new queries, {num_splits} splits")


def test_new_queries_are_successive_decode_steps():
    """Verifying gamma = 3 drafts in one call equals 4 one-query decodes at lengths L - 3 .. L (what the
    target model would compute token by token), and row t of causal attention over the whole sequence."""
    q, k, v, L = _new_query_case(2, 8, 2, 40, 16, 4, torch.float32, [40, 23], seed=5)
    out = decode_attention(q, k, v, L, block_s=16)
    for t in range(4):
        assert_close(out[:, :, t], decode_attention(q[:, :, t].contiguous(), k, v, L - 3 + t, block_s=16))
    full = torch.nn.functional.scaled_dot_product_attention(       # sequence 0: its 4 queries are rows 36..39
        torch.cat([torch.zeros(1, 8, 36, 16), q[:1]], 2), *(x[:1].repeat_interleave(4, 1) for x in (k, v)),
        is_causal=True)
    assert_close(out[:1], full[:, :, 36:])


def test_one_new_query_is_the_one_query_kernel():
    """q (B, Hq, 1, D) runs the same kernel as q (B, Hq, D) (no causal rows): the same bits."""
    q, k, v, L = _case(3, 6, 2, 100, 40, torch.float32, [2, 1, 77])
    for splits in (1, 3):
        one = decode_attention(q, k, v, L, num_splits=splits, block_s=16)
        assert torch.equal(decode_attention(q[:, :, None], k, v, L, num_splits=splits, block_s=16)[:, :, 0], one)


@pytest.mark.parametrize("num_splits,slack", [(1, 1), (3, 1), (1, 1 << 20)])
def test_broken_causal_limit_is_caught(num_splits, slack):
    """Each new query seeing one key too many (the next draft's: an off-by-one in the causal end), or
    every key (no causal limit within the new queries), is caught; the keys it reads are finite and
    inside the cache, so only the values are wrong. The same launch with slack 0 passes."""
    q, k, v, L = _new_query_case(2, 4, 2, 30, 16, 4, torch.float32, [30, 9], seed=2)
    ref = decode_attention_ref(q, k, v, L)
    broken = _launch(q, k, v, L, num_splits=num_splits, block_s=16, mask_length=True, causal_slack=slack)
    assert torch.isfinite(broken).all()
    with pytest.raises(MismatchError):
        assert_close(broken, ref, name=f"decode_attention, causal end {slack} too far")
    assert_close(broken[:, :, -1], ref[:, :, -1])         # the last query sees the whole cache either way
    assert_close(_launch(q, k, v, L, num_splits=num_splits, block_s=16, mask_length=True), ref)


def test_new_queries_bad_inputs_raise_clear_errors():
    q, k, v, L = _new_query_case(2, 4, 2, 16, 8, 4, torch.float32, [4, 9])
    with pytest.raises(ValueError, match=r"T=4 new queries .* a length 3 < T"):
        decode_attention(q, k, v, L - 1)
    with pytest.raises(ValueError, match=r"at least one new query per sequence, got T=0"):
        decode_attention(q[:, :, :0], k, v, L)
    with pytest.raises(ValueError, match=r"T \* Hq / Hkv = 65 \* 2 = 130 rows"):
        decode_attention(torch.zeros(2, 4, 65, 8, device=DEVICE), k, v, torch.full((2,), 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"q must be \(B, Hq, D\) or \(B, Hq, T, D\)"):
        decode_attention(q[None], k, v, L)
    with pytest.raises(ValueError, match=r"flash_decode: q must be \(B, Hq, D\), got"):
        flash_decode(q, k, v, L, num_splits=2)           # FlashDecoding's chapter API: one query
    with pytest.raises(ValueError, match="one query per sequence"):
        dec.launch_job(32, 8, 128, q_len=4, unified=True)


def test_tiles_put_the_group_on_the_tensor_core_rows():
    """BLOCK_G: the group padded to >= 16 rows; 128-position tiles at D <= 64 and 64 above, 3 stages,
    8 warps from 64 rows on (the AOT builds below); the interpreter takes 64 positions and one stage."""
    assert [dec.group_rows(g) for g in (1, 8, 16, 17, 33, 71, 128)] == [16, 16, 16, 32, 64, 128, 128]
    assert dec.gpu_tiles(4, 128) == dec.DecodeTiles(16, 64, 128, 4, 3)
    assert dec.gpu_tiles(71, 64) == dec.DecodeTiles(128, 128, 64, 8, 3)
    assert dec.gpu_tiles(2, 256) == dec.DecodeTiles(16, 64, 256, 4, 2)
    assert dec.gpu_tiles(8, 40, block_s=32).block_s == 32 and dec.gpu_tiles(8, 40).block_d == 64
    assert dec.gpu_tiles(128, 128, causal=True) == dec.DecodeTiles(128, 32, 128, 8, 3)    # 16 queries x group 8
    assert dec.gpu_tiles(16, 128, causal=True) == dec.gpu_tiles(16, 128)
    if runtime.runtime().interpreted:
        assert dec.default_tiles(4, 128) == dec.DecodeTiles(16, 64, 128, 4, 1)


# ----------------------------------------------------------------------------------------------
# How many programs: pure functions of the shapes and the SM count, checked without a GPU.

H100_SMS = 132


def _programs(grid):
    return math.prod(grid)


def test_one_split_is_one_program_per_sequence_and_kv_head():
    assert dec.attention_grid(1, 8, 1) == dec.decode_grid(1, 8) == (1, 8)   # 8 programs, whatever the length
    assert dec.attention_grid(1, 8, 64) == dec.split_grid(1, 8, 64) == (1, 8, 64)
    assert dec.decode_grid(32, 8) == (32, 8)


@pytest.mark.parametrize("cache_len", [4352, 8192, 32768, 131072])
def test_batch_1_fills_a_132_sm_gpu(cache_len):
    """Llama-3-8B's attention at batch 1 (8 K/V heads, groups of 4) on an H100: the single pass has
    8 programs for 132 SMs; the chosen split gives at least one program per SM once the cache holds
    ceil(132 / 8) = 17 chunks of MIN_CHUNK positions (4352), and 4 per SM at 32k."""
    s = choose_num_splits(1, 8, cache_len, H100_SMS)
    assert _programs(dec.decode_grid(1, 8)) == 8 < H100_SMS
    assert _programs(dec.attention_grid(1, 8, s)) >= H100_SMS
    if cache_len >= 32768:
        assert _programs(dec.attention_grid(1, 8, s)) == 8 * dec.MAX_SPLITS >= 3.8 * H100_SMS
    # below 17 chunks the MIN_CHUNK floor wins: 16 splits, 128 programs (the stated price)
    assert _programs(dec.attention_grid(1, 8, choose_num_splits(1, 8, 4351, H100_SMS))) == 128


def test_large_batch_keeps_one_pass():
    """128 sequences x 8 K/V heads = 1024 programs >= 4 per SM: no split, no combine."""
    assert choose_num_splits(128, 8, 32768, H100_SMS) == 1
    assert dec.attention_grid(128, 8, 1) == dec.decode_grid(128, 8)


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 32768, H100_SMS) == 64     # 8 programs -> 512 (3.9 per SM), capped
    assert choose_num_splits(1, 8, 8192, H100_SMS) == 32      # chunks of 256 positions at least
    assert choose_num_splits(32, 8, 32768, H100_SMS) == 3     # 256 programs -> 768 >= 4 * 132
    assert choose_num_splits(1, 8, 255, H100_SMS) == 1        # too short to split
    assert choose_num_splits(1, 8, 0, H100_SMS) == 1          # empty cache
    assert choose_num_splits(1, 2, 128, H100_SMS) == 1        # the tiny GPT's longest cache: one pass anywhere


@pytest.mark.parametrize("batch", [1, 2, 7, 32, 64])
@pytest.mark.parametrize("kv_heads", [1, 8])
@pytest.mark.parametrize("cache_len", [0, 1, 255, 256, 4097, 32768, 131072])
def test_choose_num_splits_properties(batch, kv_heads, cache_len):
    """Every choice: at most MAX_SPLITS; no chunk below MIN_CHUNK positions; and unless one of those
    caps binds, at least WAVES programs per SM, and one split fewer would not reach that."""
    s = choose_num_splits(batch, kv_heads, cache_len, H100_SMS)
    assert 1 <= s <= dec.MAX_SPLITS
    assert s == 1 or -(-cache_len // s) >= dec.MIN_CHUNK
    capped = s in (dec.MAX_SPLITS, max(1, cache_len // dec.MIN_CHUNK))
    assert batch * kv_heads * s >= dec.WAVES * H100_SMS or capped
    assert s == 1 or batch * kv_heads * (s - 1) < dec.WAVES * H100_SMS


def test_choose_num_splits_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sms must be an int >= 1"):
        choose_num_splits(1, 8, 100, 0)
    with pytest.raises(ValueError, match="cache_len must be an int >= 0"):
        choose_num_splits(1, 8, -1, 132)
    with pytest.raises(ValueError, match="batch"):
        choose_num_splits(0, 8, 100, 132)


def test_default_splits_follow_the_device():
    """num_splits=None: 1 under the interpreter (programs run one after another there, so a split
    would only add the partials and the combine to the tiny GPT's path); on a GPU,
    choose_num_splits with its SM count."""
    if runtime.runtime().interpreted:
        assert dec.default_num_splits(1, 8, 32768, DEVICE) == 1
        with pytest.raises(ValueError, match="not a CUDA device"):
            dec.device_sms(torch.device("cpu"))
    else:
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        assert dec.device_sms(DEVICE) == sms
        assert dec.default_num_splits(1, 8, 32768, DEVICE) == choose_num_splits(1, 8, 32768, sms)
    q, k, v, L = _case(1, 4, 1, 600, 16, torch.float32, [600], seed=9)
    assert_close(decode_attention(q, k, v, L), decode_attention_ref(q, k, v, L), dtype=torch.float32,
                 baseline=_baseline(q, k, v, L))


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


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds, derived by kernels.inspect.launch_job from the launcher's own arguments
# (dec.launch_job: meta tensors of a batch-32, 32k-token fp16 cache, the GPU tiles), for sm_80 and
# sm_90a: every group class 1..128 (BLOCK_G 16, 32, 64, 128) at head dims 64 and 128, the single pass
# and the split kernel, one compile_triton_many call for the module.

AOT_GROUPS = (1, 8, 24, 48, 71, 128)
AOT_ARCHS = ("sm80", "sm90")
# What the causal rows add per thread, measured (tests below): at 16 rows, -2 to +2 registers in the
# single pass and 0 (sm_80) or 34 (sm_90a: 104 -> 138) in the split kernel; no shared memory.
NEW_QUERY_EXTRA_REGS = 40


def _aot_cases():
    cases = {}
    for d in (64, 128):
        for g in AOT_GROUPS:
            cases[f"single pass, group {g}, D={d}"] = dec.launch_job(8 * g, 8, d, batch=32, num_splits=1)  # 8 K/V heads
            cases[f"split x64, group {g}, D={d}"] = dec.launch_job(8 * g, 8, d, num_splits=dec.MAX_SPLITS)
    cases["split unified max, group 8, D=128"] = dec.launch_job(64, 8, 128, num_splits=dec.MAX_SPLITS, unified=True)
    # several new queries (causal rows): Llama-3-8B verifying gamma = 3 drafts (4 x group 4 = 16 rows, the
    # tile of "group 8" above), and the largest tile, 16 queries x group 8 = 128 rows
    cases["single pass, 4 new queries x group 4, D=128"] = dec.launch_job(32, 8, 128, batch=32, num_splits=1, q_len=4)
    cases["split x64, 4 new queries x group 4, D=128"] = dec.launch_job(32, 8, 128, num_splits=dec.MAX_SPLITS, q_len=4)
    cases["single pass, 16 new queries x group 8, D=128"] = dec.launch_job(64, 8, 128, batch=32, num_splits=1, q_len=16)
    cases["combine, 64 splits, D=128"] = dec.combine_job(1, 32, dec.MAX_SPLITS, 128)
    # broken on purpose: 64 group rows x 128 positions x D=128 at 4 warps does not fit the registers
    cases["oversized: group 64, BLOCK_S=128, 4 warps"] = dec.launch_job(
        512, 8, 128, batch=32, num_splits=1, tiles=dec.DecodeTiles(64, 128, 128, 4, 3))
    return cases


AOT_CASES = _aot_cases()


@pytest.fixture(scope="module")
def aot_builds():
    builds = ki.compile_triton_many(list(AOT_CASES.values()), archs=AOT_ARCHS)
    return dict(zip(AOT_CASES, builds))


def test_builds_for_groups_1_to_128_do_not_spill(aot_builds):
    rows = [(f"{label} {arch}", b[arch]) for label, b in aot_builds.items() for arch in AOT_ARCHS]
    table = ki.resource_table(rows)
    print(table)                                   # shown with -s; the asserts below are the check
    for label, build in rows:
        if label.startswith("oversized"):
            continue
        assert build.spills == 0 and build.metadata["stack_bytes"] == 0, f"{label} spills\n{table}"
        if "combine" not in label:
            assert build.async_copies["LDGSTS"] > 0, f"{label}: K/V tiles not pipelined with cp.async\n{table}"


def test_the_group_runs_on_tensor_cores(aot_builds):
    """mma.sync (HMMA) for tiles under 64 rows, wgmma (HGMMA) on sm_90a from 64 rows on; no group
    reduced on CUDA cores."""
    for d in (64, 128):
        for g in AOT_GROUPS:
            b = aot_builds[f"single pass, group {g}, D={d}"]
            assert b["sm80"].tensor_core == "HMMA"
            assert b["sm90"].tensor_core == ("HGMMA" if dec.group_rows(g) >= 64 else "HMMA")


def test_new_queries_cost_no_shared_memory_and_few_registers(aot_builds):
    """The causal rows reuse the one-query tile: 4 new queries x group 4 fill the 16 rows that group 8
    fills, with the same shared memory, on tensor cores, and the per-row causal end costs at most
    NEW_QUERY_EXTRA_REGS registers per thread; the 128-row tile (16 queries x group 8, 32 positions per
    iteration: gpu_tiles(causal=True)) runs on wgmma on sm_90a like the 128-head group."""
    for kind in ("single pass", "split x64"):
        new, one = aot_builds[f"{kind}, 4 new queries x group 4, D=128"], aot_builds[f"{kind}, group 8, D=128"]
        for arch in AOT_ARCHS:
            assert new[arch].metadata["shared_bytes"] == one[arch].metadata["shared_bytes"], (kind, arch)
            assert new[arch].tensor_core == one[arch].tensor_core == "HMMA"
            extra = new[arch].metadata["registers"] - one[arch].metadata["registers"]
            assert extra <= NEW_QUERY_EXTRA_REGS, f"{kind} {arch}: {extra} more registers"
    big = aot_builds["single pass, 16 new queries x group 8, D=128"]
    assert big["sm90"].tensor_core == "HGMMA" and big["sm80"].tensor_core == "HMMA"


def test_spill_check_catches_an_oversized_tile(aot_builds):
    broken = aot_builds["oversized: group 64, BLOCK_S=128, 4 warps"]
    for arch in AOT_ARCHS:
        assert broken[arch].spills > 0 and broken[arch].metadata["stack_bytes"] > 0


def _product_widths(job, build, arg):
    """The widths of the integer products that argument ``arg`` enters in the PTX (kernels.inspect).
    The PTX numbers the runtime parameters in order; constexprs, and the strides a launch folded to
    =1, are not parameters."""
    runtime_args = [n for n, kind in job.signature.items() if kind != "constexpr"]     # in argument order
    return ki.param_product_widths(build, runtime_args.index(arg))


def test_ptx_uses_64bit_products_for_batch_and_head_offsets(aot_builds):
    """b * stride_b and hk * stride_h are 64-bit in the PTX of both K/V kernels; the check tells
    them apart from an int32 product (the per-head query stride, multiplied in int32 on purpose:
    Hq * D is small)."""
    for label in ("single pass, group 8, D=128", "split x64, group 8, D=128"):
        job, build = AOT_CASES[label], aot_builds[label]["sm90"]
        for arg in ("stride_qb", "stride_kb", "stride_kh", "stride_vb", "stride_vh"):
            widths = _product_widths(job, build, arg)
            assert widths == {64}, f"{label}: {arg} enters products of widths {widths}"
        assert 32 in _product_widths(job, build, "stride_qh")


def test_compile_jobs_are_the_default_launch_on_an_h100():
    """compile_jobs() builds every job from the launcher's own argument helper at real sizes, with the
    split count decode_attention picks on 132 SMs: every grid has at least one program per SM, except
    where MAX_SPLITS binds: Falcon-7B's single K/V head at batch 1 gets 64 programs (its 71-head
    partials already cost 2 * 71 / 512 = 28% of the K/V bytes at 64 chunks of 512 positions)."""
    jobs = dec.compile_jobs()
    falcon = jobs["Falcon-7B (MQA) decode, group 71, D=64, batch 32: 17 splits"]
    assert falcon.constexprs["BLOCK_G"] == 128 and falcon.num_warps == 8 and falcon.num_stages == 3
    assert falcon.grid == (32, 1, 17)
    assert "stride_kd: =1" in falcon.specialization() and "stride_ks: i32 %16" in falcon.specialization()
    assert jobs["Llama-2-7B (MHA) decode, group 1, D=128, batch 32: single pass"].grid == (32, 32)
    for label, job in jobs.items():
        if "combine" not in label:
            assert job.programs >= H100_SMS or job.grid[-1] == dec.MAX_SPLITS, label
    assert jobs["Falcon-7B (MQA) decode, group 71, D=64, batch 1: 64 splits"].programs == 64
