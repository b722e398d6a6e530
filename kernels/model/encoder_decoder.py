"""The 2017 Transformer (Vaswani et al.): an encoder-decoder with post-LN blocks, in plain PyTorch.

Shapes: B batch, S source tokens, T target tokens, C = d_model, H heads, F = d_ff, V the shared vocabulary.

    embed(ids) = E[ids] * sqrt(C) + PE[0..n)            then dropout       (section 3.4, 5.4)
    PE[p, 2i] = sin(p / 10000^(2i/C)),  PE[p, 2i+1] = cos(p / 10000^(2i/C))  (section 3.5)

    encoder layer (post-LN):  x = LN(x + drop(SelfAttn(x)))                 keys: the source, padding masked
                              x = LN(x + drop(FFN(x)))
    decoder layer (post-LN):  y = LN(y + drop(SelfAttn(y, causal)))         target token t sees targets 0..t
                              y = LN(y + drop(CrossAttn(y, memory)))        every target sees every source token
                              y = LN(y + drop(FFN(y)))
    FFN(u) = W_2 drop(relu(W_1 u + b_1)) + b_2,  F = 4C in the paper (2048 for C = 512)
    logits = y_L E^T                                    the embedding is shared by source, target and output

Dropout also acts on the attention probabilities (inside :class:`MultiHeadAttention`, as PyTorch's
``nn.Transformer`` does). ``final_norm=True`` adds one LayerNorm after each stack, as
``nn.Transformer`` always does (the paper's post-LN layers already end in a norm); with it, the
layers load from an ``nn.Transformer`` with :meth:`EncoderDecoder.load_torch`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.attention.mha import MultiHeadAttention


def sinusoidal_positions(n: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """(n, d_model) fp32: PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i), w_i = base^(-2i/d_model)."""
    if d_model % 2:
        raise ValueError(f"sinusoidal_positions: d_model must be even, got {d_model}")
    p = torch.arange(n, dtype=torch.float64)[:, None]                             # (n, 1)
    w = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)     # (C/2,)
    pe = torch.empty(n, d_model, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(p * w), torch.cos(p * w)
    return pe.float()


def sinusoidal_shift(k: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """(d_model, d_model) fp64 M_k with PE[p + k] = M_k PE[p] for every p: a rotation by k w_i of each
    (sin, cos) pair, the same matrix at every position (the relative-position property of section 3.5)."""
    w = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    c, s = torch.cos(k * w), torch.sin(k * w)
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    i = torch.arange(0, d_model, 2)
    m[i, i], m[i, i + 1] = c, s             # sin(a + b) = sin a cos b + cos a sin b
    m[i + 1, i], m[i + 1, i + 1] = -s, c    # cos(a + b) = cos a cos b - sin a sin b
    return m


class FeedForward(nn.Module):
    """W_2 drop(relu(W_1 u + b_1)) + b_2."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.relu(self.linear1(u))))


class EncoderLayer(nn.Module):
    """x = LN(x + drop(SelfAttn(x))); x = LN(x + drop(FFN(x))) (post-LN)."""

    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_head, dropout=dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, src_pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, key_padding_mask=src_pad)))
        return self.norm2(x + self.dropout(self.ffn(x)))

    def load_torch(self, layer: nn.TransformerEncoderLayer) -> "EncoderLayer":
        _check_torch_layer(layer)
        self.self_attn.load_state_dict(MultiHeadAttention.from_torch(layer.self_attn).state_dict())
        _copy_ffn_and_norms(self, layer, ("norm1", "norm2"))
        return self


class DecoderLayer(nn.Module):
    """y = LN(y + drop(SelfAttn(y, causal))); y = LN(y + drop(CrossAttn(y, memory))); y = LN(y + drop(FFN(y)))."""

    def __init__(self, d_model: int, n_head: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_head, dropout=dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_head, dropout=dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: torch.Tensor, memory: torch.Tensor, tgt_pad: torch.Tensor | None = None,
                src_pad: torch.Tensor | None = None) -> torch.Tensor:
        y = self.norm1(y + self.dropout(self.self_attn(y, causal=True, key_padding_mask=tgt_pad)))
        y = self.norm2(y + self.dropout(self.cross_attn(y, memory, key_padding_mask=src_pad)))  # queries: targets
        return self.norm3(y + self.dropout(self.ffn(y)))

    def load_torch(self, layer: nn.TransformerDecoderLayer) -> "DecoderLayer":
        _check_torch_layer(layer)
        self.self_attn.load_state_dict(MultiHeadAttention.from_torch(layer.self_attn).state_dict())
        self.cross_attn.load_state_dict(MultiHeadAttention.from_torch(layer.multihead_attn).state_dict())
        _copy_ffn_and_norms(self, layer, ("norm1", "norm2", "norm3"))
        return self


