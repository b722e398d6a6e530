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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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
    """One kernel to compile ahead of time, with its launch choices (see :func:`compile_triton`)."""

    kernel: object
    signature: dict[str, str]
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    aligned: list[str] | None = None

    def spec(self) -> dict:
        fn = getattr(self.kernel, "fn", self.kernel)
        module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
        if not module or not name or module == "__main__":
            raise ValueError("compile_triton needs a @triton.jit kernel defined at module level in an importable module")
        return {"module": module, "name": name, "signature": self.signature, "constexprs": self.constexprs,
                "num_warps": self.num_warps, "num_stages": self.num_stages, "aligned": self.aligned}


def compile_triton_many(jobs: list[TritonJob], *, archs=("sm90",)) -> list[dict[str, Build]]:
    """Compile every job for every architecture in one fresh process (one interpreter start, not
    one per kernel): ``[{"sm90": Build, ...} for each job]``. A spill table over many kernels and
    widths costs seconds this way."""
    targets = [parse_arch(a) for a in archs]
    specs = [dict(job.spec(), archs=[t.capability for t in targets]) for job in jobs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KERNELS_COMPILE_ONLY"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.inspect"], input=json.dumps(specs), capture_output=True, text=True, env=env,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    if proc.returncode != 0:
        raise CompileError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    results = []
    for outs in json.loads(proc.stdout):
        builds = {}
        for target, out in zip(targets, outs):
            sass, usage = disassemble(base64.b64decode(out["cubin"]))
            regs = usage.get(out["metadata"]["name"], {})
            meta = dict(out["metadata"], registers=regs.get("REG"), local_bytes=regs.get("LOCAL"),
                        stack_bytes=regs.get("STACK"))  # spilled registers live in the stack frame
            builds[target.name] = Build(target, out["ptx"], sass, out["ttgir"], meta)
        results.append(builds)
    return results


def resource_table(entries: list[tuple[str, Build]]) -> str:
    """A text table of what each compiled case costs per thread: ``entries`` are (label, Build).

    Registers and the stack frame come from ``cuobjdump --dump-resource-usage`` (spilled registers
    live in the stack frame, not in LOCAL); STL/LDL count the spill stores and loads in the SASS.
    Every column is a compile-time fact, the same on every machine that runs the same compiler."""
    rows = [("case", "arch", "warps", "registers", "stack bytes", "STL+LDL")]
    for label, b in entries:
        m = b.metadata
        rows.append((label, b.arch.nvcc_arch, str(m["num_warps"]), str(m["registers"]), str(m["stack_bytes"]),
                     str(b.spills)))
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
    pointers = [n for n, t in full_signature.items() if t.startswith("*")]
    marked = pointers if spec["aligned"] is None else spec["aligned"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in marked}
    source = ASTSource(fn=fn, signature=full_signature, constexprs=constexprs, attrs=attrs)
    results = []
    for cap in spec["archs"]:
        try:
            compiled = triton.compile(
                source, target=GPUTarget("cuda", cap, 32),
                options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]},
            )
        except Exception as err:  # triton raises several types; keep its message, name the kernel
            first = str(err).strip().splitlines()
            raise CompileError(f"Triton could not compile {fn.__name__} for sm{cap}: {' '.join(first[-3:])}") from err
        meta = compiled.metadata
        results.append({
            "ptx": compiled.asm["ptx"],
            "ttgir": compiled.asm["ttgir"],
            "cubin": base64.b64encode(compiled.asm["cubin"]).decode(),
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
    nvcc = str(tool("nvcc"))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        common = [nvcc, f"-arch={target.nvcc_arch}", "-O3", "-std=c++17", *flags, str(path)]
        _run([*common, "-ptx", "-o", str(ptx_path)], f"nvcc -ptx {path.name} for {target.nvcc_arch}")
        _run([*common, "-cubin", "-o", str(cubin_path)], f"nvcc -cubin {path.name} for {target.nvcc_arch}")
        ptx = ptx_path.read_text()
        cubin = cubin_path.read_bytes()
    sass, usage = disassemble(cubin)
    return Build(target, ptx, sass, metadata={"resources": usage, "cubin_bytes": len(cubin)})


# ----------------------------------------------------------------------------------------------
# Reading instructions

_PTX_LINE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_:]+)*)[\s;]")
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
