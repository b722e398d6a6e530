"""A tiny decoder-only GPT: pre-norm blocks, RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

One model, two paths, chosen per call with ``use_kernels``:

* ``use_kernels=False`` (pure PyTorch): every operation written out in ``torch``; this is the path
  the model is trained on (``python -m kernels.model.train``) and the reference for the other one;
* ``use_kernels=True``: the same parameters, with RMSNorm (``kernels.norm.rms_norm``), the fused
  residual-add + RMSNorm (``kernels.norm.add_rms_norm``), the attention softmax
  (``kernels.softmax.softmax``), the SwiGLU gate (``kernels.mlp.swiglu``) and single-token decode
  attention over the KV cache (``kernels.attention.decode_attention``) done by the course's Triton
  kernels. Matrix multiplications stay in PyTorch on both paths.

Shapes: B batch, T tokens in this call, C = d_model, Hq query heads, Hkv key/value heads, D = C / Hq
head dimension, S the number of cached positions, V the vocabulary.

One block (pre-norm):  h = x + Attn(RMSNorm_1(x)),  out = h + MLP(RMSNorm_2(h)),
with MLP(u) = W_down (silu(W_gate u) * (W_up u)); the logits are RMSNorm_f(x_L) @ E^T, E the token
embedding (tied weights).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256      # byte-level tokenizer (kernels.model.data)
    block_size: int = 128      # longest context, in tokens
    n_layer: int = 4
    n_head: int = 4            # query heads Hq
    n_kv_head: int = 2         # key/value heads Hkv (grouped-query attention: Hq / Hkv queries share a K/V head)
    d_model: int = 128
    d_ff: int = 352            # SwiGLU hidden width, about 8/3 d_model rounded to a multiple of 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("GPTConfig: the head dimension must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "GPTConfig":
        return cls(**json.loads(text))


# ---------------------------------------------------------------- the operations, pure PyTorch

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension, computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + residual; returns (h, rms_norm(h))."""
    h = x + residual
    return h, rms_norm_torch(h, weight, eps)


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu(g) = g * sigmoid(g)."""
    return F.silu(gate) * up


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) of x (B, H, T, D) by angle p * theta^(-2i/D) for position p.

    positions: (T,) or (B, T) integer positions. The rotate-half layout (GPT-NeoX, Llama) pairs
    dimension i with i + D/2.
    """
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D // 2, dtype=torch.float32, device=x.device) * 2 / D)  # (D/2,)
    pos = positions.to(torch.float32)
    angles = pos[..., None] * inv_freq  # (T, D/2) or (B, T, D/2)
    if angles.dim() == 3:
        angles = angles[:, None]        # (B, 1, T, D/2): same rotation for every head
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : D // 2].float(), x[..., D // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ---------------------------------------------------------------- the KV cache

