"""kernels.serving.cuda_graphs: vLLM's capture sizes and buckets; the padded static-buffer decode step
equals the engine's ordinary decode for every batch size up to the largest bucket; the rules a
capture needs (no host syncs, no data-dependent shapes, stable addresses) hold for the static step
and are broken by the engine's; the stale-input bug and a scratch page pointed at a real page are
caught; too-large batches fall back or are refused by name; capture on a CPU is refused by name;
the real capture and the CUDA C++ chain run only on a GPU (skipped here, with the reason)."""
import kernels  # noqa: F401

import pytest
import torch

from kernels import inspect as ki
from kernels.attention.paged import check_paged_inputs, paged_decode_attention_ref
from kernels.model.data import encode
from kernels.model.gpt import GPT, GPTConfig, load_pretrained
from kernels.serving.cuda_graphs import (BatchTooLargeError, DecodeBuffers, GraphedDecodeRunner, GraphedEngine,
                                         bucket_for, build_chain_program, capture_seconds, capture_sizes, count_ops,
                                         decode_step, eager_step_time, engine_decode_ops, graphed_step_time,
                                         launches_per_step, parse_chain_line, run_chain_program,
                                         scheduled_step_time, static_decode_attention,
                                         static_decode_attention_kernel)
from kernels.serving.engine import Engine, EngineConfig, PagedRunner
from kernels.serving.kv_cache import PagedKVCache

PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING LEAR:\nBlow, winds", "O", "First Citizen:\nBefore we",
           "JULIET:\n", "What's in a name?", "Now is the winter"]
SIZES = (1, 2, 4, 8)
TOL = 1e-4      # the engine's own tolerance against one-at-a-time generation (tests/test_serving_engine.py)
NO_GPU = "needs a CUDA GPU: capture and replay (and the CUDA C++ chain) cannot run on a CPU"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


def _pair(model, batch, config=EngineConfig(page_size=8, num_pages=64), new=5, **kw):
    """The ordinary engine and the graphed one, run to completion on the same prompts."""
    plain = Engine(model, config, record_logits=True)
    graphed = GraphedEngine(model, config, record_logits=True, sizes=SIZES, **kw)
    a = [plain.add(encode(p).tolist(), new) for p in PROMPTS[:batch]]
    b = [graphed.add(encode(p).tolist(), new) for p in PROMPTS[:batch]]
    plain.run()
    graphed.run()
    worst = max(float((torch.stack(plain.logits[x.id]) - torch.stack(graphed.logits[y.id])).abs().max())
                for x, y in zip(a, b))
    return a, b, worst, graphed


# ---------------------------------------------------------------- sizes and buckets

def test_capture_sizes_follow_vllms_rule():
    sizes = capture_sizes(256)                                   # largest min(2 * 256, 512) = 512
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert all(b - a == 8 for a, b in zip(sizes[3:34], sizes[4:34]))          # 8 .. 248 in steps of 8
    assert sizes[34:36] == [256, 272] and len(sizes) == 3 + 31 + 17
    assert capture_sizes(3) == [1, 2, 4]                         # largest 6
    assert capture_sizes(64, max_num_batched_tokens=20) == [1, 2, 4, 8, 16]
    assert capture_sizes(8, decode_query_len=2)[-1] == 32        # speculative decoding doubles the largest
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        capture_sizes(8, max_num_batched_tokens=0)


