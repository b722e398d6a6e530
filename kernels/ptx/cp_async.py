"""``cp.async`` commit and wait groups, emulated; and a timeline model of a multi-stage pipeline.

The PTX ISA (``nvidia2025ptx``, "Data Movement and Conversion Instructions: cp.async",
"cp.async.commit_group", "cp.async.wait_group") defines, per thread:

* ``cp.async`` starts a copy from global to shared memory and returns at once; the copy is not
  ordered with anything else the thread does and its bytes may land at any time until the thread
  waits for it;
* ``cp.async.commit_group`` closes all the thread's cp.async operations issued since the last
  commit into one *group* (a commit with nothing pending makes an empty group);
* ``cp.async.wait_group N`` blocks until at most the N most recent groups are still pending, so
  every older group has completed and its bytes are visible to the thread;
  ``cp.async.wait_all`` is ``commit_group`` then ``wait_group 0``.

:class:`AsyncCopyUnit` holds that state for one thread. By default it is *lazy*: a copy lands at
the last moment the ISA allows (when a wait forces it), which is the schedule that exposes a
missing or too-weak wait; ``eager=True`` lands every copy at once, the schedule under which such a
bug hides. A correct program gives the same answer under both.

:func:`pipeline_timeline` is a model, not a measurement: a tile's copy takes a fixed latency, copies
share one memory pipe of fixed transfer time per tile, compute takes a fixed time per tile. Its
latencies are inputs the caller chooses and labels.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

import torch

from kernels.ptx.mbarrier import MAX_COUNT, Deadlock, MBarrier, MBarrierError


class _Copy:
    """One issued cp.async: its destination and the bytes it will write; lands at most once."""

    def __init__(self, dst: torch.Tensor, data: torch.Tensor):
        self.dst, self.data, self.landed = dst, data, False

    def land(self) -> None:
        if not self.landed:
            self.dst.copy_(self.data)
            self.landed = True


class AsyncCopyUnit:
    """One thread's cp.async state: its copies in issue order, the uncommitted ones, the queue of
    committed groups, and the ``cp.async.mbarrier.arrive`` arrivals still waiting for their copies."""

    def __init__(self, *, eager: bool = False):
        self.eager = eager
        self.issued: list[_Copy] = []
        self.uncommitted: list[_Copy] = []
        self.groups: deque[list[_Copy]] = deque()
        self.trackers: list[tuple[list[_Copy], MBarrier]] = []   # (copies it waits for, barrier to arrive on)
        self.log: list[str] = []

    def cp_async(self, dst: torch.Tensor, src: torch.Tensor, src_bytes: int | None = None) -> int:
        """Start copying ``src`` (global) into ``dst`` (a view of shared memory); return the copy's
        index for :meth:`land`. ``src_bytes`` is PTX's src-size operand: only the first ``src_bytes``
        bytes are read from ``src`` and the rest of ``dst`` is zero-filled (0 reads nothing), how a
        kernel masks a tile's tail."""
        if dst.shape != src.shape:
            raise ValueError(f"cp_async: dst shape {tuple(dst.shape)} differs from src shape {tuple(src.shape)}")
        nbytes = src.numel() * src.element_size()
        if nbytes not in (4, 8, 16) and nbytes % 16:
            raise ValueError(f"cp_async copies 4, 8 or 16 bytes per instruction (or 16-byte multiples here), got {nbytes}")
        if src_bytes is None:
            landed = src.clone()                     # the source is read at issue in this model
        else:
            if not 0 <= src_bytes <= nbytes or src_bytes % src.element_size():
                raise ValueError(f"cp_async: src_bytes must be a multiple of {src.element_size()} in 0..{nbytes}, got {src_bytes}")
            keep = src_bytes // src.element_size()
            landed = torch.zeros_like(src).flatten()
            landed[:keep] = src.flatten()[:keep]     # bytes past src_bytes are never read
            landed = landed.view_as(src)
        copy = _Copy(dst, landed)
        self.issued.append(copy)
        self.uncommitted.append(copy)
        self.log.append(f"cp.async {nbytes} B" + ("" if src_bytes is None else f", src-size {src_bytes}"))
        if self.eager:
            self._land(copy)
        return len(self.issued) - 1

    def _land(self, copy: _Copy) -> None:
        """Land one copy; every arrival whose tracked copies have now all landed happens."""
        copy.land()
        ready = [t for t in self.trackers if all(c.landed for c in t[0])]
        self.trackers = [t for t in self.trackers if not all(c.landed for c in t[0])]
        for _, bar in ready:
            bar.arrive()

    def land(self, i: int) -> None:
        """Land the ``i``-th issued copy now. The copies of one thread are not ordered among
        themselves, so any of them may land first; a schedule that lands them out of order is one the
        hardware may choose."""
        if not 0 <= i < len(self.issued) or self.issued[i].landed:
            raise ValueError(f"copy {i} is not in flight")
        self._land(self.issued[i])

    def commit_group(self) -> None:
        self.groups.append(self.uncommitted)
        self.uncommitted = []
        self.log.append(f"commit_group -> {len(self.groups)} pending")

    def wait_group(self, n: int) -> None:
        """Complete the oldest groups until at most ``n`` are pending."""
        if n < 0:
            raise ValueError(f"wait_group N needs N >= 0, got {n}")
        while len(self.groups) > n:
            for copy in self.groups.popleft():
                if not copy.landed:
                    self._land(copy)
        self.log.append(f"wait_group {n} -> {len(self.groups)} pending")

    def wait_all(self) -> None:
        self.commit_group()
        self.wait_group(0)

    def mbarrier_arrive(self, bar: MBarrier, *, noinc: bool) -> None:
        """``cp.async.mbarrier.arrive[.noinc]`` on ``bar`` (the mbarrier chapter's
        :class:`~kernels.ptx.mbarrier.MBarrier`): an arrival made once every cp.async this thread
        issued before it (committed or not) has landed. With ``.noinc`` it is the thread's arrival and
        counts against ``bar``'s expected count; without it the pending count is first raised by one,
        so the asynchronous arrival nets to zero and the thread must still arrive itself."""
        if not noinc:
            if bar.pending + 1 > MAX_COUNT:
                raise MBarrierError(f"cp.async.mbarrier.arrive takes the pending count past {MAX_COUNT}")
            bar.pending += 1
        copies = [c for c in self.issued if not c.landed]
        if copies:
            self.trackers.append((copies, bar))
        else:
            bar.arrive()                              # nothing in flight: the arrival happens at once
        self.log.append(f"cp.async.mbarrier.arrive{'.noinc' if noinc else ''} -> tracks {len(copies)} copies")

    def wait_mbarrier(self, bar: MBarrier, parity: int) -> None:
        """``mbarrier.try_wait.parity`` in a loop, for this one thread: land the copies its pending
        arrivals on ``bar`` track (lazily, as late as the ISA allows), which makes those arrivals, then
        require the phase; no other thread can complete it here, so a missing arrival is a
        :class:`Deadlock`."""
        while not bar.try_wait_parity(parity):
            mine = next((t for t in self.trackers if t[1] is bar), None)
            if mine is None:
                raise Deadlock(f"mbarrier wait on parity {parity} would never return: "
                               f"{bar.pending} of {bar.expected} arrivals missing")
            for copy in mine[0]:
                if not copy.landed:
                    self._land(copy)

    @property
    def pending(self) -> int:
        return len(self.groups)


