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
"switch+z"; "bias" (DeepSeek-V3's bias update after every step, no loss). The score function is
``MoEConfig.router_score`` ("softmax" or "sigmoid"); left unset it is sigmoid for "bias" and softmax
otherwise, the pairings of the papers (the load-balancing chapter also trains the other two).
The losses of each layer are kept on the layer (``last_aux``, ``last_z``) with its load
(``last_load``, (E,) counts, before any capacity drop) for the training loop to read.

The variants the MoE chapters compare, each a field of :class:`MoEConfig` (defaults: none of them):

* ``n_shared`` always-on shared experts of width ``d_expert``, added to the routed output
  (DeepSeekMoE); fine-grained segmentation is just more, narrower experts and a larger ``top_k``;
* ``d_latent``: LatentMoE. The router reads the full-width x; the routed experts work on
  x W_down (T, d_latent) and their weighted sum goes back up through W_up (d_latent -> C);
* ``n_groups`` / ``topk_groups``: device-limited routing (:mod:`kernels.moe.group_route`);
* ``capacity_factor``: assignments past ceil(cf k T / E) per expert are dropped (``last_dropped``);
* ``layer="soft"``: Soft MoE (:mod:`kernels.moe.soft_moe`) with ``slots_per_expert`` slots per
  expert, mixing the tokens of each sequence; ``soft_normalize`` computes its logits as the paper's
  released router does (L2-normalised tokens and slot parameters, one learned scale), and
  ``soft_layers`` puts it in the last blocks only, the blocks before them getting a dense SwiGLU MLP
  of width ``top_k * d_expert`` (the active expert width of a top-k layer, so every arm computes the
  same FLOPs per token).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.model.gpt import MLP, Attention, GPTConfig, RMSNorm, add_rms_norm_torch
from kernels.moe import balance
from kernels.moe.group_route import group_limited_route, group_limited_route_ref
from kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_ref
from kernels.moe.permute import sort_by_expert, unpermute_ref
from kernels.moe.router import capacity, keep_mask, topk_route, topk_route_ref
from kernels.moe.soft_moe import slot_experts, soft_moe, soft_moe_ref

BALANCE = ("none", "switch", "z", "switch+z", "bias")
LAYERS = ("topk", "soft")
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
    router_score: str | None = None       # "softmax" | "sigmoid"; None: sigmoid for "bias", else softmax
    n_shared: int = 0                     # always-on shared experts of width d_expert (DeepSeekMoE)
    d_latent: int | None = None           # LatentMoE: routed experts work at this width
    n_groups: int = 1                     # device-limited routing: expert groups ...
    topk_groups: int | None = None        # ... and how many one token may use (None: all)
    capacity_factor: float | None = None  # None: dropless
    layer: str = "topk"                   # "topk" | "soft"
    slots_per_expert: int = 16            # Soft MoE's p
    soft_normalize: bool = False          # Soft MoE logits: scale * cos(x, phi_j) instead of x . phi_j
    soft_layers: int | None = None        # Soft MoE in the last soft_layers blocks only (None: all)

    def __post_init__(self):
        if self.balance not in BALANCE:
            raise ValueError(f"MoEConfig: balance must be one of {BALANCE}, got {self.balance!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig: top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.router_score not in (None, "softmax", "sigmoid"):
            raise ValueError(f"MoEConfig: router_score must be None, 'softmax' or 'sigmoid', got {self.router_score!r}")
        if self.layer not in LAYERS:
            raise ValueError(f"MoEConfig: layer must be one of {LAYERS}, got {self.layer!r}")
        if self.n_shared < 0:
            raise ValueError(f"MoEConfig: n_shared must be >= 0, got {self.n_shared}")
        if self.d_latent is not None and not 1 <= self.d_latent < self.d_model:
            raise ValueError(f"MoEConfig: d_latent must be in [1, d_model={self.d_model}), got {self.d_latent}")
        if self.n_groups < 1 or self.n_experts % self.n_groups:
            raise ValueError(f"MoEConfig: n_groups must divide n_experts={self.n_experts}, got {self.n_groups}")
        if self.topk_groups is not None and not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"MoEConfig: topk_groups must be in [1, n_groups={self.n_groups}], got {self.topk_groups}")
        if self.topk_groups is not None and self.top_k > self.topk_groups * (self.n_experts // self.n_groups):
            raise ValueError(f"MoEConfig: top_k={self.top_k} experts do not fit in {self.topk_groups} groups")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig: capacity_factor must be positive or None, got {self.capacity_factor}")
        if self.layer == "soft" and (self.balance != "none" or self.n_shared or self.d_latent or self.n_groups > 1
                                     or self.capacity_factor is not None):
            raise ValueError("MoEConfig: layer='soft' takes none of balance, n_shared, d_latent, n_groups, "
                             "capacity_factor (its loads are even by construction)")
        if self.layer != "soft" and (self.soft_normalize or self.soft_layers is not None):
            raise ValueError("MoEConfig: soft_normalize and soft_layers apply to layer='soft' only")
        if self.soft_layers is not None and not 1 <= self.soft_layers <= self.n_layer:
            raise ValueError(f"MoEConfig: soft_layers must be in [1, n_layer={self.n_layer}], got {self.soft_layers}")

    @property
    def score(self) -> str:
        if self.router_score is not None:
            return self.router_score
        return "sigmoid" if self.balance == "bias" else "softmax"

    @property
    def expert_width(self) -> int:
        """The width the routed experts read and write: d_latent for LatentMoE, else d_model."""
        return self.d_latent or self.d_model

    @property
    def n_dense(self) -> int:
        """The first blocks, with a dense MLP instead of an MoE layer (Soft MoE in the last layers only)."""
        return self.n_layer - self.soft_layers if self.soft_layers is not None else 0

    def gpt_config(self) -> GPTConfig:
        """The attention's view of this config; d_ff is the width of the dense blocks' MLP."""
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_kv_head=self.n_kv_head, d_model=self.d_model,
                         d_ff=self.top_k * self.d_expert, rope_theta=self.rope_theta, norm_eps=self.norm_eps)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        C, F_, E, W = config.d_model, config.d_expert, config.n_experts, config.expert_width
        self.router = nn.Linear(C, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(E, W, 2 * F_))   # [gate | up] of every expert
        self.w_down = nn.Parameter(torch.empty(E, F_, W))
        self.register_buffer("bias", torch.zeros(E))                # DeepSeek-V3's selection bias (not trained)
        if config.d_latent:                                         # LatentMoE's two shared projections
            self.latent_down = nn.Linear(C, config.d_latent, bias=False)
            self.latent_up = nn.Linear(config.d_latent, C, bias=False)
        if config.n_shared:                                         # DeepSeekMoE's shared experts, one SwiGLU
            self.shared_gate_up = nn.Parameter(torch.empty(C, 2 * config.n_shared * F_))
            self.shared_down = nn.Parameter(torch.empty(config.n_shared * F_, C))
        self.last_load = self.last_aux = self.last_z = self.last_dropped = self.last_ids = None

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        cfg = self.config
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                             # (T, C)
        logits = self.router(x)                                                  # (T, E): always the full-width x
        weights, ids = self.route(logits, use_kernels)                           # (T, k) each
        keep = None
        if cfg.capacity_factor is not None:
            keep = keep_mask(ids, cfg.n_experts, capacity(x.shape[0], cfg.n_experts, cfg.top_k, cfg.capacity_factor))
            self.last_dropped = int((~keep).sum())
        order, offsets = sort_by_expert(ids, cfg.n_experts, keep)
        rows = order // cfg.top_k                                                # (M,) token of each sorted row
        xe = self.latent_down(x) if cfg.d_latent else x                          # (T, W)
        y_sorted = self.experts(xe, rows, offsets, use_kernels)                  # (M, W)
        y = unpermute_ref(y_sorted, order, weights).to(x.dtype)                  # (T, W)
        if cfg.d_latent:
            y = self.latent_up(y)                                                # (T, C)
        if cfg.n_shared:
            y = y + self.shared(x)
        self.last_ids = ids.detach()
        self.last_load = torch.bincount(ids.reshape(-1), minlength=cfg.n_experts).detach()
        if cfg.balance in ("switch", "switch+z"):
            self.last_aux = balance.switch_aux_loss(self.probabilities(logits), ids)
        if cfg.balance in ("z", "switch+z"):
            self.last_z = balance.z_loss(logits)
        return y.view(shape)

    def route(self, logits: torch.Tensor, use_kernels: bool):
        """(weights, ids), each (T, k): top-k, or group-limited when the config has groups."""
        cfg = self.config
        bias = self.bias if cfg.balance == "bias" else None
        # the kernel routers have no backward: with gradients on, the reference routes (same choice)
        kernel = use_kernels and not torch.is_grad_enabled()
        if cfg.n_groups > 1:
            route = group_limited_route if kernel else group_limited_route_ref
            return route(logits, cfg.top_k, cfg.n_groups, cfg.topk_groups or cfg.n_groups, score=cfg.score, bias=bias)
        route = topk_route if kernel else topk_route_ref
        return route(logits, cfg.top_k, score=cfg.score, bias=bias)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """(T, E) router probabilities for the auxiliary loss's P_i: the softmax, or for sigmoid
        scores each token's scores divided by their sum (DeepSeek-V3's sequence-wise loss does the same)."""
        if self.config.score == "softmax":
            return torch.softmax(logits.float(), dim=-1)
        s = torch.sigmoid(logits.float())
        return s / s.sum(dim=-1, keepdim=True)

    def experts(self, x, rows, offsets, use_kernels: bool) -> torch.Tensor:
        """SwiGLU of every expert on its rows: (M, W) in expert order."""
        F_ = self.config.d_expert
        if use_kernels:
            gu = grouped_gemm(x, self.w_gate_up.to(x.dtype), offsets, rows=rows)    # (M, 2F)
            h = F.silu(gu[:, :F_]) * gu[:, F_:]
            return grouped_gemm(h.contiguous(), self.w_down.to(x.dtype), offsets)   # (M, W)
        gu = grouped_gemm_ref(x, self.w_gate_up, offsets, rows)
        h = F.silu(gu[:, :F_]) * gu[:, F_:]                                         # silu(gate) * up
        return grouped_gemm_ref(h, self.w_down, offsets)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts: one SwiGLU of width n_shared * d_expert on every token (T, C)."""
        gu = x @ self.shared_gate_up
        half = gu.shape[1] // 2
        return (F.silu(gu[:, :half]) * gu[:, half:]) @ self.shared_down

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None) -> None:
        """DeepSeek-V3's step: b <- b + gamma * sign(mean load - load), with this batch's load (or
        ``load``, e.g. the load all-reduced over data-parallel ranks)."""
        load = self.last_load if load is None else load
        self.bias.copy_(balance.bias_update(self.bias, load, self.config.bias_rate))


class SoftMoELayer(nn.Module):
    """Soft MoE over the tokens of each sequence: x (B, S, C) -> (B, S, C) (:mod:`kernels.moe.soft_moe`)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        C, F_, E = config.d_model, config.d_expert, config.n_experts
        self.phi = nn.Parameter(torch.empty(C, E * config.slots_per_expert))    # slot logits X Phi
        self.scale = nn.Parameter(torch.ones(())) if config.soft_normalize else None   # the paper's learned scale
        self.w_gate_up = nn.Parameter(torch.empty(E, C, 2 * F_))
        self.w_down = nn.Parameter(torch.empty(E, F_, C))
        self.last_load = self.last_aux = self.last_z = self.last_dropped = None

    def forward(self, x: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"SoftMoELayer: x must be (B, S, C): slots mix the tokens of a sequence, got {tuple(x.shape)}")
        experts = lambda slots: slot_experts(slots, self.w_gate_up.to(slots.dtype), self.w_down.to(slots.dtype))  # noqa: E731
        scale = None if self.scale is None else self.scale.to(x.dtype)
        y = (soft_moe if use_kernels else soft_moe_ref)(x, self.phi.to(x.dtype), experts, scale)
        cfg = self.config
        self.last_load = torch.full((cfg.n_experts,), x.shape[0] * cfg.slots_per_expert, dtype=torch.long)
        return y

    def update_bias(self, load=None) -> None:
        raise ValueError("SoftMoELayer: Soft MoE has no routing bias to update")


class MoEBlock(nn.Module):
    """Pre-norm block: h = x + Attn(norm1(x)); out = h + MoE(norm2(h)), or h + MLP(norm2(h)) for a
    dense block (``moe`` is then None)."""

    def __init__(self, config: MoEConfig, dense: bool = False):
        super().__init__()
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config.gpt_config())
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        if dense:
            self.mlp, self.moe = MLP(config.gpt_config()), None
        else:
            self.moe = SoftMoELayer(config) if config.layer == "soft" else MoELayer(config)
        self.eps = config.norm_eps

    def forward(self, x, positions, use_kernels: bool = False):
        a = self.attn(self.norm1(x), positions)
        h, hn = add_rms_norm_torch(x, a, self.norm2.weight, self.eps)
        return h + (self.mlp(hn, use_kernels) if self.moe is None else self.moe(hn, use_kernels))


