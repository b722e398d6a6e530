"""Grouped-tied attention (GTA) and grouped latent attention (GLA): KV layouts designed for the
arithmetic intensity of a decode step (Zadouri, Strauss and Dao 2025).

A decode step reads the whole KV cache once for very few FLOPs; its arithmetic intensity
(FLOPs per byte read) decides whether it runs at the memory roof. Per layer, per query token, at
context L, with h_q query heads and 2-byte elements:

    GQA  (h_kv heads of dim d):        bytes 2 h_kv d L 2,     FLOPs 4 h_q d L            intensity h_q / (2 h_kv)
    GTA  (h_kv tied heads of dim d,    bytes (h_kv d + r) L 2, FLOPs 4 h_q d L            about twice GQA's
          one RoPE key of dim r):
    MLA  (one latent d_c + RoPE d_R):  bytes (d_c + d_R) L 2,  FLOPs 2 h_q L (2 d_c + d_R) about 2 h_q
    GLA  (h_c latent heads of d_c/h_c  bytes (d_c + d_R) L 2,  FLOPs 2 h_q L (2 d_c/h_c + d_R)
          + one RoPE key d_R):           (split over h_c devices: (d_c/h_c + d_R) L 2 each)

GTA (the paper's Figure 1 and modeling_llama_GTA.py in Dao-AILab/grouped-latent-attention@17889dbb):
one projection gives a *tied* state t (dim d) per group; the value is all of t; the key is the first
d - r dims of t (no positional encoding) concatenated with a single-head RoPE key k_R (dim r, shared by
every head):  k_h = [t_g[:d-r] ; k_R],  v_h = t_g.  With r = d/2 it caches h_kv d + d/2 values per
token instead of GQA's 2 h_kv d.

GLA (modeling_llama_GLA.py there): MLA's latent split into h_c = 2 latent heads of 2d each (d_c = 4d),
each serving half of the query heads, with MLA's decoupled RoPE key; on 2 devices each holds one
latent head instead of a copy of MLA's whole latent. Its decode is MLA's absorbed decode with two
latent heads.

One kernel serves all three: kernels.attention.mla's latent decode (heads of a group on the MMA's M
axis, the latent tile read once as key and value). :func:`gla_decode` calls it with h_c = 2;
:func:`gta_decode` with the tied heads as latent heads, one shared RoPE head, and the query's RoPE
half moved out of the latent query (its second half zero, so q . t = q[:d-r] . t[:d-r]).
:func:`gta_decode_ref` computes GTA from its own definition (K and V built per head), so the check is
not the kernel's algebra checked against itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.attention.mla import gather_latent, meta_job, mla_decode
from kernels.attention.reference import attention_ref


@dataclass(frozen=True)
class Layout:
    """A KV layout for the decode-step counts: which mechanism and its dims."""
    kind: str                # "mha", "gqa", "mqa", "gta", "mla", "gla"
    hq: int                  # query heads
    d: int = 128             # head dim (mha/gqa/mqa/gta)
    hkv: int = 1             # K/V heads (gqa), tied heads (gta)
    rope: int = 0            # RoPE key dim (gta: r; mla/gla: d_R)
    latent: int = 0          # d_c (mla/gla), total over latent heads
    latent_heads: int = 1    # h_c (gla)

    @property
    def name(self) -> str:
        extra = {"gqa": f"-{self.hkv}", "gta": f"-{self.hkv}", "gla": f"-{self.latent_heads}"}.get(self.kind, "")
        return f"{self.kind.upper()}{extra} (h_q={self.hq})"


def decode_step_counts(layout: Layout, context: int, *, query_len: int = 1, bytes_per_element: int = 2,
                       devices: int = 1) -> tuple[float, float]:
    """(FLOPs, bytes of KV cache read) of one layer's attention for one sequence's decode step of
    ``query_len`` tokens at ``context`` cached tokens, counted per device when the heads are split
    over ``devices`` (GLA: one latent head per device; GQA/GTA: h_kv / devices heads; MLA: the whole
    latent on every device). Matmul FLOPs only (2 per multiply-add); the queries' and outputs' bytes
    are left out (they do not grow with the context)."""
    L, lq, h = context, query_len, layout.hq // devices
    k = layout.kind
    if layout.hq % devices:
        raise ValueError(f"decode_step_counts: {devices} devices must divide h_q={layout.hq}")
    if k in ("mha", "gqa", "mqa"):
        hkv = {"mha": layout.hq, "gqa": layout.hkv, "mqa": 1}[k]
        per_dev = max(hkv // devices, 1)                  # MQA's single head is copied on every device
        return 4.0 * h * lq * layout.d * L, 2.0 * per_dev * layout.d * L * bytes_per_element
    if k == "gta":
        per_dev = max(layout.hkv // devices, 1)
        return 4.0 * h * lq * layout.d * L, (per_dev * layout.d + layout.rope) * L * bytes_per_element
    if k in ("mla", "gla"):
        hc = layout.latent_heads if k == "gla" else 1
        dc_head = layout.latent // hc
        if hc % devices and devices % hc:
            raise ValueError(f"decode_step_counts: {devices} devices and {hc} latent heads do not divide")
        heads_here = max(hc // devices, 1)                # latent heads stored on one device
        flops = 2.0 * h * lq * L * (2 * dc_head + layout.rope)   # q.[c; k_R] and p.c
        return flops, (heads_here * dc_head + layout.rope) * L * bytes_per_element
    raise ValueError(f"decode_step_counts: unknown kind {k!r}")


def kv_elements_per_token(layout: Layout) -> int:
    """Cached elements per token and layer on one device (all of it)."""
    return int(decode_step_counts(layout, 1, bytes_per_element=1)[1])


# ----------------------------------------------------------------------------------------------
# GTA: the reference from its definition, and the decode by the latent kernel


def gta_decode_ref(q, tied_pages, rope_pages, block_table, seqlens, sm_scale: float, *, upcast: bool = True):
    """GTA decode from its definition: per query head h of group g = h // (Hq / Hkv), key
    k_j = [t_g,j[:d-r] ; k_R,j] and value v_j = t_g,j over the j < L_b cached tokens.

    q (B, Hq, d) (its last r dims meet the RoPE key), tied_pages (num_pages, P, Hkv, d), rope_pages
    (num_pages, P, 1, r). Returns (B, Hq, d), fp32 (fp64 kept) or, with ``upcast=False``, in q's dtype."""
    B, Hq, d = q.shape
    r = rope_pages.shape[-1]
    wide = (torch.float64 if q.dtype == torch.float64 else torch.float32) if upcast else q.dtype
    out = torch.zeros(B, Hq, d, dtype=wide, device=q.device)
    for b in range(B):
        L = int(seqlens[b])
        if L == 0:
            continue
        t = gather_latent(tied_pages, block_table[b:b + 1], L)[0].to(wide)          # (L, Hkv, d)
        kr = gather_latent(rope_pages, block_table[b:b + 1], L)[0, :, 0].to(wide)   # (L, r)
        k = torch.cat([t[..., :d - r], kr[:, None].expand(-1, t.shape[1], -1)], -1)  # (L, Hkv, d)
        o = attention_ref(q[b, None, :, None].to(wide), k.transpose(0, 1)[None], t.transpose(0, 1)[None],
                          sm_scale=sm_scale, upcast=upcast)                          # (1, Hq, 1, d)
        out[b] = o[0, :, 0]
    return out


