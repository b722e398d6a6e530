"""The shared cache of ahead-of-time builds (kernels.aot_cache): a build asked for twice compiles
once, and editing the kernel's module or a module it imports compiles it again.

Cost: two compiles of a one-line kernel for sm80 (a few seconds)."""
import importlib
import os
import sys

import pytest

from kernels import aot_cache
from kernels import inspect as ki

KERNEL = '''
import triton
import triton.language as tl

from {pkg} import helper


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, helper.twice(x), mask=offs < n)
'''
HELPER = '''
import triton


@triton.jit
def twice(x):
    return x * {factor}
'''


@pytest.fixture
def probe_package(tmp_path, monkeypatch):
    """A package ``aotprobe`` with a kernel module, the helper it imports, and an unrelated module,
    importable here and in the compile subprocess; a fresh cache and log under tmp_path."""
    pkg = tmp_path / "aotprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kern.py").write_text(KERNEL.format(pkg="aotprobe"))
    (pkg / "helper.py").write_text(HELPER.format(factor=2.0))
    (pkg / "unrelated.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(aot_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(aot_cache.LOG_ENV, str(tmp_path / "log.jsonl"))
    aot_cache._package_dir.cache_clear()
    yield pkg
    for name in [m for m in sys.modules if m == "aotprobe" or m.startswith("aotprobe.")]:
        del sys.modules[name]
    aot_cache._package_dir.cache_clear()


def _job():
    kern = importlib.import_module("aotprobe.kern")
    return ki.TritonJob(kern._scale_kernel, {"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 128})


def test_digest_follows_imports_and_nothing_else(probe_package):
    before = aot_cache.source_digest("aotprobe.kern")
    (probe_package / "unrelated.py").write_text("X = 2\n")
    assert aot_cache.source_digest("aotprobe.kern") == before, "an unrelated module changed the digest"
    (probe_package / "helper.py").write_text(HELPER.format(factor=3.0))
    assert aot_cache.source_digest("aotprobe.kern") != before, "the imported helper changed, the digest did not"


def test_a_second_request_compiles_nothing_and_a_changed_import_recompiles(probe_package, monkeypatch):
    first = ki.compile_triton_many([_job()], archs=("sm80",))[0]["sm80"]
    assert "FMUL" in first.sass or "FADD" in first.sass
    counts = aot_cache.summary()
    assert (counts["compiled"], counts["hits"]) == (1, 0)

    real_compile = ki._compile_in_subprocess

    def refuse(specs):
        raise AssertionError("compiled although the cache holds this build")

    monkeypatch.setattr(ki, "_compile_in_subprocess", refuse)
    again = ki.compile_triton_many([_job()], archs=("sm80",))[0]["sm80"]
    assert (again.ptx, again.sass, again.metadata) == (first.ptx, first.sass, first.metadata)
    assert aot_cache.summary()["hits"] == 1

    (probe_package / "helper.py").write_text(HELPER.format(factor=3.0))      # the kernel's import changed
    with pytest.raises(AssertionError, match="compiled although"):
        ki.compile_triton_many([_job()], archs=("sm80",))
    monkeypatch.setattr(ki, "_compile_in_subprocess", real_compile)
    changed = ki.compile_triton_many([_job()], archs=("sm80",))[0]["sm80"]
    assert changed.ptx != first.ptx and aot_cache.summary()["compiled"] == 2


def test_the_cache_can_be_switched_off(probe_package, monkeypatch):
    monkeypatch.setenv(aot_cache.CACHE_ENV, "off")
    assert aot_cache.cache_dir() is None
    aot_cache.store("x", {"a": 1})
    assert aot_cache.load("x") is None


def test_a_cached_compile_error_is_raised_again(probe_package):
    bad = ki.TritonJob(_job().kernel, {"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 100})  # not a power of 2
    with pytest.raises(ki.CompileError, match="_scale_kernel"):
        ki.compile_triton_many([bad], archs=("sm80",))
    kept = ki.compile_triton_many([bad], archs=("sm80",), errors="keep")[0]["sm80"]
    assert isinstance(kept, ki.CompileError) and aot_cache.summary()["hits"] == 1


def test_the_key_names_the_source_of_the_kernels_module():
    job_spec = {"module": "kernels.gpu.copy", "name": "x", "signature": {}, "constexprs": {}}
    key = ki.triton_build_key(job_spec, ki.parse_arch("sm90"))
    assert key != ki.triton_build_key(dict(job_spec, module="kernels.rows"), ki.parse_arch("sm90"))
    assert key != ki.triton_build_key(job_spec, ki.parse_arch("sm80"))
    assert len(key) == 64
