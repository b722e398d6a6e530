"""See what the hardware would run, without the hardware.

* :func:`compile_triton` compiles a Triton kernel ahead of time for an NVIDIA architecture
  (sm80, sm90, sm100, sm120 ...) with no GPU present and returns its TTGIR, PTX and SASS with the
  compiler's metadata (shared memory, warps, stages, tensor-memory columns) and the register count
  that ``cuobjdump --dump-resource-usage`` reads from the cubin.
* :func:`compile_cuda` compiles a CUDA C++ file (``kernels/cuda/*.cu``) with the pip ``nvcc`` and
  returns its PTX and SASS.
* :func:`instructions` and :func:`families` list the instructions in PTX or SASS text, so a test
  or a notebook can assert that, say, an fp16 ``tl.dot`` became ``wgmma.mma_async`` on sm90.
"""
from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kernels import aot_cache

CUDA_DIR = Path(__file__).parent / "cuda"

# Architectures the course compiles for, with what each one is.
ARCHITECTURES: dict[int, str] = {
    80: "Ampere (A100)",
    86: "Ampere (RTX 30, A10)",
    89: "Ada (L4, RTX 40)",
    90: "Hopper (H100, H200)",
    100: "Blackwell datacenter (B200, GB200)",
    120: "Blackwell consumer and workstation (RTX 50, RTX PRO 6000)",
}

_PIP_PACKAGE = {
    "nvcc": "nvidia-cuda-nvcc (with nvidia-cuda-cccl, nvidia-cuda-crt, nvidia-nvvm)",
    "cuobjdump": "nvidia-cuda-cuobjdump",
    "nvdisasm": "nvidia-cuda-nvdisasm",
}


class ToolMissingError(RuntimeError):
    """A compiler or disassembler the course uses is not installed."""


class CompileError(RuntimeError):
    """A kernel failed to compile; the message carries the compiler's output."""


@dataclass(frozen=True)
class Arch:
    """A parsed architecture name such as ``sm90`` or ``sm_100a``."""

    capability: int
    suffix: str  # "", "a" (architecture-specific features) or "f" (family)

    @property
    def name(self) -> str:
        return f"sm{self.capability}"

    @property
    def nvcc_arch(self) -> str:
        return f"sm_{self.capability}{self.suffix}"


def parse_arch(arch: str | int) -> Arch:
    """Accept ``90``, ``"sm90"``, ``"sm_90"`` or ``"sm_90a"``; refuse architectures the course does not know.

    Without a suffix, Hopper and Blackwell get ``a``: wgmma, TMA multicast and tcgen05 exist only in
    the architecture-specific targets (the CUDA C++ Programming Guide, "Feature Set Compiler Targets").
    """
    if isinstance(arch, int):
        text = f"sm{arch}"
    else:
        text = arch.strip().lower()
    m = re.fullmatch(r"sm_?(\d+)([af]?)", text)
    if not m or int(m.group(1)) not in ARCHITECTURES:
        known = ", ".join(f"sm{c}" for c in ARCHITECTURES)
        raise ValueError(f"unknown architecture {arch!r}: expected one of {known} (optionally sm_90a style)")
    cap = int(m.group(1))
    suffix = m.group(2) or ("a" if cap >= 90 else "")
    return Arch(cap, suffix)


# ----------------------------------------------------------------------------------------------
# Tools


def _tool_dirs() -> list[Path]:
    site = Path(sysconfig.get_paths()["purelib"])
    dirs = [site / "nvidia" / "cu13" / "bin", site / "nvidia" / "cuda_nvcc" / "bin"]
    try:
        import triton

        dirs.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin")
    except ImportError:
        pass
    return dirs


