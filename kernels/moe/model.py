"""A small mixture-of-experts GPT: the course's tiny GPT with every MLP replaced by E SwiGLU experts.

Attention, norms, RoPE and the tied embedding are ``kernels.model.gpt``'s. The MoE layer, for the
T = B*S tokens of a batch (x (T, C)):

    u = x W_r^T                               (T, E) router logits
    w, ids = route(u)                         (T, k) weights and experts (kernels.moe.router)
    order, offsets = sort_by_expert(ids)      assignments grouped by expert (kernels.moe.permute)
    h = swiglu(x[rows] W_gu[e])               (M, F) grouped GEMM, gather form (kernels.moe.grouped_gemm)
    y_sorted = h W_down[e]                    (M, C) grouped GEMM
    y = unpermute(y_sorted, order, w)         (T, C) weighted sum over each token's k experts

Balancing (``MoEConfig.balance``): "none"; "switch" (auxiliary loss); "z" (router z-loss);
"switch+z"; "bias" (sigmoid scores, DeepSeek-V3's bias update after every step, no loss).
The losses of each layer are kept on the layer (``last_aux``, ``last_z``) with its load
(``last_load``, (E,) counts) for the training loop to read.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.model.gpt import Attention, GPTConfig, RMSNorm, add_rms_norm_torch
from kernels.moe import balance
from kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_ref
from kernels.moe.permute import sort_by_expert, unpermute_ref
from kernels.moe.router import topk_route, topk_route_ref

BALANCE = ("none", "switch", "z", "switch+z", "bias")
MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "moe"


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 64          # each expert's SwiGLU width F
    balance: str = "none"
    aux_coef: float = 1e-2      # Switch Transformer's alpha
    z_coef: float = 1e-3        # ST-MoE's router z-loss coefficient
    bias_rate: float = 1e-3     # DeepSeek-V3's gamma
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.balance not in BALANCE:
            raise ValueError(f"MoEConfig: balance must be one of {BALANCE}, got {self.balance!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig: top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")

    @property
    def score(self) -> str:
        return "sigmoid" if self.balance == "bias" else "softmax"

    def gpt_config(self) -> GPTConfig:
        """The attention's view of this config (d_ff is unused: the experts replace the MLP)."""
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_kv_head=self.n_kv_head, d_model=self.d_model,
                         rope_theta=self.rope_theta, norm_eps=self.norm_eps)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        C, F_, E = config.d_model, config.d_expert, config.n_experts
        self.router = nn.Linear(C, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(E, C, 2 * F_))   # [gate | up] of every expert
        self.w_down = nn.Parameter(torch.empty(E, F_, C))
        self.register_buffer("bias", torch.zeros(E))                # DeepSeek-V3's selection bias (not trained)
        self.last_load = self.last_aux = self.last_z = None

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        cfg = self.config
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                             # (T, C)
        logits = self.router(x)                                                  # (T, E)
        bias = self.bias if cfg.balance == "bias" else None
        # the kernel router has no backward: with gradients on, the reference routes (same choice)
        route = topk_route if use_kernels and not torch.is_grad_enabled() else topk_route_ref
        weights, ids = route(logits, cfg.top_k, score=cfg.score, bias=bias)     # (T, k) each
        order, offsets = sort_by_expert(ids, cfg.n_experts)
        rows = order // cfg.top_k                                                # (M,) token of each sorted row
        y_sorted = self.experts(x, rows, offsets, use_kernels)                   # (M, C)
        y = unpermute_ref(y_sorted, order, weights).to(x.dtype)                  # (T, C)
        self.last_load = torch.bincount(ids.reshape(-1), minlength=cfg.n_experts).detach()
        if cfg.balance in ("switch", "switch+z"):
            self.last_aux = balance.switch_aux_loss(torch.softmax(logits.float(), dim=-1), ids)
        if cfg.balance in ("z", "switch+z"):
            self.last_z = balance.z_loss(logits)
        return y.view(shape)

    def experts(self, x, rows, offsets, use_kernels: bool) -> torch.Tensor:
        """SwiGLU of every expert on its rows: (M, C) in expert order."""
        F_ = self.config.d_expert
        if use_kernels:
            gu = grouped_gemm(x, self.w_gate_up.to(x.dtype), offsets, rows=rows)    # (M, 2F)
            h = F.silu(gu[:, :F_]) * gu[:, F_:]
            return grouped_gemm(h.contiguous(), self.w_down.to(x.dtype), offsets)   # (M, C)
        gu = grouped_gemm_ref(x, self.w_gate_up, offsets, rows)
        h = F.silu(gu[:, :F_]) * gu[:, F_:]                                         # silu(gate) * up
        return grouped_gemm_ref(h, self.w_down, offsets)

    @torch.no_grad()
    def update_bias(self) -> None:
        """DeepSeek-V3's step: b <- b + gamma * sign(mean load - load), with this batch's load."""
        self.bias.copy_(balance.bias_update(self.bias, self.last_load, self.config.bias_rate))


class MoEBlock(nn.Module):
    """Pre-norm block: h = x + Attn(norm1(x)); out = h + MoE(norm2(h))."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config.gpt_config())
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        self.moe = MoELayer(config)
        self.eps = config.norm_eps

    def forward(self, x, positions, use_kernels: bool = False):
        a = self.attn(self.norm1(x), positions)
        h, hn = add_rms_norm_torch(x, a, self.norm2.weight, self.eps)
        return h + self.moe(hn, use_kernels)


class MoEGPT(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02); the projections into the residual stream (W_o, W_down) scaled by
        1/sqrt(2 n_layer), as in the tiny GPT; norms at 1."""
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            elif name.endswith("wo.weight") or name.endswith("w_down"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.blocks]

    def forward(self, idx: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        """Logits (B, S, V) for token ids idx (B, S)."""
        if idx.dim() != 2 or idx.shape[1] > self.config.block_size:
            raise ValueError(f"MoEGPT: idx must be (B, S) with S <= {self.config.block_size}, got {tuple(idx.shape)}")
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, positions, use_kernels)
        return self.norm_f(x) @ self.wte.weight.T

    def balance_loss(self) -> torch.Tensor:
        """Sum over layers of aux_coef * L_aux + z_coef * L_z (what the config enables)."""
        cfg = self.config
        total = torch.zeros(())
        for layer in self.moe_layers:
            if layer.last_aux is not None:
                total = total + cfg.aux_coef * layer.last_aux
            if layer.last_z is not None:
                total = total + cfg.z_coef * layer.last_z
        return total


def count_parameters(config: MoEConfig) -> dict[str, int]:
    """Total and active (per token) parameters: a token runs k of the E experts."""
    C, E, F_, L = config.d_model, config.n_experts, config.d_expert, config.n_layer
    attn = C * config.n_head * (C // config.n_head) * 2 + 2 * C * config.n_kv_head * (C // config.n_head)
    expert = 3 * C * F_
    dense = config.vocab_size * C + L * (attn + C * E + 2 * C) + C
    return {"total": dense + L * E * expert, "active": dense + L * config.top_k * expert, "per_expert": expert}
