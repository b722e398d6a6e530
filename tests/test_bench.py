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
