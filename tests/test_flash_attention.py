"""kernels.attention.flash_attention (FlashAttention-2 forward and backward) and attention_ref.

The checks follow the FlashAttention test rule: the kernel's error against a reference computed in
higher precision from the same inputs must be within a small multiple of PyTorch's own error in
the low dtype (``attention_ref(..., upcast=False)``).
"""
import kernels  # noqa: F401  (before triton)

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from kernels import runtime
from kernels.attention import attention_ref, flash_attention, flash_attention_v1
from kernels.attention import flash as flash_mod
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, Nq, D, generator=g) * scale).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(DEVICE, dtype)
    return q, k, v


def _wide(t):
    """The reference's precision: fp64 for fp32 inputs, fp32 for fp16/bf16 inputs."""
    return t.double() if t.dtype == torch.float32 else t.float()


def _check_forward(q, k, v, causal, name="flash_attention", **kw):
    got = flash_attention(nan_canary(q, rows=True), nan_canary(k, rows=True), nan_canary(v, rows=True), causal, **kw)
    ref = attention_ref(_wide(q), _wide(k), _wide(v), causal)
    base = attention_ref(q, k, v, causal, upcast=False)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, ref, dtype=q.dtype, baseline=base, name=name)
    return got


FORWARD_CASES = [
    # B, Hq, Hkv, Nq,  Nk,  D,   causal
    (1, 2, 2, 1, 1, 16, False),          # length 1
    (1, 2, 2, 1, 1, 16, True),
    (2, 4, 2, 7, 7, 32, True),           # smaller than a block; GQA group 2
    (1, 4, 1, 100, 100, 64, True),       # MQA, masked tail, several blocks
    (1, 2, 2, 257, 257, 64, False),      # one row past four blocks
    (1, 4, 4, 100, 257, 80, True),       # Nq < Nk (bottom-right causal); D=80 padded to 128
    (1, 6, 2, 257, 100, 96, True),       # Nq > Nk: 157 fully masked rows; group 3; D=96
    (1, 2, 1, 33, 70, 128, False),       # Nq != Nk, D=128, MQA
    (1, 8, 2, 17, 40, 16, False),        # group 4
    (1, 2, 1, 20, 37, 192, True),        # DeepSeek-V3's Q/K head dim, padded to 256; Nq < Nk
    (1, 2, 2, 33, 17, 256, False),       # Gemma's head dim; Nq > Nk, masked tails
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal", FORWARD_CASES)
def test_forward_matches_reference(B, Hq, Hkv, Nq, Nk, D, causal, dtype):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype)
    got = _check_forward(q, k, v, causal)
    assert not torch.isnan(got).any()


@pytest.mark.parametrize("Nq,Nk,causal", [(7, 7, False), (7, 7, True), (40, 100, True), (100, 33, False)])
def test_matches_torch_sdpa(Nq, Nk, causal):
    """fp32 against torch.nn.functional.scaled_dot_product_attention (GQA via enable_gqa;
    bottom-right causal via causal_lower_right)."""
    q, k, v = _qkv(1, 4, 2, Nq, Nk, 24, torch.float32, seed=1)
    mask = causal_lower_right(Nq, Nk) if causal else None
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    base = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_close(flash_attention(q, k, v, causal), want, dtype=torch.float32, baseline=base)


def test_square_causal_is_torch_is_causal():
    """With Nq == Nk bottom-right and top-left alignment coincide: is_causal=True, the diagonal visible."""
    q, k, v = _qkv(1, 2, 2, 50, 50, 16, torch.float32, seed=2)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_close(flash_attention(q, k, v, causal=True), want, dtype=torch.float32,
                 baseline=F.scaled_dot_product_attention(q, k, v, is_causal=True))
    # row 0 sees only key 0: its output is v[0] exactly (up to rounding)
    assert_close(flash_attention(q, k, v, causal=True)[:, :, 0], v[:, :, 0])


def test_sm_scale_and_v1_loop_order_agree():
    q, k, v = _qkv(1, 4, 2, 70, 90, 40, torch.float32, seed=3)
    for causal in (False, True):
        ref, lse_ref = attention_ref(q.double(), k.double(), v.double(), causal, sm_scale=0.3, return_lse=True)
        o2, lse2 = flash_attention(q, k, v, causal, sm_scale=0.3, return_lse=True)
        o1, lse1 = flash_attention_v1(q, k, v, causal, sm_scale=0.3, return_lse=True)
        base = attention_ref(q, k, v, causal, sm_scale=0.3, upcast=False)
        assert_close(o2, ref, dtype=torch.float32, baseline=base, name="v2")
        assert_close(o1, ref, dtype=torch.float32, baseline=base, name="v1")
        assert_close(lse2, lse_ref.float(), name="lse v2")
        assert_close(lse1, lse_ref.float(), name="lse v1")


