"""Ring and tree collectives written over point-to-point ``send``/``recv``, beside the
``torch.distributed`` collectives they must equal, with every byte a rank sends counted.

p ranks, each holding a tensor of n elements (``x``). Chunks: ``x.flatten().tensor_split(p)``,
chunk c of size about n/p (the first n mod p chunks one element longer).

* ring reduce-scatter: p - 1 steps; at step s rank r sends its partial sum of chunk (r - s - 1) mod p
  to rank r + 1 and adds what rank r - 1 sends it into chunk (r - s - 2) mod p. After the last
  step rank r holds the full sum of chunk r. Bytes sent per rank: (p - 1)/p * n elements.
* ring all-gather: p - 1 steps; at step s rank r forwards chunk (r - s) mod p to rank r + 1 and
  stores chunk (r - s - 1) mod p from rank r - 1. Bytes per rank: (p - 1)/p * N, N the gathered size.
* ring all-reduce = ring reduce-scatter then ring all-gather: 2 (p - 1)/p * n elements per rank
  in 2 (p - 1) steps, whatever p (the bandwidth-optimal bound).
* tree all-reduce (binomial tree): reduce to rank 0 in ceil(log2 p) rounds, then broadcast back in
  ceil(log2 p) rounds: 2 ceil(log2 p) steps, but whole n-element messages, rank 0 sending n per child.

The ``broken`` argument selects a deliberately wrong variant, for the checks that must catch it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.dist import all_gather_single, reduce_scatter_single


@dataclass
class Traffic:
    """What one rank sent: bytes and messages (a recv is counted by the rank that sent it)."""
    bytes_sent: int = 0
    messages: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()
        self.messages += 1


def _check(x: torch.Tensor, name: str, broken: str | None, allowed: tuple[str, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if broken is not None and broken not in allowed:
        raise ValueError(f"{name}: broken must be None or one of {allowed}, got {broken!r}")
    if not dist.is_initialized():
        raise RuntimeError(f"{name}: no process group; call it inside kernels.dist.launch.launch")


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, traffic: Traffic | None) -> None:
    """Send ``send`` to rank dst while receiving ``recv`` from rank src (both posted, then waited:
    every rank of a ring sends and receives at once, so a blocking send first would deadlock)."""
    reqs = [dist.isend(send.contiguous(), dst), dist.irecv(recv, src)]
    for req in reqs:
        req.wait()
    if traffic is not None:
        traffic.add(send)


def reduce_scatter_step(p: int, r: int, s: int) -> tuple[int, int]:
    """(chunk rank r sends right, chunk it receives from the left and adds) at reduce-scatter step s."""
    return (r - s - 1) % p, (r - s - 2) % p


def all_gather_step(p: int, r: int, s: int) -> tuple[int, int]:
    """(chunk rank r forwards right, chunk it receives from the left and stores) at all-gather step s."""
    return (r - s) % p, (r - s - 1) % p


def _ring_reduce_scatter_(chunks: list[torch.Tensor], traffic, steps: int) -> None:
    """In place: after ``steps`` = p - 1 steps chunks[r] on rank r holds the sum over ranks."""
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(steps):
        send_c, recv_c = reduce_scatter_step(p, r, s)
        incoming = torch.empty_like(chunks[recv_c])
        _exchange(chunks[send_c], right, incoming, left, traffic)
        chunks[recv_c] += incoming                                   # partial sum grows by one rank


def _ring_all_gather_(chunks: list[torch.Tensor], traffic, shift: int = 0) -> None:
    """In place: rank r starts with chunks[r] final; after p - 1 steps every chunk is final.
    ``shift`` stores each received chunk that many slots off (equal chunks only: the broken variant)."""
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_c, recv_c = all_gather_step(p, r, s)
        incoming = torch.empty_like(chunks[recv_c])
        _exchange(chunks[send_c], right, incoming, left, traffic)
        chunks[(recv_c + shift) % p].copy_(incoming)                 # shift != 0 only in the broken variant


def ring_reduce_scatter(x: torch.Tensor, traffic: Traffic | None = None, broken: str | None = None) -> torch.Tensor:
    """Chunk ``rank`` of the sum over ranks of x (flattened, split by ``tensor_split(p)``).
    broken="short": one step fewer, so the result misses one rank's contribution."""
    _check(x, "ring_reduce_scatter", broken, ("short",))
    p = dist.get_world_size()
    chunks = list(x.detach().flatten().clone().tensor_split(p))
    _ring_reduce_scatter_(chunks, traffic, p - 1 - (broken == "short"))
    return chunks[dist.get_rank()].clone()


