"""kernels.bench: never times the interpreter; loads recorded results with their provenance."""
import json

import pytest

from kernels import bench, runtime

on_gpu = runtime.runtime().on_gpu


@pytest.mark.skipif(on_gpu, reason="on a GPU, timing is allowed")
def test_timing_is_refused_without_a_gpu():
    with pytest.raises(bench.NoGPUError, match="not kernel performance"):
        bench.time_ms(lambda: None)
    with pytest.raises(bench.NoGPUError):
        bench.record("x", [{"ms": 1.0}], command="test")


def test_load_says_plainly_when_nothing_was_measured(tmp_path):
    assert bench.load("never-run", results_dir=tmp_path) is None
    note = bench.missing_note("never-run")
    assert "no GPU timing was run" in note and "never-run" in note


def test_load_reads_rows_and_provenance(tmp_path):
    data = {"name": "demo", "provenance": {"device": "NVIDIA H200", "capability": "sm90", "torch": "2.13.0",
                                           "triton": "3.7.1", "date": "2026-12-02T00:00:00+00:00", "command": "x"},
            "rows": [{"n": 1024, "ms": 0.5}]}
    (tmp_path / "demo.json").write_text(json.dumps(data))
    res = bench.load("demo", results_dir=tmp_path)
    assert res.rows == [{"n": 1024, "ms": 0.5}] and "NVIDIA H200 (sm90)" in res.caption()


def test_a_results_file_without_provenance_is_rejected(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="provenance"):
        bench.load("bad", results_dir=tmp_path)


@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU: do_bench times real launches")
def test_gpu_timing_and_record(tmp_path):
    import torch

    x = torch.randn(1 << 20, device="cuda")
    median, lo, hi = bench.time_ms(lambda: x * 2)
    assert 0 < lo <= median <= hi
    path = bench.record("selftest", [{"n": x.numel(), "ms": median}], command="pytest", results_dir=tmp_path)
    prov = json.loads(path.read_text())["provenance"]
    assert prov["device"] and prov["driver"] and prov["capability"].startswith("sm")


def test_every_benchmark_a_chapter_names_can_be_run():
    """A chapter that tells readers to run `python -m benchmarks.run NAME` must name a real benchmark."""
    import re
    from pathlib import Path

    from benchmarks.run import BENCHMARKS

    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"""(?:missing_note|bench\.load|BENCH_NAME\s*=)\(?\s*["']([\w-]+)["']""")
    named = set()
    for path in [*root.glob("book/**/*.ipynb"), *root.glob("kernels/**/*.py")]:
        named |= set(pattern.findall(path.read_text()))
    assert named, "no chapter names a benchmark"
    assert named <= set(BENCHMARKS), f"named but not registered in benchmarks/run.py: {sorted(named - set(BENCHMARKS))}"


def test_the_table_names_only_the_boards_it_describes():
    from kernels.gpu import hardware

    assert hardware.identify("NVIDIA H100 80GB HBM3").key == "H100"
    assert hardware.identify("NVIDIA H200").key == "H200"
    assert hardware.identify("NVIDIA A100-SXM4-80GB").key == "A100"
    assert hardware.identify("NVIDIA B200").key == "B200"
    assert hardware.identify("NVIDIA GeForce RTX 5090").key == "RTX5090"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-40GB", "Tesla T4"):
        assert hardware.identify(other) is None, other


def test_roofline_fraction_of_a_measured_run():
    """An H100 copy of 3.35 GB in 2 ms: the HBM roof says 1 ms, so half the roofline; a matmul at
    half the fp16 peak is compute-bound at fraction 0.5; a bad time is refused."""
    from kernels.gpu import hardware, roofline

    copy = roofline.achieved("H100", ms=2.0, bytes_moved=3.35e9)
    assert copy["bound"] == "memory" and copy["roofline_ms"] == pytest.approx(1.0)
    assert copy["fraction_of_roofline"] == pytest.approx(0.5)
    flops, nbytes = roofline.matmul_counts(8192, 8192, 8192)
    ideal_ms = flops / (hardware.gpu("H100").peak("fp16") * 1e12) * 1e3
    mm = roofline.achieved("H100", ms=2 * ideal_ms, bytes_moved=nbytes, flops=flops, dtype="fp16")
    assert mm["bound"] == "compute" and mm["fraction_of_roofline"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ms must be > 0"):
        roofline.achieved("H100", ms=0.0, bytes_moved=1.0)


def test_gemm_plan_and_fraction_of_cublas():
    from benchmarks.run import add_cublas_fraction, gemm_plan

    plan = gemm_plan()
    assert ("naive", "fp16", 4096) in plan and ("naive", "fp16", 8192) not in plan
    assert ("tiled", "bf16", 4096) not in plan and ("grouped", "bf16", 8192) in plan
    assert {(i, d) for i, d, n in plan if n == 8192} >= {("torch.matmul", "fp16"), ("torch.matmul", "bf16"),
                                                         ("fp8_matmul", "fp8"), ("torch._scaled_mm", "fp8")}
    rows = add_cublas_fraction([{"impl": "torch.matmul", "M": 4096, "dtype": "float16", "ms": 2.0},
                                {"impl": "grouped", "M": 4096, "dtype": "float16", "ms": 4.0},
                                {"impl": "grouped", "M": 8192, "dtype": "float16", "ms": 4.0}])
    assert [r["fraction_of_cublas"] for r in rows] == [1.0, 0.5, None]
