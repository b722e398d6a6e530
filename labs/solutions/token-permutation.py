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

# %% wrong sort-by-expert: groups by expert but orders each group by choice rank, not by token (sorts the transposed ids)
def sort_by_expert(ids, num_experts):
    T, k = ids.shape
    col = torch.sort(ids.t().reshape(-1).long(), stable=True).indices   # index j*T + t
    order = (col % T) * k + col // T                                     # back to t*k + j
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return order, offsets

# %% wrong sort-by-expert: bincount without minlength, so empty experts at the end vanish from the offsets
def sort_by_expert(ids, num_experts):
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return order, offsets

# %% wrong sort-by-expert: offsets off by one (the inclusive prefix sum shifted into the starts: no leading zero)
def sort_by_expert(ids, num_experts):
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.full((num_experts + 1,), flat.numel(), dtype=torch.long)
    offsets[:-1] = counts.cumsum(0)
    return order, offsets

# %% solution unpermute
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    w = weights.reshape(-1)[order].float()                 # each sorted row's own gate weight
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    return out.index_add_(0, order // k, y_sorted.float() * w[:, None])

# %% wrong unpermute: forgets the gate weights (sums the k expert outputs unweighted)
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    return out.index_add_(0, order // k, y_sorted.float())

# %% wrong unpermute: reads the weights in row order instead of through order
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    w = weights.reshape(-1).float()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    return out.index_add_(0, order // k, y_sorted.float() * w[:, None])

# %% wrong unpermute: assigns instead of adding, so only one of a token's k outputs survives
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    w = weights.reshape(-1)[order].float()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    out[order // k] = y_sorted.float() * w[:, None]
    return out

# %% wrong unpermute: gathers rows in assignment order (row t*k + j) instead of scattering through order
def unpermute(y_sorted, order, weights):
    T, k = weights.shape
    rows = y_sorted.float().view(T, k, -1)
    return (rows * weights.float()[:, :, None]).sum(dim=1)
