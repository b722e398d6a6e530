"""ZeRO's memory ledger, a small ZeRO-1/2 over a flat parameter buffer, and FSDP2 (ZeRO-3) on the tiny GPT.

Mixed-precision Adam keeps, per parameter, 2 bytes of fp16/bf16 weight, 2 of gradient and K = 12
of optimizer state (fp32 master weight, momentum, variance) (Rajbhandari et al., 2020, section 3.1).
Over N data-parallel ranks, with Psi parameters, bytes per rank:

  stage 0 (plain data parallel)     (2 + 2 + K) Psi
  stage 1 (shard optimizer state)   (2 + 2) Psi + K Psi / N
  stage 2 (+ shard gradients)       2 Psi + (2 + K) Psi / N
  stage 3 (+ shard parameters)      (2 + 2 + K) Psi / N

The experiment trains in float64 with plain Adam, so its ledger is 8 + 8 + 16 bytes per parameter:
:func:`ledger` takes the three sizes as arguments. Stages 0-2 are :class:`FlatZero` (parameters as
views into one flat buffer; stage 0 all-reduces the gradients, stages 1 and 2 reduce-scatter them,
stage 2 keeping only its slice; each rank steps Adam on its 1/N slice and the slices are
all-gathered back). Stage 3 is PyTorch's FSDP2,
``torch.distributed.fsdp.fully_shard``: parameters sharded per block, all-gathered before each
block's forward and backward, gradients reduce-scattered after its backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.dist import ALL_GATHER, REDUCE_SCATTER, all_gather_single, reduce_scatter_single

STAGES = (0, 1, 2, 3)


def ledger(n_params: int, n_ranks: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
           optim_bytes: int = 12) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state under ZeRO ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"ledger: stage must be one of {STAGES}, got {stage!r}")
    if n_ranks < 1 or n_params < 0:
        raise ValueError(f"ledger: need n_ranks >= 1 and n_params >= 0, got {n_ranks}, {n_params}")
    share = 1.0 / n_ranks
    out = {"params": param_bytes * n_params * (share if stage >= 3 else 1),
           "grads": grad_bytes * n_params * (share if stage >= 2 else 1),
           "optimizer": optim_bytes * n_params * (share if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class FlatZero:
    """ZeRO stages 0-2 for one model: its parameters become views into a flat buffer (padded to a
    multiple of N); ``step()`` reduces the gradients and runs Adam.

    stage 0: all-reduce the flat gradient, Adam on the whole flat buffer (state for all Psi);
    stage 1: reduce-scatter the flat gradient (each rank needs only its slice's sum), Adam on this
             rank's slice only, all-gather the slices; the full gradient buffer is still kept;
    stage 2: as stage 1, but the full gradient is transient: only the 1/N slice stays.
    ``broken="no_gather"``: the slices are not all-gathered (each rank keeps stale weights elsewhere).
    """

    def __init__(self, model: torch.nn.Module, stage: int, lr: float, broken: str | None = None):
        if stage not in (0, 1, 2):
            raise ValueError(f"FlatZero: stage must be 0, 1 or 2 (3 is FSDP2), got {stage!r}")
        if broken not in (None, "no_gather"):
            raise ValueError(f"FlatZero: broken must be None or 'no_gather', got {broken!r}")
        self.stage, self.broken = stage, broken
        self.n, self.r = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in model.parameters()]
        total = sum(p.numel() for p in self.params)
        padded = -(-total // self.n) * self.n
        self.flat = torch.zeros(padded, dtype=self.params[0].dtype)
        offset = 0
        for p in self.params:                                          # p.data now lives in self.flat
            self.flat[offset: offset + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.slice = padded // self.n if stage else padded             # the elements this rank's Adam steps
        lo = self.r * self.slice if stage else 0
        if stage < 2:
            self.grad_buffer = torch.zeros_like(self.flat)             # the full gradient, kept (DDP, ZeRO-1)
        self.shard = torch.nn.Parameter(self.flat[lo: lo + self.slice])   # a view: Adam updates flat in place
        self.opt = torch.optim.Adam([self.shard], lr=lr)

    def _flat_grad(self) -> torch.Tensor:
        g = self.grad_buffer if self.stage < 2 else torch.zeros_like(self.flat)    # stage 2: transient
        offset = 0
        for p in self.params:
            g[offset: offset + p.numel()] = p.grad.flatten()
            offset += p.numel()
            p.grad = None                                              # the full gradient is not kept
        return g

    def step(self) -> None:
        g = self._flat_grad()                                          # (padded,) this rank's gradient
        if self.stage == 0:
            dist.all_reduce(g)                                         # every rank: the sum of everything
            grad_slice = g
        else:
            grad_slice = torch.empty(self.slice, dtype=g.dtype)        # (padded / N,)
            reduce_scatter_single(grad_slice, g)                  # each rank: the sum of its slice only
        self.shard.grad = grad_slice / self.n                          # mean over the ranks' batches
        self.opt.step()                                                # Adam on Psi (stage 0) or Psi / N elements
        if self.stage and self.broken != "no_gather":
            gathered = torch.empty_like(self.flat)
            all_gather_single(gathered, self.shard.detach().clone())
            self.flat.copy_(gathered)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: the flat parameters; the gradients it keeps (the flat
        all-reduced buffer in stages 0 and 1, the 1/N slice in stage 2); Adam's two moments."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        grads = nbytes(self.grad_buffer) if self.stage < 2 else nbytes(self.shard.grad)
        optim = sum(nbytes(v) for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        return {"params": nbytes(self.flat), "grads": grads, "optimizer": optim}


def _loss(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches(steps: int, batch: int, seq: int):
    from kernels.model import data
    tokens = data.encode(data.load_text()[:50000])
    g = torch.Generator().manual_seed(0)
    return [data.get_batch(tokens, batch, seq, g) for _ in range(steps)]


def _model():
    from kernels.model.gpt import load_pretrained
    return load_pretrained().double().train()


def train_single(steps: int, batch: int, seq: int, lr: float) -> list[float]:
    """The reference: one process, the whole batch, Adam."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in _batches(steps, batch, seq):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _global_loss(local: torch.Tensor, n: int) -> float:
    t = local.detach().clone()
    dist.all_reduce(t)
    return t.item() / n


def train_flat_zero(steps, batch, seq, lr, stage, broken=None) -> dict:
    n, r = dist.get_world_size(), dist.get_rank()
    model = _model()
    zero = FlatZero(model, stage, lr, broken)
    losses, events = [], []
    for i, (x, y) in enumerate(_batches(steps, batch, seq)):
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]                          # this rank's batch / N sequences
        zero.zero_grad()
        loss = _loss(model, xs, ys)
        loss.backward()
        with _Recorder() as rec:
            rec.phase = "step"
            zero.step()
        if i == 0:
            events = rec.events
        losses.append(_global_loss(loss, n))
    return {"losses": losses, "bytes": zero.resident_bytes(), "events": events}


