"""kernels/attention/mla.py: the naive and absorbed forms of MLA, the paged latent decode kernel
(FlashMLA's design) against its reference with splits, canaries and a broken variant, the cache
sizes at DeepSeek-V3's dims, and the sm_90a build at that size."""
import kernels  # noqa: F401
import math

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import mla as M
from kernels.testing import MismatchError, assert_close

DEVICE = runtime.device()


def _forms(seed=0, B=2, H=4, T=3, S=20, dn=16, dr=8, dc=32, dv=16):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return (r(B, H, T, dn), r(B, H, T, dr), r(B, S, dc), r(B, S, dr), r(H, dn, dc) / math.sqrt(dc),
            r(H, dv, dc) / math.sqrt(dc))


@pytest.mark.parametrize("causal", [False, True])
def test_absorbed_form_equals_naive_form(causal):
    args = _forms()
    a = M.mla_naive_ref(*args, sm_scale=0.2, causal=causal)
    b = M.mla_absorbed_ref(*args, sm_scale=0.2, causal=causal)
    assert float((a - b).abs().max()) < 1e-12


def test_absorbing_with_the_wrong_scale_is_caught():
    """The absorbed form keeps the naive scale 1/sqrt(d_nope + d_R); 1/sqrt(d_c + d_R) is a different model."""
    args = _forms(dn=16, dr=8, dc=32)
    a = M.mla_naive_ref(*args, sm_scale=1 / math.sqrt(24))
    b = M.mla_absorbed_ref(*args, sm_scale=1 / math.sqrt(40))
    assert float((a - b).abs().max()) > 1e-3


def test_deepseek_v3_cache_sizes():
    c = M.DEEPSEEK_V3
    assert M.kv_elements_per_token("mla", n_heads=c.n_heads, head_dim=128, latent=512, rope=64) == 576
    assert M.kv_elements_per_token("mla-decompressed", n_heads=128, head_dim=192, v_head_dim=128) == 40960
    assert M.kv_elements_per_token("mha", n_heads=128, head_dim=128) == 32768
    assert M.kv_elements_per_token("gqa", n_heads=128, head_dim=128, kv_heads=8) == 2048
    assert 576 * 2 * c.n_layers == 70272                       # bytes per token, all 61 layers, bf16
    with pytest.raises(ValueError, match="kind must be"):
        M.kv_elements_per_token("mqa2", n_heads=1, head_dim=1)


def _decode_case(B, Hq, Hc, Dc, Dr, P, lens, dtype, seed=0, rope_heads=None, extra_pages=2):
    g = torch.Generator().manual_seed(seed)
    S = max(lens) if max(lens) else 1
    lat = torch.randn(B, S, Hc, Dc, generator=g).to(dtype)
    rope = torch.randn(B, S, rope_heads or Hc, Dr, generator=g).to(dtype)
    lp, rp, table = M.paged_latent_cache(lat, rope, P, extra_pages=extra_pages, seed=seed)
    ql = torch.randn(B, Hq, Dc, generator=g).to(dtype)
    qr = torch.randn(B, Hq, Dr, generator=g).to(dtype)
    L = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (ql, qr, lp, rp, table, L)]


DTYPES = runtime.runtime().check_dtypes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hc,Dc,Dr,P,lens,splits", [
    (3, 20, 1, 64, 32, 32, [0, 1, 77], 1),         # empty, length 1, a masked tail; 20 heads: 2 head blocks
    (2, 8, 2, 32, 16, 16, [40, 33], 3),            # two latent heads (GLA), page 16 < the tile: BLOCK_N 16
    (1, 16, 1, 512, 64, 64, [130], 2),             # DeepSeek-V3's 512 + 64, three pages
    (2, 16, 1, 64, 16, 32, [64, 5], 8),            # 8 splits: empty splits for the short sequence
])
def test_decode_matches_reference(B, Hq, Hc, Dc, Dr, P, lens, splits, dtype):
    """Unused page slots and unused pages hold NaN: a read past a sequence shows."""
    ql, qr, lp, rp, table, L = _decode_case(B, Hq, Hc, Dc, Dr, P, lens, dtype)
    scale = 1 / math.sqrt(Dc)
    o = M.mla_decode(ql, qr, lp, rp, table, L, scale, num_splits=splits)
    ref = M.mla_decode_ref(ql.double(), qr.double(), lp.double(), rp.double(), table, L, scale)
    assert_close(o, ref, dtype=dtype, baseline=M.mla_decode_ref(ql, qr, lp, rp, table, L, scale, upcast=False))
    assert not torch.isnan(o).any()
    if 0 in lens:
        assert bool((o[lens.index(0)] == 0).all())