def test_bucket_is_the_smallest_size_at_least_the_batch():
    assert [bucket_for(b, SIZES) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    with pytest.raises(ValueError, match="sizes"):
        bucket_for(1, [])
    with pytest.raises(ValueError, match="sizes"):
        bucket_for(1, [0, 2])


# ---------------------------------------------------------------- the padded step equals the engine's

@pytest.mark.parametrize("batch", range(1, 9))
def test_padded_static_step_equals_the_engines_decode(model, batch):
    a, b, worst, graphed = _pair(model, batch)
    assert [s.generated for s in a] == [s.generated for s in b]
    assert worst < TOL, f"batch {batch}: largest logit difference {worst}"
    assert graphed.runner.stats[f"replay {bucket_for(batch, SIZES)}"] == 4       # every decode step replayed
    assert graphed.runner.stats["eager (mixed step)"] == 1                        # the prefill step


def test_static_attention_equals_the_reference(model):
    torch.manual_seed(0)
    pages = torch.randn(2, 9, 2, 8, 16)                                  # k, v: (pages, Hkv, P, D)
    q = torch.randn(3, 4, 16)
    table = torch.tensor([[3, 1, 8], [0, 2, 5], [7, 7, 7]], dtype=torch.int32)
    lens = torch.tensor([17, 1, 8], dtype=torch.int32)
    ref = paged_decode_attention_ref(q, pages[0], pages[1], table, lens)
    assert (static_decode_attention(q, pages[0], pages[1], table, lens) - ref).abs().max() < 1e-5


def test_triton_attention_without_host_checks_equals_the_static_reference():
    torch.manual_seed(1)
    pages = torch.randn(2, 9, 2, 8, 16)
    q = torch.randn(4, 4, 16)
    table = torch.tensor([[3, 1, 8], [0, 2, 5], [7, 7, 7], [8, 8, 8]], dtype=torch.int32)   # last row: padding
    lens = torch.tensor([17, 1, 24, 1], dtype=torch.int32)
    want = static_decode_attention(q, pages[0], pages[1], table, lens)
    assert (static_decode_attention_kernel(q, pages[0], pages[1], table, lens) - want).abs().max() < 1e-5
    count, _ = count_ops(static_decode_attention_kernel, q, pages[0], pages[1], table, lens)
    assert count.syncs == 0


def test_graphed_runner_with_the_triton_kernel_equals_the_torch_step(model):
    runners = {}
    for kernels_on in (False, True):
        inner = PagedRunner(model, 9, 16, use_kernels=kernels_on)
        torch.manual_seed(2)
        for pool in inner.cache.k + inner.cache.v:
            pool.normal_()
        runners[kernels_on] = GraphedDecodeRunner(inner, (4,), scratch_page=8, capture=False)
    batch = ([5, 6, 7], [20, 3, 33], [[0, 1], [2], [3, 4, 5]])                 # 3 rows in bucket 4
    got, want = runners[True].replay(*batch), runners[False].replay(*batch)
    assert (got - want).abs().max() < TOL


def test_replay_refuses_positions_and_pages_outside_their_ranges(model):
    runner = GraphedDecodeRunner(PagedRunner(model, 9, 16), (2,), scratch_page=8, capture=False)
    with pytest.raises(ValueError, match="position 16 outside its 1 pages"):
        runner.replay([1], [16], [[0]])
    with pytest.raises(ValueError, match=r"ids outside \[0, 9\)"):
        runner.replay([1], [0], [[9]])


def test_a_scratch_page_that_a_sequence_owns_is_caught(model):
    """Broken variant: padding rows writing into page 0 corrupt a real sequence's KV."""
    config = EngineConfig(page_size=8, num_pages=64)
    plain = Engine(model, config, record_logits=True)
    broken = GraphedEngine(model, config, record_logits=True, sizes=SIZES)
    broken.runner.scratch_page = 0                                       # page 0 is the first sequence's
    a = [plain.add(encode(p).tolist(), 5) for p in PROMPTS[:3]]          # 3 rows in bucket 4: one padding row
    b = [broken.add(encode(p).tolist(), 5) for p in PROMPTS[:3]]
    plain.run()
    broken.run()
    worst = max(float((torch.stack(plain.logits[x.id]) - torch.stack(broken.logits[y.id])).abs().max())
                for x, y in zip(a, b))
    assert worst > 100 * TOL


# ---------------------------------------------------------------- what a capture needs

def test_the_engines_step_syncs_and_the_static_step_does_not(model):
    eng_ops = engine_decode_ops(model, 3)
    assert eng_ops.syncs == model.config.n_layer               # int(seqlens.max()) in the reference attention
    assert eng_ops.host_to_device >= 5                          # ids, positions, slots, table, lengths per step
    runner = GraphedDecodeRunner(PagedRunner(model, 9, 16), (4,), scratch_page=8, capture=False)
    static, _ = count_ops(runner.graphs[4].replay)
    assert static.syncs == 0 and static.host_to_device == 0
    q = torch.randn(2, 4, 32)
    kv = torch.zeros(4, 2, 16, 32)
    checks, _ = count_ops(check_paged_inputs, q, kv, kv, torch.zeros(2, 3, dtype=torch.int32),
                          torch.tensor([3, 20], dtype=torch.int32), None)
    assert checks.syncs >= 4                                    # the Triton launcher's input checks read values


def test_the_static_step_runs_on_meta_tensors_and_the_reference_does_not(model):
    """Meta tensors have shapes and no values: a step that runs on them reads nothing on the host
    and has shapes fixed by its inputs' shapes."""
    cfg = model.config
    meta = GPT(cfg).to("meta")
    cache = PagedKVCache(cfg.n_layer, 9, cfg.n_kv_head, 16, cfg.head_dim, device="meta")
    buf = DecodeBuffers.empty(4, 8, cfg.vocab_size, 8, "meta")
    assert decode_step(meta, cache, buf).shape == (4, cfg.vocab_size)
    with pytest.raises(RuntimeError, match="meta"):
        paged_decode_attention_ref(torch.empty(4, 4, 32, device="meta"), cache.k[0], cache.v[0], buf.table, buf.lens)


def test_the_profiler_agrees_on_the_leaf_ops_and_also_records_the_composites(model):
    """torch.profiler records a composite op (aten::linear, aten::matmul) and the ops it calls
    (aten::mm): counting its events counts a GEMM several times. On the leaves both counts agree."""
    from collections import Counter

    eng = Engine(model, EngineConfig(page_size=16))
    for p in PROMPTS[:3]:
        eng.add(encode(p).tolist(), 3)
    eng.step()
    works = eng.scheduler.schedule()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.runner.forward(works)
    events = Counter(e.name for e in prof.events())
    count, _ = count_ops(eng.runner.forward, works)
    for leaf in ("aten::mm", "aten::bmm", "aten::_local_scalar_dense", "aten::lift_fresh", "aten::embedding"):
        assert events[leaf] == count.ops[leaf] > 0, leaf
    assert events["aten::linear"] > 0 and "aten::linear" not in count.ops
    assert sum(events.values()) > 2 * sum(count.ops.values())


def test_launch_count_is_linear_in_depth():
    counts = [engine_decode_ops(GPT(GPTConfig(n_layer=n)).eval(), 2).launches for n in (1, 2, 3)]
    assert counts[2] - counts[1] == counts[1] - counts[0] > 50        # the same launches in every block


def test_static_shapes_do_not_depend_on_the_lengths(model):
    runner = GraphedDecodeRunner(PagedRunner(model, 9, 16), (4,), scratch_page=8, capture=False)
    buf = runner.buffers[4]
    shapes = []
    for pos in ([3, 9], [40, 70]):
        buf.fill([1, 2], pos, [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]], 8)
        shapes.append(count_ops(runner.graphs[4].replay)[0].shapes)
    assert shapes[0] == shapes[1]
    kv = torch.zeros(9, 2, 16, 32)
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    ref = [count_ops(paged_decode_attention_ref, torch.zeros(2, 4, 32), kv, kv, table,
                     torch.tensor(lens, dtype=torch.int32))[0].shapes for lens in ([4, 10], [41, 64])]
    assert ref[0] != ref[1]                                     # the reference's gather width follows max(lens)


