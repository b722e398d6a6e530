"""The book page "What the compiler says" (book/99-appendix/compiler.md) is what tools.compiler_page
generates now: every module's compile_jobs() compiled for sm80, sm90a and sm100a.

The facts of each job are committed beside the page (compiler-facts.json) under a key made of the
job, the toolchain's versions and the source of the kernel's module and everything it imports, so
the check compiles only the jobs whose kernel (or a helper it imports, or the compiler) changed since
the page was written: about 200 compiles (3-5 CPU-minutes) when everything changed, seconds when
nothing did. The stored facts are not merely trusted: a few jobs, picked by their keys (so the pick
moves whenever sources change), are compiled afresh and must match what is stored."""
import types

import pytest

from kernels import aot_cache
from kernels.testing import pinned_triton
from tools import compiler_page as cp

FRESH_JOBS = 3

# The page and its facts are the pinned Triton's (requirements.txt). Under another Triton (`make
# compat`, the versions a lent GPU machine has) every key differs, so the committed page cannot be its
# output: those two checks are about the pinned toolchain and say so rather than fail or recompile all.
pinned_only = pytest.mark.skipif(not pinned_triton(), reason="the committed compiler page records the pinned Triton's facts; this Triton is another")


@pinned_only
def test_the_committed_page_is_current():
    page, facts = cp.generate(workers=2)
    assert cp.PAGE.read_text() == page, "book/99-appendix/compiler.md is out of date: run `python -m tools.compiler_page`"
    assert cp.read_facts() == facts, "book/99-appendix/compiler-facts.json is out of date: run `python -m tools.compiler_page`"


@pinned_only
def test_stored_facts_match_a_fresh_compile():
    entries = cp.inventory()
    jobs = {cp.job_key(job): (entry, label) for entry in entries for label, job in entry.jobs.items()}
    stored = cp.read_facts()
    picked = sorted(k for k in jobs if k in stored)[:FRESH_JOBS]
    assert len(picked) == FRESH_JOBS, "the facts file holds too few of the current jobs: run `python -m tools.compiler_page`"
    sample = [cp.ModuleEntry(jobs[k][0].name, [], {jobs[k][1]: jobs[k][0].jobs[jobs[k][1]]}, True) for k in picked]
    fresh = cp.compile_facts(sample, stored={}, workers=1)
    for k in picked:
        assert fresh[k] == stored[k], f"{jobs[k][0].name}: {jobs[k][1]} compiles to other facts than stored"


def test_a_changed_source_gives_a_job_a_new_key(monkeypatch):
    from kernels.gemm import matmul

    job = next(iter(matmul.compile_jobs().values()))
    before = cp.job_key(job)
    real = aot_cache.source_digest
    monkeypatch.setattr(aot_cache, "source_digest", lambda m: real(m) + ("x" if m == "kernels.gemm.matmul" else ""))
    assert cp.job_key(job) != before
    assert cp.job_key(job) not in cp.read_facts()


def test_another_toolchain_gives_every_job_a_new_key(monkeypatch):
    """Why the two checks above are the pinned Triton's alone: the toolchain is part of every key."""
    from kernels.gemm import matmul

    job = next(iter(matmul.compile_jobs().values()))
    before = cp.job_key(job)
    from kernels import inspect as ki

    real = ki.toolchain
    monkeypatch.setattr(ki, "toolchain", lambda: {**real(), "triton": "3.6.0-other"})
    assert cp.job_key(job) != before


def test_modules_without_compile_jobs_and_kernels_without_a_job_are_listed():
    from kernels.gemm import matmul

    entries = cp.inventory(["kernels.gemm.matmul", "kernels.gpu.copy"])
    by_name = {e.name: e for e in entries}
    assert by_name["kernels.gemm.matmul"].kernels_without_job == ["_matmul_no_k_mask_kernel"]
    assert not by_name["kernels.gpu.copy"].has_compile_jobs or by_name["kernels.gpu.copy"].jobs
    gap = cp.ModuleEntry("kernels.example", ["_example_kernel"])
    page = cp.render([gap, by_name["kernels.gemm.matmul"]],
                     cp.compile_facts([by_name["kernels.gemm.matmul"]], stored=cp.read_facts()))
    assert "- `kernels.example`: `_example_kernel`" in page
    assert "Kernels of this module with no job: `_matmul_no_k_mask_kernel`." in page
    assert "| sm90a |" in page and "HGMMA" in page
    assert isinstance(matmul, types.ModuleType)


def test_a_generation_that_does_not_launch_a_job_shows_no_facts_for_it():
    """microscaling's native kernel runs on Blackwell only (other GPUs take its DECODE path): its sm80 and
    sm90a builds are compiled but must not read as launches. A page that printed them (the spills of a
    build no GPU makes) is caught: the sm100a row keeps its facts, the others say "not a launch"."""
    from kernels.quant import microscaling as mx

    label, job = next(iter(mx.compile_jobs().items()))
    assert job.launched_on == ("sm100", "sm120")
    entry = cp.ModuleEntry("kernels.quant.microscaling", [], {label: job}, True)
    fact = {"regs": 1, "spills": 12345, "smem": 0, "stages": 3, "LDGSTS": 0, "UTMALDG": 0, "tensor_core": "-"}
    page = cp.render([entry], {"key": {a: fact for a in cp.ARCHS}}, keys={(entry.name, label): "key"})
    rows = {arch: next(line for line in page.splitlines() if f"| {arch} |" in line) for arch in ("sm80", "sm90a", "sm100a")}
    assert "12345" in rows["sm100a"] and "not a launch" not in rows["sm100a"]
    for arch in ("sm80", "sm90a"):
        assert "not a launch" in rows[arch] and "12345" not in rows[arch], rows[arch]
