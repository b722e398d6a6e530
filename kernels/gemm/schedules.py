"""CUTLASS's two Hopper GEMM schedules as an event model, and a warp-specialized Triton matmul.

A warp-specialized Hopper GEMM splits a thread block into a *producer* warp group, which only
issues TMA loads into a ring of shared-memory stages, and *consumer* warp groups, which issue the
wgmma instructions and run the epilogue. CUTLASS's sm90 kernels offer two ways to use two consumer
warp groups (``KernelTmaWarpSpecializedCooperative`` and ``KernelTmaWarpSpecializedPingpong``):

* cooperative: both consumers work on the SAME output tile (each on half of its rows); they run the
  mainloop together and then the epilogue together, so the tensor cores idle during the epilogue;
* ping-pong: each consumer owns its OWN tile; an ordered barrier lets only one of them issue its
  mainloop at a time, so while one runs its epilogue the other keeps the tensor cores busy.

``simulate`` plays both on one SM with parameters that are labelled assumptions (times per tile of
the mainloop on the tensor cores and of the epilogue), not measurements; the producer is assumed to
keep every stage full (loads hidden).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.gemm.ladder import check_inputs, matmul_ref

matmul_ws_ref = matmul_ref


@dataclass(frozen=True)
class Event:
    wg: int          # consumer warp group (0 or 1)
    kind: str        # "mma" (tensor cores) or "epilogue"
    tile: int
    start: float
    end: float


def simulate(schedule: str, tiles: int, mma: float, epilogue: float, *, ordered: bool = True) -> list[Event]:
    """Events of two consumer warp groups computing ``tiles`` output tiles on one SM.

    ``mma``: tensor-core time of one tile's mainloop; ``epilogue``: time of one tile's epilogue by
    one warp group (cooperative splits it in two halves run in parallel). ``ordered=False`` drops
    ping-pong's ordered barrier (the broken variant: both mainloops on the tensor cores at once)."""
    if schedule not in ("cooperative", "pingpong"):
        raise ValueError(f"schedule must be 'cooperative' or 'pingpong', got {schedule!r}")
    if tiles < 0 or mma <= 0 or epilogue < 0:
        raise ValueError(f"need tiles >= 0, mma > 0, epilogue >= 0; got {tiles}, {mma}, {epilogue}")
    events, t = [], 0.0
    if schedule == "cooperative":
        for i in range(tiles):                      # both groups: half the tile each, in lockstep
            for wg in (0, 1):
                events += [Event(wg, "mma", i, t, t + mma), Event(wg, "epilogue", i, t + mma, t + mma + epilogue / 2)]
            t += mma + epilogue / 2
        return events
    tc_free, wg_free = 0.0, [0.0, 0.0]              # when the tensor cores and each group are next free
    for i in range(tiles):
        wg = i % 2                                  # tiles alternate between the groups
        start = max(wg_free[wg], tc_free) if ordered else wg_free[wg]
        events += [Event(wg, "mma", i, start, start + mma), Event(wg, "epilogue", i, start + mma, start + mma + epilogue)]
        tc_free, wg_free[wg] = start + mma, start + mma + epilogue
    return events


def makespan(events: list[Event]) -> float:
    return max((e.end for e in events), default=0.0)


def tensor_core_busy(events: list[Event]) -> float:
    """Time the tensor cores work: the union of the mma intervals (cooperative's two halves of one
    tile count once: the groups share the SM's tensor cores for one tile's worth of work)."""
    spans = sorted({(e.start, e.end) for e in events if e.kind == "mma"})
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s >= cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def overlapping_mainloops(events: list[Event]) -> int:
    """Pairs of DIFFERENT tiles whose mainloops overlap in time: 0 for a valid ping-pong schedule."""
    mm = [e for e in events if e.kind == "mma"]
    return sum(1 for i, a in enumerate(mm) for b in mm[i + 1:]
               if a.tile != b.tile and a.start < b.end and b.start < a.end)


# ------------------------------------------------------------------------------------------------
# A warp-specialized Triton matmul: the K loop marked warp_specialize=True, operands from tensor
# descriptors (TMA on sm90a). The compiler splits it into a load partition and an MMA partition.


