"""Native Sparse Attention (NSA; Yuan et al. 2025): three branches over the same causal context, gated.

For the query q_t of head h at position t (with GQA: K/V head hk = h // G, G query heads per group):

    o_t = g_cmp * Attn(q_t, K~cmp, V~cmp) + g_slc * Attn(q_t, K~slc, V~slc) + g_win * Attn(q_t, K~win, V~win)

* **compressed** (cmp): block i of l keys starting at i*d (stride d) is pooled into one key and one
  value, phi(k_{id : id+l}); query t sees block i once the whole block is in its past, i*d + l - 1 <= t.
  The paper's phi is a learnable MLP with an intra-block position encoding; here phi is a learned
  (or uniform) weighted sum over the l positions (:func:`compress_ref`), a linear simplification.
* **selected** (slc): the keys are cut into selection blocks of l' tokens. The compressed branch's
  probabilities p_cmp[t, i] give each selection block an importance (the sum of the p_cmp of the
  compressed blocks that overlap it, weighted by the overlap in units of d: the paper's double sum
  when d divides l and l'), summed over the G query heads of a group so that **every head of the group
  shares the same blocks**, and the top n causal blocks are kept, the initial block and the
  2 local blocks always among them. The branch is attention over the tokens of those blocks, causal
  inside the block that holds t.
* **sliding window** (win): the last w keys, t - w < s <= t.

The gates g in (0, 1) come from an MLP with a sigmoid on the layer input; the reference takes them
as an input tensor. The paper gives each branch its own keys and values; the reference shares one
K and V between the branches (the branch structure is the same; the training signal is not modelled).

:func:`nsa_selected_attention` is the Triton kernel for the selected branch, with NSA's loop order:
one program per (query position, batch, K/V group). It loads the group's G query rows once (the M
dimension of the tile products), walks the group's n selected blocks, loads each block's l' keys and
values **once for all G heads**, and runs FlashAttention's online softmax over them. Shared selection is
what makes this possible: with per-head selection each head would need its own blocks and the group
would load up to G times the bytes (:func:`selected_bytes_per_token`).

NSA is trained with these branches from the start ("natively trainable"); applying the selection to
a model trained with dense attention, as the chapter does on the tiny GPT, is a measurement of how
much attention mass the rule keeps, not what the paper does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class NSAConfig:
    """NSA's block sizes; the defaults are the paper's (its pretraining setup): l = 32, d = 16, l' = 64, n = 16
    (the 1 initial and 2 local blocks included), w = 512."""

    cmp_block: int = 32        # l: tokens pooled into one compressed key
    cmp_stride: int = 16       # d: stride between compressed blocks
    sel_block: int = 64        # l': tokens per selection block
    n_selected: int = 16       # n: selection blocks per query (and group)
    n_initial: int = 1         # forced: the first block(s)
    n_local: int = 2           # forced: the block holding t and the one before it
    window: int = 512          # w: sliding-window length

    def __post_init__(self):
        for name in ("cmp_block", "cmp_stride", "sel_block", "n_selected", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"NSAConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.cmp_block % self.cmp_stride or self.sel_block % self.cmp_stride:
            raise ValueError(f"NSAConfig: cmp_stride={self.cmp_stride} must divide cmp_block={self.cmp_block} "
                             f"and sel_block={self.sel_block}")
        if self.n_initial < 0 or self.n_local < 0 or self.n_initial + self.n_local > self.n_selected:
            raise ValueError(f"NSAConfig: n_initial={self.n_initial} + n_local={self.n_local} must lie in "
                             f"[0, n_selected={self.n_selected}]")


PAPER = NSAConfig()


# ----------------------------------------------------------------------------------------------
# PyTorch references


def n_compressed(n: int, cfg: NSAConfig = PAPER) -> int:
    """Number of complete compressed blocks in n tokens: floor((n - l) / d) + 1, or 0 when n < l."""
    return 0 if n < cfg.cmp_block else (n - cfg.cmp_block) // cfg.cmp_stride + 1


def compress_ref(x: torch.Tensor, cfg: NSAConfig = PAPER, weight: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, N, D) keys or values -> (B, H, M, D) compressed, M = :func:`n_compressed` (N).

    x~_i = sum_p w_p x_{i d + p}, p < l; ``weight`` (l,) defaults to the mean (w_p = 1 / l)."""
    B, H, N, D = x.shape
    l, d = cfg.cmp_block, cfg.cmp_stride
    M = n_compressed(N, cfg)
    w = torch.full((l,), 1.0 / l, dtype=x.dtype, device=x.device) if weight is None else weight.to(x)
    if w.shape != (l,):
        raise ValueError(f"compress_ref: weight must be (cmp_block,) = ({l},), got {tuple(w.shape)}")
    if M == 0:
        return x.new_zeros(B, H, 0, D)
    blocks = x.unfold(2, l, d)                                    # (B, H, M, D, l): block i = x[i d : i d + l]
    return torch.einsum("bhmdl,l->bhmd", blocks, w)


