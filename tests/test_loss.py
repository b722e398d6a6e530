"""kernels.model.lm_head: fused cross-entropy (forward + backward) and the chunked LM-head loss."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import rows, runtime
from kernels import inspect as ki
from kernels.model import lm_head
from kernels.model.lm_head import (
    _ce_rows, aot_job, chunk_rows, cross_entropy, cross_entropy_ref, fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref, launch_config,
)
from kernels.tensor_memory import TensorPeak
from kernels.model.lm_head_memory import tensor_peak_bytes
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()


def _logits(N, V, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, V, generator=g) * scale).to(DEVICE, dtype)


def _targets(N, V, seed=1, ignore_every=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    if ignore_every:
        t[::ignore_every] = -100
    return t


def _loss_and_grad(fn, x, t, g_out=None, **kw):
    x = x.detach().clone().requires_grad_()
    loss = fn(x, t, **kw)
    g_out = torch.ones_like(loss) if g_out is None else g_out
    (dx,) = torch.autograd.grad(loss, x, g_out)
    return loss, dx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,V", [(1, 1), (5, 7), (37, 300), (9, 5000), (3, 4096)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_torch(N, V, dtype, smoothing):
    _check_cross_entropy(N, V, dtype, smoothing, "mean")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_cross_entropy_reductions(dtype, reduction):
    _check_cross_entropy(37, 300, dtype, 0.1, reduction)


def _check_cross_entropy(N, V, dtype, smoothing, reduction):
    x = _logits(N, V, dtype)
    t = _targets(N, V, ignore_every=3 if N > 3 else 0)
    g_out = torch.rand(N, device=DEVICE) if reduction == "none" else None
    got, dgot = _loss_and_grad(cross_entropy, nan_canary(x), t, g_out, label_smoothing=smoothing, reduction=reduction)
    ref, dref = _loss_and_grad(F.cross_entropy, x.double(), t, None if g_out is None else g_out.double(),
                               label_smoothing=smoothing, reduction=reduction)
    base, dbase = _loss_and_grad(lambda a, b, **k: F.cross_entropy(a, b, **k).to(torch.float32), x, t, g_out,
                                 label_smoothing=smoothing, reduction=reduction)
    assert got.dtype == torch.float32 and dgot.dtype == dtype
    # the loss is fp32 from fp32 arithmetic whatever the logits' dtype: check it at fp32 tolerance
    # (with the baseline rule for the sum over rows)
    assert_close(got, ref.float(), dtype=torch.float32, baseline=base.float(), factor=4.0, name="loss")
    assert_close(dgot, dref, dtype=dtype, baseline=dbase, name="dlogits")


def test_gradient_is_softmax_minus_onehot():
    x = _logits(6, 11, torch.float32)
    t = _targets(6, 11)
    _, dx = _loss_and_grad(cross_entropy, x, t, reduction="sum")
    assert_close(dx, torch.softmax(x, -1) - F.one_hot(t, 11).float())


def test_ignore_index_everywhere_in_a_row_and_everywhere():
    x = _logits(4, 9, torch.float32)
    t = torch.tensor([-100, 3, -100, 8], device=DEVICE)
    loss, dx = _loss_and_grad(cross_entropy, x, t)
    ref, dref = _loss_and_grad(F.cross_entropy, x, t)
    assert_close(loss, ref)
    assert_close(dx, dref)
    assert torch.equal(dx[0], torch.zeros(9, device=DEVICE)) and torch.equal(dx[2], torch.zeros(9, device=DEVICE))
    # every row ignored: PyTorch's mean is 0/0 = NaN; so is ours, and no gradient flows
    t_all = torch.full((4,), -100, device=DEVICE)
    loss, dx = _loss_and_grad(cross_entropy, x, t_all)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x, t_all))
    assert torch.equal(dx, torch.zeros_like(dx))
    # a custom ignore_index
    t7 = torch.tensor([7, 3, 7, 8], device=DEVICE)
    assert_close(cross_entropy(x, t7, ignore_index=7), F.cross_entropy(x, t7, ignore_index=7))


def test_three_dimensional_logits_and_int32_targets():
    x = _logits(2 * 5, 13, torch.float32).view(2, 5, 13)
    t = _targets(10, 13).view(2, 5)
    assert_close(cross_entropy(x, t.int()), F.cross_entropy(x.flatten(0, 1), t.flatten()))
    assert_close(cross_entropy(x, t, reduction="none"), F.cross_entropy(x.flatten(0, 1), t.flatten(), reduction="none").view(2, 5))


def test_large_logits_and_minus_inf_entries():
    x = _logits(4, 50, torch.float32, scale=1.0) * 1000
    x[1, 10:] = float("-inf")
    t = torch.tensor([0, 3, 49, 7], device=DEVICE)
    loss, dx = _loss_and_grad(cross_entropy, x, t, reduction="none")
    ref, dref = _loss_and_grad(F.cross_entropy, x, t, reduction="none")
    assert torch.isfinite(loss).all()
    assert_close(loss, ref)
    assert_close(dx, dref)


def test_reference_matches_torch():
    x = _logits(17, 40, torch.float32)
    t = _targets(17, 40, ignore_every=4)
    for ls in (0.0, 0.2):
        assert_close(cross_entropy_ref(x, t, label_smoothing=ls), F.cross_entropy(x, t, label_smoothing=ls))


def test_broken_variant_without_max_subtraction_is_caught():
    """exp(x) without subtracting the row max overflows for logits near 100 in fp32."""
    x = _logits(8, 64, torch.float32) + 100.0
    t = _targets(8, 64)
    loss_rows = _ce_rows(x, t, -100, 0.0, 1.0, subtract_max=False)
    with pytest.raises(MismatchError):
        assert_close(loss_rows, F.cross_entropy(x, t, reduction="none"), name="cross-entropy without the max")
    good = _ce_rows(x, t, -100, 0.0, 1.0)
    assert_close(good, F.cross_entropy(x, t, reduction="none"))


def test_cross_entropy_bad_inputs():
    x = torch.randn(4, 9, device=DEVICE)
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(x, torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        cross_entropy(x, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"target values must be in \[0, 9\)"):
        cross_entropy(x, torch.tensor([0, 1, 9, 2], device=DEVICE))
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(x, torch.zeros(4, dtype=torch.long, device=DEVICE), label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, torch.zeros(4, dtype=torch.long, device=DEVICE), reduction="avg")
    with pytest.raises(TypeError, match="logits have dtype"):
        cross_entropy(x.long(), torch.zeros(4, dtype=torch.long, device=DEVICE))


# ---------------------------------------------------------------- z-loss and soft-capping

TERMS = [{"z_loss": 1e-2}, {"softcap": 5.0}, {"z_loss": 1e-2, "softcap": 5.0, "label_smoothing": 0.1}]


def _check_terms(fn, N, V, dtype, terms):
    """``fn`` (the kernel, or a broken stand-in) against cross_entropy_ref in float64 with the same terms,
    loss and gradient, the reference in fp32 as the baseline. Logits of spread 20 put many of them
    beyond a cap of 5, where the cap's derivative is far from 1, and make lse large for the z-loss."""
    x = _logits(N, V, dtype, scale=20.0)
    t = _targets(N, V, ignore_every=3 if N > 3 else 0)
    got, dgot = _loss_and_grad(fn, nan_canary(x), t, **terms)
    ref, dref = _loss_and_grad(cross_entropy_ref, x.double(), t, **terms)
    base, dbase = _loss_and_grad(cross_entropy_ref, x.float(), t, **terms)
    assert_close(got, ref.float(), dtype=torch.float32, baseline=base, factor=4.0, name="loss")
    assert_close(dgot, dref, dtype=dtype, baseline=dbase.to(dtype), name="dlogits")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,V", [(1, 1), (37, 300), (5, 4097)])
