"""KV allocators (kernels.kvcache.allocator): property tests of fork / copy-on-write and of the hybrid
window allocator (hypothesis state machines, each shown to catch a deliberately broken variant), the
page-copy kernel against torch indexing, and its sm90a build at Llama 3 70B's size."""
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test

from kernels import inspect as ki
from kernels.kvcache import allocator as A

MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=30, suppress_health_check=[HealthCheck.too_slow])
BROKEN_SETTINGS = settings(MACHINE_SETTINGS, phases=(Phase.generate,))     # finding it is the test; no shrinking
SEEN = {"copy_on_write": 0, "window_frees": 0}                              # the machines reach the cases that matter


# ---------------------------------------------------------------- fork and copy-on-write

def sequences_machine(**variant):
    class Sequences(RuleBasedStateMachine):
        """allocate / append / fork / free on 10 pages of 3 positions; the model is each sequence's tokens."""
        seqs = Bundle("seqs")

        def __init__(self):
            super().__init__()
            self.s = A.PagedSequences(10, 3, **variant)
            self.model: dict[int, list[int]] = {}
            self.next_id = 0

        def _new_id(self):
            self.next_id += 1
            return self.next_id - 1

        @rule(target=seqs, n=st.integers(0, 7))
        def allocate(self, n):
            sid = self._new_id()
            tokens = [1000 * sid + i for i in range(n)]
            try:
                self.s.add(sid, tokens)
            except A.OutOfPages:
                return sid                      # refused: nothing changed, the id stays unknown
            self.model[sid] = tokens
            return sid

        @rule(sid=seqs, token=st.integers(0, 99))
        def append(self, sid, token):
            if sid not in self.model:
                return
            copies = len(self.s.copies)
            try:
                page, _ = self.s.append(sid, token)
            except A.OutOfPages:
                return
            SEEN["copy_on_write"] += len(self.s.copies) - copies
            self.model[sid].append(token)
            assert self.s.alloc.refcount[page] == 1, "a write landed in a shared page"

        @rule(target=seqs, parent=seqs)
        def fork(self, parent):
            child = self._new_id()
            if parent in self.model:
                self.s.fork(parent, child)
                self.model[child] = list(self.model[parent])
            return child

        @rule(sid=consumes(seqs))
        def free(self, sid):
            if sid in self.model:
                self.s.free(sid)
                del self.model[sid]

        @invariant()
        def pages_are_free_or_counted(self):
            self.s.check()                      # count == table entries; free list == count 0; free + used == total

        @invariant()
        def no_shared_write(self):
            assert self.s.shared_writes == 0, "a write landed in a shared page"

        @invariant()
        def contents_are_preserved(self):
            for sid, tokens in self.model.items():
                assert self.s.read(sid) == tokens, f"sequence {sid} reads back other tokens"

    return Sequences


def test_fork_and_copy_on_write_keep_their_invariants():
    SEEN["copy_on_write"] = 0
    run_state_machine_as_test(sequences_machine(), settings=MACHINE_SETTINGS)
    assert SEEN["copy_on_write"] > 0, "no example appended to a shared partial page"


@pytest.mark.parametrize("variant, symptom", [({"fork_incref": False}, "table entries"),
                                              ({"copy_on_write": False}, "shared page")])
def test_the_property_test_catches_a_broken_allocator(variant, symptom):
    with pytest.raises(AssertionError, match=symptom):
        run_state_machine_as_test(sequences_machine(**variant), settings=BROKEN_SETTINGS)


def test_copy_on_write_example():
    s = A.PagedSequences(8, 4)
    s.add(0, [1, 2, 3, 4, 5, 6])                # pages: full, then 2 of 4 slots
    s.fork(0, 1)
    assert s.alloc.refcount[s.tables[0][0]] == 2 and s.tables[0] == s.tables[1]
    s.append(1, 7)                              # shared partial last page: copied first
    s.append(0, 8)                              # now private again: written in place
    assert s.read(0) == [1, 2, 3, 4, 5, 6, 8] and s.read(1) == [1, 2, 3, 4, 5, 6, 7]
    assert s.copies == [(s.tables[0][1], s.tables[1][1])] and s.tables[0][0] == s.tables[1][0]
    s.free(0)
    s.free(1)
    assert s.alloc.num_free == 8


def test_unknown_and_duplicate_sequences_are_refused():
    s = A.PagedSequences(4, 2)
    s.add(0, [1])
    with pytest.raises(KeyError, match="already exists"):
        s.add(0, [2])
    with pytest.raises(KeyError, match="does not exist"):
        s.append(5, 1)
    with pytest.raises(A.OutOfPages):
        s.add(1, list(range(9)))


# ---------------------------------------------------------------- hybrid: full and window groups

P, WINDOWS = 4, [None, 6, 9]


