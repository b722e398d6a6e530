"""Medusa: K extra heads on the frozen model's last hidden state, a tree of their candidates, and one
forward of the base model that verifies the whole tree (Cai et al. 2024).

* :class:`MedusaHeads`: head k (k = 1..K) reads the base model's final normed hidden state h_t at
  position t and predicts the token at t + 1 + k (the base LM head predicts t + 1):

      logits_k = (h_t + SiLU(W_k h_t + b_k)) @ E^T                          (one residual block per head)

  E is the tiny GPT's tied embedding, i.e. its LM head. The paper gives every head its own LM head
  W2_k (initialised from the base one); here all heads SHARE the frozen base LM head, so a head
  costs C*C + C parameters instead of C*C + C*V. W_k starts at zero: every head starts as the base
  head. Medusa-1: the base model is frozen, only the heads train (``python -m kernels.speculative.medusa``).
* :class:`Tree`: a fixed sparse tree of candidates. A node is a path of ranks (r_1, .., r_d): "the
  r_1-th choice of head 1, then the r_2-th choice of head 2, ...". The tree is chosen greedily from
  each head's measured rank accuracy (the chance that the truth is the head's r-th guess), keeping
  the nodes with the largest product of accuracies whose parent is already in, as the paper's
  sparse trees do. Node 0 is the root: the token the base model has already chosen.
* :func:`tree_forward`: the tree flattened into one sequence after the cached prefix; every node
  attends to the whole prefix and to its own ancestors (:func:`tree_mask_ref`), at position
  prefix + depth. One forward scores every candidate path.
* :func:`tree_attention_ref` (PyTorch) and :func:`tree_attention` (Triton): attention of the tree's
  queries over the KV cache (prefix then tree nodes), the ancestor mask built in the kernel by
  walking a parent-index array. ``broken=True`` uses a causal mask instead (a node then sees its
  siblings and cousins), for the tests to catch.
* :func:`medusa_generate`: greedy Medusa decoding (equal to plain greedy decoding token for token),
  and two rules at temperature > 0: ``"exact"`` (each node's candidates are tried in order, each
  accepted with its probability under the residual of the ones rejected before it: the output is
  distributed as the model's) and ``"typical"`` (the paper's typical acceptance: accept x when
  p(x) > min(eps, delta * exp(-H(p))), eps = 0.09 and delta = 0.3 by default, the values the authors'
  ``medusa_generate`` passes to ``evaluate_posterior`` (posterior_threshold, posterior_alpha); the
  longest accepted path is kept, ties broken by its summed log-likelihood, as there; the output is NOT
  distributed as the model's).

Shapes: B batch, Hq / Hkv query / key-value heads, T tree nodes (root included), D head dim,
S cache slots, L the prefix length (cached positions before the tree), C d_model, V vocabulary.
"""
from __future__ import annotations

import heapq
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.model.gpt import GPT, KVCache, add_rms_norm_torch, rope

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "medusa"
N_HEADS = 4            # K
TOPK = 10              # ranks kept per head when building the tree
TREE_NODES = 32        # candidate nodes (the root not counted)


# ---------------------------------------------------------------- the heads