@dataclass
class KVCache:
    """Keys and values of every layer for the positions seen so far.

    k[l], v[l]: (B, Hkv, S_max, D) preallocated; seqlens: (B,) int32, how many positions of each
    sequence are filled. Bytes = 2 (K and V) * n_layer * B * Hkv * S_max * D * element size.
    """
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    seqlens: torch.Tensor

    @classmethod
    def empty(cls, config: GPTConfig, batch: int, max_len: int | None = None,
              dtype: torch.dtype = torch.float32, device=None) -> "KVCache":
        S = max_len or config.block_size
        shape = (batch, config.n_kv_head, S, config.head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)],
            seqlens=torch.zeros(batch, dtype=torch.int32, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


# ---------------------------------------------------------------- modules

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        if use_kernels:
            from kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; Hq query heads share Hkv key/value heads."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C, D = config.d_model, config.head_dim
        self.wq = nn.Linear(C, config.n_head * D, bias=False)
        self.wk = nn.Linear(C, config.n_kv_head * D, bias=False)
        self.wv = nn.Linear(C, config.n_kv_head * D, bias=False)
        self.wo = nn.Linear(config.n_head * D, C, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *, use_kernels: bool = False,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        cfg = self.config
        B, T, _ = x.shape
        Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        q = self.wq(x).view(B, T, Hq, D).transpose(1, 2)    # (B, Hq, T, D)
        k = self.wk(x).view(B, T, Hkv, D).transpose(1, 2)   # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, Hkv, D).transpose(1, 2)   # (B, Hkv, T, D)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)

        if cache is not None and T == 1:
            # Decode: write this token's K, V at each sequence's own next slot, then attend with one
            # query per sequence over its cached positions 0..seqlens[b] (different lengths allowed).
            b_idx = torch.arange(B, device=x.device)
            slot = cache.seqlens.long()                                    # (B,)
            cache.k[layer][b_idx, :, slot] = k[:, :, 0]
            cache.v[layer][b_idx, :, slot] = v[:, :, 0]
            lens = cache.seqlens + 1
            if use_kernels:
                from kernels.attention import decode_attention
                out = decode_attention(q[:, :, 0], cache.k[layer], cache.v[layer], lens)  # (B, Hq, D)
            else:
                from kernels.attention.decode import decode_attention_ref
                out = decode_attention_ref(q[:, :, 0], cache.k[layer], cache.v[layer], lens)
            out = out[:, :, None]                                           # (B, Hq, 1, D)
        else:
            start = 0
            if cache is not None:
                # Prefill: every sequence must be at the same length P; the new keys go to P..P+T-1.
                start = int(cache.seqlens[0])
                if not bool((cache.seqlens == start).all()):
                    raise ValueError("Attention: a multi-token call with a cache needs equal cache lengths")
                cache.k[layer][:, :, start: start + T] = k
                cache.v[layer][:, :, start: start + T] = v
                k = cache.k[layer][:, :, : start + T]
                v = cache.v[layer][:, :, : start + T]
            out = self._attend(q, k, v, start, use_kernels)                 # (B, Hq, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, Hq * D))

    def _attend(self, q, k, v, start: int, use_kernels: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(D) + causal mask) v; query i sits at position start + i."""
        B, Hq, T, D = q.shape
        S = k.shape[2]
        group = Hq // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                               # (B, Hq, S, D)
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))            # (B, Hq, T, S)
        i = torch.arange(T, device=q.device)[:, None] + start
        j = torch.arange(S, device=q.device)[None, :]
        scores = scores.masked_fill(j > i, float("-inf"))                   # key j visible iff j <= i
        if use_kernels:
            from kernels.softmax import softmax
            probs = softmax(scores.reshape(-1, S).contiguous(), dim=-1).view(B, Hq, T, S)
        else:
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return probs @ v


class MLP(nn.Module):
    """SwiGLU: W_down (silu(W_gate u) * (W_up u))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w_up = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w_down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, u: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        gate, up = self.w_gate(u), self.w_up(u)
        if use_kernels:
            from kernels.mlp.gated import swiglu
            shape = gate.shape
            hidden = swiglu(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])).view(shape)
        else:
            hidden = swiglu_torch(gate, up)
        return self.w_down(hidden)


