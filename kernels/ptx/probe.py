"""Which PTX instructions each architecture accepts, asked of ``ptxas`` itself.

Each :class:`Feature` is one instruction, written as the smallest PTX that uses it; :func:`probe`
assembles it for an architecture with the pip ``ptxas`` and reports whether the assembler accepted
it, with ptxas's own message when it did not (for example "Instruction 'wgmma.fence' not supported
on .target 'sm_100a'"). ``introduced`` is the generation the documentation says added it; the
gpu-generations chapter asserts that the probes agree. Sources: the PTX ISA's "Target ISA notes"
under each instruction (``nvidia2025ptx``) and the architecture whitepapers named in ``source``.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels import inspect as kinspect

PTX_VERSION = "9.2"     # what nvcc 13.2 emits
PROBE_ARCHS = ("sm_80", "sm_90a", "sm_100a", "sm_120a")

# registers, a shared buffer and a predicate for the snippets to use
_DECLARE = """\
.reg .b32 r<8>; .reg .f32 f<8>; .reg .b64 rd<2>; .reg .b8 q; .reg .b32 sa; .reg .pred p;
.shared .align 128 .b8 smem[1024];
mov.u32 sa, smem; mov.b64 rd0, 0; mov.b64 rd1, 0; mov.b32 r0, 0; mov.b32 r1, 0; setp.eq.u32 p, r0, 0;"""


@dataclass(frozen=True)
class Feature:
    key: str
    introduced: str       # "sm80", "sm90", "sm100", "sm120"
    what: str
    ptx: str
    source: str           # citation key for the feature's description


FEATURES: tuple[Feature, ...] = (
    Feature("ldmatrix", "sm75", "ldmatrix: 8x8 b16 tiles from shared memory into fragments",
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {r0, r1, r2, r3}, [sa];", "nvidia2025ptx"),
    Feature("mma.sync f16", "sm80", "mma.sync m16n8k16 f16 x f16 -> f32 (warp-level MMA)",
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {f0, f1, f2, f3}, {r0, r1, r2, r3}, {r4, r5}, {f4, f5, f6, f7};",
            "nvidia2020a100whitepaper"),
    Feature("cp.async", "sm80", "cp.async: asynchronous global -> shared copy, commit/wait groups",
            "cp.async.cg.shared.global [sa], [rd0], 16; cp.async.commit_group; cp.async.wait_group 0;",
            "nvidia2020a100whitepaper"),
    Feature("mma.sync bf16", "sm80", "mma.sync m16n8k16 with bf16 inputs",
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {f0, f1, f2, f3}, {r0, r1, r2, r3}, {r4, r5}, {f4, f5, f6, f7};",
            "nvidia2020a100whitepaper"),
    Feature("mma.sync tf32", "sm80", "mma.sync m16n8k8 with tf32 inputs",
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {f0, f1, f2, f3}, {r0, r1, r2, r3}, {r4, r5}, {f4, f5, f6, f7};",
            "nvidia2020a100whitepaper"),
    Feature("wgmma", "sm90", "wgmma.mma_async: a warpgroup (4 warps) multiplies from shared memory",
            "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {f0, f1, f2, f3}, rd0, rd1, p, 1, 1, 0, 0;",
            "nvidia2022h100whitepaper"),
    Feature("wgmma fp8", "sm90", "FP8 (e4m3, e5m2) tensor-core MMA in wgmma",
            "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {f0, f1, f2, f3}, rd0, rd1, p, 1, 1;",
            "nvidia2022h100whitepaper"),
    Feature("TMA", "sm90", "TMA: cp.async.bulk.tensor, one thread copies a tile, mbarrier completion",
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [sa], [rd0, {r0, r1}], [sa];",
            "nvidia2022h100whitepaper"),
    Feature("clusters", "sm90", "thread block clusters: barrier.cluster across the CTAs of a cluster",
            "barrier.cluster.arrive; barrier.cluster.wait;", "nvidia2025cudaguide"),
    Feature("distributed smem", "sm90", "distributed shared memory: mapa maps a peer CTA's shared address",
            "mapa.shared::cluster.u32 r2, sa, r1;", "nvidia2025cudaguide"),
    Feature("setmaxnreg", "sm90", "setmaxnreg: warpgroups hand registers to each other",
            "setmaxnreg.inc.sync.aligned.u32 240;", "nvidia2025ptx"),
    Feature("tcgen05.mma", "sm100", "tcgen05.mma: single-thread-issued MMA, accumulator in tensor memory",
            "tcgen05.mma.cta_group::1.kind::f16 [r0], rd0, rd1, r1, p;", "nvidia2024blackwellbrief"),
    Feature("TMEM", "sm100", "tensor memory: tcgen05.ld reads the accumulator into registers",
            "tcgen05.ld.sync.aligned.32x32b.x1.b32 {r2}, [r0];", "nvidia2025ptx"),
    Feature("two-CTA MMA", "sm100", "two-CTA MMA: tcgen05 with cta_group::2 spans a CTA pair",
            "tcgen05.mma.cta_group::2.kind::f16 [r0], rd0, rd1, r1, p;", "nvidia2025ptx"),
    Feature("FP6/FP4 tcgen05", "sm100", "FP6 and FP4 inputs to tcgen05.mma (kind::f8f6f4)",
            "tcgen05.mma.cta_group::1.kind::f8f6f4 [r0], rd0, rd1, r1, p;", "nvidia2024blackwellbrief"),
    Feature("FP4 convert", "sm100", "cvt to FP4 (e2m1x2)", "cvt.rn.satfinite.e2m1x2.f32 q, f0, f1;",
            "nvidia2024blackwellbrief"),
    Feature("FP6/FP4 mma.sync", "sm120", "FP6 and FP4 inputs to warp-level mma.sync (kind::f8f6f4)",
            "mma.sync.aligned.m16n8k32.row.col.kind::f8f6f4.f32.e2m1.e2m1.f32 {f0, f1, f2, f3}, {r0, r1, r2, r3}, {r4, r5}, {f4, f5, f6, f7};",
            "nvidia2025rtxblackwell"),
)


@dataclass(frozen=True)
class Probe:
    feature: str
    arch: str
    accepted: bool
    message: str  # ptxas's first error line, or "" when accepted


def feature(key: str) -> Feature:
    for f in FEATURES:
        if f.key == key:
            return f
    raise KeyError(f"unknown feature {key!r}; known: {', '.join(f.key for f in FEATURES)}")


def program(snippet: str, arch: str) -> str:
    """A complete PTX module whose one kernel runs ``snippet``."""
    return (f".version {PTX_VERSION}\n.target {arch}\n.address_size 64\n\n.visible .entry probe()\n{{\n"
            f"{_DECLARE}\n{snippet}\nret;\n}}\n")


def _target(arch: str) -> str:
    return kinspect.parse_arch(arch).nvcc_arch  # sm90 -> sm_90a; unknown arch: ValueError naming the known ones


def probe(key: str, arch: str) -> Probe:
    """Assemble ``key``'s snippet for ``arch`` with ptxas; accepted or not, with ptxas's message."""
    f = feature(key)
    target = _target(arch)
    ptxas = str(kinspect.tool("ptxas"))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.ptx"
        src.write_text(program(f.ptx, target))
        proc = subprocess.run([ptxas, f"-arch={target}", str(src), "-o", str(Path(tmp) / "probe.cubin")],
                              capture_output=True, text=True)
    errors = [ln.split("error   :", 1)[-1].strip() for ln in (proc.stderr + proc.stdout).splitlines() if "error" in ln]
    return Probe(key, target, proc.returncode == 0, "" if proc.returncode == 0 else (errors[0] if errors else proc.stderr.strip()))


def support_matrix(archs=PROBE_ARCHS, keys=None) -> dict[str, dict[str, Probe]]:
    """``{feature: {arch: Probe}}`` for every feature (or ``keys``) on every arch.

    One ptxas run per architecture: every feature becomes its own kernel in one module, and each
    error ptxas reports is charged to the kernel whose lines it names.
    """
    keys = list(keys or [f.key for f in FEATURES])
    ptxas = str(kinspect.tool("ptxas"))
    result: dict[str, dict[str, Probe]] = {k: {} for k in keys}
    for arch in archs:
        target = _target(arch)
        lines = [f".version {PTX_VERSION}", f".target {target}", ".address_size 64"]
        spans = []
        for i, k in enumerate(keys):
            start = len(lines) + 1
            lines += [f".visible .entry probe_{i}()", "{", *_DECLARE.splitlines(), feature(k).ptx, "ret;", "}"]
            spans.append((start, len(lines)))
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probes.ptx"
            src.write_text("\n".join(lines) + "\n")
            proc = subprocess.run([ptxas, f"-arch={target}", str(src), "-o", str(Path(tmp) / "probes.cubin")],
                                  capture_output=True, text=True)
        errors: dict[int, str] = {}
        for ln in (proc.stderr + proc.stdout).splitlines():
            m = re.search(r"line (\d+); error\s*:\s*(.*)", ln)
            if m:
                errors.setdefault(int(m.group(1)), m.group(2).strip())
        if proc.returncode != 0 and not errors:
            raise kinspect.CompileError(f"ptxas failed for {target} without a line-numbered error: {proc.stderr.strip()}")
        for k, (lo, hi) in zip(keys, spans):
            msgs = [msg for line, msg in sorted(errors.items()) if lo <= line <= hi]
            result[k][target] = Probe(k, target, not msgs, msgs[0] if msgs else "")
    return result


def advisories(snippet: str, arch: str) -> list[str]:
    """ptxas's warnings (its "Advisory" notes included) for ``snippet`` assembled for ``arch``;
    a CompileError if ptxas refuses the snippet. This is how NVIDIA's assembler says that an
    accepted instruction is not meant for a target."""
    target = _target(arch)
    ptxas = str(kinspect.tool("ptxas"))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.ptx"
        src.write_text(program(snippet, target))
        proc = subprocess.run([ptxas, f"-arch={target}", str(src), "-o", str(Path(tmp) / "probe.cubin")],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise kinspect.CompileError(f"ptxas refused the snippet for {target}: {proc.stderr.strip()}")
    return [ln.split("warning :", 1)[-1].strip() for ln in (proc.stderr + proc.stdout).splitlines() if "warning" in ln]


# multicast TMA, the form that kernels/cuda/tma.cu's tma_multicast_box issues (16-bit CTA mask in a .b16)
MULTICAST_TMA = (".reg .b16 mask; mov.b16 mask, 3;\n"
                 "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [sa], [rd0, {r0, r1}], [sa], mask;")