def tool(name: str) -> Path:
    """Path of ``nvcc``, ``cuobjdump`` or ``nvdisasm``: the pip-installed copy first, then PATH."""
    for d in _tool_dirs():
        if (d / name).is_file():
            return d / name
    found = shutil.which(name)
    if found:
        return Path(found)
    package = _PIP_PACKAGE.get(name, name)
    raise ToolMissingError(
        f"{name} not found: install the pip package {package} (pinned in requirements.txt; "
        f"`make env` installs it), or put a CUDA toolkit's bin/ on PATH"
    )


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def disassemble(cubin: bytes) -> tuple[str, dict[str, dict[str, int]]]:
    """SASS text of a cubin and its per-function resource usage (REG, SHARED, LOCAL, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = _run([str(tool("cuobjdump")), "-sass", str(path)], "cuobjdump -sass")
        usage = _run([str(tool("cuobjdump")), "--dump-resource-usage", str(path)], "cuobjdump --dump-resource-usage")
    return sass, parse_resource_usage(usage)


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``{function: {"REG": 10, "SHARED": 0, ...}}`` from ``cuobjdump --dump-resource-usage``."""
    result: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            current = m.group(1)
            continue
        if current and "REG:" in line:
            result[current] = {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}
            current = None
    return result


# ----------------------------------------------------------------------------------------------
# Triton


def kernel_source(kernel) -> str:
    """The Python source of a ``@triton.jit`` kernel, compiled or interpreted, decorator included.

    ``inspect.getsource`` refuses the interpreter's wrapper object; the function it wraps is ``.fn``.
    """
    import inspect as pyinspect

    return pyinspect.getsource(getattr(kernel, "fn", kernel))


@dataclass
class Build:
    """What a compile produced for one kernel on one architecture."""

    arch: Arch
    ptx: str
    sass: str
    ttgir: str = ""
    metadata: dict = field(default_factory=dict)

    def families(self, kind: str = "sass") -> Counter:
        return families(self.sass if kind == "sass" else self.ptx, kind)

    @property
    def spills(self) -> int:
        """Local-memory stores and loads in the SASS (STL, LDL): registers spilled to memory that
        each thread must write and read back. A row kernel sized for its width has none."""
        ops = instructions(self.sass, "sass")
        return sum(n for op, n in ops.items() if op.split(".")[0] in ("STL", "LDL"))

    @property
    def async_copies(self) -> dict[str, int]:
        """How the kernel fills shared memory: cp.async (SASS ``LDGSTS``) and TMA (``UTMALDG``) counts.

        Both zero means every tile goes through registers (LDG then STS), so ``num_stages`` bought
        no pipeline even if the shared memory holds several buffers."""
        fam = self.families("sass")
        return {"LDGSTS": fam["LDGSTS"], "UTMALDG": fam["UTMALDG"]}

    @property
    def tensor_core(self) -> str:
        """The tensor-core instruction family in the SASS (HMMA, HGMMA, QGMMA, UTCHMMA ...), or "-"."""
        fam = self.families("sass")
        found = sorted(f for f in fam if f in _TENSOR_CORE_SASS)
        return "+".join(found) or "-"


def compile_triton(
    kernel,
    signature: dict[str, str],
    *,
    arch: str | int,
    constexprs: dict | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: list[str] | None = None,
) -> Build:
    """Compile ``kernel`` (a module-level ``@triton.jit`` function) for ``arch`` with no GPU.

    ``signature`` maps each runtime argument to its Triton type (``"*fp16"``, ``"i32"``,
    ``"tensordesc<fp16[128, 64]>"``); constexpr arguments take their values from ``constexprs``
    (ints, floats, bools or strings). ``aligned`` names the pointer arguments to mark 16-byte
    aligned, as the JIT infers for tensors from torch's allocator; by default every pointer is.
    Without that hint Triton cannot vectorise loads or pipeline them with cp.async, and the SASS
    would not be what a real launch runs.
    """
    return compile_triton_archs(
        kernel, signature, archs=(arch,), constexprs=constexprs,
        num_warps=num_warps, num_stages=num_stages, aligned=aligned,
    )[parse_arch(arch).name]