@pytest.mark.parametrize("terms", TERMS, ids=lambda t: "+".join(t))
def test_z_loss_and_softcap_match_the_reference(N, V, dtype, terms):
    _check_terms(cross_entropy, N, V, dtype, terms)


def test_reference_terms_match_their_definitions():
    """The reference's z-loss is w lse^2 on top of PyTorch's loss, its cap is Gemma 2's tanh cap, and
    autograd through it gives ((1 + 2 w lse) softmax(c) - onehot) (1 - (c / cap)^2)."""
    x = _logits(6, 40, torch.float64, scale=20.0).requires_grad_()
    t = _targets(6, 40)
    w, cap = 1e-2, 5.0
    assert_close(cross_entropy_ref(x, t, z_loss=w), F.cross_entropy(x, t) + w * (torch.logsumexp(x, -1) ** 2).mean())
    c = cap * torch.tanh(x / cap)
    assert_close(cross_entropy_ref(x, t, softcap=cap), F.cross_entropy(c, t))
    (grad,) = torch.autograd.grad(cross_entropy_ref(x, t, z_loss=w, softcap=cap, reduction="sum"), x)
    lse_c = torch.logsumexp(c, -1, keepdim=True)
    formula = ((1 + 2 * w * lse_c) * torch.softmax(c, -1) - F.one_hot(t, 40)) * (1 - (c / cap) ** 2)
    assert_close(grad, formula)


