"""kernels.inspect.launch_job derives what a real launch compiles, and agrees with Triton's own launch path.

The reference is Triton's ``JITFunction.run`` itself, in a process with the interpreter off: a
stand-in driver answers the three questions ``run`` asks of a GPU (device, stream, target), and
``_do_compile`` is replaced by a recorder, so the signature, constexprs and attributes are the ones
``run`` would hand to the compiler on an H100. ``launch_job`` must produce the same for every case,
including a K that is not a multiple of 16 (no hint), a pointer into the middle of a buffer (not
aligned), unit strides (folded to the constant 1) and a ``do_not_specialize`` argument.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels import inspect as ki
from kernels.gemm.ladder import _matmul_grouped_kernel
from kernels.softmax.online import _softmax_online_kernel

ROOT = Path(__file__).resolve().parent.parent


@triton.jit(do_not_specialize=["n"])
def _scale_kernel(x_ptr, y_ptr, n, stride, alpha, BLOCK: tl.constexpr):
    """y[i] = alpha * x[i * stride]; ``n`` is never specialised (every length shares one binary)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, alpha * tl.load(x_ptr + offs * stride, mask=mask), mask=mask)


def _matmul_case(M, N, K, *, a=None):
    a = torch.empty(M, K, device="meta", dtype=torch.float16) if a is None else a
    b = torch.empty(K, N, device="meta", dtype=torch.float16)
    c = torch.empty(M, N, device="meta", dtype=torch.float16)
    args = (a, b, c, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    kwargs = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, HAS_BIAS=False, EPILOGUE="none", UPCAST=False,
                  num_warps=8, num_stages=3)
    return _matmul_grouped_kernel, args, kwargs


def cases() -> dict:
    """name -> (kernel, args, kwargs), built the same way in this process and in the reference one."""
    torch.manual_seed(0)
    x = torch.empty(64 * 4100 + 1, dtype=torch.float16)
    x_view = x[1:].view(64, 4100)[:, :4096]           # starts 2 bytes into the buffer: not 16-byte aligned
    rows = torch.empty(4096, 32000, device="meta", dtype=torch.float32)
    return {
        "matmul K=4096": _matmul_case(4096, 4096, 4096),
        "matmul K=4100": _matmul_case(4096, 4096, 4100),
        "matmul M=1 decode": _matmul_case(1, 14336, 4096),
        "matmul unaligned A": _matmul_case(64, 256, 4096, a=x_view),
        "softmax rows": (_softmax_online_kernel,
                         (rows, rows, 32000, rows.stride(0), rows.stride(0)),
                         dict(BLOCK_N=1024, num_warps=8)),
        "do_not_specialize": (_scale_kernel, (rows, rows, 4096, 1, 0.5), dict(BLOCK=1024)),
    }


def _normal(signature, constexprs, attrs, num_warps, num_stages) -> dict:
    """One JSON-comparable form for both sides."""
    return {"signature": dict(signature), "constexprs": {k: repr(v) for k, v in constexprs.items()},
            "attrs": {k: v for k, v in attrs.items() if v}, "num_warps": num_warps, "num_stages": num_stages}


def derived_by_launch_job() -> dict:
    out = {}
    for name, (kernel, args, kwargs) in cases().items():
        job = ki.launch_job(kernel, *args, **kwargs)
        out[name] = _normal(job.signature, job.constexprs, job.attrs, job.num_warps, job.num_stages)
    return out