def test_lse_is_logsumexp_and_fully_masked_rows():
    """Nq > Nk with causal: the first Nq - Nk rows see no key. Output 0, lse -inf, no NaN anywhere."""
    q, k, v = _qkv(1, 2, 1, 20, 5, 16, torch.float32, seed=4)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(o[:, :, :15], torch.zeros_like(o[:, :, :15]))
    assert torch.isneginf(lse[:, :, :15]).all() and torch.isfinite(lse[:, :, 15:]).all()
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / 4.0
    visible = torch.arange(5, device=DEVICE)[None, :] <= torch.arange(20, device=DEVICE)[:, None] - 15
    want = torch.logsumexp(s.masked_fill(~visible, float("-inf")), dim=-1)
    assert_close(lse[:, :, 15:], want[:, :, 15:].float())
    _, ref_lse = attention_ref(q, k, v, True, return_lse=True)
    assert torch.isneginf(ref_lse[:, :, :15]).all()
    # gradients of fully masked rows are exactly zero, and nothing is NaN
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention(qg, kg, vg, causal=True).pow(2).sum().backward()
    assert torch.equal(qg.grad[:, :, :15], torch.zeros_like(qg.grad[:, :, :15]))
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits(dtype):
    """Scores in the hundreds: exp would overflow without the running max; the kernel stays exact."""
    q, k, v = _qkv(1, 2, 2, 40, 70, 32, dtype, seed=5, scale=40.0)
    got = _check_forward(q, k, v, causal=True)
    assert torch.isfinite(got).all()


GRAD_CASES = [
    # B, Hq, Hkv, Nq, Nk, D,  causal
    (1, 2, 2, 7, 7, 16, True),           # tiny, MHA
    (1, 4, 2, 33, 33, 32, True),         # GQA group 2, one row past two 16-row blocks
    (1, 4, 1, 20, 45, 80, True),         # MQA, Nq < Nk, D padded
    (2, 2, 1, 45, 20, 16, True),         # Nq > Nk: fully masked rows
    (1, 3, 1, 30, 50, 24, False),        # group 3, not causal
    (1, 2, 1, 20, 33, 256, True),        # head dim 256, MQA
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal", GRAD_CASES)
def test_gradients_match_autograd(B, Hq, Hkv, Nq, Nk, D, causal, dtype):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=6)
    do = torch.randn(B, Hq, Nq, D, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    ins = [nan_canary(t, rows=True).requires_grad_() for t in (q, k, v)]
    # 16-row tiles: several Q and K/V blocks, masked tails, causal loop bounds inside the backward
    got = torch.autograd.grad(flash_attention(*ins, causal, block_m=16, block_n=16), ins, nan_canary(do, rows=True))
    wide = [_wide(t).requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_ref(*wide, causal), wide, _wide(do))
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    base = torch.autograd.grad(attention_ref(*low, causal, upcast=False), low, do)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert g.dtype == dtype and g.shape == w.shape
        assert not torch.isnan(g).any(), f"{name} has NaN (a canary was read)"
        assert_close(g, w, dtype=dtype, baseline=b, name=name)


def test_gradcheck_float64_reference_agrees_with_sdpa():
    """The reference's own backward is autograd's: sanity-check it against SDPA once in float64."""
    q, k, v = (t.double().requires_grad_() for t in _qkv(1, 2, 1, 6, 9, 8, torch.float32, seed=8))
    mask = causal_lower_right(6, 9)
    a = torch.autograd.grad(attention_ref(q, k, v, True).sum(), (q, k, v))
    b = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum(), (q, k, v))
    for x, y in zip(a, b):
        assert_close(x, y)


# ---- broken variants are caught ---------------------------------------------------------------


def test_forgetting_to_rescale_the_accumulator_is_caught():
    """acc += P V without acc *= alpha: exact only while the running max never grows; with
    several K/V blocks it does, and the check must fail."""
    q, k, v = _qkv(1, 2, 2, 40, 100, 32, torch.float32, seed=9)
    ref = attention_ref(q.double(), k.double(), v.double(), False)
    base = attention_ref(q, k, v, False, upcast=False)
    o, _ = flash_mod._forward(q, k, v, False, 32 ** -0.5, block_n=16, rescale=False)
    with pytest.raises(MismatchError):
        assert_close(o, ref, dtype=torch.float32, baseline=base)
    o, _ = flash_mod._forward(q, k, v, False, 32 ** -0.5, block_n=16)
    assert_close(o, ref, dtype=torch.float32, baseline=base)


def test_missing_key_mask_is_caught_by_canaries():
    """Without the n < Nk mask the padded tail of the last K/V block joins the softmax; with the
    inputs inside NaN canaries that shows up as NaN (and without canaries as a wrong answer)."""
    q, k, v = _qkv(1, 2, 2, 20, 37, 16, torch.float32, seed=10)
    ref = attention_ref(q.double(), k.double(), v.double(), False)
    base = attention_ref(q, k, v, False, upcast=False)
    o, _ = flash_mod._forward(nan_canary(q), nan_canary(k), nan_canary(v), False, 0.25, mask_kv=False)
    with pytest.raises(MismatchError):
        assert_close(o, ref, dtype=torch.float32, baseline=base)
    o, _ = flash_mod._forward(q, k, v, False, 0.25, mask_kv=False)
    with pytest.raises(MismatchError):
        assert_close(o, ref, dtype=torch.float32, baseline=base)


