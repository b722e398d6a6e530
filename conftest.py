"""Course-wide pytest hooks: import kernels first, run every book notebook a second time under
another CPU configuration, and report where the run's time went.

nbval turns every notebook cell into a test item; the notebook's time is the sum of its items'
setup, call and teardown (the kernel start is part of the first cell's setup). Beside nbval's
collector, each book notebook gets a second one, :class:`SecondConfigNotebook`: nbval's own, whose
kernel starts with ``tools.notebooks.SECOND_CPU_CONFIG`` in its environment, so every cell is run and
compared with its stored output again, as ``<notebook>::second CPU configuration::Cell N``, in the
same worker (no second pytest process). The report at the end gives each notebook's time against its
budget, the run's CPU time (this process, the workers and everything they waited for: kernels,
compiles) and wall time against the suite's budgets, and the ahead-of-time builds it compiled; it is
also written to _build/timings.json. A report, not a test: a shared machine's times are too noisy to
assert.
"""
import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import settings

import kernels  # noqa: F401  (switches Triton's interpreter on before any test imports triton)
from kernels import aot_cache

try:  # the notebook tooling: `make gpu` on a lent machine runs the kernel tests without it
    from nbval.plugin import IPyNbFile

    from tools.notebooks import CPU_CONFIG_VAR, SECOND_CPU_CONFIG, environment
except ImportError:
    IPyNbFile = None

# Property tests draw the same examples on every machine (derandomize), keep no example database
# in the checkout, and have no per-example deadline (the interpreter's speed varies by CPU).
settings.register_profile("course", derandomize=True, database=None, deadline=None)
settings.load_profile("course")

NOTEBOOK_BUDGET_S = 30.0          # one notebook, one configuration (course-design.md §10)
BUDGETS_MIN = {"cpu": 60.0, "wall": 40.0, "notebooks": 36.0, "aot": 6.0}   # the whole `make test`, 2 cores
SECOND_PASS = "second CPU configuration"
_ROOT = Path(__file__).resolve().parent
_RUN_DIR = _ROOT / "_build" / "run"
# Notebooks under this folder get the second pass (tests point it at a folder of their own).
SECOND_PASS_UNDER = Path(os.environ.get("COURSE_SECOND_PASS_UNDER") or _ROOT / "book").resolve()
# A pytest started by a test (a lab under nbval) inherits the run's log: it reports nothing itself.
_NESTED = bool(os.environ.get(aot_cache.LOG_ENV))
_notebook_seconds: dict[str, float] = defaultdict(float)
_second_pass_seconds: dict[str, float] = defaultdict(float)
_started = time.perf_counter()


if IPyNbFile is not None:
    class SecondConfigNotebook(IPyNbFile):
        """A book notebook under nbval again, strictly, with its kernel started under SECOND_CPU_CONFIG."""

        def setup(self):
            with environment(dict(SECOND_CPU_CONFIG, **{CPU_CONFIG_VAR: "second"})):
                super().setup()              # the kernel process inherits the environment at its start


def pytest_collect_file(file_path, parent):
    """Book notebooks get the second pass (labs are run in both configurations by tests/test_labs.py)."""
    if (IPyNbFile is not None and file_path.suffix == ".ipynb" and parent.config.getoption("nbval", False)
            and SECOND_PASS_UNDER in file_path.resolve().parents and not os.environ.get(CPU_CONFIG_VAR)):
        path = file_path.resolve()
        rel = path.relative_to(parent.config.rootpath).as_posix() if parent.config.rootpath in path.parents else str(path)
        return SecondConfigNotebook.from_parent(parent, path=file_path, nodeid=f"{rel}::{SECOND_PASS}")
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and IPyNbFile is not None and isinstance(item.parent, SecondConfigNotebook):
        settings_text = " ".join(f"{k}={v}" for k, v in SECOND_CPU_CONFIG.items())
        report.sections.append((SECOND_PASS, f"{item.path.name} does not reproduce its stored outputs under "
                                f"{settings_text}: a cell prints something that depends on the CPU (print the "
                                "bound it meets instead)"))


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if not path.endswith(".ipynb"):
        return
    if f"::{SECOND_PASS}::" in report.nodeid:
        _second_pass_seconds[path] += report.duration
    else:
        _notebook_seconds[path] += report.duration


