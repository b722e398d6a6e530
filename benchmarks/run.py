"""Run a named GPU benchmark and record it: ``python -m benchmarks.run matmul``.

Each benchmark times a kernel and its PyTorch counterpart with ``kernels.bench.time_ms`` and writes
``benchmarks/results/<name>.json`` with the provenance ``kernels.bench.record`` adds. On a machine
without a GPU it refuses: interpreter timings are not kernel performance.
"""
from __future__ import annotations

import argparse
import sys

import kernels  # noqa: F401  (device choice before triton is imported)
import torch

from kernels import bench, runtime


def matmul() -> list[dict]:
    from kernels.gemm.matmul import matmul as triton_matmul

    rows = []
    for n in (1024, 2048, 4096, 8192):
        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        for impl, fn in (("triton-tiled-64", lambda: triton_matmul(a, b)), ("torch.matmul", lambda: a @ b)):
            median, lo, hi = bench.time_ms(fn)
            rows.append({"impl": impl, "M": n, "N": n, "K": n, "dtype": "float16",
                         "ms": median, "ms_p20": lo, "ms_p80": hi, "tflops": 2 * n**3 / (median * 1e-3) / 1e12})
    return rows


BENCHMARKS = {"matmul": matmul}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("names", nargs="+", choices=sorted(BENCHMARKS))
    args = parser.parse_args(argv)
    if not runtime.runtime().on_gpu:
        print("no CUDA GPU here: benchmarks run only on a GPU (interpreter timings are not performance)", file=sys.stderr)
        return 2
    for name in args.names:
        path = bench.record(name, BENCHMARKS[name](), command=bench.command_line())
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