def test_backward_without_the_delta_term_is_caught():
    """dS = P * dP (forgetting - D_i, D = rowsum(dO * O)) gives wrong dq and dk."""
    q, k, v = _qkv(1, 2, 1, 20, 30, 16, torch.float32, seed=11)
    do = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    o, lse = flash_mod._forward(q, k, v, True, 0.25)
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_ref(*wide, True, sm_scale=0.25), wide, do.double())
    dq, dk, dv = flash_mod._backward(do, q, k, v, o, lse, True, 0.25, use_delta=False)
    with pytest.raises(MismatchError):
        assert_close(dq, want[0].float())
    with pytest.raises(MismatchError):
        assert_close(dk, want[1].float())
    assert_close(dv, want[2].float(), dtype=torch.float32, baseline=want[2].float())   # dV needs no D
    dq, dk, dv = flash_mod._backward(do, q, k, v, o, lse, True, 0.25)
    for g, w in zip((dq, dk, dv), want):
        assert_close(g, w.float(), dtype=torch.float32, baseline=w.float())


def test_the_rule_rejects_an_error_three_times_pytorchs_own():
    """The FlashAttention test rule is not vacuous: a result off by 3x PyTorch's own fp16 error fails."""
    q, k, v = _qkv(1, 2, 2, 30, 30, 16, torch.float16, seed=13)
    ref = attention_ref(q, k, v, False)
    base = attention_ref(q, k, v, False, upcast=False)
    worse = ref + 3.0 * (base.float() - ref)
    with pytest.raises(MismatchError):
        assert_close(worse.half(), ref, dtype=torch.float16, baseline=base)


# ---- bad input -------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    q, k, v = _qkv(1, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="4-D"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        flash_attention(q[:, :3], k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="float64"):
        flash_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(*_qkv(1, 2, 2, 8, 8, 272, torch.float32))
    with pytest.raises(ValueError, match="k shape"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="k is"):
        flash_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="block_m"):
        flash_attention(q, k, v, block_m=24)
    with pytest.raises(ValueError, match="sm_scale"):
        flash_attention(q, k, v, sm_scale=float("nan"))


@pytest.mark.parametrize("Nq,Nk,causal", [(37, 100, True), (100, 37, True), (50, 50, False)])
def test_tiled_reference_recurrence(Nq, Nk, causal):
    """The PyTorch form of the tiled recurrence (built on softmax_stats / merge_softmax_stats) is exact;
    without rescaling the accumulator it is not."""
    from kernels.attention import tiled_attention_ref
    q, k, v = (t.double() for t in _qkv(1, 4, 2, Nq, Nk, 16, torch.float32, seed=14))
    ref, lse = attention_ref(q, k, v, causal, return_lse=True)
    o, lse_t = tiled_attention_ref(q, k, v, causal, block_n=16)
    assert_close(o, ref)
    assert_close(lse_t, lse)
    bad, _ = tiled_attention_ref(q, k, v, causal, block_n=16, rescale=False)
    with pytest.raises(MismatchError):
        assert_close(bad, ref)


# ---- GPU only ---------------------------------------------------------------------------------

