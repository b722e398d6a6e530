"""kernels.mlp.gated: the fused GLU-family kernels (forward and backward), the LLaMA MLP and the 2/3 rule."""
import kernels  # noqa: F401  (before triton)
import re

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import inspect as kinspect
from kernels.mlp import gated as mlp
from kernels import runtime
from kernels.model import glu_equal_params as eq
from kernels.mlp.gated import (
    LlamaMLP, fuse_gate_up, geglu, geglu_ref, llama_hidden_size, llama_mlp_fused_ref, llama_mlp_ref, mlp_parameters, reglu,
    reglu_ref, swiglu, swiglu_fused, swiglu_fused_ref, swiglu_ref,
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
    """The module (one merged gate/up GEMM, the fused-layout SwiGLU) against the two-GEMM reference in
    float64: output, the gradient of x, and the gradients of gate, up (the merged weight's halves) and down."""
    torch.manual_seed(0)
    m = LlamaMLP(48, hidden=128).to(DEVICE)
    assert m.gate_up_proj.weight.shape == (256, 48)
    x = _t((2, 5, 48), seed=4).requires_grad_()
    y = m(x)
    w_g, w_u = m.gate_up_proj.weight.detach().double().chunk(2)
    ws = [w.clone().requires_grad_() for w in (w_g, w_u, m.down_proj.weight.detach().double())]
    x64 = x.detach().double().requires_grad_()
    y_ref = llama_mlp_ref(x64, *ws)
    assert_close(y, y_ref, dtype=torch.float32, name="LlamaMLP")
    dy = _t(y.shape, seed=5)
    y.backward(dy)
    y_ref.backward(dy.double())
    assert_close(m.gate_up_proj.weight.grad, torch.cat([ws[0].grad, ws[1].grad]), dtype=torch.float32, baseline=None,
                 name="gate/up weight grad")
    assert_close(m.down_proj.weight.grad, ws[2].grad, dtype=torch.float32, baseline=None, name="down weight grad")
    assert_close(x.grad, x64.grad, dtype=torch.float32, name="x grad")
    with pytest.raises(ValueError, match="d_model=48"):
        m(torch.ones(2, 47, device=DEVICE))


@pytest.fixture(scope="module")
def aot():
    """One compile for the module (sm_90a, the GPU launches): the GELU backward of the separate-tensor
    kernel, and the fused-layout SwiGLU forward and backward at Llama 3 8B (4096 tokens, h = 14336)."""
    entries = [e for e in mlp.launch_jobs(torch.float16) if e[0] == "glu bwd gelu"] + mlp.fused_launch_jobs(torch.float16)
    builds = kinspect.compile_triton_many([job for _, job in entries], archs=("sm90",))
    return {label: b["sm90"] for (label, _), b in zip(entries, builds)}


def test_fused_layout_compiles_at_llama3_8b_width_without_spills(aot):
    """Reading gate and up by stride from one (T, 2h) row costs nothing in registers: no spills, each
    thread's 8 halves in one 16-byte load, and rows * stride computed in 64 bits."""
    for label in ("glu fused-layout fwd silu", "glu fused-layout bwd silu"):
        b = aot[label]
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        assert b.metadata["num_warps"] == 4, label
        assert sorted({w for w in b.ptx.split() if w.startswith("ld.global")}) == ["ld.global.v4.b32"], label
        assert re.search(r"arith\.extsi %stride_gu : i32 to i64", b.ttgir), label


def test_geglu_compiles_for_gpus(aot):
    """erf and exp are libdevice/MUFU calls on a GPU, untested by the interpreter: the GELU backward
    (which has both) compiled for sm90 from its GPU launch turns the exp into ex2.approx."""
    build = aot["glu bwd gelu"]
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


# ---------------------------------------------------------------------------------------------- the fused (T, 2h) layout

def _fused_check(gu, dh, gu_in=None, dh_in=None, block_size=None):
    """swiglu_fused against swiglu_fused_ref's autograd (float64 for fp32 inputs, fp32 otherwise);
    ``gu_in``/``dh_in`` are the same values as strided views (NaN canaries), handed to the kernel."""
    wide = torch.float64 if gu.dtype == torch.float32 else torch.float32
    x = (gu.clone() if gu_in is None else gu_in).detach().requires_grad_()    # detach keeps a view's strides
    h = swiglu_fused(x, block_size=block_size)
    (dgu,) = torch.autograd.grad(h, x, dh if dh_in is None else dh_in)
    r = gu.to(wide).requires_grad_()
    h_ref = swiglu_fused_ref(r)
    (dgu_ref,) = torch.autograd.grad(h_ref, r, dh.to(wide))
    assert h.shape == dh.shape and dgu.shape == gu.shape and h.dtype == dgu.dtype == gu.dtype
    assert_close(h, h_ref, dtype=gu.dtype, name="swiglu_fused h")
    assert_close(dgu, dgu_ref, dtype=gu.dtype, name="swiglu_fused dgate_up")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, block", [((1, 2), None), ((37, 90), None), ((2, 5, 2 * 45), 16), ((3, 2 * 1100), None)])
def test_fused_layout_forward_backward(shape, block, dtype):
    """Masked tails in both directions (37 rows over tiles of 16, 45 columns over blocks of 16, 1100 over
    1024), leading dimensions, and every input a view inside NaN-padded rows (row stride > 2h)."""
    half = (*shape[:-1], shape[-1] // 2)
    gu, dh = _t(shape, dtype, 3.0), _t(half, dtype, seed=1)
    _fused_check(gu, dh, gu_in=nan_canary(gu, rows=True), dh_in=nan_canary(dh, rows=True), block_size=block)


def test_fused_layout_equals_the_split_kernel_on_views():
    """Reading the halves by stride gives what the separate-tensor kernel gives on the copied halves."""
    gu = _t((9, 2 * 40), scale=3.0)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(swiglu_fused(gu), swiglu(gate, up))


@triton.jit
def _fused_fwd_swapped_halves_kernel(gu_ptr, h_ptr, T, H, stride_gu, stride_h, ACTIVATION: tl.constexpr,
                                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    first = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    u = tl.load(first, mask=mask, other=0.0).to(tl.float32)           # BROKEN: up read from the first half
    g = tl.load(first + H, mask=mask, other=0.0).to(tl.float32)       # and gate from the second (MulAndSilu)
    h = mlp._act(g, ACTIVATION) * u
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


_REAL_FUSED_BWD = mlp._glu_fused_bwd_kernel


class _SwappedHalvesBackward:
    """The fused backward launched as usual, then its (T, 2H) gradient's halves exchanged: d gate lands
    in up's half and d up in gate's (a broken variant built on the real kernel, not a copy of it)."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _REAL_FUSED_BWD[grid](*args, **kwargs)
            dgu = args[2]                                   # (T, 2H): [d gate | d up]
            half = dgu.shape[1] // 2
            dgu.copy_(torch.cat([dgu[:, half:], dgu[:, :half]], dim=1))
        return launch


def test_fused_layout_swapped_halves_are_caught(monkeypatch):
    """The mistake a merged weight invites: gate and up swapped (vLLM's MulAndSilu order, or a
    checkpoint's shards loaded reversed), in the forward, then in the gradient's halves."""
    gu, dh = _t((7, 2 * 45), scale=3.0), _t((7, 45), seed=1)
    _fused_check(gu, dh, block_size=16)
    with monkeypatch.context() as mp:
        mp.setattr(mlp, "_glu_fused_fwd_kernel", _fused_fwd_swapped_halves_kernel)
        with pytest.raises(MismatchError, match="swiglu_fused h"):
            _fused_check(gu, dh, block_size=16)
    monkeypatch.setattr(mlp, "_glu_fused_bwd_kernel", _SwappedHalvesBackward())
    with pytest.raises(MismatchError, match="swiglu_fused dgate_up"):
        _fused_check(gu, dh, block_size=16)


def test_fused_layout_bad_input_refused():
    with pytest.raises(ValueError, match=r"even last dimension, got shape \(3, 5\)"):
        swiglu_fused(torch.ones(3, 5, device=DEVICE))
    with pytest.raises(TypeError, match="dtype torch.int32"):
        swiglu_fused(torch.ones(3, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        swiglu_fused([1.0, 2.0])
    with pytest.raises(ValueError, match="power of two"):
        swiglu_fused(torch.ones(3, 4, device=DEVICE), block_size=24)
    assert swiglu_fused(torch.empty(0, 6, device=DEVICE)).shape == (0, 3)


# ---------------------------------------------------------------------------------------------- the committed run

def test_equal_params_run_reproduces_its_first_steps():
    """Re-run the first 10 steps of the SwiGLU arm (seed 0, the chapter's learning rate): the training
    losses match the committed log; every run holds 98,304 block weights and a full curve."""
    results = eq.load()
    threads = torch.get_num_threads()
    torch.set_num_threads(results["threads"])
    try:
        train_tok, val_x, val_y = eq.splits()
        again = eq.fit("swiglu", 0, results["lr"], train_tok, val_x, val_y, steps=results["settings"]["head_steps"])
    finally:
        torch.set_num_threads(threads)
    logged = next(r for r in results["runs"] if (r["arm"], r["seed"], r["lr"]) == ("swiglu", 0, results["lr"]))
    assert again["train_head"] == pytest.approx(logged["train_head"], abs=1e-4)
    assert {r["block_weights"] for r in results["runs"]} == {98_304}
    n_curve = results["settings"]["steps"] // results["settings"]["eval_every"]
    assert all(len(r["val"]) == n_curve for r in results["runs"])
    assert len(results["runs"]) == len(results["seeds"]) * (len(eq.ARMS) + 2 * len(results["lr_sweep"]["lrs"]))


def test_equal_params_model_refuses_unknown_arm():
    with pytest.raises(ValueError, match="arm must be one of"):
        eq.NextByte("tanh")
