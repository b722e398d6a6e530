"""Thread block clusters and distributed shared memory, emulated: the cluster reduction of
``kernels/cuda/cluster_reduce.cu`` run block by block under a chosen schedule, so that each of its
two cluster barriers can be shown necessary.

Sources: the CUDA C++ Programming Guide (``nvidia2025cudaguide``), "Thread Block Clusters" and
"Distributed Shared Memory": the blocks of a cluster run at the same time, each can read and write
the others' shared memory, and a block's shared memory must not be accessed after the block has
exited, so blocks wait (``cluster.sync()``) until the others are done with it. The PTX ISA
(``nvidia2025ptx``): ``mapa``, ``ld.shared::cluster``, ``barrier.cluster.arrive/wait``.

In the emulation a block is an actor that runs until it reaches a cluster barrier. The schedule
decides who runs first among the blocks that can run: ``"leader_first"`` (rank 0 first) exposes a
read before the others have written; ``"followers_first"`` lets the other blocks finish and exit
first, which exposes a read of an exited block's shared memory. A correct kernel gives the
reference under both.
"""
from __future__ import annotations

import torch

from kernels.gpu import hardware


class DSMError(RuntimeError):
    """A block read the shared memory of a block that has already exited."""


def cluster_sum_ref(x: torch.Tensor, cluster: int, n_per_block: int) -> torch.Tensor:
    """out[c] = sum of the cluster * n_per_block elements of cluster c, in float64."""
    return x.double().reshape(-1, cluster * n_per_block).sum(1)


def _block(rank, x, n_per_block, smem, out, exited, skip, cluster, first_block):
    """One block of ``cluster_sum``: its partial into its shared memory, barrier 1, rank 0 reads
    every partial through DSM, barrier 2, exit (its shared memory is gone)."""
    start = (first_block + rank) * n_per_block
    smem[rank] = x[start: start + n_per_block].double().sum()             # partial = sum of my elements
    if not skip & 1:
        yield "barrier 1"
    if rank == 0:
        total = 0.0
        for peer in range(cluster):                                        # mapa + ld.shared::cluster
            if exited[peer]:
                raise DSMError(f"rank 0 read the shared memory of rank {peer}, which has exited")
            total = total + smem[peer]
        out.append(total)
    if not skip & 2:
        yield "barrier 2"
    exited[rank] = True