@triton.jit
def _matmul_ws_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # a (M, K), b (K, N), c (M, N): contiguous; descriptors give out-of-bounds reads as zeros
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    row0, col0 = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES, warp_specialize=True):
        a = a_desc.load([row0, k * BLOCK_K])                      # (BLOCK_M, BLOCK_K), zeros past M and K
        b = b_desc.load([k * BLOCK_K, col0])                      # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)                                   # acc += A_tile @ B_tile
    c_desc.store([row0, col0], acc.to(c_desc.dtype))


def partition_roles(ttgir: str) -> list[str]:
    """What each warp-specialized partition of a TTGIR does, default partition first: "load" (it
    issues the TMA or cp.async copies), "mma" (wgmma / tcgen05.mma), or "other" (e.g. an epilogue).
    Empty when the compiler built no ``ttg.warp_specialize`` region."""
    if "ttg.warp_specialize(" not in ttgir:
        return []
    body = ttgir[ttgir.index("ttg.warp_specialize("):]
    segments = re.split(r"^\s*(?:default \{|partition\d+\()", body, flags=re.M)[1:]
    roles = []
    for seg in segments:
        if re.search(r"async_tma_copy_global_to_local|async_copy_global_to_local", seg):
            roles.append("load")
        elif re.search(r"warp_group_dot|tc_gen5_mma", seg):
            roles.append("mma")
        else:
            roles.append("other")
    return roles


def setmaxnreg(ptx: str) -> set[tuple[str, int]]:
    """The register budgets the PTX sets: {("dec", 40), ("inc", 232), ...} (``setmaxnreg``)."""
    return {(op, int(n)) for op, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}


def _alloc(size: int, alignment: int, stream):
    """Scratch memory for device-side tensor descriptors (Triton asks the host for it)."""
    return torch.empty(size, dtype=torch.int8, device=runtime.device())


def _launch_args(a, b, c, *, block, num_stages: int):
    """(grid, args, kwargs) of one launch of the warp-specialized kernel, shared by :func:`matmul_ws`
    and :func:`compile_jobs`. 4 warps is the consumer warp group Triton 3.7 builds on sm90a: it adds
    a TMA producer group and splits the 128-row tile between two consumer groups (12 warps in all);
    at num_warps=8 it drops the warp specialization on sm90a and only software-pipelines (the chapter)."""
    (M, K), N = a.shape, b.shape[1]
    bm, bn, bk = block
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    return grid, (a, b, c, M, N, K), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=num_stages, num_warps=4)


def matmul_ws(a: torch.Tensor, b: torch.Tensor, *, block=(128, 128, 64), num_stages: int = 3) -> torch.Tensor:
    """``a @ b`` (fp16 or fp32, contiguous, rows 16-byte aligned) by the warp-specialized kernel."""
    check_inputs("matmul_ws", a, b, dtypes=(torch.float16, torch.float32))
    for name, t in (("a", a), ("b", b)):
        if not t.is_contiguous() or (t.shape[1] * t.element_size()) % 16:
            raise ValueError(f"matmul_ws: {name} must be contiguous with rows a multiple of 16 bytes (TMA), "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
    c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    triton.set_allocator(_alloc)
    grid, args, kwargs = _launch_args(a, b, c, block=block, num_stages=num_stages)
    _matmul_ws_kernel[grid](*args, **kwargs)
    return c


def launch_job(M: int, K: int, N: int, *, block=(128, 128, 64), num_stages: int = 3, num_warps: int | None = None):
    """The AOT job of :func:`matmul_ws` at (M, K) @ (K, N); ``num_warps`` overrides the launch's 4
    (the chapter compiles 8 to show what Triton does with it)."""
    from kernels import inspect as ki

    a, b, c = (torch.empty(*s, device="meta", dtype=torch.float16) for s in ((M, K), (K, N), (M, N)))
    grid, args, kwargs = _launch_args(a, b, c, block=block, num_stages=num_stages)
    if num_warps is not None:
        kwargs["num_warps"] = num_warps
    return ki.launch_job(_matmul_ws_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The warp-specialized matmul at Llama-3-70B's up projection (4096 tokens x 8192 -> 28672)."""
    return {"Llama-3-70B up proj, 4096 tokens: warp-specialized TMA 128x128x64, 4 warps":
            launch_job(4096, 8192, 28672)}
