"""Where the course's kernels run: a CUDA GPU when there is one, else the CPU through Triton's interpreter.

Triton decides at decoration time (``@triton.jit``) whether a kernel is compiled for a GPU or
interpreted in numpy, by reading ``TRITON_INTERPRET``. So the switch has to be thrown before the
first kernel module is imported; ``import kernels`` calls :func:`configure` for that reason.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch

INTERPRET_VAR = "TRITON_INTERPRET"
# Set by kernels.inspect in the subprocess that compiles kernels ahead of time: there the kernels
# must be real @triton.jit functions even though no GPU is present, and nothing is launched.
COMPILE_ONLY_VAR = "KERNELS_COMPILE_ONLY"


class RuntimeConfigError(RuntimeError):
    """The process was set up in a way the kernels cannot run in."""


@dataclass(frozen=True)
class Runtime:
    """The device the kernels run on and what can be checked there."""

    device: torch.device
    interpreted: bool  # True: Triton kernels run in numpy on the CPU
    gpu_name: str | None
    compile_only: bool = False  # True: kernels can be compiled ahead of time, not launched

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def check_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes in which a kernel's arithmetic can be checked on this device.

        The interpreter does bfloat16 arithmetic wrongly (``tl.dot`` on bf16 multiplies the bit
        patterns, triton-lang/triton#11584, and downcasts do not round to nearest-even), so on the
        CPU bfloat16 is left out: a bf16 result there would test the interpreter, not the kernel.
        """
        if self.interpreted:
            return (torch.float32, torch.float16)
        return (torch.float32, torch.float16, torch.bfloat16)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self.check_dtypes


_RUNTIME: Runtime | None = None


def _interpreter_requested() -> bool:
    return os.environ.get(INTERPRET_VAR, "0") == "1"


def configure() -> Runtime:
    """Pick the device once per process and, without a GPU, switch the interpreter on.

    Raises :class:`RuntimeConfigError` when triton was imported earlier without the interpreter
    on a machine with no GPU: kernels decorated after that point could not run anywhere.
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    if os.environ.get(COMPILE_ONLY_VAR) == "1":
        os.environ.pop(INTERPRET_VAR, None)
        _RUNTIME = Runtime(torch.device("cpu"), False, None, compile_only=True)
        return _RUNTIME
    if torch.cuda.is_available() and not _interpreter_requested():
        _RUNTIME = Runtime(torch.device("cuda"), False, torch.cuda.get_device_name(0))
        return _RUNTIME
    if "triton" in sys.modules and not _interpreter_requested():
        raise RuntimeConfigError(
            "triton was imported before kernels, without TRITON_INTERPRET=1, and there is no CUDA GPU: "
            "Triton kernels defined now could neither be compiled nor interpreted. "
            "Import kernels before triton (put `import kernels` first), or start Python with "
            "TRITON_INTERPRET=1 in the environment."
        )
    os.environ[INTERPRET_VAR] = "1"
    # The interpreter computes in NumPy, which warns where a GPU silently produces inf or NaN (an
    # overflowing exp, lanes a mask discards). Those values are the kernel's to get right and the
    # checks' to judge; as warnings they only add nondeterministic noise to notebook outputs.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    _RUNTIME = Runtime(torch.device("cpu"), True, None)
    return _RUNTIME


def runtime() -> Runtime:
    """The configured runtime (configuring it on first use)."""
    return configure()


def device() -> torch.device:
    """The device tensors for kernels should live on."""
    return configure().device


def describe() -> str:
    """One line for a notebook: where kernels run here."""
    rt = configure()
    if rt.on_gpu:
        return f"kernels run on {rt.gpu_name} (compiled Triton); checked dtypes: {_names(rt.check_dtypes)}"
    return f"kernels run on the CPU through Triton's interpreter; checked dtypes: {_names(rt.check_dtypes)}"


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