class MedusaHeads(nn.Module):
    """K residual blocks on the final hidden state, sharing the base model's (frozen) LM head."""

    def __init__(self, d_model: int, n_heads: int = N_HEADS):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n_heads, d_model, d_model))     # (K, C, C), zero: start as the base head
        self.b = nn.Parameter(torch.zeros(n_heads, d_model))              # (K, C)

    @property
    def n_heads(self) -> int:
        return self.w.shape[0]

    def forward(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """h (..., C) final normed hidden states, lm_head E (V, C) -> logits (..., K, V)."""
        u = torch.einsum("...c,kdc->...kd", h, self.w) + self.b           # (..., K, C)   W_k h + b_k
        z = h[..., None, :] + F.silu(u)                                   # (..., K, C)   h + SiLU(.)
        return z @ lm_head.T                                              # (..., K, V)   @ E^T


def head_losses(heads: MedusaHeads, h: torch.Tensor, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each head on windows x (B, T) whose base hidden states are h (B, T, C):
    head k (1-based) at position t predicts x[t + 1 + k]. Returns (K,) mean losses."""
    logits = heads(h, lm_head)                                            # (B, T, K, V)
    out = []
    for k in range(heads.n_heads):
        shift = k + 2                                                     # head k (0-based) -> x[t + k + 2]
        lk = logits[:, : x.shape[1] - shift, k]                           # (B, T - shift, V)
        out.append(F.cross_entropy(lk.reshape(-1, lk.shape[-1]), x[:, shift:].reshape(-1)))
    return torch.stack(out)


@torch.no_grad()
def base_hidden(model: GPT, x: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """The frozen base model's final normed hidden states (B, T, C) of windows x (B, T)."""
    return torch.cat([model(x[i: i + chunk], return_hidden=True) for i in range(0, len(x), chunk)])


@torch.no_grad()
def rank_accuracy(model: GPT, heads: MedusaHeads, x: torch.Tensor, topk: int = TOPK) -> torch.Tensor:
    """(K + 1, topk) counts: row 0 the base head, row k head k; entry r = how often the truth is
    that head's r-th ranked guess (ties broken by index, as torch.topk). Divide by :func:`n_scored`."""
    h = base_hidden(model, x)                                             # (B, T, C)
    E = model.wte.weight
    base = (h @ E.T)[:, :, None]                                          # (B, T, 1, V)
    logits = torch.cat([base, heads(h, E)], 2)                            # (B, T, K + 1, V)
    counts = torch.zeros(heads.n_heads + 1, topk, dtype=torch.long)
    for k in range(heads.n_heads + 1):
        shift = k + 1
        top = logits[:, : x.shape[1] - shift, k].topk(topk, -1).indices   # (B, T - shift, topk)
        hit = top == x[:, shift:, None]
        counts[k] = hit.reshape(-1, topk).sum(0)
    return counts


def n_scored(x: torch.Tensor, n_heads: int = N_HEADS) -> torch.Tensor:
    """(K + 1,) how many positions each head is scored on in :func:`rank_accuracy`."""
    B, T = x.shape
    return torch.tensor([B * (T - k - 1) for k in range(n_heads + 1)])


def train_heads(model: GPT, steps: int, *, n_windows: int = 512, batch: int = 32, lr: float = 3e-3,
                seed: int = 0, n_heads: int = N_HEADS, progress: bool = True,
                heads_cls: type = MedusaHeads) -> tuple[MedusaHeads, list[list[float]]]:
    """Medusa-1: the base model is frozen, so its hidden states are computed once, for ``n_windows``
    random windows of the training text; then AdamW on the heads only, ``batch`` of those windows a
    step. ``heads_cls(d_model, n_heads)`` (built where MedusaHeads would be, after the seed) is for
    the EAGLE chapter's capacity comparison. Returns the heads and each step's per-head losses."""
    from tqdm import tqdm

    from kernels.model.data import encode, get_batch, load_text, train_val_split

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    train, _ = train_val_split(encode(load_text()))
    x_all, _ = get_batch(train, n_windows, model.config.block_size, generator=g)    # (N, T)
    h_all = base_hidden(model, x_all)                                               # (N, T, C)
    E = model.wte.weight.detach()
    heads = heads_cls(model.config.d_model, n_heads)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    log = []
    bar = tqdm(range(steps), desc="training medusa heads", unit="step", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, n_windows, (batch,), generator=g)
        losses = head_losses(heads, h_all[idx], x_all[idx], E)
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        opt.step()
        sched.step()
        log.append(losses.detach().tolist())
        bar.set_postfix(loss1=f"{log[-1][0]:.3f}")
    return heads, log


def eval_windows(n_windows: int = 24, block: int = 128) -> torch.Tensor:
    """Held-out text: the first ``n_windows`` windows of the validation split (the end of the last
    play, never trained on)."""
    from kernels.model.data import encode, fixed_windows, load_text, train_val_split

    _, val = train_val_split(encode(load_text()))
    return fixed_windows(val, n_windows, block)[0]


def load_heads(directory: Path | str = MODEL_DIR) -> MedusaHeads:
    """The committed heads (models/medusa/heads.pt)."""
    state = torch.load(Path(directory) / "heads.pt", map_location="cpu", weights_only=True)
    heads = MedusaHeads(state["w"].shape[1], state["w"].shape[0])
    heads.load_state_dict(state)
    return heads.eval()


def load_metrics(directory: Path | str = MODEL_DIR) -> dict:
    return json.loads((Path(directory) / "metrics.json").read_text())


# ---------------------------------------------------------------- the tree

@dataclass(frozen=True)
class Tree:
    """A candidate tree, flattened: node 0 is the root; parent[i] < i; depth[i] = len(paths[i]);
    rank[i] = the rank of node i's token in head depth[i]'s top-k (0 for the root)."""
    paths: tuple[tuple[int, ...], ...]

    @property
    def parent(self) -> torch.Tensor:
        index = {p: i for i, p in enumerate(self.paths)}
        return torch.tensor([-1] + [index[p[:-1]] for p in self.paths[1:]], dtype=torch.int32)

    @property
    def depth(self) -> torch.Tensor:
        return torch.tensor([len(p) for p in self.paths], dtype=torch.long)

    @property
    def rank(self) -> torch.Tensor:
        return torch.tensor([p[-1] if p else 0 for p in self.paths], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.paths)

    def children(self) -> list[list[int]]:
        kids = [[] for _ in self.paths]
        for i, p in enumerate(self.parent.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids


def build_tree(rank_acc: torch.Tensor, n_nodes: int = TREE_NODES) -> Tree:
    """Greedy sparse tree from per-head rank accuracies rank_acc (K, topk): add, n_nodes times, the
    frontier node with the largest prod_d rank_acc[d, r_d] (its estimated chance of being accepted,
    heads taken as independent). Its first child and its next sibling join the frontier. Nodes are
    then ordered by depth, then by that value, so that every parent comes before its children."""
    K, topk = rank_acc.shape
    acc = rank_acc.double().tolist()
    chosen: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(-acc[0][0], (0,))]
    while frontier and len(chosen) < n_nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append((-neg, path))
        d, r = len(path), path[-1]
        if r + 1 < topk:                                                  # next sibling
            heapq.heappush(frontier, (neg / acc[d - 1][r] * acc[d - 1][r + 1], path[:-1] + (r + 1,)))
        if d < K:                                                         # first child
            heapq.heappush(frontier, (neg * acc[d][0], path + (0,)))
    chosen.sort(key=lambda vp: (len(vp[1]), -vp[0], vp[1]))
    return Tree(((),) + tuple(p for _, p in chosen))


def tree_mask_ref(parent: torch.Tensor) -> torch.Tensor:
    """(T, T) bool: mask[i, j] = node j is node i or one of its ancestors (walk the parent array)."""
    T = parent.numel()
    par = parent.long().tolist()
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = par[j]
    return mask


def check_tree_attention_inputs(q, k, v, lens, parent, name: str = "tree_attention") -> None:
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name}: {arg} must be a 4-D float32/float16/bfloat16 tensor, got "
                             f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(f"{name}: k and v must be (B={B}, Hkv, S, D={D}) of one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if Hq % k.shape[1]:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={k.shape[1]}")
    if not isinstance(lens, torch.Tensor) or lens.shape != (B,) or lens.dtype != torch.int32:
        raise ValueError(f"{name}: lens must be a ({B},) int32 tensor, got {getattr(lens, 'shape', type(lens))} "
                         f"{getattr(lens, 'dtype', '')}")
    if not isinstance(parent, torch.Tensor) or parent.shape != (T,) or parent.dtype != torch.int32:
        raise ValueError(f"{name}: parent must be a ({T},) int32 tensor, got {getattr(parent, 'shape', type(parent))} "
                         f"{getattr(parent, 'dtype', '')}")
    for arg, t in (("k", k), ("v", v), ("lens", lens), ("parent", parent)):
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, q on {q.device}")
    if q.device.type == "meta":
        return
    par = parent.tolist()
    if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
        raise ValueError(f"{name}: parent must hold -1 at the root and 0 <= parent[i] < i elsewhere")
    if B and (int(lens.min()) < 0 or int(lens.max()) + T > k.shape[2]):
        raise ValueError(f"{name}: lens + T must fit the cache's {k.shape[2]} slots")
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            raise ValueError(f"{name}: {arg} must be contiguous along D")


def tree_depth(parent: torch.Tensor) -> int:
    """The deepest node's depth (the root has depth 0)."""
    depth = [0] * parent.numel()
    for i, p in enumerate(parent.tolist()):
        if p >= 0:
            depth[i] = depth[p] + 1
    return max(depth)


def tree_attention_ref(q, k, v, lens, parent) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v for the tree's queries q (B, Hq, T, D) over the cache k, v
    (B, Hkv, S, D), whose slots 0..L_b-1 hold the prefix and L_b..L_b+T-1 the tree nodes (L_b = lens[b]).
    Key j is visible to node i iff j < L_b (prefix) or j - L_b is i or an ancestor of i. (B, Hq, T, D)"""
    check_tree_attention_inputs(q, k, v, lens, parent, "tree_attention_ref")
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    anc = tree_mask_ref(parent.cpu()).to(q.device)                           # (T, T)
    out = torch.empty_like(q)
    for b in range(B):
        L = int(lens[b])
        kb = k[b, :, : L + T].repeat_interleave(group, 0).float()             # (Hq, L + T, D): only written slots
        vb = v[b, :, : L + T].repeat_interleave(group, 0).float()
        mask = torch.cat([torch.ones(T, L, dtype=torch.bool, device=q.device), anc], 1)   # (T, L + T)
        s = (q[b].float() @ kb.transpose(-1, -2)) / math.sqrt(D)              # (Hq, T, L + T)
        s = s.masked_fill(~mask, float("-inf"))
        out[b] = (torch.softmax(s, -1) @ vb).to(q.dtype)
    return out


# ---------------------------------------------------------------- tree attention, Triton

@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lens_ptr, parent_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_ot,
    T, sm_scale,
    HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_DEPTH: tl.constexpr, BROKEN: tl.constexpr,
):
    """One program per (block of BLOCK_M tree nodes, sequence b, query head h): online softmax over
    the L_b + T keys in tiles of BLOCK_N. The tree part of the mask is built here: key node j is
    visible to node i iff j is in the chain i, parent[i], parent[parent[i]], ... (MAX_DEPTH steps).
    BROKEN: the causal mask j <= i instead (siblings and cousins leak into each other)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)                   # b * stride_kb passes 2**31 at a large batch and cache
    h = pid_bh % HQ
    hk = h // GROUP
    L = tl.load(lens_ptr + b)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)      # (BLOCK_M,) tree nodes
    im = i < T
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + i[:, None] * stride_qt + d[None, :],
                mask=im[:, None] & dm[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    n_keys = L + T
    for start in range(0, n_keys, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)            # (BLOCK_N,) cache slots
        sm = s < n_keys
        kt = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(kt)) * sm_scale   # (BLOCK_M, BLOCK_N)
        j = s - L                                     # tree index of slot s
        if BROKEN:
            in_tree = j[None, :] <= i[:, None]
        else:
            in_tree = j[None, :] == i[:, None]
            a = tl.load(parent_ptr + i, mask=im, other=-1)
            for _ in tl.static_range(MAX_DEPTH):
                in_tree = in_tree | ((j[None, :] == a[:, None]) & (a[:, None] >= 0))
                a = tl.load(parent_ptr + tl.maximum(a, 0), mask=a >= 0, other=-1)
        visible = (s[None, :] < L) | ((j[None, :] >= 0) & sm[None, :] & in_tree)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # a row with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + i[:, None] * stride_ot + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=im[:, None] & dm[None, :])


