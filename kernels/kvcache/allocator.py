"""Allocating and sharing KV memory: page sizes, copy-on-write forks, hybrid layer groups, shared layers.

Four questions about the memory a paged KV cache is made of, on top of the serving engine's
:class:`kernels.serving.allocator.BlockAllocator` (pages with reference counts, a free list):

* **Page size.** A sequence of L positions holds ceil(L / P) pages of P positions, so it wastes the
  unfilled tail of its last page (internal fragmentation, < P positions); a smaller page wastes less
  but costs a longer block table (one int32 per page), and a kernel whose tile must stay inside one
  page a smaller tile (kernels.attention.paged gathers a tile's rows from several pages instead).
  :func:`page_size_costs` measures the three on a list of lengths; :func:`expected_page_waste` gives
  the waste for a length distribution, such as :func:`request_length_pmf`, the lengths of requests
  whose prompt and output lengths are geometric with given means (a stand-in fitted to published
  means when the trace itself is not at hand).
* **Sharing and copy-on-write.** :class:`PagedSequences` keeps a block table per sequence; ``fork``
  shares every page of a parent (parallel sampling, beam search: Kwon et al. 2023, section 4.4),
  one more reference each; a sequence about to write into a page that another table also holds
  first gets a private copy (copy-on-write), so no write ever lands in a shared page. Page contents
  are kept as token ids, which is what a property test needs to check that every sequence reads
  back what it wrote. ``fork_incref=False`` and ``copy_on_write=False`` are broken on purpose.
* **Hybrid models.** :class:`HybridAllocator` gives each layer group (all layers of one attention
  type) its own block table per sequence over one pool, and a sliding-window group frees the pages
  that fell wholly out of the window, as vLLM V1's hybrid KV cache manager does
  (vllm-project/vllm@129ab7c6, vllm/v1/core/single_type_kv_cache_manager.py:
  SlidingWindowManager.get_num_skipped_tokens and remove_skipped_blocks); :func:`vllm_layer_groups`
  is its grouping of a model's layers into groups of equal size (docs/design/hybrid_kv_cache_manager.md
  at vllm-project/vllm@4652ef5d). The code here is written fresh.
* **Layers that share a cache.** :func:`cache_planes` maps each layer to the cache plane it reads:
  its own, a neighbour's (cross-layer attention, Brandon et al. 2024), or one global plane for all
  the upper half (YOCO, Sun et al. 2024); :func:`kv_bytes_per_token_shared` counts the bytes.

The kernel, :func:`copy_pages`, is the copy that copy-on-write needs, vLLM's ``copy_blocks``
(vllm-project/vllm@693083ae, csrc/cache_kernels.cu: one launch over (layer, pair)): for a list of
(src, dst) page pairs, page src is copied to page dst in the K and the V plane of every layer.
The pool is one tensor

    pool   (planes, 2, num_pages, Hkv, P, D)     plane = a layer's cache (K at [:, 0], V at [:, 1])
    pairs  (n, 2) int64                          (src, dst); every dst distinct and never a src

and the grid is (n pairs, 2 * planes): a program copies one page of one K or V plane in tiles of
BLOCK elements. The plane offset plane * num_pages * Hkv * P * D passes 2**31 elements at real sizes
(Llama 3 70B, 80 layers, 8 K/V heads, D = 128, P = 16: 16384 elements a page, so any pool of more
than 819 pages), so the offsets are 64-bit; ``_wide=False`` multiplies in int32, and ``_whole_page=False``
copies only the first tile of each page: both broken on purpose.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.serving.allocator import BlockAllocator, OutOfPages, fragmentation

__all__ = ["BlockAllocator", "OutOfPages", "PagedSequences", "HybridAllocator", "page_size_costs",
           "request_length_pmf", "expected_page_waste",
           "window_pages_bound", "vllm_layer_groups", "hybrid_kv_bytes", "cache_planes",
           "kv_bytes_per_token_shared", "copy_pages", "copy_pages_ref"]


# ---------------------------------------------------------------- page size

def page_size_costs(lengths, page_sizes, *, kv_bytes_per_token: int, kernel_tile: int,
                    table_entry_bytes: int = 4) -> list[dict]:
    """For each page size P, on sequences of ``lengths``: the wasted fraction of the reserved KV
    (internal fragmentation, 1 - sum L / sum ceil(L/P) P), the block-table bytes per used position
    (``table_entry_bytes`` per page), the table's share of the KV bytes, and the tile of a kernel
    whose tile stays inside one page: it walks min(P, kernel_tile) positions per iteration, so
    ``tile_fill`` = min(P, tile) / tile and ``iterations`` = sum ceil(L / min(P, tile))."""
    lengths = [int(L) for L in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError("page_size_costs: lengths must be a non-empty list of positive ints")
    used = sum(lengths)
    rows = []
    for P in page_sizes:
        if not isinstance(P, int) or P < 1:
            raise ValueError(f"page_size_costs: page sizes must be ints >= 1, got {P!r}")
        f = fragmentation(lengths, P, max(lengths))
        pages = f["paged"] // P
        step = min(P, kernel_tile)
        rows.append({"page": P, "waste": f["waste_paged"], "table_bytes_per_token": pages * table_entry_bytes / used,
                     "table_share": pages * table_entry_bytes / (f["paged"] * kv_bytes_per_token),
                     "tile_fill": step / kernel_tile, "iterations": sum(-(-L // step) for L in lengths)})
    return rows



def request_length_pmf(mean_prompt: float, mean_output: float, *, tail: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths n and probabilities P(L = n) of L = I + O, I and O independent geometric on {1, 2, ...}
    with means ``mean_prompt`` and ``mean_output`` (float64; n from 2 up to where the tail beyond is
    below ``tail``). Given only a mean, the geometric is the largest-entropy distribution on the
    positive integers. With q = 1 - 1/mean and p = 1 - q for each,

        P(L = n) = p_I p_O (q_I^(n-1) - q_O^(n-1)) / (q_I - q_O),   n >= 2   (q_I != q_O)
        P(L = n) = (n - 1) p^2 q^(n-2)                                      (q_I = q_O = q)
    """
    for name, m in (("mean_prompt", mean_prompt), ("mean_output", mean_output)):
        if not m >= 1:
            raise ValueError(f"request_length_pmf: {name} must be a number >= 1, got {m!r}")
    if not 0 < tail < 1e-3:
        raise ValueError(f"request_length_pmf: tail must be in (0, 1e-3), got {tail!r}")
    q_i, q_o = 1 - 1 / mean_prompt, 1 - 1 / mean_output
    q = max(q_i, q_o)
    # L > N needs I > N/2 or O > N/2, each of probability q^(N/2) at most: N = 2 log(tail/2) / log q
    last = 2 if q == 0 else max(2, 2 * math.ceil(math.log(tail / 2) / math.log(q)))
    n = torch.arange(2, last + 1, dtype=torch.float64)                          # (N,)
    if q_i == q_o:
        probs = (n - 1) * (1 - q) ** 2 * q ** (n - 2)
    else:
        probs = (1 - q_i) * (1 - q_o) * (q_i ** (n - 1) - q_o ** (n - 1)) / (q_i - q_o)
    return n.long(), probs


