"""Expert offloading: serve an MoE whose experts do not all fit in GPU memory.

The experts live in host memory; the GPU holds a *cache* of ``slots`` experts per layer and, at
decode, copies in over PCIe each expert a token needs that is not there (Eliseev and Mazur 2023,
"Mixtral offloading"). Two ideas cut the copies:

* **LRU**: keep the experts used most recently (a token's experts are often the previous token's);
  :func:`simulate` counts hits and misses of a routing trace for any cache size;
* **speculative prefetch**: guess layer l's experts before it runs and start copying them; a right
  guess hides the copy behind whatever compute is left before layer l's experts are needed.
  :func:`routing_trace` records, per token and layer, the experts the model used and the experts
  the guess names, from one of two points: ``guess_from="block"`` applies layer l's router to the
  residual stream *entering block l* (known once block l-1 is done, so the copy can hide only
  behind block l's attention); ``guess_from="moe"`` applies it to the input of layer l-1's MoE, the
  hidden state that layer's own gate sees (Eliseev and Mazur's point: the copy hides behind layer
  l-1's experts and block l's attention, at the price of a guess made from an older state).

The kernel is the grouped GEMM of :mod:`kernels.moe.grouped_gemm` reading its weights from the
cache through a table ``slot_of`` (expert e is in slot ``slot_of[e]``): :func:`cached_expert_gemm`.
A copy is bytes / link bandwidth (:mod:`kernels.gpu.interconnect`); :func:`token_time` turns counts
into modelled seconds per token: the copies of one layer's prefetch overlap the compute that
remains between the guess and that layer's experts (``hidden_s_per_layer``, which the guess point
sets), on-demand copies overlap nothing.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kernels.model.gpt import rms_norm_torch
from kernels.moe import grouped_gemm as gg
from kernels.moe.router import _stable_topk


# ----------------------------------------------------------------------------------------------
# The routing trace of a model


GUESS_POINTS = ("block", "moe")


@torch.no_grad()
def routing_trace(model, idx: torch.Tensor, guess_from: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """``(used, guessed)``, each (T, L, k) int64 for the B*S tokens of idx (B, S) in decode order
    (sequence by sequence, position by position): the experts each layer used, and for layers
    1..L-1 the experts that layer's router picks from the state ``guess_from`` names (module
    docstring: "block", the stream entering its block; "moe", the input of the previous layer's
    MoE); layer 0's guess is -1 (nothing runs before it)."""
    if guess_from not in GUESS_POINTS:
        raise ValueError(f"routing_trace: guess_from must be one of {GUESS_POINTS}, got {guess_from!r}")
    model.eval()
    entering, moe_in = [], []
    hooks = [block.register_forward_pre_hook(lambda _m, args: entering.append(args[0].detach()))
             for block in model.blocks]
    hooks += [layer.register_forward_pre_hook(lambda _m, args: moe_in.append(args[0].detach()))
              for layer in model.moe_layers]
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    k = model.config.top_k
    used = torch.stack([layer.last_ids for layer in model.moe_layers], dim=1)           # (T, L, k)
    guessed = torch.full_like(used, -1)
    for layer, block in enumerate(model.blocks):
        if layer == 0:
            continue
        if guess_from == "block":
            x = entering[layer]                                                     # skips this block's attention
            h = rms_norm_torch(x, block.norm2.weight, block.eps).reshape(-1, x.shape[-1])
        else:
            h = moe_in[layer - 1].reshape(-1, moe_in[layer - 1].shape[-1])          # (T, C), already normalised
        guessed[:, layer] = _stable_topk(block.moe.router(h), k)
    return used, guessed


# ----------------------------------------------------------------------------------------------
# Mixtral's published routing statistics, and what they bound


# Jiang et al. 2024 (arXiv 2401.04088), section 5, Table 5: for consecutive tokens i, i+1 of 8 subsets
# of The Pile, at Mixtral 8x7B's layers 0, 15 and 31, the fraction whose first-choice expert is the
# same, and the fraction whose two experts share at least one ("first or second choice").
MIXTRAL_REPEATS = {   # subset: {layer: (first choice repeated, at least one expert shared)}
    "ArXiv":            {0: (0.140, 0.465), 15: (0.279, 0.623), 31: (0.227, 0.529)},
    "DM Mathematics":   {0: (0.141, 0.449), 15: (0.284, 0.670), 31: (0.197, 0.445)},
    "Github":           {0: (0.149, 0.499), 15: (0.281, 0.669), 31: (0.197, 0.492)},
    "Gutenberg":        {0: (0.139, 0.495), 15: (0.261, 0.631), 31: (0.263, 0.522)},
    "PhilPapers":       {0: (0.136, 0.469), 15: (0.253, 0.619), 31: (0.221, 0.513)},
    "PubMed Abstracts": {0: (0.142, 0.486), 15: (0.246, 0.616), 31: (0.220, 0.518)},
    "StackExchange":    {0: (0.136, 0.482), 15: (0.272, 0.646), 31: (0.236, 0.536)},
    "Wikipedia (en)":   {0: (0.144, 0.498), 15: (0.236, 0.621), 31: (0.253, 0.518)},
}
MIXTRAL_LAYERS = (0, 15, 31)