def _terms_only_in_forward(logits, target, z_loss=0.0, softcap=None, label_smoothing=0.0):
    """Broken on purpose: the loss has the extra terms, the gradient is the plain loss's on the capped
    logits (no (1 + 2 w lse) factor, no dc/dx): the value of one, the slope of the other."""
    c = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    c_identity = c.detach() + (logits - logits.detach())          # value c, gradient passed through as 1
    plain = cross_entropy_ref(c_identity, target, label_smoothing=label_smoothing)
    full = cross_entropy_ref(logits, target, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    return plain + (full - plain).detach()


@pytest.mark.parametrize("terms", TERMS[:2], ids=lambda t: "+".join(t))
def test_a_gradient_without_the_terms_is_caught(terms):
    with pytest.raises(MismatchError, match="dlogits"):
        _check_terms(_terms_only_in_forward, 37, 300, torch.float32, terms)


def test_fused_linear_with_z_loss_and_softcap():
    h, w = _flce_case(37, 24, 300, torch.float32)
    t = _targets(37, 300, ignore_every=5)
    terms = {"z_loss": 1e-2, "softcap": 2.0}
    got = _flce_grads(fused_linear_cross_entropy, h * 4, w, t, chunk_size=8, **terms)
    ref = _flce_grads(fused_linear_cross_entropy_ref, h.double() * 4, w.double(), t, **terms)
    base = _flce_grads(fused_linear_cross_entropy_ref, h * 4, w, t, **terms)
    for label, a, e, b in zip(["loss", "dhidden", "dweight"], got, ref, base):
        assert_close(a, e.float(), dtype=torch.float32, baseline=b, factor=4.0, name=label)


def test_terms_bad_inputs():
    x = torch.randn(4, 9, device=DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=DEVICE)
    for bad in (-1e-4, float("nan"), float("inf"), "1e-4"):
        with pytest.raises(ValueError, match="z_loss must be"):
            cross_entropy(x, t, z_loss=bad)
    for bad in (0.0, -30.0, float("inf")):
        with pytest.raises(ValueError, match="softcap must be"):
            cross_entropy(x, t, softcap=bad)
    h, w = _flce_case(4, 8, 9, torch.float32)
    with pytest.raises(ValueError, match="fused_linear_cross_entropy: softcap"):
        fused_linear_cross_entropy(h, w, t, softcap=0.0)


# ---------------------------------------------------------------- the soft-cap's tanh against float64

@triton.jit
def _elementwise_kernel(x_ptr, y_ptr, n, cap, FN: tl.constexpr, BLOCK: tl.constexpr):
    """y = FN(x) over a flat tensor: "tanh" (kernels.rows.tanh), "softcap" (the loss kernel's
    cap * tanh(x / cap)) or "sigmoid_softcap" (the former cap * (2 sigmoid(2x / cap) - 1), broken)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if FN == "tanh":
        y = rows.tanh(x)
    elif FN == "softcap":
        y = lm_head._softcap(x, cap, 1.0 / cap)
    else:
        y = _sigmoid_softcap(x, cap, 1.0 / cap)
    tl.store(y_ptr + offs, y, mask=offs < n)


@triton.jit
def _sigmoid_softcap(x, cap, inv_cap):
    """The former soft-cap, tanh(u) = 2 sigmoid(2u) - 1: 2 sigmoid(2u) is near 1 for small u, and
    subtracting 1 keeps only its absolute precision (broken on purpose)."""
    return cap * (2.0 * tl.sigmoid(2.0 * x * inv_cap) - 1.0)


def _elementwise(x: torch.Tensor, fn: str, cap: float = 1.0) -> torch.Tensor:
    y = torch.empty_like(x)
    _elementwise_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), cap, FN=fn, BLOCK=4096)
    return y


def _max_err(y: torch.Tensor, ref: torch.Tensor, relative: bool = False) -> float:
    err = (y.double() - ref).abs()
    return float((err / ref.abs() if relative else err).max())


def test_tanh_matches_float64_at_small_and_large_u():
    """Small u (1e-7 to 0.55, both signs): the relative error, where 2 sigmoid(2u) - 1 fails, within 2x
    torch.tanh's fp32 error. Large u (0.55 to 20): within 2 units in the last place (2**-22 relative;
    torch.tanh is correctly rounded there, 0.5 unit, and 2 units is the accuracy CUDA's tanhf documents).
    The ends: tanh(+-0) = 0, tanh(+-inf) = +-1, NaN stays NaN."""
    small = torch.logspace(-7, -0.26, 1500)                     # up to 0.55
    large = torch.linspace(0.55, 20.0, 1500)
    for u, rel in ((torch.cat([small, -small]), True), (torch.cat([large, -large]), False)):
        ref = torch.tanh(u.double())
        ours, torch_err = _max_err(_elementwise(u, "tanh"), ref, rel), _max_err(torch.tanh(u), ref, rel)
        if rel:
            assert ours <= 2 * torch_err, (ours, torch_err)
        else:
            assert _max_err(_elementwise(u, "tanh"), ref, relative=True) <= 2.0 ** -22, ours
    ends = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    got = _elementwise(ends, "tanh")
    assert got[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and torch.isnan(got[4])


SOFTCAP = 30.0   # Gemma 2's final-logit cap (hf2025gemma2config)


def _softcap_errors(fn: str) -> dict:
    """Max error against float64 of the capped logits (spreads 1 and 30: u ~ 0.03 and u ~ 1) and of the
    cross-entropy gradient at V = 8 (seed 1234), for ``fn`` and for PyTorch's fp32 30 tanh(x / 30)."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for spread in (1.0, 30.0):
        x = torch.randn(4096, generator=g) * spread
        ref = SOFTCAP * torch.tanh(x.double() / SOFTCAP)
        out[f"logits, spread {spread:g}"] = (_max_err(_elementwise(x, fn, SOFTCAP), ref),
                                             _max_err(SOFTCAP * torch.tanh(x / SOFTCAP), ref))
    x, t = torch.randn(4, 8, generator=g), torch.randint(0, 8, (4,), generator=g)
    torch_ce = lambda z, t: F.cross_entropy(SOFTCAP * torch.tanh(z / SOFTCAP), t)     # noqa: E731
    _, d_ref = _loss_and_grad(torch_ce, x.double(), t)
    _, d_torch = _loss_and_grad(torch_ce, x, t)
    _, d_ours = _loss_and_grad(lambda z, t: cross_entropy(z, t, softcap=SOFTCAP), x, t)
    out["gradient, V = 8"] = (_max_err(d_ours, d_ref), _max_err(d_torch, d_ref))
    return out


def test_softcap_is_within_twice_pytorchs_fp32_error():
    """The soft-cap (the helper inside the loss kernel) and the loss's gradient against float64, each
    within 2x the error of PyTorch's own fp32 30 tanh(x / 30)."""
    for label, (ours, torch_err) in _softcap_errors("softcap").items():
        assert ours <= 2 * torch_err, f"{label}: {ours:.2e} against PyTorch's {torch_err:.2e}"


def test_sigmoid_tanh_is_caught(monkeypatch):
    """The check can fail: with the former 2 sigmoid(2u) - 1 in the loss kernel, the capped logits of
    spread 1 and the gradient are several times PyTorch's error."""
    monkeypatch.setattr(lm_head, "_softcap", _sigmoid_softcap)   # the interpreter resolves it at launch
    errors = _softcap_errors("sigmoid_softcap")
    for label in ("logits, spread 1", "gradient, V = 8"):
        ours, torch_err = errors[label]
        assert ours > 4 * torch_err, (label, ours, torch_err)


# ---------------------------------------------------------------- where the gradient goes

def test_default_leaves_the_callers_logits_untouched():
    x = _logits(6, 300, torch.float32).requires_grad_()
    before = x.detach().clone()
    t = _targets(6, 300)
    loss = cross_entropy(x, t)
    loss.backward()
    assert torch.equal(x.detach(), before)
    assert_close(x.grad, (torch.softmax(before, -1) - F.one_hot(t, 300).float()) / 6)


def test_inplace_overwrites_the_logits_with_the_gradient_and_allocates_no_second_buffer():
    """The documented contract: with inplace=True the caller's logits become dloss/dlogits (already
    divided by the rows not ignored), the forward creates no (N, V) tensor, and gradients flowing
    on to the layer below are PyTorch's."""
    N, C, V = 9, 8, 300
    h, w = _flce_case(N, C, V, torch.float32)
    t = _targets(N, V, ignore_every=4)
    h, w = h.requires_grad_(), w.requires_grad_()
    z = h @ w.T                                          # (N, V), the logits the caller hands over
    z_before = z.detach().clone()
    with TensorPeak() as probe:
        loss = cross_entropy(z, t, inplace=True)
    assert probe.peak_bytes < N * V * 4 // 4             # the loss rows and scalars, no (N, V) buffer
    n_valid = int((t != -100).sum())
    dz = (torch.softmax(z_before, -1) - F.one_hot(t.clamp(min=0), V).float()) / n_valid
    dz[t == -100] = 0
    assert_close(z.detach(), dz, name="logits after the call")
    loss.backward()
    ref = _flce_grads(fused_linear_cross_entropy_ref, h, w, t)
    assert_close(loss, ref[0])
    assert_close(h.grad, ref[1], name="dhidden")
    assert_close(w.grad, ref[2], name="dweight")


def test_inplace_without_a_gradient_to_compute_leaves_the_logits():
    x = _logits(4, 50, torch.float32)
    before = x.clone()
    t = _targets(4, 50)
    cross_entropy(x, t, inplace=True)                    # x does not require grad
    with torch.no_grad():
        cross_entropy(x.requires_grad_(), t, inplace=True)
    assert torch.equal(x.detach(), before)


def test_inplace_over_logits_another_node_saved_fails_loudly():
    """Broken use caught: exp saves its output for backward; overwriting it in place would make
    exp's backward read the gradient as logits. The version bump turns that into an error."""
    z = _logits(4, 30, torch.float32, scale=0.3).requires_grad_()
    t = _targets(4, 30)
    loss = cross_entropy(z.exp(), t, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss = cross_entropy(z.exp(), t)                     # the default is safe there
    (dz,) = torch.autograd.grad(loss, z)
    zz = z.detach().clone().requires_grad_()
    (dref,) = torch.autograd.grad(F.cross_entropy(zz.exp(), t), zz)
    assert_close(dz, dref)


def test_inplace_refuses_logits_it_cannot_overwrite_and_backward_runs_once():
    x = _logits(5, 40, torch.float32)
    t = _targets(5, 40)
    with pytest.raises(ValueError, match="inplace=True writes the gradient over logits"):
        cross_entropy(x.T.contiguous().T.requires_grad_(), t, inplace=True)   # column-major rows
    with pytest.raises(ValueError, match="stride-0"):
        cross_entropy(x[:1].expand(5, 40).requires_grad_(), t, inplace=True)
    xr = x.clone().requires_grad_()
    loss = cross_entropy(xr, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


# ---------------------------------------------------------------- launch choices, compiled for sm_90a

VOCABS = (32_000, 128_256, 151_936)   # Mistral 7B / Llama 2, Llama 3, Qwen2 (padded)
# Liger-Kernel's cross-entropy launch (linkedin/Liger-Kernel@9a12d7e67dddd9c429323768f60c298face0fed3,
# src/liger_kernel/ops/cross_entropy.py: MAX_FUSED_SIZE = 65536 // 2, num_warps=32)
LIGER_BLOCK, LIGER_WARPS = 32768, 32
GEMMA2_VOCAB = 256_000                 # Gemma 2 (hf2025gemma2config), which caps its final logits at 30


def _row_offset_multiplies(ptx: str, param: int) -> list[str]:
    """The PTX multiply opcodes that take the value of kernel parameter ``param`` (a row stride),
    directly or after a conversion (``cvt.s64.s32``)."""
    import re
    regs = set(re.findall(rf"ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_{param}\]", ptx))
    ops = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(mul|cvt)(\.[\w.]+)\s+(%\w+),\s*(%\w+)(?:,\s*(%\w+))?;", line)
        if m and regs & {m.group(4), m.group(5)}:
            if m.group(1) == "cvt":
                regs.add(m.group(3))
            else:
                ops.append(m.group(1) + m.group(2))
    return ops


@pytest.fixture(scope="module")
def ce_builds():
    """One compile (one process) for every case: the launcher's choices at three real vocabularies
    (in fp32 and bf16; equal choices compile once), the former launch, a spilling launch, and the
    int32 row-offset variant."""
    cases = {f"{dt} V={V}": aot_job(V, dt) for V in VOCABS for dt in ("fp32", "bf16")}
    cases["old: 4096, 4 warps"] = aot_job(128_256, block_v=4096, num_warps=4)
    cases["broken: 8192, 4 warps"] = aot_job(128_256, block_v=8192, num_warps=4)
    cases["broken: int32 rows"] = aot_job(128_256, int64_rows=False)
    for dt in ("fp32", "bf16"):   # Liger-Kernel's launch (block 32768, 32 warps), and 8192 at 32 warps
        cases[f"Liger {dt}: 32768, 32 warps"] = aot_job(128_256, dt, block_v=LIGER_BLOCK, num_warps=LIGER_WARPS)
    cases["bf16: 8192, 32 warps"] = aot_job(128_256, "bf16", block_v=8192, num_warps=32)
    for V in (*VOCABS, GEMMA2_VOCAB):   # with both extra terms compiled in, as Gemma 2 would train
        cases[f"bf16 V={V} z-loss+softcap"] = aot_job(V, "bf16", z_loss=True, softcap=True)
    unique = {}
    for job in cases.values():
        unique.setdefault(repr(job.spec()), job)
    builds = dict(zip(unique, (b["sm90"] for b in ki.compile_triton_many(list(unique.values())))))
    return {label: builds[repr(job.spec())] for label, job in cases.items()}


def test_launch_config_is_a_small_block_with_enough_warps():
    assert [launch_config(V) for V in (1, 300, 2048, *VOCABS)] == [(1, 1), (512, 2), (2048, 8)] + [(2048, 8)] * 3


@pytest.mark.parametrize("V", VOCABS)
def test_launch_at_real_vocabularies_does_not_spill_on_sm90a(ce_builds, V):
    for dt in ("fp32", "bf16"):
        b = ce_builds[f"{dt} V={V}"]
        assert b.metadata["num_warps"] == launch_config(V)[1]
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, ki.resource_table([(dt, b)])
        assert b.metadata["registers"] <= 64


@pytest.mark.parametrize("V", (*VOCABS, GEMMA2_VOCAB))
def test_launch_with_z_loss_and_softcap_does_not_spill(ce_builds, V):
    b = ce_builds[f"bf16 V={V} z-loss+softcap"]
    assert b.spills == 0 and b.metadata["stack_bytes"] == 0, ki.resource_table([("terms", b)])
    assert b.metadata["registers"] <= 64


def test_spill_check_catches_a_spilling_launch(ce_builds):
    """The former launch sits just under the 255-register limit without spilling (248 at the launch's
    own specialisation); one block wider spills, and the same assertion as above fails on it."""
    old, broken = ce_builds["old: 4096, 4 warps"], ce_builds["broken: 8192, 4 warps"]
    assert old.metadata["registers"] >= 240 and old.spills == 0
    with pytest.raises(AssertionError):
        assert broken.spills == 0 and broken.metadata["stack_bytes"] == 0
    assert broken.spills > 100 and broken.metadata["stack_bytes"] > 0


def test_liger_launch_spills_the_per_lane_accumulators(ce_builds):
    """At Liger-Kernel's launch (BLOCK_SIZE = min(32768, next_pow2(V)), num_warps = 32) each of the 1024
    threads holds 32 values of each of the kernel's four per-lane accumulators and of the block of
    logits: 160 fp32 values against the 64 registers a thread may have at 32 warps, so it spills (in
    fp32, as Liger's fused loss upcasts each chunk, and in bf16). A quarter of that block fits."""
    for dt in ("fp32", "bf16"):
        b = ce_builds[f"Liger {dt}: 32768, 32 warps"]
        assert b.metadata["num_warps"] == LIGER_WARPS and b.metadata["registers"] <= 64
        assert b.spills > 100 and b.metadata["stack_bytes"] > 256, ki.resource_table([(dt, b)])
    fits = ce_builds["bf16: 8192, 32 warps"]
    assert fits.spills == 0 and fits.metadata["stack_bytes"] == 0 and fits.metadata["registers"] <= 64


def test_row_offsets_are_64_bit_in_the_ptx(ce_builds):
    """N x V passes 2**31 at N = 16744 rows of V = 128256, so row * stride must be a 64-bit product.
    Proved on the compiled code, without allocating such a tensor: every multiply by a row stride
    (parameters 5 and 6, stride_xn and stride_gn) is 64-bit; the int32 variant's is not."""
    assert 16744 * 128_256 > 2**31 > 16743 * 128_256
    for param in (5, 6):
        ops = _row_offset_multiplies(ce_builds["fp32 V=128256"].ptx, param)
        assert ops and all(op in ("mul.lo.s64", "mul.wide.s32") for op in ops), ops
    broken = _row_offset_multiplies(ce_builds["broken: int32 rows"].ptx, 5)
    assert "mul.lo.s32" in broken, broken


# ---------------------------------------------------------------- fused linear cross-entropy

def _flce_case(N, C, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g).to(DEVICE, dtype)
    w = (torch.randn(V, C, generator=g) / C ** 0.5).to(DEVICE, dtype)
    return h, w


def _flce_grads(fn, h, w, t, **kw):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, t, **kw)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss, dh, dw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,C,V,chunk", [(37, 24, 300, 8), (5, 16, 33, 1024), (64, 32, 257, 64), (1, 8, 5, 1)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_linear_cross_entropy_matches_unfused(N, C, V, chunk, dtype, smoothing):
    h, w = _flce_case(N, C, V, dtype)
    t = _targets(N, V, ignore_every=5 if N > 5 else 0)
    got = _flce_grads(fused_linear_cross_entropy, h, w, t, chunk_size=chunk, label_smoothing=smoothing)
    ref = _flce_grads(fused_linear_cross_entropy_ref, h.double(), w.double(), t, label_smoothing=smoothing)
    base = _flce_grads(fused_linear_cross_entropy_ref, h, w, t, label_smoothing=smoothing)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    assert_close(got[0], ref[0].float(), dtype=torch.float32, baseline=base[0].float(), factor=4.0, name="loss")
    for label, a, e, b in zip(["dhidden", "dweight"], got[1:], ref[1:], base[1:]):
        assert_close(a, e, dtype=dtype, baseline=b, factor=4.0, name=label)


def test_fused_linear_sum_reduction_and_3d_hidden():
    h, w = _flce_case(2 * 7, 16, 40, torch.float32)
    t = _targets(14, 40)
    got = _flce_grads(fused_linear_cross_entropy, h.view(2, 7, 16), w, t.view(2, 7), reduction="sum", chunk_size=5)
    ref = _flce_grads(fused_linear_cross_entropy_ref, h.view(2, 7, 16), w, t.view(2, 7), reduction="sum")
    for a, e in zip(got, ref):
        assert_close(a, e)


def test_fused_linear_bad_inputs():
    h, w = _flce_case(4, 8, 10, torch.float32)
    t = _targets(4, 10)
    with pytest.raises(ValueError, match=r"weight \(V, C\)"):
        fused_linear_cross_entropy(h, w.T, t)
    with pytest.raises(TypeError, match="share a dtype"):
        fused_linear_cross_entropy(h, w.half(), t)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="target values"):
        fused_linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 10], device=DEVICE))
    with pytest.raises(RuntimeError, match="reduction='none'"):
        loss = fused_linear_cross_entropy(h.requires_grad_(), w, t, reduction="none")
        loss.sum().backward()


