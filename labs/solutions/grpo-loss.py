# Solutions for labs/12-rl/grpo-loss.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution group-advantages
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.float().view(-1, group_size)                       # (P, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)

# %% wrong group-advantages: normalizes with the whole batch's mean and std instead of each group's | hint: the whole batch's mean and std
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.float()
    return (r - r.mean()) / (r.std() + 1e-4)

# %% wrong group-advantages: no epsilon (a group rewarded alike divides 0 by 0) | hint: keep the + 1e-4
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.float().view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True)).reshape(-1)

# %% wrong group-advantages: the biased std (divides by G) | hint: the biased std
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.float().view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)).reshape(-1)

# %% wrong group-advantages: calls the course's advantages | hint: write it yourself
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    from kernels.rl.grpo import group_advantages_ref
    return group_advantages_ref(rewards, group_size)

# %% solution grpo-loss
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]           # (B, 1)
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: advantages from the batch's statistics, not the group's | hint: Task 1's group advantages
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    r = rewards.float()
    adv = ((r - r.mean()) / (r.std() + 1e-4))[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: the token-level mean (DAPO's average), not the per-sequence mean | hint: the mean over all tokens
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return (per_token * mask).sum() / mask.sum()

# %% wrong grpo-loss: the min of the two terms (the clip on the wrong side) | hint: the min of the two terms
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: the KL to the sampling policy (old_logp) instead of the reference model | hint: not to the sampling policy
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = old_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: the ratio detached (its value right, its gradient gone) | hint: a term is detached from logp
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    adv = group_advantages(rewards, group_size)[:, None]
    ratio = torch.exp(logp - old_logp).detach()
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    u = ref_logp - logp
    per_token = surrogate + beta * (torch.exp(u) - 1 - u)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: the whole loss under torch.no_grad() (no gradient at all) | hint: no gradient
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    with torch.no_grad():
        adv = group_advantages(rewards, group_size)[:, None]
        ratio = torch.exp(logp - old_logp)
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
        u = ref_logp - logp
        per_token = surrogate + beta * (torch.exp(u) - 1 - u)
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()

# %% wrong grpo-loss: calls the course's loss | hint: write it yourself
def grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=0.2, beta=0.04):
    from kernels.rl.grpo import grpo_loss_ref
    return grpo_loss_ref(logp, old_logp, ref_logp, rewards, mask, group_size, clip_eps=clip_eps, beta=beta)