# Eliseev and Mazur 2023 (arXiv 2312.17238), Table 2: Mixtral-8x7B-Instruct with 4-bit attention and
# 2-bit experts, tokens per second at batch 1, the full system and its ablations; k = 2 cached experts
# per layer on the RTX 3060, 4 on the others (their section 4.3).
EM_TOKENS_PER_S = {   # gpu: (full, without pre-loading, without LRU and pre-loading, naive offloading)
    "A100": (3.061, 2.918, 2.265, 1.392),
    "RTX 3080 Mobile": (2.655, 2.227, 1.758, 1.059),
    "RTX 3060": (2.278, 2.051, 1.547, 0.919),
    "T4 (Colab)": (2.092, 1.567, 1.168, 0.661),
}


def random_repeats(n_experts: int = 8, k: int = 2) -> tuple[float, float]:
    """(first choice repeated, at least one of k shared) for consecutive tokens routed at random:
    1/E and 1 - C(E-k, k) / C(E, k) (1/8 and 13/28 for Mixtral's top-2 of 8)."""
    return 1 / n_experts, 1 - math.comb(n_experts - k, k) / math.comb(n_experts, k)


def repeat_rates(used: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Table 5's two statistics of a trace (T, L, k) made of sequences of ``seq_len`` tokens, per
    layer (L,): consecutive tokens (within a sequence) whose first choice is the same, and whose
    experts share at least one. ``used[..., 0]`` must be each token's first choice."""
    T = used.shape[0]
    pair = (torch.arange(1, T) % seq_len) != 0                                   # (T-1,) same sequence
    prev, nxt = used[:-1][pair], used[1:][pair]                                  # (P, L, k)
    first = (prev[..., 0] == nxt[..., 0]).double().mean(0)
    shared = (nxt[..., :, None] == prev[..., None, :]).any(-1).any(-1).double().mean(0)
    return first, shared


def lru_hit_rate_bounds(p_shared: float, k: int = 2) -> tuple[float, float]:
    """With a cache of exactly k experts per layer and top-k routing, LRU holds the previous token's
    k experts, so its hit rate is E[experts shared] / k. Knowing only p = P(at least one shared),
    p <= E[shared] <= k p: the hit rate lies in [p / k, p]."""
    if not 0 <= p_shared <= 1:
        raise ValueError(f"lru_hit_rate_bounds: p_shared must be a probability, got {p_shared}")
    return p_shared / k, p_shared


# ----------------------------------------------------------------------------------------------
# The cache


@dataclass
class CacheStats:
    hits: int = 0               # needed and already in the cache
    prefetched: int = 0         # needed, not cached, but copied ahead by a right guess (latency hidden)
    misses: int = 0             # needed and copied on demand (the token waits)
    wasted: int = 0             # copied ahead on a wrong guess
    tokens: int = 0

    @property
    def needed(self) -> int:
        return self.hits + self.prefetched + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.needed

    @property
    def copies(self) -> int:
        return self.prefetched + self.misses + self.wasted


def simulate(used: torch.Tensor, slots: int, guessed: torch.Tensor | None = None) -> list[CacheStats]:
    """Replay a trace (T, L, k) through an LRU cache of ``slots`` experts per layer; one
    :class:`CacheStats` per layer. With ``guessed`` (T, L, k), a layer's guessed experts that are not
    cached are copied in (evicting the least recently used) before the layer runs: a guess the
    layer then uses counts as ``prefetched``, one it does not as ``wasted``."""
    if used.dim() != 3:
        raise ValueError(f"simulate: used must be a (T, L, k) trace, got {tuple(used.shape)}")
    T, L, k = used.shape
    if not k <= slots:
        raise ValueError(f"simulate: slots must be at least k={k} (a token's experts must fit), got {slots}")
    if guessed is not None and guessed.shape != used.shape:
        raise ValueError(f"simulate: guessed must have the trace's shape {tuple(used.shape)}, got {tuple(guessed.shape)}")
    stats = [CacheStats(tokens=T) for _ in range(L)]
    caches = [OrderedDict() for _ in range(L)]                    # expert -> None, oldest first
    for t in range(T):
        for layer in range(L):
            cache, st = caches[layer], stats[layer]
            need = used[t, layer].tolist()
            ahead = set()
            if guessed is not None and guessed[t, layer, 0] >= 0:
                guess = guessed[t, layer].tolist()
                for e in guess:
                    if e not in cache:                            # evict by recency among the experts
                        _insert(cache, e, slots, keep=set(guess)) # not guessed (the guess is all it knows)
                        ahead.add(e)
            for e in need:
                if e in cache:
                    if e in ahead:
                        st.prefetched += 1
                    else:
                        st.hits += 1
                    cache.move_to_end(e)
                else:
                    st.misses += 1
                    _insert(cache, e, slots, keep=set(need))
            st.wasted += len(ahead - set(need))
    return stats


def _insert(cache: OrderedDict, expert: int, slots: int, keep: set) -> None:
    """Put ``expert`` in, evicting the least recently used expert not in ``keep``."""
    while len(cache) >= slots:
        victim = next(e for e in cache if e not in keep)
        del cache[victim]
    cache[expert] = None


def token_time(stats: list[CacheStats], expert_bytes: float, link_gbs: float, compute_s_per_layer: float, *,
               hidden_s_per_layer: float) -> float:
    """Modelled seconds per token: every layer's compute, plus its on-demand copies in full, plus
    the part of its prefetch copies (right and wrong guesses) that the compute between the guess
    and the layer's experts, ``hidden_s_per_layer``, does not cover."""
    if not 0 <= hidden_s_per_layer:
        raise ValueError(f"token_time: hidden_s_per_layer must be >= 0, got {hidden_s_per_layer}")
    copy = expert_bytes / (link_gbs * 1e9)
    total = 0.0
    for st in stats:
        ahead = (st.prefetched + st.wasted) / st.tokens * copy
        total += compute_s_per_layer + st.misses / st.tokens * copy + max(0.0, ahead - hidden_s_per_layer)
    return total


# ----------------------------------------------------------------------------------------------
# The kernel: the grouped GEMM reading experts from the cache


def cached_expert_gemm(a: torch.Tensor, cache_w: torch.Tensor, slot_of: torch.Tensor, offsets: torch.Tensor, *,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """C (M, N) = A[rows[r]] @ cache_w[slot_of[e(r)]] for the sorted rows r of each expert e.

    cache_w (slots, K, N): the resident experts; slot_of (E,) int: expert e's slot, -1 if it is not
    resident (then it must have no rows); offsets (E + 1,) as for :func:`kernels.moe.grouped_gemm.grouped_gemm`."""
    E = offsets.numel() - 1
    if slot_of.shape != (E,) or slot_of.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cached_expert_gemm: slot_of must be an integer (E,) = ({E},) table, got "
                         f"{slot_of.dtype} {tuple(slot_of.shape)}")
    loads = offsets[1:] - offsets[:-1]
    missing = ((slot_of < 0) & (loads > 0)).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"cached_expert_gemm: experts {missing} have rows but no cache slot (copy them in first)")
    if int(slot_of.max()) >= cache_w.shape[0]:
        raise ValueError(f"cached_expert_gemm: slot_of names slot {int(slot_of.max())} of a {cache_w.shape[0]}-slot cache")
    if cache_w.dim() != 3 or a.dim() != 2 or a.shape[1] != cache_w.shape[1] or a.dtype != cache_w.dtype:
        raise ValueError(f"cached_expert_gemm: a (rows, K) and cache_w (slots, K, N) must agree in K and dtype, "
                         f"got {tuple(a.shape)} {a.dtype} and {tuple(cache_w.shape)} {cache_w.dtype}")
    M = int(offsets[-1])
    if rows is None and a.shape[0] != M:
        raise ValueError(f"cached_expert_gemm: offsets end at M={M} but a has {a.shape[0]} rows (pass rows=)")
    return gg._forward(a, cache_w, rows, offsets, M, slot_of=slot_of.clamp(min=0).to(torch.int32))


