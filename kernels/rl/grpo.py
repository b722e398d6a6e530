"""GRPO: the group of answers to one prompt as its own baseline, and how the loss averages tokens.

For a prompt, sample G completions o_1..o_G with rewards r_1..r_G; each completion's advantage is its
reward against the group's (DeepSeekMath, Shao et al. 2024):

    A_i = (r_i - mean(r)) / (std(r) + eps)          (Dr. GRPO, Liu et al. 2025: A_i = r_i - mean(r))

and every token of o_i carries A_i into the PPO-clipped surrogate (kernels.rl.ppo) with a k3 KL to the
reference model. No value network: the group mean is the baseline a critic would have learned.

How the per-token terms l_{i,t} become one number is a choice with consequences (aggregation_weights):

    "sequence":  (1/G) sum_i (1/|o_i|) sum_t l_{i,t}     GRPO as published: a long answer's tokens weigh less
    "token":     sum_i sum_t l_{i,t} / sum_i |o_i|        DAPO (Yu et al. 2025): every token weighs the same
    "constant":  sum_i sum_t l_{i,t} / (G * L_max)        Dr. GRPO: a constant, no length in the denominator

``python -m kernels.rl.grpo`` trains the SFT checkpoint (models/rl/sft) with GRPO on the addition task
and writes models/rl/grpo/{log.csv, metrics.json}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from tqdm import tqdm

from kernels import runtime
from kernels.rl import sft, task
from kernels.rl.ppo import ppo_loss, ppo_loss_ref

AGGREGATIONS = ("sequence", "token", "constant")


def group_advantages_ref(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (group std + eps), std unbiased; ``scale=False`` is Dr. GRPO's r - mean. rewards (P*G,)."""
    r = rewards.float().view(-1, group_size)                                   # (P, G)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, keepdim=True) + eps)
    return a.reshape(-1)


@triton.jit
def _group_advantage_kernel(r_ptr, a_ptr, G, eps, BLOCK_G: tl.constexpr, SCALE: tl.constexpr,
                            CENTER: tl.constexpr = True):
    """One program per group of G rewards: A = (r - mean) / (std + eps). CENTER=False (broken) skips the mean."""
    g = tl.program_id(0)
    offs = tl.arange(0, BLOCK_G)
    ok = offs < G
    base = g.to(tl.int64) * G
    r = tl.load(r_ptr + base + offs, mask=ok, other=0.0)
    mean = tl.sum(r, axis=0) / G
    dev = tl.where(ok, r - mean, 0.0)
    a = dev if CENTER else r
    if SCALE:
        std = tl.sqrt(tl.sum(dev * dev, axis=0) / (G - 1))                     # unbiased, as torch.std
        a = a / (std + eps)
    tl.store(a_ptr + base + offs, a, mask=ok)


def _advantage_args(r, a, group_size: int, eps: float, scale: bool, center: bool):
    """(grid, args, kwargs) of the advantage launch, one program per group; shared by
    :func:`group_advantages` and :func:`aot_job`."""
    return ((r.numel() // group_size,), (r, a, group_size, float(eps)),
            dict(BLOCK_G=triton.next_power_of_2(group_size), SCALE=scale, CENTER=center, num_warps=1))


def aot_job(group_size: int = 16, prompts: int = 512):
    """The launch :func:`group_advantages` makes for ``prompts`` groups of ``group_size`` rewards, built
    from meta tensors by :func:`kernels.inspect.launch_job` (Triton's own specialisation)."""
    from kernels import inspect as ki

    r = torch.empty(prompts * group_size, dtype=torch.float32, device="meta")   # (P * G,) rewards
    grid, args, kwargs = _advantage_args(r, torch.empty_like(r), group_size, 1e-4, True, True)
    return ki.launch_job(_group_advantage_kernel, *args, grid=grid, **kwargs)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4,
                     center: bool = True) -> torch.Tensor:
    """:func:`group_advantages_ref` as a Triton kernel; rewards (P * group_size,) float. ``center=False`` is broken."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise ValueError("group_advantages: rewards must be a 1-D floating-point tensor")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: group_size must be >= 2 and divide {rewards.numel()}, got {group_size}")
    if rewards.device.type != runtime.device().type:
        raise ValueError(f"group_advantages: rewards are on {rewards.device}; kernels run on {runtime.device()}")
    r = rewards.float().contiguous()
    a = torch.empty_like(r)
    P = r.numel() // group_size
    if P:
        grid, args, kwargs = _advantage_args(r, a, group_size, eps, scale, center)
        _group_advantage_kernel[grid](*args, **kwargs)
    return a


def aggregation_weights(mask: torch.Tensor, how: str) -> torch.Tensor:
    """Per-token weights w (B, T) with loss = sum w * l; mask (B, T) is 1 on real completion tokens."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    m = mask.float()
    if how == "sequence":
        return m / (m.sum(1, keepdim=True).clamp_min(1) * m.shape[0])        # (1/G) sum_i (1/|o_i|) sum_t
    if how == "token":
        return m / m.sum().clamp_min(1)                                       # sum_{i,t} / sum_i |o_i|
    return m / m.numel()                                                      # sum_{i,t} / (B * L_max)


