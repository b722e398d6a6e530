"""kernels.position.rope: the fused RoPE kernel against its reference, an independent complex-number
formulation and transformers' apply_rotary_pos_emb; layouts, GQA, per-token positions, gradients,
bad inputs, broken variants, and the sm_90a build at Llama-sized heads."""
import kernels  # noqa: F401  (before triton)

import importlib

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.position import rope, rope_cos_sin, rope_frequencies, rope_ref
from kernels.testing import MismatchError, assert_close, nan_canary

rope_mod = importlib.import_module("kernels.position.rope")   # the module (the package's `rope` is the function)
DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()


def _case(B, T, Hq, Hkv, D, dtype=torch.float32, S=64, seed=0, positions="ids"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    cos, sin = rope_cos_sin(rope_frequencies(D)[0], S)
    if positions == "ids":
        pos = torch.randint(0, S, (B, T), generator=g).to(DEVICE)
    elif positions == "row":
        pos = torch.arange(S - T, S, device=DEVICE)               # one (T,) row at an offset: a decode window
    else:
        pos = None
    return q, k, cos, sin, pos


def complex_rope(x, inv_freq, pos, interleaved):
    """x (B, T, H, D) rotated as complex numbers x_a + i x_b times e^{i p theta}, in float64."""
    D = x.shape[-1]
    x = x.double()
    if interleaved:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], D // 2, 2).contiguous())
    else:
        z = torch.complex(x[..., : D // 2], x[..., D // 2:])
    rot = torch.exp(1j * pos.double()[..., None, None] * inv_freq.double())        # (B, T, 1, D/2)
    w = z * rot
    if interleaved:
        return torch.view_as_real(w).reshape(x.shape)
    return torch.cat([w.real, w.imag], dim=-1)


CASES = [
    # B, T,  Hq, Hkv, D
    (2, 13, 4, 2, 64),      # GQA, few tokens
    (1, 9, 6, 6, 40),       # MHA, D/2 = 20 not a power of two (masked pair lanes)
    (3, 5, 8, 1, 128),      # MQA at Llama's head dim
    (1, 1, 3, 1, 2),        # one token, one pair
]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", CASES)
def test_matches_reference(B, T, Hq, Hkv, D, dtype, interleaved):
    q, k, cos, sin, pos = _case(B, T, Hq, Hkv, D, dtype)
    qo, ko = rope(nan_canary(q), nan_canary(k), cos, sin, pos, interleaved=interleaved)
    qr, kr = rope_ref(q, k, cos, sin, pos, interleaved=interleaved)
    assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    assert_close(qo, qr, name="q")
    assert_close(ko, kr, name="k")


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_reference_matches_complex_multiplication(interleaved):
    """An independent formulation: pairs as complex numbers times e^{i p theta} (float64)."""
    q, k, cos, sin, pos = _case(2, 7, 4, 2, 24, torch.float64)
    inv_freq = rope_frequencies(24)[0]
    cos64, sin64 = rope_cos_sin(inv_freq, 64, dtype=torch.float64)
    qr, kr = rope_ref(q, k, cos64, sin64, pos, interleaved=interleaved)
    assert_close(qr.double(), complex_rope(q, inv_freq, pos, interleaved), dtype=torch.float32)
    assert_close(kr.double(), complex_rope(k, inv_freq, pos, interleaved), dtype=torch.float32)


def test_matches_transformers_apply_rotary_pos_emb():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k, cos, sin, pos = _case(2, 11, 4, 2, 32)
    c, s = torch.cat([cos[pos], cos[pos]], -1), torch.cat([sin[pos], sin[pos]], -1)   # HF: (B, T, D)
    hq, hk = llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), c, s)    # (B, H, T, D)
    qo, ko = rope(q, k, cos, sin, pos)
    assert_close(qo, hq.transpose(1, 2))
    assert_close(ko, hk.transpose(1, 2))


def test_wrong_layout_is_caught():
    """The interleaved kernel on half-split weights is a different function: the check rejects it."""
    q, k, cos, sin, pos = _case(1, 6, 2, 2, 16)
    qo, ko = rope(q, k, cos, sin, pos, interleaved=True)
    qr, _ = rope_ref(q, k, cos, sin, pos, interleaved=False)
    with pytest.raises(MismatchError):
        assert_close(qo, qr)


def test_scores_depend_only_on_the_offset():
    """q_m . k_n after rotation equals q_{m+s} . k_{n+s} for every shift s (float64)."""
    q, k, _, _, _ = _case(1, 1, 1, 1, 32, torch.float64)
    cos, sin = rope_cos_sin(rope_frequencies(32)[0], 300, dtype=torch.float64)
    scores = []
    for shift in (0, 5, 117, 250):
        pq = torch.tensor([[shift + 40]])
        pk = torch.tensor([[shift + 3]])
        rq, _ = rope_ref(q, k, cos, sin, pq)
        _, rk = rope_ref(q, k, cos, sin, pk)
        scores.append(float((rq * rk).sum()))
    assert max(scores) - min(scores) < 1e-9


@pytest.mark.parametrize("positions", ["ids", "row", None])
def test_position_forms(positions):
    """(B, T) ids (packed sequences), one (T,) row at an offset (decode), and the default 0..T-1."""
    q, k, cos, sin, pos = _case(2, 10, 4, 2, 32, positions=positions)
    qo, ko = rope(q, k, cos, sin, pos)
    qr, kr = rope_ref(q, k, cos, sin, pos)
    assert_close(qo, qr)
    assert_close(ko, kr)


