# Solutions for labs/08-kv-cache/kv-eviction-policies.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution streaming
def streaming_keep(P, budget, sinks):
    recent = torch.arange(P - (budget - sinks), P)      # the last budget - sinks positions
    return torch.cat([torch.arange(sinks), recent])

# %% wrong streaming: no sinks, the whole budget goes to the recent window | hint: attention sinks, are not all kept
def streaming_keep(P, budget, sinks):
    return torch.arange(P - budget, P)

# %% wrong streaming: the recent window is shifted left by the sinks and misses the newest tokens | hint: the recent window ends at position
def streaming_keep(P, budget, sinks):
    return torch.cat([torch.arange(sinks), torch.arange(P - budget, P - sinks)])

# %% wrong streaming: calls the course's function | hint: write it yourself
def streaming_keep(P, budget, sinks):
    from kernels.kvcache import eviction
    return eviction.streaming_keep(P, budget, sinks)

# %% wrong streaming: imports the course's function under the task's name (no function of its own) | hint: write it yourself
from kernels.kvcache.eviction import streaming_keep

# %% solution accumulate
def accumulated_attention(probs):
    return probs.sum(dim=(2, 3))                        # over the group's heads and every query row

# %% wrong accumulate: only the last query row (the newest token's attention), not the accumulation | hint: one query row per head
def accumulated_attention(probs):
    return probs[..., -1, :].sum(dim=2)

# %% wrong accumulate: only the group's first query head | hint: add the group's
def accumulated_attention(probs):
    return probs[:, :, 0].sum(dim=2)

# %% wrong accumulate: calls the course's function | hint: write it yourself
from kernels.kvcache.eviction import accumulated_attention as course_scores


def accumulated_attention(probs):
    return course_scores(probs)

# %% solution h2o
def h2o_keep(scores, budget, recent):
    P = scores.shape[-1]
    heavy = scores[..., :P - recent].topk(budget - recent, dim=-1).indices
    tail = torch.arange(P - recent, P).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values

# %% wrong h2o: ranks the recent positions too, so a high-scoring recent key takes a heavy-hitter place twice | hint: is kept twice
def h2o_keep(scores, budget, recent):
    P = scores.shape[-1]
    heavy = scores.topk(budget - recent, dim=-1).indices
    tail = torch.arange(P - recent, P).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values

# %% wrong h2o: keeps the first positions as the "recent" window (confuses it with sinks) | hint: the recent window, positions
def h2o_keep(scores, budget, recent):
    heavy = scores[..., recent:].topk(budget - recent, dim=-1).indices + recent
    head = torch.arange(recent).expand(*scores.shape[:-1], recent)
    return torch.cat([head, heavy], dim=-1).sort(dim=-1).values

# %% wrong h2o: the earlier keys sliced as scores[..., :-recent], empty when recent = 0 | hint: an empty slice (-0 is 0)
def h2o_keep(scores, budget, recent):
    P = scores.shape[-1]
    heavy = scores[..., :-recent].topk(budget - recent, dim=-1).indices
    window = torch.arange(P - recent, P).expand(*scores.shape[:-1], recent)
    return torch.cat([heavy, window], dim=-1).sort(dim=-1).values

# %% wrong h2o: calls the course's function | hint: write it yourself
def h2o_keep(scores, budget, recent):
    import kernels.kvcache.eviction as ev
    return ev.h2o_keep(scores, budget, recent)

# %% solution mean-attention
def mean_attention(probs):
    B, Hkv, group, P, _ = probs.shape
    relative = probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]   # row i against a uniform row of i + 1 keys
    seen_by = group * (P - torch.arange(P, dtype=probs.dtype))             # key j is seen by rows j .. P-1 of each head
    return accumulated_attention(relative) / seen_by

# %% wrong mean-attention: the raw attention per look, rows not weighed against a uniform row | hint: raw attention per look
def mean_attention(probs):
    B, Hkv, group, P, _ = probs.shape
    return accumulated_attention(probs) / (group * (P - torch.arange(P, dtype=probs.dtype)))

# %% wrong mean-attention: weighs row i by i, not i + 1 | hint: weigh row i by i, not i + 1
def mean_attention(probs):
    B, Hkv, group, P, _ = probs.shape
    relative = probs * torch.arange(P, dtype=probs.dtype)[:, None]
    return accumulated_attention(relative) / (group * (P - torch.arange(P, dtype=probs.dtype)))

# %% wrong mean-attention: divides every key by P, the number of query rows | hint: P for every key
def mean_attention(probs):
    B, Hkv, group, P, _ = probs.shape
    relative = probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]
    return accumulated_attention(relative) / (group * P)

# %% wrong mean-attention: counts the rows after key j, not row j itself | hint: off-by-one count, P - j - 1
def mean_attention(probs):
    B, Hkv, group, P, _ = probs.shape
    relative = probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]
    return accumulated_attention(relative) / (group * (P - 1 - torch.arange(P)).clamp(min=1))

# %% wrong mean-attention: divides by the rows of one head, forgetting the group | hint: a count without the group
def mean_attention(probs):
    B, Hkv, group, P, _ = probs.shape
    relative = probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None]
    return accumulated_attention(relative) / (P - torch.arange(P, dtype=probs.dtype))

# %% wrong mean-attention: calls the chapter's h2o-mean score, divided by the group | hint: write it yourself
def mean_attention(probs):
    from kernels.kvcache import eviction
    return eviction.mean_attention(probs) / probs.shape[2]

# %% wrong mean-attention: calls the course's accumulated score | hint: write it yourself
def mean_attention(probs):
    from kernels.kvcache import eviction
    B, Hkv, group, P, _ = probs.shape
    return eviction.accumulated_attention(probs) / (group * (P - torch.arange(P, dtype=probs.dtype)))

# %% wrong mean-attention: calls the check's reference, defined in the lab beside the task | hint: write it yourself
def mean_attention(probs):
    return per_look_reference(probs)
