"""The engine: a paged forward of the tiny GPT over a mixed batch, driven by the scheduler.

One step (:meth:`Engine.step`) is five stages, each a method another mechanism can replace:

1. ``scheduler.schedule()`` -> the step's runs (:class:`kernels.serving.scheduler.Work`), with their
   pages allocated and the copy-on-write pairs in ``scheduler.copies``;
2. ``runner.cache.copy(copies)``: private copies of shared pages a run is about to write;
3. ``runner.forward(works)`` -> the logits (R, V) of the R runs that end on a token to sample, after
   writing every run's K, V into its page slots (the cache: :class:`kernels.serving.kv_cache.PagedKVCache`);
4. ``sampler(logits, rows)`` -> one token per row (:class:`kernels.serving.sampling.Sampler`: each
   row with its own request's temperature, top-k, top-p, min-p and seed; a request with n > 1
   choices forks at its first sample, and its choices share the prompt's pages);
5. ``_commit``: append the tokens, record log-probs, finish a choice on a stop token or at max_tokens.

``PagedRunner.forward(works)`` packs all the tokens of the step, from every sequence, into one
(N, C) matrix, so every weight matmul (Q, K, V, O projections, the MLP, the LM head) is one matmul
over N rows whatever mix of prefill chunks and decodes they came from. Only attention is per
sequence: each new K, V is written into its page slot, then

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
A sampled request's tokens depend only on its seed (kernels.serving.sampling: counter-based
uniforms keyed by seed, choice and position), so the same request gives the same answer alone or
in any batch, as long as the logits keep their order at the drawn token's margin.

Speculative decoding (``EngineConfig.speculative``, a drafter from kernels.speculative.serving, and
``num_draft`` = gamma). Before scheduling, every decoding sequence gets a draft of up to gamma
tokens (``_propose``); the scheduler appends what the token budget allows to its one-token run and
reserves the slots (``Work.draft``); the forward returns draft + 1 logits rows for that run; the
drafter's ``verify`` keeps n drafts and one more token (``_verify``), and ``Scheduler.rollback``
forgets the rejected positions and frees the pages past the kept ones. The randomness of a
speculative step (draft draws, acceptance uniforms, the residual draw) comes from :func:`spec_key`,
keyed like the sampler's by seed, choice and token index. Greedy answers equal plain decoding token
for token under the same near-tie caveat: a run of gamma + 1 tokens attends like a prefill chunk,
its logits agreeing with a decode's to about 1e-5. The drafter is an object the engine is given
(it never imports kernels.speculative, which imports this package's sampler: no package cycle); the
prefix cache, n > 1 choices and log-probs are refused with it.

Failures. A request that gets past :meth:`Engine.check_request` may still make a stage raise (a
parameter out of the kernels' range, a bug that one input triggers). One request must not fail the
batch, so the two stages that work row by row find the culprit: if the step's forward raises, each
run is forwarded again alone (a run's K, V and logits depend only on its own tokens and pages); if
the sampler raises, each request's rows are sampled again alone (a row's draw depends only on its
logits and its key, so the others' tokens are the ones the batch would have drawn). A request whose
run or rows still raise is finished with reason "error" (its pages freed, never cached) and recorded
in :attr:`Engine.failures`; the rest of the step goes on. A failure that no single request
reproduces (every run passes alone: the batch itself is at fault, e.g. a batch larger than the
captured CUDA graphs), or one outside those stages (the scheduler, speculative verification),
names no request and still raises out of :meth:`Engine.step`.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels.model.gpt import GPT, KVCache, add_rms_norm_torch, rms_norm_torch, rope
from kernels.serving.allocator import BlockAllocator
from kernels.serving.kv_cache import PagedKVCache
from kernels.serving.radix_cache import RadixCache
from kernels.serving.sampling import Sampler, SampleRow, SamplerOutput, SamplingParams, row_key, uniform_ref
from kernels.serving.scheduler import Scheduler, Sequence, Work


class EngineStalled(RuntimeError):
    """The scheduler has requests but scheduled nothing: a bug, reported rather than spun on."""


class RequestInvalid(ValueError):
    """A request the engine could never serve; ``param`` is the request field at fault ("prompt",
    "max_tokens", "n", "stop_token_ids", ...), ``code`` OpenAI's error code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Failure:
    """A request that a step failed: its group (the id of its first sequence) and the error."""
    group: int
    error: str


