"""CUDA graphs for the engine's decode step: count its launches, pad it to fixed batch sizes, replay it.

A decode step of a small batch is hundreds of small kernels (the engine's ``PagedRunner.forward``:
87 kernel ops and host-to-device copies per layer of the tiny GPT, and one sync), each launched by
the CPU. A CUDA graph records the launches of one step once (stream capture) and replays them with
one launch call, so the per-launch CPU cost is paid at capture, not per step (CUDA Programming
Guide, "CUDA Graphs").
A replay re-runs the *same* kernels on the *same* addresses with the *same* shapes, hence the
rules this module follows:

1. no CPU synchronisation inside the step (``.item()``, ``int(t)``, ``print(t)``): the reference
   paged attention reads ``int(seqlens.max())`` once per layer; :func:`static_decode_attention`
   attends over the whole table width instead and masks by length;
2. no data-dependent shapes: the step's shapes depend only on its bucket ``S`` and the table
   width ``W``, never on the lengths;
3. no tensors created or allocated per step outside the graph's pool, and no changed pointers: the
   step's inputs live in static buffers (:class:`DecodeBuffers`) that are *copied into*; a new
   tensor bound in their place is never read by a replay (:class:`EagerGraph` shows it on a CPU);
4. batch sizes are bucketed as vLLM does (:func:`capture_sizes`): a batch of B sequences runs in
   the smallest captured size S >= B, rows B..S-1 padded (their K, V go to a scratch page nobody
   reads); a batch above the largest size runs eagerly (vLLM) or is refused.

:class:`GraphedDecodeRunner` wraps the engine's :class:`~kernels.serving.engine.PagedRunner`: a step
whose runs are all single tokens goes through the static-buffer step of its bucket, captured as a
CUDA graph on a GPU and run eagerly (the same tensors, the same ops) on a CPU; any other step goes
to the wrapped runner (vLLM's ``FULL_DECODE_ONLY`` mode). :class:`GraphedEngine` is the engine
with that runner. The engine itself builds each step's inputs on the CPU, so on a GPU only the
graphed step runs there (capture needs a runner whose model and cache are on the device).

:func:`count_ops` counts what a function dispatches (compute kernels, host-to-device tensor
creations, device-to-host syncs, views that launch nothing) with a ``TorchDispatchMode``, and
:func:`eager_step_time` / :func:`graphed_step_time` model what the launches cost on a GPU from a
per-launch cost the caller supplies (not measured here: no GPU); :func:`scheduled_step_time` adds
the host's scheduling, in order or overlapped with the GPU (asynchronous scheduling), and
:func:`capture_seconds` the start-up time of capturing every size.
"""
from __future__ import annotations

import math
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import inspect as ki
from kernels.attention.paged import _paged_args, _paged_decode_kernel
from kernels.model.gpt import GPT, add_rms_norm_torch, rms_norm_torch, rope
from kernels.serving.engine import Engine, EngineConfig, PagedRunner
from kernels.serving.kv_cache import PagedKVCache
from kernels.serving.scheduler import Work


class BatchTooLargeError(ValueError):
    """A decode batch larger than the largest captured size, with ``on_too_large="raise"``."""


# ---------------------------------------------------------------- capture sizes (vLLM's rule)

def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int | None = None, decode_query_len: int = 1) -> list[int]:
    """vLLM's default CUDA-graph batch sizes (vllm-project/vllm@09f030ea, vllm/config/vllm.py,
    ``VllmConfig._set_cudagraph_sizes``): the largest is min(2 * max_num_seqs * decode_query_len, 512),
    capped by the token budget; the sizes are 1, 2, 4, then every multiple of 8 below 256, then every
    multiple of 16 from 256, up to the largest."""
    for name, v in (("max_num_seqs", max_num_seqs), ("decode_query_len", decode_query_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"capture_sizes: {name} must be an int >= 1, got {v!r}")
    largest = min(max_num_seqs * decode_query_len * 2, 512)
    if max_num_batched_tokens is not None:
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"capture_sizes: max_num_batched_tokens must be None or an int >= 1, "
                             f"got {max_num_batched_tokens!r}")
        largest = min(largest, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8))
    sizes += list(range(256, largest + 1, 16))
    return sizes


def check_sizes(sizes) -> tuple[int, ...]:
    """Sorted, distinct, positive ints; a clear error otherwise."""
    sizes = tuple(sizes)
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be a non-empty sequence of ints >= 1, got {sizes!r}")
    return tuple(sorted(set(sizes)))