# The decode step of Mixtral 8x7B with an expert cache: one token, its 2 experts (gate+up, 4096 -> 2 x 14336)
# read from a cache of 4 resident experts.
DECODE_CASE = dict(tokens=1, top_k=2, n_experts=8, slots=4, K=4096, N=2 * 14336)


def compile_jobs() -> dict:
    """The cached expert GEMM at a Mixtral decode step (meta tensors, the sm90 tiles)."""
    from kernels import inspect as ki

    c = DECODE_CASE
    M = c["tokens"] * c["top_k"]
    meta = dict(device="meta", dtype=torch.bfloat16)
    a, out = torch.empty(c["tokens"], c["K"], **meta), torch.empty(M, c["N"], **meta)
    cache_w = torch.empty(c["slots"], c["K"], c["N"], **meta)
    rows = torch.empty(M, dtype=torch.int64, device="meta")
    offsets = torch.empty(c["n_experts"] + 1, dtype=torch.int64, device="meta")
    tiles = gg.TILES["sm90"]
    schedule = tuple(torch.empty(gg.num_tile_slots(M, c["n_experts"], tiles[0]), dtype=torch.int32, device="meta")
                     for _ in range(3))
    grid, args, kwargs = gg._forward_args(a, cache_w, rows, out, offsets, schedule, tiles, on_gpu=True)
    return {"cached_expert_gemm Mixtral decode (1 token, 2 of 4 cached experts, 4096 -> 28672)":
            ki.launch_job(gg._grouped_gemm_kernel, *args, grid=grid, **kwargs)}
