"""Serving arithmetic for real model shapes: what fits in a GPU's memory, and what one step costs.

Pure functions of a model's shape (:class:`ModelShape`, the numbers of its ``config.json``) and of a
GPU from :mod:`kernels.gpu.hardware`; no tensors. The KV-cache chapter uses them to answer two
questions a server has to answer before it runs:

* **the memory budget**: weights + KV cache + workspace must fit in the usable part of the GPU's
  memory, so the free space after weights and workspace, divided by one sequence's cache, is the
  largest batch the GPU can hold at that context length (:func:`plan`);
* **the work of one layer**: FLOPs and the minimum bytes moved by one layer's attention and MLP, for
  a prefill of T tokens or a decode step of one token per sequence over a cache (:func:`layer_work`),
  whose ratio places each on the roofline.

The cache itself is sized by :func:`kernels.attention.gqa.kv_cache_bytes` (one formula for the
whole course); a sliding-window model caches at most ``sliding_window`` positions per sequence
(:func:`cached_positions`), as Mistral 7B's rolling buffer does.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.attention.gqa import kv_cache_bytes
from kernels.gpu import hardware
from kernels.model.gpt import GPTConfig

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}   # bytes per element of each storage dtype
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape as its ``config.json`` gives it (Llama-style: GQA, SwiGLU, RMSNorm, no biases)."""

    name: str
    n_layer: int
    d_model: int               # C
    n_head: int                # Hq
    n_kv_head: int             # Hkv
    head_dim: int              # D
    d_ff: int                  # SwiGLU hidden width F
    vocab_size: int            # V
    max_positions: int         # max_position_embeddings
    tied_embeddings: bool = False
    sliding_window: int | None = None   # keys further back than this are never attended (nor cached)

    def __post_init__(self):
        for field in ("n_layer", "d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "vocab_size", "max_positions"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelShape {self.name!r}: {field} must be >= 1, got {getattr(self, field)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ModelShape {self.name!r}: n_head={self.n_head} must be a multiple of "
                             f"n_kv_head={self.n_kv_head}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelShape {self.name!r}: sliding_window must be >= 1 or None, got {self.sliding_window}")


# From each model's config.json (citation keys in references.bib: hf2024llama3config,
# hf2024llama370bconfig, hf2023mistralconfig; the Llama 3 paper's Table 3, grattafiori2024llama3,
# and the Mistral 7B paper's Table 1, jiang2023mistral, give the same shapes).
LLAMA3_8B = ModelShape("Llama 3 8B", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, head_dim=128,
                       d_ff=14336, vocab_size=128256, max_positions=8192)
LLAMA3_70B = ModelShape("Llama 3 70B", n_layer=80, d_model=8192, n_head=64, n_kv_head=8, head_dim=128,
                        d_ff=28672, vocab_size=128256, max_positions=8192)
MISTRAL_7B = ModelShape("Mistral 7B v0.1", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, head_dim=128,
                        d_ff=14336, vocab_size=32000, max_positions=32768, sliding_window=4096)


def of_gpt(config: GPTConfig, name: str = "tiny GPT") -> ModelShape:
    """The course's tiny GPT (:class:`kernels.model.gpt.GPTConfig`) as a shape: tied embeddings, full attention."""
    return ModelShape(name, n_layer=config.n_layer, d_model=config.d_model, n_head=config.n_head,
                      n_kv_head=config.n_kv_head, head_dim=config.head_dim, d_ff=config.d_ff,
                      vocab_size=config.vocab_size, max_positions=config.block_size, tied_embeddings=True)


def _bytes(dtype: str, what: str) -> int:
    if dtype not in BYTES:
        raise ValueError(f"{what} must be one of {', '.join(BYTES)}, got {dtype!r}")
    return BYTES[dtype]


def parameter_count(m: ModelShape) -> dict[str, int]:
    """Parameters by part: the input embedding (V, C), the LM head (V, C) unless tied, and per layer
    W_q, W_k, W_v, W_o, the three SwiGLU matrices and two norm weights, plus the final norm."""
    C, D = m.d_model, m.head_dim
    attention = C * (m.n_head * D) * 2 + C * (m.n_kv_head * D) * 2        # W_q, W_o; W_k, W_v
    mlp = 3 * C * m.d_ff                                                  # W_gate, W_up, W_down
    parts = {
        "embedding": m.vocab_size * C,
        "lm_head": 0 if m.tied_embeddings else m.vocab_size * C,
        "attention": m.n_layer * attention,
        "mlp": m.n_layer * mlp,
        "norms": m.n_layer * 2 * C + C,
    }
    parts["total"] = sum(parts.values())
    return parts


def cached_positions(m: ModelShape, context: int) -> int:
    """Positions one sequence keeps in its cache at ``context`` tokens: all of them, or at most the
    sliding window (a rolling buffer overwrites position i at slot i % window)."""
    if not 0 <= context <= m.max_positions:
        raise ValueError(f"context must be in 0..{m.max_positions} for {m.name}, got {context}")
    return context if m.sliding_window is None else min(context, m.sliding_window)


def kv_bytes(m: ModelShape, context: int, batch: int = 1, kv_dtype: str = "bf16") -> int:
    """Bytes of the KV cache of ``batch`` sequences at ``context`` tokens each."""
    return kv_cache_bytes(m.n_layer, m.n_kv_head, m.head_dim, cached_positions(m, context), batch,
                          _bytes(kv_dtype, "kv_dtype"))


