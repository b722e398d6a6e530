"""EAGLE: drafting in feature space (Li et al. 2024), dynamic draft trees (EAGLE-2), training-time
test (EAGLE-3), on the tiny GPT.

* :class:`EagleDraft`: ONE decoder layer (RMSNorm, multi-head attention with RoPE, SwiGLU) whose
  input at position t fuses the target's final feature f_t with the embedding of the token one step
  AHEAD, x_{t+1}:

      u_t = W_fc [f_t ; E x_{t+1}] + b_fc                      (2C -> C)
      g_t = Layer(u_<=t)_t  ~  f_{t+1}                         (the next feature)
      logits = g_t E^T                                         (the target's frozen, tied LM head)

  Drafting is autoregressive in feature space: the drafted token y and the draft's own feature g_t
  make the next input u = W_fc [g_t ; E y]. Here f is the tiny GPT's final NORMED hidden state
  (``return_hidden=True``), so the LM head is E alone; the paper uses the second-to-top-layer
  feature and the target's own norm + LM head.
* Training (``python -m kernels.speculative.eagle``): feature regression (smooth L1) plus token
  cross-entropy, L = L_reg + w_cls L_cls with w_cls = 0.1 as in the authors' training script, on the frozen target's
  features over its training text. ``ttt_steps > 1`` switches on EAGLE-3's *training-time test*:
  step j > 0 feeds the draft its OWN predicted features of step j - 1 (not the target's), the query
  of step j at position t attending to the step-0 keys at positions <= t and to its own chain's keys
  of steps 1..j (what it sees at decoding time). EAGLE-3's multi-layer feature fusion is not done.
* :func:`tree_expand_ref` (PyTorch) and :func:`tree_expand` (Triton): EAGLE-2's expansion step.
  For M frontier nodes with cumulative draft log-probabilities c_i and draft log-probs l_i (V,):
  each node's top-k children get the score c_i + l_i[y]; the global top-m of those M*k candidates
  are kept (parent row, token, score). ``broken=True`` scores a child by its own l_i[y] alone.
* :func:`eagle_generate`: greedy decoding with a chain, a static tree or EAGLE-2's dynamic tree
  (expand the top-k by cumulative log-prob for ``depth`` levels, rerank all drafted nodes, keep the
  top n), verified in ONE forward by Medusa's tree attention (:func:`kernels.speculative.medusa.tree_forward`).
  Equal to plain greedy decoding token for token.

Shapes: B batch, T tokens, C d_model, V vocabulary, M frontier nodes, k children per node, m kept.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.model.gpt import GPT, MLP, GPTConfig, KVCache, RMSNorm, rope
from kernels.speculative.medusa import Tree, keep_path, tree_forward, tree_mask_ref

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "eagle"
W_CLS = 0.1                 # EAGLE-1: L = L_reg + 0.1 L_cls
TTT_STEPS = 3               # training-time test: steps of the draft on its own features


# ---------------------------------------------------------------- the draft

class EagleDraft(nn.Module):
    """One decoder layer on fused (feature, next-token embedding) inputs; predicts the next feature."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C = config.d_model
        self.fc = nn.Linear(2 * C, C)                              # [f_t ; E x_{t+1}] -> u_t
        self.norm1 = RMSNorm(C, config.norm_eps)
        self.wq = nn.Linear(C, C, bias=False)
        self.wk = nn.Linear(C, C, bias=False)
        self.wv = nn.Linear(C, C, bias=False)
        self.wo = nn.Linear(C, C, bias=False)
        self.norm2 = RMSNorm(C, config.norm_eps)
        self.mlp = MLP(config)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        nn.init.zeros_(self.fc.bias)
        with torch.no_grad():                                     # start near "g = f": the identity on the feature half
            self.fc.weight[:, :C] += torch.eye(C)

    def fuse(self, f: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """u = W_fc [f ; e] + b  (..., C)."""
        return self.fc(torch.cat([f, e], -1))

    def qkv(self, u: torch.Tensor, positions: torch.Tensor):
        """u (B, T, C) -> q, k, v (B, H, T, D), RoPE at ``positions`` (T,) or (B, T)."""
        B, T, C = u.shape
        H = self.config.n_head
        x = self.norm1(u)
        q, k, v = (w(x).view(B, T, H, C // H).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        th = self.config.rope_theta
        return rope(q, positions, th), rope(k, positions, th), v

    def finish(self, u: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and MLP: g = h + MLP(norm2(h)), h = u + W_o o.  (B, T, C)"""
        B, H, T, D = o.shape
        h = u + self.wo(o.transpose(1, 2).reshape(B, T, H * D))
        return h + self.mlp(self.norm2(h))

    def forward(self, u: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """g (B, T, C) from fused inputs u (B, T, C); mask (T, T) bool, True = key visible."""
        q, k, v = self.qkv(u, positions)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])    # (B, H, T, T)
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
        return self.finish(u, o)


def ttt_features(draft: EagleDraft, f: torch.Tensor, x: torch.Tensor, E: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
    """The draft unrolled ``steps`` times over windows x (B, T) with target features f (B, T, C).
    Step 0 at position t reads u_t = fc[f_t ; E x_{t+1}] (the target's feature) with causal attention;
    step j > 0 at position t + j reads fc[g^{(j-1)}_t ; E x_{t+1+j}], the draft's OWN feature of the
    step before (training-time test), its query attending to the step-0 keys at positions <= t and
    to its own chain's keys of steps 1..j: what the draft sees when it drafts its (j+1)-th token
    after the target's f_t. Returns [g^{(0)} (B, T-1, C), g^{(1)} (B, T-2, C), ...], g^{(j)}_t ~ f_{t+1+j}."""
    B, T, C = f.shape
    pos = torch.arange(T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    u = draft.fuse(f[:, : T - 1], E[x[:, 1:]])                    # (B, T-1, C)  u_t = fc[f_t ; E x_{t+1}]
    q, k0, v0 = draft.qkv(u, pos[: T - 1])
    D = q.shape[-1]
    keys, vals, out = [k0], [v0], []
    for j in range(steps):
        n = T - 1 - j                                             # positions t = 0..n-1 still have inputs
        if j == 0:
            s = (q @ k0.transpose(-1, -2)) / math.sqrt(D)
            o = torch.softmax(s.masked_fill(~causal[:n, :n], float("-inf")), -1) @ v0
            uj = u
        else:
            uj = draft.fuse(out[-1][:, :n], E[x[:, 1 + j: 1 + j + n]])   # fc[g_t ; E x_{t+1+j}] at position t + j
            q, kj, vj = draft.qkv(uj, pos[j: j + n])
            keys.append(kj)
            vals.append(vj)
            s0 = ((q @ keys[0][:, :, :n].transpose(-1, -2)) / math.sqrt(D)).masked_fill(~causal[:n, :n], float("-inf"))
            sd = [(q * kk[:, :, :n]).sum(-1, keepdim=True) / math.sqrt(D) for kk in keys[1:]]   # own chain: diagonal
            p = torch.softmax(torch.cat([s0] + sd, -1), -1)       # (B, H, n, n + j)
            o = p[..., :n] @ vals[0][:, :, :n]
            for i, vv in enumerate(vals[1:]):
                o = o + p[..., n + i: n + i + 1] * vv[:, :, :n]
        out.append(draft.finish(uj, o))                           # (B, n, C)
    return out


def draft_losses(draft: EagleDraft, f: torch.Tensor, x: torch.Tensor, E: torch.Tensor,
                 ttt_steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step j: L_reg = smoothL1(g^{(j)}_t, f_{t+1+j}), L_cls = CE(g^{(j)}_t E^T, x_{t+2+j}).
    Returns (L_reg (J,), L_cls (J,))."""
    reg, cls = [], []
    for j, g in enumerate(ttt_features(draft, f, x, E, ttt_steps)):
        m = g.shape[1] - 1                                        # the token target x_{t+2+j} exists for t < m
        reg.append(F.smooth_l1_loss(g[:, :m], f[:, 1 + j: 1 + j + m]))
        logits = g[:, :m] @ E.T                                   # (B, m, V)
        cls.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2 + j: 2 + j + m].reshape(-1)))
    return torch.stack(reg), torch.stack(cls)


@torch.no_grad()
def chain_accuracy(draft: EagleDraft, f: torch.Tensor, x: torch.Tensor, E: torch.Tensor, depth: int = 4):
    """(hits, totals), lists of length depth: how often step j's top-1 is x_{t+2+j} given that steps
    0..j-1 were all right (the chance a greedy chain's (j+1)-th drafted token is accepted once the
    ones before it were). Scored on the positions t < T - 1 - depth that every step reaches."""
    B, T, _ = f.shape
    L = T - 1 - depth
    alive, saved = None, []
    for j, g in enumerate(ttt_features(draft, f, x, E, depth)):
        right = (g[:, :L] @ E.T).argmax(-1) == x[:, 2 + j: 2 + j + L]    # (B, L)
        alive = right if alive is None else alive & right
        saved.append(alive)
    return [int(a.sum()) for a in saved], [B * L] + [int(a.sum()) for a in saved[:-1]]


@torch.no_grad()
def rank_accuracy(draft: EagleDraft, f: torch.Tensor, x: torch.Tensor, E: torch.Tensor, depth: int = 4,
                  topk: int = 10) -> torch.Tensor:
    """(depth, topk): entry [j, r] = the chance that the truth x_{t+2+j} is step j's r-th guess,
    among the positions where steps 0..j-1 guessed right (top-1): the acceptance estimate a static
    tree is built from (:func:`kernels.speculative.medusa.build_tree`)."""
    B, T, _ = f.shape
    L = T - 1 - depth
    alive = torch.ones(B, L, dtype=torch.bool)
    acc = torch.zeros(depth, topk, dtype=torch.float64)
    for j, g in enumerate(ttt_features(draft, f, x, E, depth)):
        top = (g[:, :L] @ E.T).topk(topk, -1).indices                     # (B, L, topk)
        hit = top == x[:, 2 + j: 2 + j + L, None]
        acc[j] = hit[alive].double().sum(0) / max(1, int(alive.sum()))
        alive = alive & hit[..., 0]
    return acc


def target_features(model: GPT, x: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """The frozen target's final normed hidden states (B, T, C) of windows x (B, T)."""
    from kernels.speculative.medusa import base_hidden
    return base_hidden(model, x, chunk)


def train_draft(model: GPT, steps: int, *, ttt_steps: int = 1, n_windows: int = 512, batch: int = 16,
                lr: float = 3e-3, seed: int = 0, progress: bool = True, draft_cls: type = EagleDraft):
    """AdamW on the draft only; the target's features are computed once for ``n_windows`` random
    windows of the training text. ``draft_cls`` (an EagleDraft subclass, built where EagleDraft would
    be, so from the same seeded initialisation) is for ablations. Returns (draft, per-step
    [L_reg, L_cls] of step 0)."""
    from tqdm import tqdm

    from kernels.model.data import encode, get_batch, load_text, train_val_split

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    train, _ = train_val_split(encode(load_text()))
    x_all, _ = get_batch(train, n_windows, model.config.block_size, generator=g)   # (N, T)
    f_all = target_features(model, x_all)                                          # (N, T, C)
    E = model.wte.weight.detach()
    draft = draft_cls(model.config)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    log = []
    bar = tqdm(range(steps), desc=f"training eagle draft (ttt {ttt_steps})", unit="step", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, n_windows, (batch,), generator=g)
        reg, cls = draft_losses(draft, f_all[idx], x_all[idx], E, ttt_steps)
        loss = (reg + W_CLS * cls).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log.append([float(reg[0].detach()), float(cls[0].detach())])
        bar.set_postfix(cls0=f"{log[-1][1]:.3f}")
    return draft.eval(), log


def load_draft(name: str = "draft", directory: Path | str = MODEL_DIR) -> EagleDraft:
    state = torch.load(Path(directory) / f"{name}.pt", map_location="cpu", weights_only=True)
    cfg = GPTConfig.from_json((ROOT / "models" / "tiny-gpt" / "config.json").read_text())
    draft = EagleDraft(cfg)
    draft.load_state_dict(state)
    return draft.eval()


def load_metrics(directory: Path | str = MODEL_DIR) -> dict:
    return json.loads((Path(directory) / "metrics.json").read_text())


# ---------------------------------------------------------------- EAGLE-2's expansion step, PyTorch

def tree_expand_ref(logp: torch.Tensor, cum: torch.Tensor, k: int, m: int):
    """logp (M, V) the draft's log-probs at M frontier nodes, cum (M,) their cumulative log-probs.
    Children: each row's top-k tokens y, scored cum_i + logp[i, y] (the log-prob of the whole path);
    the top-m of the M*k children are returned as (parent row (m,), token (m,), score (m,)), best
    first. Ties go to the lower index (row-major over (row, rank))."""
    check_expand_inputs(logp, cum, k, m, "tree_expand_ref")
    M, V = logp.shape
    # a stable top-k: sort by (-value, index)
    order = torch.stack([torch.tensor(sorted(range(V), key=lambda j: (-float(row[j]), j))[:k]) for row in logp.cpu()])
    vals = torch.gather(logp.cpu(), 1, order)                                     # (M, k)
    score = cum.cpu()[:, None] + vals                                             # (M, k)  c_i + l_i[y]
    flat = score.reshape(-1)
    pick = torch.tensor(sorted(range(M * k), key=lambda j: (-float(flat[j]), j))[:m], dtype=torch.long)
    return (pick // k).to(torch.int32), order.reshape(-1)[pick].to(torch.int32), flat[pick]


def check_expand_inputs(logp, cum, k, m, name: str = "tree_expand") -> None:
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2 or logp.dtype != torch.float32:
        raise ValueError(f"{name}: logp must be a 2-D float32 tensor (M, V), got "
                         f"{getattr(logp, 'shape', type(logp))} {getattr(logp, 'dtype', '')}")
    M, V = logp.shape
    if not isinstance(cum, torch.Tensor) or cum.shape != (M,) or cum.dtype != torch.float32:
        raise ValueError(f"{name}: cum must be a ({M},) float32 tensor, got {getattr(cum, 'shape', type(cum))} "
                         f"{getattr(cum, 'dtype', '')}")
    if cum.device != logp.device:
        raise ValueError(f"{name}: cum is on {cum.device}, logp on {logp.device}")
    if not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"{name}: k must be an int in [1, V={V}], got {k!r}")
    if not isinstance(m, int) or not 1 <= m <= M * k:
        raise ValueError(f"{name}: m must be an int in [1, M*k={M * k}], got {m!r}")
    if logp.stride(1) != 1:
        raise ValueError(f"{name}: logp must be contiguous along V")


# ---------------------------------------------------------------- EAGLE-2's expansion step, Triton

@triton.jit
def _row_topk_kernel(logp_ptr, cum_ptr, tok_ptr, score_ptr, V, stride_m,
                     K: tl.constexpr, BLOCK_V: tl.constexpr, BROKEN: tl.constexpr):
    """One program per frontier node i: K passes over its V log-probs in tiles of BLOCK_V, pass r
    finding the largest (value, -index) strictly after pass r-1's. Writes token and score
    cum_i + l_i[y] of each child (BROKEN: l_i[y] alone, the parent's log-prob forgotten)."""
    row = tl.program_id(0).to(tl.int64)                       # row * stride_m passes 2**31 at 16k rows of 128256
    base = logp_ptr + row * stride_m
    c = tl.load(cum_ptr + row)
    prev_v = float("inf")
    prev_i = -1
    for r in tl.static_range(K):
        best_v = float("-inf")
        best_i = V
        for start in range(0, V, BLOCK_V):
            j = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + j, mask=j < V, other=float("-inf"))
            after = (x < prev_v) | ((x == prev_v) & (j > prev_i))      # strictly below the last pick
            x = tl.where(after & (j < V), x, float("-inf"))
            bv = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bv, j, V), axis=0)
            better = (bv > best_v) | ((bv == best_v) & (bi < best_i))
            best_v = tl.where(better, bv, best_v)
            best_i = tl.where(better, bi, best_i)
        if BROKEN:
            s = best_v
        else:
            s = c + best_v
        tl.store(tok_ptr + row * K + r, best_i)
        tl.store(score_ptr + row * K + r, s)
        prev_v = best_v
        prev_i = best_i


@triton.jit
def _global_topm_kernel(score_ptr, tok_ptr, out_row_ptr, out_tok_ptr, out_score_ptr, N, m,
                        K: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: the m best of the N = M*K children (score descending, index ascending)."""
    j = tl.arange(0, BLOCK_N)
    s = tl.load(score_ptr + j, mask=j < N, other=float("-inf"))
    prev_v = float("inf")
    prev_i = -1
    for r in range(m):
        after = ((s < prev_v) | ((s == prev_v) & (j > prev_i))) & (j < N)
        x = tl.where(after, s, float("-inf"))
        bv = tl.max(x, axis=0)
        bi = tl.min(tl.where((x == bv) & after, j, N), axis=0)
        tl.store(out_row_ptr + r, (bi // K).to(tl.int32))
        tl.store(out_tok_ptr + r, tl.load(tok_ptr + bi))
        tl.store(out_score_ptr + r, bv)
        prev_v = bv
        prev_i = bi


GPU_BLOCK_V = 1024
CPU_BLOCK_V = 256


def _expand_args(logp, cum, tok, score, k: int, block_v: int, broken: bool = False, num_warps: int = 4):
    M, V = logp.shape
    return (M,), (logp, cum, tok, score, V, logp.stride(0)), dict(K=k, BLOCK_V=block_v, BROKEN=broken,
                                                                    num_warps=num_warps)


def tree_expand(logp: torch.Tensor, cum: torch.Tensor, k: int, m: int, *, broken: bool = False,
                block_v: int | None = None):
    """The Triton expansion step: same arguments and result as :func:`tree_expand_ref`."""
    check_expand_inputs(logp, cum, k, m)
    if not isinstance(broken, bool):
        raise ValueError(f"tree_expand: broken must be a bool, got {broken!r}")
    if block_v is None:
        block_v = GPU_BLOCK_V if logp.is_cuda else CPU_BLOCK_V
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"tree_expand: block_v must be a power of two >= 16, got {block_v}")
    M, V = logp.shape
    tok = torch.empty(M * k, dtype=torch.int32, device=logp.device)
    score = torch.empty(M * k, dtype=torch.float32, device=logp.device)
    grid, args, kwargs = _expand_args(logp, cum, tok, score, k, block_v, broken)
    _row_topk_kernel[grid](*args, **kwargs)
    rows = torch.empty(m, dtype=torch.int32, device=logp.device)
    toks = torch.empty(m, dtype=torch.int32, device=logp.device)
    scores = torch.empty(m, dtype=torch.float32, device=logp.device)
    _global_topm_kernel[(1,)](score, tok, rows, toks, scores, M * k, m, K=k,
                              BLOCK_N=max(16, triton.next_power_of_2(M * k)))
    return rows, toks, scores


# ---------------------------------------------------------------- drafting a tree

@torch.no_grad()
def draft_run(draft: EagleDraft, E: torch.Tensor, feats: torch.Tensor, toks: torch.Tensor,
              node_in: torch.Tensor, node_tok: torch.Tensor, node_parent: list[int], node_depth: list[int]):
    """The draft over the prefix and a tree of drafted nodes at once.
    feats (n, C) the target's features f_0..f_{n-1}; toks (n + 1,) x_0..x_n; prefix input t is
    fc[f_t ; E x_{t+1}] at position t. Node i: input fc[node_in_i ; E node_tok_i] at position
    n - 1 + depth_i, seeing the whole prefix and its own ancestors (parent -1: the prefix's end).
    Returns (g of the last prefix position (C,), g of the nodes (N, C))."""
    n = feats.shape[0]
    N = len(node_parent)
    u = draft.fuse(feats, E[toks[1:]])                                          # (n, C)
    if N:
        u = torch.cat([u, draft.fuse(node_in, E[node_tok])])                    # (n + N, C)
    pos = torch.cat([torch.arange(n), n - 1 + torch.tensor(node_depth, dtype=torch.long)]) if N else torch.arange(n)
    mask = torch.zeros(n + N, n + N, dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    if N:
        mask[n:, :n] = True
        anc = tree_mask_ref(torch.tensor([-1] + [p + 1 for p in node_parent], dtype=torch.int32))
        mask[n:, n:] = anc[1:, 1:]
    g = draft(u[None], pos, mask)[0]
    return g[n - 1], g[n:]


def static_tree(depth: int, width: list[int] | None = None) -> Tree:
    """A fixed tree of ranks: a chain of ``depth`` top-1 guesses when width is None, else the full tree
    in which every node of depth d has width[d] children (ranks 0..width[d]-1)."""
    if width is None:
        return Tree(((),) + tuple((0,) * d for d in range(1, depth + 1)))
    paths = [()]
    level = [()]
    for d in range(depth):
        level = [p + (r,) for p in level for r in range(width[d])]
        paths += level
    return Tree(tuple(paths))


@torch.no_grad()
def draft_tree(draft: EagleDraft, E: torch.Tensor, feats: torch.Tensor, toks: torch.Tensor, *,
               tree: Tree | None = None, depth: int = 4, topk: int = 4, n_nodes: int = 16,
               expand: str = "ref"):
    """Draft the candidate tree after x_n = toks[-1] (the root). With ``tree`` (static): node path
    (r_1..r_d) is the r_d-th most likely token of the draft at its parent. Without (EAGLE-2, dynamic):
    ``depth`` rounds of :func:`tree_expand` (k = m = topk) from the nodes kept in the previous round,
    then the ``n_nodes`` drafted nodes of highest cumulative log-prob (ancestors before children).
    Returns (tokens (T,), Tree, draft prob of each node's token given its parent (T,))."""
    parent, depth_of, tok, g_in, cum, own, path = [], [], [], [], [], [], []
    g_root, _ = draft_run(draft, E, feats, toks, feats[:0], toks[:0], [], [])
    outs = {-1: g_root}
    if tree is not None:
        kids = tree.children()
        frontier = [(-1, 0)]                                       # (node id, tree index)
        tree_id = {0: -1}
        for d in range(1, int(tree.depth.max()) + 1):
            new = []
            for nid, ti in frontier:
                lp = torch.log_softmax(outs[nid] @ E.T, -1)
                top = lp.topk(max(1, max((tree.paths[c][-1] for c in kids[ti]), default=0) + 1))
                for c in kids[ti]:
                    r = tree.paths[c][-1]
                    parent.append(nid); depth_of.append(d); tok.append(int(top.indices[r]))
                    g_in.append(outs[nid]); own.append(float(top.values[r]))
                    cum.append((cum[nid] if nid >= 0 else 0.0) + float(top.values[r]))
                    path.append(tree.paths[c])
                    tree_id[c] = len(tok) - 1
                    new.append((len(tok) - 1, c))
            _, g = draft_run(draft, E, feats, toks, torch.stack(g_in), torch.tensor(tok), parent, depth_of)
            for nid, _ in new:
                outs[nid] = g[nid]
            frontier = new
        keep = [tree_id[i] for i in range(1, len(tree))]
    else:
        frontier = [-1]
        for d in range(1, depth + 1):
            lp = torch.log_softmax(torch.stack([outs[i] for i in frontier]) @ E.T, -1).float().contiguous()
            c = torch.tensor([cum[i] if i >= 0 else 0.0 for i in frontier], dtype=torch.float32)
            k = min(topk, lp.shape[1])
            if expand == "ref":
                rows, ys, sc = tree_expand_ref(lp, c, k, min(topk, len(frontier) * k))
            else:
                rows, ys, sc = tree_expand(lp, c, k, min(topk, len(frontier) * k), broken=expand == "broken")
            new = []
            for r, y, s in zip(rows.tolist(), ys.tolist(), sc.tolist()):
                nid = frontier[r]
                parent.append(nid); depth_of.append(d); tok.append(y); g_in.append(outs[nid])
                own.append(float(lp[r, y])); cum.append(s)
                path.append((path[nid] if nid >= 0 else ()) + (sum(1 for q in parent[:-1] if q == nid),))
                new.append(len(tok) - 1)
            _, g = draft_run(draft, E, feats, toks, torch.stack(g_in), torch.tensor(tok), parent, depth_of)
            for nid in new:
                outs[nid] = g[nid]
            frontier = new
        order = sorted(range(len(tok)), key=lambda i: (-cum[i], depth_of[i], i))
        chosen = set()
        for i in order:                                            # top n_nodes, closed under ancestors
            if len(chosen) >= n_nodes:
                break
            j, need = i, []
            while j >= 0 and j not in chosen:
                need.append(j)
                j = parent[j]
            if len(chosen) + len(need) <= n_nodes:
                chosen.update(need)
        keep = sorted(chosen, key=lambda i: (depth_of[i], -cum[i], i))
    paths = ((),) + tuple(path[i] for i in keep)
    tokens = torch.tensor([int(toks[-1])] + [tok[i] for i in keep])
    conf = torch.tensor([1.0] + [math.exp(own[i]) for i in keep])
    return tokens, Tree(paths), conf


# ---------------------------------------------------------------- decoding

@torch.no_grad()
def eagle_generate(model: GPT, draft: EagleDraft, prompt: list[int], max_new_tokens: int, *,
                   mode: str = "chain", depth: int = 4, topk: int = 4, n_nodes: int = 16,
                   tree: Tree | None = None, attention: str = "ref", expand: str = "ref", trace: list | None = None):
    """Greedy EAGLE decoding at batch 1: (tokens, target forwards, accepted per forward).
    mode: "chain" (``depth`` tokens, each the draft's top-1), "static" (the fixed ``tree``),
    "dynamic" (EAGLE-2). Every step: draft, one :func:`tree_forward` of the target, keep the longest
    path whose every token is the target's argmax after its parent, plus the target's next token.
    ``trace`` (a list) receives (draft prob, accepted) for each node whose parent was accepted."""
    if mode not in ("chain", "static", "dynamic"):
        raise ValueError(f"eagle_generate: mode must be 'chain', 'static' or 'dynamic', got {mode!r}")
    if mode == "static" and tree is None:
        raise ValueError("eagle_generate: mode 'static' needs a tree")
    if mode == "chain":
        tree = static_tree(depth)
    D = depth if mode == "dynamic" else int(tree.depth.max())
    if max_new_tokens < 1 or len(prompt) + max_new_tokens + D > model.config.block_size:
        raise ValueError(f"eagle_generate: {len(prompt)} + {max_new_tokens} + depth {D} tokens exceed "
                         f"block_size={model.config.block_size}")
    E = model.wte.weight
    cache = KVCache.empty(model.config, 1, max_len=model.config.block_size + max(n_nodes, len(tree) if tree else 0) + 1)
    h = model(torch.tensor([prompt]), cache=cache, return_hidden=True)[0]        # (P, C) prefill
    feats = h                                                                     # f_0..f_{n-1}
    out = list(prompt) + [int((h[-1] @ E.T).argmax())]
    forwards, accepted = 1, []
    while len(out) - len(prompt) < max_new_tokens:
        toks = torch.tensor(out)
        tokens, tr, conf = draft_tree(draft, E, feats, toks, tree=None if mode == "dynamic" else tree,
                                      depth=depth, topk=topk, n_nodes=n_nodes, expand=expand)
        logits, hidden = tree_forward(model, tokens, tr, cache, attention=attention)
        forwards += 1
        kids = tr.children()
        want = logits.argmax(-1)
        path, cur = [0], 0
        while True:
            nxt = [c for c in kids[cur] if int(tokens[c]) == int(want[cur])]
            if trace is not None:
                trace.extend((float(conf[c]), int(tokens[c]) == int(want[cur])) for c in kids[cur])
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        keep_path(cache, path)
        out += [int(tokens[i]) for i in path[1:]] + [int(want[cur])]
        feats = torch.cat([feats, hidden[path]])
        accepted.append(len(path) - 1)
    return out[: len(prompt) + max_new_tokens], forwards, accepted


# ---------------------------------------------------------------- compile facts

LLAMA3_VOCAB = 128256


def launch_job(M: int = 10, k: int = 10, vocab: int = LLAMA3_VOCAB, *, target: str = "sm90"):
    """The GPU launch of :func:`tree_expand`'s per-node top-k on meta tensors (fp32 log-probs)."""
    from kernels import inspect as ki

    logp = torch.empty(M, vocab, device="meta")
    cum = torch.empty(M, device="meta")
    tok = torch.empty(M * k, dtype=torch.int32, device="meta")
    score = torch.empty(M * k, device="meta")
    grid, args, kwargs = _expand_args(logp, cum, tok, score, k, GPU_BLOCK_V)
    return ki.launch_job(_row_topk_kernel, *args, target=target, grid=grid, **kwargs)


def select_job(n_children: int = 100, m: int = 10, k: int = 10, *, target: str = "sm90"):
    """The GPU launch of :func:`tree_expand`'s global top-m over the M*k children (one program)."""
    from kernels import inspect as ki

    score = torch.empty(n_children, device="meta")
    tok = torch.empty(n_children, dtype=torch.int32, device="meta")
    rows = torch.empty(m, dtype=torch.int32, device="meta")
    toks = torch.empty(m, dtype=torch.int32, device="meta")
    out = torch.empty(m, device="meta")
    return ki.launch_job(_global_topm_kernel, score, tok, rows, toks, out, n_children, m, target=target, grid=(1,),
                         K=k, BLOCK_N=max(16, triton.next_power_of_2(n_children)))


def compile_jobs() -> dict:
    """Llama 3's vocabulary (128256), 10 frontier nodes with 10 children each, and 64 x 10; the
    global top-10 of 100 children."""
    return {"V 128256, 10 nodes, top-10": launch_job(10, 10), "V 128256, 64 nodes, top-10": launch_job(64, 10),
            "top-10 of 100 children": select_job(100, 10, 10)}


# ---------------------------------------------------------------- the committed run

def eval_windows(n_windows: int = 24, block: int = 128) -> torch.Tensor:
    from kernels.speculative.medusa import eval_windows as ew
    return ew(n_windows, block)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="EAGLE: train the one-layer feature draft on the frozen tiny GPT")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kernels.model.gpt import load_pretrained

    model = load_pretrained()
    E = model.wte.weight.detach()
    x = eval_windows()
    f = target_features(model, x)
    metrics = {"command": (f"python -m kernels.speculative.eagle --steps {args.steps} --seed {args.seed} "
                           f"--batch {args.batch} --windows {args.windows}"),
               "steps": args.steps, "seed": args.seed, "batch": args.batch, "n_windows": args.windows,
               "w_cls": W_CLS, "eval_windows": int(x.shape[0]), "runs": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, ttt in (("draft", 1), ("draft_ttt", TTT_STEPS)):
        t0 = time.perf_counter()
        draft, log = train_draft(model, args.steps, ttt_steps=ttt, n_windows=args.windows, batch=args.batch,
                                 seed=args.seed)
        seconds = time.perf_counter() - t0
        hits, totals = chain_accuracy(draft, f, x, E)
        torch.save({k: v.detach().clone() for k, v in draft.state_dict().items()}, args.out / f"{name}.pt")
        metrics["runs"][name] = {"ttt_steps": ttt, "train_seconds": round(seconds, 1), "chain_hits": hits,
                                 "chain_totals": totals,
                                 "final_loss_reg_cls": [round(sum(r[i] for r in log[-50:]) / len(log[-50:]), 3)
                                                        for i in range(2)]}
        with open(args.out / f"{name}_log.csv", "w") as fh:
            fh.write("step,loss_reg,loss_cls\n")
            for s, row in enumerate(log):
                if s % 10 == 0 or s == len(log) - 1:
                    fh.write(f"{s},{row[0]:.4f},{row[1]:.4f}\n")
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: (v["train_seconds"], v["chain_hits"], v["chain_totals"]) for k, v in metrics["runs"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
