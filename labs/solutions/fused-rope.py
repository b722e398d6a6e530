# Solutions for labs/06-position/fused-rope.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution rotate-pairs
def rotate_pairs(x, cos, sin, interleaved):
    D = x.shape[-1]
    i = torch.arange(D // 2)
    a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + D // 2)
    x1, x2 = x[..., a].float(), x[..., b].float()
    out = torch.empty(x.shape, dtype=torch.float32)
    out[..., a] = x1 * cos - x2 * sin
    out[..., b] = x2 * cos + x1 * sin
    return out.to(x.dtype)

# %% wrong rotate-pairs: always pairs (i, i + D/2), ignoring the interleaved layout | hint: but this case is interleaved
def rotate_pairs(x, cos, sin, interleaved):
    D = x.shape[-1]
    x1, x2 = x[..., : D // 2].float(), x[..., D // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

# %% wrong rotate-pairs: rotates by -angle (the signs of the sin terms swapped) | hint: you rotate by -a
def rotate_pairs(x, cos, sin, interleaved):
    D = x.shape[-1]
    i = torch.arange(D // 2)
    a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + D // 2)
    x1, x2 = x[..., a].float(), x[..., b].float()
    out = torch.empty(x.shape, dtype=torch.float32)
    out[..., a] = x1 * cos + x2 * sin
    out[..., b] = x2 * cos - x1 * sin
    return out.to(x.dtype)

# %% wrong rotate-pairs: returns float32 for a bfloat16 x (the cast back to x's dtype forgotten) | hint: result is float32
def rotate_pairs(x, cos, sin, interleaved):
    D = x.shape[-1]
    i = torch.arange(D // 2)
    a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + D // 2)
    x1, x2 = x[..., a].float(), x[..., b].float()
    out = torch.empty(x.shape, dtype=torch.float32)
    out[..., a] = x1 * cos - x2 * sin
    out[..., b] = x2 * cos + x1 * sin
    return out

# %% wrong rotate-pairs: calls the course's rotation | hint: write it yourself
def rotate_pairs(x, cos, sin, interleaved):
    from kernels.position.rope import _rotate_ref
    return _rotate_ref(x, cos, sin, interleaved)

# %% solution triton-rope
@triton.jit
def lab_rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, H, HALF,
                    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(pos_ptr + tok)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    row = tok * H * 2 * HALF + h[:, None] * (2 * HALF)
    if INTERLEAVED:
        a = 2 * i
        b = 2 * i + 1
    else:
        a = i
        b = i + HALF
    if CONJUGATE:
        sin = -sin
    x1 = tl.load(x_ptr + row + a[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_ptr + row + b[None, :], mask=mask, other=0.0)
    tl.store(o_ptr + row + a[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(o_ptr + row + b[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=mask)

# %% wrong triton-rope: the half-split layout for both values of INTERLEAVED | hint: but this case is interleaved
@triton.jit
def lab_rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, H, HALF,
                    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(pos_ptr + tok)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    row = tok * H * 2 * HALF + h[:, None] * (2 * HALF)
    a = i
    b = i + HALF
    if CONJUGATE:
        sin = -sin
    x1 = tl.load(x_ptr + row + a[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_ptr + row + b[None, :], mask=mask, other=0.0)
    tl.store(o_ptr + row + a[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(o_ptr + row + b[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=mask)

# %% wrong triton-rope: forgets the backward's sign flip (the gradient is rotated by +angle again) | hint: negate sin when CONJUGATE
@triton.jit
def lab_rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, H, HALF,
                    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(pos_ptr + tok)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    row = tok * H * 2 * HALF + h[:, None] * (2 * HALF)
    if INTERLEAVED:
        a = 2 * i
        b = 2 * i + 1
    else:
        a = i
        b = i + HALF
    x1 = tl.load(x_ptr + row + a[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_ptr + row + b[None, :], mask=mask, other=0.0)
    tl.store(o_ptr + row + a[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(o_ptr + row + b[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=mask)

# %% wrong triton-rope: loads x1, x2 without the mask, the stores masked (right output, reads past x) | hint: of x_ptr, past its end
@triton.jit
def lab_rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, H, HALF,
                    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(pos_ptr + tok)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    row = tok * H * 2 * HALF + h[:, None] * (2 * HALF)
    if INTERLEAVED:
        a = 2 * i
        b = 2 * i + 1
    else:
        a = i
        b = i + HALF
    if CONJUGATE:
        sin = -sin
    x1 = tl.load(x_ptr + row + a[None, :])
    x2 = tl.load(x_ptr + row + b[None, :])
    tl.store(o_ptr + row + a[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(o_ptr + row + b[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=mask)

# %% wrong triton-rope: the mask drops the head bound (heads h >= H of the last token read past x and written past the output) | hint: of x_ptr, past its end
@triton.jit
def lab_rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, H, HALF,
                    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(pos_ptr + tok)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < BLOCK_H)[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    row = tok * H * 2 * HALF + h[:, None] * (2 * HALF)
    if INTERLEAVED:
        a = 2 * i
        b = 2 * i + 1
    else:
        a = i
        b = i + HALF
    if CONJUGATE:
        sin = -sin
    x1 = tl.load(x_ptr + row + a[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_ptr + row + b[None, :], mask=mask, other=0.0)
    tl.store(o_ptr + row + a[None, :], x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(o_ptr + row + b[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask=mask)

# %% wrong triton-rope: calls the course's jit helper for the pairs | hint: write it yourself
from kernels.position.rope import _rotate_heads


@triton.jit
def lab_rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, H, HALF,
                    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(pos_ptr + tok)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + i, mask=i < HALF, other=0.0)
    if CONJUGATE:
        sin = -sin
    _rotate_heads(x_ptr + tok * H * 2 * HALF, o_ptr + tok * H * 2 * HALF, 2 * HALF, 1, H, HALF, cos, sin,
                  INTERLEAVED, BLOCK_H, BLOCK_HALF)