def compile_triton_archs(
    kernel,
    signature: dict[str, str],
    *,
    archs=("sm80", "sm90", "sm100", "sm120"),
    constexprs: dict | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned: list[str] | None = None,
) -> dict[str, Build]:
    """:func:`compile_triton` for several architectures at once: ``{"sm90": Build, ...}``.

    The compile runs in a fresh Python process with the interpreter off: a process that has
    switched ``TRITON_INTERPRET`` on holds interpreter versions of ``triton.language``'s helpers
    and cannot generate GPU code.
    """
    job = TritonJob(kernel, signature, constexprs=constexprs or {}, num_warps=num_warps,
                    num_stages=num_stages, aligned=aligned)
    return compile_triton_many([job], archs=archs)[0]


@dataclass
class TritonJob:
    """One kernel to compile ahead of time, with its launch choices.

    Build one with :func:`launch_job` from the arguments a real launch would pass: then the
    signature, the constexprs and the divisibility attributes are the ones Triton's own binder
    derives on a GPU (integers equal to 1 become constexprs, integers and pointers divisible by 16
    carry ``tt.divisibility``). A hand-written ``signature`` (see :func:`compile_triton`) is still
    possible; then ``aligned`` names the arguments marked divisible by 16 (by default every pointer).
    """

    kernel: object
    signature: dict[str, str]
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    aligned: list[str] | None = None
    # Set by launch_job: {argument: [["tt.divisibility", 16]]}, exactly what the binder derived.
    attrs: dict[str, list] | None = None
    options: dict = field(default_factory=dict)  # further launch options (maxnreg, num_ctas ...)
    grid: tuple[int, ...] | None = None  # the launch's grid, when launch_job was told it
    # The architectures ("sm80", "sm90", "sm100") whose launcher really builds this job; None: all. A
    # module that takes another path on some GPUs says so, and the compiler page does not show those
    # builds as launches.
    launched_on: tuple[str, ...] | None = None

    @property
    def programs(self) -> int | None:
        """Programs (thread blocks) the launch starts, from ``grid``; None when the grid is not known."""
        if self.grid is None:
            return None
        total = 1
        for g in self.grid:
            total *= g
        return total

    def unspecialized(self) -> "TritonJob":
        """This job as a hand-written signature compiled it before :func:`launch_job`: every integer a
        plain ``i32`` (no divisibility hint, a 1 not folded), every pointer marked 16-byte aligned.
        The "before" of a before/after comparison (see ``tools.aot_before_after``)."""
        declared = {a for a in _arg_names(self.kernel) if not _is_specialised_runtime_arg(self.kernel, a)}
        signature, constexprs = {}, {}
        for arg in _arg_names(self.kernel):
            kind = self.signature.get(arg)
            if arg in declared:
                if arg in self.constexprs:
                    constexprs[arg] = self.constexprs[arg]
            elif kind == "constexpr":      # an integer 1 the binder folded: a plain i32 again
                signature[arg] = "i32"
            elif kind is not None:
                signature[arg] = kind
        return TritonJob(self.kernel, signature, constexprs=constexprs, num_warps=self.num_warps,
                         num_stages=self.num_stages, options=dict(self.options), grid=self.grid)

    def spec(self) -> dict:
        fn = getattr(self.kernel, "fn", self.kernel)
        module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
        if not module or not name or module == "__main__":
            raise ValueError("compile_triton needs a @triton.jit kernel defined at module level in an importable module")
        return {"module": module, "name": name, "signature": self.signature,
                "constexprs": {k: _encode_constexpr(v) for k, v in self.constexprs.items()},
                "num_warps": self.num_warps, "num_stages": self.num_stages, "aligned": self.aligned,
                "attrs": self.attrs, "options": self.options}

    def specialization(self) -> str:
        """One line per runtime argument: its type and what the launch specialised it to.

        ``K: i32 %16`` (divisible by 16), ``stride_ak: =1`` (a constexpr 1, folded into the code),
        ``a_ptr: *fp16 %16`` (16-byte aligned), ``N: i32`` (no hint: a value not divisible by 16)."""
        divisible = self._divisible()
        lines = []
        for arg in _arg_names(self.kernel):
            kind = self.signature.get(arg)
            if kind is None or (kind == "constexpr" and arg not in self.constexprs):
                continue
            if kind == "constexpr":
                if _is_specialised_runtime_arg(self.kernel, arg):
                    lines.append(f"{arg}: ={self.constexprs[arg]!r}")
                continue
            lines.append(f"{arg}: {kind}{' %16' if arg in divisible else ''}")
        return "\n".join(lines)

    def _divisible(self) -> set[str]:
        if self.attrs is not None:
            return {a for a, v in self.attrs.items() if ["tt.divisibility", 16] in v}
        pointers = [n for n, t in self.signature.items() if t.startswith("*")]
        return set(pointers if self.aligned is None else self.aligned)


