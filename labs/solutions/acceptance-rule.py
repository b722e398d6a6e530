# Solutions for labs/10-speculative/acceptance-rule.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution accept-probability
def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    ratio = p / torch.where(q > 0, q, torch.ones_like(q))          # no division by zero where q == 0
    return torch.where(q > 0, ratio.clamp(max=1.0), torch.zeros_like(q))

# %% wrong accept-probability: keeps a draft exactly when p >= q and never otherwise (it biases the output) | hint: keeps a draft exactly when p(x) >= q(x)
def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p >= q).to(p.dtype)

# %% wrong accept-probability: p / q without the min with 1 (a "probability" above 1) | hint: stays in [0, 1]
def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.where(q > 0, p / torch.where(q > 0, q, torch.ones_like(q)), torch.zeros_like(q))

# %% wrong accept-probability: min(1, q / p), the ratio upside down | hint: upside down
def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.where(q > 0, (q / p).clamp(max=1.0), torch.zeros_like(q))

# %% wrong accept-probability: calls the course's rule | hint: write it yourself
def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    from kernels.speculative.sampling import accept_probability_ref
    return accept_probability_ref(p, q)

# %% solution residual
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)                                         # (rows, V)
    z = r.sum(-1, keepdim=True)
    return torch.where(z > 0, r / torch.where(z > 0, z, torch.ones_like(z)), p)

# %% wrong residual: resamples from p itself (the draft's accepted mass is counted twice) | hint: you resample from p itself
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p.clone()

# %% wrong residual: max(0, p - q) without normalising it | hint: does not sum to 1
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)

# %% wrong residual: |p - q| normalised (the mass where q > p is added too) | hint: mass on tokens where q > p
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).abs()
    z = r.sum(-1, keepdim=True)
    return torch.where(z > 0, r / torch.where(z > 0, z, torch.ones_like(z)), p)

# %% wrong residual: calls the course's residual | hint: write it yourself
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    import kernels.speculative.sampling as course
    return course.residual_ref(p, q)

# %% solution speculative-step
def speculative_step(p, q, draft, u, gumbel) -> torch.Tensor:
    B, G1, V = p.shape
    G = G1 - 1
    p_d = p[:, :G].gather(2, draft[:, :, None])[:, :, 0]             # (B, G) p_j(d_j)
    q_d = q.gather(2, draft[:, :, None])[:, :, 0]                    # (B, G) q_j(d_j)
    accepted = u * q_d < p_d                                         # (B, G)
    n = torch.where(accepted.all(1), G, (~accepted).int().argmax(1))   # (B,) first rejection, or G
    rows = torch.arange(B)
    p_n = p[rows, n]                                                 # (B, V)
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]     # (B, V): zeros at the bonus row
    r = (p_n - q_n).clamp_min(0)                                     # the residual, unnormalised
    r = torch.where((r > 0).any(1, keepdim=True), r, p_n)            # argmax needs no normalisation
    last = torch.where(r > 0, torch.log(r) + gumbel, torch.full_like(r, float("-inf"))).argmax(1)
    j = torch.arange(G1)[None, :]
    padded = torch.cat([draft, draft[:, :1]], 1)
    return torch.where(j < n[:, None], padded, torch.where(j == n[:, None], last[:, None], -1))

# %% wrong speculative-step: counts every accepted draft instead of stopping at the first rejection | hint: drafts after the first rejection are discarded
def speculative_step(p, q, draft, u, gumbel) -> torch.Tensor:
    B, G1, V = p.shape
    G = G1 - 1
    p_d = p[:, :G].gather(2, draft[:, :, None])[:, :, 0]
    q_d = q.gather(2, draft[:, :, None])[:, :, 0]
    accepted = u * q_d < p_d
    n = accepted.sum(1)
    rows = torch.arange(B)
    p_n = p[rows, n]
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]
    r = (p_n - q_n).clamp_min(0)
    r = torch.where((r > 0).any(1, keepdim=True), r, p_n)
    last = torch.where(r > 0, torch.log(r) + gumbel, torch.full_like(r, float("-inf"))).argmax(1)
    j = torch.arange(G1)[None, :]
    padded = torch.cat([draft, draft[:, :1]], 1)
    return torch.where(j < n[:, None], padded, torch.where(j == n[:, None], last[:, None], -1))

# %% wrong speculative-step: the bonus token from the residual against the last draft's q, not from p | hint: bonus token is drawn from p[:, G] itself
def speculative_step(p, q, draft, u, gumbel) -> torch.Tensor:
    B, G1, V = p.shape
    G = G1 - 1
    p_d = p[:, :G].gather(2, draft[:, :, None])[:, :, 0]
    q_d = q.gather(2, draft[:, :, None])[:, :, 0]
    accepted = u * q_d < p_d
    n = torch.where(accepted.all(1), G, (~accepted).int().argmax(1))
    rows = torch.arange(B)
    p_n = p[rows, n]
    q_n = torch.cat([q, q[:, -1:]], 1)[rows, n]
    r = (p_n - q_n).clamp_min(0)
    r = torch.where((r > 0).any(1, keepdim=True), r, p_n)
    last = torch.where(r > 0, torch.log(r) + gumbel, torch.full_like(r, float("-inf"))).argmax(1)
    j = torch.arange(G1)[None, :]
    padded = torch.cat([draft, draft[:, :1]], 1)
    return torch.where(j < n[:, None], padded, torch.where(j == n[:, None], last[:, None], -1))

# %% wrong speculative-step: no fallback for an empty residual (an all -inf argmax draws token 0) | hint: an empty residual
def speculative_step(p, q, draft, u, gumbel) -> torch.Tensor:
    B, G1, V = p.shape
    G = G1 - 1
    p_d = p[:, :G].gather(2, draft[:, :, None])[:, :, 0]
    q_d = q.gather(2, draft[:, :, None])[:, :, 0]
    accepted = u * q_d < p_d
    n = torch.where(accepted.all(1), G, (~accepted).int().argmax(1))
    rows = torch.arange(B)
    p_n = p[rows, n]
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]
    r = (p_n - q_n).clamp_min(0)
    last = torch.where(r > 0, torch.log(r) + gumbel, torch.full_like(r, float("-inf"))).argmax(1)
    j = torch.arange(G1)[None, :]
    padded = torch.cat([draft, draft[:, :1]], 1)
    return torch.where(j < n[:, None], padded, torch.where(j == n[:, None], last[:, None], -1))

# %% wrong speculative-step: calls the course's verification | hint: write it yourself
def speculative_step(p, q, draft, u, gumbel) -> torch.Tensor:
    from kernels.speculative.sampling import verify_ref
    return verify_ref(p, q, draft, u, torch.zeros(p.shape[0], dtype=torch.long))[1]