GPU_BLOCKS = (64, 64)          # BLOCK_M, BLOCK_N on a GPU
CPU_BLOCKS = (64, 64)          # the interpreter: few large programs (its cost is per operation, not per element)


def _tree_attention_args(q, k, v, lens, parent, out, *, max_depth: int, blocks, broken: bool = False,
                         num_warps: int = 4):
    """(grid, args, kwargs) of one launch, shared by :func:`tree_attention` and :func:`launch_job`."""
    B, Hq, T, D = q.shape
    block_m, block_n = blocks
    args = (q, k, v, out, lens, parent, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), T, 1.0 / math.sqrt(D))
    kwargs = dict(HQ=Hq, GROUP=Hq // k.shape[1], D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
                  BLOCK_M=block_m, BLOCK_N=block_n, MAX_DEPTH=max(1, max_depth), BROKEN=broken, num_warps=num_warps)
    return (triton.cdiv(T, block_m), B * Hq), args, kwargs


def tree_attention(q, k, v, lens, parent, *, broken: bool = False, blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """The Triton tree attention: same arguments and result as :func:`tree_attention_ref`.
    ``broken=True`` is the deliberately wrong causal-mask variant."""
    check_tree_attention_inputs(q, k, v, lens, parent)
    if not isinstance(broken, bool):
        raise ValueError(f"tree_attention: broken must be a bool, got {broken!r}")
    B, Hq, T, D = q.shape
    if blocks is None:
        blocks = GPU_BLOCKS if q.is_cuda else CPU_BLOCKS
    if any(bl < 16 or bl & (bl - 1) for bl in blocks):
        raise ValueError(f"tree_attention: blocks must be powers of two >= 16, got {blocks}")
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return out
    grid, args, kwargs = _tree_attention_args(q, k, v, lens, parent, out, max_depth=tree_depth(parent),
                                              blocks=blocks, broken=broken)
    _tree_attention_kernel[grid](*args, **kwargs)
    return out


# ---------------------------------------------------------------- one forward over the tree

@torch.no_grad()
def tree_forward(model: GPT, tokens: torch.Tensor, tree: Tree, cache: KVCache, *, attention: str = "ref"):
    """Run the tree's tokens (T,) after the cached prefix (batch 1, L = cache.seqlens[0]) in ONE forward:
    node i at position L + depth[i], attending to the prefix and its ancestors. The nodes' keys go
    to cache slots L..L+T-1; cache.seqlens is left at L (the caller keeps the accepted path).
    attention: "ref" (PyTorch), "triton", "broken" (the Triton causal-mask variant).
    Returns (logits (T, V), hidden (T, C))."""
    if attention not in ("ref", "triton", "broken"):
        raise ValueError(f"tree_forward: attention must be 'ref', 'triton' or 'broken', got {attention!r}")
    cfg = model.config
    T = len(tree)
    if tokens.shape != (T,):
        raise ValueError(f"tree_forward: tokens must be ({T},), got {tuple(tokens.shape)}")
    L = int(cache.seqlens[0])
    if cache.seqlens.numel() != 1 or L + T > cache.max_len:
        raise ValueError(f"tree_forward: batch 1 and L + T <= {cache.max_len} slots needed")
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    positions = L + tree.depth                                            # (T,) position = prefix + depth
    parent = tree.parent
    lens = cache.seqlens.clone()
    x = model.wte(tokens[None])                                           # (1, T, C)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        u = block.norm1(x)
        q = rope(attn.wq(u).view(1, T, Hq, D).transpose(1, 2), positions, cfg.rope_theta)   # (1, Hq, T, D)
        k = rope(attn.wk(u).view(1, T, Hkv, D).transpose(1, 2), positions, cfg.rope_theta)  # (1, Hkv, T, D)
        v = attn.wv(u).view(1, T, Hkv, D).transpose(1, 2)
        cache.k[layer][:, :, L: L + T] = k
        cache.v[layer][:, :, L: L + T] = v
        if attention == "ref":
            o = tree_attention_ref(q, cache.k[layer], cache.v[layer], lens, parent)
        else:
            o = tree_attention(q, cache.k[layer], cache.v[layer], lens, parent, broken=attention == "broken")
        a = attn.wo(o.transpose(1, 2).reshape(1, T, Hq * D))
        hres, hn = add_rms_norm_torch(x, a, block.norm2.weight, cfg.norm_eps)
        x = hres + block.mlp(hn)
    hidden = model.norm_f(x)[0]                                           # (T, C)
    return hidden @ model.wte.weight.T, hidden


def keep_path(cache: KVCache, path: list[int]) -> None:
    """Move the keys and values of the accepted nodes ``path`` (tree indices, root first) to the
    slots right after the prefix, and extend the cache over them."""
    L = int(cache.seqlens[0])
    src = torch.tensor(path) + L
    for layer in range(len(cache.k)):
        cache.k[layer][:, :, L: L + len(path)] = cache.k[layer][:, :, src]
        cache.v[layer][:, :, L: L + len(path)] = cache.v[layer][:, :, src]
    cache.seqlens += len(path)


# ---------------------------------------------------------------- acceptance rules

def typical_threshold(p: torch.Tensor, eps: float, delta: float) -> torch.Tensor:
    """min(eps, delta * exp(-H(p))), H the entropy of p (..., V) in nats (Cai et al. 2024, typical acceptance)."""
    H = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return torch.clamp(delta * torch.exp(-H), max=eps)


def exact_children_output(p: torch.Tensor, candidates: list[int]) -> torch.Tensor:
    """Output distribution (V,) of one node under the exact rule: candidate c_1 is kept with
    probability p(c_1); if not, p loses c_1 and is renormalised, and c_2 is tried the same way; after
    the last, a token is drawn from what is left. Each stage is speculative sampling with a one-hot
    draft, whose residual is exactly 'p without c, renormalised', so the output is p."""
    p = p.double()
    out = torch.zeros_like(p)
    mass, rest = 1.0, p.clone()
    for c in candidates:
        pc = float(rest[c] / rest.sum())
        out[c] += mass * pc
        mass *= 1 - pc
        rest[c] = 0
    if float(rest.sum()) > 0:
        out += mass * rest / rest.sum()
    return out


def typical_children_output(p: torch.Tensor, candidates: list[int], eps: float, delta: float) -> torch.Tensor:
    """Output distribution (V,) of one node under typical acceptance, one tree level: of the candidates
    with p(c) > min(eps, delta exp(-H(p))), the most likely is emitted with certainty (all accepted
    paths have length 1, so the authors' tie-break, the largest summed log-likelihood, picks it); if
    none passes, a token is drawn from p. In a whole tree a passing candidate with a longer accepted
    path below it wins instead (:func:`typical_best_node`)."""
    p = p.double()
    thr = float(typical_threshold(p, eps, delta))
    passing = [c for c in candidates if float(p[c]) > thr]
    if not passing:
        return p.clone()
    return F.one_hot(torch.tensor(max(passing, key=lambda c: float(p[c]))), p.numel()).double()


def typical_best_node(p_all: torch.Tensor, tokens: torch.Tensor, tree: Tree, eps: float, delta: float) -> int:
    """The node typical acceptance stops at: p_all (T, V) the model's distribution after each node,
    tokens (T,) the tree's tokens. A node passes when p_parent(token) > min(eps, delta e^-H(p_parent));
    of the nodes whose whole path passes, the deepest is kept, ties broken by the largest summed
    log p along the path (FasterDecoding/Medusa ``evaluate_posterior``, fast typical). 0 if none."""
    thr = typical_threshold(p_all, eps, delta)                            # (T,)
    parent = tree.parent.tolist()
    good, score, best = [True], [(0, 0.0)], 0                             # score = (depth, sum log p)
    for i in range(1, len(tree)):                                         # parent[i] < i
        j, pi = parent[i], float(p_all[parent[i], tokens[i]])
        good.append(good[j] and pi > float(thr[j]))
        score.append((score[j][0] + 1, score[j][1] + math.log(max(pi, 1e-300))))
        if good[i] and score[i] > score[best]:
            best = i
    return best


def tv_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().sum() / 2)


