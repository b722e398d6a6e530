"""What an MoE costs to train and serve: parameters, active parameters, FLOPs per token, bytes per
token at decode, and all-to-all bytes per token, computed from a model's released configuration.

Counts (per model: L layers, of which L_moe are MoE; d the hidden width; V the vocabulary):

    params  = embeddings (V d, twice when the output head is untied) + L attention + dense MLPs
              + L_moe (E routed + S shared) 3 d F + routers (E d, and E biases) + norms
    active  = the same with k routed experts instead of E (every token runs the shared experts)
    FLOPs   = 2 * active matmul parameters per token (the embedding lookup is no matmul), forward
              only; a training step is about 3 times that (forward + two backward GEMMs)
    decode bytes per token at batch B, bf16:
            = (always-read weights + L_moe * E_B * expert bytes) / B + KV-cache bytes read,
              E_B = E (1 - (1 - k/E)^B) experts a layer touches for B tokens routed evenly at random
    all-to-all (expert parallelism): each token's vector goes to its k experts and comes back,
              k d (dispatch bytes + combine bytes) per MoE layer; V3 dispatches in FP8 (1 byte) and
              combines in BF16 (2 bytes), and a token crosses to at most 4 nodes.

Attention parameters follow each model: grouped-query attention for Mixtral, multi-head latent
attention (low-rank queries and a compressed KV of 512 + 64 per token) for DeepSeek-V3.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoESpec:
    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_dense_layers: int       # layers with a dense MLP instead of experts (the first ones)
    d_ff_dense: int
    n_experts: int
    n_shared: int
    top_k: int
    d_expert: int
    attention: int            # parameters of one attention layer (its norms included)
    kv_bytes_per_token: int   # KV cache bytes per token per layer, bf16
    tied: bool = False
    router_bias: bool = False

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def expert_params(self) -> int:
        return 3 * self.d_model * self.d_expert

    def always_params(self) -> int:
        """Parameters every token reads: embeddings/head, attention, dense MLPs, shared experts,
        routers, norms."""
        d = self.d_model
        emb = self.vocab * d * (1 if self.tied else 2)
        router = self.n_moe_layers * (self.n_experts * d + (self.n_experts if self.router_bias else 0))
        norms = 2 * d * self.n_layers + d
        dense = self.n_dense_layers * 3 * d * self.d_ff_dense
        shared = self.n_moe_layers * self.n_shared * self.expert_params
        return emb + self.n_layers * self.attention + dense + shared + router + norms

    def total_params(self) -> int:
        return self.always_params() + self.n_moe_layers * self.n_experts * self.expert_params

    def active_params(self) -> int:
        return self.always_params() + self.n_moe_layers * self.top_k * self.expert_params

    def flops_per_token(self) -> float:
        """Forward FLOPs of the weights (2 per active matmul parameter; no attention-score FLOPs)."""
        return 2.0 * (self.active_params() - self.vocab * self.d_model)

    def experts_touched(self, batch: int) -> float:
        """E (1 - (1 - k/E)^B): experts of one layer that at least one of B tokens uses (even, independent routing)."""
        return self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** batch)

    def decode_bytes_per_token(self, batch: int, context: int, weight_bytes: float = 2.0) -> float:
        """HBM bytes one decode step reads, per token of a batch of ``batch`` sequences at ``context`` tokens."""
        weights = self.always_params() + self.n_moe_layers * self.experts_touched(batch) * self.expert_params
        return weights * weight_bytes / batch + context * self.n_layers * self.kv_bytes_per_token

    def all_to_all_bytes_per_token(self, dispatch_bytes: float = 2.0, combine_bytes: float = 2.0) -> float:
        """Bytes one token sends out and back across the expert-parallel group, all MoE layers, if
        none of its k experts is on its own GPU (the upper end)."""
        return self.n_moe_layers * self.top_k * self.d_model * (dispatch_bytes + combine_bytes)


def _gqa(d: int, n_heads: int, n_kv: int, head_dim: int) -> int:
    return d * n_heads * head_dim * 2 + 2 * d * n_kv * head_dim


def _mla(d: int, n_heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int) -> int:
    q = d * q_rank + q_rank + q_rank * n_heads * (nope + rope)          # W_DQ, its norm, W_UQ
    kv = d * (kv_rank + rope) + kv_rank + kv_rank * n_heads * (nope + v)  # W_DKV (+ shared rope key), norm, W_UKV
    return q + kv + n_heads * v * d                                     # + W_O


# Mixtral 8x7B (Jiang et al. 2024, Table 1): dim 4096, 32 layers, 32 heads of 128, 8 KV heads,
# FFN 14336, vocabulary 32000, 8 experts, top-2, untied head. DeepSeek-V3 (deepseek-ai/DeepSeek-V3
# inference/configs/config_671B.json): dim 7168, 61 layers (first 3 dense, FFN 18432), 128 heads,
# MLA with q rank 1536, KV rank 512, nope 128 + rope 64 key dims, value 128; 256 routed experts of
# 2048 and 1 shared, top-8, vocabulary 129280, untied head, router bias.
MIXTRAL = MoESpec("Mixtral 8x7B", vocab=32000, d_model=4096, n_layers=32, n_dense_layers=0, d_ff_dense=0,
                  n_experts=8, n_shared=0, top_k=2, d_expert=14336, attention=_gqa(4096, 32, 8, 128),
                  kv_bytes_per_token=2 * 8 * 128 * 2)
DEEPSEEK_V3 = MoESpec("DeepSeek-V3", vocab=129280, d_model=7168, n_layers=61, n_dense_layers=3, d_ff_dense=18432,
                      n_experts=256, n_shared=1, top_k=8, d_expert=2048,
                      attention=_mla(7168, 128, 1536, 512, 128, 64, 128), kv_bytes_per_token=(512 + 64) * 2,
                      router_bias=True)
SPECS = {s.name: s for s in (MIXTRAL, DEEPSEEK_V3)}


def ledger(spec: MoESpec, *, batch: int = 1, context: int = 4096) -> dict[str, float]:
    """One row of the chapter's table."""
    return {"params (B)": spec.total_params() / 1e9, "active (B)": spec.active_params() / 1e9,
            "GFLOP/token fwd": spec.flops_per_token() / 1e9,
            f"decode MB/token (B={batch}, ctx {context})": spec.decode_bytes_per_token(batch, context) / 1e6,
            "all-to-all MB/token": spec.all_to_all_bytes_per_token() / 1e6}