def tile_sums_ref(x: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Sum of each row of ``x`` (n_tiles, tile) over its elements below ``n`` (counted in the
    flattened ``x``; all of them by default): what the pipelined kernel computes."""
    flat = x.float().flatten().clone()
    if n is not None:
        flat[n:] = 0.0
    return flat.view(x.shape).sum(dim=1)


def pipelined_tile_sums(x: torch.Tensor, stages: int = 3, *, n: int | None = None, wait: int | None = None,
                        eager: bool = False) -> torch.Tensor:
    """The loop of ``kernels/cuda/cp_async.cu``, emulated: sum each tile after staging it in shared memory.

    Shared memory is a ring of ``stages`` tile buffers, filled with NaN (stale bytes). The prologue
    issues tiles 0 .. stages-2 (one group each); iteration i waits with ``wait_group(stages - 2)``
    (tile i has landed), sums tile i, then issues tile i + stages - 1 into the slot tile i - 1 used.
    ``n`` (the elements of the flattened ``x`` that may be read) masks the tail as the kernel does:
    tile j's copy passes the bytes below ``n`` as its src-size and is zero-filled past them.
    ``wait`` overrides the wait depth, to show what a wrong one does.
    """
    if stages < 2:
        raise ValueError(f"a pipeline needs stages >= 2 (one buffer being filled, one being read), got {stages}")
    if x.dim() != 2:
        raise ValueError(f"x must be (n_tiles, tile), got shape {tuple(x.shape)}")
    depth = stages - 2 if wait is None else wait
    n_tiles, tile = x.shape
    if n is not None and not 0 <= n <= x.numel():
        raise ValueError(f"n must be in 0..{x.numel()} (the elements of x), got {n}")
    smem = torch.full((stages, tile), float("nan"), dtype=x.dtype)
    unit = AsyncCopyUnit(eager=eager)
    out = torch.empty(n_tiles, dtype=torch.float32)

    def issue(j: int) -> None:                       # tile j into slot j % stages
        valid = None if n is None else min(max(n - j * tile, 0), tile) * x.element_size()
        unit.cp_async(smem[j % stages], x[j], valid)

    for j in range(stages - 1):                      # prologue: stages-1 tiles in flight
        if j < n_tiles:
            issue(j)
        unit.commit_group()
    for i in range(n_tiles):
        unit.wait_group(depth)                       # tile i is in smem[i % stages]
        out[i] = smem[i % stages].float().sum()      # compute on the staged tile
        j = i + stages - 1                           # refill the slot tile i-1 used
        if j < n_tiles:
            issue(j)
        unit.commit_group()                          # possibly empty: keeps the group count regular
    unit.wait_group(0)
    return out


def mbarrier_tile_sums(x: torch.Tensor, stages: int = 3, *, arrive_first: bool = False, eager: bool = False) -> torch.Tensor:
    """The loop of ``cp_async_mbarrier_tile_sums``, for one thread: each slot has a ``full``
    barrier of count 1; a tile's copy is followed by ``cp.async.mbarrier.arrive.noinc`` on its
    slot's barrier, and the sum of tile i waits on that barrier's phase (i // stages) & 1 instead of
    a group. ``arrive_first`` is the broken variant that arrives before issuing the copy: the
    arrival tracks nothing of the tile, so the wait passes before the tile has landed."""
    if stages < 2:
        raise ValueError(f"a pipeline needs stages >= 2 (one buffer being filled, one being read), got {stages}")
    if x.dim() != 2:
        raise ValueError(f"x must be (n_tiles, tile), got shape {tuple(x.shape)}")
    n_tiles, tile = x.shape
    smem = torch.full((stages, tile), float("nan"), dtype=x.dtype)
    full = [MBarrier(1) for _ in range(stages)]
    unit = AsyncCopyUnit(eager=eager)
    out = torch.empty(n_tiles, dtype=torch.float32)

    def issue(j: int) -> None:
        if arrive_first:
            unit.mbarrier_arrive(full[j % stages], noinc=True)
        unit.cp_async(smem[j % stages], x[j])
        if not arrive_first:
            unit.mbarrier_arrive(full[j % stages], noinc=True)

    for j in range(min(stages - 1, n_tiles)):        # prologue: no commit groups
        issue(j)
    for i in range(n_tiles):
        unit.wait_mbarrier(full[i % stages], (i // stages) & 1)   # tile i has landed in smem[i % stages]
        out[i] = smem[i % stages].float().sum()
        if i + stages - 1 < n_tiles:
            issue(i + stages - 1)                    # refill the slot tile i-1 used
    return out


# ----------------------------------------------------------------------------------------------
# cp.async into an mbarrier across threads: kernels/cuda/mbarrier_cp_async.cu, emulated (mbarrier chapter)


ARRIVALS = ("cp.async.noinc", "cp.async+arrive", "cp.async", "arrive")


def cp_async_tile_sum(x: torch.Tensor, arrival: str = "cp.async.noinc", land_order: list[int] | None = None) -> float:
    """Emulate ``cp_async_arrive_sum`` of ``kernels/cuda/mbarrier_cp_async.cu``: the sum of ``x``
    (threads, elements per thread), copied into NaN-filled shared memory by one cp.async per thread,
    then summed by a consumer that waits on ``full`` (initialised with one arrival per thread).

    ``arrival`` is what each copying thread does after its copy:

    * ``"cp.async.noinc"``: ``cp.async.mbarrier.arrive.noinc`` (the kernel's choice);
    * ``"cp.async+arrive"``: ``cp.async.mbarrier.arrive`` then ``mbarrier.arrive`` (also correct);
    * ``"cp.async"``: ``cp.async.mbarrier.arrive`` alone: each asynchronous arrival nets to zero,
      so the phase never completes (:class:`Deadlock`);
    * ``"arrive"``: a plain ``mbarrier.arrive``: it does not wait for the copy, so the phase completes
      before the bytes land and the consumer sums NaN.

    Copies land as late as the consumer's wait allows, in ``land_order`` (default: thread order).
    """
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_COUNT:
        raise ValueError(f"x must be (threads, elements per thread) with 1..{MAX_COUNT} threads, got {tuple(x.shape)}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    threads = x.shape[0]
    order = list(range(threads)) if land_order is None else list(land_order)
    if sorted(order) != list(range(threads)):
        raise ValueError(f"land_order must be a permutation of range({threads})")
    tile = torch.full_like(x, float("nan"))
    full = MBarrier(threads)
    copier = [AsyncCopyUnit() for _ in range(threads)]
    for t, unit in enumerate(copier):                  # every copying thread issues, reports, leaves
        unit.cp_async(tile[t], x[t])
        if arrival == "arrive":
            full.arrive()
        else:
            unit.mbarrier_arrive(full, noinc=arrival == "cp.async.noinc")
            if arrival == "cp.async+arrive":
                full.arrive()
    in_flight = list(order)
    while not full.try_wait_parity(0):                 # the consumer's wait; copies land only now
        if not in_flight:
            raise Deadlock(f"consumer waits on full parity 0: every copy landed, {full.pending} arrivals still pending")
        copier[in_flight[0]].land(0)
        in_flight.pop(0)
    total = float(tile.double().sum())
    for t in in_flight:                                # the rest land before the kernel exits
        copier[t].land(0)
    return total


# ----------------------------------------------------------------------------------------------
# Timeline model


@dataclass
class Timeline:
    stages: int
    copy_issue: list[float] = field(default_factory=list)
    copy_done: list[float] = field(default_factory=list)
    compute_start: list[float] = field(default_factory=list)
    compute_end: list[float] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.compute_end[-1] if self.compute_end else 0.0

    @property
    def compute_busy(self) -> float:
        """Fraction of the run the compute units are busy."""
        busy = sum(e - s for s, e in zip(self.compute_start, self.compute_end))
        return busy / self.total if self.total else 0.0


def pipeline_timeline(n_tiles: int, stages: int, *, latency: float, transfer: float, compute: float) -> Timeline:
    """Event times of an ``stages``-deep cp.async pipeline over ``n_tiles`` tiles (model, any time unit).

    * copy j is issued at t=0 for the prologue tiles (j < stages-1), otherwise when compute of tile
      j - stages + 1 starts (the wait for it has returned and its slot's previous tile is consumed);
    * copy j completes at max(issue_j + latency, done_{j-1} + transfer): a fixed latency, and one
      memory pipe that moves one tile per ``transfer``;
    * compute of tile i starts at max(end_{i-1}, done_i) and takes ``compute``.

    With stages=1 there is no overlap: each tile is copied, waited for, then computed.
    Steady state: one tile per max(compute, transfer, (latency + ...) / (stages - 1)), see
    :func:`steady_state_period`.
    """
    if stages < 1 or n_tiles < 1:
        raise ValueError(f"need stages >= 1 and n_tiles >= 1, got {stages} and {n_tiles}")
    for name, v in (("latency", latency), ("transfer", transfer), ("compute", compute)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    tl = Timeline(stages)
    issue = [None] * n_tiles
    done = [None] * n_tiles

    def start_copy(j, t):
        issue[j] = t
        prev = done[j - 1] if j > 0 else float("-inf")
        done[j] = max(t + latency, prev + transfer)

    ahead = max(stages - 1, 1) if stages > 1 else 0
    for j in range(min(ahead, n_tiles)):
        start_copy(j, 0.0)
    end_prev = 0.0
    for i in range(n_tiles):
        if issue[i] is None:                 # stages == 1: copy only after the previous compute
            start_copy(i, end_prev)
        start = max(end_prev, done[i])
        j = i + stages - 1
        if stages > 1 and j < n_tiles and issue[j] is None:
            start_copy(j, start)
        tl.compute_start.append(start)
        tl.compute_end.append(start + compute)
        end_prev = start + compute
    tl.copy_issue, tl.copy_done = list(issue), list(done)
    return tl


def steady_state_period(stages: int, *, latency: float, transfer: float, compute: float) -> float:
    """Time per tile once the pipeline is full.

    With S >= 2 stages, copy i+S-1 is issued when compute i starts, and compute i+S-1 cannot start
    before that copy is done: (S-1) periods >= latency. Also a period >= compute and >= transfer.
    So P = max(compute, transfer, latency / (S - 1)). With S = 1: P = max(latency, transfer) + compute.
    """
    if stages == 1:
        return max(latency, transfer) + compute
    return max(compute, transfer, latency / (stages - 1))


# ----------------------------------------------------------------------------------------------
# SASS: where a copy's bytes pass


_LDG = re.compile(r"\bLDG\.[\w.]+ (R\d+), ")
_STS = re.compile(r"\bSTS\.[\w.]+ \[[^\]]*\], (R\d+)")


def staged_registers(sass: str) -> set[str]:
    """Registers that a global load (``LDG``) writes and a shared store (``STS``) reads in one
    function's SASS: the registers a register-staged copy passes its bytes through. Empty for
    ``LDGSTS``, whose destination is a shared-memory address."""
    loaded = {m.group(1) for m in map(_LDG.search, sass.splitlines()) if m}
    stored = {m.group(1) for m in map(_STS.search, sass.splitlines()) if m}
    return loaded & stored
