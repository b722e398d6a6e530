"""kernels.runtime: device choice, the interpreter switch, and its refusal when set up wrongly."""
import os
import subprocess
import sys

import torch

import kernels
from kernels import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_COMPILE_ONLY")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=ROOT)


def test_cpu_runtime_interprets_and_leaves_out_bf16():
    rt = runtime.runtime()
    if rt.on_gpu:
        assert torch.bfloat16 in rt.check_dtypes
    else:
        assert rt.interpreted and os.environ["TRITON_INTERPRET"] == "1"
        assert rt.device == torch.device("cpu")
        assert torch.bfloat16 not in rt.check_dtypes and rt.supports(torch.float16)
        assert "interpreter" in runtime.describe()


def test_import_kernels_switches_the_interpreter_on_before_triton():
    proc = run_python(
        "import sys, os, kernels; assert 'triton' not in sys.modules; "
        "import torch; print(os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available())"
    )
    assert proc.returncode == 0, proc.stderr
    value, has_gpu = proc.stdout.split()
    assert value == "1" or has_gpu == "True"


def test_triton_imported_first_without_interpreter_is_refused_with_advice():
    proc = run_python("import triton, kernels")
    if "True" in run_python("import torch; print(torch.cuda.is_available())").stdout:
        assert proc.returncode == 0
        return
    assert proc.returncode != 0
    assert "RuntimeConfigError" in proc.stderr
    assert "Import kernels before triton" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr


def test_triton_imported_first_with_interpreter_is_fine():
    proc = run_python("import triton, kernels; from kernels import runtime; print(runtime.runtime().interpreted)",
                      TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_interpreter_numpy_warnings_stay_out_of_outputs():
    """An overflowing exp under the interpreter gives inf, as on a GPU, without a NumPy warning
    (which would land in a notebook's stderr), even with warnings turned into errors."""
    code = (
        "import kernels, torch, triton, triton.language as tl\n"
        "@triton.jit\n"
        "def k(x_ptr, y_ptr):\n"
        "    tl.store(y_ptr + tl.arange(0, 16), tl.exp(tl.load(x_ptr + tl.arange(0, 16))))\n"
        "x = torch.full((16,), 1000.0); y = torch.empty(16)\n"
        "k[(1,)](x, y)\n"
        "print(bool(torch.isinf(y).all()))\n"
    )
    if "True" in run_python("import torch; print(torch.cuda.is_available())").stdout:
        return
    proc = run_python(code, PYTHONWARNINGS="error")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"
