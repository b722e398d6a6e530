"""kernels.model.adamw: the fused mixed-precision AdamW step against torch.optim.AdamW on the FP32
master over several steps, broken variants the comparison catches (coupled weight decay, no bias
correction), the byte counts, clear errors, and the sm_90a build at real sizes (no spills, the flat
offset in 64 bits, and an int32 variant the check rejects)."""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import kernels  # noqa: F401  (before triton)
import pytest
import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.inspect import TritonJob, compile_triton_many

A = importlib.import_module("kernels.model.adamw")
DEVICE = runtime.device()
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@triton.jit
def _coupled_decay_kernel(w_ptr, g_ptr, p_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                          step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    """BROKEN: L2 regularisation (Adam's weight decay, g += wd p), not AdamW's decoupled decay."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_decay * p
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(w_ptr + offs, A._round_to_bf16(p), mask=mask)


@triton.jit
def _no_bias_correction_kernel(w_ptr, g_ptr, p_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                               step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    """BROKEN: the raw moments, lr * m / (sqrt(v) + eps), without 1 - beta**t."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0) * (1.0 - lr * weight_decay)
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
    p = p - lr * m / (tl.sqrt(v) + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(w_ptr + offs, A._round_to_bf16(p), mask=mask)


@triton.jit
def _int32_offsets_kernel(w_ptr, g_ptr, p_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                          step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    """BROKEN for n >= 2**31: program id * BLOCK in int32 wraps."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                  # BROKEN: int32
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0) * (1.0 - lr * weight_decay)
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(w_ptr + offs, A._round_to_bf16(p), mask=mask)


def _run(n=10_003, steps=4, kernel=None, seed=0, block_size=None, **hp):
    """The fused step and torch.optim.AdamW (for-loop path) on the same FP32 master, ``steps`` steps
    with fresh BF16 gradients each; returns ((master, m, v, weight) fused, the same from torch)."""
    hp = {**HP, **hp}
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen).to(DEVICE)                          # (n,) fp32
    ref = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], foreach=False, **hp)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    weight = master.to(torch.bfloat16)                                         # (n,) bf16
    for t in range(1, steps + 1):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(DEVICE, torch.bfloat16)  # (n,) bf16
        A.fused_adamw_(weight, grad, master, m, v, step=t, _kernel=kernel, block_size=block_size, **hp)
        ref.grad = grad.float()
        opt.step()
    st = opt.state[ref]
    return (master, m, v, weight), (ref.detach(), st["exp_avg"], st["exp_avg_sq"], ref.detach().to(torch.bfloat16))


@pytest.mark.parametrize("n, block_size", [(10_003, None), (1000, 256), (7, None)])
def test_matches_torch_adamw_over_steps(n, block_size):
    ours, theirs = _run(n=n, steps=4, block_size=block_size)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), ours[:3], theirs[:3]):
        torch.testing.assert_close(a, b, msg=lambda s, name=name: f"{name}: {s}")
    torch.testing.assert_close(ours[3], ours[0].to(torch.bfloat16), rtol=0, atol=0)  # w is the rounded master


def test_without_weight_decay_and_default_betas():
    ours, theirs = _run(steps=3, weight_decay=0.0, betas=(0.9, 0.999), lr=1e-3)
    for a, b in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kernel", [_coupled_decay_kernel, _no_bias_correction_kernel],
                         ids=["coupled-weight-decay", "no-bias-correction"])
def test_broken_variants_are_caught(kernel):
    ours, theirs = _run(steps=4, kernel=kernel)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours[0], theirs[0])


def test_byte_counts():
    assert A.state_bytes_per_param() == 16                                   # ZeRO's 2 + 2 + K, K = 12
    fused = A.fused_bytes_per_param()
    assert fused == {"read": 14, "write": 14, "total": 28}
    unfused = A.unfused_bytes_per_param()
    assert unfused["kernels"] == 10 and unfused["total"] == 92   # reads 54, writes 38
    assert unfused["read"] == 54 and unfused["write"] == 38


def test_bad_inputs_raise_clear_errors():
    n = 16
    w = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    p = torch.zeros(n, device=DEVICE)
    ok = dict(lr=1e-3, step=1)
    with pytest.raises(TypeError, match="grad must be torch.bfloat16"):
        A.fused_adamw_(w, p, p.clone(), p.clone(), p.clone(), **ok)
    with pytest.raises(TypeError, match="master must be torch.float32"):
        A.fused_adamw_(w, w.clone(), w.clone(), p.clone(), p.clone(), **ok)
    with pytest.raises(ValueError, match="elements"):
        A.fused_adamw_(w, w.clone(), p.clone(), p[:8].clone(), p.clone(), **ok)
    with pytest.raises(ValueError, match="contiguous"):
        A.fused_adamw_(w, w.clone(), torch.zeros(n, 2, device=DEVICE)[:, 0], p.clone(), p.clone(), **ok)
    with pytest.raises(ValueError, match="step counts from 1"):
        A.fused_adamw_(w, w.clone(), p.clone(), p.clone(), p.clone(), lr=1e-3, step=0)
    with pytest.raises(ValueError, match="betas"):
        A.fused_adamw_(w, w.clone(), p.clone(), p.clone(), p.clone(), betas=(1.0, 0.9), **ok)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        A.fused_adamw_(w, w.clone(), p.clone(), p.clone(), p.clone(), amsgrad=True, **ok)
    with pytest.raises(NotImplementedError, match="maximize"):
        A.fused_adamw_(w, w.clone(), p.clone(), p.clone(), p.clone(), maximize=True, **ok)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time: the launch at Llama sizes (n past 2**31)


def program_id_widened(ttgir: str) -> bool:
    from test_row_kernels_aot import program_id_widened as widened   # the GLU's check, reused
    return widened(ttgir)


@pytest.fixture(scope="module")
def builds():
    jobs = dict(A.compile_jobs())
    real = jobs["adamw Llama-3-8B, whole model"]
    jobs["broken: int32 offsets"] = TritonJob(_int32_offsets_kernel, real.signature, constexprs=real.constexprs,
                                              num_warps=real.num_warps, attrs=real.attrs)
    with pytest.MonkeyPatch.context() as mp:   # the compiler imports this module for the broken kernel
        tests_dir = str(Path(__file__).resolve().parent)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
        out = compile_triton_many(list(jobs.values()), archs=("sm90",))
    return {label: (job, b["sm90"]) for (label, job), b in zip(jobs.items(), out)}


def test_compile_jobs_are_the_launch(builds):
    job, b = builds["adamw Llama-3-8B, whole model"]
    assert job.signature["n"] == "i64"                     # 8.03e9 elements: Triton passes n as int64
    assert job.grid == (triton.cdiv(8_030_261_248, 1024),)
    assert b.metadata["num_warps"] == 4


def test_sm90_builds_do_not_spill_and_offsets_are_64_bit(builds):
    for label, (_, b) in builds.items():
        if label.startswith("broken"):
            continue
        assert b.arch.nvcc_arch == "sm_90a"
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, label
        assert program_id_widened(b.ttgir), f"{label}: program id * BLOCK computed in 32 bits"


def test_int32_variant_is_caught(builds):
    assert not program_id_widened(builds["broken: int32 offsets"][1].ttgir)