def _check_torch_layer(layer: nn.Module) -> None:
    if getattr(layer, "norm_first", False):
        raise ValueError("load_torch: the torch layer is pre-LN (norm_first=True); this reference is post-LN")
    if layer.activation not in (F.relu, "relu"):
        raise ValueError("load_torch: the torch layer must use ReLU, as the 2017 model does")


def _copy_ffn_and_norms(ours: nn.Module, theirs: nn.Module, norms: tuple[str, ...]) -> None:
    with torch.no_grad():
        ours.ffn.linear1.load_state_dict(theirs.linear1.state_dict())
        ours.ffn.linear2.load_state_dict(theirs.linear2.state_dict())
        for name in norms:
            getattr(ours, name).load_state_dict(getattr(theirs, name).state_dict())


class EncoderDecoder(nn.Module):
    """The 2017 Transformer: shared embedding scaled by sqrt(C), sinusoidal positions, post-LN stacks,
    tied output projection. Base model: C = 512, H = 8, F = 2048, 6 + 6 layers, dropout 0.1."""

    def __init__(self, vocab_size: int, d_model: int = 512, n_head: int = 8, d_ff: int = 2048,
                 n_layers: int = 6, dropout: float = 0.1, max_len: int = 512, final_norm: bool = False):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model)              # E (V, C): source, target and output
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)     # E * sqrt(C) then has unit-scale entries
        self.register_buffer("pe", sinusoidal_positions(max_len, d_model), persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, n_head, d_ff, dropout) for _ in range(n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(d_model, n_head, d_ff, dropout) for _ in range(n_layers))
        self.enc_norm = nn.LayerNorm(d_model) if final_norm else None
        self.dec_norm = nn.LayerNorm(d_model) if final_norm else None
        self.dropout = nn.Dropout(dropout)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, N) ids -> (B, N, C): E[ids] sqrt(C) + PE[0..N), then dropout."""
        n = ids.shape[1]
        if n > self.pe.shape[0]:
            raise ValueError(f"EncoderDecoder: {n} tokens exceed max_len={self.pe.shape[0]}")
        return self.dropout(self.embed(ids) * math.sqrt(self.d_model) + self.pe[:n])

    def run_encoder(self, x: torch.Tensor, src_pad: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder stack on embedded sources x (B, S, C): the memory (B, S, C)."""
        for layer in self.encoder:
            x = layer(x, src_pad)
        return x if self.enc_norm is None else self.enc_norm(x)

    def run_decoder(self, y: torch.Tensor, memory: torch.Tensor, tgt_pad: torch.Tensor | None = None,
                    src_pad: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder stack on embedded targets y (B, T, C) attending to memory (B, S, C)."""
        for layer in self.decoder:
            y = layer(y, memory, tgt_pad, src_pad)
        return y if self.dec_norm is None else self.dec_norm(y)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor | None = None,
                tgt_pad: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) for target ids tgt (B, T) given source ids src (B, S); pads are True in the masks."""
        for name, t in (("src", src), ("tgt", tgt)):
            if t.dim() != 2 or t.dtype not in (torch.long, torch.int32):
                raise ValueError(f"EncoderDecoder: {name} must be a (B, N) integer tensor, got {tuple(t.shape)} {t.dtype}")
        memory = self.run_encoder(self.embed_tokens(src), src_pad)
        y = self.run_decoder(self.embed_tokens(tgt), memory, tgt_pad, src_pad)
        return y @ self.embed.weight.T                                    # tied output projection

    def load_torch(self, transformer: nn.Transformer) -> "EncoderDecoder":
        """Copy the layers and final norms of a batch-first, post-LN, ReLU ``nn.Transformer`` (which
        has no embedding: :meth:`run_encoder` and :meth:`run_decoder` are what compare)."""
        if self.enc_norm is None:
            raise ValueError("EncoderDecoder.load_torch: nn.Transformer has final norms; build with final_norm=True")
        if len(transformer.encoder.layers) != len(self.encoder):
            raise ValueError("EncoderDecoder.load_torch: the number of layers differs")
        for ours, theirs in zip(self.encoder, transformer.encoder.layers):
            ours.load_torch(theirs)
        for ours, theirs in zip(self.decoder, transformer.decoder.layers):
            ours.load_torch(theirs)
        self.enc_norm.load_state_dict(transformer.encoder.norm.state_dict())
        self.dec_norm.load_state_dict(transformer.decoder.norm.state_dict())
        return self