def hybrid_machine(**variant):
    class Hybrid(RuleBasedStateMachine):
        """add / extend / free on 40 pages of 4 positions, a full group and windows of 6 and 9."""
        seqs = Bundle("seqs")

        def __init__(self):
            super().__init__()
            self.h = A.HybridAllocator(40, P, WINDOWS, **variant)
            self.next_id = 0

        @rule(target=seqs, n=st.integers(0, 12))
        def add(self, n):
            sid, self.next_id = self.next_id, self.next_id + 1
            try:
                self.h.add(sid, n)
            except A.OutOfPages:
                self.h.free(sid)
            return sid

        @rule(sid=seqs, n=st.integers(1, 9))
        def extend(self, sid, n):
            if sid in self.h.tables:
                free = self.h.alloc.num_free
                try:
                    self.h.extend(sid, n)
                except A.OutOfPages:
                    assert self.h.alloc.num_free == free           # refused: nothing allocated
                    return
                held = sum(self.h.held(sid, g) for g in range(len(WINDOWS)))
                SEEN["window_frees"] += sum(len(t) for t in self.h.tables[sid]) - held

        @rule(sid=consumes(seqs))
        def free(self, sid):
            if sid in self.h.tables:
                self.h.free(sid)

        @invariant()
        def counts_match_tables(self):
            self.h.check()

        @invariant()
        def window_groups_hold_only_the_window(self):
            for sid, L in self.h.lengths.items():
                assert self.h.held(sid, 0) == -(-L // P)
                for g, w in enumerate(WINDOWS[1:], start=1):
                    assert self.h.held(sid, g) <= math.ceil(w / P) + 1, "a window group holds too many pages"
                    first_needed = max(0, L - w + 1) // P       # pages from here on are still read
                    assert all(p is not None for p in self.h.tables[sid][g][first_needed:])

    return Hybrid


def test_hybrid_allocator_keeps_its_invariants():
    SEEN["window_frees"] = 0
    run_state_machine_as_test(hybrid_machine(), settings=MACHINE_SETTINGS)
    assert SEEN["window_frees"] > 0, "no example slid a window past a page"


def test_the_property_test_catches_a_window_group_that_never_frees():
    with pytest.raises(AssertionError, match="too many pages"):
        run_state_machine_as_test(hybrid_machine(free_window_pages=False), settings=BROKEN_SETTINGS)


def test_vllm_design_doc_example():
    """hybrid_kv_cache_manager.md: block 16, window 32, 112 tokens, one full and two window groups: 11 blocks."""
    h = A.HybridAllocator(64, 16, [None, 32, 32])
    h.add(0, 112)
    assert [h.held(0, g) for g in range(3)] == [7, 2, 2] and h.alloc.num_used == 11


def test_vllm_groups_gemma3_27b():
    """52 window layers and 10 full: groups of 10, the last window group 2 layers and 8 padding."""
    types = (["sliding"] * 5 + ["full"]) * 10 + ["sliding"] * 2
    groups = A.vllm_layer_groups(types)
    assert groups == [("sliding", 10)] * 5 + [("sliding", 2), ("full", 10)]
    lb = 2 * 16 * 128 * 2
    full = A.hybrid_kv_bytes(4096, ["full"] * 62, window=1024, page_size=16, layer_bytes_per_token=lb)
    assert full == 62 * 4096 * lb
    ideal = A.hybrid_kv_bytes(4096, types, window=1024, page_size=16, layer_bytes_per_token=lb)
    grouped = A.hybrid_kv_bytes(4096, types, window=1024, page_size=16, layer_bytes_per_token=lb, grouped=True)
    assert ideal < grouped < full


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="windows"):
        A.HybridAllocator(4, 2, [0])


# ---------------------------------------------------------------- page sizes, sharing layers

