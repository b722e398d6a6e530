"""The book page "What the compiler says" (book/99-appendix/compiler.md) is what tools.compiler_page
generates now: every module's compile_jobs() compiled for sm80, sm90a and sm100a.

Cost: about 200 compiles (some 70 jobs x 3 architectures, ~1 s each) in two subprocesses, 1.5 to 3
minutes on 2 cores, the first time; the facts are cached in _build/compiler-page-cache.json under a
key of the job, the Triton version and the source of every kernels module, so a run after
`python -m tools.compiler_page` with nothing changed compiles nothing."""
import types

from tools import compiler_page as cp


def test_the_committed_page_is_current():
    fresh = cp.generate(workers=2)
    assert cp.PAGE.read_text() == fresh, "book/99-appendix/compiler.md is out of date: run `python -m tools.compiler_page`"


def test_modules_without_compile_jobs_and_kernels_without_a_job_are_listed():
    from kernels.gemm import matmul

    entries = cp.inventory(["kernels.gemm.matmul", "kernels.gpu.copy"])
    by_name = {e.name: e for e in entries}
    assert by_name["kernels.gemm.matmul"].kernels_without_job == ["_matmul_no_k_mask_kernel"]
    assert not by_name["kernels.gpu.copy"].has_compile_jobs or by_name["kernels.gpu.copy"].jobs
    gap = cp.ModuleEntry("kernels.example", ["_example_kernel"])
    page = cp.render([gap, by_name["kernels.gemm.matmul"]], cp.compile_facts([by_name["kernels.gemm.matmul"]])[0],
                     cp.compile_facts([])[1])
    assert "- `kernels.example`: `_example_kernel`" in page
    assert "Kernels of this module with no job: `_matmul_no_k_mask_kernel`." in page
    assert "| sm90a |" in page and "HGMMA" in page
    assert isinstance(matmul, types.ModuleType)