def cluster_sum(x: torch.Tensor, cluster: int = 4, n_per_block: int = 1024, *, skip: int = 0,
                schedule: str = "leader_first") -> torch.Tensor:
    """Emulate ``cluster_sum`` over ``x`` (a multiple of cluster * n_per_block elements). Shared
    memory starts as NaN, so a partial read before it is written shows. ``skip`` drops barrier 1
    (bit 0) and/or barrier 2 (bit 1), as the CUDA kernel's argument does."""
    if x.dim() != 1 or x.numel() % (cluster * n_per_block):
        raise ValueError(f"x must be 1-D with a multiple of cluster * n_per_block = {cluster * n_per_block} elements, "
                         f"got shape {tuple(x.shape)}")
    if not 1 <= cluster <= hardware.MAX_CLUSTER_SIZE_NONPORTABLE["sm90"]:
        raise ValueError(f"cluster must be 1..{hardware.MAX_CLUSTER_SIZE_NONPORTABLE['sm90']} "
                         f"({hardware.MAX_CLUSTER_SIZE_PORTABLE} portably), got {cluster}")
    if schedule not in ("leader_first", "followers_first"):
        raise ValueError(f"schedule must be 'leader_first' or 'followers_first', got {schedule!r}")
    results = []
    for c in range(x.numel() // (cluster * n_per_block)):
        smem = [torch.tensor(float("nan"), dtype=torch.float64) for _ in range(cluster)]
        exited = [False] * cluster
        out: list = []
        order = list(range(cluster)) if schedule == "leader_first" else list(range(1, cluster)) + [0]
        actors = {r: _block(r, x, n_per_block, smem, out, exited, skip, cluster, c * cluster) for r in order}
        while actors:                                      # run everyone to the next barrier, in schedule order
            for r in list(actors):
                try:
                    next(actors[r])
                except StopIteration:
                    del actors[r]
        results.append(out[0])
    return torch.stack(results)


# ----------------------------------------------------------------------------------------------
# A multicast ring: kernels/cuda/cluster_multicast.cu's cluster_multicast_sums, block by block


class _Barrier:
    """An mbarrier's phase bookkeeping: ``phases`` completed, ``pending`` arrivals left in this one."""

    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count


def multicast_sums_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out[b, i] = scale[b] * sum(x[i]) for x (n_tiles, tile), in float64."""
    return scale.double()[:, None] * x.double().sum(1)[None, :]


def _producer(x, rings, full, empty, stages, cluster, events):
    """Rank 0's thread 0: wait until every block released slot s, multicast tile i into all of them."""
    for i in range(x.shape[0]):
        s = i % stages
        while empty[s].phases < i // stages:               # round r needs r completed releases of slot s
            yield "wait"
        for b in range(cluster):                            # one copy, written into every block's slot s
            rings[b][s] = x[i].double().clone()
            full[b][s].arrive()                             # complete_tx on each block's full[s]
        events[0] += 1
        yield "copied"


def _consumer(rank, scale, rings, full, empty, stages, n_tiles, out, events):
    """Block ``rank``: wait for tile i in its slot, sum it, arrive on rank 0's empty[s] (remote arrive)."""
    for i in range(n_tiles):
        s = i % stages
        while full[rank][s].phases < i // stages + 1:
            yield "wait"
        out[rank, i] = scale[rank] * rings[rank][s].sum()
        events[0] += 1
        yield "summed"
        empty[s].arrive()
        events[0] += 1
        yield "released"


def multicast_sums(x: torch.Tensor, scale: torch.Tensor, *, stages: int = 2, empty_count: int | None = None,
                   schedule: str = "leader_first") -> torch.Tensor:
    """Emulate ``cluster_multicast_sums`` for one cluster of ``scale.numel()`` blocks: rank 0 loads
    each tile of ``x`` (n_tiles, tile) once into every block's ring slot; each block releases the
    slot by arriving on rank 0's ``empty`` barrier, which expects ``empty_count`` arrivals (the
    cluster size by default; 1, counting only rank 0's own block, is the broken variant).

    Actors (the producer, one consumer per block) take one step at a time; after every step the
    schedule runs the first actor in its priority order that can move: rank 0's producer and
    consumer first ("leader_first") or the other blocks first ("followers_first"). Slots start as
    NaN, so a read of a slot that was never filled shows."""
    cluster = scale.numel()
    if x.dim() != 2 or scale.dim() != 1 or not 1 <= cluster <= hardware.MAX_CLUSTER_SIZE_NONPORTABLE["sm90"]:
        raise ValueError(f"x must be (n_tiles, tile) and scale 1-D, one value per block (1..16 blocks), "
                         f"got {tuple(x.shape)} and {tuple(scale.shape)}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if schedule not in ("leader_first", "followers_first"):
        raise ValueError(f"schedule must be 'leader_first' or 'followers_first', got {schedule!r}")
    n_tiles, tile = x.shape
    rings = [[torch.full((tile,), float("nan"), dtype=torch.float64) for _ in range(stages)] for _ in range(cluster)]
    full = [[_Barrier(1) for _ in range(stages)] for _ in range(cluster)]
    empty = [_Barrier(cluster if empty_count is None else empty_count) for _ in range(stages)]
    out = torch.full((cluster, n_tiles), float("nan"), dtype=torch.float64)
    events = [0]
    actors = {"producer": _producer(x, rings, full, empty, stages, cluster, events)}
    actors.update({r: _consumer(r, scale.double(), rings, full, empty, stages, n_tiles, out, events) for r in range(cluster)})
    order = ["producer", 0, *range(1, cluster)] if schedule == "leader_first" else [*range(1, cluster), "producer", 0]
    while actors:
        for name in [a for a in order if a in actors]:
            before = events[0]
            try:
                next(actors[name])
            except StopIteration:
                del actors[name]
                break
            if events[0] != before:                          # it moved: start again from the first in order
                break
        else:
            raise RuntimeError("deadlock: every actor waits on a barrier no one will complete")
    return out


# ----------------------------------------------------------------------------------------------
# A push reduction: kernels/cuda/cluster_multicast.cu's cluster_sum_push, block by block


class _TxBarrier:
    """An mbarrier with a transaction count: a phase completes when its one arrival has been made
    (rank 0's expect_tx) and the bytes it expects have all landed (tx-count back at zero)."""

    def __init__(self):
        self.pending, self.tx, self.phases = 1, 0, 0

    def _check(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phases, self.pending = self.phases + 1, 1

    def arrive_expect_tx(self, nbytes: int) -> None:
        self.pending -= 1
        self.tx += nbytes
        self._check()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes                                   # may go below zero before the expect_tx
        self._check()


def push_sum_ref(x: torch.Tensor, cluster: int, n_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, number of positive elements) of each cluster's cluster * n_per_block elements."""
    rows = x.double().reshape(-1, cluster * n_per_block)
    return rows.sum(1), (rows > 0).sum(1)


def _pusher(rank, x, n_per_block, first_block, slots, counter, bar):
    """One block of ``cluster_sum_push``: st.async its partial into rank 0's slot[rank] and
    red.async its positive count into rank 0's counter, each completing 4 bytes on rank 0's barrier."""
    start = (first_block + rank) * n_per_block
    part = x[start: start + n_per_block].double()
    yield "computed"
    slots[rank] = part.sum()                                # st.async.shared::cluster ... [slot], partial, [bar]
    bar.complete_tx(4)
    yield "stored"
    counter[0] += int((part > 0).sum())                     # red.async ... .add.u32 [counter], count, [bar]
    bar.complete_tx(4)
    yield "added"


def _collector(cluster, slots, counter, bar, expect_bytes, out):
    """Rank 0's thread 0 after its own push: expect the bytes on its barrier, wait, read its slots."""
    bar.arrive_expect_tx(expect_bytes)
    while bar.phases == 0:
        yield "wait"
    out.append((sum(slots[r] for r in range(cluster)), counter[0]))


def push_sum(x: torch.Tensor, cluster: int = 2, n_per_block: int = 64, *, expect_bytes: int | None = None,
             schedule: str = "leader_first") -> tuple[torch.Tensor, torch.Tensor]:
    """Emulate ``cluster_sum_push``: every block pushes into rank 0 (st.async, red.async), rank 0
    waits on its own barrier for ``expect_bytes`` (8 per block by default; fewer is the broken
    variant) and reads its slots, which start as NaN. Actors take one step at a time, the schedule
    giving rank 0's collector ("leader_first") or the other blocks ("followers_first") priority."""
    if x.dim() != 1 or x.numel() % (cluster * n_per_block):
        raise ValueError(f"x must be 1-D with a multiple of cluster * n_per_block = {cluster * n_per_block} elements, "
                         f"got shape {tuple(x.shape)}")
    if schedule not in ("leader_first", "followers_first"):
        raise ValueError(f"schedule must be 'leader_first' or 'followers_first', got {schedule!r}")
    sums, counts = [], []
    for c in range(x.numel() // (cluster * n_per_block)):
        slots = [torch.tensor(float("nan"), dtype=torch.float64) for _ in range(cluster)]
        counter, bar, out = [0], _TxBarrier(), []
        actors = {f"push{r}": _pusher(r, x, n_per_block, c * cluster, slots, counter, bar) for r in range(cluster)}
        actors["collect"] = _collector(cluster, slots, counter, bar, 8 * cluster if expect_bytes is None else expect_bytes, out)
        followers = [f"push{r}" for r in range(1, cluster)]
        order = ["push0", "collect", *followers] if schedule == "leader_first" else [*followers, "push0", "collect"]
        while actors:
            for name in [a for a in order if a in actors]:
                if name == "collect" and "push0" in actors:
                    continue                                # rank 0's thread pushes before it collects
                try:
                    step = next(actors[name])
                except StopIteration:
                    del actors[name]
                    break
                if step != "wait":
                    break
            else:
                raise RuntimeError("deadlock: rank 0 waits for bytes no block will send")
        sums.append(out[0][0])
        counts.append(out[0][1])
    return torch.stack(sums), torch.tensor(counts)
