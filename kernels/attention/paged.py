"""Paged decode attention: one new query per sequence over a KV cache stored in fixed-size pages.

A paged cache (kernels.serving.allocator) keeps every sequence's keys and values in pages of
``page_size`` positions drawn from one pool, in any order; a page table maps the sequence's
logical page i to a physical page:

    position p of sequence b  ->  k_pages[block_table[b, p // P], :, p % P, :]        P = page_size

and decode attention is the usual one, each key and value found through the table:

    o[b, h] = sum_{lo_b <= j < L_b} softmax_j(q[b, h] . k_b[g(h), j] / sqrt(D)) v_b[g(h), j]

with lo_b = 0, or lo_b = max(0, L_b - W) for a sliding window of W positions (the query at position
L_b - 1 sees the W most recent keys, itself included).

Shapes:
    q            (B, Hq, D)
    k_pages      (num_pages, Hkv, P, D)   one pool for all sequences; v_pages the same
    block_table  (B, max_pages) int32     entries past a sequence's ceil(L_b / P) pages are ignored
    seqlens      (B,) int32/int64         L_b, 0 <= L_b <= max_pages * P
    output       (B, Hq, D)               zeros where L_b = 0

One program per (sequence, K/V head) puts the query heads of its GQA group on the rows of a tile
padded to at least 16 (the M axis of the tensor cores' MMA), as the contiguous
kernels.attention.decode does, and walks the sequence in tiles of BLOCK_S positions (64 at D = 128,
decode.gpu_tiles) with the online softmax; both products, S = q K^T and acc += P V, are tl.dot.
Each row of a K/V tile finds its own page through the table,

    pos = t * BLOCK_S + s,    row s  ->  k_pages[block_table[b, pos // P], hk, pos % P, :]

so a tile spans BLOCK_S / P pages when the page is smaller than the tile (16-position pages, vLLM's
default, and 64-position tiles: four pages a tile), and lies inside one page otherwise: the tile
size is the tensor cores' choice, not the page's. FlashAttention 3's paged path loads rows the same
way when a page is smaller than its tile, and FlashInfer computes every row's address from its own
page entry. fp16 and bf16 pages multiply on tensor cores (fp32 accumulation); fp32 pages multiply in
full fp32 (input_precision "ieee", as decode does), which Triton lowers to FMAs on CUDA cores, since
TF32 would round the keys to 10 mantissa bits.

With a window, tiles wholly before lo_b are never visited: the loop starts at tile lo_b // BLOCK_S,
and the positions of that first tile before lo_b are masked (neither their table entries nor their
keys are loaded). The design follows vLLM's paged attention (vllm-project/vllm@d7e5edb1,
csrc/attention/paged_attention_v1.cu: block_tables); the code is written fresh.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.attention.decode import (MAX_GROUP, SUPPORTED_DTYPES, DecodeTiles, _load_rows_q, _precision, _tile_rows,
                                      check_block_s, default_tiles, gpu_tiles)

LOG2E = 1.4426950408889634


def gather_pages(pages: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, contiguous: (Hkv, length, D)."""
    P = pages.shape[2]
    n = -(-length // P)
    chunks = pages[table_row[:n].long()]                       # (n, Hkv, P, D)
    return chunks.permute(1, 0, 2, 3).reshape(pages.shape[1], n * P, pages.shape[3])[:, :length]


def window_start(length: int, window: int | None) -> int:
    """lo = max(0, L - W): the first key the last query sees (0 without a window)."""
    return 0 if window is None else max(0, length - window)


def paged_decode_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               block_table: torch.Tensor, seqlens: torch.Tensor, *,
                               window: int | None = None) -> torch.Tensor:
    """Gather every sequence's pages into a contiguous cache, then attention over [lo_b, L_b) in fp32
    (fp64 for fp64 inputs)."""
    B, Hq, D = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)
    Hkv, P = k_pages.shape[1], k_pages.shape[2]
    n = -(-int(seqlens.max()) // P) if B else 0                                  # pages of the longest
    if n == 0:
        return torch.zeros_like(q)
    def gather(pages):                                                           # (B, Hq, n * P, D)
        t = pages[block_table[:, :n].long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * P, D)
        return t.to(wide).repeat_interleave(Hq // Hkv, dim=1)
    k, v = gather(k_pages), gather(v_pages)
    j = torch.arange(n * P, device=q.device)[None, :]
    L = seqlens.to(q.device).long()[:, None]
    lo = L - window if window is not None else torch.zeros_like(L)
    valid = (j < L) & (j >= lo)                                                  # (B, n * P): lo_b <= j < L_b
    scores = torch.einsum("bhd,bhsd->bhs", q.to(wide), k) / math.sqrt(D)
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    probs = torch.where(valid[:, None, :], probs, torch.zeros_like(probs))       # L_b = 0: zeros, not NaN
    out = torch.einsum("bhs,bhsd->bhd", probs, v.masked_fill(~valid[:, None, :, None], 0.0))
    return out.to(q.dtype)


# The deliberately broken variants the tests must catch (paged_decode_attention's ``_broken``):
#   "length-mask"        reads the last tile whole, past the sequence's length;
#   "one-page-per-tile"  reads every row of a tile from the page of its first position (the bug of a
#                        kernel that assumes a tile never crosses a page);
#   "interleaved-heads"  puts query head g * Hkv + hk on row g instead of hk * GROUP + g.
BROKEN = (None, "length-mask", "one-page-per-tile", "interleaved-heads")


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, o_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_ks, stride_kd,
    stride_vp, stride_vh, stride_vs, stride_vd,
    stride_tb, stride_ob, stride_oh, stride_od,
    D, GROUP, WINDOW, scale_log2,
    PAGE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, BROKEN: tl.constexpr,
):
    """One program per (sequence b, K/V head hk): the group's query heads on the BLOCK_G rows of both
    MMAs, one tile of BLOCK_S positions per iteration, each row's address from its own page entry."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    L = tl.load(lens_ptr + b).to(tl.int32)                      # filled positions of sequence b
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - WINDOW, 0)                          # lo = max(0, L - W)
    # tile row g (the MMA's M axis, padded to >= 16): query head hk * GROUP + g, valid for g < GROUP
    heads, t0, row_ok = _tile_rows(hk, GROUP, 1, BLOCK_G, False)
    if BROKEN == "interleaved-heads":
        heads = tl.arange(0, BLOCK_G) * tl.num_programs(1) + hk   # broken on purpose: head g * Hkv + hk
    q = _load_rows_q(q_ptr, b, heads, t0, row_ok, stride_qb, stride_qh, 0, stride_qd, D, BLOCK_D)   # (BLOCK_G, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    s = tl.arange(0, BLOCK_S)                                   # rows of a K/V tile
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    k_head = k_ptr + hk.to(tl.int64) * stride_kh
    v_head = v_ptr + hk.to(tl.int64) * stride_vh
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)          # running max of the scores (log2 units)
    l = tl.zeros((BLOCK_G,), tl.float32)                        # running sum of exp2(score - m)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)              # running sum of exp2(score - m) v
    for t in range(lo // BLOCK_S, tl.cdiv(L, BLOCK_S)):       # tiles of BLOCK_S positions covering [lo, L)
        pos = t * BLOCK_S + s                                   # (BLOCK_S,) sequence positions of the tile
        in_seq = (pos < L) & (pos >= lo)                        # lo <= pos < L
        if BROKEN == "one-page-per-tile":
            page = tl.load(table_row + (t * BLOCK_S) // PAGE).to(tl.int64)   # broken on purpose: one page, all rows
        else:
            page = tl.load(table_row + pos // PAGE, mask=in_seq, other=0).to(tl.int64)   # (BLOCK_S,) each row's page
        slot = pos % PAGE                                       # (BLOCK_S,) each row's place in its page
        s_ok = in_seq
        if BROKEN == "length-mask":
            s_ok = pos >= lo                                    # broken on purpose: reads past L (page 0 there)
        kv_mask = s_ok[:, None] & d_ok[None, :]
        k_rows = k_head + page * stride_kp + slot * stride_ks   # (BLOCK_S,) pointers; int64: a pool passes 2**31
        v_rows = v_head + page * stride_vp + slot * stride_vs
        k = tl.load(k_rows[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0.0)   # (BLOCK_S, BLOCK_D)
        v = tl.load(v_rows[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        # scores[g, j] = q[g] . k[j] / sqrt(D) in log2 units: (BLOCK_G, BLOCK_S), one MMA over the group
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))           # finite: every visited tile meets [lo, L)
        alpha = tl.exp2(m - m_new)                              # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])                    # (BLOCK_G, BLOCK_S)
        l = l * alpha + tl.sum(p, axis=1)                       # l' = alpha l + sum p
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)   # acc' = alpha acc + P V
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]                # o = acc / l; empty sequence: 0
    offs = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def check_paged_inputs(q, k_pages, v_pages, block_table, seqlens, window, name="paged_decode_attention"):
    """Validate the arguments; errors name the argument and what was expected."""
    for arg, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("block_table", block_table),
                   ("seqlens", seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != runtime.device().type:
            raise ValueError(f"{name}: {arg} is on {t.device}, kernels run on {runtime.device()} here")
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be (B, Hq, D), got shape {tuple(q.shape)}")
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"{name}: k_pages and v_pages must both be (num_pages, Hkv, page_size, D), "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    B, Hq, D = q.shape
    _, Hkv, P, Dk = k_pages.shape
    if Dk != D:
        raise ValueError(f"{name}: q has head dim {D} but k_pages has {Dk}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if Hq // Hkv > MAX_GROUP:
        raise ValueError(f"{name}: Hq / Hkv = {Hq // Hkv} query heads per K/V head; one program serves at most "
                         f"MAX_GROUP={MAX_GROUP} (the tensor-core tile's rows), larger groups are not implemented")
    if P < 1 or P & (P - 1):
        raise ValueError(f"{name}: page_size (k_pages.shape[2]) must be a power of two, got {P}")
    if q.dtype not in SUPPORTED_DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise TypeError(f"{name}: q, k_pages, v_pages must share a dtype among float16, bfloat16, float32; "
                        f"got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
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
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_pages.shape[0]):
            raise ValueError(f"{name}: block_table entries in use must lie in [0, num_pages={k_pages.shape[0]}), "
                             f"got min {int(ids.min())}, max {int(ids.max())}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window must be None or an int >= 1, got {window!r}")


def paged_tiles(group: int, head_dim: int, block_s: int | None = None) -> DecodeTiles:
    """The launch's tiles: the contiguous decode kernel's (decode.default_tiles: the group padded to
    >= 16 rows, 64 positions per tile at D = 128 on a GPU, 64 under the interpreter), whatever the
    page size, since a tile gathers its rows from as many pages as it spans."""
    return default_tiles(group, head_dim, block_s)


def paged_grid(batch: int, kv_heads: int) -> tuple[int, int]:
    """One program per (sequence, K/V head)."""
    return (batch, kv_heads)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           block_table: torch.Tensor, seqlens: torch.Tensor, *, window: int | None = None,
                           block_s: int | None = None, _broken: str | None = None) -> torch.Tensor:
    """Decode attention over a paged cache (shapes in the module docstring); ``window`` W keeps the W
    most recent positions; ``block_s`` (a power of two >= 16, larger or smaller than the page) the
    positions per tile, default :func:`paged_tiles`'. ``_broken`` (one of :data:`BROKEN`) launches a
    deliberately wrong variant for the tests."""
    if _broken not in BROKEN:
        raise ValueError(f"paged_decode_attention: _broken must be one of {BROKEN}, got {_broken!r}")
    check_paged_inputs(q, k_pages, v_pages, block_table, seqlens, window)
    if block_s is not None:
        check_block_s(block_s, "paged_decode_attention")
    B, Hq, D = q.shape
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    grid, args, kwargs = _paged_args(q, k_pages, v_pages, block_table.contiguous(), seqlens, out, window=window,
                                     tiles=paged_tiles(Hq // k_pages.shape[1], D, block_s), broken=_broken)
    _paged_decode_kernel[grid](*args, **kwargs)
    return out


def _paged_args(q, k_pages, v_pages, table, seqlens, out, *, window: int | None, tiles: DecodeTiles | None = None,
                broken: str | None = None):
    """(grid, args, kwargs) of one launch of :func:`_paged_decode_kernel` (``table`` contiguous; ``tiles``
    default :func:`paged_tiles`), shared by :func:`paged_decode_attention`, :func:`launch_job` and the
    CUDA-graph runner so the AOT build is the launch."""
    B, Hq, D = q.shape
    Hkv, P = k_pages.shape[1], k_pages.shape[2]
    tiles = tiles or paged_tiles(Hq // Hkv, D)
    args = (q, k_pages, v_pages, table, seqlens, out,
            *q.stride(), *k_pages.stride(), *v_pages.stride(), table.stride(0), *out.stride(),
            D, Hq // Hkv, window or 0, LOG2E / math.sqrt(D))
    kwargs = dict(PAGE=P, BLOCK_S=tiles.block_s, BLOCK_G=tiles.block_g, BLOCK_D=tiles.block_d,
                  DOT_PRECISION=_precision(q.dtype), HAS_WINDOW=window is not None, BROKEN=broken,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return paged_grid(B, Hkv), args, kwargs


# ----------------------------------------------------------------------------------------------
# Compile jobs at real models' sizes: fp16 pages of 16 positions (vLLM's default), batch 32, an 8k
# context per sequence, the tiles a GPU launch picks (decode.gpu_tiles: 64 positions, four pages, at D = 128)

# (label, query heads, K/V heads, head dim, sliding window)
REAL_CONFIGS = (
    ("Llama-3-8B", 32, 8, 128, None),
    ("Llama-2-70B", 64, 8, 128, None),
    ("Mistral-7B-v0.1 (window 4096)", 32, 8, 128, 4096),
)


def launch_job(hq: int, hkv: int, head_dim: int, *, batch: int = 32, context: int = 8192, page_size: int = 16,
               window: int | None = None, tiles: DecodeTiles | None = None, dtype=torch.float16,
               target: str = "sm90"):
    """The job of the GPU launch :func:`paged_decode_attention` makes for ``batch`` sequences of
    ``context`` positions each, on meta tensors: a pool of exactly their pages, an int32 page table
    and int32 lengths. ``tiles`` defaults to a GPU's choice, ``decode.gpu_tiles(group, D)``."""
    from kernels import inspect as ki

    pages = -(-context // page_size)
    q = torch.empty(batch, hq, head_dim, dtype=dtype, device="meta")
    kv = torch.empty(batch * pages, hkv, page_size, head_dim, dtype=dtype, device="meta")
    table = torch.empty(batch, pages, dtype=torch.int32, device="meta")
    lens = torch.empty(batch, dtype=torch.int32, device="meta")
    out = torch.empty(batch, hq, head_dim, dtype=dtype, device="meta")
    grid, args, kwargs = _paged_args(q, kv, kv, table, lens, out, window=window,
                                     tiles=tiles or gpu_tiles(hq // hkv, head_dim))
    return ki.launch_job(_paged_decode_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """At :data:`REAL_CONFIGS` (D=128), batch 32, 8k positions each in 16-position pages: the launch on a GPU."""
    jobs = {}
    for label, hq, hkv, d, window in REAL_CONFIGS:
        tiles = gpu_tiles(hq // hkv, d)
        jobs[f"{label}, group {hq // hkv}, BLOCK_S {tiles.block_s}"] = launch_job(hq, hkv, d, window=window)
    return jobs