class PagedRunner:
    """The model's parameters, a paged KV cache of ``num_pages`` pages, and one forward per step."""

    def __init__(self, model: GPT, num_pages: int, page_size: int, *, use_kernels: bool = False,
                 kv_cache=None):
        cfg = model.config
        self.model, self.cfg, self.use_kernels = model, cfg, use_kernels
        if kv_cache is not None and not callable(kv_cache):
            raise TypeError(f"EngineConfig.kv_cache must be None (float pages) or a cache factory such as "
                            f"kernels.kvcache.quantization.engine_cache('int8'), got {kv_cache!r}")
        make = kv_cache or PagedKVCache        # (n_layer, num_pages, n_kv_head, page_size, head_dim) -> cache
        self.cache = make(cfg.n_layer, num_pages, cfg.n_kv_head, page_size, cfg.head_dim)
        self.P = page_size

    @property
    def k_pages(self) -> list[torch.Tensor]:
        return self.cache.k

    @property
    def v_pages(self) -> list[torch.Tensor]:
        return self.cache.v

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
            out[rows] = self.cache.decode(layer, q[rows], table, lens, use_kernels=self.use_kernels)
        D = q.shape[-1]
        for i, w in enumerate(works):
            if len(w.tokens) == 1:
                continue
            a, b = spans[i]
            L = w.start + len(w.tokens)
            k, v = self.cache.gather(layer, torch.tensor(w.seq.table, dtype=torch.int32), L)   # (Hkv, L, D)
            group = q.shape[1] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)   # (Hq, L, D)
            qi = q[a:b].transpose(0, 1)                                      # (Hq, T, D)
            scores = qi @ k.transpose(-1, -2) / math.sqrt(D)                 # (Hq, T, L)
            i_pos = torch.arange(w.start, L)[:, None]
            scores = scores.masked_fill(torch.arange(L)[None, :] > i_pos, float("-inf"))   # key j <= query i
            out[a:b] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
        return out

    @torch.no_grad()
    def forward(self, works: list[Work]) -> torch.Tensor:
        """One step over the packed runs; returns the logits (R, V) of the runs with ``sample`` set, in order:
        one row per run (its last position), or ``draft + 1`` rows for a run that ends on drafts."""
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
            self.cache.write(layer, page_idx, off_idx, k, v)                               # into page slots
            a = self._attend(layer, q, works, spans)
            h, hn = add_rms_norm_torch(x, blk.attn.wo(a.reshape(-1, Hq * D)), blk.norm2.weight, cfg.norm_eps)
            x = h + blk.mlp(hn)
        last = [j for i, w in enumerate(works) if w.sample for j in range(spans[i][1] - 1 - w.draft, spans[i][1])]
        return rms_norm_torch(x[last], m.norm_f.weight, cfg.norm_eps) @ m.wte.weight.T    # (R, V)


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
    cache_after_prefill: bool = True   # with prefix_cache: insert after prefill too, not only at the end
    policy: str = "continuous"
    order: str = "fcfs"            # the waiting queue's order: "fcfs", or "lpm" (longest cached prefix first)
    use_kernels: bool = False      # Triton paged decode attention and the Triton sampler
    seed: int = 0                  # draws the seeds of requests that bring none
    kv_cache: Callable | None = None   # builds the KV cache; None: float pages (PagedKVCache); quantized:
                                       # kernels.kvcache.quantization.engine_cache("int8"), "fp8", ...
    speculative: object | None = None  # a drafter with propose() and verify(), e.g.
                                       # kernels.speculative.serving.PromptLookup() or DraftModel(draft)
    num_draft: int = 4                 # gamma: tokens proposed per sequence per step (with speculative)


@dataclass
class SpecStats:
    """Speculative decoding's counts: verified runs, tokens proposed, accepted drafts that were emitted
    (a draft the target accepted after a stop token or past max_tokens is not counted: it never reaches
    the answer), tokens emitted by verified runs."""
    runs: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0


