# Solutions for labs/07-attention/flash-attention-forward.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution online-step
def online_step(m, l, acc, s_blk, v_blk):
    m_new = torch.maximum(m, s_blk.amax(dim=-1, keepdim=True))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)                      # exp(m - m_new): 0 while m was -inf
    p = torch.exp(s_blk - m_safe)                      # this block's unnormalised probabilities
    l_new = alpha * l + p.sum(dim=-1, keepdim=True)
    acc_new = alpha * acc + p @ v_blk
    return m_new, l_new, acc_new

# %% wrong online-step: forgets to rescale the accumulator when the max grows | hint: the accumulator must be rescaled
def online_step(m, l, acc, s_blk, v_blk):
    m_new = torch.maximum(m, s_blk.amax(dim=-1, keepdim=True))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s_blk - m_safe)
    l_new = alpha * l + p.sum(dim=-1, keepdim=True)
    acc_new = acc + p @ v_blk
    return m_new, l_new, acc_new

# %% wrong online-step: exponentiates against m_new without the -inf guard (NaN on fully masked rows) | hint: exponentiate against 0 where m' is -inf
def online_step(m, l, acc, s_blk, v_blk):
    m_new = torch.maximum(m, s_blk.amax(dim=-1, keepdim=True))
    alpha = torch.exp(m - m_new)
    p = torch.exp(s_blk - m_new)
    return m_new, alpha * l + p.sum(dim=-1, keepdim=True), alpha * acc + p @ v_blk

# %% wrong online-step: no running max at all (p = exp(s); exp overflows on large scores) | hint: exp overflowed
def online_step(m, l, acc, s_blk, v_blk):
    p = torch.exp(s_blk)
    return m, l + p.sum(dim=-1, keepdim=True), acc + p @ v_blk

# %% wrong online-step: one max shared by all the query rows of the block (amax over rows and keys) | hint: one max for all the rows of the block
def online_step(m, l, acc, s_blk, v_blk):
    m_new = torch.maximum(m, s_blk.amax(dim=(-2, -1), keepdim=True).expand_as(m))
    m_ref = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_ref)
    p = torch.exp(s_blk - m_ref)
    return m_new, alpha * l + p.sum(-1, keepdim=True), alpha * acc + p @ v_blk

# %% wrong online-step: merges the statistics with the course's merge_softmax_stats | hint: write it yourself
def online_step(m, l, acc, s_blk, v_blk):
    from kernels.softmax import merge_softmax_stats
    m_blk = s_blk.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isneginf(m_blk), torch.zeros_like(m_blk), m_blk)
    p = torch.exp(s_blk - m_safe)
    m_new, l_new = merge_softmax_stats(m, l, m_blk, p.sum(dim=-1, keepdim=True))
    new_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, l_new, torch.exp(m - new_safe) * acc + torch.exp(m_blk - new_safe) * (p @ v_blk)

# %% solution triton-inner-loop
@triton.jit
def lab_flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, Nq, Nk, D, qk_scale,
                         stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_om,
                         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, Nk, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < Nk) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + h * stride_kh + n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + h * stride_vh + n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = n[None, :] < Nk
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + (Nk - Nq))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], o,
             mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))

# %% wrong triton-inner-loop: forgets to rescale the accumulator (acc * alpha) | hint: the accumulator must be rescaled
@triton.jit
def lab_flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, Nq, Nk, D, qk_scale,
                         stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_om,
                         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, Nk, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < Nk) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + h * stride_kh + n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + h * stride_vh + n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = n[None, :] < Nk
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + (Nk - Nq))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], o,
             mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))

# %% wrong triton-inner-loop: the P @ V dot without input_precision (TF32 on a GPU, invisible in the interpreter) | hint: defaults to TF32
@triton.jit
def lab_flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, Nq, Nk, D, qk_scale,
                         stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_om,
                         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, Nk, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < Nk) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + h * stride_kh + n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + h * stride_vh + n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = n[None, :] < Nk
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + (Nk - Nq))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], o,
             mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))

# %% wrong triton-inner-loop: no running max, p = exp2(s) (exp2 overflows on the loud row) | hint: exp overflowed
@triton.jit
def lab_flash_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, Nq, Nk, D, qk_scale,
                         stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_om,
                         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, Nk, BLOCK_N):
        n = start_n + offs_n
        kv_mask = (n[:, None] < Nk) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + h * stride_kh + n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + h * stride_vh + n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = n[None, :] < Nk
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + (Nk - Nq))
        s = tl.where(visible, s, float("-inf"))
        p = tl.exp2(s)
        l_i = l_i + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], o,
             mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D))

# %% wrong triton-inner-loop: the course's kernel launched in place of the lab's | hint: write it yourself
from kernels.attention.flash import _flash_fwd_kernel as lab_flash_fwd_kernel