def bucket_for(batch: int, sizes) -> int | None:
    """The smallest size >= batch (the graph a batch of ``batch`` rows replays), or None above the largest."""
    return next((s for s in check_sizes(sizes) if s >= batch), None)


# ---------------------------------------------------------------- counting what a step dispatches

# aten ops that create a tensor from host data (torch.tensor(list)): a host-to-device copy on a GPU
_HOST_TO_DEVICE = {"aten::lift_fresh"}
# aten ops that read a device value on the host (.item(), int(t), bool(t)): a sync on a GPU
_SYNCS = {"aten::_local_scalar_dense"}
# ops that launch no kernel: allocation without initialisation, metadata
_NO_KERNEL = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::promote_types", "aten::_unsafe_view",
              "aten::result_type"}


@dataclass
class OpCount:
    """What one call dispatched to aten, by kind. ``kernels``: ops that run a kernel (on a GPU about
    one launch each; a library call may launch more than one); ``host_to_device``: tensors made from
    Python data; ``syncs``: device values read on the host; ``views``: ops that only change metadata."""
    kernels: int = 0
    host_to_device: int = 0
    syncs: int = 0
    views: int = 0
    ops: Counter = field(default_factory=Counter)          # aten op name -> calls
    shapes: list = field(default_factory=list)             # (op, output shape) of every kernel op, in order

    @property
    def launches(self) -> int:
        """Kernels plus host-to-device copies: the work the CPU submits to the GPU queue."""
        return self.kernels + self.host_to_device


def _kind(func) -> str:
    name = func.name().split(".")[0]
    if name in _SYNCS:
        return "syncs"
    if name in _HOST_TO_DEVICE:
        return "host_to_device"
    if func.is_view or name in _NO_KERNEL:
        return "views"
    return "kernels"


