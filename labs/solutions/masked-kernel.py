# Solutions for labs/00-start/masked-kernel.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution block-sums
@triton.jit
def block_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)                 # this program's block
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)   # lanes past n read 0
    tl.store(out_ptr + pid, tl.sum(x, axis=0))


def block_sums(x, block=64):
    n = x.numel()
    out = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    block_sums_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block)
    return out

# %% wrong block-sums: the load without its mask (the last block reads past n) | hint: load with mask=offsets < n
@triton.jit
def block_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + pid, tl.sum(x, axis=0))


def block_sums(x, block=64):
    n = x.numel()
    out = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    block_sums_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block)
    return out

# %% wrong block-sums: the load left unmasked, its stray lanes zeroed afterwards with tl.where (right sums, reads past n) | hint: reads element 1 of x_ptr, past its end
@triton.jit
def block_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + pid, tl.sum(tl.where(offsets < n, x, 0.0), axis=0))


def block_sums(x, block=64):
    n = x.numel()
    out = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    block_sums_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block)
    return out

# %% wrong block-sums: every program reads block 0 (pid left out of the offsets) | hint: every program summed block 0
@triton.jit
def block_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x, axis=0))


def block_sums(x, block=64):
    n = x.numel()
    out = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    block_sums_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block)
    return out

# %% wrong block-sums: n // block programs (the ragged tail block never runs) | hint: one sum per program
@triton.jit
def block_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x, axis=0))


def block_sums(x, block=64):
    n = x.numel()
    out = torch.empty(n // block, dtype=torch.float32, device=x.device)
    block_sums_kernel[(n // block,)](x, out, n, BLOCK=block)
    return out

# %% wrong block-sums: the launcher sums the blocks in PyTorch and never launches the kernel | hint: never launched block_sums_kernel
@triton.jit
def block_sums_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pass


def block_sums(x, block=64):
    pad = (-x.numel()) % block
    return torch.cat([x, x.new_zeros(pad)]).view(-1, block).sum(1)

# %% wrong block-sums: calls the check's reference | hint: write it yourself
def block_sums(x, block=64):
    return block_sums_ref(x, block)
