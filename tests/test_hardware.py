"""kernels/gpu/hardware.py: the GPU table, its sources, the roofline helpers and the occupancy calculator."""
import re
from pathlib import Path

import pytest

import kernels  # noqa: F401
from kernels.gpu import hardware as hw

ROOT = Path(__file__).resolve().parent.parent
BIB_KEYS = set(re.findall(r"@\w+\{([^,\s]+),", (ROOT / "references.bib").read_text()))


def test_table_has_the_five_gpus_with_their_architectures():
    assert {k: g.arch for k, g in hw.GPUS.items()} == {
        "A100": "sm80", "H100": "sm90", "H200": "sm90", "B200": "sm100", "RTX5090": "sm120"}


@pytest.mark.parametrize("key", list(hw.GPUS))
def test_every_field_has_a_source_in_references_bib(key):
    g = hw.gpu(key)
    needed = {"sms", "smem_per_sm_kib", "smem_per_block_kib", "registers_per_sm", "max_threads_per_sm",
              "max_blocks_per_sm", "max_warps_per_sm", "l2_mib", "hbm_gib", "hbm_bandwidth_gbs", "peak_tflops"}
    assert needed <= set(g.sources), needed - set(g.sources)
    missing = {f: k for f, k in g.sources.items() if k not in BIB_KEYS}
    assert not missing, f"{key}: citation keys not in references.bib: {missing}"


@pytest.mark.parametrize("key", list(hw.GPUS))
def test_values_are_consistent(key):
    g = hw.gpu(key)
    assert g.max_warps_per_sm * 32 == g.max_threads_per_sm
    assert g.smem_per_block_kib <= g.smem_per_sm_kib
    assert set(g.peak_tflops) <= set(hw.DTYPES)
    assert all(v > 0 for v in g.peak_tflops.values())
    # the tensor-core ladder: each halving of the bits doubles the dense rate where both are listed
    for wide, narrow in (("fp16", "fp8"), ("fp8", "fp4")):
        if wide in g.peak_tflops and narrow in g.peak_tflops:
            assert g.peak_tflops[narrow] == pytest.approx(2 * g.peak_tflops[wide], rel=0.01)
    assert g.peak_tflops["fp16"] == g.peak_tflops["bf16"]


def test_published_figures():
    assert hw.gpu("A100").peak("fp16") == 312 and hw.gpu("A100").hbm_bandwidth_gbs == 2039
    assert hw.gpu("H100").sms == 132 and hw.gpu("H100").peak("fp8") == pytest.approx(1978.9)
    assert hw.gpu("H200").hbm_bandwidth_gbs == 4800 and hw.gpu("H200").hbm_gib == 141
    assert hw.gpu("B200").peak("fp4") == 9000 and hw.gpu("B200").peak("fp16") == 2250
    assert hw.gpu("RTX5090").smem_per_sm_kib == 100 and hw.gpu("RTX5090").max_threads_per_sm == 1536
    assert hw.gpu("RTX5090").max_blocks_per_sm == 24 and hw.gpu("A100").max_blocks_per_sm == 32


def test_unknown_gpu_and_dtype_errors_name_what_is_known():
    with pytest.raises(KeyError, match="A100.*H100.*H200.*B200.*RTX5090"):
        hw.gpu("V100")
    with pytest.raises(KeyError, match="no peak listed for 'fp4'"):
        hw.gpu("A100").peak("fp4")
    with pytest.raises(KeyError, match="unknown dtype"):
        hw.gpu("A100").peak("fp12")
    with pytest.raises(KeyError, match="unknown architecture"):
        hw.by_arch("sm70")


def test_roofline_helpers():
    h = hw.gpu("H100")
    ridge = hw.ridge_point(h, "fp16")
    assert ridge == pytest.approx(989.4e12 / 3350e9)
    assert hw.attainable_tflops(h, ridge, "fp16") == pytest.approx(989.4)
    assert hw.attainable_tflops(h, ridge / 2, "fp16") == pytest.approx(989.4 / 2)
    assert hw.attainable_tflops(h, 10 * ridge, "fp16") == pytest.approx(989.4)
    # memory-bound: a copy of 1 GB moves 2 GB
    assert hw.roofline_time_s(h, 0, 2e9, "fp16") == pytest.approx(2e9 / 3350e9)
    # compute-bound: a large matmul
    flops = 2 * 8192**3
    assert hw.roofline_time_s(h, flops, 3 * 8192**2 * 2, "fp16") == pytest.approx(flops / 989.4e12)
    with pytest.raises(ValueError):
        hw.attainable_tflops(h, -1, "fp16")
    with pytest.raises(ValueError):
        hw.roofline_time_s(h, -1, 0, "fp16")


