"""Peak memory of the LM-head loss, fused (chunked) against unfused, measured two ways.

:func:`tensor_peak_bytes` counts the bytes of PyTorch tensors alive (:class:`kernels.tensor_memory.TensorPeak`): exact,
deterministic, blind to memory that is not a tensor; it runs on the kernels' device.
:func:`peak_extra_bytes` measures the process's resident memory, each case in its own process: it
sees everything, coarsely, and only on the CPU (with a GPU it raises: the tensors are not in it).

What is measured: the growth of the process's peak resident set (the larger of Linux's ``VmHWM``
and the resident set read after every PyTorch operation, minus the ``VmRSS`` just before the loss), over one forward and backward of the loss, in a separate process
(a fork of the caller, or a fresh interpreter) that has made its inputs and run the code path once
on a tiny problem (so that loading code pages and the interpreter's first-call work are not
counted). A forked child starts with its peak reset to its current resident set (Linux sets the
new address space's high-water mark at fork).
It covers every allocation the process touches: PyTorch's tensors, NumPy temporaries of the Triton
interpreter, and the allocator's own overhead. It is coarse (pages, not bytes) and says nothing
about a GPU's caching allocator; it is honest about the one thing asked: how much more memory the
unfused loss needs than the chunked one.

Run one case by hand: ``python -m kernels.model.lm_head_memory fused N C V CHUNK``.
Linux only (it reads ``/proc/self/status``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


KINDS = {
    "unfused": "logits = H W^T, then PyTorch's cross-entropy",
    "kernel": "logits = H W^T, then cross_entropy (gradient in its own buffer)",
    "kernel_inplace": "logits = H W^T, then cross_entropy(inplace=True) (gradient over the logits)",
    "fused": "fused_linear_cross_entropy (chunks of logits, gradient over each chunk)",
}


def _loss(kind: str, h, w, t, chunk):
    from kernels.model.lm_head import cross_entropy, fused_linear_cross_entropy, fused_linear_cross_entropy_ref

    if kind == "fused":
        return fused_linear_cross_entropy(h, w, t, chunk_size=chunk)
    if kind == "unfused":
        return fused_linear_cross_entropy_ref(h, w, t)
    return cross_entropy(h @ w.T, t, inplace=kind == "kernel_inplace")


def tensor_peak_bytes(N: int, C: int, V: int, chunk: int | None = None,
                      kinds=("unfused", "fused")) -> dict[str, dict]:
    """Peak bytes of the tensors each loss (see :data:`KINDS`) creates over one forward and backward,
    in this process, with :class:`kernels.tensor_memory.TensorPeak`; the inputs H (N, C), W (V, C) and their storage are not
    counted. Per kind: its loss, ``peak_bytes`` and ``timeline`` (live bytes after each operation).
    ``chunk`` None lets the fused loss choose (:func:`kernels.model.lm_head.chunk_rows`). The tensors
    live on the kernels' device (``kernels.runtime.device()``); the inputs are drawn on the CPU, so
    they are the same numbers everywhere."""
    import kernels  # noqa: F401  (before triton)
    import torch

    from kernels import runtime
    from kernels.tensor_memory import TensorPeak

    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"tensor_peak_bytes: kind must be one of {sorted(KINDS)}, got {kind!r}")
    dev = runtime.device()
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(N, C, generator=g).to(dev)
    w0 = (torch.randn(V, C, generator=g) / C ** 0.5).to(dev)
    t = torch.randint(0, V, (N,), generator=g).to(dev)
    out = {}
    for kind in kinds:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with TensorPeak() as probe:
            loss = _loss(kind, h, w, t, chunk)
            loss.backward()
        out[kind] = {"kind": kind, "loss": loss.item(), "peak_bytes": probe.peak_bytes, "timeline": probe.timeline}
    return out


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _run_case(kind: str, N: int, C: int, V: int, chunk: int) -> dict:
    import kernels  # noqa: F401  (before triton)
    import torch

    from kernels.model.lm_head import fused_linear_cross_entropy, fused_linear_cross_entropy_ref

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, C, generator=g).requires_grad_()
    w = (torch.randn(V, C, generator=g) / C ** 0.5).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)

    def loss_fn(hh, ww, tt, ch):
        if kind == "fused":
            return fused_linear_cross_entropy(hh, ww, tt, chunk_size=ch)
        return fused_linear_cross_entropy_ref(hh, ww, tt)

    from torch.utils._python_dispatch import TorchDispatchMode

    page = os.sysconf("SC_PAGE_SIZE")

    class _SampleRSS(TorchDispatchMode):
        """After every PyTorch operation (forward and backward), read the resident set size."""
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            with open("/proc/self/statm") as f:
                _SampleRSS.peak = max(_SampleRSS.peak, int(f.read().split()[1]) * page)
            return out

    small = loss_fn(h[:4].detach().requires_grad_(), w[:16].detach().requires_grad_(), t[:4] % 16, 2)
    small.backward()                                    # warm-up: code paths, not counted
    with _SampleRSS():
        small = loss_fn(h[:4].detach().requires_grad_(), w[:16].detach().requires_grad_(), t[:4] % 16, 2)
        small.backward()
    _release_free_heap()
    base = _status("VmRSS")
    _SampleRSS.peak = base
    with _SampleRSS():
        loss = loss_fn(h, w, t, chunk)
        loss.backward()
    # The larger of the sampled peak and the kernel's high-water mark (which may lag or, after a
    # fork, start from a lower base).
    peak = max(_SampleRSS.peak, _status("VmHWM"))
    return {"kind": kind, "loss": loss.item(), "peak_extra_bytes": peak - base}


def _fixed_mmap_threshold(threshold: int = 128 * 1024) -> None:
    """Make glibc serve every allocation above ``threshold`` with its own mmap and return it on free.

    By default glibc raises that threshold after large frees, and later large allocations then reuse
    heap pages that are already resident, which a resident-set measurement would not see. Fixing it
    makes every tensor larger than 128 KiB show up in VmHWM when it is touched.
    """
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, threshold)


def _release_free_heap() -> None:
    """Give every free page of glibc's heaps back to the OS (``malloc_trim(0)``).

    Free chunks left by earlier work would otherwise serve new allocations from pages that are
    already resident, and the measurement would not see them.
    """
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _forked_case(kind: str, N: int, C: int, V: int, chunk: int) -> dict:
    """Run one case in a forked child of this process (no imports to repeat); returns its result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report through the pipe, leave without running any cleanup
        code = 0
        try:
            os.close(read_fd)
            _fixed_mmap_threshold()
            payload = json.dumps(_run_case(kind, N, C, V, chunk)).encode()
        except BaseException as err:  # noqa: BLE001  (report anything to the parent)
            payload, code = json.dumps({"error": repr(err)}).encode(), 1
        os.write(write_fd, payload)
        os.close(write_fd)
        os._exit(code)
    os.close(write_fd)
    chunks = []
    while True:
        block = os.read(read_fd, 65536)
        if not block:
            break
        chunks.append(block)
    os.close(read_fd)
    os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks) or b'{"error": "no result"}')
    if "error" in result:
        raise RuntimeError(f"peak_extra_bytes: the {kind} case failed in the child: {result['error']}")
    return result


