"""The GPUs the course estimates for, with every number's source.

One table, :data:`GPUS`, holds per GPU the streaming-multiprocessor (SM) count, the per-SM limits
that decide occupancy (shared memory, registers, resident threads, blocks and warps), the L2 and
HBM sizes, the HBM bandwidth and the DENSE (no 2:4 sparsity) peak throughput per dtype. Every
chapter's roofline estimate reads these values through :func:`gpu`; no chapter keeps its own copy.

Where the numbers come from (keys in ``references.bib``; each :class:`GPU` names its own per field
in ``sources``):

* per-SM limits (shared memory per SM and per block, registers, threads, blocks, warps) are
  properties of the compute capability: the CUDA C++ Programming Guide, "Compute Capabilities",
  technical-specifications table (``nvidia2025cudaguide``);
* SM count, L2, memory size and bandwidth, and peak TFLOP/s come from each product's datasheet or
  architecture whitepaper. Datasheets quote tensor-core throughput *with* 2:4 sparsity and say in a
  footnote that dense throughput is one half of it; this table stores the dense half.
* Two B200 facts NVIDIA's datasheets do not state, the SM count (148) and the L2 size (126 MB),
  are the values reported by the device itself in published measurements
  (``chipsandcheese2025b200``, ``jarmusch2025blackwell``); they are marked as such in ``NOTES``.

Units: ``*_kib`` are KiB (1024 bytes), ``l2_mib`` is MiB as the whitepapers print "MB" for these
power-of-two caches, ``hbm_gib`` is the capacity the datasheet prints (it says "GB"),
``hbm_bandwidth_gbs`` is GB/s with 1 GB = 1e9 bytes, ``peak_tflops`` is 1e12 FLOP/s (for int8,
1e12 operations per second).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "fp6", "fp4", "int8")


@dataclass(frozen=True)
class GPU:
    key: str                   # "A100", "H100", "H200", "B200", "RTX5090"
    name: str                  # "NVIDIA H100 SXM5 80GB"
    arch: str                  # "sm80", "sm90", "sm100", "sm120"
    sms: int
    smem_per_sm_kib: int       # max shared memory per SM (configurable carve-out maximum)
    smem_per_block_kib: int    # max shared memory one block can opt in to
    registers_per_sm: int      # 32-bit registers per SM
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_warps_per_sm: int
    l2_mib: float
    hbm_gib: float
    hbm_bandwidth_gbs: float   # GB/s, 1e9 bytes per second
    peak_tflops: dict[str, float]  # DENSE tensor-core peaks by dtype; "fp32" is the CUDA-core (non-tensor) fp32 peak
    sources: dict[str, str] = field(default_factory=dict)  # field name -> citation key in references.bib

    def peak(self, dtype: str) -> float:
        """Dense peak TFLOP/s for ``dtype``; a clear error if this GPU has no such tensor-core path."""
        if dtype not in DTYPES:
            raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        if dtype not in self.peak_tflops:
            raise KeyError(
                f"{self.key} ({self.arch}) has no peak listed for {dtype!r} in its datasheet; "
                f"listed: {', '.join(sorted(self.peak_tflops))}"
            )
        return self.peak_tflops[dtype]

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_bandwidth_gbs * 1e9


# Per compute capability: the CUDA C++ Programming Guide, "Compute Capabilities", table
# "Technical Specifications per Compute Capability" (nvidia2025cudaguide), cross-checked against
# the per-architecture traits NVIDIA's CCCL library ships (nvidia2025cccltraits: cuda/__device/
# arch_traits.h). 12.0 (RTX 50) has a smaller SM than 10.0 (B200): at most 100 KiB of shared
# memory, 1536 resident threads and 24 resident blocks.
ARCH_LIMITS: dict[str, dict[str, int]] = {
    #            KiB/SM  KiB/block  regs/SM  threads/SM  blocks/SM  warps/SM
    "sm80":  dict(smem_per_sm_kib=164, smem_per_block_kib=163, registers_per_sm=65536,
                  max_threads_per_sm=2048, max_blocks_per_sm=32, max_warps_per_sm=64),
    "sm90":  dict(smem_per_sm_kib=228, smem_per_block_kib=227, registers_per_sm=65536,
                  max_threads_per_sm=2048, max_blocks_per_sm=32, max_warps_per_sm=64),
    "sm100": dict(smem_per_sm_kib=228, smem_per_block_kib=227, registers_per_sm=65536,
                  max_threads_per_sm=2048, max_blocks_per_sm=32, max_warps_per_sm=64),
    "sm120": dict(smem_per_sm_kib=100, smem_per_block_kib=99, registers_per_sm=65536,
                  max_threads_per_sm=1536, max_blocks_per_sm=24, max_warps_per_sm=48),
}

# Limits common to sm80..sm120 used by occupancy(); same Programming Guide table and the CUDA
# Occupancy Calculator's allocation rules (nvidia2025cudaguide, nvidia2025occupancy).
MAX_THREADS_PER_BLOCK = 1024
MAX_REGISTERS_PER_THREAD = 255
WARP_SIZE = 32
REGISTER_ALLOCATION_UNIT = 256        # registers are allocated per warp in units of 256
SM_PARTITIONS = 4                     # the register file is split over 4 SM sub-partitions (one scheduler each)
SMEM_ALLOCATION_UNIT = 128            # bytes; shared memory is allocated per block in 128-byte units
SMEM_RESERVED_PER_BLOCK = 1024        # bytes the system reserves per resident block (cc 8.0 and later)

_LIMIT_SOURCE = "nvidia2025cudaguide"
_LIMIT_FIELDS = tuple(ARCH_LIMITS["sm80"])


def _gpu(key, name, arch, sms, l2_mib, hbm_gib, bw, peaks, product_sources):
    sources = {f: _LIMIT_SOURCE for f in _LIMIT_FIELDS}
    sources.update(product_sources)
    return GPU(key=key, name=name, arch=arch, sms=sms, l2_mib=l2_mib, hbm_gib=hbm_gib,
               hbm_bandwidth_gbs=bw, peak_tflops=dict(peaks), sources=sources, **ARCH_LIMITS[arch])


GPUS: dict[str, GPU] = {
    # A100 SXM4 80GB. SMs and L2: the A100 whitepaper (108 SMs, 40 MB L2). Memory and all peaks: the
    # A100 datasheet (80 GB HBM2e at 2,039 GB/s for the SXM part; FP16 312, TF32 156, INT8 624 dense).
    "A100": _gpu(
        "A100", "NVIDIA A100 SXM4 80GB", "sm80", sms=108, l2_mib=40, hbm_gib=80, bw=2039,
        peaks={"fp64": 19.5, "fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312, "int8": 624},
        product_sources={"sms": "nvidia2020a100whitepaper", "l2_mib": "nvidia2020a100whitepaper",
                         "hbm_gib": "nvidia2021a100datasheet", "hbm_bandwidth_gbs": "nvidia2021a100datasheet",
                         "peak_tflops": "nvidia2021a100datasheet"},
    ),
    # H100 SXM5 80GB. The Hopper whitepaper's H100 SXM5 table: 132 SMs, 50 MB L2, dense peaks
    # FP64 tensor 66.9, FP32 66.9, TF32 494.7, FP16/BF16 989.4, FP8 1978.9, INT8 1978.9.
    # Memory: the H100 datasheet (80 GB HBM3, 3.35 TB/s).
    "H100": _gpu(
        "H100", "NVIDIA H100 SXM5 80GB", "sm90", sms=132, l2_mib=50, hbm_gib=80, bw=3350,
        peaks={"fp64": 66.9, "fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4,
               "fp8": 1978.9, "int8": 1978.9},
        product_sources={"sms": "nvidia2022h100whitepaper", "l2_mib": "nvidia2022h100whitepaper",
                         "hbm_gib": "nvidia2023h100datasheet", "hbm_bandwidth_gbs": "nvidia2023h100datasheet",
                         "peak_tflops": "nvidia2022h100whitepaper"},
    ),
    # H200 SXM 141GB: the same GH100 silicon as H100 SXM5 (132 SMs, 50 MB L2: Hopper whitepaper);
    # the H200 datasheet gives 141 GB HBM3e at 4.8 TB/s and the peaks (sparse figures halved:
    # TF32 989 -> 494.5, FP16/BF16 1,979 -> 989.5, FP8/INT8 3,958 -> 1,979; FP64 tensor 67, FP32 67).
    "H200": _gpu(
        "H200", "NVIDIA H200 SXM 141GB", "sm90", sms=132, l2_mib=50, hbm_gib=141, bw=4800,
        peaks={"fp64": 67, "fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5,
               "fp8": 1979, "int8": 1979},
        product_sources={"sms": "nvidia2022h100whitepaper", "l2_mib": "nvidia2022h100whitepaper",
                         "hbm_gib": "nvidia2024h200datasheet", "hbm_bandwidth_gbs": "nvidia2024h200datasheet",
                         "peak_tflops": "nvidia2024h200datasheet"},
    ),
    # B200 as in HGX B200 (1,000 W). The NVIDIA Blackwell datasheet (GB200 NVL72 / HGX B200), per GPU:
    # 180 GB HBM3e at 7.7 TB/s; sparse FP4 18 PF, FP8/FP6 9 PF, INT8 9 POPS, FP16/BF16 4.5 PF,
    # TF32 2.2 PF (dense: half of each); FP32 75 TF; FP64/FP64 tensor 37 TF.
    # SM count and L2 are not in the datasheet: 148 SMs and 126 MB L2 as the device reports them
    # (chipsandcheese2025b200; jarmusch2025blackwell).
    "B200": _gpu(
        "B200", "NVIDIA B200 (HGX B200, 180GB)", "sm100", sms=148, l2_mib=126, hbm_gib=180, bw=7700,
        peaks={"fp64": 37, "fp32": 75, "tf32": 1100, "fp16": 2250, "bf16": 2250, "fp8": 4500,
               "fp6": 4500, "fp4": 9000, "int8": 4500},
        product_sources={"sms": "chipsandcheese2025b200", "l2_mib": "chipsandcheese2025b200",
                         "hbm_gib": "nvidia2024blackwelldatasheet",
                         "hbm_bandwidth_gbs": "nvidia2024blackwelldatasheet",
                         "peak_tflops": "nvidia2024blackwelldatasheet"},
    ),
    # GeForce RTX 5090 (GB202, compute capability 12.0). The RTX Blackwell GPU architecture whitepaper:
    # 170 SMs, 96 MB L2, 32 GB GDDR7 at 1,792 GB/s, FP32 104.8 TF; tensor peaks (sparse halved):
    # FP16/BF16 419, TF32 104.8, FP8 838, INT8 838, FP4 1,676. There is no FP64 tensor path.
    "RTX5090": _gpu(
        "RTX5090", "NVIDIA GeForce RTX 5090 32GB", "sm120", sms=170, l2_mib=96, hbm_gib=32, bw=1792,
        peaks={"fp32": 104.8, "tf32": 104.8, "fp16": 419, "bf16": 419, "fp8": 838, "fp4": 1676,
               "int8": 838},
        product_sources={"sms": "nvidia2025rtxblackwell", "l2_mib": "nvidia2025rtxblackwell",
                         "hbm_gib": "nvidia2025rtxblackwell", "hbm_bandwidth_gbs": "nvidia2025rtxblackwell",
                         "peak_tflops": "nvidia2025rtxblackwell"},
    ),
}

# Caveats a reader should see beside the numbers.
NOTES: dict[tuple[str, str], str] = {
    ("B200", "sms"): "not in NVIDIA's datasheet; the count the device reports (148 of 160 SMs on two dies)",
    ("B200", "l2_mib"): "not in NVIDIA's datasheet; the size the device reports",
    ("B200", "hbm_bandwidth_gbs"): "HGX B200 datasheet revision: 7.7 TB/s (earlier revisions printed 8 TB/s)",
    ("RTX5090", "hbm_gib"): "GDDR7, not HBM; the field keeps its name for one table across parts",
    ("RTX5090", "peak_tflops"): "GeForce tensor peaks as the whitepaper lists them with FP16 accumulation; "
                                "check the whitepaper's FP32-accumulate row before using fp16 for training estimates",
    ("H200", "hbm_gib"): "HBM3e; the datasheet prints 141 GB",
}


def gpu(key: str) -> GPU:
    """The GPU named ``key`` ("A100", "H100", "H200", "B200", "RTX5090"); also accepts a :class:`GPU`."""
    if isinstance(key, GPU):
        return key
    try:
        return GPUS[key]
    except KeyError:
        raise KeyError(f"unknown GPU {key!r}; known GPUs: {', '.join(GPUS)}") from None


# How CUDA names the boards of the table (``torch.cuda.get_device_name()``). Only the exact board
# the table describes matches: an H100 PCIe or an A100 40GB has other bandwidths and peaks, and gets
# None rather than another board's roofline.
_DEVICE_NAMES = (
    ("A100", ("A100", "SXM4", "80GB")),
    ("H100", ("H100", "HBM3")),
    ("H200", ("H200",)),
    ("B200", ("B200",)),
    ("RTX5090", ("RTX 5090",)),
)


def identify(device_name: str) -> GPU | None:
    """The table's entry for the GPU CUDA calls ``device_name``, or None if the table does not
    describe that exact board (NVL and PCIe variants included: their clocks and bandwidths differ)."""
    if "NVL" in device_name or "PCIe" in device_name:
        return None
    for key, tokens in _DEVICE_NAMES:
        if all(tok in device_name for tok in tokens):
            return GPUS[key]
    return None


def by_arch(arch: str) -> list[GPU]:
    """The GPUs in the table with architecture ``arch`` ("sm90" ...); error for an unknown architecture."""
    if arch not in ARCH_LIMITS:
        raise KeyError(f"unknown architecture {arch!r}; the table knows {', '.join(ARCH_LIMITS)}")
    return [g for g in GPUS.values() if g.arch == arch]


def ridge_point(g: GPU | str, dtype: str) -> float:
    """FLOP per byte where the compute roof meets the bandwidth roof: peak / bandwidth."""
    g = gpu(g)
    return g.peak(dtype) * 1e12 / g.bytes_per_s


def roofline_time_s(g: GPU | str, flops: float, bytes_moved: float, dtype: str) -> float:
    """The roofline lower bound on run time: max(flops / peak, bytes / bandwidth), in seconds."""
    g = gpu(g)
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops} and {bytes_moved}")
    return max(flops / (g.peak(dtype) * 1e12), bytes_moved / g.bytes_per_s)


def attainable_tflops(g: GPU | str, intensity: float, dtype: str) -> float:
    """The roofline: min(peak, intensity * bandwidth) in TFLOP/s, for ``intensity`` in FLOP per byte."""
    g = gpu(g)
    if intensity < 0:
        raise ValueError(f"intensity must be >= 0 FLOP/byte, got {intensity}")
    return min(g.peak(dtype), intensity * g.bytes_per_s / 1e12)


@dataclass(frozen=True)
class Occupancy:
    """How many blocks of one kernel fit on one SM, and which resource stops the next one."""

    blocks_per_sm: int
    warps_per_sm: int
    occupancy: float            # resident warps / max_warps_per_sm
    limiter: str                # "warps", "blocks", "registers" or "shared memory"
    limits: dict[str, int]      # blocks allowed by each resource on its own


def occupancy(g: GPU | str, threads_per_block: int, registers_per_thread: int,
              smem_per_block_bytes: int) -> Occupancy:
    """Resident blocks per SM for a kernel, by the rules of the CUDA Occupancy Calculator.

    Each resource gives its own bound on resident blocks; the smallest wins
    (CUDA C++ Programming Guide, "Compute Capabilities" table; the allocation rules are those of
    the CUDA Toolkit's occupancy calculator, ``cuda_occupancy.h``):

    * warps:     floor(max_warps_per_sm / ceil(threads / 32))
    * blocks:    max_blocks_per_sm
    * registers: a warp takes ceil(32 * regs / 256) * 256 registers; each of the 4 SM sub-partitions
                 holds floor((regs_per_sm / 4) / that) warps; blocks = floor(4 * that_many / warps)
    * shared:    a block takes ceil((smem + 1 KiB reserved) / 128) * 128 bytes; the SM offers its
                 maximum carve-out, smem_per_sm_kib (a kernel asking for more than smem_per_block_kib
                 cannot launch at all).
    """
    g = gpu(g)
    if not 1 <= threads_per_block <= MAX_THREADS_PER_BLOCK:
        raise ValueError(f"threads_per_block must be in 1..{MAX_THREADS_PER_BLOCK}, got {threads_per_block}")
    if not 0 <= registers_per_thread <= MAX_REGISTERS_PER_THREAD:
        raise ValueError(f"registers_per_thread must be in 0..{MAX_REGISTERS_PER_THREAD}, got {registers_per_thread}")
    if smem_per_block_bytes < 0:
        raise ValueError(f"smem_per_block_bytes must be >= 0, got {smem_per_block_bytes}")
    if smem_per_block_bytes > g.smem_per_block_kib * 1024:
        raise ValueError(
            f"{g.key} ({g.arch}) lets one block use at most {g.smem_per_block_kib} KiB of shared memory; "
            f"asked for {smem_per_block_bytes} bytes ({smem_per_block_bytes / 1024:.1f} KiB)"
        )
    warps = math.ceil(threads_per_block / WARP_SIZE)
    limits = {"warps": g.max_warps_per_sm // warps, "blocks": g.max_blocks_per_sm}
    if registers_per_thread:
        regs_per_warp = math.ceil(registers_per_thread * WARP_SIZE / REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
        # warps are placed on the 4 sub-partitions, each with a quarter of the register file
        warps_by_regs = (g.registers_per_sm // SM_PARTITIONS // regs_per_warp) * SM_PARTITIONS
        limits["registers"] = warps_by_regs // warps
    else:
        limits["registers"] = limits["blocks"]
    smem = math.ceil((smem_per_block_bytes + SMEM_RESERVED_PER_BLOCK) / SMEM_ALLOCATION_UNIT) * SMEM_ALLOCATION_UNIT
    limits["shared memory"] = (g.smem_per_sm_kib * 1024) // smem
    order = ["warps", "blocks", "registers", "shared memory"]
    blocks = min(limits.values())
    limiter = min(order, key=lambda k: (limits[k], order.index(k)))
    return Occupancy(blocks_per_sm=blocks, warps_per_sm=blocks * warps,
                     occupancy=blocks * warps / g.max_warps_per_sm, limiter=limiter, limits=limits)


def table(keys=None) -> list[dict]:
    """The table as rows of plain values (for printing in a notebook)."""
    rows = []
    for g in (gpu(k) for k in (keys or GPUS)):
        rows.append({"gpu": g.key, "arch": g.arch, "SMs": g.sms, "smem/SM KiB": g.smem_per_sm_kib,
                     "regs/SM": g.registers_per_sm, "L2 MiB": g.l2_mib, "memory GB": g.hbm_gib,
                     "GB/s": g.hbm_bandwidth_gbs, **{f"{d} TF": g.peak_tflops.get(d) for d in DTYPES}})
    return rows


# ----------------------------------------------------------------------------------------------
# On-chip rates, for the memory-hierarchy chapter's bandwidths

SMEM_BANKS = 32                 # shared memory: 32 banks, each 32 bits wide per clock (CUDA C++ Programming Guide,
SMEM_BANK_BYTES = 4             # "Shared Memory" under compute capabilities 5.x and later; nvidia2025cudaguide)

# Dense FP16 tensor-core FLOP per clock per SM. A100: 4 tensor cores x 256 FP16 FMA per clock
# (nvidia2020a100whitepaper) = 2048 FLOP. H100: twice the A100 SM's MMA rate clock for clock
# (nvidia2022h100whitepaper) = 4096 FLOP.
TENSOR_FP16_FLOP_PER_CLOCK_PER_SM = {"sm80": 2048, "sm90": 4096}

# A100: 1410 MHz boost clock and an L2 read bandwidth of 5120 bytes per clock (nvidia2020a100whitepaper).
BOOST_CLOCK_MHZ = {"A100": 1410}
L2_BYTES_PER_CLOCK = {"A100": 5120}


def boost_clock_mhz(g: GPU | str) -> float:
    """The boost clock: printed in the whitepaper for A100; for H100/H200 implied by the dense FP16
    peak and the per-SM tensor rate: peak / (SMs x FLOP per clock per SM)."""
    g = gpu(g)
    if g.key in BOOST_CLOCK_MHZ:
        return float(BOOST_CLOCK_MHZ[g.key])
    if g.arch in TENSOR_FP16_FLOP_PER_CLOCK_PER_SM:
        return g.peak("fp16") * 1e12 / (g.sms * TENSOR_FP16_FLOP_PER_CLOCK_PER_SM[g.arch]) / 1e6
    raise KeyError(f"no documented clock or per-SM tensor rate for {g.key} ({g.arch})")


def smem_bandwidth_gbs(g: GPU | str) -> float:
    """Aggregate shared-memory bandwidth: SMs x 32 banks x 4 bytes x clock, in GB/s."""
    g = gpu(g)
    return g.sms * SMEM_BANKS * SMEM_BANK_BYTES * boost_clock_mhz(g) * 1e6 / 1e9


# Thread block clusters (sm90 and later): at most 8 blocks per cluster portably; H100 accepts 16 when
# the kernel opts in (cudaFuncAttributeNonPortableClusterSizeAllowed). CUDA C++ Programming Guide,
# "Thread Block Clusters" (nvidia2025cudaguide).
MAX_CLUSTER_SIZE_PORTABLE = 8
MAX_CLUSTER_SIZE_NONPORTABLE = {"sm90": 16}


# ----------------------------------------------------------------------------------------------
# How a warp's addresses become memory transactions (the memory-hierarchy chapter)

# Global memory is moved in 32-byte sectors; an L1/L2 cache line is 128 bytes = 4 sectors, and a
# miss fetches only the sectors the warp touched. The concurrent accesses of a warp's 32 threads
# coalesce into as many sector transactions as their addresses span (CUDA C++ Programming Guide,
# "Device Memory Accesses" and the global-memory sections per compute capability; nvidia2025cudaguide).
SECTOR_BYTES = 32
CACHE_LINE_BYTES = 128


def warp_sectors(byte_addresses, access_bytes: int) -> int:
    """Distinct 32-byte sectors one warp touches when each of its threads reads ``access_bytes``
    starting at its entry of ``byte_addresses`` (32 addresses, one per thread)."""
    addrs = [int(a) for a in byte_addresses]
    if len(addrs) != WARP_SIZE:
        raise ValueError(f"warp_sectors: expected {WARP_SIZE} addresses (one per thread), got {len(addrs)}")
    if access_bytes not in (1, 2, 4, 8, 16):
        raise ValueError(f"warp_sectors: access_bytes must be 1, 2, 4, 8 or 16 (a load's width), got {access_bytes}")
    sectors = set()
    for a in addrs:
        if a % access_bytes:
            raise ValueError(f"warp_sectors: address {a} is not aligned to its {access_bytes}-byte access")
        sectors.update(range(a // SECTOR_BYTES, (a + access_bytes - 1) // SECTOR_BYTES + 1))
    return len(sectors)


def smem_bank_ways(byte_addresses) -> int:
    """The bank-conflict degree of one warp's 4-byte shared-memory access: the largest number of
    DISTINCT 4-byte words any one of the 32 banks must deliver (1 = conflict-free; threads reading
    the same word share one broadcast). Bank of a word = (byte address / 4) mod 32 (CUDA C++
    Programming Guide, "Shared Memory", compute capability 5.x and later; nvidia2025cudaguide).
    Wider accesses are split by the hardware into phases; the ldmatrix and wgmma chapters treat them."""
    addrs = [int(a) for a in byte_addresses]
    if len(addrs) != WARP_SIZE:
        raise ValueError(f"smem_bank_ways: expected {WARP_SIZE} addresses (one per thread), got {len(addrs)}")
    if any(a % SMEM_BANK_BYTES for a in addrs):
        raise ValueError("smem_bank_ways: every address must be 4-byte aligned (a 32-bit access)")
    words_per_bank: dict[int, set[int]] = {}
    for a in addrs:
        w = a // SMEM_BANK_BYTES
        words_per_bank.setdefault(w % SMEM_BANKS, set()).add(w)
    return max(len(words) for words in words_per_bank.values())


# ----------------------------------------------------------------------------------------------
# Published measurements (not datasheet numbers): te42kyfo/gpu-benches, D. Ernst's microbenchmarks
# (te42kyfo2024gpubenches), which a reader can rerun.

# gpu-latency (pointer chasing by one warp, every cache line touched once per pass) on an H100 PCIe
# at 1755 MHz, gpu-latency/h100_pcie.txt @a7dc559c: (working set in kB, cycles per load). The steps
# are the L1 (up to the 256 KiB unified L1/shared SRAM), the near L2 partition, the far one
# (H100's 50 MB L2 is two partitions of 25 MB), and HBM.
POINTER_CHASE_H100_PCIE = (
    (1, 34.2), (16, 34.1), (64, 34.2), (216, 34.8), (239, 134.2), (264, 205.8), (354, 264.0),
    (1029, 265.6), (10230, 265.5), (19946, 265.5), (26551, 319.6), (35343, 475.4), (47045, 466.8),
    (62620, 626.5), (125026, 649.9), (340388, 652.4), (1529075, 658.4),
)
POINTER_CHASE_CLOCK_MHZ = 1755
# the plateaus of that curve, in cycles
LATENCY_CYCLES_H100_PCIE = {"L1 hit": 34, "L2 hit, near partition": 265, "L2 hit, far partition": 475, "HBM": 650}

# gpu-stream "read" kernel (each thread loads one 8-byte double, two blocks per SM, the block size
# swept) on an H200 (132 SMs), gpu-stream/h200.txt @fd7091fb: (threads per SM, GB/s).
STREAM_READ_H200 = (
    (64, 123), (256, 485), (512, 935), (768, 1314), (1024, 1707), (1280, 1996), (1536, 2297),
    (1792, 2539), (2048, 2756),
)
STREAM_BYTES_PER_THREAD = 8
