"""Course-wide pytest hooks: import kernels first, and report how long each notebook took.

nbval turns every notebook cell into a test item; the notebook's time is the sum of its items'
setup, call and teardown (the kernel start is part of the first cell's setup). The report is
printed at the end of every run and written to _build/timings.json.
"""
import json
import time
from collections import defaultdict
from pathlib import Path

import kernels  # noqa: F401  (switches Triton's interpreter on before any test imports triton)

NOTEBOOK_BUDGET_S = 30.0
_ROOT = Path(__file__).resolve().parent
_notebook_seconds: dict[str, float] = defaultdict(float)
_started = time.perf_counter()


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _notebook_seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _notebook_seconds:
        return
    tr = terminalreporter
    tr.section("notebook durations (nbval, budget %.0f s each)" % NOTEBOOK_BUDGET_S)
    for path, seconds in sorted(_notebook_seconds.items(), key=lambda kv: -kv[1]):
        flag = "  OVER BUDGET" if seconds > NOTEBOOK_BUDGET_S else ""
        tr.write_line(f"{seconds:7.1f} s  {path}{flag}")
    tr.write_line(f"{sum(_notebook_seconds.values()):7.1f} s  all notebooks; whole run {time.perf_counter() - _started:.0f} s")
    out = _ROOT / "_build" / "timings.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"notebooks_s": dict(_notebook_seconds),
                               "wall_s": time.perf_counter() - _started}, indent=1) + "\n")
