# Solutions for labs/05-mlp/fused-swiglu.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution forward
@triton.jit
def swiglu_fwd_kernel(gu_ptr, h_ptr, T, H, stride_gu, stride_h, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]              # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)            # up: column H + j, same row
    h = g * tl.sigmoid(g) * u                                           # silu(g) u
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)

# %% wrong forward: gate and up swapped (silu of the second half) | hint: gate and up are swapped
@triton.jit
def swiglu_fwd_kernel(gu_ptr, h_ptr, T, H, stride_gu, stride_h, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]              # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)            # up: column H + j, same row
    h = u * tl.sigmoid(u) * g
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)

# %% wrong forward: stores without the mask (the edge tiles write past h) | hint: of h_ptr, past its end
@triton.jit
def swiglu_fwd_kernel(gu_ptr, h_ptr, T, H, stride_gu, stride_h, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h)

# %% wrong forward: loads without the mask, the store masked (right h, reads past the last row) | hint: of gu_ptr, past its end
@triton.jit
def swiglu_fwd_kernel(gu_ptr, h_ptr, T, H, stride_gu, stride_h, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate).to(tl.float32)
    u = tl.load(gate + H).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)

# %% wrong forward: the course's fused kernel launched as the lab's | hint: write it yourself
from kernels.mlp.gated import _glu_fused_fwd_kernel as swiglu_fwd_kernel

# %% solution backward
@triton.jit
def swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, T, H, stride_gu, stride_dh, stride_dgu,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]              # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)            # up: column H + j, same row
    dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dgate = dgu_ptr + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgate, dh * u * s * (1.0 + g * (1.0 - s)), mask=mask)       # d gate = dh u silu'(g)
    tl.store(dgate + H, dh * g * s, mask=mask)                            # d up = dh silu(g)

# %% wrong backward: silu'(g) taken as sigmoid(g) | hint: not sigmoid(g) alone
@triton.jit
def swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, T, H, stride_gu, stride_dh, stride_dgu,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]              # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)            # up: column H + j, same row
    dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dgate = dgu_ptr + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgate, dh * u * s, mask=mask)
    tl.store(dgate + H, dh * g * s, mask=mask)

# %% wrong backward: d gate and d up written to each other's half | hint: d gate and d up are swapped
@triton.jit
def swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, T, H, stride_gu, stride_dh, stride_dgu,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]              # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)            # up: column H + j, same row
    dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dgate = dgu_ptr + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgate + H, dh * u * s * (1.0 + g * (1.0 - s)), mask=mask)
    tl.store(dgate, dh * g * s, mask=mask)

# %% wrong backward: calls the course's activation helper for silu and its derivative | hint: write it yourself
from kernels.mlp.gated import _act_and_grad


@triton.jit
def swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, T, H, stride_gu, stride_dh, stride_dgu,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    gate = gu_ptr + rows[:, None] * stride_gu + cols[None, :]              # gate: column j of row t
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + H, mask=mask, other=0.0).to(tl.float32)            # up: column H + j, same row
    dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, "silu")
    dgate = dgu_ptr + rows[:, None] * stride_dgu + cols[None, :]
    tl.store(dgate, dh * u * da, mask=mask)
    tl.store(dgate + H, dh * a, mask=mask)