def workspace_bytes(m: ModelShape, step_tokens: int, act_dtype: str = "bf16") -> int:
    """Activation memory of one step over ``step_tokens`` tokens (all sequences' new tokens together),
    as a model: the fp32 logits (4 V bytes per token) plus one layer's widest live activations in
    ``act_dtype``, the layer input and residual (2 C), Q, K, V (Hq D + 2 Hkv D) and the SwiGLU gate,
    up and product (3 F). Allocator slack, the CUDA context and communication buffers are not counted:
    the usable fraction in :func:`plan` leaves room for them."""
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
    widest = 2 * m.d_model + (m.n_head + 2 * m.n_kv_head) * m.head_dim + 3 * m.d_ff
    return step_tokens * (4 * m.vocab_size + widest * _bytes(act_dtype, "act_dtype"))


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's memory at one context length, in bytes; ``max_batch`` sequences fit (0: none)."""

    usable: int
    weights: int
    workspace: int
    kv_per_sequence: int
    max_batch: int

    @property
    def free_for_kv(self) -> int:
        return self.usable - self.weights - self.workspace


def plan(m: ModelShape, gpu: hardware.GPU | str, context: int, *, weight_dtype: str = "bf16",
         kv_dtype: str = "bf16", step_tokens: int = 2048, utilization: float = 0.9) -> MemoryPlan:
    """The largest batch of sequences at ``context`` tokens that fits on one ``gpu``:

        max_batch = floor((utilization * memory - weights - workspace) / kv_bytes(one sequence))

    ``memory`` is the table's ``hbm_gib`` taken as GiB; ``utilization`` is the fraction a server lets
    itself use (vLLM's default ``gpu_memory_utilization`` is 0.9). 0 when the weights and workspace
    alone do not fit.
    """
    g = hardware.gpu(gpu)
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    usable = int(utilization * g.hbm_gib * GIB)
    weights = parameter_count(m)["total"] * _bytes(weight_dtype, "weight_dtype")
    workspace = workspace_bytes(m, step_tokens)
    per_seq = kv_bytes(m, context, 1, kv_dtype)
    free = usable - weights - workspace
    return MemoryPlan(usable=usable, weights=weights, workspace=workspace, kv_per_sequence=per_seq,
                      max_batch=max(free, 0) // per_seq)


def decode_step_bytes(m: ModelShape, batch: int, context: int, *, weight_dtype: str = "bf16",
                      kv_dtype: str = "bf16") -> dict[str, int]:
    """Bytes one decode step must read from memory at least: every weight a token uses once for the
    whole batch, except the input embedding, of which each sequence reads one row (C values); and each
    sequence's cache (``context`` positions, or the window)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    wb = _bytes(weight_dtype, "weight_dtype")
    p = parameter_count(m)
    # Tied: the LM head is the embedding matrix and reads all of it anyway.
    table = p["embedding"] if m.tied_embeddings else 0
    weights = (p["total"] - p["embedding"] + table) * wb
    rows = 0 if m.tied_embeddings else batch * m.d_model * wb
    return {"weights": weights, "embedding_rows": rows, "kv_cache": kv_bytes(m, context, batch, kv_dtype),
            "total": weights + rows + kv_bytes(m, context, batch, kv_dtype)}


def layer_work(m: ModelShape, new_tokens: int, past: int, batch: int = 1,
               dtype: str = "bf16") -> dict[str, dict[str, float]]:
    """FLOPs and minimum bytes of one layer's attention and MLP when each of ``batch`` sequences
    brings ``new_tokens`` tokens after ``past`` cached ones (prefill: past = 0; decode: new_tokens = 1).

    FLOPs: 2 per weight per token; attention adds q k^T and p v, 4 Hq D per (query, visible key),
    with the causal count of visible keys, past + (T + 1) / 2 on average (the window caps it).
    Bytes, the least any implementation moves: each weight once for the whole batch, the layer's
    input read and output written once per token, the cached K and V of the past positions read
    once and the new ones written once; everything else stays on chip. Weights, activations and the
    cache all in ``dtype``.
    """
    if new_tokens < 1 or past < 0 or batch < 1:
        raise ValueError(f"new_tokens >= 1, past >= 0 and batch >= 1 expected, got {new_tokens}, {past}, {batch}")
    b = _bytes(dtype, "dtype")
    C, D, T = m.d_model, m.head_dim, new_tokens
    tokens = batch * T
    w_attn = C * (m.n_head * D) * 2 + C * (m.n_kv_head * D) * 2
    w_mlp = 3 * C * m.d_ff
    visible = past + (T + 1) / 2
    if m.sliding_window is not None:
        visible = min(visible, m.sliding_window)
    kv_row = 2 * m.n_kv_head * D * b                                      # K and V of one position
    io = 2 * tokens * C * b                                               # input read, output written
    attention = {
        "flops": 2 * w_attn * tokens + 4 * m.n_head * D * visible * tokens,
        "bytes": w_attn * b + io + batch * (cached_positions(m, past) + T) * kv_row,
    }
    mlp = {"flops": 2 * w_mlp * tokens, "bytes": w_mlp * b + io}
    for part in (attention, mlp):
        part["intensity"] = part["flops"] / part["bytes"]
    return {"attention": attention, "mlp": mlp}
