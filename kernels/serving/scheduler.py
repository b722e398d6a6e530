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
2. then waiting sequences in arrival order while budget and pages last: a cached prefix is taken
   from the radix cache (its pages shared, not recomputed), the rest is prefilled in chunks of at
   most ``chunk`` tokens (chunked prefill: a long prompt no longer stalls the decodes for a step).

A run whose last token is the sequence's last known token is *sampled*: the forward returns that
position's logits and the sequence grows by one token. ``policy="static"`` is the baseline that
admits a new batch only when the previous one has finished entirely.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kernels.serving.allocator import BlockAllocator


@dataclass
class Sequence:
    id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)     # prompt + generated so far
    num_computed: int = 0                                # positions whose K, V are in the cache
    table: list[int] = field(default_factory=list)       # page table
    cached_tokens: int = 0                               # prompt tokens taken from the prefix cache
    preemptions: int = 0
    finished: bool = False

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclass(frozen=True)
class Work:
    """One sequence's part of a step: ``tokens`` at positions start .. start + len - 1."""
    seq: Sequence
    start: int
    tokens: list[int]
    sample: bool                                        # return logits of the last position


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, max_tokens: int = 256, max_seqs: int = 64,
                 chunk: int | None = None, prefix_cache=None, policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"Scheduler: policy must be 'continuous' or 'static', got {policy!r}")
        if max_tokens < 1 or max_seqs < 1 or (chunk is not None and chunk < 1):
            raise ValueError("Scheduler: max_tokens, max_seqs and chunk must be >= 1")
        self.allocator = allocator
        self.max_tokens, self.max_seqs, self.chunk = max_tokens, max_seqs, chunk
        self.cache = prefix_cache
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- pages

    def _grow(self, seq: Sequence, n_positions: int) -> bool:
        """Give ``seq`` pages for its first n_positions positions; False if they cannot be found."""
        need = self.allocator.pages_for(n_positions) - len(seq.table)
        if need <= 0:
            return True
        if need > self.allocator.num_free and self.cache is not None:
            self.cache.evict(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            return False
        seq.table += self.allocator.allocate(need)
        return True

    def release(self, seq: Sequence) -> None:
        """Give back every page ``seq`` holds (shared pages: one reference)."""
        self.allocator.decref(seq.table)
        seq.table = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed, seq.cached_tokens = 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _chunk(self, remaining: int, budget: int) -> int:
        return min(remaining, budget, self.chunk or remaining)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> list[Work]:
        budget = self.max_tokens
        plan: list[tuple[Sequence, int]] = []
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
        admit = self.policy == "continuous" or not self.running
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_seqs:   # 2. waiting
            seq = self.waiting[0]
            if seq.num_computed == 0 and self.cache is not None and not seq.table:
                shared = self.cache.match(seq.tokens[:-1])   # the last token must be computed: its logits
                self.allocator.incref(shared)
                seq.table = list(shared)
                seq.num_computed = seq.cached_tokens = len(shared) * self.allocator.page_size
            n = self._chunk(len(seq.tokens) - seq.num_computed, budget)
            if not self._grow(seq, seq.num_computed + n):
                break                                        # no pages: wait for running ones to finish
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return [Work(s, s.num_computed, s.tokens[s.num_computed:s.num_computed + n],
                     s.num_computed + n == len(s.tokens)) for s, n in plan]

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: its whole computed pages go to the prefix cache, its pages are released."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.cache is not None and seq.table:
            full = seq.num_computed // self.allocator.page_size
            self.cache.insert(seq.tokens[:full * self.allocator.page_size], seq.table[:full])
        self.release(seq)
