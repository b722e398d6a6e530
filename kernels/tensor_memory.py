"""Bytes of PyTorch tensors alive over time, measured operation by operation: :class:`TensorPeak`.

A dispatch mode (``TorchDispatchMode``) sees the output of every PyTorch operation, the backward's
included. Each new storage among the outputs is tracked through a weak reference to its C++
storage, so it counts for as long as anything keeps it alive (a view, a tensor saved for backward,
a ``.grad``), not just the Python object that first held it. After every operation the live total
is appended to ``timeline``. Tensors that existed before the block count only if they are passed
in ``track`` (a model's parameters, an optimizer's state); then their frees are seen too.

Exact at the level of storages and deterministic (the same operations allocate the same bytes on
any CPU); blind to memory that is not a tensor's storage (an operator's internal workspace, the
allocator's rounding and caching, the Triton interpreter's NumPy arrays). Used by the LM-head
chapter (the losses' peaks), precision-memory (one training step against its ledger) and
cuda-graphs (the activation pool of a decode step per captured size).

    with TensorPeak(track=model.parameters()) as probe:
        loss = f(x); probe.mark("forward"); loss.backward()
    probe.peak_bytes, probe.timeline, probe.marks, probe.bytes_at_peak(tensors)
"""
from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _counted(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_warm = False


def _warm_up() -> None:
    """Run one operation under a dispatch mode. Its first use imports a good part of torch._dynamo:
    inside a probe, those new objects would make every cycle collection slow (a tenth of a second
    each, hundreds of times), since only the objects that existed at ``__enter__`` are frozen."""
    global _warm
    if not _warm:
        with _PassThrough():
            torch.zeros(1) + 1
        _warm = True


def _storages(args, kwargs) -> set[int]:
    """Addresses of the storages of every tensor among an operation's arguments."""
    return {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {})) if _counted(t)}


class TensorPeak:
    """Peak and timeline of the bytes of tensor storage alive inside a ``with`` block.

    ``timeline[i]``: bytes alive after the i-th operation. ``marks``: (label, index) pairs from
    :meth:`mark`, the number of operations seen when it was called (a phase ends there).
    ``peak_bytes`` and ``peak_index``: the largest entry of the timeline and where it first occurs.
    An output whose storage is one of the operation's inputs' (a view, an in-place result) is not new
    memory. Storage held only by garbage cycles does not count (collected after every operation that
    made new memory: Triton's interpreter leaves such cycles, which a GPU launch would not).
    """

    def __init__(self, track: Iterable[torch.Tensor] = ()):
        probe = self
        self.peak_bytes = 0
        self.peak_index = -1
        self.timeline: list[int] = []                     # live bytes after each operation, in order
        self.marks: list[tuple[str, int]] = []
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}   # storage address -> (weak ref, bytes)
        self._at_peak: list[tuple[StorageWeakRef, int]] = []
        self._track = [t for t in track if _counted(t)]

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                probe._observe(out, _storages(args, kwargs))
                return out

        self._mode = _Mode()

    def mark(self, label: str) -> None:
        """End a phase called ``label`` here: the operations seen so far belong to it and the ones before."""
        self.marks.append((label, len(self.timeline)))

    def bytes_at_peak(self, tensors: Iterable[torch.Tensor | StorageWeakRef]) -> int:
        """Bytes, alive at the peak, of the storages of ``tensors`` (tensors, or weak references to
        storages taken earlier, for tensors that were freed since)."""
        wanted = {(x if isinstance(x, StorageWeakRef) else StorageWeakRef(x.untyped_storage())).cdata
                  for x in tensors if isinstance(x, StorageWeakRef) or _counted(x)}
        return sum(n for ref, n in self._at_peak if ref.cdata in wanted)

    def _add(self, storage) -> bool:
        key = storage.data_ptr()
        # an address may be reused (allocators do): a dead entry there is a new storage
        if key and (key not in self._live or not self._alive(self._live[key][0])):
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            return True
        return False

    def _alive(self, ref: StorageWeakRef) -> bool:
        return not ref.expired()

    def _observe(self, out, inputs: set[int]) -> None:
        grew = False
        for item in tree_leaves(out):
            if _counted(item) and item.untyped_storage().data_ptr() not in inputs:
                grew |= self._add(item.untyped_storage())
        if grew:
            # Only an operation that made new memory can raise the peak, so only then is the cycle
            # collector worth its cost; the objects that existed before the block are frozen.
            gc.collect()
        self._live = {k: v for k, v in self._live.items() if self._alive(v[0])}
        self.timeline.append(sum(n for _, n in self._live.values()))
        if self.timeline[-1] > self.peak_bytes or self.peak_index < 0:
            self.peak_bytes, self.peak_index = self.timeline[-1], len(self.timeline) - 1
            self._at_peak = list(self._live.values())

    def __enter__(self):
        _warm_up()
        gc.collect()
        gc.freeze()
        for t in self._track:
            self._add(t.untyped_storage())
        self._track = []                                  # weak from here on: the block may free them
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._mode.__exit__(*exc)
        finally:
            gc.unfreeze()
