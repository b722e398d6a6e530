# Solutions for labs/08-kv-cache/kv-eviction-policies.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution streaming
def streaming_keep(P, budget, sinks):
    recent = torch.arange(P - (budget - sinks), P)      # the last budget - sinks positions
    return torch.cat([torch.arange(sinks), recent])

# %% wrong streaming: no sinks, the whole budget goes to the recent window
def streaming_keep(P, budget, sinks):
    return torch.arange(P - budget, P)

# %% wrong streaming: the recent window is shifted left by the sinks and misses the newest tokens
def streaming_keep(P, budget, sinks):
    return torch.cat([torch.arange(sinks), torch.arange(P - budget, P - sinks)])

# %% solution accumulate
def accumulated_attention(probs):
    return probs.sum(dim=(2, 3))                        # over the group's heads and every query row

# %% wrong accumulate: only the last query row (the newest token's attention), not the accumulation
def accumulated_attention(probs):
    return probs[..., -1, :].sum(dim=2)

# %% wrong accumulate: only the group's first query head
def accumulated_attention(probs):
    return probs[:, :, 0].sum(dim=2)

# %% solution h2o
def h2o_keep(scores, budget, recent):
    P = scores.shape[-1]
    heavy = scores[..., :P - recent].topk(budget - recent, dim=-1).indices
    tail = torch.arange(P - recent, P).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values

# %% wrong h2o: ranks the recent positions too, so a high-scoring recent key takes a heavy-hitter place twice
def h2o_keep(scores, budget, recent):
    P = scores.shape[-1]
    heavy = scores.topk(budget - recent, dim=-1).indices
    tail = torch.arange(P - recent, P).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values

# %% wrong h2o: keeps the first positions as the "recent" window (confuses it with sinks)
def h2o_keep(scores, budget, recent):
    heavy = scores[..., recent:].topk(budget - recent, dim=-1).indices + recent
    head = torch.arange(recent).expand(*scores.shape[:-1], recent)
    return torch.cat([head, heavy], dim=-1).sort(dim=-1).values

# %% solution mean
def mean_attention(probs):
    P = probs.shape[-1]
    relative = probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]       # row i against uniform 1/(i+1)
    return relative.sum(dim=(2, 3)) / torch.arange(P, 0, -1, dtype=probs.dtype)  # mean over the P - j rows

# %% wrong mean: divides the column sum by P - j only, so early rows (few keys, large probabilities) still weigh more
def mean_attention(probs):
    P = probs.shape[-1]
    return probs.sum(dim=(2, 3)) / torch.arange(P, 0, -1, dtype=probs.dtype)

# %% wrong mean: divides by P for every key instead of the P - j rows that see key j
def mean_attention(probs):
    P = probs.shape[-1]
    return (probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]).sum(dim=(2, 3)) / P