def test_buffers_keep_their_addresses_and_a_rebound_tensor_is_never_read(model):
    runner = GraphedDecodeRunner(PagedRunner(model, 9, 16), (2,), scratch_page=8, capture=False)
    buf = runner.buffers[2]
    ptrs = [t.data_ptr() for t in (buf.ids, buf.pos, buf.table, buf.lens, buf.logits)]
    first = runner.replay([10, 11], [0, 0], [[0], [1]])
    second = runner.replay([40, 41], [0, 0], [[0], [1]])
    assert ptrs == [t.data_ptr() for t in (buf.ids, buf.pos, buf.table, buf.lens, buf.logits)]
    assert (first - second).abs().max() > 1.0                   # copied in: the new tokens were read
    buf.ids = torch.tensor([10, 11])                            # bound in the buffer's place, not copied
    runner.graphs[2].replay()
    assert torch.equal(buf.logits[:2], second)                  # the old tokens' logits: stale, silently


# ---------------------------------------------------------------- errors and fallbacks

def test_a_batch_above_the_largest_size_falls_back_by_name(model):
    config = EngineConfig(page_size=8, num_pages=64)
    eng = GraphedEngine(model, config, sizes=(1, 2), record_logits=True)
    plain = Engine(model, config, record_logits=True)
    a = [plain.add(encode(p).tolist(), 3) for p in PROMPTS[:3]]
    b = [eng.add(encode(p).tolist(), 3) for p in PROMPTS[:3]]
    plain.run()
    eng.run()
    assert [s.generated for s in a] == [s.generated for s in b]
    assert eng.runner.stats["eager (too large)"] == 2 and not any(k.startswith("replay") for k in eng.runner.stats)


