"""A PPO run on the addition task: the tiny GPT as the policy, a linear value head, GAE, the fused loss.

Each step samples one answer to each of ``prompts_per_step`` training prompts with the current policy,
forms per-token rewards as InstructGPT did (a KL penalty -beta_kl (log pi_old - log pi_ref) on every
token, plus the verifier's reward on the answer's last token), estimates advantages and value targets
with GAE (kernels.rl.gae, gamma = 1, lambda = 0.95) from the value head's estimates, whitens the
advantages over the batch's tokens, and takes ``inner_steps`` AdamW steps on the clipped surrogate plus
the clipped value loss (kernels.rl.ppo.ppo_loss). The value head reads the policy's final hidden state,
detached: a linear critic on the policy's features, so the value loss does not move the policy.

``python -m kernels.rl.ppo_run`` starts from models/rl/sft and writes models/rl/ppo/{log.csv, metrics.json}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from kernels.rl import sft, task
from kernels.rl.gae import gae
from kernels.rl.ppo import ppo_loss


def policy_and_values(model, head: nn.Linear, completions: torch.Tensor, pairs: torch.Tensor):
    """(log pi of each completion token (B, L), value of the state before it (B, L)), from one forward."""
    seqs = torch.cat([task.prompts(pairs), completions], dim=1)
    hidden = model(seqs[:, :-1], return_hidden=True)[:, task.PROMPT_LEN - 1:]        # (B, L, C)
    logp = torch.log_softmax(hidden @ model.wte.weight.T, -1).gather(-1, completions[..., None]).squeeze(-1)
    return logp, head(hidden.detach()).squeeze(-1)


def token_rewards(rewards: torch.Tensor, old_logp, ref_logp, mask, kl_coef: float) -> torch.Tensor:
    """r_t = -kl_coef (log pi_old - log pi_ref) on every real token, plus the task reward on the last one."""
    r = -kl_coef * (old_logp - ref_logp) * mask
    last = mask.sum(1).long() - 1                                                     # index of END (or L - 1)
    r[torch.arange(len(r)), last] += rewards
    return r


def train_ppo(out_dir: Path | None, *, steps: int = 50, prompts_per_step: int = 256, inner_steps: int = 2,
              lr: float = 1e-4, value_lr: float = 1e-3, kl_coef: float = 0.02, clip_eps: float = 0.2,
              gamma: float = 1.0, lam: float = 0.95, eval_every: int = 10, seed: int = 0, progress: bool = True,
              stop_after: int | None = None) -> dict:
    policy, reference = sft.policy_and_reference(seed, 1)
    head = nn.Linear(policy.config.d_model, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    train_pairs, held_out = task.split_pairs()
    gen = torch.Generator().manual_seed(seed)
    opt = sft.adamw([{"params": policy.parameters(), "lr": lr}, {"params": head.parameters(), "lr": value_lr}], lr)
    log = [{"step": 0, "reward": "", "kl": "", "clip_fraction": "", "value_error": "",
            "held_out_accuracy": task.accuracy(policy, held_out)}]
    start = time.perf_counter()
    for step in tqdm(range(1, (stop_after or steps) + 1), desc="ppo", disable=not progress):
        pairs = train_pairs[torch.randint(0, len(train_pairs), (prompts_per_step,), generator=gen)]
        comp = task.sample(policy, pairs, temperature=1.0, generator=gen)
        mask, rewards = task.completion_mask(comp), task.rewards(comp, pairs)
        with torch.no_grad():
            old_logp, old_values = policy_and_values(policy, head, comp, pairs)
            ref_logp = task.completion_logprobs(reference, comp, pairs)
            adv, returns = gae(token_rewards(rewards, old_logp, ref_logp, mask, kl_coef), old_values, mask, gamma, lam)
            mu = (adv * mask).sum() / mask.sum()
            sd = (((adv - mu) ** 2 * mask).sum() / mask.sum()).sqrt()
            adv = (adv - mu) / (sd + 1e-8) * mask                                     # whitened over the batch
        w = mask / mask.sum()
        for _ in range(inner_steps):
            logp, values = policy_and_values(policy, head, comp, pairs)
            loss, stats = ppo_loss(logp, old_logp, ref_logp, adv, w, clip_eps=clip_eps, beta=0.0, values=values,
                                   old_values=old_values, returns=returns, return_stats=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        value_error = float((((old_values - returns) ** 2) * w).sum())
        row = {"step": step, "reward": round(float(rewards.mean()), 5),
               "kl": round(float(((old_logp - ref_logp) * w).sum()), 6), "clip_fraction": round(stats["clip_fraction"], 5),
               "value_error": round(value_error, 5), "held_out_accuracy": ""}
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = task.accuracy(policy, held_out)
        log.append(row)
    if out_dir is not None:
        sft.save_run(out_dir, policy, log, {
            "steps": steps, "prompts_per_step": prompts_per_step, "inner_steps": inner_steps, "lr": lr,
            "value_lr": value_lr, "kl_coef": kl_coef, "clip_eps": clip_eps, "gamma": gamma, "lam": lam, "seed": seed,
            "train_seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
            "command": "python -m kernels.rl.ppo_run"}, checkpoint=False)
    return {"log": log}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.rl.ppo_run", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=sft.OUT_DIR / "ppo")
    args = p.parse_args(argv)
    train_ppo(args.out, steps=args.steps)
    print(json.loads((args.out / "metrics.json").read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