def expected_page_waste(lengths: torch.Tensor, probs: torch.Tensor, page_size: int) -> float:
    """The wasted fraction of the reserved KV for lengths drawn with probabilities ``probs``:
    1 - E[L] / E[P ceil(L / P)], a ratio of expectations, as :func:`page_size_costs` measures on a
    list a ratio of sums (a list of lengths is the distribution that gives each of them weight 1 / count)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"expected_page_waste: page_size must be an int >= 1, got {page_size!r}")
    if lengths.shape != probs.shape or lengths.ndim != 1 or lengths.numel() == 0 or int(lengths.min()) < 1:
        raise ValueError("expected_page_waste: lengths and probs must be matching non-empty 1-D tensors, lengths >= 1")
    L, p = lengths.to(torch.float64), probs.to(torch.float64)
    reserved = page_size * torch.ceil(L / page_size)                            # P ceil(L / P) positions held
    return float(1 - (p * L).sum() / (p * reserved).sum())


# ---------------------------------------------------------------- sharing: fork and copy-on-write

class PagedSequences:
    """Block tables over a :class:`BlockAllocator`, page contents kept as token ids.

    ``pages[p]`` is the content of physical page p (``page_size`` slots, None where nothing was
    written); sequence s reads position i from ``pages[tables[s][i // P]][i % P]``. ``copies`` logs
    every copy-on-write (src, dst), the pairs a step hands to :func:`copy_pages`."""

    def __init__(self, num_pages: int, page_size: int, *, fork_incref: bool = True, copy_on_write: bool = True):
        self.alloc = BlockAllocator(num_pages, page_size)
        self.P = page_size
        self.pages: list[list] = [[None] * page_size for _ in range(num_pages)]
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.copies: list[tuple[int, int]] = []
        self.shared_writes = 0                  # writes that landed in a page another table holds
        self._fork_incref, self._cow = fork_incref, copy_on_write

    def _need(self, sid: int, known: bool = True) -> None:
        if (sid in self.tables) != known:
            raise KeyError(f"sequence {sid} {'does not exist' if known else 'already exists'}")

    def add(self, sid: int, tokens) -> None:
        """A new sequence holding ``tokens`` (its prompt): ceil(len / P) fresh pages."""
        self._need(sid, known=False)
        tokens = list(tokens)
        table = self.alloc.allocate(self.alloc.pages_for(len(tokens)))
        self.tables[sid], self.lengths[sid] = table, 0
        for t in tokens:
            self._write(sid, t)

    def _write(self, sid: int, token) -> tuple[int, int]:
        """Token into the next slot of ``sid`` (its page already in the table); returns (page, offset)."""
        i = self.lengths[sid]
        page, off = self.tables[sid][i // self.P], i % self.P
        if self.alloc.refcount[page] > 1:
            self.shared_writes += 1
        self.pages[page][off] = token
        self.lengths[sid] = i + 1
        return page, off

    def append(self, sid: int, token) -> tuple[int, int]:
        """One more token (a decode step): a fresh page when the last one is full; a private copy
        first when the last page is partly filled and shared (copy-on-write). Returns the slot."""
        self._need(sid)
        table, n = self.tables[sid], self.lengths[sid]
        if n == len(table) * self.P:
            table += self.alloc.allocate(1)
        elif self._cow and self.alloc.refcount[table[-1]] > 1:
            src, dst = table[-1], self.alloc.allocate(1)[0]
            self.pages[dst] = list(self.pages[src])
            self.copies.append((src, dst))
            self.alloc.decref([src])
            table[-1] = dst
        return self._write(sid, token)

    def fork(self, parent: int, child: int) -> None:
        """``child`` shares every page of ``parent`` (one more reference each), and its length."""
        self._need(parent)
        self._need(child, known=False)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]
        if self._fork_incref:
            self.alloc.incref(self.tables[child])

    def free(self, sid: int) -> None:
        self._need(sid)
        self.alloc.decref(self.tables.pop(sid))
        del self.lengths[sid]

    def read(self, sid: int) -> list:
        """The sequence's tokens, read through its block table."""
        self._need(sid)
        return [self.pages[self.tables[sid][i // self.P]][i % self.P] for i in range(self.lengths[sid])]

    def holders(self) -> list[int]:
        """holders[p]: how many block-table entries name page p."""
        h = [0] * self.alloc.num_pages
        for table in self.tables.values():
            for p in table:
                h[p] += 1
        return h

    def check(self) -> None:
        """Every page is free (count 0, on the free list) or held with count = its table entries."""
        self.alloc.check()
        h = self.holders()
        bad = [p for p, c in enumerate(self.alloc.refcount) if c != h[p]]
        if bad:
            raise AssertionError(f"PagedSequences: pages {bad[:5]} have counts {[self.alloc.refcount[p] for p in bad[:5]]} "
                                 f"but {[h[p] for p in bad[:5]]} table entries")
        if self.alloc.num_free + self.alloc.num_used != self.alloc.num_pages:
            raise AssertionError("PagedSequences: free + used != total")


# ---------------------------------------------------------------- hybrid models: layer groups, windows

def window_pages_bound(window: int, page_size: int) -> int:
    """Most pages a window group holds for one sequence: the next query needs the window - 1
    positions before it, which span at most ceil((window - 1) / P) + 1 pages."""
    return -(-(window - 1) // page_size) + 1


class HybridAllocator:
    """One pool of pages; a block table per (sequence, layer group). ``windows[g]`` is None for a
    full-attention group, or the sliding window W of group g: after L positions are computed, the
    next query sees positions L - W + 1 .. L, so the pages wholly before L - W + 1 are freed and
    their entries become None (vLLM's null block), keeping the table's logical indexing.
    ``free_window_pages=False`` keeps them (a hybrid model served by a full-attention allocator)."""

    def __init__(self, num_pages: int, page_size: int, windows, *, free_window_pages: bool = True):
        windows = list(windows)
        if not windows or any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"HybridAllocator: windows must be a non-empty list of None or ints >= 1, got {windows!r}")
        self.alloc = BlockAllocator(num_pages, page_size)
        self.P, self.windows, self._free_window = page_size, windows, free_window_pages
        self.tables: dict[int, list[list[int | None]]] = {}
        self.lengths: dict[int, int] = {}

    def add(self, sid: int, length: int = 0) -> None:
        if sid in self.tables:
            raise KeyError(f"sequence {sid} already exists")
        self.tables[sid], self.lengths[sid] = [[] for _ in self.windows], 0
        self.extend(sid, length)

    def extend(self, sid: int, n: int = 1) -> None:
        """n more computed positions: pages for them in every group, then each window group frees
        the pages that no later query can see. Nothing changes if the pool runs out."""
        L = self.lengths[sid] + n
        need = [max(0, self.alloc.pages_for(L) - len(t)) for t in self.tables[sid]]
        if sum(need) > self.alloc.num_free:
            raise OutOfPages(f"HybridAllocator.extend: {sum(need)} pages asked, {self.alloc.num_free} free")
        for table, k in zip(self.tables[sid], need):
            table += self.alloc.allocate(k)
        self.lengths[sid] = L
        if self._free_window:
            for table, w in zip(self.tables[sid], self.windows):
                if w is not None:
                    self._drop_before(table, max(0, L - w + 1) // self.P)

    def _drop_before(self, table: list, n_pages: int) -> None:
        for i in range(n_pages - 1, -1, -1):            # from the newest skipped page back
            if table[i] is None:
                break                                   # the earlier ones were freed before
            self.alloc.decref([table[i]])
            table[i] = None

    def held(self, sid: int, group: int) -> int:
        return sum(p is not None for p in self.tables[sid][group])

    def free(self, sid: int) -> None:
        for table in self.tables.pop(sid):
            self.alloc.decref([p for p in table if p is not None])
        del self.lengths[sid]

    def check(self) -> None:
        self.alloc.check()
        h = [0] * self.alloc.num_pages
        for tables in self.tables.values():
            for table in tables:
                for p in table:
                    if p is not None:
                        h[p] += 1
        if h != self.alloc.refcount:
            raise AssertionError("HybridAllocator: reference counts and table entries disagree")
        for sid, tables in self.tables.items():
            for table, w in zip(tables, self.windows):
                if w is not None and self._free_window and sum(p is not None for p in table) > window_pages_bound(w, self.P):
                    raise AssertionError(f"HybridAllocator: sequence {sid} holds more than the window's pages")


def vllm_layer_groups(layer_types) -> list[tuple[str, int]]:
    """vLLM's grouping of a hybrid model's layers (hybrid_kv_cache_manager.md, 'Case 3'): every group
    has the same number of layer slots, the smallest layer count among the attention types; each type
    fills ceil(count / size) groups, the last one padded. Returns (type, real layers) per group."""
    counts: dict[str, int] = {}
    for t in layer_types:
        counts[t] = counts.get(t, 0) + 1
    size = min(counts.values())
    groups = []
    for t, c in counts.items():
        groups += [(t, min(size, c - i * size)) for i in range(-(-c // size))]
    return groups


def hybrid_kv_bytes(n_tokens: int, layer_types, *, window: int, page_size: int, layer_bytes_per_token: int,
                    grouped: bool = False) -> int:
    """KV bytes one sequence of ``n_tokens`` computed positions holds when its window layers
    ("sliding") keep only the pages a window allocator keeps and its "full" layers keep everything.
    ``grouped``: as vLLM lays it out, every group as wide as the largest (padding layers cost memory)."""
    full_pages = -(-n_tokens // page_size)
    win_pages = full_pages - max(0, n_tokens - window + 1) // page_size
    pages = {"full": full_pages, "sliding": win_pages}
    if grouped:
        groups = vllm_layer_groups(layer_types)
        size = max(n for _, n in groups)
        slots = sum(pages[t] * size for t, _ in groups)
    else:
        slots = sum(pages[t] for t in layer_types)
    return slots * page_size * layer_bytes_per_token


# ---------------------------------------------------------------- layers that share a cache

SHARING = ("none", "cla", "yoco")


def cache_planes(num_layers: int, scheme: str = "none", share: int = 2) -> list[int]:
    """plane[l]: the cache plane layer l reads. "none": its own. "cla": cross-layer attention with
    sharing factor ``share``, the first layer of every run of ``share`` computes K/V and the others
    reuse it (Brandon et al. 2024, CLA2 for share=2). "yoco": the lower half (the self-decoder)
    keeps its own planes (in YOCO, efficient attention of constant memory), and every layer of the
    upper half (the cross-decoder) reads one global plane, written once (Sun et al. 2024)."""
    if scheme not in SHARING:
        raise ValueError(f"cache_planes: scheme must be one of {SHARING}, got {scheme!r}")
    if num_layers < 1 or (scheme == "cla" and share < 1) or (scheme == "yoco" and num_layers < 2):
        raise ValueError(f"cache_planes: bad num_layers={num_layers} or share={share} for {scheme!r}")
    if scheme == "none":
        return list(range(num_layers))
    if scheme == "cla":
        return [l // share for l in range(num_layers)]
    half = num_layers // 2
    return list(range(half)) + [half] * (num_layers - half)


def kv_bytes_per_token_shared(num_layers: int, kv_heads: int, head_dim: int, scheme: str = "none", *,
                              share: int = 2, bytes_per_element: int = 2, self_decoder_grows: bool = False) -> int:
    """KV bytes each new token adds: 2 * planes * Hkv * D * bytes over the planes that grow with the
    context. YOCO's self-decoder planes hold a constant window (or a recurrent state) in the paper, so
    they add nothing per token unless ``self_decoder_grows`` (a full-attention self-decoder)."""
    planes = cache_planes(num_layers, scheme, share)
    growing = set(planes)
    if scheme == "yoco" and not self_decoder_grows:
        growing = {planes[-1]}
    return 2 * len(growing) * kv_heads * head_dim * bytes_per_element


# ---------------------------------------------------------------- the kernel: copy pages in every plane

def copy_pages_ref(pool: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """A copy of ``pool`` with page dst := page src in every plane, K and V, for each (src, dst)."""
    out = pool.clone()
    pairs = pairs.long()
    out[:, :, pairs[:, 1]] = pool[:, :, pairs[:, 0]]
    return out


@triton.jit
def _copy_pages_kernel(pool_ptr, pairs_ptr, stride_plane, page_elems,
                       BLOCK: tl.constexpr, WIDE: tl.constexpr, WHOLE_PAGE: tl.constexpr):
    """Program (pair, plane): page src -> page dst in one K or V plane (plane = 2 * layer + {0: K, 1: V})."""
    pair = tl.program_id(0)
    plane = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * pair)                            # int64 page ids
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    if WIDE:
        plane_off = plane.to(tl.int64) * stride_plane              # passes 2**31 at real sizes
    else:
        plane_off = plane * stride_plane                           # broken on purpose: int32 products
        src = src.to(tl.int32)
        dst = dst.to(tl.int32)
    src_base = pool_ptr + plane_off + src * page_elems
    dst_base = pool_ptr + plane_off + dst * page_elems
    offs = tl.arange(0, BLOCK)
    n_tiles = tl.cdiv(page_elems, BLOCK) if WHOLE_PAGE else 1      # broken: only the first tile
    for t in range(0, n_tiles):
        o = t * BLOCK + offs
        ok = o < page_elems
        tl.store(dst_base + o, tl.load(src_base + o, mask=ok), mask=ok)


def check_copy_inputs(pool: torch.Tensor, pairs: torch.Tensor, name: str = "copy_pages") -> None:
    if not isinstance(pool, torch.Tensor) or pool.dim() != 6 or pool.shape[1] != 2:
        raise ValueError(f"{name}: pool must be (planes, 2, num_pages, Hkv, P, D), got "
                         f"{tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool)}")
    if not pool.is_contiguous():
        raise ValueError(f"{name}: pool must be contiguous (pages are copied as flat runs of elements)")
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: pairs must be (n, 2) int32/int64, got {tuple(pairs.shape)} {pairs.dtype}")
    if pairs.device != pool.device:
        raise ValueError(f"{name}: pairs on {pairs.device}, pool on {pool.device}")
    if pairs.numel() == 0:
        return
    N = pool.shape[2]
    if int(pairs.min()) < 0 or int(pairs.max()) >= N:
        raise ValueError(f"{name}: page ids must lie in [0, num_pages={N}), got [{int(pairs.min())}, {int(pairs.max())}]")
    src, dst = pairs[:, 0].tolist(), pairs[:, 1].tolist()
    if len(set(dst)) != len(dst) or set(src) & set(dst):
        raise ValueError(f"{name}: every destination must be distinct and never a source (programs run "
                         f"in any order), got pairs {list(zip(src, dst))}")


def _copy_args(pool, pairs, *, block: int, wide: bool = True, whole_page: bool = True):
    planes, _, N = pool.shape[:3]
    page_elems = pool[0, 0, 0].numel()
    grid = (pairs.shape[0], 2 * planes)
    args = (pool, pairs, N * page_elems, page_elems)
    kwargs = dict(BLOCK=block, WIDE=wide, WHOLE_PAGE=whole_page, num_warps=4)
    return grid, args, kwargs


def copy_pages(pool: torch.Tensor, pairs, *, block: int = 1024, _wide: bool = True,
               _whole_page: bool = True) -> torch.Tensor:
    """In place: page dst := page src in every K and V plane of ``pool`` for each (src, dst) of
    ``pairs`` ((n, 2) or a list of tuples). One launch. Returns ``pool``."""
    if not isinstance(pairs, torch.Tensor):
        pairs = torch.tensor(list(pairs), dtype=torch.int64, device=pool.device).reshape(-1, 2)
    check_copy_inputs(pool, pairs)
    if block < 16 or block & (block - 1):
        raise ValueError(f"copy_pages: block must be a power of two >= 16, got {block!r}")
    if pairs.shape[0] == 0:
        return pool
    grid, args, kwargs = _copy_args(pool, pairs.to(torch.int64).contiguous(), block=block, wide=_wide,
                                    whole_page=_whole_page)
    _copy_pages_kernel[grid](*args, **kwargs)
    return pool


REAL_CONFIGS = [("Llama-3-70B", 80, 8, 128, 16)]       # (label, layers, K/V heads, head dim, page size)


def launch_job(layers: int, kv_heads: int, head_dim: int, page_size: int, *, num_pages: int = 4096,
               n_pairs: int = 64, block: int = 1024, dtype=torch.bfloat16, target: str = "sm90", wide: bool = True):
    """The GPU launch of :func:`copy_pages` on meta tensors: a pool of ``num_pages`` pages of every
    layer, ``n_pairs`` copy-on-write pairs (a step that forks a few sequences at a time)."""
    from kernels import inspect as ki

    pool = torch.empty(layers, 2, num_pages, kv_heads, page_size, head_dim, dtype=dtype, device="meta")
    pairs = torch.empty(n_pairs, 2, dtype=torch.int64, device="meta")
    grid, args, kwargs = _copy_args(pool, pairs, block=block, wide=wide)
    return ki.launch_job(_copy_pages_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama 3 70B (80 layers, 8 K/V heads, D = 128) in bf16 pages of 16 positions, 4096 pages, the
    launcher's tile of 1024 elements (8 per thread at 4 warps: 16-byte accesses in bf16)."""
    return {f"{label}, page {page}, BLOCK 1024": launch_job(layers, hkv, d, page)
            for label, layers, hkv, d, page in REAL_CONFIGS}
