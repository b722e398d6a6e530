"""kernels.serving.radix_cache: whole-page prefix matching, node splits, reference counts, LRU eviction."""
import pytest

from kernels.serving.allocator import BlockAllocator
from kernels.serving.radix_cache import RadixCache


def _seq(alloc, cache, tokens):
    """A finished sequence: pages for its whole pages of tokens, inserted, then released by the sequence."""
    n = len(tokens) // alloc.page_size
    pages = alloc.allocate(n)
    cache.insert(tokens[:n * alloc.page_size], pages)
    alloc.decref(pages)
    return pages


def test_match_whole_pages_and_split():
    alloc = BlockAllocator(16, 2)
    cache = RadixCache(alloc)
    a = _seq(alloc, cache, [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == a
    assert cache.match([1, 2, 3, 9]) == a[:1]                    # partial page not matched; edge split
    assert cache.match([1, 3]) == [] and cache.match([1]) == []
    b = _seq(alloc, cache, [1, 2, 3, 4, 8, 8])                  # shares two pages, adds one
    assert cache.match([1, 2, 3, 4, 8, 8]) == a[:2] + [b[2]]
    assert cache.cached_pages == 4 and alloc.num_used == 4     # b's duplicate pages went back
    alloc.check()


def test_refcounts_protect_pages_in_use():
    alloc = BlockAllocator(4, 2)
    cache = RadixCache(alloc)
    a = _seq(alloc, cache, [1, 2, 3, 4])
    held = cache.match([1, 2, 3, 4, 5])
    alloc.incref(held)                                          # a running sequence holds them
    assert cache.evict(4) == 0
    alloc.decref(held)
    assert cache.evict(4) == 2 and alloc.num_used == 0 and a == held


def test_lru_evicts_the_oldest_leaf():
    alloc = BlockAllocator(6, 2)
    cache = RadixCache(alloc)
    _seq(alloc, cache, [1, 1, 2, 2])
    _seq(alloc, cache, [3, 3, 4, 4])
    cache.match([1, 1, 2, 2])                                   # the first becomes the most recent
    cache.evict(1)
    assert cache.match([3, 3]) == [] and len(cache.match([1, 1, 2, 2])) == 2


def test_hit_rate_and_clear():
    alloc = BlockAllocator(8, 2)
    cache = RadixCache(alloc)
    _seq(alloc, cache, [1, 2, 3, 4])
    cache.match([1, 2, 3, 4, 5, 6])                             # 4 of 6 tokens hit
    assert cache.hit_tokens == 4 and cache.queried_tokens == 6
    cache.clear()
    assert alloc.num_used == 0 and cache.cached_pages == 0


def test_insert_checks_lengths():
    cache = RadixCache(BlockAllocator(4, 2))
    with pytest.raises(ValueError, match="3 tokens for 1 pages"):
        cache.insert([1, 2, 3], [0])
