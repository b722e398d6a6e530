"""Read SASS one function at a time (``cuobjdump -sass`` prints every kernel of a cubin in one text)."""
from __future__ import annotations

import re
from collections import Counter

from kernels import inspect as kinspect

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)


def split_functions(sass: str) -> dict[str, str]:
    """``{kernel name: its SASS}`` from a cuobjdump listing; error if the listing names no function."""
    marks = list(_FUNCTION.finditer(sass))
    if not marks:
        raise ValueError("no 'Function :' header in this SASS text: is it cuobjdump -sass output?")
    out = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        out[m.group(1)] = sass[m.end(): nxt.start() if nxt else len(sass)]
    return out


def opcodes(sass: str, function: str) -> Counter:
    """Full opcodes (``LDSM.16.MT88.4`` ...) of one kernel in a SASS listing."""
    funcs = split_functions(sass)
    if function not in funcs:
        raise KeyError(f"no kernel {function!r} in this SASS; it has {', '.join(sorted(funcs))}")
    return kinspect.instructions(funcs[function], "sass")


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def listing(sass: str, function: str) -> list[str]:
    """One kernel's instructions in program order, as text without addresses and encodings
    (``"@P0 MEMBAR.ALL.GPU"``, ``"SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4], RZ"``); NOPs left out."""
    funcs = split_functions(sass)
    if function not in funcs:
        raise KeyError(f"no kernel {function!r} in this SASS; it has {', '.join(sorted(funcs))}")
    out = []
    for m in _INSTRUCTION.finditer(funcs[function]):
        text = " ".join(m.group(1).split())
        if text.split()[-1] != "NOP" and text != "NOP":
            out.append(text)
    return out