class _Counter(TorchDispatchMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # nothing runs under torch.compile here: without the dynamo wrapper torch._dynamo is never
        # imported (seconds of a notebook's budget)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _kind(func)
        setattr(self.count, kind, getattr(self.count, kind) + 1)
        self.count.ops[func.name()] += 1
        if kind == "kernels" and isinstance(out, torch.Tensor):
            self.count.shapes.append((func.name(), tuple(out.shape)))
        return out


def count_ops(fn: Callable, *args, **kwargs) -> tuple[OpCount, object]:
    """Run ``fn(*args, **kwargs)`` under a dispatch mode that counts every aten op it reaches (after
    PyTorch's composite ops are decomposed, so ``linear`` counts as its ``t`` and ``mm``);
    returns (the count, fn's result)."""
    count = OpCount()
    with _Counter(count):
        result = fn(*args, **kwargs)
    return count, result


def engine_decode_ops(model: GPT, batch: int, *, page_size: int = 16, prompt_len: int = 5) -> OpCount:
    """What ``PagedRunner.forward`` dispatches for one decode step of ``batch`` sequences (after
    their prefill), on a throwaway engine."""
    eng = Engine(model, EngineConfig(page_size=page_size, max_seqs=max(batch, 1)), record_history=False)
    for b in range(batch):
        eng.add([(7 * b + j) % model.config.vocab_size for j in range(prompt_len)], 2)
    eng.step()                                                          # the prefills
    works = eng.scheduler.schedule()                                    # the decode step's runs
    if len(works) != batch or any(len(w.tokens) != 1 for w in works):
        raise RuntimeError(f"engine_decode_ops: expected {batch} decode runs, got {[len(w.tokens) for w in works]}")
    count, _ = count_ops(eng.runner.forward, works)
    return count


# ---------------------------------------------------------------- the static-shape decode step

def static_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                            lens: torch.Tensor) -> torch.Tensor:
    """Paged decode attention with shapes fixed by the inputs' shapes alone: every row attends over
    all W pages of its table row, positions j >= lens[b] masked (probability exactly 0). The same
    result as :func:`kernels.attention.paged.paged_decode_attention_ref`, without its
    ``int(seqlens.max())``. q (S, Hq, D), pages (num_pages, Hkv, P, D), table (S, W), lens (S,) >= 1."""
    S, Hq, D = q.shape
    Hkv, P = k_pages.shape[1], k_pages.shape[2]
    W = table.shape[1]
    def gather(pages):                                                   # (S, Hq, W * P, D)
        t = pages[table.long()].permute(0, 2, 1, 3, 4).reshape(S, Hkv, W * P, D)
        return t.repeat_interleave(Hq // Hkv, dim=1)
    k, v = gather(k_pages), gather(v_pages)
    valid = torch.arange(W * P, device=q.device)[None, :] < lens.long()[:, None]      # (S, W * P): j < L_b
    scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(D)                      # (S, Hq, W * P)
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bhsd->bhd", probs, v)                                   # (S, Hq, D)


def static_decode_attention_kernel(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                                   lens: torch.Tensor) -> torch.Tensor:
    """The same attention by the course's Triton paged decode kernel, launched without
    :func:`~kernels.attention.paged.check_paged_inputs` (its host reads of the lengths and page ids
    are syncs; :meth:`GraphedDecodeRunner.replay` checks the batch's Python lists before they are
    copied in). The grid
    (S, Hkv) is fixed by the shapes; each program's loop over its own length is read on the device,
    which a graph allows: work that depends on data inside a kernel, not shapes on the host."""
    out = torch.empty_like(q)                                            # (S, Hq, D)
    grid, args, kwargs = _paged_args(q, k_pages, v_pages, table, lens, out, window=None)   # the launcher's tiles
    _paged_decode_kernel[grid](*args, **kwargs)
    return out


@dataclass
class DecodeBuffers:
    """The static inputs and output of one bucket of S rows; a step reads and writes only these.

    ids (S,) int64 tokens; pos (S,) int64 their positions; table (S, W) int32 page tables;
    lens (S,) int32 = pos + 1; logits (S, V) the output. Rows past the batch are padding: token 0 at
    position 0 of a scratch page no sequence owns."""
    ids: torch.Tensor
    pos: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def empty(cls, size: int, width: int, vocab: int, scratch_page: int, device) -> "DecodeBuffers":
        return cls(ids=torch.zeros(size, dtype=torch.long, device=device),
                   pos=torch.zeros(size, dtype=torch.long, device=device),
                   table=torch.full((size, width), scratch_page, dtype=torch.int32, device=device),
                   lens=torch.ones(size, dtype=torch.int32, device=device),
                   logits=torch.zeros(size, vocab, device=device))

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def fill(self, ids: list[int], pos: list[int], tables: list[list[int]], scratch_page: int) -> None:
        """Copy a batch of B <= S rows into the buffers (in place: the addresses never change) and
        pad rows B..S-1."""
        S, W = self.table.shape
        B = len(ids)
        if not 1 <= B <= S or len(pos) != B or len(tables) != B:
            raise ValueError(f"fill: need 1 <= B <= {S} rows with one position and one table each, got "
                             f"{B} ids, {len(pos)} positions, {len(tables)} tables")
        if any(len(t) > W for t in tables):
            raise ValueError(f"fill: a page table is longer than the buffers' width W={W}")
        pad = S - B
        rows = [t + [scratch_page] * (W - len(t)) for t in tables] + [[scratch_page] * W] * pad
        self.ids.copy_(torch.tensor(ids + [0] * pad))
        self.pos.copy_(torch.tensor(pos + [0] * pad))
        self.table.copy_(torch.tensor(rows, dtype=torch.int32))
        self.lens.copy_(torch.tensor([p + 1 for p in pos] + [1] * pad, dtype=torch.int32))


@torch.no_grad()
def decode_step(model: GPT, cache: PagedKVCache, buf: DecodeBuffers, *, use_kernels: bool = False) -> torch.Tensor:
    """One decode step over the S rows of ``buf``, pure tensor ops (capturable): the same math as
    ``PagedRunner.forward`` for single-token runs. Writes each row's K, V at slot
    (table[b, pos // P], pos % P) and returns the logits (S, V). ``use_kernels``: attention by
    the Triton kernel (:func:`static_decode_attention_kernel`)."""
    attend = static_decode_attention_kernel if use_kernels else static_decode_attention
    cfg = model.config
    Hq, Hkv, D, P = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cache.page_size
    S = buf.size
    page = buf.table.gather(1, (buf.pos // P)[:, None]).squeeze(1).long()   # (S,) physical page of each new slot
    off = buf.pos % P                                                  # (S,)
    x = model.wte(buf.ids)                                             # (S, C)
    for layer, blk in enumerate(model.blocks):
        u = rms_norm_torch(x, blk.norm1.weight, cfg.norm_eps)
        q = rope(blk.attn.wq(u).view(1, S, Hq, D).transpose(1, 2), buf.pos[None], cfg.rope_theta)
        k = rope(blk.attn.wk(u).view(1, S, Hkv, D).transpose(1, 2), buf.pos[None], cfg.rope_theta)
        v = blk.attn.wv(u).view(S, Hkv, D)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)                # (S, H, D)
        cache.write(layer, page, off, k, v)
        a = attend(q, cache.k[layer], cache.v[layer], buf.table, buf.lens)
        h, hn = add_rms_norm_torch(x, blk.attn.wo(a.reshape(S, Hq * D)), blk.norm2.weight, cfg.norm_eps)
        x = h + blk.mlp(hn)
    return rms_norm_torch(x, model.norm_f.weight, cfg.norm_eps) @ model.wte.weight.T    # (S, V)


class EagerGraph:
    """What a replay does, on any device: re-run ``step`` on the tensors bound when it was made,
    writing into the output buffer. A CUDA graph replays recorded kernels on recorded addresses;
    binding these tensors at construction is the same contract, so a new tensor put in a buffer's
    place is never read (the stale-input bug), while a copy into the buffer is."""

    def __init__(self, step: Callable[[], torch.Tensor], out: torch.Tensor):
        self._step, self._out = step, out

    def replay(self) -> None:
        self._out.copy_(self._step())


def _cuda_graph(step: Callable[[], torch.Tensor], pool, warmup: int = 2):
    """Capture ``step`` (warmed up on a side stream, as torch.cuda.graph's documentation asks) into a
    torch.cuda.CUDAGraph sharing ``pool``; returns (graph, its static output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


# ---------------------------------------------------------------- the graphed runner and engine

ON_TOO_LARGE = ("eager", "raise")


class GraphedDecodeRunner:
    """Wraps a :class:`PagedRunner` (whose cache has a page ``scratch_page`` that the allocator never
    hands out): decode-only steps of B <= max(sizes) rows replay the bucket of size ``bucket_for(B)``;
    other steps (any run of more than one token) and, with ``on_too_large="eager"``, batches above the
    largest size go to the wrapped runner. ``capture=True`` captures one CUDA graph per size (a GPU
    and a model and cache on it are needed); ``capture=False`` replays eagerly (:class:`EagerGraph`);
    None: capture when the cache is on a CUDA device. ``stats`` counts replays per size and eager steps."""

    def __init__(self, runner: PagedRunner, sizes=(1, 2, 4, 8), *, scratch_page: int, capture: bool | None = None,
                 on_too_large: str = "eager"):
        if on_too_large not in ON_TOO_LARGE:
            raise ValueError(f"on_too_large must be one of {ON_TOO_LARGE}, got {on_too_large!r}")
        self.sizes = check_sizes(sizes)
        pages = runner.cache.k[0].shape[0]
        if not isinstance(scratch_page, int) or not 0 <= scratch_page < pages:
            raise ValueError(f"scratch_page must be a page of the runner's cache, in [0, {pages}), got {scratch_page!r}")
        device = runner.cache.k[0].device
        if capture is None:
            capture = device.type == "cuda"
        if capture and not torch.cuda.is_available():
            raise ValueError("capture=True needs a CUDA GPU (torch.cuda.is_available() is False here); "
                             "use capture=False to run the same static-buffer step eagerly")
        if capture and (device.type != "cuda" or runner.model.wte.weight.device.type != "cuda"):
            raise ValueError("capture=True needs the runner's model and KV cache on the CUDA device, "
                             f"got cache on {device} and model on {runner.model.wte.weight.device}")
        self.runner, self.capture, self.on_too_large = runner, capture, on_too_large
        self.scratch_page = scratch_page
        self.width = -(-runner.model.config.block_size // runner.P)          # W: pages of the longest context
        self.buffers: dict[int, DecodeBuffers] = {}
        self.graphs: dict[int, object] = {}
        self.stats: Counter = Counter()
        pool = torch.cuda.graph_pool_handle() if capture else None
        for size in sorted(self.sizes, reverse=True):                        # largest first: the pool is reused
            buf = DecodeBuffers.empty(size, self.width, runner.model.config.vocab_size, scratch_page, device)
            step = self._step_of(buf)
            if capture:
                graph, buf.logits = _cuda_graph(step, pool)
            else:
                graph = EagerGraph(step, buf.logits)
            self.buffers[size], self.graphs[size] = buf, graph

    def _step_of(self, buf: DecodeBuffers) -> Callable[[], torch.Tensor]:
        """The step on the tensors ``buf`` holds now (bound, as a capture binds their addresses)."""
        model, cache, bound, kernels = self.runner.model, self.runner.cache, replace(buf), self.runner.use_kernels
        return lambda: decode_step(model, cache, bound, use_kernels=kernels)

    @property
    def cache(self) -> PagedKVCache:
        return self.runner.cache

    @property
    def k_pages(self) -> list[torch.Tensor]:
        return self.runner.cache.k

    @property
    def v_pages(self) -> list[torch.Tensor]:
        return self.runner.cache.v

    def replay(self, ids: list[int], pos: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step of B rows through bucket ``bucket_for(B)``: copy into its buffers, replay,
        return the B rows of logits (a copy: the buffer is overwritten by the next replay)."""
        size = bucket_for(len(ids), self.sizes)
        if size is None:
            raise BatchTooLargeError(f"a decode batch of {len(ids)} sequences exceeds the largest captured size "
                                     f"{self.sizes[-1]}: add a larger size or use on_too_large='eager'")
        self._check(pos, tables)
        buf = self.buffers[size]
        buf.fill(ids, pos, tables, self.scratch_page)
        self.graphs[size].replay()
        self.stats[f"replay {size}"] += 1
        return buf.logits[:len(ids)].clone()

    def _check(self, pos: list[int], tables: list[list[int]]) -> None:
        """On the host lists, before the copy: each position inside its row's pages, each page id
        inside the cache (the kernel reads what the table says, unchecked)."""
        pages, P = self.cache.k[0].shape[0], self.runner.P
        for b, (p, t) in enumerate(zip(pos, tables)):
            if not 0 <= p < len(t) * P:
                raise ValueError(f"replay: row {b} has position {p} outside its {len(t)} pages of {P}")
            if any(not 0 <= page < pages for page in t):
                raise ValueError(f"replay: row {b}'s page table {t} has ids outside [0, {pages})")

    @torch.no_grad()
    def forward(self, works: list[Work]) -> torch.Tensor:
        """The engine's runner interface: logits (R, V) of the runs with ``sample`` set, in order."""
        decode_only = all(len(w.tokens) == 1 for w in works)
        too_large = len(works) > self.sizes[-1]
        if not decode_only or (too_large and self.on_too_large == "eager"):
            self.stats["eager (mixed step)" if not decode_only else "eager (too large)"] += 1
            return self.runner.forward(works)
        logits = self.replay([w.tokens[0] for w in works], [w.start for w in works], [w.seq.table for w in works])
        return logits[[i for i, w in enumerate(works) if w.sample]]


class GraphedEngine(Engine):
    """The engine with a :class:`GraphedDecodeRunner`: its runner's cache has one page more than the
    allocator hands out (``config.num_pages``), the scratch page of the padding rows."""

    def __init__(self, model: GPT, config: EngineConfig = EngineConfig(), *, sizes=(1, 2, 4, 8),
                 capture: bool | None = None, on_too_large: str = "eager", **kwargs):
        super().__init__(model, config, **kwargs)
        inner = PagedRunner(model, config.num_pages + 1, config.page_size, use_kernels=config.use_kernels)
        self.runner = GraphedDecodeRunner(inner, sizes, scratch_page=config.num_pages, capture=capture,
                                          on_too_large=on_too_large)


# ---------------------------------------------------------------- what the launches cost: a model

def launches_per_step(per_layer: int, fixed: int, layers: int) -> int:
    """Launches of one eager decode step: ``per_layer`` for each of ``layers`` blocks plus ``fixed``
    (embedding, final norm, LM head, the step's input copies)."""
    return per_layer * layers + fixed


def eager_step_time(launches: int, launch_s: float, gpu_s: float, *, views: int = 0, view_s: float = 0.0,
                    node_s: float = 0.0) -> float:
    """An eager step when the CPU issues launches asynchronously: the GPU cannot finish before the
    CPU has issued the last kernel, nor before its own work is done. The host pays ``launch_s`` per
    launch and ``view_s`` per view (no kernel, but Python and the dispatcher); the GPU pays its
    roofline time ``gpu_s`` plus ``node_s`` per kernel (a tiny kernel's fixed cost on the device):
    t = max(n t_launch + v t_view, t_gpu + n t_node) (the last kernel's tail ignored)."""
    _check_costs(launches=launches, views=views, launch_s=launch_s, view_s=view_s, gpu_s=gpu_s, node_s=node_s)
    return max(launches * launch_s + views * view_s, gpu_s + launches * node_s)


def graphed_step_time(graph_launch_s: float, gpu_s: float, *, launches: int = 0, node_s: float = 0.0) -> float:
    """A replayed step: one launch call on the host, then the GPU runs the ``launches`` nodes, each
    at its roofline share plus ``node_s``: t = max(t_graph, t_gpu + n t_node)."""
    _check_costs(launches=launches, graph_launch_s=graph_launch_s, gpu_s=gpu_s, node_s=node_s)
    return max(graph_launch_s, gpu_s + launches * node_s)


def scheduled_step_time(sched_s: float, host_s: float, device_s: float, *, overlap: bool) -> float:
    """A step whose host first schedules it and prepares its inputs (``sched_s``), then issues its
    launches (``host_s``: n t_launch eager, one graph launch graphed), while the GPU takes ``device_s``.
    In order (the scheduler waits for the step's outputs): t = sched + max(host, device). Overlapped
    (asynchronous scheduling: the next step is scheduled while the GPU runs this one):
    t = max(sched + host, device), so the scheduling hides behind the GPU only where the host's whole
    work is shorter than the GPU's."""
    _check_costs(sched_s=sched_s, host_s=host_s, device_s=device_s)
    return max(sched_s + host_s, device_s) if overlap else sched_s + max(host_s, device_s)


def capture_seconds(sizes: int, launches: int, launch_s: float, *, warmups: int = 1, graph_sets: int = 1) -> float:
    """Host time to capture ``graph_sets`` graphs for each of ``sizes`` batch sizes: each capture runs
    the step's Python ``warmups`` times eagerly and once recorded, ``launches`` calls at ``launch_s``
    each. Instantiation (cudaGraphInstantiate) is not counted: a lower bound."""
    _check_costs(sizes=sizes, launches=launches, launch_s=launch_s, warmups=warmups, graph_sets=graph_sets)
    return graph_sets * sizes * (warmups + 1) * launches * launch_s


def _check_costs(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")


# ---------------------------------------------------------------- the CUDA C++ chain (kernels/cuda/graph_chain.cu)

CHAIN_SOURCE = "graph_chain"


def build_chain_program(out_dir: str | Path | None = None, *, arch: str | int = "sm90") -> Path:
    """Compile and link ``kernels/cuda/graph_chain.cu`` into an executable with the course's nvcc (the
    CUDA runtime linked statically); no GPU needed to build, one needed to run it."""
    target = ki.parse_arch(arch)
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="graph_chain_"))
    exe = out_dir / "graph_chain"
    source = ki.cuda_source(CHAIN_SOURCE)
    proc = subprocess.run([str(ki.tool("nvcc")), f"-arch={target.nvcc_arch}", "-O3", "-std=c++17", str(source),
                           "-o", str(exe)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ki.CompileError(f"nvcc {source.name} -o {exe.name} failed:\n{proc.stderr.strip()}")
    return exe


def run_chain_program(exe: str | Path, kernels: int = 64, reps: int = 200) -> dict[str, float]:
    """Run the built program (a GPU is needed) and parse its one line of results."""
    if not torch.cuda.is_available():
        raise RuntimeError("run_chain_program needs a CUDA GPU; the program can be built here, not run")
    proc = subprocess.run([str(exe), str(kernels), str(reps)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{exe} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_chain_line(proc.stdout)


CHAIN_KEYS = ("kernels", "nodes", "reps", "eager_us_per_chain", "graph_us_per_chain", "same")


def parse_chain_line(text: str) -> dict[str, float]:
    """The program's one line of results, ``kernels N nodes N reps R eager_us_per_chain T graph_us_per_chain T
    same 0|1``, as a dict; a line without every key is refused (a changed program, a crash mid-line)."""
    words = text.split()
    result = {words[i]: float(words[i + 1]) for i in range(0, len(words) - 1, 2)}
    missing = [k for k in CHAIN_KEYS if k not in result]
    if missing:
        raise ValueError(f"parse_chain_line: no {', '.join(missing)} in {text.strip()[:200]!r}")
    return result