def test_page_size_costs_trade_waste_for_table_and_tile():
    lengths = [1, 5, 16, 17, 100, 333]
    rows = A.page_size_costs(lengths, [1, 2, 4, 8, 16, 32, 64], kv_bytes_per_token=1024, kernel_tile=16)
    assert rows[0]["waste"] == 0 and rows[0]["tile_fill"] == 1 / 16
    assert all(a["waste"] <= b["waste"] for a, b in zip(rows, rows[1:]))          # doubling P never wastes less
    assert all(a["table_bytes_per_token"] >= b["table_bytes_per_token"] for a, b in zip(rows, rows[1:]))
    assert rows[4]["iterations"] == sum(-(-L // 16) for L in lengths) == rows[6]["iterations"]
    assert rows[6]["tile_fill"] == 1
    with pytest.raises(ValueError, match="page sizes"):
        A.page_size_costs(lengths, [0], kv_bytes_per_token=1, kernel_tile=1)



def test_request_length_pmf_is_the_convolution_of_two_geometrics():
    n, p = A.request_length_pmf(3.0, 7.5)
    assert abs(float(p.sum()) - 1) < 1e-12 and abs(float((n * p).sum()) - 10.5) < 1e-9     # E[I + O]
    geo = lambda mean, k: (1 / mean) * (1 - 1 / mean) ** (k - 1)                             # P(X = k), k >= 1
    for length in (2, 3, 9, 40):
        direct = sum(geo(3.0, i) * geo(7.5, length - i) for i in range(1, length))
        assert abs(float(p[n == length]) - direct) < 1e-15
    n2, p2 = A.request_length_pmf(5.0, 5.0)                                                 # the equal-means form
    assert abs(float((n2 * p2).sum()) - 10) < 1e-9
    assert abs(float(p2[n2 == 4]) - sum(geo(5.0, i) * geo(5.0, 4 - i) for i in range(1, 4))) < 1e-15
    for bad in ({"mean_prompt": 0.5, "mean_output": 3}, {"mean_prompt": 3, "mean_output": float("nan")}):
        with pytest.raises(ValueError, match="must be a number >= 1"):
            A.request_length_pmf(**bad)


def test_expected_page_waste_matches_the_list_measure_and_the_geometric_closed_form():
    lengths = [1, 5, 16, 17, 100, 333, 5]
    values, counts = torch.tensor(lengths).unique(return_counts=True)
    for P in (1, 3, 16, 64):
        by_list = A.page_size_costs(lengths, [P], kv_bytes_per_token=1, kernel_tile=1)[0]["waste"]
        assert abs(A.expected_page_waste(values, counts / len(lengths), P) - by_list) < 1e-12
    # one geometric length of mean m: ceil(L / P) is geometric with parameter 1 - q^P, so
    # E[P ceil(L / P)] = P / (1 - q^P) and the waste is 1 - (1 - q^P) / (P (1 - q))
    m, q = 40.0, 1 - 1 / 40.0
    k = torch.arange(1, 3000)
    pk = (1 - q) * q ** (k - 1).double()
    for P in (1, 16, 64):
        assert abs(A.expected_page_waste(k, pk, P) - (1 - (1 - q ** P) / (P * (1 - q)))) < 1e-9

    def floor_waste(lengths, probs, P):                     # broken: pages rounded down, as if a tail were free
        L = lengths.double()
        return float(1 - (probs * L).sum() / (probs * P * torch.clamp(torch.floor(L / P), min=1)).sum())
    assert abs(floor_waste(k, pk, 16) - (1 - (1 - q ** 16) / (16 * (1 - q)))) > 0.1
    with pytest.raises(ValueError, match="page_size"):
        A.expected_page_waste(k, pk, 0)
    with pytest.raises(ValueError, match="matching"):
        A.expected_page_waste(k, pk[:-1], 16)

def test_cross_layer_sharing_bytes():
    assert A.cache_planes(6, "cla", 2) == [0, 0, 1, 1, 2, 2]
    assert A.cache_planes(6, "yoco") == [0, 1, 2, 3, 3, 3]
    base = A.kv_bytes_per_token_shared(32, 8, 128)
    assert base == 128 * 1024
    assert A.kv_bytes_per_token_shared(32, 8, 128, "cla", share=2) == base // 2
    assert A.kv_bytes_per_token_shared(32, 8, 128, "cla", share=3) == 2 * 11 * 8 * 128 * 2
    assert A.kv_bytes_per_token_shared(32, 8, 128, "yoco") == base // 32
    assert A.kv_bytes_per_token_shared(32, 8, 128, "yoco", self_decoder_grows=True) == 17 * base // 32
    with pytest.raises(ValueError, match="scheme"):
        A.cache_planes(4, "mqa")


# ---------------------------------------------------------------- the kernel

def _pool_in_canaries(shape, dtype, gen):
    """A contiguous pool inside a NaN-filled buffer: an unmasked write past a page shows as a changed canary."""
    n = math.prod(shape)
    buf = torch.full((n + 64,), float("nan"), dtype=dtype)
    pool = buf[32:32 + n].view(shape)
    pool.copy_(torch.randn(shape, generator=gen).to(dtype))
    return buf, pool


@pytest.mark.parametrize("shape, pairs, block", [
    ((2, 2, 7, 2, 4, 5), [(1, 4), (2, 0), (6, 5)], 16),        # 40 elements a page: 3 tiles, the last partial
    ((1, 2, 5, 3, 2, 3), [(0, 4)], 64),                         # a tile larger than the page
    ((3, 2, 9, 1, 16, 8), [(8, 1), (3, 2), (4, 0), (5, 6)], 32),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_pages_matches_torch_indexing(shape, pairs, block, dtype):
    buf, pool = _pool_in_canaries(shape, dtype, torch.Generator().manual_seed(0))
    ref = A.copy_pages_ref(pool, torch.tensor(pairs))
    A.copy_pages(pool, pairs, block=block)
    assert torch.equal(pool, ref)
    assert buf[:32].isnan().all() and buf[32 + pool.numel():].isnan().all()


def test_broken_copy_of_only_the_first_tile_is_caught():
    pool = torch.randn(2, 2, 6, 2, 4, 5)
    ref = A.copy_pages_ref(pool, torch.tensor([(1, 3)]))
    A.copy_pages(pool, [(1, 3)], block=16, _whole_page=False)
    assert not torch.equal(pool, ref)


def test_copy_pages_refuses_bad_input():
    pool = torch.zeros(2, 2, 4, 1, 2, 2)
    with pytest.raises(ValueError, match="planes, 2, num_pages"):
        A.copy_pages(torch.zeros(2, 4, 1, 2, 2), [(0, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        A.copy_pages(pool.transpose(4, 5), [(0, 1)])
    with pytest.raises(ValueError, match="page ids"):
        A.copy_pages(pool, [(0, 4)])
    with pytest.raises(ValueError, match="never a source"):
        A.copy_pages(pool, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="distinct"):
        A.copy_pages(pool, [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="block"):
        A.copy_pages(pool, [(0, 1)], block=24)
    assert A.copy_pages(pool, []) is pool


def test_copy_on_write_through_the_kernel_keeps_every_sequence_readable():
    """The allocator's copy-on-write pairs, applied by the kernel to a real (planes, 2, pages, Hkv, P, D)
    pool before each write: every sequence gathers back the K/V of its own tokens in every plane."""
    planes, N, Hkv, Pg, D = 2, 12, 2, 3, 4
    s = A.PagedSequences(N, Pg)
    pool = torch.zeros(planes, 2, N, Hkv, Pg, D)

    def kv(token):                                              # (planes, 2, Hkv, D): what a token writes
        return torch.arange(planes * 2 * Hkv * D, dtype=torch.float32).view(planes, 2, Hkv, D) + 100 * token

    def append(sid, token):
        before = len(s.copies)
        page, off = s.append(sid, token)
        A.copy_pages(pool, s.copies[before:], block=16)
        pool[:, :, page, :, off] = kv(token)

    s.add(0, [])
    for t in (1, 2, 3, 4):
        append(0, t)
    s.fork(0, 1)
    s.fork(0, 2)
    for t in (5, 6, 7, 8):
        for sid in (0, 1, 2):
            append(sid, 10 * sid + t)
    assert len(s.copies) == 2                                   # the last partial page, once per late writer
    for sid in (0, 1, 2):
        tokens = s.read(sid)
        table = s.tables[sid]
        got = torch.stack([pool[:, :, table[i // Pg], :, i % Pg] for i in range(len(tokens))])
        assert torch.equal(got, torch.stack([kv(t) for t in tokens]))


@pytest.fixture(scope="module")
def builds():
    jobs = A.compile_jobs()
    jobs["broken: int32 offsets"] = A.launch_job(80, 8, 128, 16, wide=False)
    return jobs, dict(zip(jobs, ki.compile_triton_many(list(jobs.values()), archs=("sm90",))))


def test_compile_jobs_at_llama3_70b_do_not_spill(builds):
    jobs, out = builds
    for label, b in out.items():
        assert b["sm90"].arch.nvcc_arch == "sm_90a"
        assert b["sm90"].spills == 0 and b["sm90"].metadata["stack_bytes"] == 0, f"{label} spills"
        assert jobs[label].grid == (64, 160)                    # (pairs, 80 layers x K and V)


def test_pages_move_in_16_byte_vectors(builds):
    """8 bf16 elements per thread and the divisibility hints of a real launch: LDG/STG.E.128 only."""
    jobs, out = builds
    b = out["Llama-3-70B, page 16, BLOCK 1024"]["sm90"]
    ops = ki.instructions(b.sass, "sass")
    assert ops["LDG.E.128"] > 0 and ops["STG.E.128"] > 0
    assert not [op for op in ops if op.startswith("STG") and op != "STG.E.128"]


def _widths(job, build, arg):
    runtime_args = [n for n, kind in job.signature.items() if kind != "constexpr"]
    return ki.param_product_widths(build, runtime_args.index(arg))


def test_plane_offsets_are_64bit_and_the_int32_variant_is_caught(builds):
    jobs, out = builds
    assert 80 * 2 * 4096 * 8 * 16 * 128 > 2 ** 31                # the pool's elements at this size
    for label in jobs:
        w = _widths(jobs[label], out[label]["sm90"], "stride_plane")
        assert w == ({32} if label.startswith("broken") else {64}), label