def test_a_batch_above_the_largest_size_is_refused_when_asked(model):
    eng = GraphedEngine(model, EngineConfig(page_size=8, num_pages=64), sizes=(1, 2), on_too_large="raise")
    for p in PROMPTS[:3]:
        eng.add(encode(p).tolist(), 3)
    eng.step()
    with pytest.raises(BatchTooLargeError, match="3 sequences exceeds the largest captured size 2.*on_too_large"):
        eng.step()


def test_bad_options_are_refused_by_name(model):
    runner = PagedRunner(model, 9, 16)
    with pytest.raises(ValueError, match="on_too_large"):
        GraphedDecodeRunner(runner, scratch_page=8, on_too_large="pad")
    with pytest.raises(ValueError, match="scratch_page"):
        GraphedDecodeRunner(runner, scratch_page=9)
    with pytest.raises(ValueError, match="sizes"):
        GraphedDecodeRunner(runner, (), scratch_page=8)
    buf = DecodeBuffers.empty(2, 3, 256, 8, "cpu")
    with pytest.raises(ValueError, match="fill"):
        buf.fill([1, 2, 3], [0, 0, 0], [[0], [1], [2]], 8)
    with pytest.raises(ValueError, match="width"):
        buf.fill([1], [0], [[0, 1, 2, 3]], 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_capture_on_a_cpu_is_refused_by_name(model):
    with pytest.raises(ValueError, match="capture=True needs a CUDA GPU"):
        GraphedDecodeRunner(PagedRunner(model, 9, 16), scratch_page=8, capture=True)
    with pytest.raises(ValueError, match="capture=True"):
        GraphedEngine(model, EngineConfig(page_size=8, num_pages=64), capture=True)


# ---------------------------------------------------------------- the cost model

def test_cost_model():
    assert launches_per_step(150, 20, 32) == 4820
    assert eager_step_time(1000, 4e-6, 1e-3) == pytest.approx(4e-3)          # launch bound
    assert eager_step_time(100, 4e-6, 1e-3) == pytest.approx(1e-3)           # GPU bound: launches hidden
    assert graphed_step_time(5e-6, 1e-3) == pytest.approx(1e-3)
    # views cost host time though they launch nothing: 100 launches at 4 us + 400 views at 1 us = 0.8 ms
    assert eager_step_time(100, 4e-6, 1e-3, views=400, view_s=1e-6) == pytest.approx(1e-3)   # under the GPU
    assert eager_step_time(100, 4e-6, 1e-4, views=400, view_s=1e-6) == pytest.approx(8e-4)
    # a graph's nodes each cost the GPU node_s: 2000 nodes at 0.9 us add 1.8 ms to a 1 ms roofline
    assert graphed_step_time(5e-6, 1e-3, launches=2000, node_s=0.9e-6) == pytest.approx(2.8e-3)
    assert eager_step_time(2000, 1e-6, 1e-3, node_s=0.9e-6) == pytest.approx(2.8e-3)   # the same floor eager
    for bad in ({"view_s": -1e-6}, {"node_s": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            eager_step_time(10, 1e-6, 1e-3, **bad)
    # scheduling: in order it adds to the step; overlapped it hides only behind a GPU longer than the host
    assert scheduled_step_time(2e-3, 5e-6, 8e-3, overlap=False) == pytest.approx(10e-3)
    assert scheduled_step_time(2e-3, 5e-6, 8e-3, overlap=True) == pytest.approx(8e-3)       # graphed: hidden
    assert scheduled_step_time(2e-3, 70e-3, 8e-3, overlap=True) == pytest.approx(72e-3)     # launch bound: not
    assert scheduled_step_time(2e-3, 70e-3, 8e-3, overlap=False) == pytest.approx(72e-3)
    # 51 sizes, one warm-up and one capture each, 100 launches at 10 us: 0.102 s, twice for two graph sets
    assert capture_seconds(51, 100, 10e-6) == pytest.approx(0.102)
    assert capture_seconds(51, 100, 10e-6, warmups=0, graph_sets=2) == pytest.approx(0.102)
    with pytest.raises(ValueError, match="sched_s"):
        scheduled_step_time(-1.0, 0.0, 0.0, overlap=True)


# ---------------------------------------------------------------- the CUDA C++ chain

def test_chain_output_is_parsed_and_a_partial_line_refused():
    line = "kernels 64 nodes 64 reps 50 eager_us_per_chain 180.250 graph_us_per_chain 40.125 same 1\n"
    assert parse_chain_line(line) == {"kernels": 64, "nodes": 64, "reps": 50, "eager_us_per_chain": 180.25,
                                      "graph_us_per_chain": 40.125, "same": 1}
    with pytest.raises(ValueError, match="graph_us_per_chain, same"):
        parse_chain_line("kernels 64 nodes 64 reps 50 eager_us_per_chain 180.250")


def test_chain_program_compiles_for_sm90_and_links(tmp_path):
    build = ki.compile_cuda("graph_chain", arch="sm90")
    assert "chain_step" in build.metadata["resources"]
    assert build.families("sass")["FFMA"] >= 1 and build.spills == 0
    exe = build_chain_program(tmp_path, arch="sm90")
    assert exe.is_file() and exe.stat().st_size > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_chain_program_runs_and_the_graph_gives_the_same_bits(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    exe = build_chain_program(tmp_path, arch=f"sm{major}{minor}")
    result = run_chain_program(exe, kernels=64, reps=50)
    assert result["same"] == 1 and result["nodes"] == 64


# ---------------------------------------------------------------- real capture (GPU only)

@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_captured_replay_equals_the_eager_static_step(model):
    gpu = load_pretrained().cuda()
    runner = PagedRunner(gpu, 17, 16)
    runner.cache = PagedKVCache(gpu.config.n_layer, 17, gpu.config.n_kv_head, 16, gpu.config.head_dim, device="cuda")
    torch.manual_seed(0)
    for pool in runner.cache.k + runner.cache.v:
        pool.normal_()
    graphed = GraphedDecodeRunner(runner, (1, 2, 4, 8), scratch_page=16, capture=True)
    assert isinstance(graphed.graphs[8], torch.cuda.CUDAGraph)
    for batch in (1, 3, 8):
        ids = list(range(5, 5 + batch))
        pos = [3 + 5 * b for b in range(batch)]                         # <= 38: three pages of 16
        tables = [[(3 * b + j) % 16 for j in range(3)] for b in range(batch)]
        got = graphed.replay(ids, pos, tables)
        buf = DecodeBuffers.empty(batch, graphed.width, gpu.config.vocab_size, 16, "cuda")
        buf.fill(ids, pos, tables, 16)
        with torch.no_grad():
            want = decode_step(gpu, runner.cache, buf)
        assert (got - want).abs().max() < TOL
    buf = graphed.buffers[2]
    before = graphed.replay([1, 2], [3, 4], [[0], [1]])
    buf.ids = torch.tensor([7, 8], device="cuda")               # rebound, not copied: the replay reads the old one
    graphed.graphs[2].replay()
    assert torch.equal(buf.logits[:2], before)