_M63 = (1 << 63) - 1
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3            # the three streams of a speculative step's randomness


def spec_key(seed: int, choice: int, step: int, stream: int) -> int:
    """The Philox key of one speculative draw: like :func:`kernels.serving.sampling.row_key` (seed, choice,
    token index in the answer), on a seed moved by ``stream`` (DRAFT, ACCEPT, RESIDUAL) so that the
    three never share uniforms with each other or with the plain sampler."""
    return row_key((seed + stream * 0x632BE59BD9B4E019) & _M63, choice, step)


@dataclass
class StepOutput:
    """One token a step produced for one choice, with its log-probs when the request asked."""
    seq: Sequence
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Engine:
    """add(prompt ids, max_new_tokens, params=SamplingParams) -> Sequence; step() advances every
    scheduled sequence by one run and returns the tokens it produced."""

    def __init__(self, model: GPT, config: EngineConfig = EngineConfig(), *, record_logits: bool = False,
                 record_history: bool = True):
        self.model, self.config = model, config
        self.logits: dict[int, list[torch.Tensor]] | None = {} if record_logits else None   # per sequence id
        self.allocator = BlockAllocator(config.num_pages, config.page_size)
        self.cache = RadixCache(self.allocator) if config.prefix_cache else None
        self.scheduler = Scheduler(self.allocator, max_tokens=config.max_tokens, max_seqs=config.max_seqs,
                                   chunk=config.chunk, prefix_cache=self.cache, policy=config.policy,
                                   cache_after_prefill=config.cache_after_prefill, order=config.order)
        self.runner = PagedRunner(model, config.num_pages, config.page_size, use_kernels=config.use_kernels,
                                  kv_cache=config.kv_cache)
        self.sampler = Sampler(use_kernels=config.use_kernels)
        self.spec = config.speculative
        if self.spec is not None:
            if not all(callable(getattr(self.spec, f, None)) for f in ("propose", "verify")):
                raise TypeError(f"EngineConfig.speculative must be None or a drafter with propose() and verify() "
                                f"(kernels.speculative.serving.PromptLookup, DraftModel), got {self.spec!r}")
            if not isinstance(config.num_draft, int) or isinstance(config.num_draft, bool) or config.num_draft < 1:
                raise ValueError(f"EngineConfig.num_draft must be an int >= 1, got {config.num_draft!r}")
            if config.prefix_cache:
                raise ValueError("EngineConfig.speculative does not support prefix_cache=True (rolled-back "
                                 "pages could be shared with the radix cache)")
        self.spec_stats = SpecStats()
        self._q: dict[int, torch.Tensor | None] = {}                # per sequence id: its draft's q (k, V)
        self.times = StepTimes()
        self.history: list[list[tuple[int, int, int, bool]]] = []  # per step: (seq id, start, n tokens, sampled)
        self.record_history = record_history                       # off in a long-running server
        self._next_id = 0
        self._seeds = random.Random(config.seed)
        self.failures: list[Failure] = []                          # failed requests not yet taken

    def check_request(self, prompt: list[int], params: SamplingParams | int) -> None:
        """Reject what the engine could never serve, with the reason and the field at fault
        (:class:`RequestInvalid`; the server turns it into a 400 naming that field)."""
        if isinstance(params, int) or params is None:
            if not isinstance(params, int) or isinstance(params, bool) or params < 1:
                raise RequestInvalid(f"max_tokens must be an integer >= 1, got {params!r}", "max_tokens")
            params = SamplingParams(max_tokens=params)
        limit = self.model.config.block_size
        if not prompt:
            raise RequestInvalid("the prompt is empty: at least one token is needed", "prompt")
        if len(prompt) + params.max_tokens > limit:
            # the prompt is at fault if it leaves no room for one token, else max_tokens is
            raise RequestInvalid(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceed the "
                                 f"model's context of {limit} tokens", "prompt" if len(prompt) >= limit else
                                 "max_tokens", "context_length_exceeded")
        if self.allocator.pages_for(len(prompt) + params.max_tokens) > self.allocator.num_pages:
            raise RequestInvalid("the request needs more KV pages than the whole cache holds", "max_tokens")
        if params.n > self.config.max_seqs:
            raise RequestInvalid(f"n={params.n} choices need more batch seats than max_seqs={self.config.max_seqs}",
                                 "n")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestInvalid("token ids must lie in [0, vocab_size)", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestInvalid(f"stop_token_ids must lie in [0, {vocab})", "stop_token_ids")
        if self.spec is not None and params.n > 1:
            raise RequestInvalid(f"n={params.n} choices are not served with speculative decoding "
                                 f"(EngineConfig.speculative)", "n")
        if self.spec is not None and params.logprobs is not None:
            raise RequestInvalid("logprobs are not served with speculative decoding (EngineConfig.speculative)",
                                 "logprobs")

    def add(self, prompt: list[int], max_new_tokens: int | None = None, *, params: SamplingParams | None = None) -> Sequence:
        """Queue a request; ``max_new_tokens`` (if given) overrides ``params.max_tokens``. Returns its
        first choice; the others appear in ``.children`` once it forks."""
        if params is None:
            params = SamplingParams(max_tokens=max_new_tokens) if max_new_tokens is not None else SamplingParams()
        elif max_new_tokens is not None:
            params = replace(params, max_tokens=max_new_tokens)
        self.check_request(prompt, params)
        seq = Sequence(self._next_id, list(prompt), params.max_tokens, params=params, forks=params.n - 1)
        seq.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """End one choice (a stop string seen by the server: reason "stop"); its pages go back at once."""
        self.scheduler.finish(seq, reason)

    def abort(self, seq: Sequence) -> None:
        """Stop a request and every choice it forked (a client went away): their pages go back at once."""
        for s in [seq, *seq.children]:
            self.scheduler.finish(s, "abort")
        seq.forks = 0

    def _fail(self, group: int, err: Exception) -> None:
        """Finish every choice of request ``group`` with reason "error" and record the failure."""
        for s in [*self.scheduler.running, *self.scheduler.waiting]:
            if s.group == group:
                s.forks = 0
                self.scheduler.finish(s, "error")
        self.failures.append(Failure(group, f"{type(err).__name__}: {err}"))

    def take_failures(self) -> list[Failure]:
        """The requests failed since the last call (the server answers each with an error)."""
        out, self.failures = self.failures, []
        return out

    # ---------------------------------------------------------------- one step, in its stages

    def step(self) -> list[StepOutput]:
        """One iteration; returns the tokens it produced (one per sampled choice)."""
        t0 = time.perf_counter()
        if self.spec is not None:
            self._propose()
        works = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not works:
            if self.scheduler.has_work():
                raise EngineStalled(f"{len(self.scheduler.waiting)} waiting and {len(self.scheduler.running)} "
                                    f"running sequences, but nothing could be scheduled")
            return []
        self.runner.cache.copy(self.scheduler.copies)
        works, logits = self._forward(works)
        t2 = time.perf_counter()
        for w in works:
            self.scheduler.computed(w)
        sampled = [w for w in works if w.sample]
        first = [0]                                                  # each sampled run's first logits row
        for w in sampled:
            first.append(first[-1] + 1 + w.draft)
        plain = [i for i, w in enumerate(sampled) if not w.draft]
        seqs, rows = self._rows([sampled[i].seq for i in plain])
        out = self._commit(seqs, logits[[first[plain[r]] for r in rows]])
        spec = [i for i, w in enumerate(sampled) if w.draft]
        if spec:
            out += self._verify([sampled[i] for i in spec], [logits[first[i]:first[i + 1]] for i in spec])
        t3 = time.perf_counter()
        self.times.schedule += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
        self.times.steps += 1
        self.times.tokens += sum(len(w.tokens) for w in works)
        if self.record_history:
            self.history.append([(w.seq.id, w.start, len(w.tokens), w.sample) for w in works])
        return out

    def _forward(self, works: list[Work]) -> tuple[list[Work], torch.Tensor]:
        """The step's forward -> (the runs that go on, their logits). If it raises, every run is forwarded
        again alone and a request whose run still raises is failed (its other runs dropped too); if
        every run passes alone, the batch itself was at fault and its error is raised."""
        try:
            return works, self.runner.forward(works)
        except Exception as err:
            batch_err = err
        done, failed = [], len(self.failures)
        for w in works:
            try:
                done.append((w, self.runner.forward([w])))
            except Exception as err:
                self._fail(w.seq.group, err)
        if len(self.failures) == failed:
            raise batch_err
        done = [(w, rows) for w, rows in done if not w.seq.finished]
        V = self.model.config.vocab_size
        return [w for w, _ in done], torch.cat([rows for _, rows in done]) if done else torch.empty(0, V)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor):
        """The sampler over the step's rows -> (the choices that go on, their logits rows, the draws). If it
        raises, each request's rows are drawn again alone and a request whose rows still raise is failed;
        if every request's rows pass alone, the batch's error is raised."""
        rows = [SampleRow(s.params, s.seed, s.choice, len(s.generated)) for s in seqs]
        try:
            return seqs, logits, self.sampler(logits, rows)
        except Exception as err:
            batch_err = err
        keep, tokens, lps, tops, failed = [], [], [], [], len(self.failures)
        for group in dict.fromkeys(s.group for s in seqs):
            idx = [j for j, s in enumerate(seqs) if s.group == group]
            try:
                drawn = self.sampler(logits[idx], [rows[j] for j in idx])
            except Exception as err:
                self._fail(group, err)
                continue
            keep += idx
            tokens, lps, tops = tokens + drawn.tokens, lps + drawn.logprobs, tops + drawn.top_logprobs
        if len(self.failures) == failed:
            raise batch_err
        return [seqs[j] for j in keep], logits[keep], SamplerOutput(tokens, lps, tops)

    def _rows(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """The choices that draw a token this step and the logits row of each: a request with n > 1
        forks at its first sample, its new choices drawing from the same row."""
        seqs, rows = [], []
        for r, seq in enumerate(sampled):
            fam = [seq]
            if seq.forks:
                ids = list(range(self._next_id, self._next_id + seq.forks))
                self._next_id += len(ids)
                fam += self.scheduler.fork(seq, ids)
            seqs += fam
            rows += [r] * len(fam)
        return seqs, rows

    def _commit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Sample, append, record, stop."""
        seqs, logits, drawn = self._sample(seqs, logits)
        out = []
        for j, seq in enumerate(seqs):
            token = drawn.tokens[j]
            seq.tokens.append(token)
            if self.logits is not None:
                self.logits.setdefault(seq.id, []).append(logits[j])
            if drawn.logprobs[j] is not None:
                seq.logprobs.append((drawn.logprobs[j], drawn.top_logprobs[j]))
            out.append(StepOutput(seq, token, drawn.logprobs[j], drawn.top_logprobs[j]))
            if token in seq.params.stop_token_ids:
                self.scheduler.finish(seq, "stop")
            elif len(seq.generated) >= seq.max_new_tokens:
                self.scheduler.finish(seq, "length")
        return out

    # ---------------------------------------------------------------- speculative decoding

    def _propose(self) -> None:
        """Give every decoding sequence (one token not yet computed) a draft of up to ``num_draft`` tokens,
        never past its max_tokens: the drafter sees the tokens so far, the request's parameters and the
        keys of the draws it may make (one per drafted position)."""
        self._q = {}
        for seq in self.scheduler.running:
            seq.draft = []
            left = seq.max_new_tokens - len(seq.generated)
            if seq.num_computed != len(seq.tokens) - 1 or left < 2:
                continue
            k = min(self.config.num_draft, left - 1)
            t = len(seq.generated)
            keys = [spec_key(seq.seed, seq.choice, t + j, DRAFT) for j in range(k)]
            draft, q = self.spec.propose(list(seq.tokens), k, seq.params, keys)
            if len(draft) > k or (q is not None and tuple(q.shape) != (len(draft), self.model.config.vocab_size)):
                raise ValueError(f"EngineConfig.speculative: propose() returned {len(draft)} tokens and q of shape "
                                 f"{None if q is None else tuple(q.shape)} for a draft of at most {k}")
            seq.draft, self._q[seq.id] = [int(d) for d in draft], q

    def _verify(self, works: list[Work], blocks: list[torch.Tensor]) -> list[StepOutput]:
        """Verify each run's drafts against its draft + 1 logits rows (grouped by draft length, one
        verify() call per group), keep the accepted drafts and one more token, roll the rest back."""
        out = []
        for k in sorted({w.draft for w in works}):
            group = [(w, b) for w, b in zip(works, blocks) if w.draft == k]
            seqs = [w.seq for w, _ in group]
            steps = [len(s.generated) for s in seqs]
            logits = torch.stack([b for _, b in group])                                 # (B, k+1, V)
            drafts = torch.tensor([s.draft[:k] for s in seqs], dtype=torch.int64)       # (B, k)
            qs = [None if self._q.get(s.id) is None else self._q[s.id][:k] for s in seqs]
            u = uniform_ref(torch.tensor([spec_key(s.seed, s.choice, t, ACCEPT) for s, t in zip(seqs, steps)],
                                         dtype=torch.int64), k)                         # (B, k) in (0, 1)
            keys = torch.tensor([spec_key(s.seed, s.choice, t, RESIDUAL) for s, t in zip(seqs, steps)],
                                dtype=torch.int64)
            n, tokens = self.spec.verify(logits, [s.params for s in seqs], drafts, qs, u, keys,
                                         use_kernels=self.config.use_kernels)
            for b, (w, _) in enumerate(group):
                seq, nb = w.seq, int(n[b])
                self.scheduler.rollback(seq, w.start + 1 + nb)       # the last token and the nb accepted drafts
                seq.draft = []
                st = self.spec_stats
                st.runs, st.drafted = st.runs + 1, st.drafted + k
                for j, token in enumerate(tokens[b, :nb + 1].tolist()):
                    seq.tokens.append(token)
                    st.emitted += 1
                    st.accepted += j < nb      # an accepted draft counts once emitted: none past a stop token
                    if self.logits is not None:
                        self.logits.setdefault(seq.id, []).append(logits[b, j])
                    out.append(StepOutput(seq, token))
                    if token in seq.params.stop_token_ids:
                        self.scheduler.finish(seq, "stop")
                        break
                    if len(seq.generated) >= seq.max_new_tokens:
                        self.scheduler.finish(seq, "length")
                        break
        return out

    def run(self, max_steps: int = 100_000) -> None:
        """Step until every added sequence has finished; raises if a request failed on the way (the
        others have finished by then)."""
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                if self.failures:
                    raise RuntimeError(f"run: {len(self.failures)} request(s) failed: "
                                       + "; ".join(f"request {f.group}: {f.error}" for f in self.take_failures()))
                return
            self.step()
        raise RuntimeError(f"run: not finished after {max_steps} steps")

    def pages_held_by_requests(self) -> int:
        """References held by sequences (0 once every request has finished or been aborted)."""
        return sum(len(s.table) for s in list(self.scheduler.running) + list(self.scheduler.waiting))


@torch.no_grad()
def reference_generate(model: GPT, prompt: list[int], max_new_tokens: int, *, params: SamplingParams | None = None,
                       seed: int = 0, choice: int = 0) -> tuple[list[int], float, torch.Tensor]:
    """One-at-a-time generation with the model's contiguous KV cache (pure PyTorch): greedy, or with
    ``params`` drawn as the engine draws choice ``choice`` of a request seeded ``seed`` (the reference
    sampler, the same keys).

    Returns (generated tokens, the smallest top-1 minus top-2 logit gap over the steps, the logits
    of every step (max_new_tokens, V)): the gap says how far each greedy choice is from a tie.
    """
    sampler = Sampler(use_kernels=False)
    params = params or SamplingParams(max_tokens=max_new_tokens)
    cache = KVCache.empty(model.config, 1)
    nxt = torch.tensor([prompt])
    out, rows = [], []
    for t in range(max_new_tokens):
        logits = model(nxt, cache=cache)[0, -1]
        rows.append(logits)
        token = sampler(logits[None], [SampleRow(params, seed, choice, t)]).tokens[0]
        out.append(token)
        nxt = torch.tensor([[token]])
    steps = torch.stack(rows)
    top2 = steps.topk(2, dim=-1).values
    return out, float((top2[:, 0] - top2[:, 1]).min()), steps