def gta_queries(q: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent kernel's queries for GTA: q_lat = [q[:d-r] ; 0] (dim d, so q_lat . t = q[:d-r] . t[:d-r])
    and q_rope = q[d-r:]."""
    d = q.shape[-1]
    q_lat = torch.cat([q[..., :d - rope_dim], torch.zeros_like(q[..., d - rope_dim:])], -1)
    return q_lat.contiguous(), q[..., d - rope_dim:].contiguous()


def gta_decode(q, tied_pages, rope_pages, block_table, seqlens, sm_scale: float, **kwargs) -> torch.Tensor:
    """GTA decode by kernels.attention.mla.mla_decode: the Hkv tied heads are its latent heads, the
    single RoPE head is shared; returns (B, Hq, d). ``kwargs`` go to mla_decode (num_splits, tile)."""
    if rope_pages.dim() != 4 or rope_pages.shape[2] != 1:
        raise ValueError(f"gta_decode: rope_pages must be (num_pages, P, 1, r): one RoPE key for all heads, "
                         f"got {tuple(rope_pages.shape)}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] <= rope_pages.shape[-1]:
        raise ValueError(f"gta_decode: q must be (B, Hq, d) with d > r = {rope_pages.shape[-1]}, "
                         f"got {tuple(getattr(q, 'shape', ()))}")
    q_lat, q_rope = gta_queries(q, rope_pages.shape[-1])
    return mla_decode(q_lat, q_rope, tied_pages, rope_pages, block_table, seqlens, sm_scale, **kwargs)


def gla_decode(q_lat, q_rope, latent_pages, rope_pages, block_table, seqlens, sm_scale: float, **kwargs):
    """GLA decode: mla_decode with latent_pages (num_pages, P, h_c, d_c / h_c), h_c >= 2 latent heads
    each serving Hq / h_c query heads (absorbed queries q_lat (B, Hq, d_c / h_c))."""
    if latent_pages.dim() != 4 or latent_pages.shape[2] < 2:
        raise ValueError(f"gla_decode: latent_pages must have h_c >= 2 latent heads, got {tuple(latent_pages.shape)}")
    return mla_decode(q_lat, q_rope, latent_pages, rope_pages, block_table, seqlens, sm_scale, **kwargs)


# ----------------------------------------------------------------------------------------------
# Compile jobs


# GLA-2 as in the repository's FA3 usage example (README at 17889dbb: 128 query heads, 2 latent heads
# of 256, RoPE 64, pages of 64); GTA with Llama-3-8B's 32 query heads in 8 groups, d = 128, r = d / 2.
GLA2 = Layout("gla", hq=128, latent=512, latent_heads=2, rope=64)
GTA8 = Layout("gta", hq=32, d=128, hkv=8, rope=64)


def compile_jobs() -> dict:
    """GLA-2 and GTA-8 decode at batch 32, 8192 cached tokens, bf16, as gla_decode / gta_decode launch on a
    132-SM H100 (tile and split count from kernels.attention.mla's rules)."""
    B, S = 32, 8192
    jobs = {}
    for label, hq, hc, dc, hr, dr in (("GLA-2 decode, 128 heads, 2 latent heads of 256 + RoPE 64", 128, 2, 256, 2, 64),
                                      ("GTA-8 decode, 32 heads, 8 tied heads of 128, RoPE 64", 32, 8, 128, 1, 64)):
        job, splits = meta_job(B, S, hq, hc, dc, hr, dr, 1 / math.sqrt(128 + 64 if hr == hc else 128))
        jobs[f"{label}, B={B}, S={S}, {splits} split(s)"] = job
    return jobs