def compressed_visible(n: int, cfg: NSAConfig = PAPER, device=None) -> torch.Tensor:
    """(n, M) bool: query t sees compressed block i when the block has ended, i d + l - 1 <= t."""
    t = torch.arange(n, device=device)[:, None]
    i = torch.arange(n_compressed(n, cfg), device=device)[None, :]
    return i * cfg.cmp_stride + cfg.cmp_block - 1 <= t


def _group(kv: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...): the K/V head each query head reads (h // G)."""
    return kv.repeat_interleave(hq // kv.shape[1], dim=1)


def dense_masked_attention_ref(q, k, v, visible, sm_scale: float | None = None, return_probs: bool = False):
    """softmax(q k^T * scale, masked to ``visible``) v; q (B, Hq, Nq, Dk), k (B, Hkv, Nk, Dk),
    v (B, Hkv, Nk, Dv), ``visible`` broadcastable to (B, Hkv or Hq, Nq, Nk). A row with nothing
    visible gives output 0 and probabilities 0. Computed in q's dtype (pass fp64 for a reference)."""
    Hq = q.shape[1]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if visible.dim() == 4 and visible.shape[1] not in (1, Hq):
        visible = _group(visible, Hq)                             # a group's mask serves all its heads
    s = (q @ _group(k, Hq).transpose(-1, -2)) * scale             # (B, Hq, Nq, Nk)
    s = s.masked_fill(~visible, float("-inf"))
    any_visible = visible.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~any_visible, 0.0), dim=-1) * any_visible   # P = softmax(S); empty row 0
    o = p @ _group(v, Hq)                                          # (B, Hq, Nq, Dv)
    return (o, p) if return_probs else o


def compressed_attention_ref(q, k, v, cfg: NSAConfig = PAPER, weight_k=None, weight_v=None, sm_scale=None):
    """The compressed branch: (o_cmp (B, Hq, N, Dv), p_cmp (B, Hq, N, M)), keys and values pooled by
    :func:`compress_ref`; rows t < l - 1 see no compressed block (o 0, p 0)."""
    kc, vc = compress_ref(k, cfg, weight_k), compress_ref(v, cfg, weight_v)
    return dense_masked_attention_ref(q, kc, vc, compressed_visible(q.shape[2], cfg, q.device), sm_scale, return_probs=True)


def overlap_weights(n: int, cfg: NSAConfig = PAPER, device=None) -> torch.Tensor:
    """(M, Nb): overlap of compressed block i ([i d, i d + l)) with selection block j ([j l', (j+1) l'))
    in units of d. At the paper's sizes each selection block gets weights 1, 2, 2, 2, 1 from the
    compressed blocks 4j - 1 .. 4j + 3: the paper's double sum over l'/d and l/d shifts."""
    M, Nb = n_compressed(n, cfg), triton.cdiv(n, cfg.sel_block)
    start = torch.arange(M, device=device)[:, None] * cfg.cmp_stride
    sel = torch.arange(Nb, device=device)[None, :] * cfg.sel_block
    lo = torch.maximum(start, sel)
    hi = torch.minimum(start + cfg.cmp_block, sel + cfg.sel_block)
    return (hi - lo).clamp(min=0).to(torch.float64) / cfg.cmp_stride


