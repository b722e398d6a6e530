"""Before / after of issue 21: each ``compile_jobs()`` job built as a launch compiles it (after) and as
a hand-written signature compiled it before ``launch_job`` (before: every integer a plain ``i32``, no
divisibility hint, no folded unit stride; every pointer 16-byte aligned; ``TritonJob.unspecialized``).

    python -m tools.aot_before_after                      # every module with compile_jobs()
    python -m tools.aot_before_after kernels.gemm.ladder  # some modules

prints one Markdown table (registers, spills, shared memory KiB, stages, LDGSTS on sm80 and sm90a,
``before -> after``), and lists the modules that still have only an old ``aot_job``/``aot_jobs`` helper
(their "after" needs a ``compile_jobs()`` first).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tools import compiler_page as cp

ARCHS = ("sm80", "sm90")
FIELDS = (("regs", "regs"), ("spills", "spills"), ("smem", "smem KiB"), ("stages", "stages"), ("LDGSTS", "LDGSTS"))


def pairs(entries) -> list[tuple[str, str, object, object]]:
    """(module, label, before job, after job) for every job of every entry."""
    return [(e.name, label, job.unspecialized(), job) for e in entries for label, job in e.jobs.items()]


def table(rows, *, workers: int = 2) -> str:
    from concurrent.futures import ThreadPoolExecutor

    from kernels import inspect as ki

    jobs = [j for _, _, before, after in rows for j in (before, after)]
    chunks = [jobs[i:i + 2 * cp.CHUNK] for i in range(0, len(jobs), 2 * cp.CHUNK)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        builds = [b for done in pool.map(lambda ch: ki.compile_triton_many(ch, archs=ARCHS, errors="keep"), chunks)
                  for b in done]
    header = ["module", "job"] + [f"{name} {arch}" for arch in ARCHS for _, name in FIELDS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for k, (module, label, _, _) in enumerate(rows):
        before, after = builds[2 * k], builds[2 * k + 1]
        cells = [f"`{module}`", label]
        for arch in ARCHS:
            fb, fa = cp._facts(before[arch]), cp._facts(after[arch])
            for key, _ in FIELDS:
                if "error" in fb or "error" in fa:
                    cells.append("does not compile")
                else:
                    cells.append(f"{fb[key]} -> {fa[key]}" if fb[key] != fa[key] else str(fa[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def old_helpers_only(names: list[str]) -> list[str]:
    out = []
    for name in names:
        module = importlib.import_module(name)
        if not hasattr(module, "compile_jobs") and any(hasattr(module, h) for h in ("aot_job", "aot_jobs")):
            out.append(name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="kernels modules (default: every one with compile_jobs)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    entries = [e for e in cp.inventory(args.modules or None) if e.jobs]
    print(table(pairs(entries), workers=args.workers))
    waiting = old_helpers_only(args.modules or cp.module_names())
    if waiting:
        print("\nOnly an old aot_job/aot_jobs helper, no compile_jobs() yet: " + ", ".join(waiting))
    return 0


if __name__ == "__main__":
    sys.exit(main())
