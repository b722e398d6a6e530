"""kernels.serving.scheduler and simulate: budgets, chunks, preemption order, static batching, the
deadlock a held prefix caused, a property test over random workloads (every request finishes, every
page comes back, every sequence reads its own tokens from its pages, forks copy-on-write), and the
event simulation's cost model."""
import random

import pytest

from kernels.serving.allocator import BlockAllocator
from kernels.serving.radix_cache import RadixCache
from kernels.serving.scheduler import Scheduler, Sequence
from kernels.serving.simulate import CostModel, Request, first_token_times, percentile, simulate


def _drive(sched, steps=1000):
    """Run the scheduler with a fake model (token 0 every sample); returns the plans."""
    plans = []
    for _ in range(steps):
        if not sched.has_work():
            break
        works = sched.schedule()
        plans.append([(w.seq.id, w.start, len(w.tokens), w.sample) for w in works])
        for w in works:
            sched.computed(w)
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
    with pytest.raises(ValueError, match="order"):
        Scheduler(BlockAllocator(4, 4), order="lifo")
    with pytest.raises(ValueError, match="prefix_cache"):
        Scheduler(BlockAllocator(4, 4), order="lpm")              # nothing to rank by


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


# ---------------------------------------------------------------- the held-prefix deadlock

def _cached(alloc, cache, tokens):
    pages = alloc.allocate(len(tokens) // alloc.page_size)
    cache.insert(tokens, pages)
    alloc.decref(pages)


def test_a_request_that_cannot_be_admitted_holds_no_pages():
    """The review's case (8 pages of 4, 2 cached; A = 20 prompt + 12 new, B = the cached prefix + 1
    token + 20 new). Before the fix B kept its matched prefix (count 2, unevictable) while it waited;
    A, preempted, then needed those pages, and after 40 steps both waited forever with 6 pages free."""
    alloc = BlockAllocator(8, 4)
    cache = RadixCache(alloc)
    prefix = list(range(1, 9))
    _cached(alloc, cache, prefix)
    s = Scheduler(alloc, max_tokens=64, prefix_cache=cache)
    a, b = Sequence(0, [50 + i for i in range(20)], 12), Sequence(1, prefix + [90], 20)
    s.add(a)
    s.add(b)
    for _ in range(200):
        if not s.has_work():
            break
        assert all(not q.table for q in s.waiting), "a waiting request holds pages"
        works = s.schedule()
        assert works, f"nothing scheduled: waiting {[q.id for q in s.waiting]}, {alloc.num_free} pages free"
        for w in works:
            s.computed(w)
            if w.sample:
                w.seq.tokens.append(0)
                if len(w.seq.generated) >= w.seq.max_new_tokens:
                    s.finish(w.seq)
    assert a.finished and b.finished and s.preemptions >= 1
    assert alloc.num_used == cache.cached_pages
    cache.clear()
    assert alloc.num_used == 0


def test_a_failed_admission_does_not_count_as_a_cache_hit():
    alloc = BlockAllocator(6, 4)
    cache = RadixCache(alloc)
    _cached(alloc, cache, [1, 2, 3, 4])
    s = Scheduler(alloc, max_tokens=64, prefix_cache=cache)
    s.running.append(Sequence(9, [7] * 4, 2, tokens=[7] * 5, table=alloc.allocate(5), num_computed=4))   # every free page
    s.add(Sequence(0, [1, 2, 3, 4, 5, 6], 2))
    assert [w.seq.id for w in s.schedule()] == [9]
    assert cache.hit_tokens == 0 and cache.queried_tokens == 0 and alloc.refcount[cache.match([1, 2, 3, 4])[0]] == 1


def test_first_token_times_price_each_step_once():
    cost = CostModel()
    history = [[(0, 0, 5, True), (1, 0, 3, False)], [(0, 5, 1, False), (1, 3, 2, True)]]
    first = first_token_times(history, cost)
    t1 = cost.step_time(8, 8)
    assert first == {0: t1, 1: t1 + cost.step_time(3, 11)}       # sequence 1 samples only in step 2


def test_lpm_admits_the_longest_cached_prefix_first():
    """order="lpm" admits by cached pages (2 > 1 > 0), ties in arrival order; "fcfs" by arrival."""
    admitted = {}
    for order in ("fcfs", "lpm"):
        alloc = BlockAllocator(16, 4)
        cache = RadixCache(alloc)
        _cached(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
        s = Scheduler(alloc, max_tokens=64, max_seqs=1, prefix_cache=cache, order=order)
        for i, prompt in enumerate([[9] * 5, [1, 2, 3, 4, 9], [7] * 5, [1, 2, 3, 4, 5, 6, 7, 8, 9]]):
            s.add(Sequence(i, prompt, 1))
        plans = _drive(s)
        admitted[order] = [p[0][0] for p in plans if p[0][2] > 1 or p[0][1] > 0]    # each prefill's sequence
    assert admitted["fcfs"] == [0, 1, 2, 3]
    assert admitted["lpm"] == [3, 1, 0, 2]


# ---------------------------------------------------------------- random workloads

def _fake_token(seq) -> int:
    """A deterministic stand-in for the model: depends on the choice and its tokens so far."""
    return (sum(seq.tokens) * 31 + len(seq.tokens) * 7 + seq.choice * 13) % 40 + 1


def _run_workload(rng: random.Random, max_steps: int = 4000) -> dict:
    """One random workload through the real scheduler, with a fake KV store: slot (page, offset) holds
    the token written at that position. Checks after every step that each running sequence's pages
    hold exactly its own tokens, that waiting sequences hold no pages, and the allocator's invariant."""
    P = rng.choice([1, 2, 4, 8])
    num_pages = rng.randint(6, 40)
    alloc = BlockAllocator(num_pages, P)
    cache = RadixCache(alloc) if rng.random() < 0.7 else None
    s = Scheduler(alloc, max_tokens=rng.choice([1, 3, 8, 64]), max_seqs=rng.choice([1, 2, 4, 16]),
                  chunk=rng.choice([None, 1, 3, 7]), prefix_cache=cache, policy=rng.choice(["continuous"] * 3 + ["static"]),
                  cache_after_prefill=rng.random() < 0.5, order="lpm" if cache is not None and rng.random() < 0.5 else "fcfs")
    prefixes = [[rng.randint(41, 60) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    store: dict[tuple[int, int], int] = {}
    requests, arrivals = [], {}
    n_req = rng.randint(1, 12)
    for i in range(n_req):
        prompt = rng.choice(prefixes) + [rng.randint(41, 60) for _ in range(rng.randint(1, 10))]
        new = rng.randint(1, 12)
        while alloc.pages_for(len(prompt) + new) > num_pages:                  # what check_request refuses
            new -= 1
            if new == 0:
                prompt, new = prompt[:P], 1
        forks = rng.choice([0, 0, 0, 1, 2]) if s.max_seqs >= 3 else 0
        arrivals[i] = rng.randint(0, 30)
        requests.append(Sequence(i, prompt, new, forks=forks))
    next_id, everyone = n_req, list(requests)
    for step in range(max_steps):
        for r in requests:
            if arrivals[r.id] == step:
                s.add(r)
        if not s.has_work() and step > max(arrivals.values()):
            break
        for q in list(s.running) + list(s.waiting):
            if rng.random() < 0.01:                                          # a client goes away
                for x in [q, *q.children]:
                    s.finish(x, "abort")
                q.forks = 0
        works = s.schedule()
        if s.has_work():
            assert works or not s.running and not s.waiting, "work waiting but nothing scheduled"
        assert all(not q.table for q in s.waiting)
        for src, dst in s.copies:                                            # copy-on-write, before writes
            for off in range(P):
                if (src, off) in store:
                    store[(dst, off)] = store[(src, off)]
        for w in works:
            for j, t in enumerate(w.tokens):
                p = w.start + j
                store[(w.seq.table[p // P], p % P)] = t
            s.computed(w)
        for w in works:
            if not w.sample or w.seq.finished:
                continue
            fam = [w.seq]
            if w.seq.forks:
                ids = list(range(next_id, next_id + w.seq.forks))
                next_id += len(ids)
                fam += s.fork(w.seq, ids)
                everyone += fam[1:]
            for q in fam:
                q.tokens.append(_fake_token(q))
                if len(q.generated) >= q.max_new_tokens:
                    s.finish(q)
        for q in s.running:                                                  # every page holds its own tokens
            for p in range(q.num_computed):
                assert store.get((q.table[p // P], p % P)) == q.tokens[p], f"seq {q.id} reads a wrong slot at {p}"
        alloc.check()
    else:
        raise AssertionError(f"not finished after {max_steps} steps: waiting {len(s.waiting)}, running {len(s.running)}")
    assert all(q.finished for q in everyone)
    assert alloc.num_used == (cache.cached_pages if cache else 0)
    if cache is not None:
        cache.clear()
    assert alloc.num_used == 0
    return {"preemptions": s.preemptions, "forks": sum(len(q.children) for q in requests),
            "hits": cache.hit_tokens if cache else 0, "steps": step}


def test_random_workloads_finish_and_return_every_page():
    """300 seeded workloads: pool sizes, page sizes, budgets, chunks, seats, shared prefixes, forks,
    arrivals, aborts. The totals show the cases really happened (preemptions, forks, cache hits)."""
    totals = {"preemptions": 0, "forks": 0, "hits": 0}
    for seed in range(300):
        out = _run_workload(random.Random(seed))
        for k in totals:
            totals[k] += out[k]
    assert totals["preemptions"] > 100 and totals["forks"] > 50 and totals["hits"] > 100, totals


def test_fork_shares_pages_and_copies_the_partial_one():
    alloc = BlockAllocator(16, 4)
    s = Scheduler(alloc, max_tokens=64)
    parent = Sequence(0, list(range(1, 11)), 3, forks=2)                  # 10 tokens: pages 0, 1 full, 2 partial
    s.add(parent)
    (w,) = s.schedule()
    s.computed(w)
    kids = s.fork(parent, [1, 2])
    assert [alloc.refcount[p] for p in parent.table] == [3, 3, 3]
    for q in [parent, *kids]:
        q.tokens.append(q.choice + 50)
    works = s.schedule()
    assert len(works) == 3 and len(s.copies) == 2                         # two of three copy page 2; the last owns it
    assert [alloc.refcount[p] for p in parent.table[:2]] == [3, 3]
    assert len({q.table[2] for q in [parent, *kids]}) == 3