def peak_extra_bytes(N: int, C: int, V: int, chunk: int = 32, kinds=("unfused", "fused"), *,
                     fork: bool = True) -> dict[str, dict]:
    """Run each case ("fused", "unfused") in its own process; returns, per kind, its loss and its
    peak extra bytes.

    ``fork=True`` (Linux): a forked child of this process, with glibc's mmap threshold fixed (see
    :func:`_fixed_mmap_threshold`) and its free heap pages returned before the measurement, so
    nothing is imported again. ``fork=False``: a fresh Python
    process per case (slower: it imports torch and triton), run side by side.
    """
    import kernels  # noqa: F401  (before triton)
    from kernels import runtime
    if runtime.runtime().on_gpu:
        raise RuntimeError("peak_extra_bytes measures the resident memory of CPU tensors, and on a GPU the kernels "
                           "take GPU tensors only: use tensor_peak_bytes there")
    for kind in kinds:
        if kind not in ("fused", "unfused"):
            raise ValueError(f"peak_extra_bytes: kind must be 'fused' or 'unfused', got {kind!r}")
    if fork:
        return {kind: _forked_case(kind, N, C, V, chunk) for kind in kinds}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {kind: subprocess.Popen([sys.executable, "-m", "kernels.model.lm_head_memory", kind, str(N), str(C), str(V),
                                     str(chunk)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for kind in kinds}
    results = {}
    for kind, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"peak_extra_bytes: the {kind} case failed:\n{err[-2000:]}")
        results[kind] = json.loads(out.strip().splitlines()[-1])
    return results


if __name__ == "__main__":
    kind, *dims = sys.argv[1:]
    _fixed_mmap_threshold()
    print(json.dumps(_run_case(kind, *map(int, dims))))