def ring_all_gather(x: torch.Tensor, traffic: Traffic | None = None, broken: str | None = None) -> torch.Tensor:
    """The concatenation over ranks of x (flattened; every rank's x has the same numel).
    broken="misplace": each received chunk is stored one slot off."""
    _check(x, "ring_all_gather", broken, ("misplace",))
    p, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(p * x.numel(), dtype=x.dtype)
    chunks = list(out.tensor_split(p))
    chunks[r].copy_(x.detach().flatten())
    _ring_all_gather_(chunks, traffic, shift=1 if broken == "misplace" else 0)
    return out


def ring_all_reduce(x: torch.Tensor, traffic: Traffic | None = None, broken: str | None = None) -> torch.Tensor:
    """Sum over ranks of x, same shape: ring reduce-scatter, then ring all-gather of the sums.
    broken="short": the reduce-scatter stops one step early (one rank's share missing per chunk)."""
    _check(x, "ring_all_reduce", broken, ("short",))
    p = dist.get_world_size()
    buf = x.detach().flatten().clone()
    chunks = list(buf.tensor_split(p))                               # views into buf
    _ring_reduce_scatter_(chunks, traffic, p - 1 - (broken == "short"))
    _ring_all_gather_(chunks, traffic)
    return buf.view(x.shape)


def tree_all_reduce(x: torch.Tensor, traffic: Traffic | None = None, broken: str | None = None) -> torch.Tensor:
    """Sum over ranks of x: binomial-tree reduce to rank 0, then binomial-tree broadcast.
    Round k (mask = 2^k): a rank whose lowest set bit is mask sends its partial sum to rank - mask;
    rank r + mask, if it exists, sends to r. broken="overwrite": the receiver replaces instead of adds."""
    _check(x, "tree_all_reduce", broken, ("overwrite",))
    p, r = dist.get_world_size(), dist.get_rank()
    buf = x.detach().clone().contiguous()
    incoming = torch.empty_like(buf)
    mask = 1
    while mask < p:                                                  # reduce: leaves to root
        if r & mask:
            dist.send(buf, r - mask)
            if traffic is not None:
                traffic.add(buf)
            break
        if r + mask < p:
            dist.recv(incoming, r + mask)
            buf = incoming.clone() if broken == "overwrite" else buf + incoming
        mask <<= 1
    mask = 1 << max(p - 1, 0).bit_length()                           # broadcast: root to leaves
    while mask > 1:
        mask >>= 1
        if r % (2 * mask) == 0 and r + mask < p:
            dist.send(buf, r + mask)
            if traffic is not None:
                traffic.add(buf)
        elif r % (2 * mask) == mask:
            dist.recv(buf, r - mask)
    return buf


# ---------------------------------------------------------------- references: torch.distributed itself

def all_reduce_ref(x: torch.Tensor) -> torch.Tensor:
    out = x.detach().clone()
    dist.all_reduce(out)
    return out


def all_gather_ref(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype)
    all_gather_single(out, x.detach().flatten().contiguous())
    return out