# ---------------------------------------------------------------- decoding

@torch.no_grad()
def medusa_generate(model: GPT, heads: MedusaHeads, prompt: list[int], max_new_tokens: int, tree: Tree, *,
                    rule: str = "greedy", temperature: float = 0.0, eps: float = 0.09, delta: float = 0.3,
                    generator: torch.Generator | None = None, attention: str = "ref"):
    """Medusa decoding at batch 1: (tokens, base-model forwards, tokens accepted from the tree per forward).

    Each step: the heads read the hidden state of the last accepted node, their top-k fill the tree,
    one :func:`tree_forward` scores it, and the longest path the rule accepts is kept, plus one token
    of the base model after it (the next root). The forwards count the prefill, as plain decoding's do.
    rule: "greedy" (candidate kept iff it is the argmax: equals plain greedy decoding), "exact" or
    "typical" (temperature > 0; see the module docstring)."""
    if rule not in ("greedy", "exact", "typical"):
        raise ValueError(f"medusa_generate: rule must be 'greedy', 'exact' or 'typical', got {rule!r}")
    if (rule == "greedy") != (temperature == 0.0):
        raise ValueError(f"medusa_generate: rule 'greedy' goes with temperature 0 and only it, got {rule!r}, {temperature}")
    K = heads.n_heads
    if int(tree.depth.max()) > K:
        raise ValueError(f"medusa_generate: the tree is deeper than the {K} heads")
    if max_new_tokens < 1 or len(prompt) + max_new_tokens + K > model.config.block_size:
        raise ValueError(f"medusa_generate: {len(prompt)} + {max_new_tokens} + K={K} tokens exceed "
                         f"block_size={model.config.block_size}")
    E = model.wte.weight
    T = len(tree)
    kids = tree.children()
    depth, rank = tree.depth, tree.rank
    topk = int(rank.max()) + 1
    cache = KVCache.empty(model.config, 1, max_len=model.config.block_size + T)

    def dist(logits):                                                     # (.., V) -> probabilities, float64
        return torch.softmax(logits.double() / temperature, -1)

    def draw(p):
        return int(torch.multinomial(p, 1, generator=generator))

    h = model(torch.tensor([prompt]), cache=cache, return_hidden=True)[0, -1]    # (C,) prefill
    root = int((h @ E.T).argmax()) if rule == "greedy" else draw(dist(h @ E.T))
    out, forwards, accepted = list(prompt) + [root], 1, []
    while len(out) - len(prompt) < max_new_tokens:
        top = heads(h, E).topk(topk, -1).indices                          # (K, topk) candidates
        tokens = torch.tensor([root] + [int(top[depth[i] - 1, rank[i]]) for i in range(1, T)])
        logits, hidden = tree_forward(model, tokens, tree, cache, attention=attention)
        forwards += 1
        path, cur = [0], 0
        if rule == "greedy":
            while True:
                want = int(logits[cur].argmax())
                nxt = [c for c in kids[cur] if int(tokens[c]) == want]
                if not nxt:
                    break
                cur = nxt[0]
                path.append(cur)
            bonus = int(logits[cur].argmax())
        elif rule == "exact":
            while True:
                rest = dist(logits[cur])
                moved = False
                for c in kids[cur]:                                       # one-hot drafts, tried in order
                    t = int(tokens[c])
                    u = float(torch.rand((), generator=generator, dtype=torch.float64))
                    if u * float(rest.sum()) < float(rest[t]):
                        cur, moved = c, True
                        path.append(c)
                        break
                    rest[t] = 0.0                                         # the residual: p without t
                if not moved:
                    bonus = draw(rest / rest.sum())
                    break
        else:                                                             # typical acceptance
            p_all = dist(logits)                                          # (T, V)
            best = typical_best_node(p_all, tokens, tree, eps, delta)
            while best > 0:
                path.insert(1, best)
                best = int(tree.parent[best])
            cur = path[-1]
            bonus = draw(p_all[cur])
        keep_path(cache, path)
        out += [int(tokens[i]) for i in path[1:]] + [bonus]
        accepted.append(len(path) - 1)
        h, root = hidden[cur], bonus
    return out[: len(prompt) + max_new_tokens], forwards, accepted


