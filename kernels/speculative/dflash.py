"""DFlash-style block drafting: a small drafter fills a whole block of [MASK] slots in ONE forward,
conditioned on the target's hidden features; the target verifies the block in one forward.

DFlash (Chen, Liang, Liu 2026, arXiv:2602.06036) drafts with a lightweight block-diffusion model: the
block is [last accepted token, MASK, ..., MASK]; every draft layer's attention takes as keys and values
the target's context features (projected hidden states of the target, "KV injection") followed by the
block itself, with NO causal mask inside the block, so all masked positions are predicted at once.
The target's embedding and LM head are shared with the drafter. Here, at the tiny GPT's size:

* :class:`BlockDrafter`: ``n_layer`` layers over a block of K slots; context = the target's final
  normed hidden states of the last W positions (the paper fuses several intermediate layers; the
  course's GPT exposes only the final one), projected and given a learned recency embedding.
  One forward proposes K - 1 tokens (block slot 0 is the token already chosen by the target).
* :func:`block_attention_ref` (PyTorch) and :func:`block_attention` (Triton): the block's queries over
  a key buffer whose slots 0..L_b-1 hold the context and L_b..L_b+K-1 the block; key s is visible to
  every block query iff s < L_b + K (bidirectional inside the block, whole context visible, nothing
  past the block). Broken variants kept for the tests: ``"causal"`` (a causal mask inside the block,
  the autoregressive drafter's mask) and ``"leak"`` (ignores L_b: reads every slot of the buffer).
* :func:`dflash_greedy`: greedy block-speculative decoding (equal to plain greedy decoding token for
  token); :func:`ar_draft_greedy`: the same loop with an autoregressive draft (the target's first
  layer, kernels.speculative.drafts.truncated_copy) that needs K - 1 sequential forwards per block.
* :func:`parallel_q_fn`: the draft distribution of a parallel drafter for the exact checks of
  kernels.speculative.sampling: position j's distribution does not depend on the drafted d_<j.

Training (``python -m kernels.speculative.dflash``): masked-block prediction on the target's OWN greedy
continuations of random prefixes of the training text (cross-entropy at the K - 1 masked slots).
This is one denoising step from all-masked, which is how DFlash drafts at inference; the paper's
training recipe (anchors, loss weighting, data) is not reproduced.

Shapes: B batch, H / Hkv query / key-value heads, K block size, D head dim, S key slots,
L context length (slots before the block), C d_model, V vocabulary, W context window.
"""
from __future__ import annotations

import json
import math
import time
from fractions import Fraction
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.model.gpt import GPT, KVCache, RMSNorm

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "dflash"
BLOCK = 8            # K: block slots (slot 0 the known token, K - 1 drafted)
WINDOW = 32          # W: context features the drafter sees
VARIANTS = ("exact", "causal", "leak")


# ---------------------------------------------------------------- the block mask and attention, PyTorch

def block_mask_ref(L: int, K: int, variant: str = "exact") -> torch.Tensor:
    """(K, L + K) bool: which key slot each block query sees. Exact: all of them (context, whole block).
    "causal": block query i sees block keys j <= i only (an autoregressive drafter's mask)."""
    ctx = torch.ones(K, L, dtype=torch.bool)
    blk = torch.ones(K, K, dtype=torch.bool)
    if variant == "causal":
        blk = torch.tril(blk)
    return torch.cat([ctx, blk], 1)


