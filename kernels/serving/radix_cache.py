"""A radix tree over token ids whose edges are whole pages of KV cache: prompt prefixes reused across requests.

Every node's edge is a run of tokens whose length is a multiple of ``page_size``, with the page ids
that hold their keys and values; the path from the root spells a token prefix, and the pages along
it are that prefix's KV cache. A new request walks the tree with its prompt: the pages it meets
are its cached prefix (shared, not recomputed). A request inserts its whole computed pages after
its prefill and again when it finishes (kernels.serving.scheduler), so the next one can match them. Only whole pages are cached: the KV of a page is a function of the page's
tokens and of every token before it, which the path fixes.

Reference counts: the tree holds one reference to every page it stores (BlockAllocator.incref);
each running sequence that matched a page holds another. A leaf whose pages nobody else holds
(count 1) is evictable; ``evict`` frees the least recently used such leaves first.

SGLang's RadixAttention is the design (Zheng et al. 2024; sgl-project/sglang@006b0e3d,
python/sglang/srt/mem_cache/radix_cache.py: page-aligned keys, node split on a partial match, LRU
eviction of unlocked leaves); the code here is written fresh, and uses the allocator's counts
where SGLang keeps a separate lock count per node.
"""
from __future__ import annotations

import heapq

from kernels.serving.allocator import BlockAllocator


class Node:
    __slots__ = ("key", "pages", "children", "parent", "last_access")

    def __init__(self, key: tuple, pages: list[int], parent: "Node | None"):
        self.key = key                  # tokens of this edge, len(key) = len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple, Node] = {}   # first page's tokens -> child
        self.parent = parent
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.P = allocator.page_size
        self.root = Node((), [], None)
        self.clock = 0                  # a counter, not wall time: eviction order is deterministic
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.num_cached_pages = 0

    def _tick(self, node: Node) -> None:
        self.clock += 1
        while node is not None:
            node.last_access = self.clock
            node = node.parent

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut node's edge after n_pages pages; returns the new upper node (node becomes its child)."""
        cut = n_pages * self.P
        upper = Node(node.key[:cut], node.pages[:n_pages], node.parent)
        upper.last_access = node.last_access
        node.parent.children[node.key[:self.P]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[node.key[:self.P]] = node
        return upper

    def _walk(self, tokens: tuple) -> tuple[Node, list[int], int]:
        """Deepest node matching whole pages of ``tokens``: (node, pages along the path, tokens matched);
        a match ending inside an edge splits it there."""
        node, pages, i = self.root, [], 0
        while len(tokens) - i >= self.P:
            child = node.children.get(tokens[i:i + self.P])
            if child is None:
                break
            k = 0                                                  # whole pages of the edge that match
            while (k + 1) * self.P <= len(child.key) and i + (k + 1) * self.P <= len(tokens) and \
                    child.key[k * self.P:(k + 1) * self.P] == tokens[i + k * self.P:i + (k + 1) * self.P]:
                k += 1
            if k * self.P < len(child.key):
                child = self._split(child, k)
            node, pages, i = child, pages + child.pages, i + k * self.P
        return node, pages, i

    def match(self, tokens, *, count: bool = True) -> list[int]:
        """Pages of the longest cached whole-page prefix of ``tokens`` (the caller increfs them).
        ``count=False`` leaves the hit statistics alone (the scheduler counts a match only once the
        request is admitted, :meth:`count`)."""
        tokens = tuple(tokens)
        node, pages, matched = self._walk(tokens)
        self._tick(node)
        if count:
            self.count(len(tokens), matched)
        return pages

    def count(self, queried: int, hit: int) -> None:
        """Record a lookup of ``queried`` tokens of which ``hit`` were cached."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def insert(self, tokens, pages: list[int]) -> int:
        """Store ``pages`` (len(tokens) == len(pages) * page_size) under ``tokens``; the tree increfs
        the pages it did not already have. Returns how many tokens were already cached."""
        tokens = tuple(tokens)
        if len(tokens) != len(pages) * self.P:
            raise ValueError(f"insert: {len(tokens)} tokens for {len(pages)} pages of {self.P}")
        node, _, matched = self._walk(tokens)
        if matched < len(tokens):
            new_pages = pages[matched // self.P:]
            self.allocator.incref(new_pages)
            self.num_cached_pages += len(new_pages)
            leaf = Node(tokens[matched:], list(new_pages), node)
            node.children[leaf.key[:self.P]] = leaf
            node = leaf
        self._tick(node)
        return matched

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children and n is not self.root:
                yield n

    def _evictable(self, node: Node) -> bool:
        """A leaf whose pages only the tree holds (count 1): no running sequence reads them."""
        return node is not self.root and not node.children and all(self.allocator.refcount[p] == 1 for p in node.pages)

    def evict(self, n_pages: int) -> int:
        """Free at least ``n_pages`` pages if possible, least recently used leaves first, skipping
        leaves whose pages a running sequence still holds. Returns the pages freed.

        One walk puts the evictable leaves in a min-heap by last access; each pop frees a leaf, and a
        parent that this leaves childless (and unheld) joins the heap: O(leaves + k log leaves) for k
        evictions, where rescanning every leaf per eviction would be O(k * leaves) (SGLang's evict
        keeps the same heap, sgl-project/sglang@006b0e3d, radix_cache.py)."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.decref(leaf.pages)
            freed += len(leaf.pages)
            self.num_cached_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[:self.P]]
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    @property
    def cached_pages(self) -> int:
        """Pages the tree holds (a counter kept by insert and evict)."""
        return self.num_cached_pages

    def clear(self) -> None:
        """Drop every page the tree holds (a sequence still holding one keeps it)."""
        self.evict(self.allocator.num_pages)
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.pages:
                self.allocator.decref(n.pages)
            stack.extend(n.children.values())
        self.root = Node((), [], None)
        self.num_cached_pages = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
