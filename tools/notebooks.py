"""Execute the course's notebooks in place and read their metadata.

``python -m tools.notebooks execute book`` (``make execute``) re-runs every book notebook top to
bottom in the current environment and stores the outputs, which is what the book renders and what
nbval later compares against. Each notebook runs in its own folder, on one thread.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
# A second CPU configuration under which every notebook must print the same outputs as stored:
# ATen's scalar kernels instead of its AVX2/AVX-512 ones, MKL's reproducible code path, and two
# threads instead of one. Each changes the order of floating-point reductions, as another CPU, BLAS
# build or thread count would; an output that prints a raw error magnitude does not survive it.
# `make test` already runs one notebook per core, so the two threads wait for each other asleep
# (OMP_WAIT_POLICY=PASSIVE) rather than spinning against the other worker: spinning made a
# training cell several times slower without changing a single result.
# What each variable costs (measured for issue 48 on an AVX-512 machine, CPU seconds of one process):
# ATen's scalar kernels take 2.9x its AVX-512 ones on vectorised elementwise work (softmax, exp), and
# MKL's compatible path 2.2x on an fp32 GEMM; across a whole chapter (gqa-mqa, both passes) the total
# moved by under 10% between ATEN_CPU_CAPABILITY=default and avx2. The cheaper settings perturb less:
# avx2 changed one of five probe results (softmax), MKL_CBWR=AVX2 none, while default and COMPATIBLE
# changed the GEMM's bits too. The stronger settings stay; the saving came from running this pass as
# nbval's own collector in the same worker (conftest.py) instead of a pytest process per notebook.
SECOND_CPU_CONFIG = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "2",
                     "OMP_WAIT_POLICY": "PASSIVE"}
# Set in the process that runs the second pass, so that it does not start a third.
CPU_CONFIG_VAR = "COURSE_CPU_CONFIG"


def book_notebooks(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def run_nbval(path: Path, *, second_config: bool = False, both: bool = False) -> subprocess.CompletedProcess:
    """nbval on one notebook in a fresh process, strictly against its stored outputs, on one thread
    as ``make test`` runs it, or under :data:`SECOND_CPU_CONFIG` with ``second_config=True``, or in
    both configurations one after the other in the same process with ``both=True`` (the course's
    ``conftest.py`` as a plugin, its second pass pointed at the notebook's folder)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    plugin = []
    if second_config:
        env.update(SECOND_CPU_CONFIG)
        env[CPU_CONFIG_VAR] = "second"
    elif both:
        env["COURSE_SECOND_PASS_UNDER"] = str(Path(path).resolve().parent)
        plugin = ["-p", "conftest"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugin, "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
         "--nbval", "--nbval-current-env", "--nbval-sanitize-with", str(ROOT / "nbval_sanitize.cfg"), str(path)],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )


@contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set for the duration (a kernel started inside inherits them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(path: Path, *, kernel_name: str = "python3") -> float:
    """Run ``path`` top to bottom and write its outputs back; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    with environment({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}):
        client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name=kernel_name,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    seconds = time.perf_counter() - start
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.notebooks")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="execute notebooks in place")
    ex.add_argument("paths", nargs="+", type=Path, help="notebooks, or folders to search for them")
    args = parser.parse_args(argv)
    targets: list[Path] = []
    for p in args.paths:
        targets.extend(sorted(p.rglob("*.ipynb")) if p.is_dir() else [p])
    targets = [t for t in targets if ".ipynb_checkpoints" not in t.parts]
    for t in targets:
        print(f"executing {t} ...", flush=True)
        print(f"  {execute(t):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