def check_block_attention_inputs(q, k, v, lens, name: str = "block_attention") -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{name}: q must be a (B, H, K, D) tensor, got {getattr(q, 'shape', type(q))}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: q must be float32, float16 or bfloat16, got {q.dtype}")
    B, H, K, D = q.shape
    for arg, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B or t.shape[3] != D:
            raise ValueError(f"{name}: {arg} must be a ({B}, Hkv, S, {D}) tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: {arg} must be {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
        if t.stride(3) != 1:
            raise ValueError(f"{name}: {arg} must be contiguous along D")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"{name}: H={H} query heads must be a multiple of Hkv={k.shape[1]}")
    if q.stride(3) != 1:
        raise ValueError(f"{name}: q must be contiguous along D")
    if not isinstance(lens, torch.Tensor) or lens.shape != (B,) or lens.dtype != torch.int32 or lens.device != q.device:
        raise ValueError(f"{name}: lens must be a ({B},) int32 tensor on {q.device}, got "
                         f"{getattr(lens, 'shape', type(lens))} {getattr(lens, 'dtype', '')}")
    if B and (int(lens.min()) < 0 or int(lens.max()) + K > k.shape[2]):
        raise ValueError(f"{name}: need 0 <= lens[b] and lens[b] + K={K} <= S={k.shape[2]}")


def block_attention_ref(q, k, v, lens) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for the block's queries q (B, H, K, D) over k, v (B, Hkv, S, D),
    whose slots 0..L_b-1 hold the context and L_b..L_b+K-1 the block (L_b = lens[b]); every query sees
    every one of these L_b + K slots and nothing after them. (B, H, K, D)"""
    check_block_attention_inputs(q, k, v, lens, "block_attention_ref")
    B, H, K, D = q.shape
    group = H // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(lens[b])
        kb = k[b, :, : L + K].repeat_interleave(group, 0).float()          # (H, L + K, D): written slots only
        vb = v[b, :, : L + K].repeat_interleave(group, 0).float()
        s = q[b].float() @ kb.transpose(-1, -2) / math.sqrt(D)               # (H, K, L + K)
        out[b] = (torch.softmax(s, -1) @ vb).to(q.dtype)
    return out


def masked_attention_dense(q, k, v, mask) -> torch.Tensor:
    """Dense attention with an explicit (K, S) mask, the same for every sequence: a second reference."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, 1).float()
    vv = v.repeat_interleave(group, 1).float()
    s = q.float() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv).to(q.dtype)


# ---------------------------------------------------------------- the block attention, Triton

