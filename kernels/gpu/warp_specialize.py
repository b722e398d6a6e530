"""Warp specialization: producer warps that only copy, consumer warps that only compute.

Three pieces:

* :func:`ws_matmul`, a Triton matmul whose K loop is ``tl.range(..., warp_specialize=True)``:
  on sm90 and later Triton splits the loop into a producer partition (TMA loads through the tensor
  descriptors) and consumer partitions (the MMAs), hands registers between them with
  ``setmaxnreg``, and synchronises them with mbarriers. On a CPU the interpreter runs the loop
  as written (``warp_specialize`` has no effect there), so the result is checked, not the split.
* :func:`register_split`: the register budget of a specialised block, with the PTX ISA's rules for
  ``setmaxnreg`` (``nvidia2025ptx``, "setmaxnreg": a count from 24 to 256, a multiple of 8, set
  per warpgroup) and the SM's register file (``kernels.gpu.hardware``).
* :func:`timeline`: a model, not a measurement, of a producer/consumer pipeline against the same
  work done by warps that both load and compute. Its durations are inputs the caller labels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels.gpu import hardware

SETMAXNREG_RANGE = (24, 256)      # PTX ISA, setmaxnreg: imm-reg-count in 24..256, a multiple of 8


@triton.jit
def _ws_matmul_kernel(a_desc, b_desc, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPECIALIZE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES, warp_specialize=SPECIALIZE):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])            # (BLOCK_M, BLOCK_K), zero-filled past M, K
        b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])            # (BLOCK_K, BLOCK_N), zero-filled past K, N
        acc = tl.dot(a, b, acc)                                    # acc += a @ b
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)    # int64: rows * N may pass 2**31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def ws_matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A B in float32 from fp16 inputs."""
    return a.float() @ b.float()


def ws_matmul(a: torch.Tensor, b: torch.Tensor, *, block=(64, 128, 64), stages: int = 3,
              specialize: bool = True, padding: str = "zero") -> torch.Tensor:
    """C (M x N, fp32) = A (M x K fp16) B (K x N fp16) through tensor descriptors, one program per
    output tile, the K loop warp-specialised on sm90+. ``padding`` is the descriptors' fill past the
    edges; only "zero" is correct when K is not a multiple of the block (the test of a broken variant)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.dtype != torch.float16:
            raise ValueError(f"{name} must be a 2-D float16 tensor, got {t.dtype} with shape {tuple(t.shape)}")
        if t.stride(1) != 1 or (t.stride(0) * 2) % 16:
            raise ValueError(f"{name}: rows must be contiguous and their stride a multiple of 16 bytes (a tensor map rule)")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: inner dimensions differ")
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    grid, args, kwargs = _launch_args(a, b, c, block=block, stages=stages, specialize=specialize, padding=padding)
    _ws_matmul_kernel[grid](*args, **kwargs)
    return c


def _launch_args(a, b, c, *, block=(64, 128, 64), stages: int = 3, specialize: bool = True, padding: str = "zero"):
    """(grid, args, kwargs) of one launch of :func:`_ws_matmul_kernel` (host tensor descriptors over
    a and b), shared by :func:`ws_matmul` and :func:`compile_jobs` so the AOT build is the launch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = block
    M, K = a.shape
    N = b.shape[1]
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [bm, bk], padding=padding)
    b_desc = TensorDescriptor(b, [K, N], [b.stride(0), 1], [bk, bn], padding=padding)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    return grid, (a_desc, b_desc, c, M, N, K), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                                                    SPECIALIZE=specialize, num_warps=4)


