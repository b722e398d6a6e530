"""kernels.attention.nsa: NSA's branches, its block-selection rule, and the selected-branch kernel.

The kernel is checked against the dense masked reference (full attention with a mask that allows only
the selected blocks, causal) by the FlashAttention test rule: its error against the wide reference
must be within a small multiple of PyTorch's own error in the low dtype.
"""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.attention import attention_ref
from kernels.attention import nsa
from kernels.testing import MismatchError, assert_close, nan_canary

DEVICE = runtime.device()
SMALL = nsa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_selected=3, n_initial=1, n_local=1, window=12)


def _qkv(B, Hq, Hkv, Nq, Nk, DK, DV, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, DK, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, Nk, DK, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, Nk, DV, generator=g).to(DEVICE, dtype)
    return q, k, v


def _random_idx(B, H, Nq, Nk, block, n, seed=0):
    """Per (b, h, row): the row's own block, then up to n - 1 random earlier blocks, -1 padded, in a
    random order (the kernel must not assume sorted lists)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, H, Nq, n), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for r in range(Nq):
                own = (r + Nk - Nq) // block
                rest = torch.randperm(own, generator=g)[: n - 1].tolist()
                row = [own] + rest
                row += [-1] * (n - len(row))
                idx[b, h, r] = torch.tensor(row)[torch.randperm(n, generator=g)]
    return idx.to(DEVICE)


def _wide(t):
    return t.double() if t.dtype == torch.float32 else t.float()


def _check(q, k, v, idx, block, **kw):
    got = nsa.nsa_selected_attention(nan_canary(q, rows=True), nan_canary(k, rows=True), nan_canary(v, rows=True),
                                     nan_canary(idx), block, **kw)
    want = nsa.selected_attention_ref(_wide(q), _wide(k), _wide(v), idx, block)
    base = nsa.selected_attention_ref(q, k, v, idx, block)
    assert got.shape == (*q.shape[:3], v.shape[3]) and got.dtype == q.dtype
    assert_close(got, want, dtype=q.dtype, baseline=base, name="nsa_selected_attention")
    return got


# ----------------------------------------------------------------------------------------------
# The references


def test_paper_config_and_bad_configs():
    assert (nsa.PAPER.cmp_block, nsa.PAPER.cmp_stride, nsa.PAPER.sel_block, nsa.PAPER.n_selected,
            nsa.PAPER.window) == (32, 16, 64, 16, 512)
    with pytest.raises(ValueError, match="cmp_stride"):
        nsa.NSAConfig(cmp_block=32, cmp_stride=12)
    with pytest.raises(ValueError, match="n_initial"):
        nsa.NSAConfig(n_selected=2)


def test_overlap_weights_are_eq9_double_sum():
    """At l = 32, d = 16, l' = 64 selection block j collects compressed blocks 4j - 1 .. 4j + 3 with
    weights 1, 2, 2, 2, 1 (overlap / d), which is sum_{m < l'/d} sum_{n < l/d} of shifted p_cmp."""
    W = nsa.overlap_weights(512)                                # (31, 8)
    assert W.shape == (nsa.n_compressed(512), 8)
    assert W[:, 3].nonzero().flatten().tolist() == [11, 12, 13, 14, 15]
    assert W[11:16, 3].tolist() == [1.0, 2.0, 2.0, 2.0, 1.0]
    double_sum = torch.zeros(31, dtype=torch.float64)
    for m in range(4):
        for n in range(2):
            double_sum[4 * 3 + m + n - 1] += 1.0
    assert torch.equal(W[:, 3], double_sum)
    assert torch.equal(W.sum(1), torch.full((31,), 2.0, dtype=torch.float64))   # every block spreads l/d


def test_compress_is_the_block_mean_and_takes_weights():
    x = torch.randn(2, 3, 41, 5, dtype=torch.float64)
    c = nsa.compress_ref(x, SMALL)                             # blocks of 8 every 4: (41 - 8) // 4 + 1 = 9
    assert c.shape == (2, 3, 9, 5)
    assert_close(c[:, :, 4], x[:, :, 16:24].mean(2))
    w = torch.arange(8, dtype=torch.float64)
    assert_close(nsa.compress_ref(x, SMALL, w)[:, :, 2], (x[:, :, 8:16] * w[:, None]).sum(2))
    assert nsa.compress_ref(x[:, :, :7], SMALL).shape[2] == 0


def test_compressed_branch_is_causal_per_block():
    vis = nsa.compressed_visible(20, SMALL)                    # block i ends at 4i + 7
    assert vis[6].sum() == 0 and vis[7].tolist()[:2] == [True, False] and vis[19].sum() == 4
    q, k, v = _qkv(1, 4, 2, 20, 20, 8, 8, torch.float64)
    o, p = nsa.compressed_attention_ref(q, k, v, SMALL)
    assert torch.equal(o[:, :, :7], torch.zeros_like(o[:, :, :7]))
    assert_close(p.sum(-1)[:, :, 7:], torch.ones(1, 4, 13, dtype=torch.float64))


def test_selection_rule_forced_causal_shared_and_top_n():
    """Group-shared importance, the initial and the local block always kept, no future block, and the
    free choices are the highest importance among the remaining causal blocks."""
    torch.manual_seed(0)
    B, Hq, Hkv, N = 1, 6, 2, 90
    q, k, v = _qkv(B, Hq, Hkv, N, N, 8, 8, torch.float64)
    _, p = nsa.compressed_attention_ref(q, k, v, SMALL)
    imp = nsa.selection_importance_ref(p, Hkv, SMALL)          # (1, 2, 90, 6)
    assert imp.shape == (B, Hkv, N, 6)
    per_head = p @ nsa.overlap_weights(N, SMALL)
    assert_close(imp[:, 1], per_head[:, 3:6].sum(1))           # group 1 = query heads 3, 4, 5
    idx = nsa.select_blocks_ref(imp, SMALL)
    assert idx.dtype == torch.int32 and idx.shape == (B, Hkv, N, 3)
    for t in range(N):
        own = t // 16
        for h in range(Hkv):
            row = [j for j in idx[0, h, t].tolist() if j >= 0]
            assert row == sorted(row) and len(row) == min(3, own + 1)
            assert 0 in row and own in row and max(row) == own
            free = [j for j in range(1, own)]
            if free and len(row) == 3:
                chosen = [j for j in row if j not in (0, own)]
                best = max(free, key=lambda j: float(imp[0, h, t, j]))
                assert chosen == [best]


def test_selection_mask_matches_loops():
    idx = _random_idx(1, 2, 5, 40, 16, 3, seed=3)
    mask = nsa.selection_mask_ref(idx, 40, 16, q_offset=35)
    for h in range(2):
        for r in range(5):
            t = r + 35
            want = [s <= t and (s // 16) in idx[0, h, r].tolist() for s in range(40)]
            assert mask[0, h, r].tolist() == want


def test_branches_reduce_to_full_attention_when_nothing_is_dropped():
    """With every block selectable and a window as long as the sequence, the selected and the window
    branch are causal attention itself (against kernels.attention.attention_ref)."""
    cfg = nsa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_selected=4, window=64)
    q, k, v = _qkv(2, 4, 2, 50, 50, 12, 12, torch.float64)
    gates = torch.rand(2, 4, 50, 3, dtype=torch.float64)
    out, parts = nsa.nsa_ref(q, k, v, gates, cfg, return_parts=True)
    full = attention_ref(q, k, v, causal=True)
    assert_close(parts["slc"], full)
    assert_close(parts["win"], full)
    assert_close(out, gates[..., :1] * parts["cmp"] + (gates[..., 1:2] + gates[..., 2:]) * full)
    with pytest.raises(ValueError, match="gates"):
        nsa.nsa_ref(q, k, v, gates[..., :2], cfg)


def test_paper_decode_tokens_table4():
    """The paper's decoding table: tokens loaded per decode step, 2048 / 2560 / 3584 / 5632 at 8k .. 64k,
    against 8192 .. 65536 for full attention (expected speed-ups 4x .. 11.6x)."""
    got = [nsa.paper_decode_tokens(s) for s in (8192, 16384, 32768, 65536)]
    assert got == [2048, 2560, 3584, 5632]
    assert round(65536 / got[-1], 1) == 11.6
    full, shared = nsa.decode_bytes(65536, 4, 192, 128, None), nsa.decode_bytes(65536, 4, 192, 128)
    per_head = nsa.decode_bytes(65536, 4, 192, 128, group=16, shared=False)
    assert full // shared == 11 and full / per_head < 4          # per-head selection loses most of it
    k = nsa.keys_per_query(65535)
    assert k == {"cmp": 4095, "slc": 1024, "win": 512}
    assert nsa.prefill_flops(100, 2, 8, 8, None) == 2 * 2 * 16 * (100 * 101 // 2)


# ----------------------------------------------------------------------------------------------
# The kernel

F32, F16 = torch.float32, torch.float16
KERNEL_CASES = [
    # B, Hq, Hkv, Nq, Nk, DK, DV, block, n, dtype
    (1, 6, 2, 37, 37, 24, 20, 16, 3, F32),      # group 3, DK != DV, last block partial
    (1, 6, 2, 37, 37, 24, 20, 16, 3, F16),
    (1, 5, 1, 45, 45, 40, 72, 16, 4, F32),      # MQA, group 5 (padded to 16 rows)
    (2, 8, 2, 3, 70, 32, 32, 32, 2, F32),       # the last 3 positions only (decode-like), batch 2
    (2, 8, 2, 3, 70, 32, 32, 32, 2, F16),
    (1, 16, 1, 20, 20, 16, 16, 16, 2, F32),     # the paper's group of 16 heads
    (1, 16, 1, 20, 20, 16, 16, 16, 2, F16),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,DK,DV,block,n,dtype", KERNEL_CASES)
def test_kernel_matches_dense_masked_reference(B, Hq, Hkv, Nq, Nk, DK, DV, block, n, dtype):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, DK, DV, dtype)
    got = _check(q, k, v, _random_idx(B, Hkv, Nq, Nk, block, n), block)
    assert not torch.isnan(got).any()


def test_kernel_with_the_nsa_rule_and_sm_scale():
    q, k, v = _qkv(1, 4, 2, 40, 40, 16, 16)
    _, p = nsa.compressed_attention_ref(q.double(), k.double(), v.double(), SMALL)
    idx = nsa.select_blocks_ref(nsa.selection_importance_ref(p, 2, SMALL), SMALL)
    assert (idx == -1).any()                                   # early rows have fewer than n blocks
    got = nsa.nsa_selected_attention(q, k, v, idx, 16, sm_scale=0.3)
    want = nsa.selected_attention_ref(q.double(), k.double(), v.double(), idx, 16, sm_scale=0.3)
    assert_close(got, want, dtype=torch.float32, baseline=nsa.selected_attention_ref(q, k, v, idx, 16, sm_scale=0.3))


def test_causal_mask_inside_the_block_is_needed():
    """BROKEN = 1 lets a query see the later keys of its own block: caught."""
    q, k, v = _qkv(1, 4, 2, 30, 30, 16, 16)
    idx = _random_idx(1, 2, 30, 30, 16, 2)
    bad = nsa.nsa_selected_attention(q, k, v, idx, 16, _broken=1)
    with pytest.raises(MismatchError):
        assert_close(bad, nsa.selected_attention_ref(q.double(), k.double(), v.double(), idx, 16), dtype=torch.float32)


def test_per_head_selection_is_not_what_the_kernel_computes():
    """The kernel's heads share their group's blocks. Indices chosen per query head (here head 0's
    and head 1's differ) cannot be expressed: a dense reference with per-head masks differs from the
    kernel run on either head's list, so the sharing is part of the contract, not an optimisation."""
    q, k, v = _qkv(1, 2, 1, 40, 40, 16, 16)
    per_head = torch.cat([_random_idx(1, 1, 40, 40, 16, 2, seed=s) for s in (1, 2)], dim=1)   # (1, Hq=2, 40, 2)
    assert not torch.equal(per_head[:, 0], per_head[:, 1])
    mask = nsa.selection_mask_ref(per_head, 40, 16)             # (1, 2, 40, 40): one mask per query head
    want = nsa.dense_masked_attention_ref(q.double(), k.double(), v.double(), mask)
    got = nsa.nsa_selected_attention(q, k, v, per_head[:, :1].contiguous(), 16)
    with pytest.raises(MismatchError):
        assert_close(got, want, dtype=torch.float32)


def test_bad_inputs_raise_clear_errors():
    q, k, v = _qkv(1, 4, 2, 10, 10, 16, 16)
    idx = _random_idx(1, 2, 10, 10, 16, 2)
    f = nsa.nsa_selected_attention
    with pytest.raises(TypeError, match="idx must be int32"):
        f(q, k, v, idx.long())
    with pytest.raises(ValueError, match=r"idx must be \(B, Hkv, Nq, n\)"):
        f(q, k, v, _random_idx(1, 4, 10, 10, 16, 2))            # per query head: refused
    with pytest.raises(ValueError, match="idx values"):
        f(q, k, v, idx + 1)
    with pytest.raises(ValueError, match="multiple"):
        f(q[:, :3], k, v, idx)
    with pytest.raises(ValueError, match="block"):
        f(q, k, v, idx, 24)
    with pytest.raises(TypeError, match="share a dtype"):
        f(q, k.half(), v, idx)
    with pytest.raises(TypeError, match="dtype"):
        f(q.int(), k, v, idx)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        f(torch.cat([q, q], 2), k, v, torch.cat([idx, idx], 2))
    with pytest.raises(ValueError, match="head dims"):
        f(torch.zeros(1, 4, 10, 300), torch.zeros(1, 2, 10, 300), v, idx)
    with pytest.raises(ValueError, match="sm_scale"):
        f(q, k, v, idx, sm_scale=float("nan"))


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds at the paper's size (compile_jobs: a 64k bf16 prefill, 64 heads in 4 groups)

def _aot_cases():
    cases = dict(nsa.compile_jobs())
    # broken on purpose: 2 warps and 1 stage at DK = 192 (K/V through registers, not cp.async): spills
    job = nsa.launch_job(64, 4, 192, 128, num_warps=2)
    job.num_stages = 1
    cases["2 warps, 1 stage, DK=192"] = job
    return cases


AOT_CASES = _aot_cases()


@pytest.fixture(scope="module")
def aot_builds():
    return dict(zip(AOT_CASES, (b["sm90"] for b in ki.compile_triton_many(list(AOT_CASES.values()), archs=("sm90",)))))


def test_builds_at_the_paper_size_do_not_spill_and_use_tensor_cores(aot_builds):
    """No spills on sm_90a, mma.sync tensor-core products (HMMA: 16 query rows per tile are below
    wgmma's 64), the gathered K/V blocks filled by cp.async (LDGSTS) over 2 stages."""
    table = ki.resource_table(list(aot_builds.items()))
    print(table)
    for label in nsa.compile_jobs():
        b = aot_builds[label]
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, table
        assert b.tensor_core == "HMMA" and b.families("ptx")["mma.sync"] > 0, table
        assert b.async_copies["LDGSTS"] > 0, table
    assert aot_builds["2 warps, 1 stage, DK=192"].spills > 0   # the spill check can fail


def test_compile_jobs_are_the_launch():
    job = nsa.compile_jobs()["NSA-27B (64 q heads, 4 groups, dk 192, dv 128), 64k prefill, selected branch"]
    c = job.constexprs
    assert (c["BLOCK_H"], c["BLOCK_S"], c["BLOCK_DK"], c["BLOCK_DV"], c["BROKEN"]) == (16, 64, 256, 128, 0)
    assert job.grid == (65536, 4) and job.num_warps == 4 and job.num_stages == nsa.GPU_STAGES


def test_attention_mass_kept_orders_and_bounds():
    """Oracles bound the rule by construction; with every block selectable all selections keep everything;
    a key block that every query attends to is found by the compressed-attention rule."""
    cfg = nsa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=4, n_initial=1, n_local=2, window=16)
    q, k, v = _qkv(2, 4, 2, 64, 64, 16, 16, torch.float64, seed=5)
    r = nsa.attention_mass_kept(q, k, v, cfg, first_row=40)
    assert r["oracle_per_head"] >= r["oracle_shared"] >= r["nsa"] - 1e-12 and r["oracle_shared"] >= r["recent"] - 1e-12
    assert 4 <= r["union_blocks"] <= 5 + 1e-12                 # 3 forced blocks + one free choice per head
    every = nsa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=8, window=16)
    assert all(abs(x - 1) < 1e-12 for name, x in nsa.attention_mass_kept(q, k, v, every, 40).items() if name != "union_blocks")
    k[:, :, 24:32] = 4 * q[:, ::2, 60:61].mean(2, keepdim=True)   # block 3 holds keys aligned with the late queries
    r = nsa.attention_mass_kept(q, k, v, cfg, first_row=56)
    assert r["nsa"] > r["recent"] + 0.1


def test_ptx_uses_64bit_products_for_batch_head_row_and_block_offsets(aot_builds):
    """At 64k tokens x 64 heads x 192 (B = 1) q already has 2**29.6 elements; a batch of 4 passes 2**31.
    b * stride_b, the K/V head, the query row and the block's first key times stride_n are 64-bit
    products; the head offsets inside the group tile stay 32-bit (stride_qh enters both)."""
    label = "NSA-27B (64 q heads, 4 groups, dk 192, dv 128), 64k prefill, selected branch"
    job, build = AOT_CASES[label], aot_builds[label]
    runtime_args = [n for n, kind in job.signature.items() if kind != "constexpr"]
    widths = lambda arg: ki.param_product_widths(build, runtime_args.index(arg))   # noqa: E731
    for arg in ("stride_qb", "stride_kb", "stride_kh", "stride_kn", "stride_vn", "stride_qm", "stride_ob"):
        assert widths(arg) == {64}, arg
    assert widths("stride_qh") == {32, 64}