def test_a_shared_rope_head_for_several_latent_heads():
    ql, qr, lp, rp, table, L = _decode_case(2, 8, 2, 32, 16, 16, [30, 17], torch.float32, rope_heads=1)
    o = M.mla_decode(ql, qr, lp, rp, table, L, 0.2, num_splits=2)
    assert_close(o, M.mla_decode_ref(ql.double(), qr.double(), lp.double(), rp.double(), table, L, 0.2),
                 dtype=torch.float32, baseline=M.mla_decode_ref(ql, qr, lp, rp, table, L, 0.2, upcast=False))


def test_reading_the_last_tile_whole_is_caught():
    ql, qr, lp, rp, table, L = _decode_case(2, 16, 1, 64, 32, 32, [50, 77], torch.float32)
    ref = M.mla_decode_ref(ql.double(), qr.double(), lp.double(), rp.double(), table, L, 0.125)
    with pytest.raises(MismatchError):
        assert_close(M.mla_decode(ql, qr, lp, rp, table, L, 0.125, _mask_length=False), ref, dtype=torch.float32)


def test_sparse_page_selection_is_attention_over_those_pages():
    """Reading less: a page table that lists only some of a sequence's pages gives exact attention over
    those positions (block-sparse selection runs in the same kernel)."""
    ql, qr, lp, rp, table, L = _decode_case(1, 16, 1, 64, 32, 32, [160], torch.float32)
    keep = torch.tensor([0, 2, 4])                                  # pages 0, 2, 4 of 5
    sub = table[:, keep].contiguous()
    o = M.mla_decode(ql, qr, lp, rp, sub, torch.tensor([96], dtype=torch.int32), 0.125)
    pos = torch.cat([torch.arange(32) + 32 * p for p in keep.tolist()])
    full = M.gather_latent(lp, table, 160)[0, pos]                  # (96, 1, 64)
    rope = M.gather_latent(rp, table, 160)[0, pos]
    s = (full[:, 0] @ ql[0].double().T.float() + rope[:, 0] @ qr[0].T) * 0.125   # (96, Hq)
    want = torch.softmax(s.double(), 0).T @ full[:, 0].double()
    assert_close(o[0], want, dtype=torch.float32, baseline=want)


def test_bad_inputs_are_refused_by_name():
    ql, qr, lp, rp, table, L = _decode_case(1, 16, 1, 64, 32, 32, [40], torch.float32)
    with pytest.raises(ValueError, match="must be a power of two >= 16"):
        M.mla_decode(ql[..., :48], qr, lp[..., :48], rp, table, L, 0.1)
    with pytest.raises(ValueError, match="Hq=15 must be a multiple"):
        M.mla_decode(ql[:, :15], qr[:, :15], *_decode_case(1, 16, 2, 64, 32, 32, [40], torch.float32)[2:], 0.1)
    with pytest.raises(ValueError, match="seqlens must lie"):
        M.mla_decode(ql, qr, lp, rp, table, L + 100, 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        M.mla_decode(ql, qr, lp, rp, table, L, 0.0)
    with pytest.raises(ValueError, match="num_splits"):
        M.mla_decode(ql, qr, lp, rp, table, L, 0.1, num_splits=0)
    with pytest.raises(TypeError, match="share one of"):
        M.mla_decode(ql.half(), qr, lp, rp, table, L, 0.1)
    with pytest.raises(ValueError, match="block_table entries"):
        M.mla_decode(ql, qr, lp, rp, table + 100, L, 0.1)


@pytest.fixture(scope="module")
def builds():
    jobs = M.compile_jobs()
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_sm90a_build_at_deepseek_v3_size_uses_wgmma_without_spills(builds):
    _, out = builds
    for label, b in out.items():
        b = b["sm90"]
        assert b.tensor_core == "HGMMA", label
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        assert b.metadata["shared_bytes"] <= 227 * 1024, label
        assert b.async_copies["LDGSTS"] > 0, label                  # cp.async pipelining of the cache tiles


def test_page_offsets_are_64_bit(builds):
    """page * stride_cp passes 2**31 for a pool of 64-position pages of 576 bf16 values past 58k pages."""
    jobs, out = builds
    for label, job in jobs.items():
        runtime_args = [n for n, kind in job.signature.items() if kind != "constexpr"]
        for arg in ("stride_cp", "stride_rp"):
            assert ki.param_product_widths(out[label]["sm90"], runtime_args.index(arg)) == {64}, (label, arg)


def test_grid_sizes_against_an_h100():
    """B=1 at 32k tokens: 2 head blocks x 64 splits (MAX_SPLITS) = 128 programs, one wave short of 132 SMs;
    B=64 at 8k: 64 x 2 x 5 = 640 programs, the four waves choose_num_splits aims for."""
    from kernels.attention.decode import choose_num_splits
    assert choose_num_splits(1, 2, 32768, 132) * 2 == 128
    assert 64 * 2 * choose_num_splits(64, 2, 8192, 132) == 640 >= 4 * 132