def selection_importance_ref(p_cmp: torch.Tensor, n_kv_head: int, cfg: NSAConfig = PAPER) -> torch.Tensor:
    """p_cmp (B, Hq, N, M) -> (B, Hkv, N, Nb): p_slc = p_cmp W, summed over each group's heads."""
    B, Hq, N, M = p_cmp.shape
    if Hq % n_kv_head:
        raise ValueError(f"selection_importance_ref: Hq={Hq} must be a multiple of n_kv_head={n_kv_head}")
    p_slc = p_cmp @ overlap_weights(N, cfg, p_cmp.device).to(p_cmp.dtype)          # (B, Hq, N, Nb)
    return p_slc.reshape(B, n_kv_head, Hq // n_kv_head, N, -1).sum(2)               # shared by the group


def select_blocks_ref(importance: torch.Tensor, cfg: NSAConfig = PAPER, q_offset: int = 0) -> torch.Tensor:
    """importance (B, H, Nq, Nb) -> block indices (B, H, Nq, n) int32, ascending, -1 where fewer than n
    blocks exist. Query row r sits at position t = r + q_offset; block j is a candidate when it has
    started (j l' <= t); the first ``n_initial`` blocks and the ``n_local`` blocks ending at t's block
    are always kept; the rest are the highest-importance candidates (torch.topk)."""
    B, H, Nq, Nb = importance.shape
    n = cfg.n_selected
    t = torch.arange(Nq, device=importance.device)[:, None] + q_offset            # (Nq, 1) positions
    j = torch.arange(Nb, device=importance.device)[None, :]                        # (1, Nb)
    own = t // cfg.sel_block
    causal = j <= own
    forced = causal & ((j < cfg.n_initial) | (j > own - cfg.n_local))
    score = importance.masked_fill(~causal, float("-inf")).masked_fill(forced, float("inf"))
    top, idx = score.topk(min(n, Nb), dim=-1)                                      # (B, H, Nq, <= n)
    idx = torch.where(top == float("-inf"), Nb, idx)                               # not a block: sort last
    idx = idx.sort(dim=-1).values
    idx = torch.where(idx == Nb, -1, idx)
    if idx.shape[-1] < n:
        idx = torch.cat([idx, idx.new_full((B, H, Nq, n - idx.shape[-1]), -1)], dim=-1)
    return idx.to(torch.int32)


def selection_mask_ref(idx: torch.Tensor, n_keys: int, block: int, q_offset: int = 0) -> torch.Tensor:
    """idx (B, H, Nq, n) -> (B, H, Nq, Nk) bool: key s visible to row r (position r + q_offset) when
    s's block s // block is one of the row's indices and s <= r + q_offset (causal)."""
    B, H, Nq, n = idx.shape
    Nb = triton.cdiv(n_keys, block)
    hit = torch.zeros(B, H, Nq, Nb + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(-1, torch.where(idx < 0, Nb, idx.long()), True)                  # -1 lands in a spare column
    s = torch.arange(n_keys, device=idx.device)
    t = torch.arange(Nq, device=idx.device)[:, None] + q_offset
    return hit[..., :Nb][..., s // block] & (s[None, :] <= t)


def selected_attention_ref(q, k, v, idx, block: int = 64, sm_scale=None):
    """The dense masked reference of the selected branch: full attention over (B, Hkv, Nk) keys with
    the mask of :func:`selection_mask_ref` (one mask per K/V group, shared by its query heads)."""
    Nq, Nk = q.shape[2], k.shape[2]
    return dense_masked_attention_ref(q, k, v, selection_mask_ref(idx, Nk, block, Nk - Nq), sm_scale)


def sliding_attention_ref(q, k, v, window: int = 512, sm_scale=None):
    """The sliding-window branch: key s visible to query t when t - w < s <= t."""
    N = q.shape[2]
    t = torch.arange(N, device=q.device)[:, None]
    s = torch.arange(N, device=q.device)[None, :]
    return dense_masked_attention_ref(q, k, v, (s <= t) & (s > t - window), sm_scale)


def nsa_ref(q, k, v, gates, cfg: NSAConfig = PAPER, weight_k=None, weight_v=None, sm_scale=None,
            return_parts: bool = False):
    """NSA's output (B, Hq, N, Dv) = g_cmp o_cmp + g_slc o_slc + g_win o_win; ``gates`` (B, Hq, N, 3)
    in (0, 1). With ``return_parts``: also a dict of the three branch outputs, p_cmp and the indices."""
    B, Hq, N, _ = q.shape
    if gates.shape != (B, Hq, N, 3):
        raise ValueError(f"nsa_ref: gates must be (B, Hq, N, 3) = {(B, Hq, N, 3)}, got {tuple(gates.shape)}")
    o_cmp, p_cmp = compressed_attention_ref(q, k, v, cfg, weight_k, weight_v, sm_scale)
    idx = select_blocks_ref(selection_importance_ref(p_cmp, k.shape[1], cfg), cfg)
    o_slc = selected_attention_ref(q, k, v, idx, cfg.sel_block, sm_scale)
    o_win = sliding_attention_ref(q, k, v, cfg.window, sm_scale)
    out = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    if not return_parts:
        return out
    return out, {"cmp": o_cmp, "slc": o_slc, "win": o_win, "p_cmp": p_cmp, "idx": idx}


# ----------------------------------------------------------------------------------------------
# Counting: keys, FLOPs and bytes


def keys_per_query(t: int, cfg: NSAConfig = PAPER) -> dict[str, int]:
    """Keys the three branches attend for the query at position t (t + 1 keys in its past):
    compressed blocks that have ended, the tokens of min(n, started blocks) selection blocks (capped
    at t + 1), and min(w, t + 1) window keys."""
    cmp = n_compressed(t + 1, cfg)
    slc = min(cfg.n_selected * cfg.sel_block, t + 1)
    win = min(cfg.window, t + 1)
    return {"cmp": cmp, "slc": slc, "win": win}


def paper_decode_tokens(s: int, cfg: NSAConfig = PAPER) -> int:
    """The paper's count of tokens a decode step loads at context s (its table of decoding memory access): s / d compressed
    tokens + n l' selected + w window."""
    return s // cfg.cmp_stride + cfg.n_selected * cfg.sel_block + cfg.window


def prefill_flops(n: int, n_head: int, dk: int, dv: int, cfg: NSAConfig | None = PAPER) -> int:
    """Attention FLOPs of one layer's causal prefill of n tokens: 2 (dk + dv) per (query head, key)
    pair (q k^T and p v). ``cfg`` None: full attention, t + 1 keys for query t. Otherwise NSA's three
    branches (the selection's scores are p_cmp, already computed; the pooling is counted as
    2 l (dk + dv) per compressed block and K/V head, which is small)."""
    t = torch.arange(n, dtype=torch.float64)
    if cfg is None:
        keys = (t + 1).sum()
        return int(2 * n_head * (dk + dv) * keys)
    cmp = torch.where(t + 1 >= cfg.cmp_block, (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1, 0)
    slc = torch.clamp(t + 1, max=cfg.n_selected * cfg.sel_block)
    win = torch.clamp(t + 1, max=cfg.window)
    keys = (cmp + slc + win).sum()
    return int(2 * n_head * (dk + dv) * keys)


def decode_bytes(s: int, n_kv_head: int, dk: int, dv: int, cfg: NSAConfig | None = PAPER,
                 group: int = 1, shared: bool = True, bytes_per_element: int = 2) -> int:
    """K/V bytes one decode step reads per layer at context s. ``cfg`` None: all s tokens.
    NSA: :func:`paper_decode_tokens`; with ``shared`` False each of the ``group`` heads of a group
    selects (and loads) its own n blocks, the compressed and window keys still shared."""
    per_token = n_kv_head * (dk + dv) * bytes_per_element
    if cfg is None:
        return s * per_token
    sel = cfg.n_selected * cfg.sel_block * (1 if shared else group)
    return (s // cfg.cmp_stride + sel + cfg.window) * per_token


def selected_bytes_per_token(idx: torch.Tensor, block: int, dk: int, dv: int, bytes_per_element: int = 2) -> float:
    """Mean K/V bytes the selected branch loads per (query, K/V group) when each index row (last dim)
    is loaded once: idx (B, H, N, n) with -1 for unused. For per-head indices (B, Hq, N, n) this is
    per query head, so a group of G heads loads G times it."""
    blocks = (idx >= 0).sum(-1).double().mean()
    return float(blocks) * block * (dk + dv) * bytes_per_element


# ----------------------------------------------------------------------------------------------
# The Triton kernel: the selected branch, one program per (query, batch, K/V group)


@triton.jit
def _nsa_selected_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ib, stride_ih, stride_im, stride_is,
    stride_ob, stride_oh, stride_om, stride_od,
    Hkv, Nq, Nk, DK, DV, GROUP, N_SEL, qk_scale,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BROKEN: tl.constexpr,
):
    """Program (r, b * Hkv + hk): the G query heads of group hk at query row r attend the group's
    selected blocks. BROKEN = 1 drops the causal mask inside a block (keys after t count)."""
    r = tl.program_id(0)                                   # query row; its position is t = r + Nk - Nq
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    t = r + Nk - Nq
    heads = tl.arange(0, BLOCK_H)                          # (BLOCK_H,) the group's query heads, padded
    offs_s = tl.arange(0, BLOCK_S)                         # (BLOCK_S,) keys inside a selection block
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_ok = heads < GROUP
    dk_ok = offs_dk < DK
    dv_ok = offs_dv < DV
    # 64-bit bases: batch, head and row offsets pass 2**31 elements at long contexts
    h0 = (hk * GROUP).to(tl.int64)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h0 * stride_qh + r.to(tl.int64) * stride_qm
    q = tl.load(q_base + heads[:, None] * stride_qh + offs_dk[None, :] * stride_qd,
                mask=h_ok[:, None] & dk_ok[None, :], other=0.0)           # (BLOCK_H, BLOCK_DK): Q of the group
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    i_base = idx_ptr + b.to(tl.int64) * stride_ib + hk.to(tl.int64) * stride_ih + r.to(tl.int64) * stride_im

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)  # running max (log2 units), per head
    l_i = tl.zeros((BLOCK_H,), tl.float32)                # running sum
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)       # running sum of P V
    for i in range(0, N_SEL):
        j = tl.load(i_base + i * stride_is)               # the i-th selected block of this group; -1: none
        n = j.to(tl.int64) * BLOCK_S + offs_s             # (BLOCK_S,) key positions
        if BROKEN == 1:
            visible = (n < Nk) & (j >= 0)                 # broken on purpose: keys after t inside the block
        else:
            visible = (n <= t) & (j >= 0)                 # causal inside the block; t < Nk so no tail read
        k = tl.load(k_base + n[:, None] * stride_kn + offs_dk[None, :] * stride_kd,
                    mask=visible[:, None] & dk_ok[None, :], other=0.0)     # K of the block, once for G heads
        v = tl.load(v_base + n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=visible[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale   # (BLOCK_H, BLOCK_S), log2 units
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)                     # rescale what was summed under the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]        # no visible key (cannot happen with a local block): 0
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h0 * stride_oh + r.to(tl.int64) * stride_om
    tl.store(o_base + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
             o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])


def _check(q, k, v, idx, block, sm_scale, name="nsa_selected_attention", check_values=True):
    for arg, t in (("q", q), ("k", k), ("v", v), ("idx", idx)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D, got shape {tuple(t.shape)}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if idx.dtype != torch.int32:
        raise TypeError(f"{name}: idx must be int32 block indices, got {idx.dtype}")
    B, Hq, Nq, DK = q.shape
    Bk, Hkv, Nk, DKk = k.shape
    if Bk != B or DKk != DK or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share B, "
                         "k and v their (B, Hkv, Nk), q and k their head dim")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if Hq // Hkv > 128:
        raise ValueError(f"{name}: a group of {Hq // Hkv} query heads exceeds 128 rows per program")
    if not (1 <= DK <= MAX_HEAD_DIM and 1 <= v.shape[3] <= MAX_HEAD_DIM):
        raise ValueError(f"{name}: head dims DK={DK}, DV={v.shape[3]} must lie in [1, {MAX_HEAD_DIM}]")
    if not 1 <= Nq <= Nk:
        raise ValueError(f"{name}: need 1 <= Nq <= Nk (queries are the last Nq positions), got Nq={Nq}, Nk={Nk}")
    if idx.shape[:3] != (B, Hkv, Nq) or idx.shape[3] < 1:
        raise ValueError(f"{name}: idx must be (B, Hkv, Nq, n) = ({B}, {Hkv}, {Nq}, n >= 1): one index list per "
                         f"query and K/V group (shared by the group's heads), got {tuple(idx.shape)}")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"{name}: block must be a power of two >= 16, got {block!r}")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ValueError(f"{name}: sm_scale must be a finite number or None, got {sm_scale!r}")
    if check_values and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= triton.cdiv(Nk, block):
            raise ValueError(f"{name}: idx values must lie in [-1, {triton.cdiv(Nk, block) - 1}] "
                             f"(Nk={Nk} keys in blocks of {block}), got [{lo}, {hi}]")


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_warps(block_h: int, dk: int) -> int:
    return 4 if block_h * max(dk, 64) >= 16 * 128 else 2


# GPU launch: 4 warps (2 spill at DK = 192: tests/test_nsa.py), 2 stages so the gathered K/V blocks
# arrive by cp.async (LDGSTS) while the previous block is multiplied. The interpreter runs 1 stage.
GPU_STAGES = 2


def _launch_args(q, k, v, idx, o, block: int, sm_scale: float, broken: int = 0, num_warps: int | None = None,
                 num_stages: int | None = None):
    """(grid, args, kwargs) of one launch of :func:`_nsa_selected_kernel`, shared by the launcher and
    :func:`compile_jobs` so that the AOT build is the launch."""
    B, Hq, Nq, DK = q.shape
    Hkv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
    block_h = max(16, triton.next_power_of_2(Hq // Hkv))          # tl.dot needs at least 16 rows
    bdk, bdv = max(16, triton.next_power_of_2(DK)), max(16, triton.next_power_of_2(DV))
    args = (q, k, v, idx, o, *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *o.stride(),
            Hkv, Nq, Nk, DK, DV, Hq // Hkv, idx.shape[3], sm_scale * LOG2E)
    kwargs = dict(BLOCK_H=block_h, BLOCK_S=block, BLOCK_DK=bdk, BLOCK_DV=bdv, DOT_PRECISION=_precision(q.dtype),
                  BROKEN=broken, num_warps=num_warps or _num_warps(block_h, bdk),
                  num_stages=num_stages or (1 if runtime.runtime().interpreted else GPU_STAGES))
    return (Nq, B * Hkv), args, kwargs


def nsa_selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                           block: int = 64, sm_scale: float | None = None, *, _broken: int = 0) -> torch.Tensor:
    """NSA's selected branch in Triton: q (B, Hq, Nq, DK), k (B, Hkv, Nk, DK), v (B, Hkv, Nk, DV), any
    strides, fp16/bf16/fp32, head dims up to 256; idx (B, Hkv, Nq, n) int32 selection-block indices
    (blocks of ``block`` keys, -1 for none), one list per query and K/V group, shared by the group's
    Hq / Hkv query heads. Query row r sits at position r + Nk - Nq and sees only keys up to it.
    Returns (B, Hq, Nq, DV) in q's dtype; equals :func:`selected_attention_ref`."""
    _check(q, k, v, idx, block, sm_scale)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    B, Hq, Nq, _ = q.shape
    o = torch.empty(B, Hq, Nq, v.shape[3], dtype=q.dtype, device=q.device)
    grid, args, kwargs = _launch_args(q, k, v, idx, o, block, scale, broken=_broken)
    _nsa_selected_kernel[grid](*args, **kwargs)
    return o


# ----------------------------------------------------------------------------------------------
# Compile jobs at the paper's model size

# (label, query heads, K/V heads, DK, DV): the paper's 27B MoE backbone (its pretraining setup): 64 heads in 4
# GQA groups (16 query heads per group), query/key dim 192, value dim 128. And a D = 128 variant.
REAL_CONFIGS = (
    ("NSA-27B (64 q heads, 4 groups, dk 192, dv 128)", 64, 4, 192, 128),
    ("64 q heads, 4 groups, d 128", 64, 4, 128, 128),
)


def launch_job(hq: int, hkv: int, dk: int, dv: int, *, seq: int = 65536, batch: int = 1, block: int = 64,
               n_sel: int = 16, dtype=torch.bfloat16, target: str = "sm90", num_warps: int | None = None):
    """The job a GPU launch of the selected branch compiles for a prefill of ``seq`` tokens (meta tensors)."""
    from kernels import inspect as ki

    q = torch.empty(batch, hq, seq, dk, dtype=dtype, device="meta")
    k = torch.empty(batch, hkv, seq, dk, dtype=dtype, device="meta")
    v = torch.empty(batch, hkv, seq, dv, dtype=dtype, device="meta")
    idx = torch.empty(batch, hkv, seq, n_sel, dtype=torch.int32, device="meta")
    o = torch.empty(batch, hq, seq, dv, dtype=dtype, device="meta")
    grid, args, kwargs = _launch_args(q, k, v, idx, o, block, dk ** -0.5, num_warps=num_warps, num_stages=GPU_STAGES)
    return ki.launch_job(_nsa_selected_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The selected branch at :data:`REAL_CONFIGS`, a 64k-token bf16 prefill, l' = 64, n = 16."""
    return {f"{label}, 64k prefill, selected branch": launch_job(hq, hkv, dk, dv)
            for label, hq, hkv, dk, dv in REAL_CONFIGS}


# ----------------------------------------------------------------------------------------------
# Post hoc on a dense-trained model: how much attention mass do the selected blocks keep?


def _block_mass(probs: torch.Tensor, block: int) -> torch.Tensor:
    """probs (B, H, T, S) -> (B, H, T, Nb): the probability each query puts on each block of keys."""
    B, H, T, S = probs.shape
    Nb = triton.cdiv(S, block)
    padded = torch.nn.functional.pad(probs, (0, Nb * block - S))
    return padded.view(B, H, T, Nb, block).sum(-1)


def _kept(block_mass: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """block_mass (B, Hq, T, Nb), idx (B, H, T, n) with H = Hq or a divisor (groups) -> (B, Hq, T) mass kept."""
    Hq = block_mass.shape[1]
    idx = idx.repeat_interleave(Hq // idx.shape[1], dim=1).long()
    got = block_mass.gather(-1, idx.clamp(min=0)) * (idx >= 0)
    return got.sum(-1)


@torch.no_grad()
def attention_mass_kept(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: NSAConfig,
                        first_row: int) -> dict[str, float]:
    """For one layer of a model trained with dense causal attention, q (B, Hq, T, D), k and v
    (B, Hkv, T, D) (rotated as the model uses them): the mean share of each query's dense attention
    probability that falls in the keys a selection keeps, over query rows t >= ``first_row`` and all
    query heads. Selections, all with n = cfg.n_selected blocks of cfg.sel_block keys and the forced
    initial and local blocks:

    * ``nsa``: NSA's rule, importance from compressed attention over mean-pooled keys and values,
      summed over each GQA group (applied post hoc: the model was not trained with it);
    * ``oracle_shared``: the top blocks by the true attention mass summed over the group (the best any
      group-shared selection can do);
    * ``oracle_per_head``: the top blocks by each head's own true mass (per-head selection's best);
    * ``recent``: the initial block and the n - 1 most recent blocks (a sliding window of blocks).

    Also ``union_blocks``: the mean number of distinct blocks the G heads of a group choose with
    per-head selection (``oracle_per_head``), which a group-shared kernel would have to load to serve them.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, T, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    _, probs = dense_masked_attention_ref(q, k, v, causal, return_probs=True)           # (B, Hq, T, T)
    mass = _block_mass(probs, cfg.sel_block)                                             # (B, Hq, T, Nb)
    Nb = mass.shape[-1]
    _, p_cmp = compressed_attention_ref(q, k, v, cfg)
    sel = {
        "nsa": select_blocks_ref(selection_importance_ref(p_cmp, Hkv, cfg), cfg),
        "oracle_shared": select_blocks_ref(mass.view(B, Hkv, G, T, Nb).sum(2), cfg),
        "oracle_per_head": select_blocks_ref(mass, cfg),
        "recent": select_blocks_ref(torch.arange(Nb, dtype=torch.float64, device=q.device).expand(B, Hkv, T, Nb), cfg),
    }
    out = {name: float(_kept(mass, idx)[:, :, first_row:].mean()) for name, idx in sel.items()}
    per_head = sel["oracle_per_head"][:, :, first_row:].long()                          # (B, Hq, rows, n)
    rows = per_head.shape[2]
    grouped = per_head.view(B, Hkv, G, rows, -1).permute(0, 1, 3, 2, 4).flatten(3)     # (B, Hkv, rows, G n)
    hit = torch.zeros(B, Hkv, rows, Nb + 1, dtype=torch.bool, device=q.device)
    hit.scatter_(-1, torch.where(grouped < 0, Nb, grouped), True)
    out["union_blocks"] = float(hit[..., :Nb].sum(-1).double().mean())
    return out