ON_GPU = runtime.runtime().on_gpu


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: SDPA's flash backend and compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_sdpa_flash_backend(dtype, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(15)
    q, k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    ref = attention_ref(q, k, v, causal)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ours = flash_attention(q, k, v, causal)
    assert_close(theirs, ref, dtype=dtype, baseline=attention_ref(q, k, v, causal, upcast=False), name="sdpa flash")
    assert_close(ours, ref, dtype=dtype, baseline=theirs, name="flash_attention vs SDPA's own error")


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: torch.cuda memory statistics")
def test_gpu_peak_memory_has_no_n_by_n_tensor():
    n, d = 8192, 64
    q, k, v = (torch.randn(1, 4, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    flash_attention(q, k, v, True)                       # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    flash_attention(q, k, v, True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 4 * n * n * 2 / 16                    # far below one (N x N) fp16 score matrix per head
    assert extra <= 2 * (4 * n * d * 2 + 4 * n * 4)      # about O and lse


def test_backward_with_a_broadcast_gradient():
    """o.sum().backward() hands the kernel a dO with stride 0 everywhere; strides are honoured."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 20, 24, 16, torch.float32, seed=16))
    flash_attention(q, k, v, True).sum().backward()
    got = [t.grad for t in (q, k, v)]
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_ref(*wide, True).sum().backward()
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*low, True, upcast=False).sum().backward()
    for name, g, w, b in zip("qkv", got, wide, low):
        assert_close(g, w.grad, dtype=torch.float32, baseline=b.grad, name=f"d{name}")


# ----------------------------------------------------------------------------------------------
# ALiBi: flash_attention(..., alibi_slopes=...) against attention with an explicit bias matrix


def _alibi_ref(q, k, v, causal):
    from kernels.position.alibi import alibi_attention_ref, alibi_slopes
    slopes = alibi_slopes(q.shape[1]).to(DEVICE)
    return alibi_attention_ref(_wide(q), _wide(k), _wide(v), slopes.to(_wide(q).dtype), causal), slopes


ALIBI_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal
    (2, 4, 2, 37, 37, 32, True),          # GQA, masked tail, several 16-blocks
    (1, 6, 2, 20, 70, 40, True),          # 6 heads: the non-power-of-two slopes; Nq < Nk (decode-like)
    (1, 3, 3, 33, 20, 16, False),         # symmetric bias without the mask; Nq > Nk
    (1, 2, 1, 50, 30, 24, True),          # Nq > Nk: fully masked rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal", ALIBI_CASES)
def test_alibi_forward_and_backward_match_explicit_bias(B, Hq, Hkv, Nq, Nk, D, causal, dtype):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=20)
    want, slopes = _alibi_ref(q, k, v, causal)
    qc, kc, vc = (nan_canary(t, rows=True).requires_grad_() for t in (q, k, v))
    got = flash_attention(qc, kc, vc, causal, alibi_slopes=slopes.float(), block_m=16, block_n=16)
    from kernels.position.alibi import alibi_attention_ref
    base = alibi_attention_ref(q, k, v, slopes.float(), causal).to(dtype)   # PyTorch's result, rounded to dtype
    assert_close(got, want, dtype=dtype, baseline=base, factor=4, name="alibi forward")
    assert not torch.isnan(got).any()
    g = torch.Generator().manual_seed(21)
    do = torch.randn(got.shape, generator=g).to(DEVICE, dtype)
    got.backward(do)
    qw, kw, vw = (_wide(t).requires_grad_() for t in (q, k, v))
    alibi_attention_ref(qw, kw, vw, slopes.to(qw.dtype), causal).backward(_wide(do))
    for name, a, b in (("dq", qc, qw), ("dk", kc, kw), ("dv", vc, vw)):
        assert_close(a.grad, b.grad, dtype=dtype, baseline=b.grad.to(dtype), factor=4, name=f"alibi {name}")


def test_alibi_matches_sdpa_with_a_float_mask():
    """An independent formulation: SDPA with the bias (and -inf above the diagonal) as attn_mask."""
    from kernels.position.alibi import alibi_bias, alibi_slopes
    q, k, v = _qkv(1, 4, 4, 30, 30, 16, torch.float32, seed=22)
    slopes = alibi_slopes(4)
    mask = alibi_bias(slopes, 30, 30).masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), float("-inf"))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    base = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
    assert_close(flash_attention(q, k, v, True, alibi_slopes=slopes.float()), want, dtype=torch.float32, baseline=base)


def test_alibi_without_the_bias_is_caught():
    """HAS_ALIBI off in the forward (plain attention) or only in the backward (P recomputed without it)."""
    q, k, v = _qkv(1, 4, 2, 40, 40, 16, torch.float32, seed=23)
    want, slopes = _alibi_ref(q, k, v, True)
    slopes = slopes.float()
    out, _ = flash_mod._FlashAttention.apply(q, k, v, slopes, True, 0.25, 16, 16, False, True)
    with pytest.raises(MismatchError):
        assert_close(out, want.float())
    qa, qb = q.clone().requires_grad_(), q.clone().requires_grad_()
    flash_mod._FlashAttention.apply(qa, k, v, slopes, True, 0.25, 16, 16, True, True)[0].sum().backward()
    flash_mod._FlashAttention.apply(qb, k, v, slopes, True, 0.25, 16, 16, True, False)[0].sum().backward()
    with pytest.raises(MismatchError):
        assert_close(qb.grad, qa.grad)


def test_alibi_with_zero_slopes_is_plain_attention():
    q, k, v = _qkv(1, 2, 2, 25, 25, 16, torch.float32, seed=24)
    zero = torch.zeros(2, device=DEVICE)
    assert_close(flash_attention(q, k, v, True, alibi_slopes=zero), flash_attention(q, k, v, True), dtype=torch.float32)


def test_alibi_bad_slopes_raise_clear_errors():
    q, k, v = _qkv(1, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \(Hq,\) = \(4,\)"):
        flash_attention(q, k, v, True, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="finite"):
        flash_attention(q, k, v, True, alibi_slopes=torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor"):
        flash_attention(q, k, v, True, alibi_slopes=[0.5] * 4)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time builds, derived by kernels.inspect.launch_job from the launchers' own arguments
# (flash.compile_jobs: meta tensors of an 8192-token fp16 prefill, causal, the GPU tiles)

from kernels import inspect as ki  # noqa: E402

AOT_ARCHS = ("sm80", "sm90")


GEMMA, GEMMA_TAIL = "Gemma-2-9B local prefill", ", D=256, cap 50, window 4096"
SMEM_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}    # the most shared memory one block may have


def _aot_cases():
    # the plain D = 256 builds are compile_jobs' too (the compiler page); the soft-capped, windowed ones
    # hold more registers, so they are the ones this module builds
    cases = {label: job for label, job in flash_mod.compile_jobs().items() if "plain" not in label}
    cases.update({f"Llama-3.2-1B-sized ALiBi prefill {p}, D=64": j
                  for p, j in flash_mod.launch_jobs(32, 8, 64, alibi=True).items()})
    # broken on purpose: dK/dV with 64 x 64 tiles at D = 128 and two stages, what the tile rule avoids
    wide = flash_mod.Tiles(64, 64, 128, 8, 2)
    cases["oversized dkdv 64x64, D=128"] = flash_mod.launch_jobs(32, 8, 128, bwd={"dkdv": wide, "dq": wide})["dkdv"]
    # not the launch: 64 query rows at 8 warps, which splits the keys between warps too
    cases["short fwd 64x64, 8 warps, D=128"] = flash_mod.launch_jobs(32, 8, 128, fwd=flash_mod.Tiles(64, 64, 128, 8, 2))["fwd"]
    return cases


AOT_CASES = _aot_cases()


@pytest.fixture(scope="module")
def aot_builds():
    return dict(zip(AOT_CASES, ki.compile_triton_many(list(AOT_CASES.values()), archs=AOT_ARCHS)))


def test_builds_at_real_sizes_do_not_spill_and_pipeline(aot_builds):
    """Forward, dK/dV and dQ at head dims 64 and 128, with and without ALiBi, and at 256 with Gemma 2's
    soft-cap and window: no spills, no stack, shared memory within the block's limit, K/V (or Q/dO)
    tiles filled by cp.async on sm_80 and sm_90a, tensor cores on both."""
    rows = [(f"{label} {a}", b[a]) for label, b in aot_builds.items() for a in AOT_ARCHS]
    table = ki.resource_table(rows)
    print(table)
    for label, b in rows:
        if label.startswith(("oversized", "short")):
            continue
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, f"{label} spills\n{table}"
        assert b.metadata["shared_bytes"] <= SMEM_LIMIT[label.split()[-1]], f"{label} shared memory\n{table}"
        assert b.async_copies["LDGSTS"] > 0 and b.tensor_core != "-", f"{label}\n{table}"


def test_spill_check_catches_the_oversized_dkdv_tile(aot_builds):
    for a in AOT_ARCHS:
        assert aot_builds["oversized dkdv 64x64, D=128"][a].spills > 0


def test_forward_splits_warps_along_query_rows_only(aot_builds):
    """The default forward (128 rows, 8 warps) lays both products out with warpsPerCTA = [8, 1]: every
    warp owns 16 whole query rows, so the row max and sum need no exchange between warps."""
    import re
    def layouts(label, arch):
        return set(re.findall(r"#ttg\.nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]", aot_builds[label][arch].ttgir))
    for a in AOT_ARCHS:
        assert layouts("Llama-3-8B prefill fwd, D=128", a) == {("8", "1")}, layouts("Llama-3-8B prefill fwd, D=128", a)
        # the check can fail: 64 rows over 8 warps put warps side by side along the columns of a
        # product ([1, 8] on sm_80's mma.sync, [4, 2] for one of sm_90a's two wgmma products)
        short = layouts("short fwd 64x64, 8 warps, D=128", a)
        assert any(cols != "1" for _, cols in short), short


def _product_widths(job, build, arg):
    runtime_args = [n for n, kind in job.signature.items() if kind != "constexpr"]     # in argument order
    return ki.param_product_widths(build, runtime_args.index(arg))


@pytest.mark.parametrize("part", ["fwd", "dkdv", "dq"])
def test_ptx_uses_64bit_products_for_batch_head_and_tile_offsets(aot_builds, part):
    """b * stride_b, h * stride_h and a tile's first row times stride_n are 64-bit in every kernel's
    PTX (a (128, 32, 8192, 128) tensor has 2**32 elements); the offsets inside a tile stay 32-bit,
    which the check tells apart (stride_qm enters both)."""
    label = f"Llama-3-8B prefill {part}, D=128"
    job, build = AOT_CASES[label], aot_builds[label]["sm90"]
    for arg in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_vb", "stride_vh"):
        assert _product_widths(job, build, arg) == {64}, f"{part}: {arg}"
    assert _product_widths(job, build, "stride_qm") == {32, 64}


@triton.jit
def _offset_probe(out_ptr, stride_b, stride_h, WIDE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if WIDE:
        off = flash_mod._head_offset(b, h, stride_b, stride_h)
    else:
        off = b * stride_b + h * stride_h                  # what the kernels computed before: int32
    tl.store(out_ptr + b * tl.num_programs(1) + h, off.to(tl.int64))


def test_head_offsets_are_int64_past_2_31_elements():
    """(128, 32, 8192, 128): head h of batch entry b starts at b * 2**25 + h * 2**20, past 2**31 from
    b = 64 on. The interpreter computes in the kernel's own integer types: int32 wraps there too."""
    B, H, N, D = 128, 32, 8192, 128
    out = torch.zeros(B, H, dtype=torch.int64, device=DEVICE)
    want = (torch.arange(B)[:, None] * (H * N * D) + torch.arange(H)[None, :] * (N * D)).to(torch.int64)
    _offset_probe[(B, H)](out, H * N * D, N * D, WIDE=True)
    assert int(want.max()) > 2**31 and torch.equal(out.cpu(), want)
    _offset_probe[(B, H)](out, H * N * D, N * D, WIDE=False)
    assert int(out.min()) < 0                              # the int32 form wraps: the test can fail


def test_compile_jobs_are_the_launch():
    jobs = flash_mod.compile_jobs()
    fwd = jobs["Llama-3-8B prefill fwd, D=128"]
    assert (fwd.constexprs["BLOCK_M"], fwd.constexprs["BLOCK_N"], fwd.num_warps) == flash_mod.FWD_TILE[128]
    assert fwd.constexprs["HAS_ALIBI"] is False and "slopes_ptr: =None" in fwd.specialization()
    assert jobs["Llama-3-8B-sized ALiBi prefill dq, D=128"].constexprs["HAS_ALIBI"] is True
    dkdv = jobs["Llama-3-8B prefill dkdv, D=128"]
    assert (dkdv.constexprs["BLOCK_M"], dkdv.constexprs["BLOCK_N"], dkdv.num_warps) == flash_mod.DKDV_TILE[128]
    gemma = jobs[f"{GEMMA} dkdv{GEMMA_TAIL}"]
    assert (gemma.constexprs["BLOCK_M"], gemma.constexprs["BLOCK_N"], gemma.num_warps) == flash_mod.DKDV_TILE[256]
    assert gemma.constexprs["SOFTCAP"] and gemma.constexprs["HAS_WINDOW"] and gemma.constexprs["SKIP_OUTSIDE"]
    g27 = jobs["Gemma-2-27B local prefill fwd, D=128, cap 50, window 4096"]
    assert (g27.constexprs["BLOCK_M"], g27.constexprs["BLOCK_N"], g27.num_warps) == flash_mod.OPTION_TILE[("fwd", 128)]
    # what the launcher itself picks at that size is what compile_jobs built (warps included)
    tiles = flash_mod.bwd_tiles(8192, 8192, 256)["dkdv"]
    assert (tiles.block_m, tiles.block_n, tiles.num_warps) == flash_mod.DKDV_TILE[256]


def _free_gpu_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if ON_GPU else 0


@pytest.mark.skipif(_free_gpu_bytes() < 24 * 2**30,
                    reason="needs a CUDA GPU with 24 GiB free: q, k, v, o of 2**31 + 2**25 elements each")
def test_gpu_tensors_past_2_31_elements():
    """B = 65, H = 32, N = 8192, D = 128: the last batch entry starts past 2**31 elements."""
    B, H, N, D = 65, 32, 8192, 128
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    assert q.numel() > 2**31
    out = flash_attention(q, k, v, True)
    last = attention_ref(q[-1:, :2], k[-1:, :2], v[-1:, :2], True)
    assert_close(out[-1:, :2], last, dtype=torch.float16, baseline=attention_ref(q[-1:, :2], k[-1:, :2], v[-1:, :2],
                                                                                 True, upcast=False))


# ----------------------------------------------------------------------------------------------
# Gemma 2's score soft-cap and the sliding window: flash_attention(..., softcap=, window=)


def _grads(fn, q, k, v, do):
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ins)
    return (out, *torch.autograd.grad(out, ins, do))


def _check_options(q, k, v, causal, softcap, window, name):
    """Forward and backward against attention_ref with the same options (fp32 or fp64 from the same
    inputs), within the FlashAttention rule against PyTorch's own low-precision result; NaN canaries."""
    dtype = q.dtype
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(31)).to(DEVICE, dtype)
    got = _grads(lambda a, b, c: flash_attention(nan_canary(a, rows=True), nan_canary(b, rows=True),
                                                 nan_canary(c, rows=True), causal, softcap=softcap, window=window,
                                                 block_m=16, block_n=16), q, k, v, do)
    want = _grads(lambda a, b, c: attention_ref(a, b, c, causal, softcap=softcap, window=window),
                  *(_wide(t) for t in (q, k, v)), _wide(do))
    base = _grads(lambda a, b, c: attention_ref(a, b, c, causal, softcap=softcap, window=window, upcast=False),
                  q, k, v, do)
    for part, g, w, b in zip(("o", "dq", "dk", "dv"), got, want, base):
        assert not torch.isnan(g).any(), f"{name} {part}: a canary was read"
        assert_close(g, w, dtype=dtype, baseline=b, name=f"{name} {part}")