@triton.jit
def _block_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lens_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_ot,
    K, S, sm_scale,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    """One program per (sequence b, query head h): the whole block (K <= BLOCK_M queries) at once, an
    online softmax over the L_b + K visible key slots in tiles of BLOCK_N. VARIANT 0 is exact;
    1 masks block key j from query i when j > i (causal inside the block); 2 reads all S slots."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)                       # b * stride_kb passes 2**31 at a large batch and context
    h = pid % H
    hk = h // GROUP
    L = tl.load(lens_ptr + b)
    i = tl.arange(0, BLOCK_M)                         # (BLOCK_M,) block slots
    im = i < K
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + i[:, None] * stride_qt + d[None, :],
                mask=im[:, None] & dm[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if VARIANT == 2:
        n_keys = S
    else:
        n_keys = L + K
    for start in range(0, n_keys, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)             # (BLOCK_N,) key slots
        sm = s < n_keys
        kt = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(kt)) * sm_scale    # (BLOCK_M, BLOCK_N)
        visible = sm[None, :] & im[:, None]
        if VARIANT == 1:
            visible = visible & (s[None, :] - L <= i[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # padded query rows see nothing
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + i[:, None] * stride_ot + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=im[:, None] & dm[None, :])


GPU_BLOCK_N = 64
CPU_BLOCK_N = 64


def _block_attention_args(q, k, v, lens, out, *, block_n: int, variant: str = "exact", num_warps: int = 4):
    """(grid, args, kwargs) of one launch, shared by :func:`block_attention` and :func:`launch_job`."""
    B, H, K, D = q.shape
    args = (q, k, v, out, lens, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            K, k.shape[2], 1.0 / math.sqrt(D))
    kwargs = dict(H=H, GROUP=H // k.shape[1], D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
                  BLOCK_M=max(16, triton.next_power_of_2(K)), BLOCK_N=block_n, VARIANT=VARIANTS.index(variant),
                  num_warps=num_warps)
    return (B * H,), args, kwargs


def block_attention(q, k, v, lens, *, variant: str = "exact", block_n: int | None = None) -> torch.Tensor:
    """The Triton block attention: same arguments and result as :func:`block_attention_ref`.
    ``variant`` "causal" or "leak" selects a deliberately broken mask, for the tests."""
    check_block_attention_inputs(q, k, v, lens)
    if variant not in VARIANTS:
        raise ValueError(f"block_attention: variant must be one of {VARIANTS}, got {variant!r}")
    B, H, K, D = q.shape
    if K > 128:
        raise ValueError(f"block_attention: block size K must be <= 128 (one query tile), got {K}")
    block_n = block_n or (GPU_BLOCK_N if q.is_cuda else CPU_BLOCK_N)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_attention: block_n must be a power of two >= 16, got {block_n}")
    out = torch.empty(B, H, K, D, dtype=q.dtype, device=q.device)
    if B == 0 or K == 0:
        return out
    grid, args, kwargs = _block_attention_args(q, k, v, lens, out, block_n=block_n, variant=variant)
    _block_attention_kernel[grid](*args, **kwargs)
    return out


# ---------------------------------------------------------------- the drafter

class DraftLayer(nn.Module):
    def __init__(self, C: int, n_head: int, eps: float):
        super().__init__()
        self.n_head = n_head
        self.norm1, self.norm2 = RMSNorm(C, eps), RMSNorm(C, eps)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(C, C, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(C, 3 * C), nn.Linear(3 * C, C)

    def forward(self, x, ctx, attention: str = "ref"):
        """x (B, K, C) the block, ctx (B, L, C) the projected context features (equal L in a batch)."""
        B, K, C = x.shape
        L = ctx.shape[1]
        Hh, Dh = self.n_head, C // self.n_head
        u = self.norm1(x)
        kv_in = torch.cat([ctx, u], 1)                                     # (B, L + K, C): context then block
        q = self.wq(u).view(B, K, Hh, Dh).transpose(1, 2)                  # (B, H, K, Dh)
        k = self.wk(kv_in).view(B, L + K, Hh, Dh).transpose(1, 2)          # (B, H, L + K, Dh)
        v = self.wv(kv_in).view(B, L + K, Hh, Dh).transpose(1, 2)
        lens = torch.full((B,), L, dtype=torch.int32)
        if attention == "ref":                                             # differentiable: the dense form
            a = masked_attention_dense(q, k, v, block_mask_ref(L, K))
        elif attention == "triton":
            a = block_attention(q, k, v, lens)
        elif attention == "causal":
            a = masked_attention_dense(q, k, v, block_mask_ref(L, K, "causal"))
        else:
            raise ValueError(f"DraftLayer: attention must be 'ref', 'triton' or 'causal', got {attention!r}")
        x = x + self.wo(a.transpose(1, 2).reshape(B, K, C))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class BlockDrafter(nn.Module):
    """Drafts K - 1 tokens from [token, MASK x (K-1)] in one forward, reading the target's last W
    hidden features. The target's embedding E (V, C) is the input table and E^T the LM head (shared,
    frozen: passed in, not stored)."""

    def __init__(self, C: int, n_head: int = 4, n_layer: int = 2, block: int = BLOCK, window: int = WINDOW,
                 eps: float = 1e-5):
        super().__init__()
        self.block, self.window = block, window
        self.fc = nn.Linear(C, C, bias=False)                              # context feature projection
        self.ctx_norm = RMSNorm(C, eps)
        self.recency = nn.Parameter(torch.zeros(window, C))               # distance 0 = the latest feature
        self.mask = nn.Parameter(torch.randn(C) * 0.02)                    # the [MASK] embedding
        self.pos = nn.Parameter(torch.zeros(block, C))                     # block slot embedding
        self.layers = nn.ModuleList(DraftLayer(C, n_head, eps) for _ in range(n_layer))
        self.norm_f = RMSNorm(C, eps)

    def forward(self, ctx_h, first, E, attention: str = "ref"):
        """ctx_h (B, L, C) the target's hidden features (L <= W, the latest last), first (B,) the block's
        known token, E (V, C) the target's embedding. Logits (B, K - 1, V) for block slots 1..K-1."""
        B, L, C = ctx_h.shape
        if L > self.window or L < 1:
            raise ValueError(f"BlockDrafter: need 1 <= L <= window={self.window} context features, got {L}")
        ctx = self.ctx_norm(self.fc(ctx_h)) + self.recency[:L].flip(0)     # (B, L, C)
        x = torch.cat([E[first][:, None], self.mask.expand(B, self.block - 1, C)], 1) + self.pos   # (B, K, C)
        for layer in self.layers:
            x = layer(x, ctx, attention)
        return self.norm_f(x[:, 1:]) @ E.T                                 # (B, K - 1, V)

    @torch.no_grad()
    def propose(self, ctx_h, first: int, E, attention: str = "ref") -> tuple[list[int], torch.Tensor]:
        """One drafter forward: (K - 1 greedy tokens, their per-position distributions q (K - 1, V))."""
        logits = self(ctx_h[None, -self.window:], torch.tensor([first]), E, attention)[0]
        return logits.argmax(-1).tolist(), torch.softmax(logits.float(), -1)


