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
from kernels.attention import choose_num_splits, decode_attention, decode_attention_ref
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
    got = decode_attention(q, k_t, v_t, L, num_splits=num_splits, block_s=8)
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
    with pytest.raises(ValueError, match="block_s must be a power of two >= 8"):
        decode_attention(q, k, v, L, block_s=4)
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match=r"decode_attention: num_splits must be an int in \[1, 64\]"):
            decode_attention(q, k, v, L, num_splits=bad)


def test_default_block_keeps_the_gpu_product_small():
    """On a GPU the (group x BLOCK_S x D) product stays at most 8192 values (no register spills:
    the AOT builds below compile these tiles for sm_90a); the interpreter takes 64."""
    assert dec.default_block_s(4, 128) == (64 if runtime.runtime().interpreted else 16)
    for group, d in [(1, 32), (1, 128), (3, 40), (4, 128), (8, 128), (16, 64)]:
        bs = dec.gpu_block_s(group, d)
        assert bs >= dec.MIN_BLOCK_S and bs & (bs - 1) == 0
        assert triton.next_power_of_2(group) * triton.next_power_of_2(d) * bs <= dec.GPU_PRODUCT_ELEMENTS
    assert (dec.gpu_block_s(4, 128), dec.gpu_block_s(8, 128), dec.gpu_block_s(1, 32)) == (16, 8, 128)


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
# Ahead-of-time builds for sm_90a at real shapes (head_dim 128, GQA groups 4 and 8), with the
# launchers' tiles and 4 warps, of every kernel decode_attention (and flash_decode) can launch: one
# compile_triton_many call for the module (about 2 s per kernel).

_POINTERS = {"lens_ptr": "*i32", "mpart_ptr": "*fp32", "lpart_ptr": "*fp32", "opart_ptr": "*fp32", "flag_ptr": "*i32"}
_FLOATS = {"scale_log2", "phi_log2", "low_log2", "high_log2"}


def _signature(kernel, constexprs):
    """fp16 tensors, fp32 partials, i32 strides and sizes: what a launch with fp16 caches passes."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            continue
        sig[name] = _POINTERS.get(name, "*fp16") if name.endswith("_ptr") else ("fp32" if name in _FLOATS else "i32")
    return sig


def _job(kernel, **constexprs):
    return ki.TritonJob(kernel, _signature(kernel, constexprs), constexprs=constexprs, num_warps=4)


def _tiles(group):
    return dict(BLOCK_G=group, BLOCK_S=dec.gpu_block_s(group, 128), BLOCK_D=128)


AOT_CASES = {
    "decode_attention, group 4": _job(dec._decode_attention_kernel, **_tiles(4), MASK_LENGTH=True),
    "decode_attention, group 8": _job(dec._decode_attention_kernel, **_tiles(8), MASK_LENGTH=True),
    "split, group 4": _job(dec._decode_split_kernel, **_tiles(4), UNIFIED=False, MASK_LENGTH=True),
    "split, group 8": _job(dec._decode_split_kernel, **_tiles(8), UNIFIED=False, MASK_LENGTH=True),
    "split unified max, group 8": _job(dec._decode_split_kernel, **_tiles(8), UNIFIED=True, MASK_LENGTH=True),
    "combine, 64 splits": _job(dec._decode_combine_kernel, BLOCK_SPLITS=dec.MAX_SPLITS, BLOCK_D=128),
    # broken variant: group 8 with a 32-position tile (32768 products per tile) spills
    "decode_attention, group 8, BLOCK_S=32": _job(dec._decode_attention_kernel, BLOCK_G=8, BLOCK_S=32, BLOCK_D=128,
                                                  MASK_LENGTH=True),
}


@pytest.fixture(scope="module")
def sm90_builds():
    builds = ki.compile_triton_many(list(AOT_CASES.values()), archs=("sm90",))
    return {label: b["sm90"] for label, b in zip(AOT_CASES, builds)}


def test_sm90_builds_at_real_shapes_do_not_spill(sm90_builds):
    table = ki.resource_table(list(sm90_builds.items()))
    print(table)                                   # shown with -s; the asserts below are the check
    for label, build in sm90_builds.items():
        if "BLOCK_S=32" in label:
            continue
        assert build.spills == 0 and build.metadata["stack_bytes"] == 0, f"{label} spills\n{table}"
    assert dec.gpu_block_s(8, 128) == 8 and dec.gpu_block_s(4, 128) == 16


def test_sm90_spill_check_catches_an_oversized_tile(sm90_builds):
    broken = sm90_builds["decode_attention, group 8, BLOCK_S=32"]
    assert broken.spills > 0 and broken.metadata["stack_bytes"] > 0


def _product_widths(build, kernel, arg):
    """The widths of the integer products that argument ``arg`` enters in the PTX (kernels.inspect)."""
    index = kernel.arg_names.index(arg)              # constexprs come last: PTX numbers the others in order
    return ki.param_product_widths(build, index)


def test_ptx_uses_64bit_products_for_batch_and_head_offsets(sm90_builds):
    """b * stride_b and hk * stride_h are 64-bit in the PTX of both K/V kernels; the check tells
    them apart from an int32 product (the per-head query stride, multiplied in int32 on purpose:
    Hq * D is small)."""
    for label in ("decode_attention, group 8", "split, group 8"):
        kernel = dec._decode_attention_kernel if label.startswith("decode") else dec._decode_split_kernel
        for arg in ("stride_qb", "stride_kb", "stride_kh", "stride_vb", "stride_vh"):
            widths = _product_widths(sm90_builds[label], kernel, arg)
            assert widths == {64}, f"{label}: {arg} enters products of widths {widths}"
        assert 32 in _product_widths(sm90_builds[label], kernel, "stride_qh")
