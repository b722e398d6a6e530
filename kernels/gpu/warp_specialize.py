"""Warp specialization: producer warps that only copy, consumer warps that only compute.

Three pieces:

* :func:`ws_matmul`, a Triton matmul whose K loop is ``tl.range(..., warp_specialize=True)``:
  on sm90 and later Triton splits the loop into a producer partition (TMA loads through the tensor
  descriptors) and consumer partitions (the MMAs), hands registers between them with
  ``setmaxnreg``, and synchronises them with mbarriers. On a CPU the interpreter runs the loop
  as written (``warp_specialize`` has no effect there), so the result is checked, not the split.
  :func:`consumer_dots` reads the split from the compiled TTGIR: whether the consumers divide the
  tile (128 rows: 64 each) or replicate it (64 rows: each computes the whole tile).
* :func:`register_split`: the register budget of a specialised block, with the PTX ISA's rules for
  ``setmaxnreg`` (``nvidia2025ptx``, "setmaxnreg": a count from 24 to 256, a multiple of 8, set
  per warpgroup) and the SM's register file (``kernels.gpu.hardware``).
* :func:`timeline`: a model, not a measurement, of a producer/consumer pipeline against the same
  work done by warps that both load and compute. Its durations are inputs the caller labels.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.gpu import hardware

SETMAXNREG_RANGE = (24, 256)      # PTX ISA, setmaxnreg: imm-reg-count in 24..256, a multiple of 8


@triton.jit
def _ws_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPECIALIZE: tl.constexpr,
                      PADDING: tl.constexpr):
    # Device-side descriptors: the compiler, not the host, chooses each TMA box, so it may cut the
    # (BLOCK_M, BLOCK_K) A tile into one box per consumer warp group (a host descriptor fixes the box).
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K],
                                       padding_option=PADDING)
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N],
                                       padding_option=PADDING)
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_c, 1], block_shape=[BLOCK_M, BLOCK_N])
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES, warp_specialize=SPECIALIZE):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])            # (BLOCK_M, BLOCK_K), filled past M, K
        b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])            # (BLOCK_K, BLOCK_N), filled past K, N
        acc = tl.dot(a, b, acc)                                    # acc += a @ b
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc)          # TMA store: rows >= M, cols >= N are dropped


def ws_matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A B in float32 from fp16 inputs."""
    return a.float() @ b.float()


def ws_matmul(a: torch.Tensor, b: torch.Tensor, *, block=(128, 128, 64), stages: int = 3,
              specialize: bool = True, padding: str = "zero") -> torch.Tensor:
    """C (M x N, fp32) = A (M x K fp16) B (K x N fp16) through tensor descriptors, one program per
    output tile, the K loop warp-specialised on sm90+. The default 128-row tile is the one Triton
    3.7 splits between two consumer warp groups (64 rows each); at 64 rows it replicates the
    consumer (:func:`consumer_dots`). ``padding`` is the descriptors' fill past the edges; only
    "zero" is correct when K is not a multiple of the block (the test of a broken variant)."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.dtype != torch.float16:
            raise ValueError(f"{name} must be a 2-D float16 tensor, got {t.dtype} with shape {tuple(t.shape)}")
        if t.stride(1) != 1 or (t.stride(0) * 2) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name}: rows must be contiguous, their stride a multiple of 16 bytes and the start "
                             "16-byte aligned (tensor map rules)")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: inner dimensions differ")
    if padding not in ("zero", "nan"):
        raise ValueError(f"padding must be 'zero' or 'nan', got {padding!r}")
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    triton.set_allocator(_alloc)
    grid, args, kwargs = _launch_args(a, b, c, block=block, stages=stages, specialize=specialize, padding=padding)
    _ws_matmul_kernel[grid](*args, **kwargs)
    return c


def _alloc(size: int, alignment: int, stream):
    """Global scratch for the device-side tensor descriptors (Triton asks the host for it)."""
    return torch.empty(size, dtype=torch.int8, device=runtime.device())


def _launch_args(a, b, c, *, block=(128, 128, 64), stages: int = 3, specialize: bool = True, padding: str = "zero"):
    """(grid, args, kwargs) of one launch of :func:`_ws_matmul_kernel`, shared by :func:`ws_matmul`
    and :func:`launch_job` so the AOT build is the launch."""
    bm, bn, bk = block
    M, K = a.shape
    N = b.shape[1]
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    return grid, (a, b, c, M, N, K, a.stride(0), b.stride(0), c.stride(0)), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, SPECIALIZE=specialize, PADDING=padding, num_warps=4)


def launch_job(M: int, K: int, N: int, *, specialize: bool = True, block=(128, 128, 64), stages: int = 3):
    """The AOT job of :func:`ws_matmul` at (M, K) @ (K, N) on meta tensors."""
    from kernels import inspect as ki

    a = torch.empty(M, K, dtype=torch.float16, device="meta")
    b = torch.empty(K, N, dtype=torch.float16, device="meta")
    c = torch.empty(M, N, dtype=torch.float32, device="meta")
    grid, args, kwargs = _launch_args(a, b, c, block=block, stages=stages, specialize=specialize)
    return ki.launch_job(_ws_matmul_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama-3-8B's gate/up projection at a 4096-token prefill (4096 x 4096 -> 14336), warp-specialized
    and plain (the same loop without ``warp_specialize``), at the 128-row launch tile and at 64 rows."""
    jobs = {}
    for bm in (128, 64):
        for spec in (True, False):
            kind = "warp-specialized" if spec else "plain loop"
            jobs[f"{bm}x128x64 {kind}"] = launch_job(4096, 4096, 14336, specialize=spec, block=(bm, 128, 64))
    return jobs