OPTION_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, causal, softcap, window
    (1, 2, 2, 1, 1, 16, True, 5.0, 1),          # length 1, window 1
    (1, 4, 2, 37, 37, 32, True, 2.0, None),     # a strong cap (scores of a few units), GQA, masked tail
    (1, 2, 1, 20, 45, 16, False, 50.0, None),   # Gemma 2's cap, not causal, Nq < Nk
    (1, 4, 2, 37, 37, 32, True, None, 5),       # window smaller than a block, several blocks
    (1, 2, 1, 20, 45, 24, True, None, 17),      # Nq < Nk: the window is aligned bottom-right
    (1, 2, 1, 45, 20, 16, True, None, 6),       # Nq > Nk: fully masked rows
    (1, 2, 2, 30, 30, 16, True, None, 100),     # window >= seq: causal attention
    (1, 2, 1, 40, 40, 32, True, 3.0, 20),       # both, MQA
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,softcap,window", OPTION_CASES)
def test_softcap_and_window_match_reference(B, Hq, Hkv, Nq, Nk, D, causal, softcap, window, dtype):
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=30, scale=3.0)    # scores of several units: the cap bites
    _check_options(q, k, v, causal, softcap, window, name=f"cap {softcap} window {window}")


def test_window_one_is_each_querys_own_value():
    """Window 1: query i sees key i alone, so O = V, dV = dO (summed over the group) and dQ, dK are zero in
    exact arithmetic (P = 1, dP - D = dO.V - dO.O = 0). The kernel's dQ, dK are rounding: P = exp2(S - lse)
    is 1 to a few ulp, times dP of a few units."""
    q, k, v = _qkv(1, 4, 2, 33, 33, 16, torch.float32, seed=40)
    do = torch.randn(1, 4, 33, 16, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    o, dq, dk, dv = _grads(lambda a, b, c: flash_attention(nan_canary(a, rows=True), nan_canary(b, rows=True),
                                                           nan_canary(c, rows=True), True, window=1, block_m=16,
                                                           block_n=16), q, k, v, do)
    assert_close(o, v.repeat_interleave(2, dim=1))
    assert_close(dv, do.reshape(1, 2, 2, 33, 16).sum(dim=2))
    assert float(dq.abs().max()) < 1e-5 and float(dk.abs().max()) < 1e-5
    causal_dq = _grads(lambda a, b, c: flash_attention(a, b, c, True), q, k, v, do)[1]
    assert float(causal_dq.abs().max()) > 0.1             # without the window the same dQ is not small


def test_softcap_head_dim_256():
    q, k, v = _qkv(1, 2, 1, 20, 33, 256, torch.float32, seed=32, scale=3.0)
    _check_options(q, k, v, True, 10.0, 9, name="D=256")


def test_softcap_reference_is_gemma2s_formula():
    """attention_ref's cap is softcap * tanh(S / softcap) before the mask, S = sm_scale Q K^T: SDPA on the
    capped scores as a float mask (with -inf above the diagonal) gives the same."""
    q, k, v = (t.double() for t in _qkv(1, 2, 2, 12, 12, 8, torch.float32, seed=33, scale=4.0))
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    capped = 5.0 * torch.tanh(s / 5.0)
    bias = (capped - s).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    assert_close(attention_ref(q, k, v, True, softcap=5.0), F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_softcap_in_log2_units_is_caught():
    """Capping the scores after the log2(e) scaling (cap tanh(S log2 e / cap), a cap of cap / log2 e in
    natural units) is a plausible slip in an exp2 kernel: the check rejects it."""
    q, k, v = _qkv(1, 2, 2, 30, 30, 16, torch.float32, seed=34, scale=3.0)
    want = attention_ref(q.double(), k.double(), v.double(), True, softcap=2.0)
    base = attention_ref(q, k, v, True, softcap=2.0, upcast=False)
    bad, _ = flash_mod._forward(q, k, v, True, 0.25, softcap=2.0, cap_units=1.0)
    with pytest.raises(MismatchError):
        assert_close(bad, want, dtype=torch.float32, baseline=base)
    good, _ = flash_mod._forward(q, k, v, True, 0.25, softcap=2.0)
    assert_close(good, want, dtype=torch.float32, baseline=base)


@pytest.mark.parametrize("Nq,Nk,window", [(40, 40, 7), (25, 60, 16), (60, 25, 3), (33, 33, 1), (20, 20, 64)])
def test_window_matches_sdpa_with_a_boolean_mask(Nq, Nk, window):
    """fp32 against torch.nn.functional.scaled_dot_product_attention with the equivalent boolean mask,
    forward and backward (rows that see no key: SDPA gives NaN there, the kernel 0, so they are compared
    only where a key is visible)."""
    q, k, v = _qkv(1, 4, 2, Nq, Nk, 24, torch.float32, seed=35)
    i = torch.arange(Nq, device=DEVICE)[:, None] + Nk - Nq
    j = torch.arange(Nk, device=DEVICE)[None, :]
    mask = (j <= i) & (j > i - window)                   # (Nq, Nk) True = attend
    rows = mask.any(dim=1)
    do = torch.randn(1, 4, Nq, 24, generator=torch.Generator().manual_seed(36)).to(DEVICE)

    def sdpa(a, b, c):
        out = F.scaled_dot_product_attention(a, b, c, attn_mask=mask, enable_gqa=True)
        return torch.where(rows[:, None], out, torch.zeros((), dtype=out.dtype))
    got = _grads(lambda a, b, c: flash_attention(a, b, c, True, window=window, block_m=16, block_n=16), q, k, v, do)
    want = _grads(sdpa, q.double(), k.double(), v.double(), do.double())
    base = _grads(sdpa, q, k, v, do)
    for part, g, w, b in zip(("o", "dq", "dk", "dv"), got, want, base):
        assert_close(g, w, dtype=torch.float32, baseline=b, name=f"window {window} {part}")


def test_window_skips_the_tiles_outside_it():
    """One block of 16 queries at the end of 100 keys, window 20: they see keys 65..99, in the tiles
    from 64 on. Keys (and values) 0..63 are NaN: a kernel that read them and masked them afterwards
    would multiply NaN values by zero weights (NaN), so a finite result that matches shows the loop
    never reached them. The backward's dK/dV programs for those keys loop over no query (their gradients
    are exactly 0) and dQ's loop starts at 64. With the skip switched off the same inputs give NaN."""
    q, k, v = _qkv(1, 2, 1, 16, 100, 16, torch.float32, seed=37)
    ref_inputs = (q.double(), k.double(), v.double())
    k, v = k.clone(), v.clone()
    k[:, :, :64] = float("nan")
    v[:, :, :64] = float("nan")
    do = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(38)).to(DEVICE)
    o, lse = flash_mod._forward(q, k, v, True, 0.25, window=20, block_m=16, block_n=16)
    want = attention_ref(*ref_inputs, True, sm_scale=0.25, window=20)
    assert_close(o, want.float(), dtype=torch.float32, baseline=want.float())
    dq, dk, dv = flash_mod._backward(do, q, k, v, o, lse, True, 0.25, window=20, block_m=16, block_n=16)
    assert torch.isfinite(dq).all() and torch.isfinite(dk[:, :, 64:]).all() and torch.isfinite(dv[:, :, 64:]).all()
    assert not dk[:, :, :64].any() and not dv[:, :, :64].any()
    wide = [t.clone().requires_grad_() for t in ref_inputs]
    wq, wk, wv = torch.autograd.grad(attention_ref(*wide, True, sm_scale=0.25, window=20), wide, do.double())
    assert_close(dq, wq.float(), dtype=torch.float32, baseline=wq.float())
    assert_close(dk[:, :, 64:], wk[:, :, 64:].float(), dtype=torch.float32, baseline=wk[:, :, 64:].float())
    # the broken variant: the mask alone (every tile read) is exact on clean keys but reads the NaN
    masked_only, lse_m = flash_mod._forward(q, k, v, True, 0.25, window=20, block_m=16, block_n=16, skip_outside=False)
    assert torch.isnan(masked_only).all()
    dq_m, dk_m, _ = flash_mod._backward(do, q, k, v, o, lse, True, 0.25, window=20, block_m=16, block_n=16,
                                        skip_outside=False)
    assert torch.isnan(dq_m).all() and torch.isnan(dk_m[:, :, :64]).all()


def test_window_off_by_one_is_caught():
    """A window one key too wide (j >= i' - W instead of j > i' - W) fails the check; window 1 against 2
    is the starkest case."""
    q, k, v = _qkv(1, 2, 2, 30, 30, 16, torch.float32, seed=39)
    for w in (1, 8):
        want = attention_ref(q.double(), k.double(), v.double(), True, window=w)
        base = attention_ref(q, k, v, True, window=w, upcast=False)
        with pytest.raises(MismatchError):
            assert_close(flash_attention(q, k, v, True, window=w + 1), want, dtype=torch.float32, baseline=base)
        assert_close(flash_attention(q, k, v, True, window=w), want, dtype=torch.float32, baseline=base)


def test_softcap_and_window_bad_values_raise_clear_errors():
    q, k, v = _qkv(1, 4, 2, 8, 8, 16, torch.float32)
    for cap in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            flash_attention(q, k, v, True, softcap=cap)
    with pytest.raises(ValueError, match="softcap with alibi_slopes"):
        flash_attention(q, k, v, True, softcap=50.0, alibi_slopes=torch.ones(4))
    for w in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            flash_attention(q, k, v, True, window=w)
    with pytest.raises(ValueError, match="window needs causal=True"):
        flash_attention(q, k, v, False, window=4)
