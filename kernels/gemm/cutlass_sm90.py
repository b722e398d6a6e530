"""CUTLASS's Hopper GEMM schedules, compiled: ``KernelTmaWarpSpecializedCooperative`` and
``KernelTmaWarpSpecializedPingpong`` instantiated in ``kernels/cuda/cutlass_sm90_gemm.cu`` and built
for sm_90a with the course's nvcc against the CUTLASS headers of the PyPI package ``nvidia-cutlass``
(4.2.0.0). Nothing runs: the cubin's SASS and resource usage are read back.

``compile_facts()`` compiles (about half a minute of nvcc front end) and returns, per schedule, what
the compiler made of it: threads per block, the tile, the mainloop's shared-memory stages and the
dynamic shared memory (from CUTLASS's own constants, stored by a small kernel in the same file),
registers at launch and the ``setmaxnreg`` budgets the warp groups move to, wgmma shape and counts,
TMA loads and stores, spills. ``python -m kernels.gemm.cutlass_sm90`` writes them to
``models/cutlass-sm90/facts.json``, which the chapter reads (a notebook has no minute to spare);
``tests/test_cutlass_sm90.py`` recompiles and checks the committed file is what the compiler says.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels import inspect as ki
from kernels.ptx import sass as S

CUTLASS_PACKAGE = "nvidia-cutlass==4.2.0.0"
ROOT = Path(__file__).resolve().parent.parent.parent
FACTS = ROOT / "models" / "cutlass-sm90" / "facts.json"
FLAGS = ("-arch=sm_90a", "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr")
SCHEDULES = ("Cooperative", "Pingpong")
# cutlass_sm90_facts stores, in order: threads, dynamic shared memory, stages of each schedule.
_FACT_SLOTS = [(s, f) for f in ("threads", "shared_bytes", "stages") for s in SCHEDULES]


def cutlass_include() -> Path:
    """The CUTLASS C++ headers shipped inside the ``nvidia-cutlass`` wheel (cutlass_library/source/include)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        raise ki.ToolMissingError(f"the CUTLASS headers are not installed: pip install {CUTLASS_PACKAGE}")
    include = Path(spec.origin).parent / "source" / "include"
    if not (include / "cutlass" / "cutlass.h").is_file():
        raise ki.ToolMissingError(f"no cutlass/cutlass.h under {include}: reinstall {CUTLASS_PACKAGE}")
    return include


def compile_sm90() -> tuple[str, str, dict]:
    """nvcc the CUTLASS source for sm_90a: (PTX, SASS, resource usage per function). One front-end pass."""
    source = ki.cuda_source("cutlass_sm90_gemm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "cutlass.cubin"
        cmd = [str(ki.tool("nvcc")), *FLAGS, f"-I{cutlass_include()}", "--keep", f"--keep-dir={tmp}",
               "-cubin", "-o", str(cubin), str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ki.CompileError(f"nvcc {source.name} failed:\n{proc.stderr[-3000:]}")
        ptx = next(Path(tmp).glob("*.ptx")).read_text()
        sass, usage = ki.disassemble(cubin.read_bytes())
    return ptx, sass, usage


def _stored_constants(ptx: str) -> list[int]:
    """The integers cutlass_sm90_facts stores, in slot order (st.global of immediates)."""
    body = ptx[ptx.index(".entry cutlass_sm90_facts"):]
    body = body[: body.index("ret;")]
    values = dict(re.findall(r"mov\.u32\s+(%r\d+), (\d+);", body))                    # register -> immediate
    stores = {int(off or 0): int(values[reg]) for off, reg in re.findall(r"st\.global\.u32\s+\[%rd\d+(?:\+(\d+))?\],\s*(%r\d+);", body)}
    return [stores[4 * i] for i in range(len(_FACT_SLOTS))]


def facts(ptx: str, sass: str, usage: dict) -> dict:
    """Per schedule: what CUTLASS asked for and what the compiler made of it."""
    constants = dict(zip(_FACT_SLOTS, _stored_constants(ptx)))
    functions = S.split_functions(sass)
    out = {}
    for schedule in SCHEDULES:
        name = next(n for n in functions if f"KernelTmaWarpSpecialized{schedule}" in n)
        ops = S.opcodes(sass, name)
        fam = ki.families(functions[name], "sass")
        budgets = sorted({(("dec" if "DEALLOC" in op else "inc"), int(v, 16))
                          for op, v in re.findall(r"(USETMAXREG\.\S+)\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", functions[name])})
        entry = ptx[ptx.index(f".entry {name}"):].split(".entry", 2)[1]              # this kernel's PTX only
        wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", entry)))
        out[schedule] = {
            "tile": [int(v) for v in re.search(r"Shape<_?(\d+), _?(\d+), _?(\d+)>", _TILES[schedule]).groups()],
            "threads": constants[(schedule, "threads")],
            "stages": constants[(schedule, "stages")],
            "shared_bytes": constants[(schedule, "shared_bytes")],
            "registers_at_launch": usage[name]["REG"],
            "setmaxnreg": [list(b) for b in budgets],
            "wgmma_shapes": wgmma,
            "HGMMA": fam["HGMMA"], "UTMALDG": fam["UTMALDG"], "UTMASTG": fam["UTMASTG"],
            "spills": sum(n for op, n in ops.items() if op.split(".")[0] in ("STL", "LDL")),
        }
    return out


# The tiles the .cu file instantiates (checked against its text by the test).
_TILES = {"Cooperative": "Shape<_128, _128, _64>", "Pingpong": "Shape<_64, _128, _64>"}


def compile_facts() -> dict:
    ptx, sass, usage = compile_sm90()
    nvcc = subprocess.run([str(ki.tool("nvcc")), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return {"cutlass": CUTLASS_PACKAGE, "nvcc": nvcc, "flags": list(FLAGS), "schedules": facts(ptx, sass, usage)}


def load_facts() -> dict:
    """The committed facts (``models/cutlass-sm90/facts.json``)."""
    return json.loads(FACTS.read_text())


def main() -> int:
    FACTS.parent.mkdir(parents=True, exist_ok=True)
    FACTS.write_text(json.dumps(compile_facts(), indent=2) + "\n")
    print(f"wrote {FACTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