def reduce_scatter_ref(x: torch.Tensor) -> torch.Tensor:
    """dist.reduce_scatter_single needs equal chunks; tensor_split's uneven ones come from a full all-reduce."""
    p, flat = dist.get_world_size(), x.detach().flatten().contiguous()
    if flat.numel() % p:
        return all_reduce_ref(flat).tensor_split(p)[dist.get_rank()].clone()
    out = torch.empty(flat.numel() // p, dtype=x.dtype)
    reduce_scatter_single(out, flat)
    return out


# ---------------------------------------------------------------- bytes each rank sends, derived

def ring_all_reduce_bytes(n_bytes: int, p: int) -> float:
    """2 (p - 1)/p * n: each rank sends p - 1 chunks in the reduce-scatter and p - 1 in the all-gather."""
    return 2 * (p - 1) / p * n_bytes


def ring_all_gather_bytes(out_bytes: int, p: int) -> float:
    """(p - 1)/p * N for a gathered result of N bytes (each rank forwards the p - 1 chunks it lacks)."""
    return (p - 1) / p * out_bytes


def ring_reduce_scatter_bytes(n_bytes: int, p: int) -> float:
    """(p - 1)/p * n for an input of n bytes per rank."""
    return (p - 1) / p * n_bytes


def tree_all_reduce_bytes(n_bytes: int, p: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in the binomial tree: n to its parent (not rank 0), n per child."""
    children = sum(1 for k in range(max(p - 1, 0).bit_length())
                   if rank % (2 << k) == 0 and rank + (1 << k) < p)
    return n_bytes * ((rank != 0) + children)


def tree_steps(p: int) -> int:
    """Sequential rounds of the tree all-reduce: ceil(log2 p) up, ceil(log2 p) down."""
    return 2 * math.ceil(math.log2(p)) if p > 1 else 0


# ---------------------------------------------------------------- the chapter's experiment (one launch)

def _rank_input(n: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    """Rank-dependent data: small integers in float64 (sums exact in any order), else normals."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.float64:
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_worker(rank: int, p: int, sizes: tuple[int, ...], dtypes: tuple[str, ...] = ("float64", "float32")) -> dict:
    """Every ring/tree collective against torch.distributed's, for each size and dtype, plus the bytes
    each rank sent and whether each broken variant differs. Returns {(name, n, dtype): max |diff|},
    bytes per (name, n) and broken -> max |diff|; rank 0's ring/tree results also come back whole."""
    diffs, sent, broken = {}, {}, {}
    for dt_name in dtypes:
        dt = getattr(torch, dt_name)
        for n in sizes:
            x = _rank_input(n, dt, rank, seed=n)
            cases = {
                "ring_all_reduce": (ring_all_reduce, all_reduce_ref),
                "tree_all_reduce": (tree_all_reduce, all_reduce_ref),
                "ring_reduce_scatter": (ring_reduce_scatter, reduce_scatter_ref),
                "ring_all_gather": (ring_all_gather, all_gather_ref),
            }
            for name, (mine, ref) in cases.items():
                traffic = Traffic()
                got = mine(x, traffic)
                diffs[(name, n, dt_name)] = _max_diff(got, ref(x))
                sent[(name, n, dt_name)] = (traffic.bytes_sent, traffic.messages)
    n = max(sizes)
    x = _rank_input(n, torch.float64, rank, seed=7)
    broken["ring_all_reduce/short"] = _max_diff(ring_all_reduce(x, broken="short"), all_reduce_ref(x))
    broken["tree_all_reduce/overwrite"] = _max_diff(tree_all_reduce(x, broken="overwrite"), all_reduce_ref(x))
    broken["ring_reduce_scatter/short"] = _max_diff(ring_reduce_scatter(x, broken="short"), reduce_scatter_ref(x))
    broken["ring_all_gather/misplace"] = _max_diff(ring_all_gather(x, broken="misplace"), all_gather_ref(x))
    return {"diffs": diffs, "sent": sent, "broken": broken}


def timing_worker(rank: int, p: int, sizes: tuple[int, ...], reps: int = 5) -> dict:
    """Fastest seconds (of ``reps``, after one warm-up, barrier before each: the least disturbed run) of ring all-reduce, tree
    all-reduce and dist.all_reduce on float32 tensors of each size; and of a one-way p2p message between
    ranks 0 and 1 (half a ping-pong), the alpha-beta model's single link."""
    import time
    out = {}
    algos = {"ring": ring_all_reduce, "tree": tree_all_reduce, "gloo": all_reduce_ref}
    for n in sizes:
        x = torch.ones(n, dtype=torch.float32)
        for name, fn in algos.items():
            times = []
            for i in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            out[(name, n)] = min(times[1:])
        times = []
        buf = torch.empty(n, dtype=torch.float32)
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - t0) / 2)
        out[("p2p", n)] = min(times[1:])
    return out


def chapter_worker(rank: int, p: int, check_sizes: tuple[int, ...], time_sizes: tuple[int, ...], reps: int) -> dict:
    """The collectives chapter's one launch: the checks, then the timings (each rank returns its own)."""
    import time
    t0 = time.perf_counter()
    result = check_worker(rank, p, check_sizes)
    result["timings"] = timing_worker(rank, p, time_sizes, reps)
    result["seconds_in_worker"] = time.perf_counter() - t0
    return result