def _arg_names(kernel) -> list[str]:
    import inspect as pyinspect

    return list(pyinspect.signature(getattr(kernel, "fn", kernel)).parameters)


def _is_specialised_runtime_arg(kernel, arg: str) -> bool:
    """True for an argument the kernel does not declare ``tl.constexpr`` (a launch folded it to a value)."""
    import inspect as pyinspect

    param = pyinspect.signature(getattr(kernel, "fn", kernel)).parameters[arg]
    return "constexpr" not in str(param.annotation)


def launch_job(kernel, *args, target: str | int = "sm90", grid=None, **kwargs) -> TritonJob:
    """The job a launch ``kernel[grid](*args, **kwargs)`` on an NVIDIA GPU would compile.

    The arguments are what the launcher passes: tensors (real ones, or on the ``meta`` device to
    describe a real model's sizes without the memory), integers, floats, constexprs and the launch
    options (``num_warps``, ``num_stages``, ``maxnreg`` ...). Triton's own binder
    (``triton.runtime.jit.create_function_from_signature`` with the CUDA backend) specialises them
    exactly as on a GPU: an integer equal to 1 becomes a constexpr, an integer or a pointer divisible
    by 16 carries ``tt.divisibility``, ``do_not_specialize`` is honoured. No GPU and no driver are
    needed, and nothing is launched. ``grid`` (optional) records the launch's grid on the job, so a
    table can show how many programs the launch starts against the GPU's SMs.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = getattr(kernel, "fn", kernel)
    if isinstance(kernel, JITFunction):
        jit = kernel
    else:  # the interpreter's wrapper keeps the decorator's arguments (do_not_specialize ...)
        jit = JITFunction(fn, **getattr(kernel, "kwargs", {}))
    names = jit.arg_names
    missing = [p.name for p in jit.params[len(args):] if p.name not in kwargs and not p.has_default]
    if missing:
        raise TypeError(f"launch_job({fn.__name__}): no value for {missing}: pass every argument the launch passes")
    backend = make_backend(GPUTarget("cuda", parse_arch(target).capability, 32))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, option_kwargs = binder(*args, **kwargs)
    unknown = set(option_kwargs) - set(backend.parse_options({}).__dict__)
    if unknown:
        raise TypeError(f"launch_job({fn.__name__}): {sorted(unknown)} are neither arguments nor launch options")
    options, signature, constexprs, attrs = jit._pack_args(backend, option_kwargs, bound, specialization, option_kwargs)
    nested = [path for path in (*constexprs, *attrs) if len(path) != 1]
    if nested:
        raise ValueError(f"launch_job({fn.__name__}): tuple arguments are not supported (paths {nested})")
    extra = {k: v for k, v in option_kwargs.items() if k not in ("num_warps", "num_stages")}
    return TritonJob(
        kernel, dict(signature), constexprs={names[p[0]]: v for p, v in constexprs.items()},
        num_warps=options.num_warps, num_stages=options.num_stages,
        attrs={names[p[0]]: v for p, v in attrs.items() if v}, options=extra,
        grid=None if grid is None else tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,))),
    )


def _encode_constexpr(value):
    """A constexpr value as JSON for the compile subprocess (``tl.float16`` and jitted helpers too)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__name__ == "dtype" and hasattr(value, "primitive_bitwidth"):
        return {"tl_dtype": str(value)}
    fn = getattr(value, "fn", None)
    if fn is not None and getattr(fn, "__module__", None):
        return {"jit_function": f"{fn.__module__}:{fn.__qualname__}"}
    raise ValueError(f"constexpr value {value!r} of type {type(value).__name__} cannot be sent to the compiler")


