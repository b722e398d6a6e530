"""Generalized advantage estimation (Schulman et al. 2016) over token trajectories.

A completion is an episode whose steps are its tokens; step t has reward r_t (the KL penalty, plus the
task reward on the last token) and the critic's value V_t. With V_T = 0 after the last token,

    delta_t = r_t + gamma V_{t+1} - V_t                    (one-step TD error)
    A_t     = delta_t + gamma lambda A_{t+1},  A_T = 0     (= sum_k (gamma lambda)^k delta_{t+k})
    R_t     = A_t + V_t                                    (the value target, the lambda-return)

lambda = 0 gives the one-step TD advantage (low variance, biased by the critic); lambda = 1 gives the
Monte Carlo return minus the baseline (unbiased, high variance). The recurrence runs backward in time,
so the kernel gives each program a block of trajectories and walks their T steps from the end; a
mask (B, T) marks the real tokens (padding after a completion's end is skipped: its A and R are 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime

BLOCK_B = 64


def gae_ref(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
            lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, T), by the backward recurrence in PyTorch."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_v = torch.zeros(B, dtype=rewards.dtype)
    next_a = torch.zeros(B, dtype=rewards.dtype)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = a * m
        next_v = torch.where(m > 0, values[:, t], next_v)   # padding keeps the next real step's value (0 at the end)
        next_a = torch.where(m > 0, a, next_a)
    return adv, (adv + values) * mask


@triton.jit
def _gae_kernel(r_ptr, v_ptr, m_ptr, a_ptr, ret_ptr, B, T, gamma, lam,
                BLOCK_B: tl.constexpr, BOOTSTRAP: tl.constexpr = True):
    """BLOCK_B trajectories per program, walking t = T-1 .. 0. BOOTSTRAP=False (broken) drops gamma V_{t+1}."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = rows < B
    base = rows.to(tl.int64) * T
    next_v = tl.zeros((BLOCK_B,), tl.float32)
    next_a = tl.zeros((BLOCK_B,), tl.float32)
    for i in range(0, T):
        t = T - 1 - i
        m = tl.load(m_ptr + base + t, mask=ok, other=0.0)
        r = tl.load(r_ptr + base + t, mask=ok, other=0.0)
        v = tl.load(v_ptr + base + t, mask=ok, other=0.0)
        if BOOTSTRAP:
            delta = r + gamma * next_v - v                      # delta_t = r_t + gamma V_{t+1} - V_t
        else:
            delta = r - v
        a = delta + gamma * lam * next_a                        # A_t = delta_t + gamma lambda A_{t+1}
        real = m > 0
        tl.store(a_ptr + base + t, tl.where(real, a, 0.0), mask=ok)
        tl.store(ret_ptr + base + t, tl.where(real, a + v, 0.0), mask=ok)
        next_v = tl.where(real, v, next_v)
        next_a = tl.where(real, a, next_a)


def _gae_args(r, v, m, adv, ret, gamma: float, lam: float, bootstrap: bool):
    """(grid, args, kwargs) of the GAE launch over (B, T), BLOCK_B sequences a program; shared by
    :func:`gae` and :func:`aot_job`."""
    B, T = r.shape
    return ((triton.cdiv(B, BLOCK_B),), (r, v, m, adv, ret, B, T, float(gamma), float(lam)),
            dict(BLOCK_B=BLOCK_B, BOOTSTRAP=bootstrap, num_warps=2))


def aot_job(batch: int = 512, steps: int = 1024):
    """The launch :func:`gae` makes for ``batch`` sequences of ``steps`` tokens, built from meta tensors
    by :func:`kernels.inspect.launch_job` (Triton's own specialisation)."""
    from kernels import inspect as ki

    r = torch.empty(batch, steps, dtype=torch.float32, device="meta")      # (B, T): rewards, values, mask, outputs
    grid, args, kwargs = _gae_args(r, r, r, r, r, 1.0, 0.95, True)
    return ki.launch_job(_gae_kernel, *args, grid=grid, **kwargs)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95,
        *, bootstrap: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae_ref` as a Triton kernel; all (B, T), fp32 out. ``bootstrap=False`` is the broken variant."""
    for name, x in (("rewards", rewards), ("values", values), ("mask", mask)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"gae: {name} must be a (B, T) tensor")
        if x.shape != rewards.shape:
            raise ValueError(f"gae: {name} has shape {tuple(x.shape)}, rewards have {tuple(rewards.shape)}")
        if x.device.type != runtime.device().type:
            raise ValueError(f"gae: {name} is on {x.device}; kernels run on {runtime.device()}")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gae: gamma and lam must be in [0, 1], got {gamma} and {lam}")
    r, v, m = (x.detach().float().contiguous() for x in (rewards, values, mask))
    B, T = r.shape
    adv, ret = torch.empty_like(r), torch.empty_like(r)
    if B and T:
        grid, args, kwargs = _gae_args(r, v, m, adv, ret, gamma, lam, bootstrap)
        _gae_kernel[grid](*args, **kwargs)
    return adv, ret


def compile_jobs() -> dict:
    """GAE over 512 sequences of 1024 tokens (fp32)."""
    return {"GAE, 512 sequences x 1024 tokens": aot_job(512, 1024)}