# ---------------------------------------------------------------- decoding

@torch.no_grad()
def dflash_greedy(model: GPT, drafter: BlockDrafter, prompt: list[int], max_new_tokens: int, *,
                  attention: str = "ref") -> tuple[list[int], int, int, list[int]]:
    """Greedy block-speculative decoding: (tokens, target forwards, drafter forwards, accepted per step).
    Each step: ONE drafter forward proposes K - 1 tokens after the last token; ONE target forward over
    [last, drafts] gives its argmax at every slot; keep drafts while they equal it, then the target's
    own token. The target's hidden states of the kept positions extend the drafter's context."""
    K = drafter.block
    if max_new_tokens < 1 or len(prompt) < 1:
        raise ValueError(f"dflash_greedy: need max_new_tokens >= 1 and a non-empty prompt, got {max_new_tokens}, {len(prompt)}")
    if len(prompt) + max_new_tokens + K > model.config.block_size:
        raise ValueError(f"dflash_greedy: {len(prompt)} + {max_new_tokens} + K={K} exceed block_size")
    E = model.wte.weight
    cache = KVCache.empty(model.config, 1)
    h = model(torch.tensor([prompt]), cache=cache, return_hidden=True)[0]  # (T, C) prefill
    out = list(prompt) + [int((h[-1] @ E.T).argmax())]
    feats = h                                                              # now: every position before out[-1]
    forwards, drafts, accepted = 1, 0, []
    while len(out) - len(prompt) < max_new_tokens:
        left = max_new_tokens - (len(out) - len(prompt))
        draft = []
        if left > 1:
            draft = drafter.propose(feats, out[-1], E, attention)[0][: left - 1]
            drafts += 1
        h = model(torch.tensor([[out[-1]] + draft]), cache=cache, return_hidden=True)[0]   # (1 + n, C)
        pred = (h @ E.T).argmax(-1).tolist()
        forwards += 1
        n = 0
        while n < len(draft) and draft[n] == pred[n]:
            n += 1
        out += draft[:n] + [pred[n]]
        cache.seqlens -= len(draft) - n                                    # forget the rejected drafts' keys
        feats = torch.cat([feats, h[: n + 1]])                             # out[-1] (old) and the kept drafts
        accepted.append(n)
    return out, forwards, drafts, accepted


