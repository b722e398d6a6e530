"""Write the book page "What the compiler says" (``book/99-appendix/compiler.md``).

Every module of ``kernels`` that defines Triton kernels is imported; each one's ``compile_jobs()``
(labelled jobs built with ``kernels.inspect.launch_job`` from the launcher's own arguments at a real
model's size) is compiled ahead of time for sm80, sm90a and sm100a, and one table per module reports
what the compiler made of each job: registers, spills, shared memory, pipeline stages, asynchronous
copies (cp.async ``LDGSTS``, TMA ``UTMALDG``) and the tensor-core instruction family. A module with
kernels and no ``compile_jobs()`` is listed as such, so the gap stays visible.

``python -m tools.compiler_page`` rewrites the page and ``compiler-facts.json`` beside it: the facts of
every job under a key made of the job, the toolchain's versions and the source of the kernel's module
and of every module it imports (:func:`job_key`). ``tests/test_compiler_page.py`` checks that the
committed page is what this produces, compiling only the jobs whose key is not in the facts file (their
kernel, a module it imports or the toolchain changed) and, so that the stored facts are not merely
trusted, a few jobs afresh. Compiles go through :func:`kernels.inspect.compile_triton_many` and its
shared cache, in ``--workers`` subprocesses (about a second per job and architecture).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "book" / "99-appendix" / "compiler.md"
FACTS = ROOT / "book" / "99-appendix" / "compiler-facts.json"   # committed: {job key: {arch: facts}}
ARCHS = ("sm80", "sm90", "sm100")
H100_SMS = 132      # the waves column: programs / 132 SMs (an H100 SXM; kernels/gpu/hardware.py)
CHUNK = 6           # jobs per compile subprocess
COLUMNS = ("job", "arch", "programs", "regs", "spills", "smem KiB", "stages", "LDGSTS", "UTMALDG", "tensor core")


@dataclass
class ModuleEntry:
    name: str
    kernels: list[str]                          # the @triton.jit functions the module defines
    jobs: dict = field(default_factory=dict)    # label -> TritonJob, from compile_jobs()
    has_compile_jobs: bool = False
    error: str | None = None                    # compile_jobs() raised

    @property
    def kernels_without_job(self) -> list[str]:
        covered = {getattr(job.kernel, "fn", job.kernel).__name__ for job in self.jobs.values()}
        return [k for k in self.kernels if k not in covered]


def _is_triton_kernel(obj) -> bool:
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(obj, "fn")


def module_names() -> list[str]:
    import kernels

    return sorted(m.name for m in pkgutil.walk_packages(kernels.__path__, "kernels."))


def inventory(names: list[str] | None = None) -> list[ModuleEntry]:
    """Every module with Triton kernels (defined there, not imported), with its compile_jobs()."""
    import kernels  # noqa: F401  (picks the device and the interpreter before triton is imported)

    entries = []
    for name in names or module_names():
        module = importlib.import_module(name)
        found = sorted(k for k, v in vars(module).items()
                       if _is_triton_kernel(v) and getattr(v.fn, "__module__", None) == name and k.endswith("_kernel"))
        if not found and not hasattr(module, "compile_jobs"):
            continue
        entry = ModuleEntry(name, found, has_compile_jobs=hasattr(module, "compile_jobs"))
        if entry.has_compile_jobs:
            try:
                entry.jobs = dict(module.compile_jobs())
            except Exception as err:  # a broken compile_jobs is shown on the page, not hidden
                entry.error = f"{type(err).__name__}: {err}".splitlines()[0]
        entries.append(entry)
    return entries


def job_key(job) -> str:
    """A job's entry in the facts file: the cache keys of its builds for every architecture on the
    page (each names the job, the toolchain and the source of the kernel's module and its imports)."""
    from kernels import aot_cache
    from kernels import inspect as ki

    spec = job.spec()
    return aot_cache.key({"page": [ki.triton_build_key(spec, ki.parse_arch(a)) for a in ARCHS]})


def _facts(build) -> dict:
    """One table row's compile facts, or the reason it did not compile."""
    from kernels import inspect as ki

    if isinstance(build, ki.CompileError):
        return {"error": str(build).split(": ", 1)[-1][:160]}
    m = build.metadata
    return {"regs": m["registers"], "spills": build.spills, "smem": math.ceil(m["shared_bytes"] / 1024),
            "stages": m["num_stages"], **build.async_copies, "tensor_core": build.tensor_core}


def read_facts(path: Path = FACTS) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def job_keys(entries: list[ModuleEntry]) -> dict[tuple[str, str], str]:
    """{(module, job label): job key}, computed once, so that a page is rendered from the keys its
    facts were looked up or compiled under even if a source changes meanwhile."""
    return {(e.name, label): job_key(job) for e in entries for label, job in e.jobs.items()}


def compile_facts(entries: list[ModuleEntry], *, stored: dict, workers: int = 2,
                  keys: dict[tuple[str, str], str] | None = None) -> dict:
    """{job key: {arch: facts}} for every job: from ``stored`` where its key is there (its source and
    toolchain unchanged), compiled for the others."""
    from kernels import inspect as ki

    keys = keys or job_keys(entries)
    jobs = {keys[(e.name, label)]: job for e in entries for label, job in e.jobs.items()}
    todo = [k for k in jobs if k not in stored]
    chunks = [todo[i:i + CHUNK] for i in range(0, len(todo), CHUNK)]

    def run(chunk):
        builds = ki.compile_triton_many([jobs[k] for k in chunk], archs=ARCHS, errors="keep")
        return {k: {arch: _facts(b) for arch, b in bs.items()} for k, bs in zip(chunk, builds)}

    found = {k: stored[k] for k in jobs if k in stored}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for done in pool.map(run, chunks):
            found.update(done)
    return found


def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def _programs(job) -> str:
    if job.programs is None:
        return "-"
    return f"{job.programs} ({job.programs / H100_SMS:.2f} waves)"


def render(entries: list[ModuleEntry], facts: dict, keys: dict[tuple[str, str], str] | None = None) -> str:
    import triton

    keys = keys or job_keys(entries)
    lines = [
        "# What the compiler says",
        "",
        "Every Triton kernel of the course's `kernels` package, compiled ahead of time at a real model's size "
        "for three NVIDIA generations: sm80 (A100), sm90a (H100) and sm100a (B200). Each job is built by its "
        "module's `compile_jobs()` with `kernels.inspect.launch_job` from the arguments the launcher really "
        "passes (tensors on the meta device), so integers divisible by 16 carry their hint and unit strides "
        "are folded, exactly as a launch on a GPU specialises them. No GPU was used: these are compile-time "
        "facts of Triton " + triton.__version__ + ", the same on every machine with that compiler.",
        "",
        "- **programs**: the launch's grid, and how many waves it makes on an H100's 132 SMs (below 1: SMs idle);",
        "- **regs**: registers per thread (`cuobjdump --dump-resource-usage`); **spills**: local-memory stores "
        "and loads (STL + LDL) in the SASS;",
        "- **smem KiB**: shared memory per program; **stages**: `num_stages`;",
        "- **LDGSTS** / **UTMALDG**: cp.async and TMA copies in the SASS (both 0: every tile goes through "
        "registers, so the stages are no pipeline);",
        "- **tensor core**: the SASS family of the matrix instructions (HMMA, HGMMA, QGMMA, UTCHMMA, ...), "
        "`-` for none;",
        "- **not a launch**: the job is still compiled for every generation, but its module runs another "
        "kernel there (a fallback path), so no GPU of that generation builds it and its facts are not shown.",
        "",
        "Generated by `python -m tools.compiler_page`; `tests/test_compiler_page.py` checks that this page is "
        "current. Chapters link here for the full table of their kernels.",
        "",
    ]
    missing = [e for e in entries if not e.has_compile_jobs]
    for entry in (e for e in entries if e.has_compile_jobs):
        lines += [f"## `{entry.name}`", ""]
        if entry.error:
            lines += [f"`compile_jobs()` failed: {_cell(entry.error)}", ""]
        if entry.jobs:
            lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
            for label, job in entry.jobs.items():
                kernel = getattr(job.kernel, "fn", job.kernel).__name__
                per_arch = facts[keys[(entry.name, label)]]
                for i, arch in enumerate(ARCHS):
                    f = per_arch[arch]
                    first = f"{_cell(label)} (`{kernel}`, {job.num_warps} warps)" if i == 0 else ""
                    arch_name = arch if arch == "sm80" else arch + "a"
                    programs = _programs(job) if i == 0 else ""
                    if job.launched_on is not None and arch not in job.launched_on:
                        row = [first, arch_name, programs, "not a launch: the module takes another path on this "
                               "GPU (see its chapter)"] + [""] * 6
                    elif "error" in f:
                        row = [first, arch_name, programs, f"does not compile: {_cell(f['error'])}"] + [""] * 6
                    else:
                        row = [first, arch_name, programs, f["regs"], f["spills"], f["smem"], f["stages"],
                               f["LDGSTS"], f["UTMALDG"], f["tensor_core"]]
                    lines.append("| " + " | ".join(str(c) for c in row) + " |")
            lines.append("")
        if entry.kernels_without_job:
            lines += ["Kernels of this module with no job: " + ", ".join(f"`{k}`" for k in entry.kernels_without_job)
                      + ".", ""]
    lines += ["## Modules with no `compile_jobs()` yet", ""]
    if missing:
        lines += [f"- `{e.name}`: " + ", ".join(f"`{k}`" for k in e.kernels) for e in missing]
    else:
        lines.append("None: every module with Triton kernels defines `compile_jobs()`.")
    return "\n".join(lines) + "\n"


def generate(*, workers: int = 2, stored: dict | None = None) -> tuple[str, dict]:
    """(the page, the facts it shows), reusing ``stored`` facts whose job, toolchain and source are
    unchanged (the committed facts file by default; ``{}`` compiles everything)."""
    entries = inventory()
    keys = job_keys(entries)
    facts = compile_facts(entries, stored=read_facts() if stored is None else stored, workers=workers, keys=keys)
    return render(entries, facts, keys), facts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="compile subprocesses at once (default 2)")
    parser.add_argument("--no-cache", action="store_true", help="compile everything, ignoring the stored facts")
    args = parser.parse_args(argv)
    page, facts = generate(workers=args.workers, stored={} if args.no_cache else None)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    FACTS.write_text(json.dumps(facts, indent=0, sort_keys=True) + "\n")
    print(f"wrote {PAGE.relative_to(ROOT)} and {FACTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
