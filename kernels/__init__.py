"""Kernels, references and checks for *The Path to LLM Mastery*.

Importing this package picks the device and, on a machine without a GPU, switches Triton's
interpreter on before any kernel module imports triton (see :mod:`kernels.runtime`). That is the
package's one side effect; every submodule only defines things.
"""
from kernels import runtime as _runtime

_runtime.configure()