def launch_job(M: int, K: int, N: int, *, specialize: bool = True, block=(64, 128, 64), stages: int = 3):
    """The AOT job of :func:`ws_matmul` at (M, K) @ (K, N) on meta tensors."""
    from kernels import inspect as ki

    a = torch.empty(M, K, dtype=torch.float16, device="meta")
    b = torch.empty(K, N, dtype=torch.float16, device="meta")
    c = torch.empty(M, N, dtype=torch.float32, device="meta")
    grid, args, kwargs = _launch_args(a, b, c, block=block, stages=stages, specialize=specialize)
    return ki.launch_job(_ws_matmul_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama-3-8B's gate/up projection at a 4096-token prefill (4096 x 4096 -> 14336), warp-specialized
    and plain (the same loop without ``warp_specialize``)."""
    return {"Llama-3-8B up proj, 4096 tokens: warp-specialized, 64x128x64": launch_job(4096, 4096, 14336),
            "Llama-3-8B up proj, 4096 tokens: plain loop, 64x128x64": launch_job(4096, 4096, 14336, specialize=False)}


@dataclass(frozen=True)
class RegisterSplit:
    producer: int            # registers per thread after setmaxnreg.dec
    consumer: int            # registers per thread after setmaxnreg.inc
    producer_warpgroups: int
    consumer_warpgroups: int

    @property
    def total(self) -> int:
        """Registers the block holds after the split: 128 threads per warpgroup."""
        return 128 * (self.producer * self.producer_warpgroups + self.consumer * self.consumer_warpgroups)


def register_split(producer: int, consumer: int, producer_warpgroups: int = 1, consumer_warpgroups: int = 2,
                   arch: str = "sm90") -> RegisterSplit:
    """Check a setmaxnreg split against the ISA's rules and the SM's register file."""
    for name, n in (("producer", producer), ("consumer", consumer)):
        lo, hi = SETMAXNREG_RANGE
        if not lo <= n <= hi or n % 8:
            raise ValueError(f"{name} count {n}: setmaxnreg takes a multiple of 8 from {lo} to {hi}")
    split = RegisterSplit(producer, consumer, producer_warpgroups, consumer_warpgroups)
    budget = hardware.ARCH_LIMITS[arch]["registers_per_sm"]
    if split.total > budget:
        raise ValueError(f"{split.total} registers for the block exceed the {budget} of an {arch} SM")
    return split


@dataclass
class Timeline:
    loads: list[tuple[float, float]] = field(default_factory=list)      # (start, end) of each tile's copy
    computes: list[tuple[float, float]] = field(default_factory=list)   # (start, end) of each tile's compute

    @property
    def total(self) -> float:
        return max(e for _, e in self.computes)


def timeline(n_tiles: int, *, load: float, compute: float, issue: float, stages: int = 2,
             specialized: bool = True) -> Timeline:
    """Model of one block's K loop. A copy takes ``load`` from issue to landing; ``compute`` is the
    MMA time of a tile; ``issue`` is the time the computing warps spend issuing one tile's copies
    themselves (address math, hundreds of cp.async) when they are not specialised.

    Specialised: a producer issues copy j as soon as a slot is free (the consumer finished tile
    j - stages), copies overlap each other, and the consumer computes tile j when it has landed.
    Not specialised: the same warps issue copy j + stages - 1 (``issue`` time on their own clock)
    before computing tile j, so issuing sits on the critical path every tile.
    """
    if n_tiles < 1 or stages < 1 or min(load, compute, issue) < 0:
        raise ValueError("n_tiles and stages must be >= 1 and the durations >= 0")
    t = Timeline()
    done = [0.0] * n_tiles
    if specialized:
        for j in range(n_tiles):
            start = done[j - stages] if j >= stages else 0.0      # the slot frees when tile j-stages is consumed
            t.loads.append((start, start + load))
            c0 = max(t.loads[j][1], t.computes[-1][1] if t.computes else 0.0)
            t.computes.append((c0, c0 + compute))
            done[j] = c0 + compute
        return t
    clock = 0.0
    for j in range(min(stages - 1, n_tiles)):                        # prologue: the warps issue the first copies
        t.loads.append((clock + issue, clock + issue + load))
        clock += issue
    for j in range(n_tiles):
        nxt = j + stages - 1
        if nxt < n_tiles:                                           # issue the next copy, then compute tile j
            t.loads.append((clock + issue, clock + issue + load))
            clock += issue
        c0 = max(clock, t.loads[j][1])
        t.computes.append((c0, c0 + compute))
        clock = c0 + compute
    return t