def test_chunk_rows_keeps_a_chunks_logits_within_the_hidden_states():
    N, C, V = 65_536, 4096, 128_256                       # Llama 3 8B, 8 x 8192 tokens
    n = chunk_rows(N, C, V)
    assert n == 2048 and n * V <= N * C < (n + 128) * V
    assert chunk_rows(65_536, 3584, 152_064) == 1536      # Qwen2.5 7B
    assert chunk_rows(37, 24, 300) == 37 and chunk_rows(1000, 16, 100_000) == 128   # at least min(N, 128)
    assert chunk_rows(0, 8, 10) == 1


def test_tensor_peak_of_the_losses():
    """Tensors alive at the peak, in (N, V) fp32 tensors L: PyTorch's loss about 3 (log-softmax saved,
    nll's dense gradient, the log-softmax gradient); the kernel with its own buffer 2 (logits and
    gradient); in place 1; chunked, one (chunk, V) buffer plus the (V, C) and (N, C) gradients, which
    autograd adopts as .grad without a copy."""
    N, C, V, chunk = 128, 16, 512, 16
    res = tensor_peak_bytes(N, C, V, chunk, kinds=("unfused", "kernel", "kernel_inplace", "fused"))
    L = N * V * 4
    peak = {k: r["peak_bytes"] for k, r in res.items()}
    for r in res.values():
        assert abs(r["loss"] - res["unfused"]["loss"]) < 1e-5
    grads = V * C * 4 + N * C * 4                         # dW (V, C) and dH (N, C), fp32
    rows = 2048                                           # the loss rows, targets' masks, scalars
    assert 3 * L <= peak["unfused"] < 3 * L + rows, peak
    assert 2 * L <= peak["kernel"] < 2 * L + rows, peak
    assert L + grads <= peak["kernel_inplace"] < L + grads + rows, peak
    assert chunk * V * 4 + grads <= peak["fused"] < chunk * V * 4 + grads + rows, peak
    # the probe sees a tensor as long as a view of it lives, not only its first Python object
    with TensorPeak() as probe:
        view = torch.empty(1000)[::2]
    assert probe.peak_bytes == 4000 and view.numel() == 500
    # and a view of a tensor made before the block is not new memory
    before = torch.empty(1000)
    with TensorPeak() as probe:
        view = before[::2] * 1                            # the view is free; the product is 500 floats
    assert probe.peak_bytes == 2000


@pytest.mark.skipif(runtime.runtime().on_gpu, reason="a CPU measurement: resident memory of CPU tensors")
def test_peak_memory_measurement_sees_the_logits():
    """The process's resident memory grows by at least the unfused loss's logits-sized tensors
    (forked children, Linux). The chunked case is not asserted: at this size its resident growth is
    page-level noise from the interpreter."""
    from kernels.model.lm_head_memory import peak_extra_bytes
    N, C, V = 256, 16, 2048
    res = peak_extra_bytes(N, C, V, 16)
    assert abs(res["unfused"]["loss"] - res["fused"]["loss"]) < 1e-4
    assert res["unfused"]["peak_extra_bytes"] > 2.5 * N * V * 4, res
