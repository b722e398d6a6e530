"""kernels/attention/gla_gta.py: the decode-step counts of MHA/GQA/MLA/GLA/GTA (checked against the
paper repository's stated intensities), GTA's decode by the latent kernel against GTA's own definition
(with a broken variant caught), GLA's two latent heads, and the sm_90a builds."""
import kernels  # noqa: F401
import math

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import gla_gta as G
from kernels.attention import mla as M
from kernels.gpu import hardware as hw
from kernels.testing import MismatchError, assert_close

DEVICE = runtime.device()


def test_intensities_match_the_papers_statements():
    """README of Dao-AILab/grouped-latent-attention@17889dbb: MLA at h_q = 128 reaches about 2 h_q = 256
    FLOP/byte, near the H100 roof of about 295; GLA-2 stays at about h_q = 128, like MQA."""
    mla = G.Layout("mla", 128, latent=512, rope=64)
    f, b = G.decode_step_counts(mla, 4096)
    assert 240 < f / b < 256
    f, b = G.decode_step_counts(G.GLA2, 4096)
    assert f / b == 128.0
    f, b = G.decode_step_counts(G.Layout("mqa", 128), 4096)
    assert f / b == 128.0
    assert round(hw.ridge_point("H100", "bf16")) == 295


def test_gta_halves_gqa_cache_and_doubles_intensity():
    gqa, gta = G.Layout("gqa", 32, hkv=8), G.GTA8
    assert G.kv_elements_per_token(gqa) == 2048 and G.kv_elements_per_token(gta) == 8 * 128 + 64
    (fq, bq), (ft, bt) = G.decode_step_counts(gqa, 8192), G.decode_step_counts(gta, 8192)
    assert fq == ft and 1.8 < bq / bt < 2.0


def test_gla_shards_where_mla_duplicates():
    mla = G.Layout("mla", 128, latent=512, rope=64)
    assert G.decode_step_counts(mla, 1000, devices=2)[1] == G.decode_step_counts(mla, 1000)[1]   # a full copy each
    assert G.decode_step_counts(G.GLA2, 1000, devices=2)[1] == (256 + 64) * 1000 * 2
    with pytest.raises(ValueError, match="unknown kind"):
        G.decode_step_counts(G.Layout("nsa", 8), 10)


def _gta_case(B, Hq, Hkv, d, r, P, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lens)
    tied = torch.randn(B, S, Hkv, d, generator=g).to(dtype)
    kr = torch.randn(B, S, 1, r, generator=g).to(dtype)
    tp, rp, table = M.paged_latent_cache(tied, kr, P, extra_pages=1, seed=seed)
    q = torch.randn(B, Hq, d, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (q, tp, rp, table, torch.tensor(lens, dtype=torch.int32))]


@pytest.mark.parametrize("dtype", runtime.runtime().check_dtypes, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,d,r,P,lens,splits", [
    (3, 12, 3, 64, 32, 32, [0, 70, 33], 2),
    (1, 32, 8, 128, 64, 64, [130], 1),          # Llama-3-8B-sized GTA-8 heads, three pages
])
def test_gta_decode_matches_its_definition(B, Hq, Hkv, d, r, P, lens, splits, dtype):
    q, tp, rp, table, L = _gta_case(B, Hq, Hkv, d, r, P, lens, dtype)
    tau = 1 / math.sqrt(d)
    o = G.gta_decode(q, tp, rp, table, L, tau, num_splits=splits)
    ref = G.gta_decode_ref(q.double(), tp.double(), rp.double(), table, L, tau)
    assert_close(o, ref, dtype=dtype, baseline=G.gta_decode_ref(q, tp, rp, table, L, tau, upcast=False))


def test_gta_with_the_query_rope_half_left_in_the_latent_query_is_caught():
    """Forgetting to zero q's RoPE half in the latent query adds q[d-r:] . t[d-r:] to every score."""
    q, tp, rp, table, L = _gta_case(2, 8, 2, 64, 32, 32, [40, 50], torch.float32)
    ref = G.gta_decode_ref(q.double(), tp.double(), rp.double(), table, L, 0.125)
    bad = M.mla_decode(q, q[..., 32:].contiguous(), tp, rp, table, L, 0.125)
    with pytest.raises(MismatchError):
        assert_close(bad, ref, dtype=torch.float32)


def test_gla_decode_is_two_latent_heads():
    g = torch.Generator().manual_seed(1)
    B, Hq, Dc, Dr, S = 2, 16, 64, 32, 75
    lat = torch.randn(B, S, 2, Dc, generator=g)
    rope = torch.randn(B, S, 2, Dr, generator=g)
    lp, rp, table = M.paged_latent_cache(lat, rope, 32)
    ql, qr = torch.randn(B, Hq, Dc, generator=g), torch.randn(B, Hq, Dr, generator=g)
    L = torch.tensor([75, 30], dtype=torch.int32)
    o = G.gla_decode(ql, qr, lp, rp, table, L, 0.1, num_splits=2)
    ref = M.mla_decode_ref(ql.double(), qr.double(), lp.double(), rp.double(), table, L, 0.1)
    assert_close(o, ref, dtype=torch.float32, baseline=M.mla_decode_ref(ql, qr, lp, rp, table, L, 0.1, upcast=False))
    # heads 0..7 read latent head 0 only: changing latent head 1 leaves them unchanged
    lp2 = lp.clone()
    lp2[:, :, 1] += 1.0
    o2 = G.gla_decode(ql, qr, lp2, rp, table, L, 0.1, num_splits=2)
    assert torch.equal(o2[:, :8], o[:, :8]) and not torch.equal(o2[:, 8:], o[:, 8:])
    with pytest.raises(ValueError, match="h_c >= 2"):
        G.gla_decode(ql, qr, lp[:, :, :1], rp[:, :, :1], table, L, 0.1)


def test_gta_bad_inputs():
    q, tp, rp, table, L = _gta_case(1, 8, 2, 64, 32, 32, [40], torch.float32)
    with pytest.raises(ValueError, match="one RoPE key for all heads"):
        G.gta_decode(q, tp, tp, table, L, 0.1)
    with pytest.raises(ValueError, match="d > r"):
        G.gta_decode(q[..., :32], tp, rp, table, L, 0.1)


@pytest.fixture(scope="module")
def builds():
    jobs = G.compile_jobs()
    return dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_sm90a_builds_without_spills(builds):
    for label, b in builds.items():
        b = b["sm90"]
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        # GLA: 64 heads of a latent head fill wgmma's 64 rows; GTA's 4 heads per group pad to 16: mma.sync
        assert b.tensor_core == ("HGMMA" if label.startswith("GLA") else "HMMA"), label