# ----------------------------------------------------------------------------------------------
# The run's CPU time and ahead-of-time builds. Each process (the controller, each xdist worker)
# writes its own CPU time, itself and the children it waited for, into _build/run/ when it ends;
# the controller sums them. Compiles are logged by kernels.aot_cache into _build/run/aot-log.jsonl
# (the environment variable is inherited by workers, notebook kernels and compile subprocesses).


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if _is_worker(config) or _NESTED:
        return
    _RUN_DIR.mkdir(parents=True, exist_ok=True)
    for old in _RUN_DIR.glob("*"):
        old.unlink()
    os.environ[aot_cache.LOG_ENV] = str(_RUN_DIR / "aot-log.jsonl")


def _cpu_seconds() -> dict:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"user": me.ru_utime + children.ru_utime, "system": me.ru_stime + children.ru_stime}


def pytest_sessionfinish(session):
    if _is_worker(session.config):
        worker = session.config.workerinput["workerid"]
        (_RUN_DIR / f"cpu-{worker}.json").write_text(json.dumps(_cpu_seconds()))


def _run_cpu_seconds() -> dict:
    """This process and its waited-for children, plus every worker's own account (a worker still
    running when the controller reads its children is counted from its file, not twice: the
    controller's children total includes only workers it has reaped, so workers are read from files
    and the controller's children are left out when there are worker files)."""
    workers = [json.loads(p.read_text()) for p in _RUN_DIR.glob("cpu-*.json")]
    if not workers:
        return _cpu_seconds()
    me = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": me.ru_utime + sum(w["user"] for w in workers),
            "system": me.ru_stime + sum(w["system"] for w in workers)}


def _flag(value_min: float, budget: str) -> str:
    return f"budget {BUDGETS_MIN[budget]:.0f} min" + ("  OVER BUDGET" if value_min > BUDGETS_MIN[budget] else "")


def pytest_terminal_summary(terminalreporter):
    if _NESTED or _is_worker(terminalreporter.config):
        return
    tr = terminalreporter
    wall = time.perf_counter() - _started
    cpu = _run_cpu_seconds()
    aot = aot_cache.summary(_RUN_DIR / "aot-log.jsonl")
    if _notebook_seconds:
        tr.section("notebook durations (nbval, budget %.0f s each, per configuration)" % NOTEBOOK_BUDGET_S)
        for path, seconds in sorted(_notebook_seconds.items(), key=lambda kv: -kv[1]):
            second = _second_pass_seconds.get(path)
            flag = "  OVER BUDGET" if max(seconds, second or 0) > NOTEBOOK_BUDGET_S else ""
            tr.write_line(f"{seconds:7.1f} s {second or 0:7.1f} s  {path}{flag}")
    tr.section("where the run's time went")
    notebooks_min = (sum(_notebook_seconds.values()) + sum(_second_pass_seconds.values())) / 60
    tr.write_line(f"CPU time {(cpu['user'] + cpu['system']) / 60:6.1f} min (user {cpu['user'] / 60:.1f}, system "
                  f"{cpu['system'] / 60:.1f}), {_flag((cpu['user'] + cpu['system']) / 60, 'cpu')}")
    tr.write_line(f"wall     {wall / 60:6.1f} min, {_flag(wall / 60, 'wall')}")
    tr.write_line(f"notebooks {notebooks_min:5.1f} min of worker time: first configuration "
                  f"{sum(_notebook_seconds.values()):.0f} s over {len(_notebook_seconds)}, second "
                  f"{sum(_second_pass_seconds.values()):.0f} s over {len(_second_pass_seconds)}, "
                  f"{_flag(notebooks_min, 'notebooks')}")
    tr.write_line(f"AOT builds {aot['seconds'] / 60:4.1f} min compiling: {aot['compiled']} compiled, {aot['hits']} "
                  f"from the shared cache, {_flag(aot['seconds'] / 60, 'aot')}")
    out = _ROOT / "_build" / "timings.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"notebooks_s": dict(_notebook_seconds), "second_config_s": dict(_second_pass_seconds),
                               "wall_s": wall, "cpu_s": cpu, "aot": aot}, indent=1) + "\n")