@dataclass(frozen=True)
class ConsumerDot:
    """One consumer partition's MMA, read from an sm90 TTGIR: its ``warp_group_dot`` (wgmma) shape
    (m x k times k x n) and the shared-memory buffers (the kernel-level SSA names
    that ``ttg.warp_specialize`` hands the partition) its A and B operands are read from."""
    partition: str
    m: int
    n: int
    k: int
    a_buffer: str
    b_buffer: str


_DOT = re.compile(r"= ttng\.warp_group_dot (%[\w.]+), (%[\w.]+),.*?!ttg\.memdesc<(\d+)x(\d+)x[^>]*>"
                  r" \* !ttg\.memdesc<(\d+)x(\d+)x[^>]*> -> tensor<(\d+)x(\d+)x")


def warp_regions(ttgir: str) -> dict[str, list[str]]:
    """The lines of each region of the ``ttg.warp_specialize`` in a TTGIR listing, by name
    ("default", "partition0", ...), each partition's header line first; plus "operands": the
    kernel-level values the op hands its partitions, in order. Empty when there is no region."""
    lines = ttgir.splitlines()
    start = next((i for i, ln in enumerate(lines) if "ttg.warp_specialize(" in ln), None)
    if start is None:
        return {}
    head = lines[start]
    regions = {"operands": re.findall(r"%[\w.]+", head[head.index("(") + 1:head.index(")")])}
    current = None
    for ln in lines[start + 1:]:
        name = re.match(r"\s*(default) \{|\s*(partition\d+)\(", ln)
        if name:
            current = name.group(1) or name.group(2)
            regions[current] = [ln]
        elif re.match(r"\s*\} : \(", ln):
            break
        elif current:
            regions[current].append(ln)
    return regions


def consumer_dots(ttgir: str) -> list[ConsumerDot]:
    """The wgmma of every partition that issues one, with the buffers it reads (see :class:`ConsumerDot`).
    Two consumers whose ``a_buffer`` is the same read the same rows of A: they compute the same
    output rows (replication). A split tile gives them different A buffers of BLOCK_M / 2 rows."""
    regions = warp_regions(ttgir)
    out = []
    for name, body in regions.items():
        if not name.startswith("partition"):
            continue
        params = re.findall(r"(%[\w.]+): ", body[0])              # the partition's block arguments, in order
        defs = {m.group(1): m.group(2) for m in
                (re.search(r"(%[\w.]+) = ttg\.memdesc_index (%[\w.]+)\[", ln) for ln in body) if m}

        def buffer(value: str) -> str:
            arg = defs.get(value, value)                           # the ring slot -> the whole ring
            return regions["operands"][params.index(arg)] if arg in params else arg

        for ln in body:
            m = _DOT.search(ln)
            if m:
                a, b, am, ak, bk, bn, cm, cn = m.groups()
                out.append(ConsumerDot(name, int(cm), int(cn), int(ak), buffer(a), buffer(b)))
    return out


_COPY = re.compile(r"ttng\.async_tma_copy_(global_to_local|local_to_global) (%[\w.]+)\[(%[\w.]+), (%[\w.]+)\] (%[\w.]+)")


def partition_listing(ttgir: str) -> list[str]:
    """What each region of the ``ttg.warp_specialize`` does, one line per TMA copy and wgmma, read
    from the TTGIR: a copy's coordinates written out in terms of ``pid_m``, ``pid_n`` and the loop
    counter ``k`` (from the region's own arithmetic), each ring slot named by its ring (the
    kernel-level buffer, as in :func:`consumer_dots`)."""
    regions = warp_regions(ttgir)
    dots = {(d.partition, d.m): d for d in consumer_dots(ttgir)}
    out = []
    for name, body in regions.items():
        if name == "operands":
            continue
        params = re.findall(r"(%[\w.]+): ", body[0]) if name.startswith("partition") else []
        defs = {}
        for ln in body:
            m = re.match(r"\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (.*)", ln)
            if m:
                defs[m.group(1)] = (m.group(2), m.group(3))
            loop = re.search(r"scf\.for (%[\w.]+) = ", ln)
            if loop:
                defs[loop.group(1)] = ("loop", "k")

        def expr(v: str) -> str:
            const = re.fullmatch(r"%c(\d+)_i\d+(?:_\d+)?", v)
            if const:
                return const.group(1)
            op, rest = defs.get(v, (None, ""))
            if op == "loop":
                return "k"
            if op == "tt.get_program_id":
                return "pid_m" if rest.startswith("x") else "pid_n"
            if op in ("arith.muli", "arith.addi"):
                x, y = re.findall(r"%[\w.]+", rest)[:2]
                return f"{expr(x)}{'*' if op == 'arith.muli' else ' + '}{expr(y)}"
            return v

        def ring(v: str) -> str:
            op, rest = defs.get(v, (None, ""))
            base = re.match(r"(%[\w.]+)\[", rest).group(1) if op == "ttg.memdesc_index" else v
            return regions["operands"][params.index(base)] if base in params else base

        for ln in body:
            c = _COPY.search(ln)
            if c:
                kind, desc, r, col, buf = c.groups()
                desc = desc.lstrip("%").split("_desc")[0]
                if kind == "global_to_local":
                    out.append(f"{name}: TMA load  {desc}[{expr(r)}, {expr(col)}] -> {ring(buf)}")
                else:
                    out.append(f"{name}: TMA store {desc}[{expr(r)}, {expr(col)}]")
            if "ttng.warp_group_dot " in ln:
                d = next(d for (p, _), d in dots.items() if p == name)
                out.append(f"{name}: wgmma {d.m}x{d.k} (A from {d.a_buffer}) * {d.k}x{d.n} (B from {d.b_buffer}) -> {d.m}x{d.n}")
    return out


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
