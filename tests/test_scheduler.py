"""kernels.serving.scheduler and simulate: budgets, chunks, preemption order, static batching, and the
event simulation's cost model."""
import pytest

from kernels.serving.allocator import BlockAllocator
from kernels.serving.scheduler import Scheduler, Sequence
from kernels.serving.simulate import CostModel, Request, percentile, simulate


def _drive(sched, steps=1000):
    """Run the scheduler with a fake model (token 0 every sample); returns the plans."""
    plans = []
    for _ in range(steps):
        if not sched.has_work():
            break
        works = sched.schedule()
        plans.append([(w.seq.id, w.start, len(w.tokens), w.sample) for w in works])
        for w in works:
            w.seq.num_computed = w.start + len(w.tokens)
            if w.sample:
                w.seq.tokens.append(0)
                if len(w.seq.generated) >= w.seq.max_new_tokens:
                    sched.finish(w.seq)
    return plans


def test_budget_and_chunks():
    s = Scheduler(BlockAllocator(64, 4), max_tokens=10, chunk=6)
    for i, n in enumerate([13, 2, 9]):
        s.add(Sequence(i, [1] * n, 3))
    plans = _drive(s)
    assert plans[0] == [(0, 0, 6, False), (1, 0, 2, True), (2, 0, 2, False)]
    assert all(sum(n for _, _, n, _ in p) <= 10 and all(n <= 6 for _, _, n, _ in p) for p in plans)
    assert s.allocator.num_used == 0


def test_preempts_the_newest_and_recomputes():
    s = Scheduler(BlockAllocator(5, 4), max_tokens=64)
    seqs = [Sequence(i, [1] * 6, 8) for i in range(2)]          # each needs 4 pages at the end: 8 > 5
    for q in seqs:
        s.add(q)
    plans = _drive(s)
    assert s.preemptions >= 1 and seqs[1].preemptions >= 1 and seqs[0].preemptions == 0
    assert all(len(q.generated) == 8 for q in seqs) and s.allocator.num_used == 0
    restarts = [p for p in plans if any(sid == 1 and start == 0 and n > 1 for sid, start, n, _ in p)]
    assert len(restarts) == 2                                    # first prefill, and the recompute of 6 + generated


def test_static_waits_for_the_whole_batch():
    s = Scheduler(BlockAllocator(64, 4), max_tokens=64, max_seqs=2, policy="static")
    for i, new in enumerate([1, 5, 2]):
        s.add(Sequence(i, [1] * 3, new))
    plans = _drive(s)
    first_seen = {sid: k for k, p in reversed(list(enumerate(plans))) for sid, *_ in p}
    assert first_seen[2] == 5                                    # joins only after sequence 1's 5 steps
    c = Scheduler(BlockAllocator(64, 4), max_tokens=64, max_seqs=2)
    for i, new in enumerate([1, 5, 2]):
        c.add(Sequence(i, [1] * 3, new))
    plans = _drive(c)
    first_seen = {sid: k for k, p in reversed(list(enumerate(plans))) for sid, *_ in p}
    assert first_seen[2] == 1                                    # continuous: takes the freed seat at once


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        Scheduler(BlockAllocator(4, 4), policy="fifo")
    with pytest.raises(ValueError, match=">= 1"):
        Scheduler(BlockAllocator(4, 4), chunk=0)


def _requests(n=40):
    return [Request(0.01 * i, 200 + 37 * (i % 7), 20 + 13 * (i % 5)) for i in range(n)]


def test_simulation_continuous_beats_static():
    st = simulate(_requests(), policy="static", max_seqs=8)
    co = simulate(_requests(), max_seqs=8)
    assert co.throughput > 1.3 * st.throughput
    assert percentile(co.ttft, 50) < percentile(st.ttft, 50)
    assert co.tokens_out == st.tokens_out == sum(r.output_len for r in _requests())


def test_simulation_chunking_bounds_decode_stalls():
    reqs = [Request(0.0, 64, 200)] + [Request(0.05 * i, 3000, 5) for i in range(1, 6)]
    whole = simulate(reqs, max_tokens=4096)
    chunked = simulate(reqs, max_tokens=256, chunk=256)
    assert max(chunked.tbt) < 0.5 * max(whole.tbt)


def test_cost_model_is_memory_bound_for_decode():
    c = CostModel()
    assert c.step_time(1, 0) == pytest.approx(c.overhead + c.weight_bytes / c.bandwidth)
    assert c.step_time(8192, 0) > c.step_time(1, 0)               # a long prefill is compute bound
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 100) == 2.0