def test_packed_sequences_restart_at_zero():
    """Two sequences packed in one row (positions 0..5, 0..3) equal each one alone."""
    q, k, cos, sin, _ = _case(1, 10, 2, 1, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]], device=DEVICE)
    qo, ko = rope(q, k, cos, sin, pos)
    q2, k2 = rope(q[:, 6:].contiguous(), k[:, 6:].contiguous(), cos, sin)
    assert_close(qo[:, 6:], q2)
    assert_close(ko[:, 6:], k2)


def test_strided_views_of_bhtd_tensors():
    """A (B, H, T, D) tensor passed as its (B, T, H, D) transpose: strides, not copies."""
    q, k, cos, sin, pos = _case(2, 9, 4, 2, 32)
    qv = nan_canary(q.transpose(1, 2).contiguous()).transpose(1, 2)
    kv = nan_canary(k.transpose(1, 2).contiguous()).transpose(1, 2)
    assert not qv.is_contiguous()
    qo, ko = rope(qv, kv, cos, sin, pos)
    assert_close(qo, rope_ref(q, k, cos, sin, pos)[0])
    assert_close(ko, rope_ref(q, k, cos, sin, pos)[1])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_gradients(interleaved):
    q, k, cos, sin, pos = _case(2, 7, 4, 2, 24)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = rope(q1, k1, cos, sin, pos, interleaved=interleaved)
    torch.autograd.backward((qo, ko), (gq, gk))
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    qr, kr = rope_ref(q2, k2, cos, sin, pos, interleaved=interleaved)
    torch.autograd.backward((qr, kr), (gq, gk))
    assert_close(q1.grad, q2.grad, name="dq")
    assert_close(k1.grad, k2.grad, name="dk")


def test_backward_without_the_sign_flip_is_caught():
    """Rotating the gradient by +angle instead of -angle (the forgotten transpose) is wrong."""
    q, k, cos, sin, pos = _case(1, 6, 2, 1, 16)
    g = torch.randn_like(q)
    q1 = q.clone().requires_grad_()
    qo, _ = rope_mod._Rope.apply(q1, k, cos, sin, pos, False, False)      # CONJUGATE off in the backward
    (qo * g).sum().backward()
    q2 = q.clone().requires_grad_()
    (rope_ref(q2, k, cos, sin, pos)[0] * g).sum().backward()
    with pytest.raises(MismatchError):
        assert_close(q1.grad, q2.grad)


def test_frequencies_match_the_tiny_gpt():
    """theta_i = 10000^(-2i/D) as kernels.model.gpt computes them."""
    inv_freq, factor = rope_frequencies(32, 10000.0)
    assert factor == 1.0 and inv_freq.shape == (16,)
    assert_close(inv_freq.float(), 10000.0 ** (-torch.arange(0, 16, dtype=torch.float32) * 2 / 32))


def test_bad_inputs_raise_clear_errors():
    q, k, cos, sin, pos = _case(1, 4, 2, 1, 16, S=8)
    with pytest.raises(ValueError, match="must be even"):
        rope(q[..., :15], k[..., :15], cos, sin, pos)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 8\)"):
        rope(q, k, cos, sin, pos + 8)
    with pytest.raises(ValueError, match="exceed the 8 rows"):
        rope(torch.randn(1, 9, 2, 16), torch.randn(1, 9, 1, 16), cos, sin)
    with pytest.raises(ValueError, match="same shape"):
        rope(q, k, cos, sin[:4], pos)
    with pytest.raises(ValueError, match=r"\(S, D/2\)"):
        rope(q, k, cos[:, :4], sin[:, :4], pos)
    with pytest.raises(ValueError, match="positions must be"):
        rope(q, k, cos, sin, pos[:, :3])
    with pytest.raises(TypeError, match="integer tensor"):
        rope(q, k, cos, sin, pos.float())
    with pytest.raises(TypeError, match="dtype"):
        rope(q.double(), k.double(), cos, sin, pos)
    with pytest.raises(ValueError, match="B, T and D must match"):
        rope(q, k[:, :3], cos, sin, pos)
    with pytest.raises(ValueError, match="4-D"):
        rope(q[0], k, cos, sin, pos)
    with pytest.raises(ValueError, match="even integer"):
        rope_frequencies(15)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time build at Llama-sized heads: 32 query heads, 8 K/V heads (Llama-3-8B), D = 128


def _job(dtype, Hq, Hkv, D, interleaved):
    """The launch rope makes for one 8192-token sequence, on meta tensors (Triton's own specialisation)."""
    return rope_mod.launch_job(Hq, Hkv, D, dtype={"fp16": torch.float16, "bf16": torch.bfloat16}[dtype],
                               interleaved=interleaved)


AOT_CASES = {
    "fp16, Hq 32, Hkv 8, D 128, half": _job("fp16", 32, 8, 128, False),
    "bf16, Hq 32, Hkv 8, D 128, interleaved": _job("bf16", 32, 8, 128, True),
    "fp16, Hq 64, Hkv 8, D 128, half": _job("fp16", 64, 8, 128, False),
}


def test_sm90_builds_at_llama_heads_do_not_spill():
    builds = ki.compile_triton_many(list(AOT_CASES.values()), archs=("sm90",))
    table = ki.resource_table([(label, b["sm90"]) for label, b in zip(AOT_CASES, builds)])
    print(table)
    for label, b in zip(AOT_CASES, builds):
        build = b["sm90"]
        assert build.arch.nvcc_arch == "sm_90a"
        assert build.spills == 0 and build.metadata["stack_bytes"] == 0, f"{label} spills\n{table}"
        # 64-bit offsets: the token index is widened before it multiplies a stride
        assert "mul.wide" in build.ptx or "mul.lo.s64" in build.ptx