class _Recorder:
    """Wraps dist.all_gather_single / reduce_scatter_single (all_gather_into_tensor /
    reduce_scatter_tensor before torch 2.13: what FSDP2 and FlatZero call) and
    dist.all_reduce (FlatZero's stage 0) to log each call as (op, phase, elements)."""

    def __init__(self):
        self.events, self.phase = [], "forward"

    def __enter__(self):
        self._ag, self._rs, self._ar = getattr(dist, ALL_GATHER), getattr(dist, REDUCE_SCATTER), dist.all_reduce

        def size(a, k):                                            # the larger tensor: gathered / scattered
            return max(t.numel() for t in list(a) + list(k.values()) if torch.is_tensor(t))

        def ag(*a, **k):
            self.events.append(("all-gather", self.phase, size(a, k)))
            return self._ag(*a, **k)

        def rs(*a, **k):
            self.events.append(("reduce-scatter", self.phase, size(a, k)))
            return self._rs(*a, **k)

        def ar(*a, **k):
            self.events.append(("all-reduce", self.phase, size(a, k)))
            return self._ar(*a, **k)

        self._set(ag, rs, ar)
        return self

    def __exit__(self, *exc):
        self._set(self._ag, self._rs, self._ar)

    @staticmethod
    def _set(ag, rs, ar):
        setattr(dist, ALL_GATHER, ag)
        setattr(dist, REDUCE_SCATTER, rs)
        dist.all_reduce = ar


def ring_bytes_sent(events, element_bytes: int, n_ranks: int) -> float:
    """Bytes one rank sends for the recorded collectives, each run as a ring (the collectives
    chapter's counts): all-reduce 2 (N-1)/N n, all-gather and reduce-scatter (N-1)/N n, with n the
    full (gathered or scattered) tensor's bytes."""
    from kernels.dist import collectives as C
    per_op = {"all-reduce": C.ring_all_reduce_bytes, "all-gather": C.ring_all_gather_bytes,
              "reduce-scatter": C.ring_reduce_scatter_bytes}
    unknown = {op for op, *_ in events} - per_op.keys()
    if unknown:
        raise ValueError(f"ring_bytes_sent: no ring count for {sorted(unknown)}")
    return sum(per_op[op](n * element_bytes, n_ranks) for op, _, n in events)


def train_fsdp2(steps, batch, seq, lr) -> dict:
    """ZeRO-3 with FSDP2: fully_shard each block, then the root (embedding, final norm); Adam on
    the DTensor shards. The first step's collectives are logged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n, r = dist.get_world_size(), dist.get_rank()
    model = _model()
    mesh = init_device_mesh("cpu", (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, events = [], []
    for i, (x, y) in enumerate(_batches(steps, batch, seq)):
        with _Recorder() as rec:
            loss = _loss(model, x.chunk(n)[r], y.chunk(n)[r])
            rec.phase = "backward"
            loss.backward()
        if i == 0:
            events = rec.events
        opt.step()
        losses.append(_global_loss(loss, n))
        if i < steps - 1:
            opt.zero_grad()
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    resident = {"params": sum(nbytes(local(p)) for p in model.parameters()),
                "grads": sum(nbytes(local(p.grad)) for p in model.parameters() if p.grad is not None),
                "optimizer": sum(nbytes(local(v)) for s in opt.state.values() for v in s.values()
                                 if torch.is_tensor(v) and v.dim())}
    return {"losses": losses, "bytes": resident, "events": events}


def zero_worker(rank: int, world: int, steps: int, batch: int, seq: int, lr: float) -> dict:
    """The chapter's one launch: stages 0-2 (FlatZero), stage 3 (FSDP2), the broken stage 1; rank 0
    also trains the single-process reference."""
    import time
    seconds = {}
    t0 = time.perf_counter()
    out = {}
    for s in (0, 1, 2):
        out[s] = train_flat_zero(steps, batch, seq, lr, s)
        seconds[s], t0 = time.perf_counter() - t0, time.perf_counter()
    out[3] = train_fsdp2(steps, batch, seq, lr)
    seconds[3], t0 = time.perf_counter() - t0, time.perf_counter()
    out["broken"] = train_flat_zero(steps, batch, seq, lr, 1, broken="no_gather")
    seconds["broken"], t0 = time.perf_counter() - t0, time.perf_counter()
    if rank == 0:
        out["single"] = train_single(steps, batch, seq, lr)
        seconds["single"] = time.perf_counter() - t0
    out["seconds"] = seconds
    return out


