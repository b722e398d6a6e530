# Solutions for labs/03-softmax/online-softmax-and-rmsnorm.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution online-softmax
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    m = torch.full((*x.shape[:-1], 1), float("-inf"))      # running max, (..., 1)
    l = torch.zeros((*x.shape[:-1], 1))                    # running sum of exp(x - m)
    for start in range(0, x.shape[-1], block):
        blk = x[..., start:start + block]
        m_new = torch.maximum(m, blk.amax(dim=-1, keepdim=True))
        l = l * torch.exp(m - m_new) + torch.exp(blk - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    return torch.exp(x - m) / l

# %% wrong online-softmax: no max subtraction (exp overflows on large logits) | hint: exp overflowed to inf
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    l = torch.zeros((*x.shape[:-1], 1))
    for start in range(0, x.shape[-1], block):
        l = l + torch.exp(x[..., start:start + block]).sum(dim=-1, keepdim=True)
    return torch.exp(x) / l

# %% wrong online-softmax: the running sum is not rescaled when the max grows | hint: rescale it by exp(m - m')
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    m = torch.full((*x.shape[:-1], 1), float("-inf"))
    l = torch.zeros((*x.shape[:-1], 1))
    for start in range(0, x.shape[-1], block):
        blk = x[..., start:start + block]
        m_new = torch.maximum(m, blk.amax(dim=-1, keepdim=True))
        l = l + torch.exp(blk - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    return torch.exp(x - m) / l

# %% wrong online-softmax: the rescale factor inverted, exp(m' - m) (inf x 0 in the first block) | hint: the inverted exp(m' - m)
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    m = torch.full((*x.shape[:-1], 1), float("-inf"))
    l = torch.zeros((*x.shape[:-1], 1))
    for start in range(0, x.shape[-1], block):
        blk = x[..., start:start + block]
        m_new = torch.maximum(m, blk.amax(dim=-1, keepdim=True))
        l = l * torch.exp(m_new - m) + torch.exp(blk - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    return torch.exp(x - m) / l

# %% wrong online-softmax: the running max starts at 0 instead of -inf | hint: must start at -inf
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    m = torch.zeros((*x.shape[:-1], 1))
    l = torch.zeros((*x.shape[:-1], 1))
    for start in range(0, x.shape[-1], block):
        blk = x[..., start:start + block]
        m_new = torch.maximum(m, blk.amax(dim=-1, keepdim=True))
        l = l * torch.exp(m - m_new) + torch.exp(blk - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    return torch.exp(x - m) / l

# %% wrong online-softmax: calls the course's online softmax | hint: write it yourself
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    import kernels.softmax
    return kernels.softmax.online_softmax_ref(x.float(), block=block)

# %% wrong online-softmax: hands the row to PyTorch's softmax (no recurrence at all) | hint: write it yourself
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    return torch.nn.functional.softmax(x.float(), dim=-1)

# %% wrong online-softmax: the same through the tensor method | hint: your function calls torch.Tensor.softmax
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    return x.float().softmax(-1)

# %% wrong online-softmax: the normaliser from torch.logsumexp (the answer in one call, no recurrence) | hint: your function calls torch.logsumexp
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    return torch.exp(x - torch.logsumexp(x, dim=-1, keepdim=True))

# %% wrong online-softmax: a one-shot safe softmax (max and sum over the whole row: right values, no recurrence) | hint: that is a one-shot softmax, not the online recurrence
def online_softmax(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    x = x.float()
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)

# %% solution rms-norm
@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n, stride_row, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    rms_norm_fwd_kernel[(rows,)](x, weight, y, n, x.stride(0), eps, BLOCK_N=triton.next_power_of_2(n))
    return y

# %% wrong rms-norm: subtracts the mean (that is LayerNorm without the bias) | hint: that is LayerNorm
@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n, stride_row, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(mask, x - tl.sum(x, axis=0) / n, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    rms_norm_fwd_kernel[(rows,)](x, weight, y, n, x.stride(0), eps, BLOCK_N=triton.next_power_of_2(n))
    return y

# %% wrong rms-norm: loads without the mask (reads past the end of each row) | hint: read lanes past the end of the row
@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n, stride_row, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_row + cols).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    rms_norm_fwd_kernel[(rows,)](x, weight, y, n, x.stride(0), eps, BLOCK_N=triton.next_power_of_2(n))
    return y

# %% wrong rms-norm: eps outside the square root, 1 / (sqrt(ms) + eps) | hint: eps goes inside the square root
@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n, stride_row, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / (tl.sqrt(tl.sum(x * x, axis=0) / n) + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    rms_norm_fwd_kernel[(rows,)](x, weight, y, n, x.stride(0), eps, BLOCK_N=triton.next_power_of_2(n))
    return y

# %% wrong rms-norm: the launcher normalises in PyTorch and never launches the kernel | hint: never launched rms_norm_fwd_kernel
@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n, stride_row, eps, BLOCK_N: tl.constexpr):
    pass


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight.float()

# %% wrong rms-norm: calls the course's RMSNorm | hint: write it yourself
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    from kernels.norm import rms_norm
    return rms_norm(x, weight, eps)
