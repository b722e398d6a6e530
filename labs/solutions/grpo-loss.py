# Solutions for labs/12-rl/grpo-loss.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution group-advantages
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.float().view(-1, group_size)                       # (P, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)

# %% wrong group-advantages: normalizes with the whole batch's mean and std instead of each group's
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.float()
    return (r - r.mean()) / (r.std() + 1e-4)

# %% solution grpo-loss
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]           # (B, 1)
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: advantages from the batch's statistics, not the group's
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    r = rewards.float()
    adv = ((r - r.mean()) / (r.std() + 1e-4))[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: the token-level mean (DAPO's average), not the per-sequence mean
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return (per_token * mask).sum() / mask.sum()

# %% wrong grpo-loss: the min of the two terms (the clip on the wrong side)
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: the KL to the sampling policy (old_logp) instead of the reference model
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = old_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()