@torch.no_grad()
def plain_generate(model: GPT, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[int]:
    """Plain decoding with the KV cache: one forward per token (the baseline)."""
    return model.generate(torch.tensor([prompt]), max_new_tokens, temperature=temperature,
                          generator=generator)[0].tolist()


# ---------------------------------------------------------------- compile facts

LLAMA3_8B = dict(Hq=32, Hkv=8, D=128)      # Llama 3 8B: 32 query heads, 8 KV heads, head dim 128
VICUNA_7B = dict(Hq=32, Hkv=32, D=128)     # Vicuna 7B (Llama 2 7B): 32 heads, no GQA, head dim 128


def launch_job(Hq: int, Hkv: int, D: int, *, nodes: int = 64, prefix: int = 4096, batch: int = 1,
               max_depth: int = 4, target: str = "sm90"):
    """The GPU launch of :func:`tree_attention` on meta tensors (bf16), a cache of prefix + nodes slots."""
    from kernels import inspect as ki

    q = torch.empty(batch, Hq, nodes, D, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, Hkv, prefix + nodes, D, dtype=torch.bfloat16, device="meta")
    v = torch.empty_like(k)
    out = torch.empty_like(q)
    lens = torch.empty(batch, dtype=torch.int32, device="meta")
    parent = torch.empty(nodes, dtype=torch.int32, device="meta")
    grid, args, kwargs = _tree_attention_args(q, k, v, lens, parent, out, max_depth=max_depth, blocks=GPU_BLOCKS)
    return ki.launch_job(_tree_attention_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """64 tree nodes of depth up to 4 after a 4096-token prefix, head dim 128, bf16."""
    return {"Llama 3 8B (GQA 32/8), 64 nodes, prefix 4096": launch_job(**LLAMA3_8B),
            "Vicuna 7B (32 heads), 64 nodes, prefix 4096": launch_job(**VICUNA_7B)}


# ---------------------------------------------------------------- the committed run

def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Medusa-1: train K heads on the frozen tiny GPT")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--windows", type=int, default=512)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kernels.model.gpt import load_pretrained

    model = load_pretrained()
    t0 = time.perf_counter()
    heads, log = train_heads(model, args.steps, n_windows=args.windows, batch=args.batch, seed=args.seed)
    seconds = time.perf_counter() - t0
    heads.eval()
    x = eval_windows()
    counts = rank_accuracy(model, heads, x)
    n = n_scored(x)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in heads.state_dict().items()}, args.out / "heads.pt")
    metrics = {
        "command": (f"python -m kernels.speculative.medusa --steps {args.steps} --seed {args.seed} "
                    f"--batch {args.batch} --windows {args.windows}"),
        "steps": args.steps, "seed": args.seed, "batch": args.batch, "n_windows": args.windows, "train_seconds": round(seconds, 1),
        "n_heads": heads.n_heads, "topk": TOPK, "eval_windows": int(x.shape[0]),
        "rank_counts": counts.tolist(), "n_scored": n.tolist(),
        "final_loss": [round(sum(r[k] for r in log[-50:]) / 50, 4) for k in range(heads.n_heads)],
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with open(args.out / "train_log.csv", "w") as f:
        f.write("step," + ",".join(f"loss_head{k + 1}" for k in range(heads.n_heads)) + "\n")
        for s, row in enumerate(log):
            if s % 10 == 0 or s == len(log) - 1:
                f.write(f"{s}," + ",".join(f"{v:.4f}" for v in row) + "\n")
    print(json.dumps({k: metrics[k] for k in ("train_seconds", "final_loss")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
