"""An event simulation of the scheduler: the real ``Scheduler`` and allocator, a model clock instead of a GPU.

Each step's duration comes from a roofline cost model (the assumptions are the arguments of
:class:`CostModel`, every one labelled): a step reads the weights once and the KV cache of every
sequence it touches, and does 2 * parameters FLOPs per token it processes,

    t_step = overhead + max(bytes / bandwidth, flops / peak)
    bytes  = weight_bytes + kv_bytes_per_token * (positions of KV read by the step's attention)
    flops  = 2 * params * (tokens in the step)

Requests carry a prompt length, an output length and an arrival time; tokens are dummies (the
model is not run), so the simulation measures scheduling only: time to first token (TTFT), time
between tokens, and throughput, for continuous batching, chunked prefill and static batching.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.serving.allocator import BlockAllocator
from kernels.serving.scheduler import Scheduler, Sequence


@dataclass(frozen=True)
class CostModel:
    """Defaults: Llama-3-8B in fp16 on one H100 SXM (assumptions, not measurements)."""
    params: float = 8.0e9                    # parameters (Llama-3-8B)
    weight_bytes: float = 16.0e9             # fp16 weights, read once per step
    kv_bytes_per_token: float = 131072.0     # 2 * 32 layers * 8 KV heads * 128 * 2 bytes
    bandwidth: float = 3.35e12               # H100 SXM HBM3, bytes/s
    peak_flops: float = 989e12 * 0.6         # dense fp16 tensor-core peak at an assumed 60% efficiency
    overhead: float = 2e-3                   # scheduling + launches per step, assumed

    def step_time(self, tokens: int, kv_read: int) -> float:
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_read) / self.bandwidth
        compute = 2 * self.params * tokens / self.peak_flops
        return self.overhead + max(memory, compute)


@dataclass(frozen=True)
class Request:
    arrival: float
    prompt_len: int
    output_len: int


@dataclass
class Result:
    ttft: list[float]              # per request: first token time - arrival
    tbt: list[float]               # every gap between two consecutive tokens of a request
    finish: list[float]            # per request: completion time
    makespan: float
    tokens_out: int
    steps: int
    preemptions: int

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run."""
        return self.tokens_out / self.makespan


def simulate(requests: list[Request], *, policy: str = "continuous", max_tokens: int = 8192,
             max_seqs: int = 64, chunk: int | None = None, num_pages: int = 4096, page_size: int = 16,
             cost: CostModel = CostModel(), max_steps: int = 1_000_000) -> Result:
    """Run ``requests`` through the scheduler on the model clock. ``policy="static"`` admits a new batch
    of up to ``max_seqs`` only when the previous batch has wholly finished, and charges every step for
    the whole batch (its padded shape) until the longest member is done."""
    alloc = BlockAllocator(num_pages, page_size)
    sched = Scheduler(alloc, max_tokens=max_tokens, max_seqs=max_seqs, chunk=chunk, policy=policy)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    seqs = {i: Sequence(i, [1] * requests[i].prompt_len, requests[i].output_len) for i in order}
    first, last, finish = {}, {}, {}
    tbt = []
    clock, nxt, steps = 0.0, 0, 0
    batch: list[Sequence] = []                                     # static: the admitted batch
    while len(finish) < len(requests):
        while nxt < len(order) and requests[order[nxt]].arrival <= clock:
            sched.add(seqs[order[nxt]])
            nxt += 1
        works = sched.schedule()
        if not works:                                              # idle until the next arrival
            clock = requests[order[nxt]].arrival
            continue
        if policy == "static":
            batch = [w.seq for w in works] if not batch or all(s.finished for s in batch) else batch
            pad = max(len(s.tokens) for s in batch)
            tokens = sum(len(w.tokens) for w in works) + sum(1 for s in batch if s.finished)
            kv = len(batch) * pad
        else:
            tokens = sum(len(w.tokens) for w in works)
            kv = sum(w.start + len(w.tokens) for w in works)
        clock += cost.step_time(tokens, kv)
        steps += 1
        if steps > max_steps:
            raise RuntimeError("simulate: too many steps")
        for w in works:
            s = w.seq
            s.num_computed = w.start + len(w.tokens)
            if w.sample:
                s.tokens.append(0)
                if s.id not in first:
                    first[s.id] = clock
                else:
                    tbt.append(clock - last[s.id])
                last[s.id] = clock
                if len(s.generated) >= s.max_new_tokens:
                    sched.finish(s)
                    finish[s.id] = clock
    return Result(ttft=[first[i] - requests[i].arrival for i in range(len(requests))], tbt=tbt,
                  finish=[finish[i] for i in range(len(requests))], makespan=clock,
                  tokens_out=sum(r.output_len for r in requests), steps=steps, preemptions=sched.preemptions)


def first_token_times(history: list, cost: CostModel) -> dict[int, float]:
    """Time to first token of every sequence in an engine's recorded ``history`` (one list per step of
    (seq id, start, tokens, sampled)), each step priced by ``cost``: the modelled TTFT of the schedule
    the real engine ran, not of this module's simulation."""
    clock, first = 0.0, {}
    for step in history:
        tokens = sum(n for _, _, n, _ in step)
        kv_read = sum(start + n for _, start, n, _ in step)          # positions each run's attention reads
        clock += cost.step_time(tokens, kv_read)
        for sid, _, _, sampled in step:
            if sampled:
                first.setdefault(sid, clock)
    return first


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: a value of the list, no interpolation."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]
