"""kernels.attention.flash_decode: split-K decode attention, its combine, and the FlashDecoding++ variant."""
import kernels  # noqa: F401  (before triton)

import re
from importlib import import_module

import pytest
import torch

from kernels import runtime
from kernels.attention import (choose_num_splits, combine_ref, decode_attention, decode_attention_ref,
                               flash_decode, flash_decode_ref, flash_decode_unified_max, split_ref)
from kernels.softmax import softmax_stats
from kernels.testing import MismatchError, assert_close, nan_canary

fd = import_module("kernels.attention.flash_decode")  # the module (the package re-exports a function of that name)
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
    # and it agrees with the tiny-GPT decode kernel
    assert_close(got, decode_attention(q, k, v, L).to(got.dtype), dtype=dtype,
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
    km, kl, ko, _ = fd._split(q, k, v, L, num_splits, block_s=16)
    assert_close(km, m.float(), name="m_s")
    assert_close(kl, l.float(), name="l_s")
    assert_close(ko, o.float(), name="o_s")
    assert_close(fd.combine(m.float(), l.float(), o.float()), combine_ref(m, l, o).float(), name="combine kernel")


def test_combine_order_does_not_matter_and_empty_splits_drop_out():
    q, k, v, L = _case(1, 2, 1, 40, 8, torch.float32, [40], seed=3)
    m, l, o = split_ref(q.double(), k.double(), v.double(), L, 4)
    perm = torch.tensor([2, 0, 3, 1], device=DEVICE)
    assert_close(combine_ref(m[..., perm], l[..., perm], o[..., perm, :]), combine_ref(m, l, o))
    pad_m = torch.cat([m, torch.full_like(m[..., :1], float("-inf"))], -1)
    pad_l = torch.cat([l, torch.zeros_like(l[..., :1])], -1)
    pad_o = torch.cat([o, torch.zeros_like(o[..., :1, :])], -2)
    assert_close(combine_ref(pad_m, pad_l, pad_o), combine_ref(m, l, o))
    assert_close(fd.combine(pad_m.float(), pad_l.float(), pad_o.float()), combine_ref(m, l, o).float())


def test_averaging_the_splits_is_wrong():
    """A combine that averages the normalised partial outputs (ignoring l_s and m_s) is caught."""
    q, k, v, L = _case(2, 4, 2, 60, 16, torch.float32, [60, 31], seed=4, scale=3.0)
    m, l, o = split_ref(q.double(), k.double(), v.double(), L, 3)
    with pytest.raises(MismatchError):
        assert_close(o.mean(dim=-2), flash_decode_ref(q.double(), k.double(), v.double(), L))


def test_broken_combine_without_max_rescale_is_caught():
    """Weights l_s instead of l_s e^{m_s - m}: the combine must fail the check."""
    q, k, v, L = _case(2, 2, 1, 64, 16, torch.float32, [64, 40], seed=5, scale=3.0)
    m, l, o, _ = fd._split(q, k, v, L, 4, block_s=16)
    bad = (l[..., None] * o).sum(-2) / l.sum(-1, keepdim=True)
    want = flash_decode_ref(q.double(), k.double(), v.double(), L)
    with pytest.raises(MismatchError):
        assert_close(bad, want.float())
    assert_close(fd.combine(m, l, o), want.float(), dtype=torch.float32, baseline=want.float())


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


def test_choose_num_splits():
    H100 = 132
    assert choose_num_splits(1, 8, 32768, H100) == 64     # Llama-3-8B, batch 1: 8 programs -> 512 (3.9 waves), capped
    assert choose_num_splits(1, 8, 8192, H100) == 32      # chunks of 256 positions at least
    assert choose_num_splits(32, 8, 32768, H100) == 3     # 256 programs -> 768 >= 4 * 132
    assert choose_num_splits(128, 8, 32768, H100) == 1    # the batch alone fills 4 waves
    assert choose_num_splits(1, 8, 255, H100) == 1        # too short to split
    assert choose_num_splits(1, 8, 0, H100) == 1          # empty cache


@pytest.mark.parametrize("batch", [1, 2, 7, 32, 64])
@pytest.mark.parametrize("kv_heads", [1, 8])
@pytest.mark.parametrize("cache_len", [0, 1, 255, 256, 4097, 32768, 131072])
def test_choose_num_splits_properties(batch, kv_heads, cache_len):
    """Every choice: at most MAX_SPLITS; no chunk below MIN_CHUNK positions; and unless one of those
    caps binds, at least WAVES programs per SM, and one split fewer would not reach that."""
    sms = 132
    s = choose_num_splits(batch, kv_heads, cache_len, sms)
    assert 1 <= s <= fd.MAX_SPLITS
    assert s == 1 or -(-cache_len // s) >= fd.MIN_CHUNK
    capped = s in (fd.MAX_SPLITS, max(1, cache_len // fd.MIN_CHUNK))
    assert batch * kv_heads * s >= fd.WAVES * sms or capped
    assert s == 1 or batch * kv_heads * (s - 1) < fd.WAVES * sms


def test_choose_num_splits_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sms must be an int >= 1"):
        choose_num_splits(1, 8, 100, 0)
    with pytest.raises(ValueError, match="cache_len must be an int >= 0"):
        choose_num_splits(1, 8, -1, 132)
    with pytest.raises(ValueError, match="batch"):
        choose_num_splits(0, 8, 100, 132)


def test_grid_programs_at_batch_1_and_32():
    """The launchers' grids, for Llama-3-8B-like heads (8 K/V) on an H100's 132 SMs, 32k caches."""
    from kernels.attention.decode import decode_grid
    prod = lambda g: g[0] * g[1] * (g[2] if len(g) > 2 else 1)   # noqa: E731
    assert prod(decode_grid(1, 8)) == 8                                               # 6% of the SMs
    assert prod(fd.split_grid(1, 8, choose_num_splits(1, 8, 32768, 132))) == 512     # 3.9 waves
    assert prod(fd.split_grid(32, 8, choose_num_splits(32, 8, 32768, 132))) == 768


def test_default_splits_follow_the_device():
    """num_splits=None asks choose_num_splits with this device's SM count (1 under the interpreter)."""
    q, k, v, L = _case(1, 4, 1, 600, 16, torch.float32, [600], seed=9)
    sms = fd.device_sms(q.device)
    assert sms == (1 if DEVICE.type == "cpu" else torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    want = flash_decode_ref(q.double(), k.double(), v.double(), L).float()
    assert_close(flash_decode(q, k, v, L), want, dtype=torch.float32, baseline=decode_attention_ref(q, k, v, L))
    assert choose_num_splits(1, 1, 600, 1) == 2            # what ran on the CPU: two chunks of 300


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


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds for sm_90a at real shapes (head_dim 128, GQA groups 4 and 8), with the
# launchers' tiles and 4 warps: one compile_triton_many call for the module (about 2 s per kernel).

from kernels import inspect as ki  # noqa: E402
from kernels.attention import decode as dec  # noqa: E402

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
    "split, group 4": _job(fd._flash_decode_split_kernel, **_tiles(4), UNIFIED=False),
    "split, group 8": _job(fd._flash_decode_split_kernel, **_tiles(8), UNIFIED=False),
    "split unified max, group 8": _job(fd._flash_decode_split_kernel, **_tiles(8), UNIFIED=True),
    "combine, 64 splits": _job(fd._flash_decode_combine_kernel, BLOCK_SPLITS=fd.MAX_SPLITS, BLOCK_D=128),
    # broken variant: group 8 with a 32-position tile (32768 products per tile) spills
    "decode_attention, group 8, BLOCK_S=32": _job(dec._decode_attention_kernel, BLOCK_G=8, BLOCK_S=32, BLOCK_D=128,
                                                  MASK_LENGTH=True),
}


@pytest.fixture(scope="module")
def sm90_builds():
    try:
        builds = ki.compile_triton_many(list(AOT_CASES.values()), archs=("sm90",))
    except ki.ToolMissingError as err:                     # no cuobjdump: the spill count cannot be read
        pytest.skip(str(err))
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
    """The widths of the integer products that argument ``arg`` enters in the PTX: 64 where it is read
    sign-extended into a 64-bit register (ld.param.s32 %rd, cvt.s64.s32, mul.wide.s32), 32 where
    its 32-bit register enters a mul.lo.s32 / mad.lo.s32."""
    index = kernel.arg_names.index(arg)              # constexprs come last: PTX numbers the others in order
    name = build.metadata["name"]
    load = re.search(rf"ld\.param\.[bs]32\s+(%rd?\d+), \[{name}_param_{index}\];", build.ptx)
    assert load, f"{arg} (param {index}) is not read in the PTX of {name}"
    reg = load.group(1)
    if reg.startswith("%rd"):
        return {64}
    widths = set()
    if re.search(rf"(cvt\.s64\.s32\s+%rd\d+, |mul\.wide\.s32\s+%rd\d+,[^;]*[ ,]){reg}\b", build.ptx):
        widths.add(64)
    if re.search(rf"(mul|mad)\.lo\.s32\s+%r\d+,[^;]*[ ,]{reg}\b", build.ptx):
        widths.add(32)
    return widths


def test_ptx_uses_64bit_products_for_batch_and_head_offsets(sm90_builds):
    """b * stride_b and hk * stride_h are 64-bit in the PTX of both K/V kernels; the check tells
    them apart from an int32 product (the per-head query stride, multiplied in int32 on purpose:
    Hq * D is small)."""
    for label in ("decode_attention, group 8", "split, group 8"):
        kernel = dec._decode_attention_kernel if label.startswith("decode") else fd._flash_decode_split_kernel
        for arg in ("stride_qb", "stride_kb", "stride_kh", "stride_vb", "stride_vh"):
            widths = _product_widths(sm90_builds[label], kernel, arg)
            assert widths == {64}, f"{label}: {arg} enters products of widths {widths}"
        assert 32 in _product_widths(sm90_builds[label], kernel, "stride_qh")
