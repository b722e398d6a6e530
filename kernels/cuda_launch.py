"""Run the course's CUDA C++ kernels from Python: a small ctypes binding of the CUDA driver API.

``load(name, arch=None)`` compiles ``kernels/cuda/<name>.cu`` to PTX with :func:`kernels.inspect.compile_cuda`
(for the GPU's own architecture by default) and loads it with ``cuModuleLoadData``; the driver
JIT-compiles the PTX for the device. ``module.launch(kernel, grid, block, *args)`` looks the
``extern "C"`` kernel up with ``cuModuleGetFunction`` and starts it with ``cuLaunchKernel`` on
torch's current stream. Arguments: CUDA torch tensors (passed as their ``data_ptr()``), Python
ints (``int``), floats (``float``), or explicit ``ctypes`` values for anything else.

This needs an NVIDIA driver and a CUDA GPU; without one, :func:`load` raises :class:`NoCudaError`
saying so (tests that need it skip with that reason).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

import torch

from kernels import inspect as kinspect


class NoCudaError(RuntimeError):
    """No CUDA driver or GPU here: the kernel cannot be loaded or launched."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


_LIB = None


def driver() -> ctypes.CDLL:
    """The CUDA driver library, initialised; :class:`NoCudaError` when there is none or no GPU."""
    global _LIB
    if _LIB is not None:
        return _LIB
    if not torch.cuda.is_available():
        raise NoCudaError("no CUDA GPU is visible to torch here: CUDA kernels can be compiled and their SASS read, "
                          "but not launched")
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as err:
        raise NoCudaError(f"the CUDA driver library ({name}) could not be loaded: {err}") from err
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # makes torch's primary context current on this thread
    _LIB = lib
    _check(lib.cuInit(0), "cuInit")
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        msg = ctypes.c_char_p()
        lib = _LIB
        text = "unknown error"
        if lib is not None and lib.cuGetErrorString(status, ctypes.byref(msg)) == 0 and msg.value:
            text = msg.value.decode()
        raise CudaDriverError(f"{call} failed with CUDA error {status}: {text}")


def _argument(value):
    if isinstance(value, torch.Tensor):
        if value.device.type != "cuda":
            raise ValueError(f"tensor argument is on {value.device}; CUDA kernels need CUDA tensors")
        return ctypes.c_void_p(value.data_ptr())
    if isinstance(value, bool):
        return ctypes.c_int(int(value))
    if isinstance(value, int):
        return ctypes.c_int(value)
    if isinstance(value, float):
        return ctypes.c_float(value)
    if isinstance(value, (ctypes._SimpleCData, ctypes.Structure)):
        return value
    raise TypeError(f"cannot pass {type(value).__name__} to a CUDA kernel: use a tensor, int, float or a ctypes value")


def _dim3(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(d) <= 3 or any((not isinstance(x, int)) or x < 1 for x in d):
        raise ValueError(f"grid and block must be 1 to 3 positive ints, got {d!r}")
    return tuple(d) + (1,) * (3 - len(d))


@dataclass
class Module:
    name: str
    arch: str
    handle: ctypes.c_void_p
    ptx: str

    def function(self, kernel: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        _check(driver().cuModuleGetFunction(ctypes.byref(fn), self.handle, kernel.encode()),
               f"cuModuleGetFunction({kernel!r}) in {self.name}.cu")
        return fn

    def attribute(self, kernel: str, attribute: str) -> int:
        """A compiled kernel's attribute from cuFuncGetAttribute: "registers", "shared_bytes" (static), "max_threads"."""
        codes = {"max_threads": 0, "shared_bytes": 1, "registers": 4}
        if attribute not in codes:
            raise KeyError(f"unknown attribute {attribute!r}; known: {', '.join(codes)}")
        value = ctypes.c_int()
        _check(driver().cuFuncGetAttribute(ctypes.byref(value), codes[attribute], self.function(kernel)),
               f"cuFuncGetAttribute({kernel!r}, {attribute})")
        return value.value

    def max_active_blocks(self, kernel: str, block_threads: int, dynamic_shared_bytes: int = 0) -> int:
        """The driver's occupancy answer (cuOccupancyMaxActiveBlocksPerMultiprocessor), to check
        :func:`kernels.gpu.hardware.occupancy` against."""
        n = ctypes.c_int()
        _check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self.function(kernel),
                                                                    block_threads, dynamic_shared_bytes),
               f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel!r})")
        return n.value

    def launch(self, kernel: str, grid, block, *args, shared_bytes: int = 0, sync: bool = True) -> None:
        """Launch ``kernel`` with ``grid`` x ``block`` threads on torch's current stream."""
        lib = driver()
        fn = self.function(kernel)
        gx, gy, gz = _dim3(grid)
        bx, by, bz = _dim3(block)
        values = [_argument(a) for a in args]
        params = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(lib.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, None),
               f"cuLaunchKernel({kernel!r})")
        if sync:
            torch.cuda.synchronize()


def device_arch() -> str:
    """The current GPU's architecture as the course names it (``sm90`` ...)."""
    driver()
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def load(name: str, *, arch: str | None = None) -> Module:
    """Compile ``kernels/cuda/<name>.cu`` to PTX and load it into torch's CUDA context."""
    lib = driver()
    target = arch or device_arch()
    build = kinspect.compile_cuda(name, arch=target)
    image = build.ptx.encode() + b"\0"
    handle = ctypes.c_void_p()
    _check(lib.cuModuleLoadData(ctypes.byref(handle), ctypes.c_char_p(image)), f"cuModuleLoadData({name}.cu, {target})")
    return Module(name, target, handle, build.ptx)


class TensorMapArg(ctypes.Structure):
    """A ``CUtensorMap``: 128 opaque bytes, passed to a kernel by value (``const __grid_constant__``).
    The driver writes it only at a 64-byte aligned address: make it with :func:`aligned_tensor_map`."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def aligned_tensor_map() -> TensorMapArg:
    """A zeroed :class:`TensorMapArg` at a 64-byte aligned address (ctypes aligns structures to 8)."""
    buf = (ctypes.c_uint8 * (128 + 64))()
    tmap = TensorMapArg.from_address((ctypes.addressof(buf) + 63) // 64 * 64)
    tmap._buffer = buf          # keeps the memory alive as long as the map
    return tmap


def encode_tensor_map(arguments: dict) -> TensorMapArg:
    """``cuTensorMapEncodeTiled`` with the arguments :meth:`kernels.ptx.tma.TensorMap.arguments`
    lists (enums as ints, dimensions innermost first); the result is a kernel argument."""
    lib = driver()
    rank = arguments["tensorRank"]
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    tmap = aligned_tensor_map()
    _check(lib.cuTensorMapEncodeTiled(
        ctypes.byref(tmap), arguments["tensorDataType"], rank, ctypes.c_void_p(arguments["globalAddress"]),
        (u64 * rank)(*arguments["globalDim"]), (u64 * max(rank - 1, 1))(*arguments["globalStrides"]),
        (u32 * rank)(*arguments["boxDim"]), (u32 * rank)(*arguments["elementStrides"]),
        arguments["interleave"], arguments["swizzle"], arguments["l2Promotion"], arguments["oobFill"]),
        "cuTensorMapEncodeTiled")
    return tmap
