"""GPU timing with provenance, and the recorded results a CPU build plots.

On a GPU, :func:`time_ms` times a callable with ``triton.testing.do_bench`` and :func:`record`
writes the measurements to ``benchmarks/results/<name>.json`` together with where and how they
were made (GPU, driver, library versions, date, command). On a CPU there is nothing to time:
Triton's interpreter runs kernels in numpy, one program after another, and its speed says nothing
about the kernel's. :func:`time_ms` refuses, and :func:`load` returns what a GPU run recorded, or
``None`` with :func:`missing_note` saying plainly that nothing was measured.
"""
from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import runtime

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


class NoGPUError(RuntimeError):
    """Timing was asked for on a machine where kernels are interpreted."""


def time_ms(fn, *, warmup: int = 25, rep: int = 100, quantiles=(0.5, 0.2, 0.8)) -> tuple[float, ...]:
    """Median and (20%, 80%) quantiles of ``fn()``'s run time in milliseconds, on the GPU only."""
    if not runtime.runtime().on_gpu:
        raise NoGPUError(
            "no CUDA GPU here: kernels run in Triton's interpreter, whose timings are not kernel "
            "performance. Run the benchmark on a GPU, or plot recorded results with kernels.bench.load()."
        )
    import triton.testing

    return tuple(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=list(quantiles)))


def provenance(command: str) -> dict:
    """Where and how a measurement was made."""
    import triton

    rt = runtime.runtime()
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "device": rt.gpu_name or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if rt.on_gpu:
        info["driver"] = _driver_version()
        cap = torch.cuda.get_device_capability()
        info["capability"] = f"sm{cap[0]}{cap[1]}"
    return info


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass
class Results:
    """One recorded benchmark: its provenance and its rows (each row names its shapes)."""

    name: str
    provenance: dict
    rows: list[dict]

    def caption(self) -> str:
        p = self.provenance
        return f"measured on {p['device']} ({p.get('capability', '?')}), torch {p['torch']}, triton {p['triton']}, {p['date'][:10]}"


def record(name: str, rows: list[dict], *, command: str, results_dir: Path | None = None) -> Path:
    """Write ``rows`` (dicts with shapes and timings) with their provenance; GPU runs only."""
    if not runtime.runtime().on_gpu:
        raise NoGPUError("refusing to record benchmark results measured without a GPU")
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError("rows must be a non-empty list of dicts")
    out_dir = results_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"name": name, "provenance": provenance(command), "rows": rows}, indent=1) + "\n")
    return path


def load(name: str, *, results_dir: Path | None = None) -> Results | None:
    """The recorded results called ``name``, or ``None`` when no GPU run recorded them."""
    path = (results_dir or RESULTS_DIR) / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    for key in ("provenance", "rows"):
        if key not in data:
            raise ValueError(f"{path} has no {key!r}: not a kernels.bench results file")
    return Results(data.get("name", name), data["provenance"], data["rows"])


def missing_note(name: str) -> str:
    """The plain sentence a chapter prints when a benchmark was never run on a GPU."""
    return (
        f"No GPU measurement of {name!r} is recorded (benchmarks/results/{name}.json is absent): "
        f"no GPU timing was run for this chapter. `python -m benchmarks.run {name}` on a GPU records it."
    )


def command_line() -> str:
    """The current process's command line, for provenance."""
    return " ".join([Path(sys.executable).name, *sys.argv])
