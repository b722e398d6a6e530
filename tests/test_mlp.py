"""kernels.mlp.gated: the fused GLU-family kernels (forward and backward), the LLaMA MLP and the 2/3 rule."""
import kernels  # noqa: F401  (before triton)
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import inspect as kinspect
from kernels.mlp import gated as mlp
from kernels import runtime
from kernels.mlp.gated import (
    LlamaMLP, fuse_gate_up, geglu, geglu_ref, llama_hidden_size, llama_mlp_fused_ref, llama_mlp_ref, mlp_parameters, reglu,
    reglu_ref, swiglu, swiglu_ref,
)
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes
DEVICE = runtime.device()
SHAPES = [(1, 1), (3, 7), (37, 1000), (2, 5, 4097), (129,)]
VARIANTS = {
    "swiglu": (swiglu, swiglu_ref, {}),
    "geglu": (geglu, geglu_ref, {}),
    "geglu_tanh": (geglu, geglu_ref, {"approximate": "tanh"}),
    "reglu": (reglu, reglu_ref, {}),
}

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's exp-overflow notices in the interpreter


def _t(shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def _run(fn, gate, up, dh):
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    h = fn(gate, up)
    return (h, *torch.autograd.grad(h, (gate, up), dh))


def _check(variant, gate, up, dh, gate_in=None, up_in=None, block_size=None):
    """Kernel against the reference's autograd (float64 for fp32 inputs, fp32 otherwise), elementwise."""
    fn, ref, kw = VARIANTS[variant]
    wide = torch.float64 if gate.dtype == torch.float32 else torch.float32
    got = _run(lambda a, b: fn(a, b, block_size=block_size, **kw),
               gate if gate_in is None else gate_in, up if up_in is None else up_in, dh)
    want = _run(lambda a, b: ref(a, b, **kw), gate.to(wide), up.to(wide), dh.to(wide))
    for label, a, r in zip(("h", "dgate", "dup"), got, want):
        assert a.dtype == gate.dtype and a.shape == gate.shape, label
        assert_close(a, r, dtype=gate.dtype, name=f"{variant} {label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_backward(variant, shape, dtype):
    _check(variant, _t(shape, dtype, 3.0), _t(shape, dtype, seed=1), _t(shape, dtype, seed=2))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nan_canaries_and_small_blocks(variant):
    """Many programs (block 64) with a masked tail, every input inside a NaN-filled buffer."""
    g, u, d = _t((7, 45), scale=3.0), _t((7, 45), seed=1), _t((7, 45), seed=2)
    _check(variant, g, u, nan_canary(d), gate_in=nan_canary(g), up_in=nan_canary(u), block_size=64)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_large_magnitudes_and_zero(variant):
    """Gates of +-80 (sigmoid saturates, exp overflows in the tail of the formulas) and exact zeros."""
    g = torch.tensor([-80.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 80.0] * 3, device=DEVICE)
    u, d = _t(g.shape, seed=1), _t(g.shape, seed=2)
    _check(variant, g, u, d)


def test_non_contiguous_inputs():
    g, u, d = _t((30, 40), scale=3.0), _t((30, 40), seed=1), _t((40, 30), seed=2)
    _check("swiglu", g.t(), u.t(), d)
    _check("geglu", g[:, ::2], u[:, ::2], d[::2, :].t())     # strided views, a transposed gradient


def test_exact_and_tanh_gelu_differ_and_each_matches_torch():
    g = torch.linspace(-6, 6, 2001, device=DEVICE)
    one = torch.ones_like(g)
    exact, approx = geglu(g, one), geglu(g, one, approximate="tanh")
    gap = (exact - approx).abs().max().item()
    assert 1e-4 < gap < 1e-3                             # the approximation is off by at most ~5e-4
    assert_close(exact, F.gelu(g.double()), dtype=torch.float32, name="exact")
    assert_close(approx, F.gelu(g.double(), approximate="tanh"), dtype=torch.float32, name="tanh")


def test_relu_gradient_at_zero_matches_torch():
    g = torch.zeros(5, device=DEVICE)
    _, dg, _ = _run(reglu, g, torch.ones(5, device=DEVICE), torch.ones(5, device=DEVICE))
    assert torch.equal(dg, torch.zeros(5, device=DEVICE))


def test_references_gradcheck_float64():
    g = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    for _, ref, kw in VARIANTS.values():
        assert torch.autograd.gradcheck(lambda a, b: ref(a, b, **kw), (g, u))
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((12, 8), (12, 8), (8, 12))]
    assert torch.autograd.gradcheck(llama_mlp_ref, (x, *ws))


# ---------------------------------------------------------------------------------------------- LLaMA MLP, the 2/3 rule

@pytest.mark.parametrize("d, multiple_of, multiplier, hidden", [
    (4096, 256, None, 11008),      # LLaMA-7B
    (8192, 256, None, 22016),      # LLaMA-65B
    (4096, 1024, 1.3, 14336),      # Llama 3 8B (meta-llama/llama-models sku_list)
    (8192, 4096, 1.3, 28672),      # Llama 2 70B, Llama 3 70B
    (16384, 4096, 1.2, 53248),     # Llama 3.1 405B
    (2048, 256, 1.5, 8192),        # Llama 3.2 1B
])
def test_llama_hidden_sizes_of_real_models(d, multiple_of, multiplier, hidden):
    assert llama_hidden_size(d, multiple_of, multiplier) == hidden


def test_llama_hidden_size_without_the_multiplier_misses_llama3():
    """The plain 2/3 rule gives 11264 at d = 4096 with multiple_of 1024, not Llama 3 8B's 14336."""
    assert llama_hidden_size(4096, multiple_of=1024) == 11264 != 14336


@pytest.mark.parametrize("d", [96, 768, 4096 * 3])
def test_two_thirds_rule_keeps_parameters_equal(d):
    assert mlp_parameters(d, 8 * d // 3, gated=True) == mlp_parameters(d, 4 * d, gated=False) == 8 * d * d
    m = LlamaMLP(d // 8 if d > 1000 else d, hidden=8 * (d // 8 if d > 1000 else d) // 3)
    assert sum(p.numel() for p in m.parameters()) == mlp_parameters(m.d_model, m.hidden, gated=True)


def test_llama_mlp_module_matches_reference_and_trains():
    torch.manual_seed(0)
    m = LlamaMLP(48, hidden=128).to(DEVICE)
    x = _t((2, 5, 48), seed=4).requires_grad_()
    y = m(x)
    ws = [p.detach().double().requires_grad_() for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
    x64 = x.detach().double().requires_grad_()
    y_ref = llama_mlp_ref(x64, *ws)
    assert_close(y, y_ref, dtype=torch.float32, name="LlamaMLP")
    dy = _t(y.shape, seed=5)
    y.backward(dy)
    y_ref.backward(dy.double())
    for p, w in zip((m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight), ws):
        assert_close(p.grad, w.grad, dtype=torch.float32, baseline=None, name="weight grad")
    assert_close(x.grad, x64.grad, dtype=torch.float32, name="x grad")
    with pytest.raises(ValueError, match="d_model=48"):
        m(torch.ones(2, 47, device=DEVICE))


def test_geglu_compiles_for_gpus():
    """erf and exp are libdevice/MUFU calls on a GPU, untested by the interpreter: compile the backward
    (which has both) for sm90 and check the exp became ex2.approx."""
    build = kinspect.compile_triton(
        mlp._glu_bwd_kernel,
        {"gate_ptr": "*fp16", "up_ptr": "*fp16", "dh_ptr": "*fp16", "dgate_ptr": "*fp16", "dup_ptr": "*fp16", "n": "i32"},
        arch="sm90", constexprs={"ACTIVATION": "gelu", "BLOCK": 1024},
    )
    assert build.families("ptx")["ex2.approx"] > 0
    assert "MUFU.EX2" in build.sass


# ---------------------------------------------------------------------------------------------- bad input

def test_bad_input_refused():
    a = torch.ones(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"same shape, got \(3, 4\) and \(4, 3\)"):
        swiglu(a, torch.ones(4, 3, device=DEVICE))
    with pytest.raises(TypeError, match="share a dtype"):
        geglu(a, a.half())
    with pytest.raises(TypeError, match="dtype torch.int32"):
        reglu(a.int(), a.int())
    with pytest.raises(TypeError, match="torch.Tensor"):
        swiglu([1.0], a)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        geglu(a, a, approximate="erf")
    with pytest.raises(ValueError, match="power of two"):
        swiglu(a, a, block_size=100)
    assert swiglu(torch.empty(0, 4, device=DEVICE), torch.empty(0, 4, device=DEVICE)).shape == (0, 4)


# ---------------------------------------------------------------------------------------------- broken variants are caught

@triton.jit
def _fwd_no_program_offset_kernel(gate_ptr, up_ptr, h_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)                            # BROKEN: every program does the first block
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, (mlp._act(g, ACTIVATION) * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_sigmoid_gate_kernel(gate_ptr, up_ptr, h_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, (tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=mask)   # BROKEN: GLU, not SwiGLU


@triton.jit
def _bwd_wrong_derivative_kernel(gate_ptr, up_ptr, dh_ptr, dgate_ptr, dup_ptr, n,
                                 ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dup_ptr + offs, (dh * g * s).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (dh * u * s).to(dgate_ptr.dtype.element_ty), mask=mask)  # BROKEN: silu' is not sigmoid


def test_broken_block_indexing_is_caught(monkeypatch):
    """An elementwise kernel's load mask cannot change the outputs it stores (each lane is independent),
    so the indexing mistake to catch is in the offsets: here every program writes the first block."""
    g, u, d = _t((5, 30), scale=3.0), _t((5, 30), seed=1), _t((5, 30), seed=2)
    _check("swiglu", g, u, d, block_size=64)
    # Fresh inputs for the broken run: the output is torch.empty, and the caching allocator may hand
    # back the buffer that still holds the correct run's result for the same inputs.
    g2, u2, d2 = _t((5, 30), scale=3.0, seed=3), _t((5, 30), seed=4), _t((5, 30), seed=5)
    monkeypatch.setattr(mlp, "_glu_fwd_kernel", _fwd_no_program_offset_kernel)
    with pytest.raises(MismatchError, match="swiglu h"):
        _check("swiglu", g2, u2, d2, block_size=64)


def test_broken_activation_is_caught(monkeypatch):
    g, u, d = _t((5, 30), scale=3.0), _t((5, 30), seed=1), _t((5, 30), seed=2)
    monkeypatch.setattr(mlp, "_glu_fwd_kernel", _fwd_sigmoid_gate_kernel)
    with pytest.raises(MismatchError, match="swiglu h"):
        _check("swiglu", g, u, d)


def test_broken_backward_is_caught(monkeypatch):
    g, u, d = _t((5, 30), scale=3.0), _t((5, 30), seed=1), _t((5, 30), seed=2)
    monkeypatch.setattr(mlp, "_glu_bwd_kernel", _bwd_wrong_derivative_kernel)
    with pytest.raises(MismatchError, match="swiglu dgate"):
        _check("swiglu", g, u, d)


# ---------------------------------------------------------------------------------------------- fused gate/up layout

def test_fused_gate_up_equals_two_gemms():
    """One (2h, d) GEMM split into gate and up gives the two-GEMM block, forward and weight gradients."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 24, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(40, 24, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(24, 40, generator=g, dtype=torch.float64)
    wgu = fuse_gate_up(wg, wu).requires_grad_()
    assert wgu.shape == (80, 24) and torch.equal(wgu[:40], wg) and torch.equal(wgu[40:], wu)
    fused = llama_mlp_fused_ref(x, wgu, wd)
    wg2, wu2 = wg.clone().requires_grad_(), wu.clone().requires_grad_()
    split = llama_mlp_ref(x, wg2, wu2, wd)
    assert_close(fused, split, dtype=torch.float64)
    dy = torch.randn(fused.shape, generator=g, dtype=torch.float64)
    (dwgu,) = torch.autograd.grad(fused, wgu, dy)
    dwg, dwu = torch.autograd.grad(split, (wg2, wu2), dy)
    assert_close(dwgu, torch.cat([dwg, dwu]), dtype=torch.float64)


def test_fused_gate_up_with_swapped_halves_is_caught():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 16, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(24, 16, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(16, 24, generator=g, dtype=torch.float64)
    with pytest.raises(MismatchError):
        assert_close(llama_mlp_fused_ref(x, fuse_gate_up(wu, wg), wd), llama_mlp_ref(x, wg, wu, wd), dtype=torch.float64)


def test_fused_gate_up_bad_shapes_refused():
    with pytest.raises(ValueError, match="w_gate and w_up"):
        fuse_gate_up(torch.zeros(4, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="w_gate_up"):
        llama_mlp_fused_ref(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(3, 2))
