"""The engine: a paged forward of the tiny GPT over a mixed batch, driven by the scheduler.

``PagedRunner.forward(works)`` runs one step. All the tokens of the step, from every sequence,
are packed into one (N, C) matrix, so every weight matmul (Q, K, V, O projections, the MLP, the LM
head) is one matmul over N rows whatever mix of prefill chunks and decodes they came from. Only
attention is per sequence: each new K, V is written into its page slot, then

* a run of one token (a decode) joins the batched paged decode attention
  (kernels.attention.paged: ``paged_decode_attention`` with ``use_kernels``, else its reference);
* a run of T > 1 tokens (a prefill chunk starting at position s) attends causally to its sequence's
  pages 0 .. s + T - 1 (gathered), query i seeing keys j <= s + i.

Exactness. Greedy outputs of the engine equal one-at-a-time generation (``reference_generate``,
the model's own contiguous KV cache) *token for token*, not bit for bit: a row of a batched matmul
on the CPU may be summed in another order than the same row alone (BLAS picks kernels by shape),
and a chunked prefill sums attention in another order than a whole one. The logits agree to about
1e-5 and the tests check that the greedy choice is never closer than that: the smallest gap
between the top two logits over the reference run is reported beside the largest logit difference.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from kernels.attention.paged import gather_pages, paged_decode_attention, paged_decode_attention_ref
from kernels.model.gpt import GPT, KVCache, add_rms_norm_torch, rms_norm_torch, rope
from kernels.serving.allocator import BlockAllocator
from kernels.serving.radix_cache import RadixCache
from kernels.serving.scheduler import Scheduler, Sequence, Work


class PagedRunner:
    """The model's parameters, a paged KV cache of ``num_pages`` pages, and one forward per step."""

    def __init__(self, model: GPT, num_pages: int, page_size: int, *, use_kernels: bool = False):
        cfg = model.config
        self.model, self.cfg, self.use_kernels = model, cfg, use_kernels
        shape = (num_pages, cfg.n_kv_head, page_size, cfg.head_dim)     # (pages, Hkv, P, D)
        self.k_pages = [torch.zeros(shape) for _ in range(cfg.n_layer)]
        self.v_pages = [torch.zeros(shape) for _ in range(cfg.n_layer)]
        self.P = page_size

    def _attend(self, layer: int, q: torch.Tensor, works: list[Work], spans) -> torch.Tensor:
        """q (N, Hq, D) of the packed tokens -> attention output (N, Hq, D)."""
        out = torch.empty_like(q)
        dec = [i for i, w in enumerate(works) if len(w.tokens) == 1]
        if dec:
            rows = [spans[i][0] for i in dec]
            width = max(len(works[i].seq.table) for i in dec)
            table = torch.tensor([works[i].seq.table + [0] * (width - len(works[i].seq.table)) for i in dec],
                                 dtype=torch.int32)
            lens = torch.tensor([works[i].start + 1 for i in dec], dtype=torch.int32)
            attend = paged_decode_attention if self.use_kernels else paged_decode_attention_ref
            out[rows] = attend(q[rows], self.k_pages[layer], self.v_pages[layer], table, lens)
        D = q.shape[-1]
        for i, w in enumerate(works):
            if len(w.tokens) == 1:
                continue
            a, b = spans[i]
            L = w.start + len(w.tokens)
            table = torch.tensor(w.seq.table, dtype=torch.int32)
            k = gather_pages(self.k_pages[layer], table, L)                  # (Hkv, L, D)
            v = gather_pages(self.v_pages[layer], table, L)
            group = q.shape[1] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)   # (Hq, L, D)
            qi = q[a:b].transpose(0, 1)                                      # (Hq, T, D)
            scores = qi @ k.transpose(-1, -2) / math.sqrt(D)                 # (Hq, T, L)
            i_pos = torch.arange(w.start, L)[:, None]
            scores = scores.masked_fill(torch.arange(L)[None, :] > i_pos, float("-inf"))   # key j <= query i
            out[a:b] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
        return out

    @torch.no_grad()
    def forward(self, works: list[Work]) -> dict[int, torch.Tensor]:
        """One step over the packed runs; returns {sequence id: logits (V,)} for the sampled runs."""
        cfg, m = self.cfg, self.model
        Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        ids = torch.tensor([t for w in works for t in w.tokens])                         # (N,)
        pos = torch.tensor([w.start + j for w in works for j in range(len(w.tokens))])   # (N,)
        spans, n = [], 0
        for w in works:
            spans.append((n, n + len(w.tokens)))
            n += len(w.tokens)
        slots = [(w.seq.table[p // self.P], p % self.P) for w in works
                 for p in range(w.start, w.start + len(w.tokens))]
        page_idx = torch.tensor([s[0] for s in slots])
        off_idx = torch.tensor([s[1] for s in slots])
        x = m.wte(ids)                                                                    # (N, C)
        for layer, blk in enumerate(m.blocks):
            u = rms_norm_torch(x, blk.norm1.weight, cfg.norm_eps)
            q = rope(blk.attn.wq(u).view(1, -1, Hq, D).transpose(1, 2), pos[None], cfg.rope_theta)
            k = rope(blk.attn.wk(u).view(1, -1, Hkv, D).transpose(1, 2), pos[None], cfg.rope_theta)
            v = blk.attn.wv(u).view(-1, Hkv, D)
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)                              # (N, H, D)
            self.k_pages[layer][page_idx, :, off_idx] = k                                  # write into page slots
            self.v_pages[layer][page_idx, :, off_idx] = v
            a = self._attend(layer, q, works, spans)
            h, hn = add_rms_norm_torch(x, blk.attn.wo(a.reshape(-1, Hq * D)), blk.norm2.weight, cfg.norm_eps)
            x = h + blk.mlp(hn)
        last = [spans[i][1] - 1 for i, w in enumerate(works) if w.sample]
        logits = rms_norm_torch(x[last], m.norm_f.weight, cfg.norm_eps) @ m.wte.weight.T   # (n_sampled, V)
        return {w.seq.id: logits[j] for j, w in enumerate(w for w in works if w.sample)}


@dataclass
class StepTimes:
    """Wall seconds spent per phase (the request-path chapter measures them)."""
    schedule: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0
    tokens: int = 0


@dataclass
class EngineConfig:
    num_pages: int = 256
    page_size: int = 16
    max_tokens: int = 256          # token budget of one step
    max_seqs: int = 32
    chunk: int | None = None       # largest prefill run per sequence per step (None: whole prompt)
    prefix_cache: bool = False
    policy: str = "continuous"
    use_kernels: bool = False


class Engine:
    """add(prompt ids, max_new_tokens) -> Sequence; step() advances every scheduled sequence by one run."""

    def __init__(self, model: GPT, config: EngineConfig = EngineConfig(), *, record_logits: bool = False,
                 record_history: bool = True):
        self.model, self.config = model, config
        self.logits: dict[int, list[torch.Tensor]] | None = {} if record_logits else None   # per sequence id
        self.allocator = BlockAllocator(config.num_pages, config.page_size)
        self.cache = RadixCache(self.allocator) if config.prefix_cache else None
        self.scheduler = Scheduler(self.allocator, max_tokens=config.max_tokens, max_seqs=config.max_seqs,
                                   chunk=config.chunk, prefix_cache=self.cache, policy=config.policy)
        self.runner = PagedRunner(model, config.num_pages, config.page_size, use_kernels=config.use_kernels)
        self.times = StepTimes()
        self.history: list[list[tuple[int, int, int, bool]]] = []  # per step: (seq id, start, n tokens, sampled)
        self.record_history = record_history                       # off in a long-running server
        self._next_id = 0

    def check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        """Reject what the engine could never serve, with the reason (the server turns it into a 400)."""
        limit = self.model.config.block_size
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) exceed the "
                             f"model's context of {limit} tokens")
        if self.allocator.pages_for(len(prompt) + max_new_tokens) > self.allocator.num_pages:
            raise ValueError("the request needs more KV pages than the whole cache holds")
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt):
            raise ValueError("token ids must lie in [0, vocab_size)")

    def add(self, prompt: list[int], max_new_tokens: int) -> Sequence:
        self.check_request(prompt, max_new_tokens)
        seq = Sequence(self._next_id, list(prompt), max_new_tokens)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence (a client went away): its pages go back at once."""
        if not seq.finished:
            self.scheduler.finish(seq)

    def step(self) -> list[tuple[Sequence, int]]:
        """One iteration; returns the (sequence, new token) pairs it produced."""
        t0 = time.perf_counter()
        works = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not works:
            return []
        logits = self.runner.forward(works)
        t2 = time.perf_counter()
        out = []
        for w in works:
            w.seq.num_computed = w.start + len(w.tokens)
            if w.sample:
                token = int(torch.argmax(logits[w.seq.id]))               # greedy
                if self.logits is not None:
                    self.logits.setdefault(w.seq.id, []).append(logits[w.seq.id])
                w.seq.tokens.append(token)
                out.append((w.seq, token))
                if len(w.seq.generated) >= w.seq.max_new_tokens:
                    self.scheduler.finish(w.seq)
        t3 = time.perf_counter()
        self.times.schedule += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
        self.times.steps += 1
        self.times.tokens += sum(len(w.tokens) for w in works)
        if self.record_history:
            self.history.append([(w.seq.id, w.start, len(w.tokens), w.sample) for w in works])
        return out

    def run(self, max_steps: int = 100_000) -> None:
        """Step until every added sequence has finished."""
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            self.step()
        raise RuntimeError(f"run: not finished after {max_steps} steps")

    def pages_held_by_requests(self) -> int:
        """References held by sequences (0 once every request has finished or been aborted)."""
        return sum(len(s.table) for s in list(self.scheduler.running) + list(self.scheduler.waiting))


@torch.no_grad()
def reference_generate(model: GPT, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float, torch.Tensor]:
    """One-at-a-time greedy generation with the model's contiguous KV cache (pure PyTorch).

    Returns (generated tokens, the smallest top-1 minus top-2 logit gap over the steps, the logits
    of every step (max_new_tokens, V)): the gap says how far each greedy choice is from a tie.
    """
    cache = KVCache.empty(model.config, 1)
    nxt = torch.tensor([prompt])
    out, rows = [], []
    for _ in range(max_new_tokens):
        logits = model(nxt, cache=cache)[0, -1]
        rows.append(logits)
        token = int(torch.argmax(logits))
        out.append(token)
        nxt = torch.tensor([[token]])
    steps = torch.stack(rows)
    top2 = steps.topk(2, dim=-1).values
    return out, float((top2[:, 0] - top2[:, 1]).min()), steps
