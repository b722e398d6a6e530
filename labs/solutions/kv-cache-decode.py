# Solutions for labs/01-foundations/kv-cache-decode.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution decode-step
def decode_step(w, x_t, pos, k_cache, v_cache):
    cfg, B = w.config, x_t.shape[0]
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    at = torch.tensor([pos])                                                  # this token's position
    q = rope(w.wq(x_t).view(B, 1, Hq, D).transpose(1, 2), at, cfg.rope_theta)  # (B, Hq, 1, D)
    k = rope(w.wk(x_t).view(B, 1, Hkv, D).transpose(1, 2), at, cfg.rope_theta)  # (B, Hkv, 1, D)
    k_cache[:, :, pos] = k[:, :, 0]                                           # append: the next step reads it
    v_cache[:, :, pos] = w.wv(x_t).view(B, 1, Hkv, D).transpose(1, 2)[:, :, 0]
    heads = torch.arange(Hq) // (Hq // Hkv)                                   # query head h -> its K/V head
    k, v = k_cache[:, heads, : pos + 1], v_cache[:, heads, : pos + 1]         # (B, Hq, pos + 1, D)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)     # (B, Hq, 1, pos + 1)
    return w.wo((probs @ v).transpose(1, 2).reshape(B, 1, Hq * D))            # (B, 1, C)

# %% wrong decode-step: attends over positions 0..pos-1, leaving the token itself out | hint: the window is off by one
def decode_step(w, x_t, pos, k_cache, v_cache):
    cfg, B = w.config, x_t.shape[0]
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    at = torch.tensor([pos])
    q = rope(w.wq(x_t).view(B, 1, Hq, D).transpose(1, 2), at, cfg.rope_theta)
    k = rope(w.wk(x_t).view(B, 1, Hkv, D).transpose(1, 2), at, cfg.rope_theta)
    k_cache[:, :, pos] = k[:, :, 0]
    v_cache[:, :, pos] = w.wv(x_t).view(B, 1, Hkv, D).transpose(1, 2)[:, :, 0]
    heads = torch.arange(Hq) // (Hq // Hkv)
    k, v = k_cache[:, heads, :pos], v_cache[:, heads, :pos]
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
    return w.wo((probs @ v).transpose(1, 2).reshape(B, 1, Hq * D))

# %% wrong decode-step: RoPE at position 0 (the step's own index within the call) | hint: rotate q and k at the token's position pos
def decode_step(w, x_t, pos, k_cache, v_cache):
    cfg, B = w.config, x_t.shape[0]
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    at = torch.arange(x_t.shape[1])                       # 0: the position inside this call, not in the sequence
    q = rope(w.wq(x_t).view(B, 1, Hq, D).transpose(1, 2), at, cfg.rope_theta)
    k = rope(w.wk(x_t).view(B, 1, Hkv, D).transpose(1, 2), at, cfg.rope_theta)
    k_cache[:, :, pos] = k[:, :, 0]
    v_cache[:, :, pos] = w.wv(x_t).view(B, 1, Hkv, D).transpose(1, 2)[:, :, 0]
    heads = torch.arange(Hq) // (Hq // Hkv)
    k, v = k_cache[:, heads, : pos + 1], v_cache[:, heads, : pos + 1]
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
    return w.wo((probs @ v).transpose(1, 2).reshape(B, 1, Hq * D))

# %% wrong decode-step: K/V heads repeated (head h reads h % Hkv) instead of interleaved | hint: query head h reads key/value head h // (Hq // Hkv)
def decode_step(w, x_t, pos, k_cache, v_cache):
    cfg, B = w.config, x_t.shape[0]
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    at = torch.tensor([pos])
    q = rope(w.wq(x_t).view(B, 1, Hq, D).transpose(1, 2), at, cfg.rope_theta)
    k = rope(w.wk(x_t).view(B, 1, Hkv, D).transpose(1, 2), at, cfg.rope_theta)
    k_cache[:, :, pos] = k[:, :, 0]
    v_cache[:, :, pos] = w.wv(x_t).view(B, 1, Hkv, D).transpose(1, 2)[:, :, 0]
    k, v = k_cache[:, :, : pos + 1].repeat(1, Hq // Hkv, 1, 1), v_cache[:, :, : pos + 1].repeat(1, Hq // Hkv, 1, 1)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
    return w.wo((probs @ v).transpose(1, 2).reshape(B, 1, Hq * D))

# %% wrong decode-step: the scores not divided by sqrt(D) | hint: the scores are q k^T / sqrt(D)
def decode_step(w, x_t, pos, k_cache, v_cache):
    cfg, B = w.config, x_t.shape[0]
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    at = torch.tensor([pos])
    q = rope(w.wq(x_t).view(B, 1, Hq, D).transpose(1, 2), at, cfg.rope_theta)
    k = rope(w.wk(x_t).view(B, 1, Hkv, D).transpose(1, 2), at, cfg.rope_theta)
    k_cache[:, :, pos] = k[:, :, 0]
    v_cache[:, :, pos] = w.wv(x_t).view(B, 1, Hkv, D).transpose(1, 2)[:, :, 0]
    heads = torch.arange(Hq) // (Hq // Hkv)
    k, v = k_cache[:, heads, : pos + 1], v_cache[:, heads, : pos + 1]
    probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return w.wo((probs @ v).transpose(1, 2).reshape(B, 1, Hq * D))

# %% wrong decode-step: calls the layer's own forward | hint: write it yourself
def decode_step(w, x_t, pos, k_cache, v_cache):
    return w(x_t, torch.tensor([pos]))

# %% wrong decode-step: calls the lab's slip model with the right head map (no slip at all) | hint: write it yourself
def decode_step(w, x_t, pos, k_cache, v_cache):
    return slipped_step(kv_head=lambda h: h // (w.config.n_head // w.config.n_kv_head))(w, x_t, pos, k_cache, v_cache)

# %% wrong decode-step: PyTorch's fused attention over the cache | hint: your function calls torch.nn.functional.scaled_dot_product_attention
def decode_step(w, x_t, pos, k_cache, v_cache):
    cfg, B = w.config, x_t.shape[0]
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    at = torch.tensor([pos])
    q = rope(w.wq(x_t).view(B, 1, Hq, D).transpose(1, 2), at, cfg.rope_theta)
    k = rope(w.wk(x_t).view(B, 1, Hkv, D).transpose(1, 2), at, cfg.rope_theta)
    k_cache[:, :, pos] = k[:, :, 0]
    v_cache[:, :, pos] = w.wv(x_t).view(B, 1, Hkv, D).transpose(1, 2)[:, :, 0]
    out = torch.nn.functional.scaled_dot_product_attention(q, k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1],
                                                           enable_gqa=True)
    return w.wo(out.transpose(1, 2).reshape(B, 1, Hq * D))
