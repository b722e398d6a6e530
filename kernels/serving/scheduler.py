"""Iteration-level scheduling: continuous batching, chunked prefill under a token budget, preemption.

Every engine step runs one forward over a *mixed* batch: for each scheduled sequence a run of its
tokens whose KV is not yet computed (a whole prompt, a chunk of one, or the single token sampled
last step). The scheduler picks those runs each step (Orca's iteration-level scheduling, Yu et al.
2022), so a sequence that finishes leaves the batch at once and a waiting one joins the next step.

One step, under a budget of ``max_tokens`` tokens and ``max_seqs`` sequences (the order of vLLM's
v1 scheduler, vllm-project/vllm@b4622cf9, vllm/v1/core/sched/scheduler.py; written fresh here):

1. running sequences first, oldest first: each gets min(its uncomputed tokens, ``chunk``, budget
   left) tokens, usually 1 (a decode); pages for them are allocated now. When no page is free the
   prefix cache gives back unused pages, then the newest running sequence is *preempted by
   recompute*: its pages are freed, its computed count reset to 0, and it goes to the front of the
   waiting queue with its prompt and the tokens it generated, to be prefilled again later;
2. then waiting sequences in arrival order (``order="lpm"``: longest cached prefix first, SGLang's
   longest-prefix-match policy) while budget, seats and pages last: a cached prefix is
   taken from the radix cache (its pages shared, not recomputed), the rest is prefilled in chunks of
   at most ``chunk`` tokens (chunked prefill: a long prompt no longer stalls the decodes for a step).

Pages of a cached prefix are *held* (a reference taken) only while the request's own pages are
being found, so that the eviction this may trigger cannot free them; if the pages cannot be found,
the request gives the prefix back before it waits. A waiting request therefore never holds a page,
and the oldest running one always progresses: nothing can wait forever on pages another waiting
request keeps (tests/test_scheduler.py drives random workloads to that end).

Copy-on-write. ``fork`` makes sequences that share every page of a parent (parallel sampling, n > 1:
vLLM's fork, Kwon et al. 2023 section 4.4). A page shared by several sequences is only ever read:
before a sequence writes a position into a page whose count is above 1, ``_grow`` gives it a fresh
page and records (source, destination) in ``copies``, which the engine copies before the step's
forward. Only the partly filled last page of a prompt is ever copied; whole pages stay shared.

Prefix caching. After a prefill run the whole pages computed so far go into the radix cache
(``cache_after_prefill``, SGLang's cache_unfinished_req), so a request that arrives while another
with the same system prompt is still running finds it; at the end every whole computed page goes
in. A page the tree already holds under the same tokens replaces the sequence's duplicate, which
is freed.

A run whose last token is the sequence's last known token is *sampled*: the forward returns that
position's logits and the sequence grows by one token.

Speculative decoding (the engine's ``speculative`` option). Before a step the engine may give a
decoding sequence a ``draft`` of proposed tokens; the scheduler then appends as many of them as the
token budget allows to the sequence's one-token run and reserves their KV slots like a prefill
chunk's (``Work.draft`` counts them, and the forward returns ``draft + 1`` logits rows for the run).
After verification the engine calls :meth:`Scheduler.rollback`: the rejected drafts' positions are
forgotten (``num_computed`` goes back) and the pages past the kept positions are released. Drafts
are scheduled after every running sequence's own run, from the budget and pages left: they never
cause a preemption.

``policy="static"`` is the baseline that admits a new batch only when the previous one has finished
entirely.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kernels.serving.allocator import BlockAllocator


@dataclass(eq=False)
class Sequence:
    """One sequence of tokens the engine extends: a request, or one of its forked choices (n > 1)."""
    id: int
    prompt: list[int]
    max_new_tokens: int
    params: object = None                                # kernels.serving.sampling.SamplingParams
    seed: int = 0                                        # the request's sampling seed
    tokens: list[int] = field(default_factory=list)     # prompt + generated so far
    num_computed: int = 0                                # positions whose K, V are in the cache
    table: list[int] = field(default_factory=list)       # page table
    cached_tokens: int = 0                               # prompt tokens taken from the prefix cache
    preemptions: int = 0
    finished: bool = False
    finish_reason: str | None = None                     # "length", "stop", "abort" or "error"
    choice: int = 0                                      # index among a request's n choices
    group: int = -1                                      # id of the request's first sequence
    forks: int = 0                                       # choices still to fork at the first sample
    children: list["Sequence"] = field(default_factory=list)
    logprobs: list = field(default_factory=list)         # per generated token, when asked
    draft: list[int] = field(default_factory=list)       # proposed tokens to verify next step (speculative)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.group < 0:
            self.group = self.id

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def seats(self) -> int:
        """Batch seats the sequence needs: itself and the choices it will fork."""
        return 1 + self.forks


@dataclass(frozen=True)
class Work:
    """One sequence's part of a step: ``tokens`` at positions start .. start + len - 1."""
    seq: Sequence
    start: int
    tokens: list[int]
    sample: bool                                        # return logits of the last position
    draft: int = 0                                      # the last ``draft`` tokens are proposals to verify:
                                                        # logits of the last draft + 1 positions returned


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, max_tokens: int = 256, max_seqs: int = 64,
                 chunk: int | None = None, prefix_cache=None, policy: str = "continuous",
                 cache_after_prefill: bool = True, order: str = "fcfs"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"Scheduler: policy must be 'continuous' or 'static', got {policy!r}")
        if order not in ("fcfs", "lpm"):
            raise ValueError(f"Scheduler: order must be 'fcfs' or 'lpm', got {order!r}")
        if order == "lpm" and prefix_cache is None:
            raise ValueError("Scheduler: order='lpm' ranks requests by their cached prefix: it needs a prefix_cache")
        if max_tokens < 1 or max_seqs < 1 or (chunk is not None and chunk < 1):
            raise ValueError("Scheduler: max_tokens, max_seqs and chunk must be >= 1")
        self.allocator = allocator
        self.P = allocator.page_size
        self.max_tokens, self.max_seqs, self.chunk = max_tokens, max_seqs, chunk
        self.cache = prefix_cache
        self.cache_after_prefill = cache_after_prefill
        self.policy, self.order = policy, order
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.copies: list[tuple[int, int]] = []         # this step's copy-on-write (source, destination) pages
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- pages

    def _grow(self, seq: Sequence, n_positions: int) -> bool:
        """Make positions num_computed .. n_positions - 1 of ``seq`` writable: new pages past its table,
        and a private copy of every page it shares among those it will write. False if the pages
        cannot be found (nothing changes then)."""
        pages = self.allocator.pages_for(n_positions)
        first = seq.num_computed // self.P                           # first logical page written
        shared = [i for i in range(first, min(pages, len(seq.table))) if self.allocator.refcount[seq.table[i]] > 1]
        need = max(0, pages - len(seq.table)) + len(shared)
        if need == 0:
            return True
        if need > self.allocator.num_free and self.cache is not None:
            self.cache.evict(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            return False
        fresh = self.allocator.allocate(need)
        for i in shared:                                             # copy-on-write
            dst = fresh.pop()
            self.copies.append((seq.table[i], dst))
            self.allocator.decref([seq.table[i]])
            seq.table[i] = dst
        seq.table += fresh
        return True

    def release(self, seq: Sequence) -> None:
        """Give back every page ``seq`` holds (shared pages: one reference)."""
        if self.copies:                                              # a copy into a page it gives back is moot
            mine = set(seq.table)
            self.copies = [(s, d) for s, d in self.copies if d not in mine]
        self.allocator.decref(seq.table)
        seq.table = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed, seq.cached_tokens = 0, 0
        seq.draft = []
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _order_waiting(self) -> None:
        """With ``order="lpm"``, sort the waiting queue by the length of each request's cached prefix,
        longest first, ties in queue order (sorted is stable). As in SGLang's LPM policy
        (sgl-project/sglang@ad0119f, managers/schedule_policy.py) the lookup also refreshes the matched
        nodes' LRU time, so a prefix that waiting requests want is evicted last."""
        if self.order != "lpm" or len(self.waiting) < 2:
            return
        hit = {s.id: len(self.cache.match(s.tokens[:-1], count=False)) for s in self.waiting}   # pages
        self.waiting = deque(sorted(self.waiting, key=lambda s: -hit[s.id]))

    def _chunk(self, remaining: int, budget: int) -> int:
        return min(remaining, budget, self.chunk or remaining)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Tokens of waiting ``seq`` scheduled now (0: its pages cannot be found; it holds none)."""
        matched = []
        if self.cache is not None and seq.num_computed == 0:
            matched = self.cache.match(seq.tokens[:-1], count=False)   # the last token must be computed: its logits
            self.allocator.incref(matched)                              # held, so evict() cannot take them
            seq.table = list(matched)
            seq.num_computed = seq.cached_tokens = len(matched) * self.P
        n = self._chunk(len(seq.tokens) - seq.num_computed, budget)
        if not self._grow(seq, seq.num_computed + n):
            self.release(seq)                                           # give the prefix back while waiting
            seq.num_computed = seq.cached_tokens = 0
            return 0
        if self.cache is not None:
            self.cache.count(len(seq.tokens) - 1, seq.cached_tokens)
        return n

    # ---------------------------------------------------------------- one step

    def schedule(self) -> list[Work]:
        budget = self.max_tokens
        self.copies = []
        plan: list[tuple[Sequence, int]] = []
        drafted: dict[int, int] = {}                         # seq id -> draft tokens in its run
        for seq in list(self.running):                       # 1. running, oldest first
            if seq not in self.running:                      # preempted below to make room
                continue
            n = self._chunk(len(seq.tokens) - seq.num_computed, budget)
            if n == 0:
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]                    # the newest running sequence
                self._preempt(victim)
                budget += sum(k for s, k in plan if s is victim)     # its tokens leave this step
                plan = [(s, k) for s, k in plan if s is not victim]
                if victim is seq:
                    break
            if seq in self.running:
                plan.append((seq, n))
                budget -= n
        for i, (seq, n) in enumerate(plan):                  # 1b. drafts, from what is left: no preemption
            extra = min(len(seq.draft), budget) if n == 1 == len(seq.tokens) - seq.num_computed else 0
            if extra and self._grow(seq, seq.num_computed + n + extra):
                plan[i] = (seq, n + extra)
                drafted[seq.id] = extra
                budget -= extra
        admit = self.policy == "continuous" or not self.running
        if admit:
            self._order_waiting()
        while admit and self.waiting and budget > 0:         # 2. waiting, in arrival (or LPM) order
            seq = self.waiting[0]
            if sum(s.seats for s in self.running) + seq.seats > self.max_seqs:
                break
            n = self._admit(seq, budget)
            if n == 0:
                break                                        # no pages: wait for running ones to finish
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        works = []
        for s, n in plan:
            d = drafted.get(s.id, 0)
            run = (s.tokens + s.draft[:d])[s.num_computed:s.num_computed + n]
            works.append(Work(s, s.num_computed, run, s.num_computed + n - d == len(s.tokens), d))
        return works

    def computed(self, work: Work) -> None:
        """The forward has written ``work``'s K, V: advance the sequence, and after a prefill run put
        its whole computed pages into the prefix cache (``cache_after_prefill``)."""
        seq = work.seq
        seq.num_computed = work.start + len(work.tokens)
        if self.cache is not None and self.cache_after_prefill and len(work.tokens) > 1:
            self._cache_pages(seq)

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Speculative decoding: only the first ``num_computed`` positions of ``seq`` hold keys and values
        of its tokens (the rejected drafts' slots are forgotten, to be overwritten); the pages past them
        go back. Never used with the prefix cache or forks (the engine refuses them), so no page here
        is shared."""
        if not 0 <= num_computed <= seq.num_computed:
            raise ValueError(f"rollback: num_computed must lie in [0, {seq.num_computed}], got {num_computed}")
        seq.num_computed = num_computed
        keep = self.allocator.pages_for(num_computed)
        self.allocator.decref(seq.table[keep:])
        del seq.table[keep:]

    def _cache_pages(self, seq: Sequence) -> None:
        """Insert the whole computed pages of ``seq``; where the tree already had pages for the same
        tokens, the sequence switches to them and frees its duplicates."""
        full = seq.num_computed // self.P
        if full == 0:
            return
        tokens = seq.tokens[:full * self.P]
        self.cache.insert(tokens, seq.table[:full])
        tree = self.cache.match(tokens, count=False)
        for i, page in enumerate(tree):
            if seq.table[i] != page:
                self.allocator.incref([page])
                self.allocator.decref([seq.table[i]])
                seq.table[i] = page

    def fork(self, parent: Sequence, ids: list[int]) -> list[Sequence]:
        """New running sequences that share every page of ``parent`` (one reference each) and its
        tokens so far; their next writes into a shared page copy it first (see ``_grow``)."""
        children = []
        for k, cid in enumerate(ids, start=parent.choice + 1):
            child = Sequence(cid, parent.prompt, parent.max_new_tokens, params=parent.params, seed=parent.seed,
                             tokens=list(parent.tokens), num_computed=parent.num_computed,
                             table=list(parent.table), cached_tokens=parent.cached_tokens,
                             choice=k, group=parent.group)
            self.allocator.incref(child.table)
            children.append(child)
        parent.forks = 0
        parent.children += children
        self.running += children
        return children

    def finish(self, seq: Sequence, reason: str = "length") -> None:
        """A sequence is done: its whole computed pages go to the prefix cache, its pages are released."""
        if seq.finished:
            return
        seq.finished, seq.finish_reason = True, reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.cache is not None and seq.table and reason not in ("abort", "error"):
            self._cache_pages(seq)
        self.release(seq)
