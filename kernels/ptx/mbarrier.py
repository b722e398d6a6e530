"""The mbarrier object, emulated as the PTX ISA's state machine; and the producer/consumer ring of
``kernels/cuda/mbarrier.cu`` run on it, with a scheduler that finds races and deadlocks.

The PTX ISA (``nvidia2025ptx``, "Parallel Synchronization and Communication Instructions: mbarrier",
subsections "Contents of the mbarrier object", "Phase of the mbarrier object", "Tracking
asynchronous operations by the mbarrier object", "mbarrier.arrive", "mbarrier.expect_tx",
"mbarrier.test_wait/mbarrier.try_wait") defines an mbarrier as a 64-bit object in shared memory
holding:

* the current **phase** (waits test only its parity: even phases have parity 0, odd ones 1);
* the **pending arrival count** of the current phase, and the **expected arrival count** that
  the pending count is reset to when a phase completes (``mbarrier.init`` sets both to ``count``);
* the **tx-count**, bytes of asynchronous transactions the current phase still waits for.
  ``expect-tx(n)`` raises it by n, ``complete-tx(n)`` (done by the copy engine when n bytes land)
  lowers it by n; it may go negative when bytes land before they are expected.

The current phase completes when the pending arrival count AND the tx-count are both zero; the
barrier then moves to the next phase, with pending arrivals reset to the expected count.
``try_wait.parity P`` returns true when the phase of parity P has completed, which the ISA
defines for P being the parity of the current phase (false: it is still running) or of the
immediately preceding one (true). An arrival that would take the pending count below zero is
undefined behaviour; here it is an error. Ranges (the ISA's table of mbarrier contents): expected
arrivals 1 .. 2**20 - 1, tx-count -(2**20 - 1) .. 2**20 - 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_COUNT = 2**20 - 1   # PTX ISA: the largest arrival count and |tx-count| an mbarrier holds


class MBarrierError(RuntimeError):
    """An operation the PTX ISA leaves undefined (too many arrivals, counts out of range)."""


class Deadlock(RuntimeError):
    """Every actor waits on a barrier phase that nothing left can complete."""


class MBarrier:
    """One mbarrier: phase, pending and expected arrivals, tx-count."""

    def __init__(self, count: int):
        if not 1 <= count <= MAX_COUNT:
            raise MBarrierError(f"mbarrier.init count must be in 1..{MAX_COUNT}, got {count}")
        self.expected = count
        self.pending = count
        self.tx = 0
        self.phase = 0          # phases completed so far; the current phase's parity is phase & 1

    @property
    def parity(self) -> int:
        return self.phase & 1

    def _complete_if_done(self) -> None:
        if self.pending == 0 and self.tx == 0:      # phase completion: no arrivals and no bytes owed
            self.phase += 1
            self.pending = self.expected

    def arrive(self, count: int = 1, no_complete: bool = False) -> int:
        """``mbarrier.arrive``: pending -= count. Returns the phase parity before the arrival (the
        ISA's opaque ``state`` carries the phase; its parity is what a later wait would test).
        ``no_complete``: ``mbarrier.arrive.noComplete``, which the ISA leaves undefined if it completes
        the phase (an error here)."""
        if count < 1 or count > self.pending:
            raise MBarrierError(f"arrive({count}) with {self.pending} arrivals pending in phase {self.phase}: "
                                "the PTX ISA defines no effect for more arrivals than a phase expects")
        if no_complete and count == self.pending and self.tx == 0:
            raise MBarrierError(f"arrive.noComplete({count}) would complete phase {self.phase}: undefined in the PTX ISA")
        before = self.parity
        self.pending -= count
        self._complete_if_done()
        return before

    def expect_tx(self, nbytes: int) -> None:
        """``mbarrier.expect_tx``: the current phase also waits for ``nbytes`` more bytes."""
        if nbytes < 0 or abs(self.tx + nbytes) > MAX_COUNT:
            raise MBarrierError(f"expect_tx({nbytes}) takes the tx-count {self.tx} outside +-{MAX_COUNT}")
        self.tx += nbytes

    def arrive_expect_tx(self, nbytes: int) -> int:
        """``mbarrier.arrive.expect_tx``: expect-tx(nbytes), then arrive, as one step."""
        self.expect_tx(nbytes)
        return self.arrive()

    def complete_tx(self, nbytes: int) -> None:
        """What a bulk copy's ``mbarrier::complete_tx::bytes`` does when its ``nbytes`` land."""
        if nbytes < 0 or abs(self.tx - nbytes) > MAX_COUNT:
            raise MBarrierError(f"complete_tx({nbytes}) takes the tx-count {self.tx} outside +-{MAX_COUNT}")
        self.tx -= nbytes
        self._complete_if_done()

    def try_wait_parity(self, parity: int) -> bool:
        """``mbarrier.try_wait.parity``: has the phase with this parity completed? True when the
        current phase has the other parity (the phase asked about is the preceding one)."""
        if parity not in (0, 1):
            raise ValueError(f"parity must be 0 or 1, got {parity!r}")
        return self.parity != parity

    def state(self) -> tuple[int, int, int]:
        """(phase, pending arrivals, tx-count)."""
        return self.phase, self.pending, self.tx


# ---------------------------------------------------------------------------------------------
# The producer/consumer ring of kernels/cuda/mbarrier.cu, as actors on emulated barriers


@dataclass
class Copy:
    """A bulk copy in flight: lands ``src`` into ``dst`` and pays ``dst``'s bytes to ``bar``."""

    dst: torch.Tensor
    src: torch.Tensor
    bar: MBarrier

    def land(self) -> None:
        self.dst.copy_(self.src)
        self.bar.complete_tx(self.src.numel() * self.src.element_size())


@dataclass
class Run:
    """What a scheduled run did: the outputs and the event log (actor, event)."""

    out: torch.Tensor
    log: list[tuple[str, str]] = field(default_factory=list)


def _producer(x, ring, full, empty, copies, log, producer_parity_flip):
    stages = len(full)
    for i in range(x.shape[0]):
        s, rnd = i % stages, i // stages
        parity = (rnd & 1) ^ (0 if producer_parity_flip else 1)   # correct: ^1, round 0 passes at once
        while not empty[s].try_wait_parity(parity):
            yield empty[s], parity, f"empty[{s}] parity {parity}"
        full[s].arrive_expect_tx(ring[s].numel() * ring[s].element_size())
        copies.append(Copy(ring[s], x[i].clone(), full[s]))
        log.append(("producer", f"tile {i} -> slot {s}"))


def _consumer(c, consumers, x, ring, full, empty, out, log, consumer_parity_flip):
    stages = len(full)
    for i in range(x.shape[0]):
        s, rnd = i % stages, i // stages
        parity = (rnd & 1) ^ (1 if consumer_parity_flip else 0)   # correct: the round's own parity
        while not full[s].try_wait_parity(parity):
            yield full[s], parity, f"full[{s}] parity {parity}"
        if i % consumers == c:
            out[i] = ring[s].double().sum()
            log.append((f"consumer {c}", f"sum tile {i} from slot {s}"))
        empty[s].arrive()


def ring_sums(x: torch.Tensor, stages: int = 3, consumers: int = 2, *, consumer_parity_flip: bool = False,
              producer_parity_flip: bool = False) -> Run:
    """Emulate ``mbarrier_ring_sums``: out[i] = sum of tile i of ``x`` (n_tiles, tile).

    Actors (the producer thread, one per consumer warp) run round-robin until each blocks on a
    barrier wait. Bulk copies land *lazily*: only when every actor is blocked, one at a time, the
    oldest first, which is the latest the hardware may land them. Shared memory starts as NaN, so
    a consumer that reads a slot before its bytes land produces NaN. If every actor is blocked and
    no copy is in flight, :class:`Deadlock` names what each actor waits for.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (n_tiles, tile), got shape {tuple(x.shape)}")
    if stages < 1 or consumers < 1:
        raise ValueError(f"stages and consumers must be >= 1, got {stages}, {consumers}")
    ring = torch.full((stages, x.shape[1]), float("nan"), dtype=x.dtype)
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(consumers) for _ in range(stages)]
    out = torch.full((x.shape[0],), float("nan"), dtype=torch.float64)
    copies: list[Copy] = []
    run = Run(out)
    actors = {"producer": _producer(x, ring, full, empty, copies, run.log, producer_parity_flip)}
    for c in range(consumers):
        actors[f"consumer {c}"] = _consumer(c, consumers, x, ring, full, empty, out, run.log, consumer_parity_flip)
    waiting: dict[str, tuple] = {}
    while actors:
        for name in list(actors):          # each actor runs until it blocks on a wait, or ends
            try:
                waiting[name] = next(actors[name])
            except StopIteration:
                del actors[name]
                waiting.pop(name, None)
        if actors and not any(bar.try_wait_parity(parity) for bar, parity, _ in waiting.values()):
            if not copies:
                raise Deadlock("; ".join(f"{n} waits on {w[2]}" for n, w in sorted(waiting.items())))
            copies.pop(0).land()           # nothing else can move: the oldest copy lands now
            run.log.append(("copy engine", "bytes landed"))
    for c in copies:                       # copies still in flight land before the kernel exits
        c.land()
    return run


def ring_sums_ref(x: torch.Tensor) -> torch.Tensor:
    """The reference: each tile's sum, in float64."""
    return x.double().sum(1)