def test_occupancy_each_limiter():
    # registers: 255 registers/thread x 256 threads = 8 warps x 8192 registers = all 65536
    o = hw.occupancy("H100", 256, 255, 0)
    assert (o.blocks_per_sm, o.limiter) == (1, "registers")
    # warps: 1024 threads, few registers: 2 blocks fill 64 warps
    o = hw.occupancy("A100", 1024, 16, 0)
    assert (o.blocks_per_sm, o.warps_per_sm, o.occupancy, o.limiter) == (2, 64, 1.0, "warps")
    # blocks: tiny blocks stop at 32 per SM
    o = hw.occupancy("A100", 32, 16, 0)
    assert (o.blocks_per_sm, o.limiter) == (32, "blocks")
    # shared memory: 64 KiB + 1 KiB reserved per block; A100 has 164 KiB -> 2 blocks, H100 228 -> 3
    assert hw.occupancy("A100", 128, 32, 64 * 1024).blocks_per_sm == 2
    assert hw.occupancy("H100", 128, 32, 64 * 1024).blocks_per_sm == 3
    assert hw.occupancy("H100", 128, 32, 64 * 1024).limiter == "shared memory"
    # sm120 has 48 warps per SM, so 1024-thread blocks fit only once, and at most 24 blocks
    assert hw.occupancy("RTX5090", 1024, 16, 0).blocks_per_sm == 1
    assert hw.occupancy("RTX5090", 32, 16, 0).blocks_per_sm == 24


def test_occupancy_register_granularity_per_sub_partition():
    # 80 regs -> 2560 per warp; a quarter of the file (16384) holds 6 warps, so 24 warps, not 25
    o = hw.occupancy("A100", 32, 80, 0)
    assert o.limits["registers"] == 24
    # 33 registers round up to 40 per thread (1280 per warp): 12 warps per sub-partition
    assert hw.occupancy("A100", 128, 33, 0).limits["registers"] == 48 // 4


def test_occupancy_bad_inputs():
    with pytest.raises(ValueError, match="threads_per_block"):
        hw.occupancy("A100", 0, 32, 0)
    with pytest.raises(ValueError, match="threads_per_block"):
        hw.occupancy("A100", 2048, 32, 0)
    with pytest.raises(ValueError, match="registers_per_thread"):
        hw.occupancy("A100", 128, 256, 0)
    with pytest.raises(ValueError, match="at most 99 KiB"):
        hw.occupancy("RTX5090", 128, 32, 100 * 1024)


def test_a_wrong_register_rule_is_caught(monkeypatch):
    # without the 256-register allocation unit, 80 registers/thread would seem to allow 25 warps
    monkeypatch.setattr(hw, "REGISTER_ALLOCATION_UNIT", 1)
    monkeypatch.setattr(hw, "SM_PARTITIONS", 1)
    assert hw.occupancy("A100", 32, 80, 0).limits["registers"] != 24


def test_clock_and_on_chip_bandwidths_agree_with_the_peaks():
    # A100: 108 SMs x 2048 FLOP/clock x 1410 MHz is the datasheet's 312 TFLOPS
    a = hw.gpu("A100")
    assert a.sms * hw.TENSOR_FP16_FLOP_PER_CLOCK_PER_SM["sm80"] * hw.boost_clock_mhz(a) * 1e6 == pytest.approx(312e12, rel=0.01)
    assert hw.smem_bandwidth_gbs("A100") == pytest.approx(108 * 128 * 1.41)
    assert 1.80e3 < hw.boost_clock_mhz("H100") < 1.85e3      # implied by 989.4 TFLOPS over 132 SMs
    with pytest.raises(KeyError, match="no documented clock"):
        hw.boost_clock_mhz("B200")


def test_warp_sectors_model():
    assert hw.warp_sectors([4 * t for t in range(32)], 4) == 4           # 128 contiguous bytes: 4 sectors
    assert hw.warp_sectors([4 * t + 16 for t in range(32)], 4) == 5      # misaligned by 16 bytes: one more
    assert hw.warp_sectors([128 * t for t in range(32)], 4) == 32        # one sector per thread
    assert hw.warp_sectors([0] * 32, 4) == 1                             # every thread the same word
    with pytest.raises(ValueError, match="32 addresses"):
        hw.warp_sectors([0] * 16, 4)
    with pytest.raises(ValueError, match="not aligned"):
        hw.warp_sectors([2] * 32, 4)


def test_smem_bank_ways_model():
    assert hw.smem_bank_ways([4 * t for t in range(32)]) == 1            # a row of a 32-wide fp32 tile
    assert hw.smem_bank_ways([4 * 32 * t for t in range(32)]) == 32      # a column: every word in bank 0
    assert hw.smem_bank_ways([4 * 33 * t for t in range(32)]) == 1       # padded to 33 columns
    assert hw.smem_bank_ways([4 * 2 * t for t in range(32)]) == 2        # stride 2 words: 2-way
    assert hw.smem_bank_ways([0] * 32) == 1                              # broadcast
    with pytest.raises(ValueError, match="4-byte aligned"):
        hw.smem_bank_ways([2] * 32)


def test_published_measurements_are_ordered_levels():
    lat = hw.LATENCY_CYCLES_H100_PCIE
    assert lat["L1 hit"] < lat["L2 hit, near partition"] < lat["L2 hit, far partition"] < lat["HBM"]
    sizes = [kb for kb, _ in hw.POINTER_CHASE_H100_PCIE]
    assert sizes == sorted(sizes)
    assert [bw for _, bw in hw.STREAM_READ_H200] == sorted(bw for _, bw in hw.STREAM_READ_H200)