class MoEGPT(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(MoEBlock(config, dense=i < config.n_dense) for i in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02); the projections into the residual stream (W_o, the experts' W_down, the
        shared experts' down projection, LatentMoE's W_up) scaled by 1/sqrt(2 n_layer), as in the tiny
        GPT; norms and Soft MoE's learned scale at 1."""
        into_residual = ("wo.weight", "w_down", "mlp.w_down.weight", "shared_down", "latent_up.weight")
        for name, p in self.named_parameters():
            if "norm" in name or name.endswith("moe.scale"):        # norms and Soft MoE's scale at 1
                nn.init.ones_(p)
            elif name.endswith(into_residual):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    @property
    def moe_layers(self) -> list:
        return [b.moe for b in self.blocks if b.moe is not None]

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
    """Total and active (per token) parameters. A token runs k of the E routed experts, the shared
    experts and LatentMoE's two projections; a Soft MoE token's slot share runs through k = E p / S
    experts' worth of weights (its active count uses that expert FLOP equivalent). Dense blocks (Soft
    MoE in the last layers only) run their whole SwiGLU MLP of width k F."""
    C, E, F_, L, W = config.d_model, config.n_experts, config.d_expert, config.n_layer, config.expert_width
    M = L - config.n_dense                                                      # MoE layers
    attn = C * config.n_head * (C // config.n_head) * 2 + 2 * C * config.n_kv_head * (C // config.n_head)
    expert = 3 * W * F_
    if config.layer == "soft":
        router = C * E * config.slots_per_expert + int(config.soft_normalize)   # Phi and the scale
        k_equiv = E * config.slots_per_expert / config.block_size
    else:
        router = C * E
        k_equiv = config.top_k
    always = 2 * C * (config.d_latent or 0) + 3 * C * config.n_shared * F_     # latent projections, shared experts
    mlp = 3 * C * config.top_k * F_                                             # a dense block's SwiGLU
    dense = config.vocab_size * C + L * (attn + 2 * C) + M * (router + always) + config.n_dense * mlp + C
    return {"total": dense + M * E * expert, "active": dense + round(M * k_equiv * expert), "per_expert": expert}
