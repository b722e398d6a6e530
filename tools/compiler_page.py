"""Write the book page "What the compiler says" (``book/99-appendix/compiler.md``).

Every module of ``kernels`` that defines Triton kernels is imported; each one's ``compile_jobs()``
(labelled jobs built with ``kernels.inspect.launch_job`` from the launcher's own arguments at a real
model's size) is compiled ahead of time for sm80, sm90a and sm100a, and one table per module reports
what the compiler made of each job: registers, spills, shared memory, pipeline stages, asynchronous
copies (cp.async ``LDGSTS``, TMA ``UTMALDG``) and the tensor-core instruction family. A module with
kernels and no ``compile_jobs()`` is listed as such, so the gap stays visible.

``python -m tools.compiler_page`` rewrites the page; ``tests/test_compiler_page.py`` checks that the
committed page is what this produces. Compiles run in ``--workers`` subprocesses (about a second per
job and architecture); facts are cached in ``_build/compiler-page-cache.json`` under a key made of the
job, the Triton version and the source of every ``kernels`` module, so a second run with nothing
changed compiles nothing, and any change to a kernel's code recompiles everything.
"""
from __future__ import annotations

import argparse
import hashlib
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
CACHE = ROOT / "_build" / "compiler-page-cache.json"
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


def _source_digest() -> str:
    import triton

    h = hashlib.sha256(triton.__version__.encode())
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        h.update(path.relative_to(ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _job_key(job, digest: str) -> str:
    return hashlib.sha256(json.dumps([job.spec(), ARCHS, digest], sort_keys=True, default=str).encode()).hexdigest()


def _facts(build) -> dict:
    """One table row's compile facts, or the reason it did not compile."""
    from kernels import inspect as ki

    if isinstance(build, ki.CompileError):
        return {"error": str(build).split(": ", 1)[-1][:160]}
    m = build.metadata
    return {"regs": m["registers"], "spills": build.spills, "smem": math.ceil(m["shared_bytes"] / 1024),
            "stages": m["num_stages"], **build.async_copies, "tensor_core": build.tensor_core}


def compile_facts(entries: list[ModuleEntry], *, workers: int = 2, cache: Path | None = CACHE) -> tuple[dict, str]:
    """({job key: {arch: facts}} for every job, the source digest), compiling only what the cache lacks."""
    from kernels import inspect as ki

    digest = _source_digest()
    stored = json.loads(cache.read_text()) if cache and cache.is_file() else {}
    jobs = {_job_key(job, digest): job for e in entries for job in e.jobs.values()}
    todo = [k for k in jobs if k not in stored]
    chunks = [todo[i:i + CHUNK] for i in range(0, len(todo), CHUNK)]

    def run(keys):
        builds = ki.compile_triton_many([jobs[k] for k in keys], archs=ARCHS, errors="keep")
        return {k: {arch: _facts(b) for arch, b in bs.items()} for k, bs in zip(keys, builds)}

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for done in pool.map(run, chunks):
            stored.update(done)
    if cache and todo:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(stored, sort_keys=True))
    return {k: stored[k] for k in jobs}, digest


def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def _programs(job) -> str:
    if job.programs is None:
        return "-"
    return f"{job.programs} ({job.programs / H100_SMS:.2f} waves)"


def render(entries: list[ModuleEntry], facts: dict, digest: str) -> str:
    import triton

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
        "`-` for none.",
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
                per_arch = facts[_job_key(job, digest)]
                for i, arch in enumerate(ARCHS):
                    f = per_arch[arch]
                    first = f"{_cell(label)} (`{kernel}`, {job.num_warps} warps)" if i == 0 else ""
                    arch_name = arch if arch == "sm80" else arch + "a"
                    programs = _programs(job) if i == 0 else ""
                    if "error" in f:
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


def generate(*, workers: int = 2, cache: Path | None = CACHE) -> str:
    entries = inventory()
    facts, digest = compile_facts(entries, workers=workers, cache=cache)
    return render(entries, facts, digest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="compile subprocesses at once (default 2)")
    parser.add_argument("--no-cache", action="store_true", help="compile everything, ignoring the cache")
    args = parser.parse_args(argv)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(generate(workers=args.workers, cache=None if args.no_cache else CACHE))
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
