"""Course-wide pytest hooks: import kernels first, run every book notebook a second time under
another CPU configuration, and report how long each notebook took.

nbval turns every notebook cell into a test item; the notebook's time is the sum of its items'
setup, call and teardown (the kernel start is part of the first cell's setup). Beside those items,
each book notebook gets one more, ``<notebook>::second CPU configuration``, which re-runs the
notebook under nbval in a fresh process with ``tools.notebooks.SECOND_CPU_CONFIG`` in its
environment and fails if any stored output differs there. The report is printed at the end of
every run and written to _build/timings.json.
"""
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import settings

import kernels  # noqa: F401  (switches Triton's interpreter on before any test imports triton)
from tools.notebooks import CPU_CONFIG_VAR, SECOND_CPU_CONFIG, run_nbval

# Property tests draw the same examples on every machine (derandomize), keep no example database
# in the checkout, and have no per-example deadline (the interpreter's speed varies by CPU).
settings.register_profile("course", derandomize=True, database=None, deadline=None)
settings.load_profile("course")

NOTEBOOK_BUDGET_S = 30.0
SECOND_PASS = "second CPU configuration"
_ROOT = Path(__file__).resolve().parent
_notebook_seconds: dict[str, float] = defaultdict(float)
_second_pass_seconds: dict[str, float] = {}
_started = time.perf_counter()


class SecondConfigFile(pytest.File):
    def collect(self):
        yield SecondConfigItem.from_parent(self, name=SECOND_PASS)


class SecondConfigItem(pytest.Item):
    """The notebook under nbval, strictly, in a fresh process with the second CPU configuration."""

    def runtest(self):
        proc = run_nbval(self.path, second_config=True)
        if proc.returncode != 0:
            raise SecondConfigMismatch(proc.stdout[-4000:] + proc.stderr[-1000:])

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, SecondConfigMismatch):
            settings = " ".join(f"{k}={v}" for k, v in SECOND_CPU_CONFIG.items())
            return (f"{self.path.name} does not reproduce its stored outputs under {settings}: a cell prints "
                    f"something that depends on the CPU (print the bound it meets instead)\n\n{excinfo.value}")
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}: {SECOND_PASS}"


class SecondConfigMismatch(Exception):
    pass


def pytest_collect_file(file_path, parent):
    """Book notebooks (not labs, which tests/test_labs.py runs in both configurations itself)."""
    if (file_path.suffix == ".ipynb" and parent.config.getoption("nbval", False)
            and _ROOT / "book" in file_path.parents and not os.environ.get(CPU_CONFIG_VAR)):
        return SecondConfigFile.from_parent(parent, path=file_path)
    return None


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if not path.endswith(".ipynb"):
        return
    if report.nodeid.endswith("::" + SECOND_PASS):
        _second_pass_seconds[path] = _second_pass_seconds.get(path, 0.0) + report.duration
    else:
        _notebook_seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _notebook_seconds or os.environ.get(CPU_CONFIG_VAR):
        return
    tr = terminalreporter
    tr.section("notebook durations (nbval, budget %.0f s each)" % NOTEBOOK_BUDGET_S)
    for path, seconds in sorted(_notebook_seconds.items(), key=lambda kv: -kv[1]):
        flag = "  OVER BUDGET" if seconds > NOTEBOOK_BUDGET_S else ""
        tr.write_line(f"{seconds:7.1f} s  {path}{flag}")
    tr.write_line(f"{sum(_notebook_seconds.values()):7.1f} s  all notebooks; whole run {time.perf_counter() - _started:.0f} s")
    if _second_pass_seconds:
        tr.write_line(f"{sum(_second_pass_seconds.values()):7.1f} s  the second CPU configuration pass "
                      f"({len(_second_pass_seconds)} notebooks, process start included)")
    out = _ROOT / "_build" / "timings.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"notebooks_s": dict(_notebook_seconds), "second_config_s": _second_pass_seconds,
                               "wall_s": time.perf_counter() - _started}, indent=1) + "\n")