@torch.no_grad()
def ar_draft_greedy(model: GPT, draft_model: GPT, prompt: list[int], max_new_tokens: int, gamma: int
                    ) -> tuple[list[int], int, int, list[int]]:
    """The same loop with an autoregressive draft model proposing ``gamma`` tokens one after another
    (its own KV cache within a block: gamma sequential forwards): (tokens, target forwards, draft
    forwards, accepted per step)."""
    from kernels.speculative.drafts import speculative_greedy

    count = [0]

    def drafter(tokens):
        g = min(gamma, model.config.block_size - len(tokens))
        count[0] += g
        return draft_model.generate(torch.tensor([tokens]), g)[0, len(tokens):].tolist()

    out, forwards, accepted = speculative_greedy(model, prompt, max_new_tokens, drafter, gamma)
    return out, forwards, count[0], accepted


def plain_greedy(model: GPT, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain decoding with the KV cache: one target forward per token (the baseline)."""
    return model.generate(torch.tensor([prompt]), max_new_tokens)[0].tolist()


# ---------------------------------------------------------------- exactness with a parallel drafter

def parallel_q_fn(marginals: list, prefix_len: int):
    """q_fn for kernels.speculative.sampling.step_distribution of a drafter that proposes every block
    position independently: position j's distribution is marginals[j] whatever d_<j were drafted
    (step_distribution also asks after the last draft, where q is not used: the last one is returned)."""
    return lambda seq: marginals[min(len(seq) - prefix_len, len(marginals) - 1)]


def block_output_distribution(p_fn, marg_fn, prefix: tuple, gamma: int, length: int, rule: str = "exact") -> dict:
    """Exact distribution of the first ``length`` tokens of repeated block-speculative steps, where each
    block's drafter gives ``gamma`` independent per-position marginals marg_fn(prefix) computed once
    from the block's context (the parallel drafter), and the target checks them with ``rule``."""
    from kernels.speculative.sampling import step_distribution

    if length <= 0:
        return {(): Fraction(1)}
    out: dict = {}
    q_fn = parallel_q_fn(marg_fn(prefix), len(prefix))
    for seq, w in step_distribution(p_fn, q_fn, prefix, gamma, rule).items():
        if len(seq) >= length:
            out[seq[:length]] = out.get(seq[:length], 0) + w
        else:
            for rest, w2 in block_output_distribution(p_fn, marg_fn, prefix + seq, gamma, length - len(seq), rule).items():
                out[seq + rest] = out.get(seq + rest, 0) + w * w2
    return out


# ---------------------------------------------------------------- training

def eval_prompts(n: int = 6, length: int = 24, seed: int = 1) -> list[list[int]]:
    """Held-out prompts: windows of the validation text."""
    from kernels.model.data import encode, load_text, train_val_split

    _, val = train_val_split(encode(load_text()))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(val) - length, (n,), generator=g).tolist()
    return [val[s: s + length].tolist() for s in starts]


@torch.no_grad()
def make_batch(model: GPT, tokens: torch.Tensor, batch: int, K: int, W: int, g: torch.Generator):
    """A training batch: context features (B, W, C) of random text prefixes, the block's first token
    (the text's next token), and the labels: the target's own greedy continuation (B, K - 1)."""
    T = int(torch.randint(W, model.config.block_size - K - 1, (1,), generator=g))   # prefix length, > W
    starts = torch.randint(0, len(tokens) - T - 1, (batch,), generator=g)
    x = torch.stack([tokens[s: s + T + 1] for s in starts.tolist()])              # (B, T + 1)
    cache = KVCache.empty(model.config, batch)
    h = model(x, cache=cache, return_hidden=True)                                  # (B, T + 1, C)
    E = model.wte.weight
    nxt = (h[:, -1] @ E.T).argmax(-1)
    labels = [nxt]
    for _ in range(K - 2):
        nxt = model(nxt[:, None], cache=cache)[:, -1].argmax(-1)
        labels.append(nxt)
    return h[:, T - W: T], x[:, T], torch.stack(labels, 1)


