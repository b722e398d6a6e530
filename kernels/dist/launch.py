"""Start ``world_size`` processes that join one ``torch.distributed`` process group, run a
function in each, and return what every rank returned, in rank order.

The transport is ``torch.distributed`` itself (gloo on CPUs, NCCL on GPUs); this module only
starts processes (``torch.multiprocessing`` with the ``forkserver`` method, which works from a
notebook: one server process imports torch once and every rank is forked from it, instead of
each rank importing torch again as ``spawn`` does), picks a free TCP port for the rendezvous,
and watches them:

* every launch has two deadlines, ``start_timeout`` for the processes to start and join the group
  and ``timeout`` for the function once all have joined: a rank that has not answered by then is
  named in the error and every process is killed, so a notebook cell or a test never hangs;
* a rank that raises sends its traceback back; the launcher kills the others (which would
  otherwise wait in a collective for a partner that never comes) and raises :class:`RankFailed`
  naming that rank;
* a rank that dies without a word (a segfault, ``os._exit``) is reported with its exit code.

The function runs as ``fn(rank, world_size, *args)`` and must be importable by name (defined at
module level in ``kernels.dist``): the server imports its module, the ranks find it there. The
server imports only torch, ``torch.distributed`` and that module; the first launch in a process
pays that import once (about 2 s of CPU), later launches reuse the server (a fraction of a second).

A rank's result travels back pickled to bytes by the standard pickler, so it may hold tensors:
torch.multiprocessing's own queue pickling would hand them over as shared-memory file
descriptors, which vanish when the rank exits before the parent has read them.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A launch that did not return a result from every rank."""


class RankFailed(LaunchError):
    """A rank raised (its traceback is in the message) or exited without a result."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        super().__init__(f"rank {rank} failed: {detail}")


class RankTimeout(LaunchError):
    """The deadline passed before these ranks returned."""

    def __init__(self, ranks: list[int], timeout: float, phase: str):
        self.ranks, self.phase = ranks, phase
        names = ", ".join(str(r) for r in ranks)
        what = ("did not start and join the process group" if phase == "start" else
                "did not finish (hung in a collective, or waiting for a rank that never answers)")
        super().__init__(f"rank {names} {what} within {timeout:g} s; all processes were killed")


@dataclass
class Launch:
    """What a launch returned: ``results[r]`` is rank r's return value; ``start_seconds`` the wall
    time until every rank had joined the group (process start and imports), ``seconds`` until the
    last result; ``cpu_seconds[r]`` the CPU time rank r's process used (after its fork)."""
    results: list
    start_seconds: float
    seconds: float
    cpu_seconds: list


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float, fn, args, out) -> None:
    """One rank: join the group, say ("ready"), run fn, send ("ok", result) or ("error", traceback)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        out.put((rank, "ready", None))
        result = pickle.dumps(fn(rank, world_size, *args))      # tensors copied into bytes, not shared
        out.put((rank, "ok", (result, time.process_time())))
    except BaseException:  # noqa: BLE001 (the parent reports it, naming this rank)
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_server_modules: set[str] = set()     # what the running fork server (if any) has imported


def _fork_server_context(modules: set[str], extra: str):
    """The forkserver context, its server importing ``modules`` (and ``extra``, the function's module,
    when it starts). A server already running without some of ``modules`` is stopped first
    (multiprocessing's ForkServer._stop), so that the next launch starts one that imports them
    once, instead of every rank importing them again."""
    import multiprocessing.forkserver as fs

    global _server_modules
    if not modules <= _server_modules:
        if _server_modules:
            fs._forkserver._stop()
        _server_modules = _server_modules | modules
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(sorted(_server_modules | {extra}))
    return ctx


def launch(fn, world_size: int, args: tuple = (), *, timeout: float = 60.0, start_timeout: float = 120.0,
           backend: str = "gloo", preload: tuple[str, ...] = ()) -> Launch:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in one process group.

    Returns a :class:`Launch` with every rank's result. Raises :class:`RankFailed` naming the first
    rank that raised or died, or :class:`RankTimeout` naming the ranks that had not joined the group
    ``start_timeout`` seconds after the start, or had not returned ``timeout`` seconds after all
    joined; in every case all processes have been killed before the error is raised.

    ``preload`` names more modules for the fork server to import once, before it forks the ranks
    (e.g. ``torch._dynamo``, which ``torch.optim`` and FSDP2 import on first use: seconds per rank).
    A running server that lacks one of them is replaced (see :func:`_fork_server_context`).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"launch: {name} must be positive seconds, got {value!r}")
    if not callable(fn) or "<locals>" in getattr(fn, "__qualname__", "<locals>") or fn.__module__ == "__main__":
        raise ValueError("launch: fn must be a function defined at module level in an importable module "
                         f"(the ranks import it by name), got {fn!r}")
    ctx = _fork_server_context({"kernels.dist.launch", "torch.distributed", *preload}, fn.__module__)
    out = ctx.Queue()
    port = free_port()
    start = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout, fn, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    ready: set[int] = set()
    started = None                                   # when the last rank joined the group
    try:
        while len(results) < world_size:
            now = time.perf_counter()
            if started is None and now - start > start_timeout:
                raise RankTimeout(sorted(set(range(world_size)) - ready), start_timeout, "start")
            if started is not None and now - started > timeout:
                raise RankTimeout(sorted(set(range(world_size)) - set(results)), timeout, "run")
            left = (start_timeout - (now - start)) if started is None else (timeout - (now - started))
            try:
                rank, status, value = out.get(timeout=min(max(left, 0.01), 0.2))
            except queue_mod.Empty:
                for r, p in enumerate(procs):       # died without reporting (segfault, os._exit)
                    if r not in results and p.exitcode is not None and out.empty():
                        time.sleep(0.2)              # its last message may still be in flight
                        if out.empty():
                            raise RankFailed(r, f"process exited with code {p.exitcode} and no result")
                continue
            if status == "error":
                raise RankFailed(rank, "\n" + value)
            if status == "ready":
                ready.add(rank)
                if len(ready) == world_size:
                    started = time.perf_counter()
                continue
            results[rank] = value
        seconds = time.perf_counter() - start
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world_size:
                p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
    return Launch([pickle.loads(results[r][0]) for r in range(world_size)], started - start, seconds,
                  [results[r][1] for r in range(world_size)])


# ---------------------------------------------------------------- workers that go wrong on purpose

def failing_worker(rank: int, world_size: int, bad_rank: int) -> int:
    """Rank ``bad_rank`` raises before a collective the others are waiting in."""
    import torch
    import torch.distributed as dist

    if rank == bad_rank:
        raise ValueError(f"rank {rank} was told to fail")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def hanging_worker(rank: int, world_size: int, bad_rank: int) -> int:
    """Rank ``bad_rank`` never joins the all-reduce the others are waiting in (it sleeps)."""
    import torch
    import torch.distributed as dist

    if rank == bad_rank:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def exiting_worker(rank: int, world_size: int, bad_rank: int) -> int:
    """Rank ``bad_rank`` dies at once without a word (as a segfault would)."""
    if rank == bad_rank:
        os._exit(3)
    return rank
