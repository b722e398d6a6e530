# Solutions for labs/16-moe/token-permutation.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution sort-by-expert
def sort_by_expert(ids, num_experts):
    flat = ids.reshape(-1).long()                          # assignment t*k + j -> its expert
    order = torch.sort(flat, stable=True).indices          # grouped by expert, token order inside
    counts = torch.bincount(flat, minlength=num_experts)   # every expert's load, zeros included
    offsets = torch.zeros(num_experts + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return order, offsets

# %% wrong sort-by-expert: groups by expert but orders each group by choice rank, not by token (sorts the transposed ids) | hint: lists its tokens out of order
def sort_by_expert(ids, num_experts):
    T, k = ids.shape
    col = torch.sort(ids.t().reshape(-1).long(), stable=True).indices   # index j*T + t
    order = (col % T) * k + col // T                                     # back to t*k + j
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return order, offsets

# %% wrong sort-by-expert: bincount without minlength, so empty experts at the end vanish from the offsets | hint: still has an (empty) group
def sort_by_expert(ids, num_experts):
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return order, offsets

# %% wrong sort-by-expert: offsets off by one (the inclusive prefix sum shifted into the starts: no leading zero) | hint: offsets[0] is not 0
def sort_by_expert(ids, num_experts):
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.full((num_experts + 1,), flat.numel(), dtype=torch.long)
    offsets[:-1] = counts.cumsum(0)
    return order, offsets

# %% wrong sort-by-expert: calls the course's sort | hint: write it yourself
def sort_by_expert(ids, num_experts):
    from kernels.moe.permute import sort_by_expert as course_sort
    return course_sort(ids, num_experts)

# %% solution unpermute
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    w = weights.reshape(-1)[order].float()                 # each sorted row's own gate weight
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    return out.index_add_(0, order // k, y_sorted.float() * w[:, None])

# %% wrong unpermute: forgets the gate weights (sums the k expert outputs unweighted) | hint: the gate weights are missing
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    return out.index_add_(0, order // k, y_sorted.float())

# %% wrong unpermute: reads the weights in row order instead of through order | hint: read the weight through order[r]
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    w = weights.reshape(-1).float()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    return out.index_add_(0, order // k, y_sorted.float() * w[:, None])

# %% wrong unpermute: assigns instead of adding, so only one of a token's k outputs survives | hint: add the rows into the output
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    w = weights.reshape(-1)[order].float()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    out[order // k] = y_sorted.float() * w[:, None]
    return out

# %% wrong unpermute: gathers rows in assignment order (row t*k + j) instead of scattering through order | hint: the rows are sorted by expert
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    rows = y_sorted.float().view(T, k, -1)
    return (rows * weights.float()[:, :, None]).sum(dim=1)

# %% wrong unpermute: calls the course's combine | hint: write it yourself
import kernels.moe.permute


def unpermute(y_sorted, order, weights):
    return kernels.moe.permute.unpermute_ref(y_sorted, order, weights)

# %% solution capacity
def keep_mask(ids, num_experts, cap):
    T, k = ids.shape
    by_priority = ids.t().reshape(-1).long()                       # (k*T,): all first choices, then all second ...
    onehot = torch.nn.functional.one_hot(by_priority, num_experts)  # (k*T, E)
    slot = (onehot.cumsum(0) - 1).gather(1, by_priority[:, None])[:, 0]   # assignments to the same expert ahead of it
    return (slot < cap).view(k, T).t()

# %% wrong capacity: token order first (a token's second choice before the next token's first) | hint: the priority is choice rank first
def keep_mask(ids, num_experts, cap):
    flat = ids.reshape(-1).long()
    onehot = torch.nn.functional.one_hot(flat, num_experts)
    slot = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]
    return (slot < cap).view(ids.shape)

# %% wrong capacity: slot <= cap, one assignment too many per expert | hint: more than its cap
def keep_mask(ids, num_experts, cap):
    T, k = ids.shape
    by_priority = ids.t().reshape(-1).long()
    onehot = torch.nn.functional.one_hot(by_priority, num_experts)
    slot = (onehot.cumsum(0) - 1).gather(1, by_priority[:, None])[:, 0]
    return (slot <= cap).view(k, T).t()

# %% wrong capacity: a Python loop that reads each expert id back to the host | hint: reads a value back to the host
def keep_mask(ids, num_experts, cap):
    T, k = ids.shape
    taken = [0] * num_experts
    keep = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for t in range(T):
            e = int(ids[t, j])
            keep[t, j] = taken[e] < cap
            taken[e] += 1
    return keep

# %% wrong capacity: one pass per expert through nonzero (each nonzero reads its count back to the host) | hint: reads that count back to the host
def keep_mask(ids, num_experts, cap):
    T, k = ids.shape
    by_priority = ids.t().reshape(-1).long()
    keep = torch.ones(k * T, dtype=torch.bool)
    for e in range(num_experts):
        keep[(by_priority == e).nonzero()[cap:, 0]] = False     # this expert's assignments past its cap
    return keep.view(k, T).t()

# %% wrong capacity: calls the course's mask | hint: write it yourself
def keep_mask(ids, num_experts, cap):
    from kernels.moe.router import keep_mask as course_mask
    return course_mask(ids, num_experts, cap)
