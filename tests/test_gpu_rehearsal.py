"""benchmarks.gpu rehearsed on the CPU: every step of the GPU run at a toy size through Triton's
interpreter, so a typo, a wrong signature or a broken reference cannot waste a GPU loan.

The times these steps record are wall-clock times of the interpreter, NOT performance; only that
each step runs, times every row and passes every check is asserted. The plan must fit its budget.
"""
import json

import kernels  # noqa: F401
import pytest
import torch

from benchmarks import gpu
from kernels import bench, runtime

pytestmark = pytest.mark.skipif(runtime.runtime().on_gpu, reason="a CPU rehearsal: on a GPU, `make gpu` runs the steps")


@pytest.mark.parametrize("step", gpu.STEPS, ids=[s.name for s in gpu.STEPS])
def test_step_runs_at_toy_size(step):
    ctx = gpu.Ctx(real=False, device=runtime.device())
    groups = gpu.run_steps(ctx, [step])
    g = groups[step.group]
    assert g["errors"] == [], g["errors"]
    assert len(g["rows"]) == step.rows, "the plan's row count of this step is not what it runs"
    untimed = [r for r in g["rows"] if "ms" not in r]
    assert untimed == [], untimed
    failed = [c for c in g["checks"] if not c["ok"]]
    assert failed == [], failed
    assert step.name == "ceilings" or g["checks"], f"{step.name} checks nothing against a reference"
    bases = {r["case"] for r in g["rows"] if r.get("baseline")}
    assert all("vs_baseline" in r for r in g["rows"] if r["case"] in bases and not r.get("baseline"))


def test_a_wrong_kernel_is_a_failed_check_and_the_run_goes_on():
    ctx = gpu.Ctx(real=False, device=runtime.device())
    x = ctx.randn(4, 8, dtype=torch.float32)
    assert not ctx.close("broken", "4x8", lambda: x + 1e-2, lambda: x)
    assert ctx.close("exact", "4x8", lambda: x.clone(), lambda: x)
    assert [c["ok"] for c in ctx.checks] == [False, True] and "MismatchError" in ctx.checks[0]["error"]

    def raises(_ctx):
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
    groups = gpu.run_steps(ctx, [gpu.Step("bad", "g", "toy", 1, 1, raises), gpu.STEPS[0]])
    assert "shared memory" in groups["g"]["errors"][0]["error"]
    assert groups["ceilings"]["rows"] and not groups["ceilings"]["errors"]


def test_a_step_that_poisons_the_context_leaves_the_later_steps_to_a_fresh_process(monkeypatch):
    """A sticky CUDA error (an illegal address) makes every later launch in the process fail: the steps
    after it run in a new process, with this run's ceilings, and their results join this run's."""
    ctx = gpu.Ctx(real=False, device=runtime.device())

    def illegal_address(_ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(gpu, "context_usable", lambda _ctx: False)
    groups = gpu.run_steps(ctx, [gpu.Step("bad", "g", "toy", 1, 1, illegal_address), gpu.STEPS[0]], rehearse=True)
    assert "illegal memory access" in groups["g"]["errors"][0]["error"]
    assert "fresh process" in groups["g"]["errors"][1]["error"]
    ran = groups["ceilings"]
    assert ran["errors"] == [] and len(ran["rows"]) == gpu.STEPS[0].rows and "ceilings" in ran["seconds"]


def test_a_step_name_that_does_not_exist_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--rehearse", "--steps", "gemm", "gemmm"])
    assert "'gemmm'" in capsys.readouterr().err


def test_the_plan_fits_eight_minutes_and_names_every_step():
    text = gpu.plan_text()
    total = gpu.STARTUP_S + gpu.TESTS_CAP_S + sum(s.estimate_s for s in gpu.STEPS)
    assert total <= gpu.BUDGET_S == 480 and "fits" in text
    assert all(s.name in text for s in gpu.STEPS)
    assert len({s.name for s in gpu.STEPS}) == len(gpu.STEPS)


def test_without_a_gpu_the_run_refuses_and_the_results_round_trip(tmp_path, capsys):
    assert gpu.main([]) == 2 and "no CUDA GPU" in capsys.readouterr().err
    groups = {"g": {"rows": [{"case": "c", "impl": "i", "ms": 1.0, "ms_p20": 0.9, "ms_p80": 1.1, "bytes": 8.0,
                              "flops": 0.0, "gbs": 8e-6, "tflops": 0.0}], "checks": [], "errors": [], "ceilings": {}}}
    path, = gpu.write_results(groups, {"device": "cpu", "torch": "x", "triton": "y", "date": "2026-12-07"},
                              tmp_path, rehearsal=True)
    loaded = bench.load("g", results_dir=tmp_path)
    assert loaded.rows == groups["g"]["rows"] and "not performance" in json.loads(path.read_text())["provenance"]["note"]


def test_junit_report_gives_per_test_errors(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase name="ok"/><testcase name="skip"><skipped/></testcase>'
                   '<testcase name="bad"><failure message="MismatchError: 3 of 40 differ"/></testcase>'
                   '</testsuite></testsuites>')
    res = gpu.junit_results(xml)
    assert (res["passed"], res["skipped"], res["failed"]) == (1, 1, 1)
    assert res["failures"] == [{"test": "bad", "error": "MismatchError: 3 of 40 differ"}]


def test_the_native_pass_enables_gpu_tests_and_leaves_notebooks_out(tmp_path):
    cmd = gpu.pytest_command(gpu.test_files()[0], tmp_path / "r.xml")
    assert "addopts=" in cmd and "not slow" in cmd and "no:nbval" in cmd and "--nbval" not in cmd
    names = [p.name for p in gpu.test_files()]
    assert "test_gpu_rehearsal.py" not in names and "test_notebooks.py" not in names
    assert names.index("test_wgmma.py") < names.index("test_adamw.py")          # GPU-only tests first


def test_the_native_pass_reports_pass_fail_and_missing_modules_per_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")          # three bare pytest processes, not the course's
    files = {"test_ok.py": "import pytest\ndef test_a():\n    assert 1\n@pytest.mark.skip(reason='x')\ndef test_b():\n    pass\n",
             "test_bad.py": "def test_c():\n    assert 1 == 2, 'broken kernel'\n",
             "test_missing.py": "import no_such_module_here\ndef test_d():\n    pass\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    ctx = gpu.Ctx(real=False, device=runtime.device())
    junit = tmp_path / "junit"
    junit.mkdir()
    gpu.run_tests(ctx, [tmp_path / n for n in files], cap_s=120, workers=3, tmp=junit, root=tmp_path)
    got = {c["kernel"]: c for c in ctx.checks}
    assert got["tests/test_ok.py"]["ok"] and (got["tests/test_ok.py"]["passed"], got["tests/test_ok.py"]["skipped"]) == (1, 1)
    assert not got["tests/test_bad.py"]["ok"] and "broken kernel" in got["tests/test_bad.py"]["failures"][0]["error"]
    assert got["tests/test_missing.py"]["error"] == "not run: needs no_such_module_here (not installed here)"