class Block(nn.Module):
    """Pre-norm block: h = x + Attn(norm1(x)); out = h + MLP(norm2(h)).

    The add that makes h and the norm2 that reads it are one fused operation,
    ``add_rms_norm(x, attn_out, w2) -> (h, norm2(h))``: h is read once instead of written and read back.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *, use_kernels: bool = False,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        a = self.attn(self.norm1(x, use_kernels), positions, use_kernels=use_kernels, cache=cache, layer=layer)
        if use_kernels:
            from kernels.norm import add_rms_norm
            shape = x.shape
            h, hn = add_rms_norm(x.reshape(-1, shape[-1]), a.reshape(-1, shape[-1]), self.norm2.weight,
                                 self.config.norm_eps)
            h, hn = h.view(shape), hn.view(shape)
        else:
            h, hn = add_rms_norm_torch(x, a, self.norm2.weight, self.config.norm_eps)
        return h + self.mlp(hn, use_kernels)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)  # E (V, C); also the LM head (tied)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; the two projections that write into the residual stream
        (W_o, W_down) scaled by 1/sqrt(2 n_layer) so the stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.startswith("norm_f"):
                nn.init.ones_(p)
            elif name.endswith("wo.weight") or name.endswith("w_down.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, *, use_kernels: bool = False, cache: KVCache | None = None,
                return_hidden: bool = False) -> torch.Tensor:
        """Logits (B, T, V) for token ids idx (B, T); with ``cache`` the tokens continue the cached ones.

        ``return_hidden=True`` returns the final normed hidden states (B, T, C) instead of logits,
        for a loss that fuses the LM head (kernels.model.lm_head.fused_linear_cross_entropy).
        """
        if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32):
            raise ValueError(f"GPT: idx must be a (B, T) integer tensor, got {tuple(idx.shape)} {idx.dtype}")
        B, T = idx.shape
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(f"GPT: {T} tokens exceed block_size={self.config.block_size}")
            positions = torch.arange(T, device=idx.device)
        else:
            if T > 1 and not bool((cache.seqlens == cache.seqlens[0]).all()):
                raise ValueError("GPT: a multi-token call with a cache needs equal cache lengths")
            if int(cache.seqlens.max()) + T > cache.max_len:
                raise ValueError(f"GPT: cache holds {cache.max_len} positions; "
                                 f"{int(cache.seqlens.max())} used + {T} new do not fit")
            positions = cache.seqlens.long()[:, None] + torch.arange(T, device=idx.device)  # (B, T)
        x = self.wte(idx)                                                # (B, T, C)
        for layer, block in enumerate(self.blocks):
            x = block(x, positions, use_kernels=use_kernels, cache=cache, layer=layer)
        if cache is not None:
            cache.seqlens += T
        x = self.norm_f(x, use_kernels)
        if return_hidden:
            return x
        return x @ self.wte.weight.T                                     # (B, T, V): tied LM head

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, use_cache: bool = True,
                 use_kernels: bool = False, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend idx (B, T0) by ``max_new_tokens`` tokens; greedy when temperature == 0.

        Without the cache every step runs the whole sequence again (T0 + t tokens at step t); with it,
        one prefill of T0 tokens and then one token per step. Both give the same tokens (greedy).
        """
        B, T0 = idx.shape
        if T0 + max_new_tokens > self.config.block_size:
            raise ValueError(f"generate: {T0} + {max_new_tokens} tokens exceed block_size={self.config.block_size}")
        out = idx
        cache = KVCache.empty(self.config, B, device=idx.device) if use_cache else None
        next_input = idx
        for _ in range(max_new_tokens):
            if use_cache:
                logits = self(next_input, use_kernels=use_kernels, cache=cache)[:, -1]
            else:
                logits = self(out, use_kernels=use_kernels)[:, -1]
            if temperature == 0.0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            next_input = nxt
        return out


# ---------------------------------------------------------------- counting

def count_parameters(config: GPTConfig) -> dict[str, int]:
    """Parameters by part, derived from the config (the LM head is the embedding: no extra entry)."""
    C, D, L = config.d_model, config.head_dim, config.n_layer
    attn = C * config.n_head * D + 2 * C * config.n_kv_head * D + config.n_head * D * C  # W_q, W_k, W_v, W_o
    mlp = 3 * C * config.d_ff                                                          # W_gate, W_up, W_down
    norms = 2 * C
    parts = {
        "embedding": config.vocab_size * C,
        "attention": L * attn,
        "mlp": L * mlp,
        "norms": L * norms + C,
    }
    parts["non_embedding"] = parts["attention"] + parts["mlp"] + parts["norms"]
    parts["total"] = parts["embedding"] + parts["non_embedding"]
    return parts


def forward_flops(config: GPTConfig, n_tokens: int, context: int | None = None) -> dict[str, int]:
    """Matmul FLOPs (2 per multiply-add) of a forward over ``n_tokens`` tokens, each attending to
    ``context`` keys on average (default: the causal average (n_tokens + 1) / 2 of one sequence).

    Counts the weight matmuls (2 * weights touched per token), the LM head (2 C V per token) and the
    two attention products q k^T and p v (2 * 2 * Hq * D * context per token). Norms, softmax, RoPE
    and the SwiGLU gate are O(C) per token and left out, as in the 6N rule.
    """
    C, L = config.d_model, config.n_layer
    ctx = (n_tokens + 1) / 2 if context is None else context
    p = count_parameters(config)
    weights = 2 * (p["attention"] + p["mlp"]) * n_tokens
    lm_head = 2 * C * config.vocab_size * n_tokens
    attention = int(round(2 * 2 * L * config.n_head * config.head_dim * ctx * n_tokens))
    return {"weights": weights, "lm_head": lm_head, "attention": attention,
            "total": weights + lm_head + attention}


# ---------------------------------------------------------------- checkpoints

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-gpt"


def load_pretrained(directory: Path | str = MODEL_DIR) -> GPT:
    """The committed tiny GPT (models/tiny-gpt/model.pt + config.json), in eval mode, fp32, on the CPU."""
    directory = Path(directory)
    config = GPTConfig.from_json((directory / "config.json").read_text())
    model = GPT(config)
    state = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval()
