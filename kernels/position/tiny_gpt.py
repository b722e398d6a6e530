"""The course's tiny GPT (kernels.model.gpt) run at chosen positions and RoPE frequencies.

``GPT.forward`` always places its tokens at 0..T-1 with theta_i = rope_theta^(-2i/D) and refuses
T > block_size (128). The position chapters need to move the positions (shift them all, compare),
change the frequencies (position interpolation, NTK, YaRN, Llama 3 rules) and run past 128 tokens,
without retraining. :func:`forward_at` is GPT.forward with those three knobs, reusing the model's
own modules (norms, projections, attention, MLP); with the defaults it equals GPT.forward
(tests/test_position.py checks it to fp32 rounding).

Shapes: idx (B, T) token ids; positions (T,) or (B, T) integers; logits (B, T, V).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.model.gpt import GPT, add_rms_norm_torch
from kernels.position.rope import rope, rope_cos_sin, rope_frequencies, rope_ref


def forward_at(model: GPT, idx: torch.Tensor, positions: torch.Tensor | None = None, *,
               inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0,
               use_kernel: bool = False, table_length: int | None = None) -> torch.Tensor:
    """Logits of ``model`` for idx (B, T) with the tokens at ``positions`` (default 0..T-1).

    ``inv_freq`` (D/2,) replaces the model's theta_i (default rope_theta^(-2i/D)); the
    ``attention_factor`` multiplies cos and sin (YaRN). ``use_kernel`` rotates with the Triton
    :func:`kernels.position.rope` instead of :func:`rope_ref`.
    """
    cfg = model.config
    B, T = idx.shape
    pos = torch.arange(T) if positions is None else positions
    if inv_freq is None:
        inv_freq, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta)
    length = table_length or int(pos.max()) + 1
    cos, sin = rope_cos_sin(inv_freq, length, attention_factor=attention_factor, dtype=model.wte.weight.dtype,
                            device=idx.device)
    rotate = rope if use_kernel else rope_ref
    x = model.wte(idx)                                                   # (B, T, C)
    for block in model.blocks:
        a = _attention(block.attn, block.norm1(x), cos, sin, pos, rotate)
        h, hn = add_rms_norm_torch(x, a, block.norm2.weight, cfg.norm_eps)
        x = h + block.mlp(hn)
    return model.norm_f(x) @ model.wte.weight.T                          # (B, T, V)


def _attention(attn, x, cos, sin, pos, rotate):
    """The block's causal GQA attention with the rotation ``rotate`` at positions ``pos``."""
    cfg = attn.config
    B, T, _ = x.shape
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = attn.wq(x).view(B, T, Hq, D)                                     # (B, T, Hq, D): the kernel's layout
    k = attn.wk(x).view(B, T, Hkv, D)
    v = attn.wv(x).view(B, T, Hkv, D).transpose(1, 2)                    # (B, Hkv, T, D)
    q, k = rotate(q, k, cos, sin, pos)
    out = attn._attend(q.transpose(1, 2), k.transpose(1, 2), v, 0, False)   # (B, Hq, T, D), causal
    return attn.wo(out.transpose(1, 2).reshape(B, T, Hq * D))


def mean_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood (nats) per position: (T,), averaged over the batch."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return nll.view(targets.shape).mean(0)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.mean()))


@torch.no_grad()
def position_nll(model: GPT, x: torch.Tensor, y: torch.Tensor, scaling: dict | None = None) -> torch.Tensor:
    """Per-position mean NLL (T,) of windows x, y (N, T) with the model's RoPE scaled by ``scaling``
    (kernels.position.scaling; ``"dynamic"`` gets the window length as its current length)."""
    cfg = model.config
    inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, scaling, seq_len=x.shape[1])
    return mean_nll(forward_at(model, x, inv_freq=inv_freq, attention_factor=factor), y)


@torch.no_grad()
def sliding_window_nll(model: GPT, tokens: torch.Tensor, start: int, end: int, window: int) -> torch.Tensor:
    """NLL (end - start,) of predicting tokens[t + 1] from only the last ``window`` tokens ending at t,
    for t in [start, end): what the model achieves when it is never shown more than it was trained on."""
    if start < window - 1:
        raise ValueError(f"sliding_window_nll: start={start} must be at least window - 1 = {window - 1}")
    ctx = torch.stack([tokens[t - window + 1: t + 1] for t in range(start, end)])   # (end - start, window)
    logits = forward_at(model, ctx)[:, -1]                                          # the last position of each
    return F.cross_entropy(logits.float(), tokens[start + 1: end + 1], reduction="none")