def train_drafter(model: GPT, steps: int, *, batch: int = 32, lr: float = 2e-3, seed: int = 0,
                  K: int = BLOCK, W: int = WINDOW) -> tuple[BlockDrafter, list[float]]:
    from tqdm import tqdm

    from kernels.model.data import encode, load_text, train_val_split

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    train, _ = train_val_split(encode(load_text()))
    drafter = BlockDrafter(model.config.d_model, block=K, window=W)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=max(steps, 1), pct_start=0.1)
    E = model.wte.weight.detach()
    log = []
    for _ in tqdm(range(steps), desc="dflash drafter"):
        ctx, first, labels = make_batch(model, train, batch, K, W, g)
        logits = drafter(ctx, first, E)                                           # (B, K - 1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        log.append(loss.item())
    return drafter.eval(), log


def load_drafter(directory: Path | str = MODEL_DIR) -> BlockDrafter:
    d = Path(directory)
    m = json.loads((d / "metrics.json").read_text())
    drafter = BlockDrafter(m["d_model"], n_head=m["n_head"], n_layer=m["n_layer"], block=m["block"], window=m["window"])
    drafter.load_state_dict(torch.load(d / "drafter.pt", weights_only=True))
    return drafter.eval()


def load_metrics(directory: Path | str = MODEL_DIR) -> dict:
    return json.loads((Path(directory) / "metrics.json").read_text())


# ---------------------------------------------------------------- compile facts

QWEN3_8B = dict(H=32, Hkv=8, D=128)      # Qwen3-8B: 32 query heads, 8 KV heads, head dim 128


def launch_job(H: int, Hkv: int, D: int, *, block: int = 16, context: int = 4096, batch: int = 1,
               target: str = "sm90"):
    """The GPU launch of :func:`block_attention` on meta tensors (bf16): a block of ``block`` slots after
    ``context`` context slots."""
    from kernels import inspect as ki

    q = torch.empty(batch, H, block, D, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, Hkv, context + block, D, dtype=torch.bfloat16, device="meta")
    v = torch.empty_like(k)
    out = torch.empty_like(q)
    lens = torch.empty(batch, dtype=torch.int32, device="meta")
    grid, args, kwargs = _block_attention_args(q, k, v, lens, out, block_n=GPU_BLOCK_N)
    return ki.launch_job(_block_attention_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Qwen3-8B's attention shape (GQA 32/8, head dim 128), blocks of 16 after 4096 context slots."""
    return {"Qwen3-8B (GQA 32/8), block 16, context 4096": launch_job(**QWEN3_8B),
            "Qwen3-8B (GQA 32/8), block 16, context 4096, batch 64": launch_job(**QWEN3_8B, batch=64)}


# ---------------------------------------------------------------- the committed run

def main(argv: list[str] | None = None) -> int:
    import argparse

    from kernels.model.gpt import load_pretrained

    ap = argparse.ArgumentParser(description="DFlash-style block drafter for the frozen tiny GPT")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_pretrained().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    t0 = time.perf_counter()
    drafter, log = train_drafter(model, args.steps, batch=args.batch, seed=args.seed)
    seconds = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in drafter.state_dict().items()}, args.out / "drafter.pt")
    metrics = {
        "command": f"python -m kernels.speculative.dflash --steps {args.steps} --seed {args.seed} --batch {args.batch}",
        "steps": args.steps, "seed": args.seed, "batch": args.batch, "train_seconds": round(seconds, 1),
        "d_model": model.config.d_model, "n_head": 4, "n_layer": len(drafter.layers),
        "block": drafter.block, "window": drafter.window,
        "final_loss": round(sum(log[-50:]) / max(1, len(log[-50:])), 3),
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with open(args.out / "train_log.csv", "w") as f:
        f.write("step,loss\n")
        for s, v in enumerate(log):
            if s % 10 == 0 or s == len(log) - 1:
                f.write(f"{s},{v:.4f}\n")
    print(json.dumps({k: metrics[k] for k in ("train_seconds", "final_loss")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