def grpo_loss_ref(logp, old_logp, ref_logp, rewards, mask, group_size, *, aggregation="sequence",
                  scale=True, clip_eps=0.2, beta=0.04):
    """The GRPO objective in PyTorch: group advantages broadcast over each completion's tokens."""
    adv = group_advantages_ref(rewards, group_size, scale=scale)[:, None].expand_as(logp)
    return ppo_loss_ref(logp, old_logp, ref_logp, adv, aggregation_weights(mask, aggregation),
                        clip_eps=clip_eps, beta=beta, kl="k3")


def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, *, aggregation="sequence",
              scale=True, clip_eps=0.2, beta=0.04, return_stats=False):
    """GRPO with the two kernels: group advantages, then the fused PPO token kernel (k3 KL)."""
    if logp.dim() != 2 or rewards.shape != logp.shape[:1]:
        raise ValueError(f"grpo_loss: logp must be (B, T) and rewards (B,), got {tuple(logp.shape)} and "
                         f"{tuple(rewards.shape)}")
    adv = group_advantages(rewards, group_size, scale=scale)[:, None].expand_as(logp)
    return ppo_loss(logp, old_logp, ref_logp, adv, aggregation_weights(mask, aggregation), clip_eps=clip_eps,
                    beta=beta, kl="k3", return_stats=return_stats)


# ---------------------------------------------------------------- the run

def rollout(policy, pairs: torch.Tensor, group_size: int, gen: torch.Generator, temperature: float = 1.0) -> dict:
    """G samples for each of the pairs: completions (P*G, L), their pairs, mask and rewards."""
    rep = pairs.repeat_interleave(group_size, 0)                              # (P*G, 2)
    comp = task.sample(policy, rep, temperature=temperature, generator=gen)
    return {"pairs": rep, "completions": comp, "mask": task.completion_mask(comp),
            "rewards": task.rewards(comp, rep)}


def train_grpo(out_dir: Path | None, *, steps: int = 50, prompts_per_step: int = 32, group_size: int = 8,
               inner_steps: int = 2, lr: float = 1e-4, beta: float = 0.04, clip_eps: float = 0.2,
               aggregation: str = "sequence", eval_every: int = 10, seed: int = 0, threads: int = 1,
               progress: bool = True, stop_after: int | None = None) -> dict:
    """GRPO from the SFT checkpoint; each step samples prompts_per_step x group_size completions with
    the current policy (pi_old), then takes ``inner_steps`` AdamW steps on them. Returns {"log", "model"};
    ``stop_after`` ends the run early (a few steps to check a log)."""
    policy, reference = sft.policy_and_reference(seed, threads)
    train_pairs, held_out = task.split_pairs()
    gen = torch.Generator().manual_seed(seed)
    opt = sft.adamw(policy.parameters(), lr)
    log = [{"step": 0, "reward": "", "kl": "", "clip_fraction": "", "held_out_accuracy": task.accuracy(policy, held_out)}]
    start = time.perf_counter()
    bar = tqdm(range(1, (stop_after or steps) + 1), desc="grpo", disable=not progress)
    for step in bar:
        pick = train_pairs[torch.randint(0, len(train_pairs), (prompts_per_step,), generator=gen)]
        ro = rollout(policy, pick, group_size, gen)
        with torch.no_grad():
            old = task.completion_logprobs(policy, ro["completions"], ro["pairs"])
            ref = task.completion_logprobs(reference, ro["completions"], ro["pairs"])
        for _ in range(inner_steps):
            logp = task.completion_logprobs(policy, ro["completions"], ro["pairs"])
            loss, stats = grpo_loss(logp, old, ref, ro["rewards"], ro["mask"], group_size, aggregation=aggregation,
                                    clip_eps=clip_eps, beta=beta, return_stats=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        row = {"step": step, "reward": round(float(ro["rewards"].mean()), 5), "kl": round(stats["kl"], 6),
               "clip_fraction": round(stats["clip_fraction"], 5), "held_out_accuracy": ""}
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = task.accuracy(policy, held_out)
            bar.set_postfix(reward=f"{row['reward']:.2f}", acc=f"{row['held_out_accuracy']:.3f}")
        log.append(row)
    policy.eval()
    if out_dir is not None:
        sft.save_run(out_dir, policy, log, {
            "steps": steps, "prompts_per_step": prompts_per_step, "group_size": group_size,
            "inner_steps": inner_steps, "lr": lr, "beta": beta, "clip_eps": clip_eps, "aggregation": aggregation,
            "seed": seed, "threads": threads, "train_seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__, "command": "python -m kernels.rl.grpo"}, checkpoint=False)
    return {"log": log, "model": policy}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.rl.grpo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--out", type=Path, default=sft.OUT_DIR / "grpo")
    args = p.parse_args(argv)
    out = args.out
    train_grpo(out, steps=args.steps, lr=args.lr, prompts_per_step=args.prompts, beta=args.beta)
    print(json.loads((out / "metrics.json").read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def compile_jobs() -> dict:
    """DeepSeekMath's GRPO group of 64 samples and a group of 16, for 512 prompts."""
    return {f"group advantages, {P} prompts x G={G}": aot_job(G, P) for G, P in ((16, 512), (64, 512))}