def _decode_constexpr(value):
    if isinstance(value, dict) and "tl_dtype" in value:
        import triton.language as tl

        return tl.dtype(value["tl_dtype"])
    if isinstance(value, dict) and "jit_function" in value:
        module, qualname = value["jit_function"].split(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    return value


def compile_triton_many(jobs: list[TritonJob], *, archs=("sm90",), errors: str = "raise") -> list[dict[str, Build]]:
    """Compile every job for every architecture: ``[{"sm90": Build, ...} for each job]``.

    Builds come from the run's shared cache (:mod:`kernels.aot_cache`, keyed by the job, the
    architecture, the toolchain and the source of the kernel's module and everything it imports)
    where present; the rest compile in one fresh process (one interpreter start, not one per
    kernel), so a spill table over many kernels and widths costs seconds, and the same build asked
    for again by a notebook, its second CPU configuration, a test or the compiler page costs nothing.

    ``errors="keep"``: a job that does not compile for one architecture (fp8 ``tl.dot`` on sm80, say)
    gets a :class:`CompileError` in place of its Build there, and the others still compile."""
    if errors not in ("raise", "keep"):
        raise ValueError(f"compile_triton_many: errors must be 'raise' or 'keep', got {errors!r}")
    targets = [parse_arch(a) for a in archs]
    specs = [job.spec() for job in jobs]
    keys = [[triton_build_key(spec, t) for t in targets] for spec in specs]
    entries = [[aot_cache.load(k) for k in row] for row in keys]
    for spec, row in zip(specs, entries):
        for target, entry in zip(targets, row):
            if entry is not None:
                aot_cache.record("triton", f"{spec['module']}.{spec['name']}", target.name, 0.0, hit=True)
    missing = {i: [j for j, e in enumerate(row) if e is None] for i, row in enumerate(entries)}
    missing = {i: js for i, js in missing.items() if js}
    if missing:
        compiled = _compile_in_subprocess([dict(specs[i], archs=[targets[j].capability for j in js])
                                           for i, js in missing.items()])
        for (i, js), outs in zip(missing.items(), compiled):
            for j, out in zip(js, outs):
                entries[i][j] = _entry_of(out)
                aot_cache.store(keys[i][j], entries[i][j])
                aot_cache.record("triton", f"{specs[i]['module']}.{specs[i]['name']}", targets[j].name,
                                 out.get("seconds", 0.0), hit=False)
    results = []
    for row in entries:
        builds = {}
        for target, entry in zip(targets, row):
            if "error" in entry:
                if errors == "raise":
                    raise CompileError(entry["error"])
                builds[target.name] = CompileError(entry["error"])
            else:
                builds[target.name] = Build(target, entry["ptx"], entry["sass"], entry["ttgir"], entry["metadata"])
        results.append(builds)
    return results


def triton_build_key(spec: dict, target: Arch) -> str:
    """The cache entry of one job on one architecture: the job, the target, and the source digest of
    the kernel's module and of every module that supplies a jitted constexpr (a helper passed in)."""
    modules = {spec["module"]} | {v["jit_function"].split(":")[0] for v in spec["constexprs"].values()
                                  if isinstance(v, dict) and "jit_function" in v}
    return aot_cache.key({"kind": "triton", "spec": spec, "capability": target.capability, "toolchain": toolchain(),
                          "sources": {m: aot_cache.source_digest(m) for m in sorted(modules)}})


@lru_cache(maxsize=1)
def toolchain() -> dict:
    """What a build depends on besides its source: Triton's version and what ``--version`` prints for
    ptxas, nvcc and cuobjdump (None where one is missing). No paths: a clone elsewhere on the same
    toolchain shares the keys."""
    import triton

    found = {}
    for name in ("cuobjdump", "nvcc", "ptxas"):
        try:
            found[name] = _run([str(tool(name)), "--version"], f"{name} --version").strip().splitlines()[-1]
        except (ToolMissingError, CompileError, OSError):
            found[name] = None
    return {"triton": triton.__version__, **found}


def _compile_in_subprocess(specs: list[dict]) -> list[list[dict]]:
    """Run :func:`_compile_in_this_process` for each spec in one fresh interpreter (see
    :func:`compile_triton_archs` for why fresh); a compile that fails comes back as ``{"error": ...}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KERNELS_COMPILE_ONLY"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.inspect"], input=json.dumps([dict(s, keep_errors=True) for s in specs]),
        capture_output=True, text=True, env=env, cwd=str(Path(__file__).resolve().parent.parent),
    )
    if proc.returncode != 0:
        raise CompileError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout)


def _entry_of(out: dict) -> dict:
    """A compile's output as a cache entry: TTGIR, PTX, SASS and metadata with the register count."""
    if "error" in out:
        return {"error": out["error"]}
    sass, usage = disassemble(base64.b64decode(out["cubin"]))
    regs = usage.get(out["metadata"]["name"], {})
    meta = dict(out["metadata"], registers=regs.get("REG"), local_bytes=regs.get("LOCAL"),
                stack_bytes=regs.get("STACK"))  # spilled registers live in the stack frame
    return {"ptx": out["ptx"], "sass": sass, "ttgir": out["ttgir"], "metadata": meta}


def resource_table(entries: list[tuple[str, Build]]) -> str:
    """A text table of what each compiled case costs per thread: ``entries`` are (label, Build).

    Registers and the stack frame come from ``cuobjdump --dump-resource-usage`` (spilled registers
    live in the stack frame, not in LOCAL); STL/LDL count the spill stores and loads in the SASS;
    shared memory and stages come from the compiler's metadata, LDGSTS (cp.async) and UTMALDG (TMA)
    count the asynchronous copies that make those stages a pipeline.
    Every column is a compile-time fact, the same on every machine that runs the same compiler."""
    rows = [("case", "arch", "warps", "registers", "stack bytes", "STL+LDL", "smem KiB", "stages", "LDGSTS",
             "UTMALDG")]
    for label, b in entries:
        m = b.metadata
        copies = b.async_copies
        rows.append((label, b.arch.nvcc_arch, str(m["num_warps"]), str(m["registers"]), str(m["stack_bytes"]),
                     str(b.spills), f"{m['shared_bytes'] / 1024:.0f}", str(m["num_stages"]), str(copies["LDGSTS"]),
                     str(copies["UTMALDG"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _compile_in_this_process(spec: dict) -> list[dict]:
    """The subprocess side of :func:`compile_triton_archs` (interpreter off, nothing launched)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    constexprs = spec["constexprs"]
    full_signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            full_signature[arg] = "constexpr"
        elif arg in spec["signature"]:
            full_signature[arg] = spec["signature"][arg]
        else:
            raise ValueError(f"argument {arg!r} of {fn.__name__} has neither a type in signature nor a constexpr value")
    unknown = set(spec["signature"]) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"signature names arguments {sorted(unknown)} that {fn.__name__} does not have")
    if spec.get("attrs") is not None:  # derived by launch_job: Triton's own binder decided
        attrs = {(fn.arg_names.index(n),): v for n, v in spec["attrs"].items()}
    else:
        pointers = [n for n, t in full_signature.items() if t.startswith("*")]
        marked = pointers if spec["aligned"] is None else spec["aligned"]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in marked}
    constexprs = {k: _decode_constexpr(v) for k, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=full_signature, constexprs=constexprs, attrs=attrs)
    results = []
    for cap in spec["archs"]:
        start = time.perf_counter()
        try:
            compiled = triton.compile(
                source, target=GPUTarget("cuda", cap, 32),
                options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"], **spec.get("options", {})},
            )
        except Exception as err:  # triton raises several types; keep its message, name the kernel
            first = str(err).strip().splitlines()
            message = f"Triton could not compile {fn.__name__} for sm{cap}: {' '.join(first[-3:])}"
            if spec.get("keep_errors"):
                results.append({"error": message})
                continue
            raise CompileError(message) from err
        meta = compiled.metadata
        results.append({
            "ptx": compiled.asm["ptx"],
            "ttgir": compiled.asm["ttgir"],
            "cubin": base64.b64encode(compiled.asm["cubin"]).decode(),
            "seconds": time.perf_counter() - start,
            "metadata": {
                "name": meta.name, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                "shared_bytes": meta.shared, "tmem_columns": getattr(meta, "tmem_size", 0),
            },
        })
    return results


# ----------------------------------------------------------------------------------------------
# CUDA C++


def cuda_source(name: str) -> Path:
    """Path of ``kernels/cuda/<name>.cu``, with a clear error if it does not exist."""
    path = CUDA_DIR / (name if name.endswith(".cu") else f"{name}.cu")
    if not path.is_file():
        available = ", ".join(sorted(p.stem for p in CUDA_DIR.glob("*.cu"))) or "none"
        raise FileNotFoundError(f"no CUDA source {path.name} in {CUDA_DIR} (available: {available})")
    return path


def compile_cuda(source: str | os.PathLike, *, arch: str | int, flags: tuple[str, ...] = ()) -> Build:
    """Compile a ``.cu`` file (a path, or a name under ``kernels/cuda``) with nvcc: PTX, cubin, SASS."""
    target = parse_arch(arch)
    path = Path(source)
    if not path.is_file():
        path = cuda_source(str(source))
    headers = sorted(p for p in path.parent.iterdir() if p.suffix in (".h", ".cuh"))
    entry_key = aot_cache.key({"kind": "cuda", "source": path.read_text(), "arch": target.nvcc_arch,
                               "flags": list(flags), "toolchain": toolchain(),
                               "headers": {h.name: h.read_text() for h in headers}})
    entry = aot_cache.load(entry_key)
    if entry is not None:
        aot_cache.record("cuda", path.name, target.nvcc_arch, 0.0, hit=True)
    else:
        start = time.perf_counter()
        try:
            entry = _nvcc_build(path, target, flags)
        except CompileError as err:
            entry = {"error": str(err)}
        aot_cache.store(entry_key, entry)
        aot_cache.record("cuda", path.name, target.nvcc_arch, time.perf_counter() - start, hit=False)
    if "error" in entry:
        raise CompileError(entry["error"])
    return Build(target, entry["ptx"], entry["sass"], metadata=entry["metadata"])


def _nvcc_build(path: Path, target: Arch, flags: tuple[str, ...]) -> dict:
    """nvcc to PTX and to a cubin, then cuobjdump: the cache entry of :func:`compile_cuda`."""
    nvcc = str(tool("nvcc"))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        common = [nvcc, f"-arch={target.nvcc_arch}", "-O3", "-std=c++17", *flags, str(path)]
        _run([*common, "-ptx", "-o", str(ptx_path)], f"nvcc -ptx {path.name} for {target.nvcc_arch}")
        _run([*common, "-cubin", "-o", str(cubin_path)], f"nvcc -cubin {path.name} for {target.nvcc_arch}")
        ptx = ptx_path.read_text()
        cubin = cubin_path.read_bytes()
    sass, usage = disassemble(cubin)
    return {"ptx": ptx, "sass": sass, "metadata": {"resources": usage, "cubin_bytes": len(cubin)}}


# ----------------------------------------------------------------------------------------------
# Reading instructions

# SASS families that run on the tensor cores: mma.sync (HMMA, IMMA, QMMA), wgmma (HGMMA, IGMMA,
# QGMMA) and tcgen05.mma (UTCHMMA, UTCIMMA, UTCQMMA, UTCOMMA for the block-scaled kinds).
_TENSOR_CORE_SASS = {"HMMA", "IMMA", "QMMA", "HGMMA", "IGMMA", "QGMMA", "UTCHMMA", "UTCIMMA", "UTCQMMA",
                     "UTCOMMA", "UTCMMA", "OMMA"}

_PTX_LINE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_:]+(?:X\b)?)*)[\s;]")
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")

# PTX families that the course names by more than their first word, longest first.
_PTX_FAMILIES = sorted(
    [
        "cp.async.bulk.tensor", "cp.async.bulk", "cp.async.commit_group", "cp.async.wait_group",
        "cp.async.wait_all", "cp.async.mbarrier", "cp.async", "cp.reduce.async.bulk",
        "wgmma.mma_async", "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group",
        "tcgen05.mma", "tcgen05.ld", "tcgen05.st", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.commit",
        "tcgen05.cp", "tcgen05.wait", "tcgen05.fence", "tcgen05.relinquish_alloc_permit",
        "mma.sync", "ldmatrix.sync", "stmatrix.sync", "mbarrier.init", "mbarrier.arrive",
        "mbarrier.try_wait", "mbarrier.expect_tx", "mbarrier.wait", "ld.global", "ld.shared", "ld.param",
        "st.global", "st.shared", "ex2.approx", "fence.proxy", "bar.sync", "barrier.sync", "setmaxnreg",
    ],
    key=len,
    reverse=True,
)


def instructions(text: str, kind: str) -> Counter:
    """Count the full opcodes in PTX (``kind="ptx"``) or SASS (``kind="sass"``) text."""
    if kind == "ptx":
        ops = []
        for line in text.splitlines():
            stripped = line.split("//")[0]
            m = _PTX_LINE.match(stripped)
            if m:
                ops.append(m.group(1))
        return Counter(ops)
    if kind == "sass":
        return Counter(m.group(1) for m in _SASS_LINE.finditer(text))
    raise ValueError(f"kind must be 'ptx' or 'sass', got {kind!r}")


def family_of(opcode: str, kind: str) -> str:
    """``HMMA.16816.F32`` -> ``HMMA``; ``mma.sync.aligned.m16n8k16...`` -> ``mma.sync``; ``add.f32`` -> ``add``."""
    if kind == "sass":
        return opcode.split(".")[0]
    for prefix in _PTX_FAMILIES:
        if opcode == prefix or opcode.startswith(prefix + "."):
            return prefix
    return opcode.split(".")[0]


def families(text: str, kind: str) -> Counter:
    """Count instruction families in PTX or SASS text."""
    counts: Counter = Counter()
    for op, n in instructions(text, kind).items():
        counts[family_of(op, kind)] += n
    return counts


if __name__ == "__main__":  # the compile subprocess of compile_triton_archs
    import kernels  # noqa: F401  (configures the runtime: compile-only, interpreter off)

    try:
        print(json.dumps([_compile_in_this_process(spec) for spec in json.loads(sys.stdin.read())]))
    except Exception as err:
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)


def param_product_widths(build, index: int) -> set[int]:
    """The widths of the integer products the kernel's runtime parameter ``index`` enters in the PTX:
    64 where it is read sign-extended into a 64-bit register (ld.param %rd, cvt.s64.s32,
    mul.wide.s32), 32 where its 32-bit register enters a mul.lo.s32 / mad.lo.s32. The PTX numbers
    the parameters that are not constexprs, in order."""
    name = build.metadata["name"]
    load = re.search(rf"ld\.param\.[bsu](?:32|64)\s+(%rd?\d+), \[{name}_param_{index}\];", build.ptx)
    if load is None:
        raise ValueError(f"param_product_widths: parameter {index} is not read in the PTX of {name}")
    reg = load.group(1)
    if reg.startswith("%rd"):
        return {64}
    widths = set()
    if re.search(rf"(cvt\.s64\.s32\s+%rd\d+, |mul\.wide\.s32\s+%rd\d+,[^;]*[ ,]){reg}\b", build.ptx):
        widths.add(64)
    if re.search(rf"(mul|mad)\.lo\.s32\s+%r\d+,[^;]*[ ,]{reg}\b", build.ptx):
        widths.add(32)
    return widths