def derived_by_triton_run() -> dict:
    """In a process with the interpreter off: what ``JITFunction.run`` passes to the compiler."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(StandInDriver())
    out = {}
    for name, (kernel, args, kwargs) in cases().items():
        seen = {}

        def record(key, signature, device, constexprs, options, attrs, warmup, _seen=seen, _kernel=kernel):
            names = _kernel.arg_names
            _seen.update(_normal(signature, {names[p[0]]: v for p, v in constexprs.items()},
                                 {names[p[0]]: v for p, v in attrs.items()}, options.num_warps, options.num_stages))

        kernel._do_compile = record
        kernel.run(*args, grid=(1,), warmup=True, **kwargs)
        out[name] = seen
    return out


@pytest.fixture(scope="module")
def triton_run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KERNELS_COMPILE_ONLY"] = "1"
    code = ("import kernels, json; from tests.test_inspect_specialization import derived_by_triton_run; "
            "print(json.dumps(derived_by_triton_run()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_launch_job_agrees_with_tritons_own_launch_path(triton_run):
    mine = json.loads(json.dumps(derived_by_launch_job()))
    assert set(mine) == set(triton_run)
    for name in mine:
        assert mine[name] == triton_run[name], name


def test_specialization_is_what_a_gpu_engineer_expects():
    jobs = {name: ki.launch_job(k, *a, **kw) for name, (k, a, kw) in cases().items()}
    aligned = jobs["matmul K=4096"]
    assert aligned.constexprs["stride_ak"] == 1 and aligned.constexprs["stride_bn"] == 1
    assert {"a_ptr", "K", "stride_am", "stride_bk"} <= set(aligned.attrs)
    assert "K" not in jobs["matmul K=4100"].attrs                     # 4100 % 16 != 0: no hint
    assert "stride_am" not in jobs["matmul K=4100"].attrs             # the row stride is 4100 too
    assert jobs["matmul M=1 decode"].constexprs["M"] == 1             # M=1 is folded into the code
    assert "a_ptr" not in jobs["matmul unaligned A"].attrs            # a view 2 bytes in
    assert "n" not in jobs["do_not_specialize"].attrs and jobs["do_not_specialize"].signature["n"] == "i32"
    assert jobs["do_not_specialize"].constexprs["stride"] == 1
    assert "stride_am: i32 %16" in aligned.specialization() and "stride_ak: =1" in aligned.specialization()


def test_divisibility_changes_the_code_a_gpu_runs():
    """The reason for all of this: with K % 16 == 0 the grouped matmul pipelines both operands with
    cp.async (LDGSTS) into 3 stages of shared memory; with K = 4100 A's row stride is not a multiple
    of 16 elements, its rows are not 16-byte aligned, and only B's copies stay asynchronous."""
    jobs = cases()
    builds = ki.compile_triton_many([ki.launch_job(k, *a, **kw) for k, a, kw in
                                     (jobs["matmul K=4096"], jobs["matmul K=4100"])], archs=("sm80", "sm90"))
    for arch in ("sm80", "sm90"):
        hinted, unhinted = builds[0][arch], builds[1][arch]
        assert hinted.async_copies["LDGSTS"] > unhinted.async_copies["LDGSTS"]
        assert hinted.metadata["shared_bytes"] > unhinted.metadata["shared_bytes"]
        assert hinted.spills == 0


def test_launch_job_refuses_what_a_launch_would_refuse():
    kernel, args, kwargs = cases()["matmul K=4096"]
    with pytest.raises(TypeError, match="no value for"):
        ki.launch_job(kernel, *args[:5], **kwargs)
    with pytest.raises(TypeError, match="num_wraps"):
        ki.launch_job(kernel, *args, **kwargs, num_wraps=4)


def test_grid_and_the_unspecialized_job():
    kernel, args, kwargs = cases()["matmul K=4096"]
    job = ki.launch_job(kernel, *args, grid=(32 * 32,), **kwargs)
    assert job.grid == (1024,) and job.programs == 1024
    assert ki.launch_job(kernel, *args, **kwargs).programs is None
    old = job.unspecialized()                           # the hand-written signature of the old path
    assert old.attrs is None and old.signature["stride_ak"] == "i32" and old.signature["K"] == "i32"
    assert "stride_ak" not in old.constexprs and old.constexprs["BLOCK_M"] == 128
    assert "stride_ak: i32" in old.specialization() and "K: i32 %16" not in old.specialization()
    assert "a_ptr: *fp16 %16" in old.specialization()   # the old default: every pointer aligned


def test_errors_keep_returns_the_failure_per_architecture():
    kernel, args, kwargs = cases()["matmul K=4096"]
    bad = ki.launch_job(kernel, *args, **{**kwargs, "BLOCK_K": 3})
    softmax, softmax_args, softmax_kwargs = cases()["softmax rows"]
    good = ki.launch_job(softmax, *softmax_args, **softmax_kwargs)
    (bad_builds, good_builds) = ki.compile_triton_many([bad, good], archs=("sm80",), errors="keep")
    assert isinstance(bad_builds["sm80"], ki.CompileError) and "_matmul_grouped_kernel" in str(bad_builds["sm80"])
    assert isinstance(good_builds["sm80"], ki.Build)
    with pytest.raises(ValueError, match="errors"):
        ki.compile_triton_many([good], errors="ignore")
