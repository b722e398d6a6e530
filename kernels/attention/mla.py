"""Multi-head latent attention (DeepSeek-V2/V3): a latent KV cache, the absorbed decode, and a paged
decode kernel in FlashMLA's design.

MLA (DeepSeek-AI 2024, DeepSeek-V2 section 2.1) caches, per token and layer, one compressed latent
c_KV (d_c values, shared by all heads) and one decoupled RoPE key k_R (d_R values, shared by all heads):

    c_KV = W_DKV h                       (d_c,)          k_R = RoPE(W_KR h)     (d_R,)
    k_h  = [W_UK,h c_KV ; k_R]           (d_nope + d_R,) v_h = W_UV,h c_KV      (d_v,)
    o_h  = softmax_j(tau (q_nope,h . W_UK,h c_j + q_R,h . k_R,j)) v_h,j         tau = 1/sqrt(d_nope + d_R)

At decode the up-projections need not be applied to the cache ("absorbed"):

    q_nope . (W_UK c) = (W_UK^T q_nope) . c          so q_lat,h = W_UK,h^T q_nope,h   (d_c,)
    sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j)        so o_h = W_UV,h o_lat,h

and every head attends to the same cache rows [c_j ; k_R,j] (d_c + d_R = 576 in DeepSeek-V3) with values
c_j (512): multi-query attention with a 576-dim key whose first 512 dims are also the value.
:func:`mla_naive_ref` and :func:`mla_absorbed_ref` compute both forms.

The kernel (:func:`mla_decode`) follows FlashMLA (deepseek-ai/FlashMLA@33e110bb, csrc/flash_fwd_mla_kernel.h:
Flash_fwd_kernel_traits_mla<576, 64, 64, 8, T, 512>): a program owns BLOCK_H query heads of one latent
head (the heads on the MMA's M axis, so QK^T and PV are tensor-core GEMMs), walks the sequence in tiles
of BLOCK_N positions of a paged cache (the page size a multiple of BLOCK_N; FlashMLA requires
page_block_size == kBlockN == 64), loads each cache tile ONCE and uses its first d_c columns both as
the key's latent part and as the value ("K is V": FlashMLA reads V from the K tile in shared memory).
Optionally the sequence is split (flash decoding) and the partials merged by
kernels.attention.decode.combine.

Shapes (decode, one new token per sequence):
    q_lat        (B, Hq, Dc)             absorbed queries;   q_rope (B, Hq, Dr)
    latent_pages (num_pages, P, Hc, Dc)  Hc latent heads (MLA: 1; GLA: 2); query head h reads h // (Hq / Hc)
    rope_pages   (num_pages, P, Hr, Dr)  Hr = 1 (one RoPE key shared by all) or Hr = Hc
    block_table  (B, max_pages) int32    seqlens (B,) int32/int64
    output       (B, Hq, Dc)             o_lat, in q's dtype (zeros for an empty sequence)
The two cache tensors may be views into one (num_pages, P, Hc, Dc + Dr) tensor, FlashMLA's layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention.decode import MAX_SPLITS, choose_num_splits, combine, device_sms
from kernels.attention.reference import attention_ref

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MLAConfig:
    """The attention dims of an MLA model."""
    n_layers: int
    n_heads: int
    kv_lora_rank: int          # d_c
    qk_nope_head_dim: int      # d_nope
    qk_rope_head_dim: int      # d_R
    v_head_dim: int            # d_v

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """1/sqrt(d_nope + d_R): the softmax scale of both forms (YaRN's mscale^2 factor left out)."""
        return 1.0 / math.sqrt(self.qk_head_dim)


# deepseek-ai/DeepSeek-V3@9b4e9788, inference/configs/config_671B.json: n_layers 61, n_heads 128,
# kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
DEEPSEEK_V3 = MLAConfig(n_layers=61, n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128)


def kv_elements_per_token(kind: str, *, n_heads: int, head_dim: int, kv_heads: int = 1, latent: int = 0,
                          rope: int = 0, v_head_dim: int | None = None) -> int:
    """Cached elements per token and layer.

    "mha" / "gqa" / "mqa": 2 * kv_heads * head_dim (K and V; mha uses n_heads, mqa one head);
    "mla": latent + rope (one c_KV and one k_R for all heads);
    "mla-decompressed": n_heads * (head_dim + v_head_dim), the K (d_nope + d_R) and V (d_v) of every head,
    what DeepSeek-V3's reference code caches with attn_impl = "naive"."""
    if kind == "mha":
        return 2 * n_heads * head_dim
    if kind == "gqa":
        if kv_heads < 1 or n_heads % kv_heads:
            raise ValueError(f"kv_elements_per_token: kv_heads={kv_heads} must divide n_heads={n_heads}")
        return 2 * kv_heads * head_dim
    if kind == "mqa":
        return 2 * head_dim
    if kind == "mla":
        return latent + rope
    if kind == "mla-decompressed":
        return n_heads * (head_dim + (v_head_dim if v_head_dim is not None else head_dim))
    raise ValueError(f"kv_elements_per_token: kind must be mha, gqa, mqa, mla or mla-decompressed, got {kind!r}")


# ----------------------------------------------------------------------------------------------
# The two forms, in PyTorch


def _check_forms(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    B, H, T, dn = q_nope.shape
    if q_rope.shape[:3] != (B, H, T) or c_kv.dim() != 3 or k_rope.shape[:2] != c_kv.shape[:2]:
        raise ValueError(f"mla: expected q_nope (B, H, T, dn), q_rope (B, H, T, dr), c_kv (B, S, dc), k_rope (B, S, dr); "
                         f"got {tuple(q_nope.shape)}, {tuple(q_rope.shape)}, {tuple(c_kv.shape)}, {tuple(k_rope.shape)}")
    dc = c_kv.shape[-1]
    if w_uk.shape != (H, dn, dc) or w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != dc:
        raise ValueError(f"mla: expected w_uk (H, dn, dc) = ({H}, {dn}, {dc}) and w_uv (H, dv, dc), "
                         f"got {tuple(w_uk.shape)} and {tuple(w_uv.shape)}")


def mla_naive_ref(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, sm_scale: float, causal: bool = False):
    """Decompress the cache into per-head K (B, H, S, dn + dr) and V (B, H, S, dv), then attention.

    q_nope (B, H, T, dn), q_rope (B, H, T, dr), c_kv (B, S, dc), k_rope (B, S, dr) (RoPE applied),
    w_uk (H, dn, dc), w_uv (H, dv, dc). Returns (B, H, T, dv) in the inputs' wide dtype."""
    _check_forms(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)
    H = q_nope.shape[1]
    k_nope = torch.einsum("bsc,hdc->bhsd", c_kv, w_uk)                     # W_UK,h c_j
    v = torch.einsum("bsc,hdc->bhsd", c_kv, w_uv)                          # W_UV,h c_j
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    return attention_ref(q, k, v, causal, sm_scale)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat,h = W_UK,h^T q_nope,h: (B, H, T, dn) x (H, dn, dc) -> (B, H, T, dc)."""
    return torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk)


def mla_absorbed_ref(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, sm_scale: float, causal: bool = False):
    """The absorbed form: one shared key [c ; k_R] (dc + dr) and value c (dc) for all heads, then W_UV."""
    _check_forms(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)
    q = torch.cat([absorb_query(q_nope, w_uk), q_rope], dim=-1)           # (B, H, T, dc + dr)
    k = torch.cat([c_kv, k_rope], dim=-1)[:, None]                         # (B, 1, S, dc + dr)
    o_lat = attention_ref(q, k, c_kv[:, None], causal, sm_scale)           # (B, H, T, dc): MQA, V = c
    return torch.einsum("bhtc,hdc->bhtd", o_lat, w_uv)                     # o_h = W_UV,h o_lat,h


# ----------------------------------------------------------------------------------------------
# Paged latent decode: the reference


def gather_latent(pages: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of each sequence from a paged (num_pages, P, H, D) cache: (B, length, H, D)."""
    P = pages.shape[1]
    n = -(-length // P)
    t = pages[block_table[:, :n].long()]                                   # (B, n, P, H, D)
    return t.reshape(t.shape[0], n * P, *pages.shape[2:])[:, :length]


def mla_decode_ref(q_lat, q_rope, latent_pages, rope_pages, block_table, seqlens, sm_scale: float, *,
                   upcast: bool = True) -> torch.Tensor:
    """Decode attention over the paged latent cache: query head h of sequence b scores
    tau (q_lat . c_j + q_rope . k_R,j) over j < L_b of its latent head h // (Hq / Hc), and returns
    sum_j p_j c_j (B, Hq, Dc); an empty sequence gives zeros. ``upcast=True``: in fp32 (fp64 kept),
    returned wide; ``upcast=False``: every product in the inputs' dtype (PyTorch's own low-precision
    result, the baseline of the attention test rule)."""
    B, Hq, Dc = q_lat.shape
    Hc, Hr = latent_pages.shape[2], rope_pages.shape[2]
    wide = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    wide = wide if upcast else q_lat.dtype
    S = int(seqlens.max()) if B else 0
    if S == 0:
        return torch.zeros(B, Hq, Dc, dtype=wide, device=q_lat.device)
    c = gather_latent(latent_pages, block_table, S).to(wide)               # (B, S, Hc, Dc)
    r = gather_latent(rope_pages, block_table, S).to(wide)                 # (B, S, Hr, Dr)
    head = torch.arange(Hq, device=q_lat.device) // (Hq // Hc)             # latent head of each query head
    c_h = c[:, :, head].permute(0, 2, 1, 3)                                # (B, Hq, S, Dc)
    r_h = r[:, :, head if Hr == Hc else torch.zeros_like(head)].permute(0, 2, 1, 3)
    s = (torch.einsum("bhc,bhsc->bhs", q_lat.to(wide), c_h) + torch.einsum("bhr,bhsr->bhs", q_rope.to(wide), r_h)) * sm_scale
    valid = torch.arange(S, device=q_lat.device)[None, :] < seqlens.long()[:, None]   # (B, S)
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(s.masked_fill(~valid.any(1)[:, None, None], 0.0), dim=-1) * valid[:, None]
    return torch.einsum("bhs,bhsc->bhc", p.to(wide), c_h)


# ----------------------------------------------------------------------------------------------
# The kernel


@triton.jit
def _mla_decode_kernel(
    ql_ptr, qr_ptr, c_ptr, r_ptr, table_ptr, lens_ptr, o_ptr, mpart_ptr, lpart_ptr,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,
    stride_cp, stride_cs, stride_ch, stride_rp, stride_rs, stride_rh,
    stride_tb, stride_ob, stride_oh,
    Hq, GROUP, HEAD_BLOCKS, ROPE_SHARED, NUM_SPLITS, scale_log2,
    DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_LENGTH: tl.constexpr,
):
    """One program per (sequence b, latent head x head block, split): BLOCK_H query heads of one latent
    head over one chunk of sequence b's cache, a tile of BLOCK_N positions (inside one page) per step."""
    b = tl.program_id(0)
    hc = tl.program_id(1) // HEAD_BLOCKS                      # latent head
    hb = tl.program_id(1) % HEAD_BLOCKS                       # block of its GROUP query heads
    split = tl.program_id(2)
    L = tl.load(lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N   # whole tiles per split
    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)
    g = hb * BLOCK_H + tl.arange(0, BLOCK_H)                  # (BLOCK_H,) heads within the group
    g_ok = g < GROUP
    heads = hc * GROUP + g                                    # query heads
    dc = tl.arange(0, DC)
    dr = tl.arange(0, DR)
    ql = tl.load(ql_ptr + b.to(tl.int64) * stride_qlb + heads[:, None] * stride_qlh + dc[None, :],
                 mask=g_ok[:, None], other=0.0)               # (BLOCK_H, DC)
    qr = tl.load(qr_ptr + b.to(tl.int64) * stride_qrb + heads[:, None] * stride_qrh + dr[None, :],
                 mask=g_ok[:, None], other=0.0)               # (BLOCK_H, DR)
    hr = tl.where(ROPE_SHARED == 1, 0, hc)                    # one RoPE key for all, or one per latent head
    n = tl.arange(0, BLOCK_N)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, DC), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + start // PAGE).to(tl.int64)   # physical page
        slot = start % PAGE + n                                # positions inside the page (BLOCK_N divides PAGE)
        if MASK_LENGTH:
            ok = start + n < hi
        else:
            ok = start + n < start + BLOCK_N                   # broken on purpose: the last tile read whole
        c = tl.load(c_ptr + page * stride_cp + hc.to(tl.int64) * stride_ch + slot[:, None] * stride_cs + dc[None, :],
                    mask=ok[:, None], other=0.0)               # (BLOCK_N, DC): latent rows, key AND value
        kr = tl.load(r_ptr + page * stride_rp + hr.to(tl.int64) * stride_rh + slot[:, None] * stride_rs + dr[None, :],
                     mask=ok[:, None], other=0.0)              # (BLOCK_N, DR): RoPE keys
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)                     # q_lat . c_j
        s = tl.dot(qr, tl.trans(kr), s, input_precision=DOT_PRECISION) * scale_log2    # + q_R . k_R,j, log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))            # finite: every visited tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)   # += P c: V is c
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    rows = b.to(tl.int64) * Hq + heads                        # (BLOCK_H,) rows of (B * Hq)
    if SPLIT:
        tl.store(mpart_ptr + rows * NUM_SPLITS + split, tl.where(l_i > 0, m_i * 0.6931471805599453, float("-inf")),
                 mask=g_ok)                                   # m_s in natural-log units, -inf if empty
        tl.store(lpart_ptr + rows * NUM_SPLITS + split, l_i, mask=g_ok)
        tl.store(o_ptr + (rows[:, None] * NUM_SPLITS + split) * DC + dc[None, :], o, mask=g_ok[:, None])
    else:
        tl.store(o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dc[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launcher

# GPU tiles (BLOCK_H, BLOCK_N, num_warps): FlashMLA's 64 heads x 64 positions, 8 warps, for DeepSeek-V3.
# Compiled for sm_90a at 576/512 (Triton 3.7.1, tests/test_mla.py): with 2 stages the 64 x 512 fp32
# accumulator fits in 255 registers and 216 KiB of shared memory without spilling; with 3 stages
# (Triton's default) it spills, and with 4 warps it spills at every tile size tried.
GPU_TILE = (64, 64, 8)
NUM_STAGES = 2
CPU_TILE = (16, 32, 4)


def gpu_tile(group: int, latent_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps) on a GPU: BLOCK_H the group's query heads rounded up to a power of
    two between 16 (tl.dot's smallest M) and 64; 8 warps from a 64 x 256 fp32 accumulator up (4 spill there), 4 below."""
    bh = min(64, max(16, triton.next_power_of_2(group)))
    return bh, GPU_TILE[1], 8 if bh * latent_dim >= 64 * 256 else 4


def check_latent_inputs(q_lat, q_rope, latent_pages, rope_pages, block_table, seqlens, name: str = "mla_decode"):
    """Validate the arguments of :func:`mla_decode` (shapes in the module docstring)."""
    args = (("q_lat", q_lat), ("q_rope", q_rope), ("latent_pages", latent_pages), ("rope_pages", rope_pages),
            ("block_table", block_table), ("seqlens", seqlens))
    for arg, t in args:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_rope.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"{name}: q_lat must be (B, Hq, Dc) and q_rope (B, Hq, Dr), got {tuple(q_lat.shape)}, "
                         f"{tuple(q_rope.shape)}")
    if latent_pages.dim() != 4 or rope_pages.dim() != 4 or rope_pages.shape[:2] != latent_pages.shape[:2]:
        raise ValueError(f"{name}: latent_pages must be (num_pages, P, Hc, Dc) and rope_pages (num_pages, P, Hr, Dr), "
                         f"got {tuple(latent_pages.shape)}, {tuple(rope_pages.shape)}")
    B, Hq, Dc = q_lat.shape
    _, P, Hc, Dc2 = latent_pages.shape
    Hr, Dr = rope_pages.shape[2], rope_pages.shape[3]
    if Dc2 != Dc or Dr != q_rope.shape[2]:
        raise ValueError(f"{name}: q_lat/q_rope dims ({Dc}, {q_rope.shape[2]}) differ from the cache's ({Dc2}, {Dr})")
    for nm, d in (("Dc", Dc), ("Dr", Dr), ("page size", P)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name}: {nm} = {d} must be a power of two >= 16 (tensor-core tiles)")
    if Hq % Hc:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of the latent heads Hc={Hc}")
    if Hr not in (1, Hc):
        raise ValueError(f"{name}: rope_pages must have 1 head (shared) or Hc={Hc}, got {Hr}")
    for arg, t in args[:4]:
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != q_lat.dtype:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; q_lat, q_rope and the caches must share one of "
                            f"float16, bfloat16, float32")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {arg} must be contiguous in its last dimension, got strides {t.stride()}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: block_table must be a (B={B}, max_pages) int32/int64 tensor, "
                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    if seqlens.shape != (B,) or seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: seqlens must be a (B,)=({B},) int32/int64 tensor, got {tuple(seqlens.shape)} {seqlens.dtype}")
    cap = block_table.shape[1] * P
    if B and (int(seqlens.min()) < 0 or int(seqlens.max()) > cap):
        raise ValueError(f"{name}: seqlens must lie in [0, max_pages * page_size = {cap}], got "
                         f"min {int(seqlens.min())}, max {int(seqlens.max())}")
    if B:
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * P < seqlens[:, None]
        ids = block_table[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= latent_pages.shape[0]):
            raise ValueError(f"{name}: block_table entries in use must lie in [0, num_pages={latent_pages.shape[0]}), "
                             f"got min {int(ids.min())}, max {int(ids.max())}")


def default_num_splits(batch: int, programs_per_sequence: int, cache_len: int, device: torch.device) -> int:
    """1 under the interpreter; on a GPU kernels.attention.decode.choose_num_splits with this GPU's SMs,
    counting (latent head x head block) programs per sequence as decode counts K/V heads."""
    if runtime.runtime().interpreted:
        return 1
    return choose_num_splits(max(batch, 1), programs_per_sequence, cache_len, device_sms(device))


def _launch_args(q_lat, q_rope, latent_pages, rope_pages, table, seqlens, out, m, l, sm_scale, *,
                 num_splits: int, block_h: int, block_n: int, num_warps: int, mask_length: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_mla_decode_kernel`, shared by :func:`mla_decode`
    and :func:`compile_jobs`. ``out`` is (B, Hq, Dc) for one split, the fp32 partials (B, Hq, S, Dc)
    for more, with m and l (B, Hq, S)."""
    B, Hq, Dc = q_lat.shape
    P, Hc = latent_pages.shape[1], latent_pages.shape[2]
    group = Hq // Hc
    head_blocks = triton.cdiv(group, block_h)
    split = num_splits > 1
    args = (q_lat, q_rope, latent_pages, rope_pages, table, seqlens, out, m, l,
            q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1),
            latent_pages.stride(0), latent_pages.stride(1), latent_pages.stride(2),
            rope_pages.stride(0), rope_pages.stride(1), rope_pages.stride(2),
            table.stride(0), 0 if split else out.stride(0), 0 if split else out.stride(1),
            Hq, group, head_blocks, rope_pages.shape[2], num_splits, sm_scale * LOG2E)
    kwargs = dict(DC=Dc, DR=q_rope.shape[2], PAGE=P, BLOCK_H=block_h, BLOCK_N=min(block_n, P), SPLIT=split,
                  DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", MASK_LENGTH=mask_length,
                  num_warps=num_warps, num_stages=NUM_STAGES)
    return (B, Hc * head_blocks, num_splits), args, kwargs


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent_pages: torch.Tensor, rope_pages: torch.Tensor,
               block_table: torch.Tensor, seqlens: torch.Tensor, sm_scale: float, *, num_splits: int | None = None,
               tile: tuple[int, int, int] | None = None, _mask_length: bool = True) -> torch.Tensor:
    """o_lat (B, Hq, Dc) in q_lat's dtype: :func:`mla_decode_ref` by the kernel.

    ``sm_scale`` is explicit (DeepSeek-V3: 1/sqrt(192), not 1/sqrt(576): the absorbed form keeps the
    naive form's scale). ``num_splits`` (1..MAX_SPLITS) cuts each sequence into that many chunks merged
    by kernels.attention.decode.combine; None fills the GPU (1 under the interpreter). ``tile`` =
    (BLOCK_H, BLOCK_N, num_warps), powers of two >= 16 with BLOCK_N <= page size.
    ``_mask_length=False`` is the broken variant that reads every last tile whole."""
    check_latent_inputs(q_lat, q_rope, latent_pages, rope_pages, block_table, seqlens)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"mla_decode: sm_scale must be a positive finite number, got {sm_scale!r}")
    B, Hq, Dc = q_lat.shape
    P, Hc = latent_pages.shape[1], latent_pages.shape[2]
    if tile is None:
        bh, bn, warps = gpu_tile(Hq // Hc, Dc) if runtime.runtime().on_gpu else CPU_TILE
        bn = min(bn, P)
    else:
        bh, bn, warps = tile
    for nm, val in (("BLOCK_H", bh), ("BLOCK_N", bn)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"mla_decode: tile {nm} must be a power of two >= 16, got {val!r}")
    if bn > P:
        raise ValueError(f"mla_decode: tile BLOCK_N={bn} must not exceed the page size {P}")
    if num_splits is None:
        num_splits = default_num_splits(B, Hc * triton.cdiv(Hq // Hc, bh), int(seqlens.max()) if B else 0, q_lat.device)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"mla_decode: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    out = torch.empty((B, Hq, Dc), dtype=q_lat.dtype, device=q_lat.device)
    if B == 0:
        return out
    table = block_table.contiguous()
    if num_splits > 1:
        m = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q_lat.device)
        l = torch.empty_like(m)
        part = torch.empty((B, Hq, num_splits, Dc), dtype=torch.float32, device=q_lat.device)
    else:
        m = l = part = out
    grid, args, kwargs = _launch_args(q_lat, q_rope, latent_pages, rope_pages, table, seqlens, part, m, l, sm_scale,
                                      num_splits=num_splits, block_h=bh, block_n=bn, num_warps=warps,
                                      mask_length=_mask_length)
    _mla_decode_kernel[grid](*args, **kwargs)
    return combine(m, l, part, out_dtype=q_lat.dtype) if num_splits > 1 else out


def paged_latent_cache(latent: torch.Tensor, rope: torch.Tensor, page_size: int, *, seed: int = 0,
                       extra_pages: int = 0, fill=float("nan")):
    """Scatter contiguous caches latent (B, S, Hc, Dc) and rope (B, S, Hr, Dr) into pages (a random page
    order, ``extra_pages`` unused pages, unused slots filled with ``fill``). With Hr == Hc, FlashMLA's
    layout: one (num_pages, P, Hc, Dc + Dr) pool viewed as (latent_pages, rope_pages); with Hr = 1 (one
    RoPE key shared by all heads, GTA) two pools under one page table.
    Returns (latent_pages, rope_pages, block_table int32 (B, ceil(S / P)))."""
    B, S, Hc, Dc = latent.shape
    Hr, Dr = rope.shape[2], rope.shape[3]
    if rope.shape[:2] != (B, S) or Hr not in (1, Hc):
        raise ValueError(f"paged_latent_cache: rope must be (B, S, 1 or Hc, Dr) with B={B}, S={S}, Hc={Hc}, "
                         f"got {tuple(rope.shape)}")
    n = -(-S // page_size)
    total = B * n + extra_pages
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:B * n].view(B, n)

    def scatter(rows):                                   # rows (B, S, H, D) -> (total, P, H, D)
        pool = torch.full((total, page_size, *rows.shape[2:]), fill, dtype=rows.dtype, device=rows.device)
        for b in range(B):
            for i in range(n):
                chunk = rows[b, i * page_size:(i + 1) * page_size]
                pool[order[b, i], :chunk.shape[0]] = chunk
        return pool

    table = order.to(torch.int32).to(latent.device)
    if Hr == Hc:
        pool = scatter(torch.cat([latent, rope], dim=-1))
        return pool[..., :Dc], pool[..., Dc:], table
    return scatter(latent), scatter(rope), table


# ----------------------------------------------------------------------------------------------
# Compile jobs at DeepSeek-V3's size


def meta_job(B: int, S: int, hq: int, hc: int, dc: int, hr: int, dr: int, sm_scale: float, *, page: int = 64,
             sms: int = 132):
    """The launch job of :func:`mla_decode` for B sequences of S cached tokens (bf16 meta tensors, one pool
    of pages), with the tile of :func:`gpu_tile` and the split count :func:`default_num_splits` picks on
    a GPU of ``sms`` SMs. Returns (job, number of splits)."""
    from kernels import inspect as ki

    bh, bn, warps = gpu_tile(hq // hc, dc)
    splits = choose_num_splits(B, hc * triton.cdiv(hq // hc, bh), S, sms)
    pages = B * S // page
    if hr == hc:                                            # FlashMLA's layout: one pool, two views
        pool = torch.empty(pages, page, hc, dc + dr, device="meta", dtype=torch.bfloat16)
        lat, rope = pool[..., :dc], pool[..., dc:]
    else:                                                   # one RoPE key shared by all heads (GTA)
        lat = torch.empty(pages, page, hc, dc, device="meta", dtype=torch.bfloat16)
        rope = torch.empty(pages, page, hr, dr, device="meta", dtype=torch.bfloat16)
    q_lat = torch.empty(B, hq, dc, device="meta", dtype=torch.bfloat16)
    q_rope = torch.empty(B, hq, dr, device="meta", dtype=torch.bfloat16)
    table = torch.empty(B, S // page, device="meta", dtype=torch.int32)
    lens = torch.empty(B, device="meta", dtype=torch.int32)
    if splits > 1:
        out = torch.empty(B, hq, splits, dc, device="meta", dtype=torch.float32)
        m = torch.empty(B, hq, splits, device="meta", dtype=torch.float32)
    else:
        out = m = torch.empty(B, hq, dc, device="meta", dtype=torch.bfloat16)
    grid, args, kwargs = _launch_args(q_lat, q_rope, lat, rope, table, lens, out, m, m, sm_scale, num_splits=splits,
                                      block_h=bh, block_n=bn, num_warps=warps)
    return ki.launch_job(_mla_decode_kernel, *args, grid=grid, **kwargs), splits


def compile_jobs() -> dict:
    """DeepSeek-V3 decode (128 query heads on one latent head, Dc 512 + Dr 64, 64-position pages, the
    cache in FlashMLA's one-pool layout), bf16, as :func:`mla_decode` launches it on a 132-SM H100:
    batch 64 at 8192 cached tokens and batch 1 at 32768."""
    cfg = DEEPSEEK_V3
    jobs = {}
    for B, S in ((64, 8192), (1, 32768)):
        job, splits = meta_job(B, S, cfg.n_heads, 1, cfg.kv_lora_rank, 1, cfg.qk_rope_head_dim, cfg.sm_scale)
        jobs[f"DeepSeek-V3 decode, 128 heads, 576/512, B={B}, S={S}, {splits} split(s)"] = job
    return jobs
