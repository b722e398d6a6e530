"""A block allocator for a paged KV cache: fixed-size pages, reference counts, a page table per sequence.

The KV cache of every layer is one pool of ``num_pages`` pages of ``page_size`` positions:
    k_pages[layer], v_pages[layer]   (num_pages, Hkv, page_size, D)
A sequence owns a list of page ids, its page table: position p of the sequence lives in page
``table[p // page_size]`` at offset ``p % page_size``. Pages are handed out in any order, so a
sequence needs ceil(L / page_size) pages whatever the other sequences do, and the only memory it
wastes is the unfilled tail of its last page (< page_size positions).

A page may be shared (a cached prompt prefix read by several sequences, kernels.serving.radix_cache):
it carries a reference count, and returns to the free list when the count reaches zero.
The design follows vLLM's block pool (vllm-project/vllm@002f3491, vllm/v1/core/block_pool.py:
a free queue of blocks, ref_cnt per block); the code here is written fresh.
"""
from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class BlockAllocator:
    """``num_pages`` pages with reference counts. ``allocate(n)`` -> n page ids (count 1 each),
    ``incref(pages)`` shares them, ``decref(pages)`` releases; a page is free iff its count is 0."""

    def __init__(self, num_pages: int, page_size: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"BlockAllocator: num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"BlockAllocator: page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.free = deque(range(num_pages))          # FIFO: a freed page is reused last

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, n_positions: int) -> int:
        """ceil(n_positions / page_size): pages a sequence of that length needs."""
        return -(-n_positions // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfPages(f"allocate: {n} pages asked, {len(self.free)} free of {self.num_pages}")
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise ValueError(f"incref: page {p} is free; only a held page can be shared")
            self.refcount[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            if self.refcount[p] < 1:
                raise ValueError(f"decref: page {p} is already free (double free)")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free.append(p)

    def check(self) -> None:
        """Invariant: the free list holds exactly the pages with count 0, once each."""
        zero = {p for p, c in enumerate(self.refcount) if c == 0}
        if len(self.free) != len(set(self.free)) or set(self.free) != zero:
            raise AssertionError("BlockAllocator: free list and reference counts disagree")


def slot_mapping(table: list[int], positions, page_size: int) -> list[int]:
    """Flat slot of each position: page * page_size + offset (the index a KV write goes to)."""
    return [table[p // page_size] * page_size + p % page_size for p in positions]


def fragmentation(lengths, page_size: int, max_len: int) -> dict[str, float]:
    """KV positions reserved vs used for sequences of ``lengths``.

    contiguous: every sequence reserves max_len positions (a static per-request buffer);
    paged: ceil(L / page_size) * page_size. Returns the positions used, reserved by each scheme,
    and the wasted fraction 1 - used / reserved.
    """
    lengths = [int(L) for L in lengths]
    used = sum(lengths)
    contiguous = max_len * len(lengths)
    paged = sum(-(-L // page_size) * page_size for L in lengths)
    return {"used": used, "contiguous": contiguous, "paged": paged,
            "waste_contiguous": 1 - used / contiguous, "waste_paged": 1 - used / paged}
