"""One GPU run, prepared: ``python -m benchmarks.gpu --out benchmarks/results/<date>`` (``make gpu``).

A lent GPU is a short loan (about fifteen minutes, start-up included), so the run is one command of at
most eight minutes, planned and rehearsed on the CPU:

1. **Provenance**: device, driver, torch, triton, CUDA and nvcc versions, printed first.
2. **Ceilings** measured in the same run, not taken from a datasheet: a device-to-device copy (HBM
   bandwidth) and a cuBLAS bf16 GEMM (dense tensor-core throughput). Every row reports its fraction
   of one of them.
3. **Correctness, natively**: the kernel tests under ``tests/`` with the GPU-only tests enabled
   (several pytest processes, one file each, a hard time cap; a file that did not finish is reported
   as not run, never as passed), and in every benchmark step each kernel once at a real model's size
   against its reference (``kernels.testing.assert_close``) before it is timed.
4. **Ratios**: each kernel against the library a practitioner would use instead, median and (20%,
   80%) quantiles from ``triton.testing.do_bench``, bytes and FLOPs, achieved GB/s and TFLOP/s,
   inputs drawn at random.

``--out DIR`` writes one JSON per group (``kernels.bench.load`` reads them) and a summary table is
printed last. A step that fails (a launch the hardware refuses, a Triton feature this version lacks)
records its error and the run goes on. ``--plan`` prints the steps with their estimated compile and
run times against the eight-minute budget; ``--rehearse`` runs every step at a toy size through
Triton's interpreter on the CPU (wall-clock times, not performance): the test
``tests/test_gpu_rehearsal.py`` does that, so a typo cannot waste a GPU loan.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import kernels  # noqa: F401  (device choice before triton is imported)
import torch

from kernels import bench, runtime
from kernels.testing import assert_close

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480.0                 # the whole command: eight minutes of a fifteen-minute loan
TESTS_CAP_S = 170.0              # the native test pass is cut off here (files not finished: "not run")
TEST_WORKERS = 8                 # pytest processes sharing the one GPU (16 CPU cores compile kernels)
COMPILE_S = 2.0                  # one Triton compilation (ptxas included) on a loaded 16-core host
ROW_S = 0.35                     # one do_bench row: its warm-up (25 ms), 5 calls to estimate, 100 ms of reps
STARTUP_S = 25.0                 # interpreter start, CUDA context, imports, the provenance
MIN_TORCH, MIN_TRITON = (2, 11), (3, 6)
REHEARSAL_NOTE = "REHEARSAL on the CPU through Triton's interpreter at toy sizes: wall-clock times, not performance"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2])


# ---------------------------------------------------------------------------------------------------
# The context every step gets: random inputs, checks, timing, rows.

@dataclass
class Ctx:
    """What a step uses: ``real`` sizes on a GPU or toy sizes in the interpreter, the measured ceilings,
    and the rows, checks and errors the step records."""

    real: bool
    device: torch.device
    ceilings: dict = field(default_factory=dict)      # {"copy_gbs": ..., "gemm_tflops": ...}
    rows: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    seed: int = 0

    def randn(self, *shape, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        """Standard normal values (times ``scale``) on the device: never zeros, never a constant."""
        self.seed += 1
        if dtype == torch.bfloat16 and not self.real:
            dtype = torch.float16          # the interpreter's bf16 arithmetic is wrong (kernels.runtime)
        g = torch.Generator(device=self.device).manual_seed(self.seed)
        return (torch.randn(*shape, device=self.device, generator=g, dtype=torch.float32) * scale).to(dtype)

    def check(self, kernel: str, size: str, fn: Callable[[], None]) -> bool:
        """Run ``fn`` (which asserts); record pass, or fail with the error text. Returns whether it passed."""
        try:
            fn()
            self.checks.append({"kernel": kernel, "size": size, "ok": True})
            return True
        except Exception as exc:                          # noqa: BLE001  (recorded, the run goes on)
            self.checks.append({"kernel": kernel, "size": size, "ok": False, "error": _error_text(exc)})
            return False

    def close(self, kernel: str, size: str, actual, expected, *, baseline=None, dtype=None) -> bool:
        """:func:`check` of ``assert_close(actual(), expected(), ...)`` (callables: an exception in the
        kernel's launch is a failed check too)."""
        def run():
            base = baseline() if baseline is not None else None
            assert_close(actual(), expected(), baseline=base, dtype=dtype, name=kernel)
        return self.check(kernel, size, run)

    def time(self, fn) -> tuple[float, float, float]:
        """(median, p20, p80) in ms: ``do_bench`` on a GPU; one wall-clock call in the rehearsal."""
        if self.real:
            return bench.time_ms(fn)
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return ms, ms, ms

    def row(self, case: str, impl: str, fn, *, bytes_moved: float = 0.0, flops: float = 0.0,
            baseline: bool = False, peak_bytes: int | None = None, **config) -> dict:
        """Time ``fn`` and record the row: achieved GB/s and TFLOP/s, and their fractions of the measured
        copy bandwidth and cuBLAS throughput. ``baseline`` marks the library row of ``case`` the other
        rows of the case are compared with (:func:`add_ratios`)."""
        try:
            ms, lo, hi = self.time(fn)
        except Exception as exc:                          # noqa: BLE001
            row = {"case": case, "impl": impl, "baseline": baseline, "error": _error_text(exc), **config}
            self.rows.append(row)
            return row
        s = ms * 1e-3
        gbs, tflops = bytes_moved / s / 1e9, flops / s / 1e12
        row = {"case": case, "impl": impl, "baseline": baseline, **config, "ms": ms, "ms_p20": lo, "ms_p80": hi,
               "bytes": bytes_moved, "flops": flops, "gbs": gbs, "tflops": tflops}
        if self.ceilings.get("copy_gbs"):
            row["of_copy_bw"] = gbs / self.ceilings["copy_gbs"]
        if self.ceilings.get("gemm_tflops"):
            row["of_cublas_peak"] = tflops / self.ceilings["gemm_tflops"]
        if peak_bytes is not None:
            row["peak_bytes"] = peak_bytes
        self.rows.append(row)
        return row

    def measured(self, case: str, impl: str, ms: float, *, baseline: bool = False, timer: str, **config) -> dict:
        """Record a row timed by something else than :meth:`time` (a program's own clock): ``ms`` is its
        mean, and ``timer`` says what measured it; there are no quantiles."""
        row = {"case": case, "impl": impl, "baseline": baseline, **config, "ms": ms, "ms_p20": ms, "ms_p80": ms,
               "bytes": 0.0, "flops": 0.0, "gbs": 0.0, "tflops": 0.0, "timer": timer}
        self.rows.append(row)
        return row

    def peak_memory(self, fn) -> int | None:
        """Bytes allocated at the peak of one call of ``fn`` beyond what was allocated before (GPU only)."""
        if not self.real:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before


def _error_text(exc: BaseException, limit: int = 1500) -> str:
    """The exception as one string; a Triton feature this version lacks (an attribute or module of
    triton that is not there) is named as such, so the reader knows it is a skip, not a kernel bug."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (AttributeError, ImportError)) and "triton" in str(exc):
        import triton

        text = f"skipped: needs a newer Triton than {triton.__version__} ({text})"
    return text if len(text) <= limit else text[:limit] + " ..."


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each timed row's speed relative to its case's baseline row: ``baseline_ms / ms`` (> 1: faster)."""
    base = {r["case"]: r["ms"] for r in rows if r.get("baseline") and "ms" in r}
    for r in rows:
        if "ms" in r and r["case"] in base and not r.get("baseline"):
            r["vs_baseline"] = base[r["case"]] / r["ms"]
    return rows


# ---------------------------------------------------------------------------------------------------
# The steps. Each takes the context; sizes come from ``ctx.real`` (a real model's) or a toy.

def _sz(ctx: Ctx, real, toy):
    return real if ctx.real else toy


def step_ceilings(ctx: Ctx) -> None:
    """The run's own ceilings: a D2D copy of 1 GiB (read + write) and a cuBLAS bf16 GEMM at 8192^3."""
    n = _sz(ctx, 2 ** 28, 2 ** 12)                                   # fp32 elements: 1 GiB on a GPU
    src, dst = ctx.randn(n, dtype=torch.float32), torch.empty(n, device=ctx.device)
    copy = ctx.row("copy", "torch copy_ (D2D)", lambda: dst.copy_(src), bytes_moved=8.0 * n, n=n, baseline=True)
    m = _sz(ctx, 8192, 64)
    a, b = ctx.randn(m, m), ctx.randn(m, m)
    gemm = ctx.row("gemm", "cuBLAS bf16 (torch.matmul)", lambda: a @ b, flops=2.0 * m ** 3,
                   bytes_moved=6.0 * m * m, M=m, N=m, K=m, baseline=True)
    if "ms" not in copy or "ms" not in gemm:
        raise RuntimeError("the ceilings could not be measured: " + str(copy.get("error") or gemm.get("error")))
    ctx.ceilings.update(copy_gbs=copy["gbs"], gemm_tflops=gemm["tflops"])


def _matmul_check(ctx, name, size, fn, a, b, baseline=None):
    ctx.close(name, size, fn, lambda: a.float() @ b.float(), baseline=baseline or (lambda: a @ b))


def step_gemm(ctx: Ctx) -> None:
    """The GEMM ladder against cuBLAS at 4096^3 and 8192^3, fp16 and bf16 (naive only at 4096)."""
    from kernels.gemm import ladder, persistent
    from kernels.gemm.matmul import matmul as tiled

    sizes = _sz(ctx, (4096, 8192), (48, 80))
    for n in sizes:
        for dtype in (torch.float16, torch.bfloat16):
            a, b = ctx.randn(n, n, dtype=dtype), ctx.randn(n, n, dtype=dtype)
            impls = {"torch.matmul (cuBLAS)": lambda: a @ b, "grouped": lambda: ladder.matmul(a, b),
                     "persistent": lambda: persistent.matmul_persistent(a, b)}
            if n == sizes[0]:
                impls["naive"] = lambda: ladder.matmul_naive(a, b)
            if dtype == torch.float16:                                  # the tiled step has no bf16
                bm, bn, bk = _sz(ctx, (128, 128, 64), (32, 32, 32))
                impls["tiled"] = lambda: tiled(a, b, block_m=bm, block_n=bn, block_k=bk)
            case = f"{n}^3 {str(dtype)[6:]}"
            for impl, fn in impls.items():
                base = impl.startswith("torch")
                if not base and n == sizes[0]:
                    _matmul_check(ctx, f"gemm {impl}", case, fn, a, b)
                ctx.row(case, impl, fn, flops=2.0 * n ** 3, bytes_moved=3.0 * n * n * a.element_size(),
                        baseline=base, M=n, N=n, K=n, dtype=str(dtype)[6:])


def step_fp8_gemm(ctx: Ctx) -> None:
    """The FP8 GEMM (per-tensor scales, bf16 out) against torch._scaled_mm at 4096^3 and 8192^3."""
    from kernels.quant import fp8

    for n in _sz(ctx, (4096, 8192), (64, 96)):
        (aq, sa), (bq, sb) = fp8.quantize_current(ctx.randn(n, n, dtype=torch.float32)), \
            fp8.quantize_current(ctx.randn(n, n, dtype=torch.float32))
        bq_t = bq.t().contiguous().t()                                     # cuBLAS's FP8 wants B column-major
        ours = lambda: fp8.fp8_matmul(aq, bq, sa, sb, out_dtype=torch.bfloat16)   # noqa: E731
        case = f"{n}^3 fp8 e4m3"
        if n == _sz(ctx, 4096, 64):
            ctx.close("fp8_matmul", case, ours, lambda: fp8.fp8_matmul_ref(aq, bq, sa, sb), dtype=torch.bfloat16)
        counts = dict(flops=2.0 * n ** 3, bytes_moved=2.0 * n * n + 2.0 * n * n, M=n, N=n, K=n, dtype="fp8")
        ctx.row(case, "torch._scaled_mm (cuBLAS)", lambda: torch._scaled_mm(aq, bq_t, scale_a=sa, scale_b=sb,
                                                                            out_dtype=torch.bfloat16),
                baseline=True, **counts)
        ctx.row(case, "fp8_matmul", ours, **counts)


def _sdpa(backend_name: str, ctx: Ctx, q, k, v, causal: bool):
    """SDPA restricted to one backend on a GPU; in the rehearsal the math backend stands in (the CPU has
    no cuDNN backend), so only the call's shape and signature are rehearsed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    backends = [backend] if ctx.real else [SDPBackend.MATH]

    def run():
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _attn_inputs(ctx, b, h, n, d, dtype=torch.bfloat16, grad=False):
    return [ctx.randn(b, h, n, d, dtype=dtype).requires_grad_(grad) for _ in range(3)]


def step_flash_forward(ctx: Ctx) -> None:
    """FlashAttention-2 (kernels.attention.flash) and -3 (flash3) forward against SDPA's flash and cuDNN
    backends: bf16, 32 heads of 128, 16k tokens per batch at 4k and 16k, causal and not."""
    from kernels.attention import flash_attention
    from kernels.attention.flash3 import flash_attention_3

    h, d = _sz(ctx, 32, 2), _sz(ctx, 128, 64)
    for n in _sz(ctx, (4096, 16384), (64, 96)):
        b = _sz(ctx, 16384 // n, 1)
        q, k, v = _attn_inputs(ctx, b, h, n, d)
        for causal in (False, True):
            case = f"fwd B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}"
            flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
            impls = {"sdpa flash": _sdpa("FLASH_ATTENTION", ctx, q, k, v, causal),
                     "sdpa cudnn": _sdpa("CUDNN_ATTENTION", ctx, q, k, v, causal),
                     "flash_attention (FA2)": lambda: flash_attention(q, k, v, causal),
                     "flash_attention_3": lambda: flash_attention_3(q, k, v, causal)}
            if n == _sz(ctx, 4096, 64):
                q1, k1, v1 = q[:1], k[:1], v[:1]
                ref = lambda: torch.nn.functional.scaled_dot_product_attention(   # noqa: E731
                    q1.float(), k1.float(), v1.float(), is_causal=causal)
                for name, fn in (("flash_attention (FA2)", lambda: flash_attention(q1, k1, v1, causal)),
                                 ("flash_attention_3", lambda: flash_attention_3(q1, k1, v1, causal))):
                    ctx.close(name, case, fn, ref, baseline=_sdpa("FLASH_ATTENTION", ctx, q1, k1, v1, causal))
            for impl, fn in impls.items():
                ctx.row(case, impl, fn, flops=flops, bytes_moved=4.0 * b * h * n * d * 2, baseline=impl == "sdpa flash",
                        B=b, H=h, N=n, D=d, causal=causal)


def step_flash_backward(ctx: Ctx) -> None:
    """FlashAttention-2's backward against SDPA flash and cuDNN backward, the same shapes as the forward."""
    from kernels.attention import flash_attention

    h, d = _sz(ctx, 32, 2), _sz(ctx, 128, 64)
    for n in _sz(ctx, (4096, 16384), (64, 96)):
        b = _sz(ctx, 16384 // n, 1)
        q, k, v = _attn_inputs(ctx, b, h, n, d, grad=True)
        do = ctx.randn(b, h, n, d)
        for causal in (False, True):
            case = f"bwd B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}"
            fwds = {"sdpa flash": _sdpa("FLASH_ATTENTION", ctx, q, k, v, causal),
                    "sdpa cudnn": _sdpa("CUDNN_ATTENTION", ctx, q, k, v, causal),
                    "flash_attention (FA2)": lambda: flash_attention(q, k, v, causal)}
            if n == _sz(ctx, 4096, 64):
                q1, k1, v1 = (t[:1].detach().requires_grad_() for t in (q, k, v))
                do1 = do[:1]
                grads = lambda o: _flat(torch.autograd.grad(o, (q1, k1, v1), do1))          # noqa: E731
                ctx.close("flash_attention (FA2) backward", case, lambda: grads(flash_attention(q1, k1, v1, causal)),
                          lambda: _flat(_fp32_grads(lambda *t: (torch.nn.functional.scaled_dot_product_attention(
                              *t, is_causal=causal) * do1.float()).sum(), q1, k1, v1)),
                          baseline=lambda: grads(_sdpa("FLASH_ATTENTION", ctx, q1, k1, v1, causal)()),
                          dtype=torch.bfloat16)
            flops = 10.0 * b * h * n * n * d * (0.5 if causal else 1.0)      # 5 GEMMs of the backward
            for impl, fwd in fwds.items():
                try:
                    o = fwd()
                except Exception as exc:                                      # noqa: BLE001
                    ctx.rows.append({"case": case, "impl": impl, "error": _error_text(exc)})
                    continue
                ctx.row(case, impl, lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                        flops=flops, bytes_moved=8.0 * b * h * n * d * 2, baseline=impl == "sdpa flash",
                        B=b, H=h, N=n, D=d, causal=causal)


def _decode_counts(b, hq, hkv, length, d, elt=2):
    return dict(bytes_moved=2.0 * b * hkv * length * d * elt, flops=4.0 * b * hq * length * d)


def step_decode(ctx: Ctx) -> None:
    """Flash decoding (split K/V) and paged attention at 32k context against the measured copy
    bandwidth (and SDPA on the contiguous cache): Llama-3-70B's 64 query / 8 K/V heads of 128, bf16."""
    from kernels.attention import decode_attention_ref, flash_decode
    from kernels.attention.paged import paged_decode_attention, paged_decode_attention_ref

    b, hq, hkv, d = _sz(ctx, 8, 4), _sz(ctx, 64, 4), _sz(ctx, 8, 2), _sz(ctx, 128, 32)
    length, page = _sz(ctx, 32768, 50), 16
    q = ctx.randn(b, hq, d)
    k, v = ctx.randn(b, hkv, length, d), ctx.randn(b, hkv, length, d)
    lens = torch.full((b,), length, device=ctx.device, dtype=torch.int32)
    size = f"B{b} Hq{hq} Hkv{hkv} L{length} D{d}"
    qs = q.view(b, hq, 1, d)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)   # noqa: E731
    low = lambda: sdpa().view(b, hq, d)                                                # PyTorch in the low dtype
    ctx.close("flash_decode", size, lambda: flash_decode(q, k, v, lens), lambda: decode_attention_ref(q, k, v, lens),
              baseline=low)
    counts = _decode_counts(b, hq, hkv, length, d)
    ctx.row(size, "sdpa (contiguous cache, GQA)", sdpa, baseline=True, **counts)
    ctx.row(size, "flash_decode", lambda: flash_decode(q, k, v, lens), **counts)
    pages = -(-length // page)
    perm = torch.randperm(b * pages, device=ctx.device)
    table = perm.view(b, pages).to(torch.int32)
    pad = b * pages * page - b * length
    kp = torch.cat([k.transpose(1, 2).reshape(b * length, hkv, d), k.new_zeros(pad, hkv, d)]).view(b * pages, page, hkv, d)
    vp = torch.cat([v.transpose(1, 2).reshape(b * length, hkv, d), v.new_zeros(pad, hkv, d)]).view(b * pages, page, hkv, d)
    kp, vp = kp.transpose(1, 2).contiguous(), vp.transpose(1, 2).contiguous()         # (pages, Hkv, P, D)
    kp, vp = kp[torch.argsort(perm)], vp[torch.argsort(perm)]                         # page i of seq b at table[b, i]
    ctx.close("paged_decode_attention", size + f" page {page}", lambda: paged_decode_attention(q, kp, vp, table, lens),
              lambda: paged_decode_attention_ref(q, kp, vp, table, lens), baseline=low)
    ctx.row(size, f"paged_decode_attention (page {page})", lambda: paged_decode_attention(q, kp, vp, table, lens),
            **counts)
    _decode_split_vs_one_pass(ctx)


def _decode_split_vs_one_pass(ctx: Ctx) -> None:
    """The flash-decoding chapter's claim: at batch 1 the one-pass grid (B x Hkv = 8 programs) leaves
    most SMs idle, and the default split (choose_num_splits) fills them; the bandwidth model predicts
    min(1, after / SMs) / min(1, before / SMs) (132 / 8 = 16.5x on an H100 at 32k). Llama-2-70B's
    64 query / 8 K/V heads of 128, bf16; the one pass is the case's baseline, so vs_baseline is the
    measured speed-up, beside model_speedup."""
    from kernels.attention import choose_num_splits, decode_attention, decode_attention_ref

    b, hq, hkv, d, length = 1, _sz(ctx, 64, 4), _sz(ctx, 8, 2), _sz(ctx, 128, 32), _sz(ctx, 32768, 300)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if ctx.real else 132
    splits = choose_num_splits(b, hkv, length, sms)
    model = min(1.0, b * hkv * splits / sms) / min(1.0, b * hkv / sms)
    q = ctx.randn(b, hq, d)
    k, v = ctx.randn(b, hkv, length, d), ctx.randn(b, hkv, length, d)
    lens = torch.full((b,), length, device=ctx.device, dtype=torch.int32)
    case = f"B{b} Hq{hq} Hkv{hkv} L{length} D{d}: split vs one pass"
    one_pass = lambda: decode_attention(q, k, v, lens, num_splits=1)           # noqa: E731
    split = lambda: decode_attention(q, k, v, lens, num_splits=splits)         # noqa: E731
    ctx.close("decode_attention split", case, split, lambda: decode_attention_ref(q, k, v, lens), baseline=one_pass)
    counts = _decode_counts(b, hq, hkv, length, d)
    ctx.row(case, "decode_attention one pass (B x Hkv programs)", one_pass, baseline=True, **counts)
    ctx.row(case, f"decode_attention {splits} splits", split, splits=splits, sms=sms, model_speedup=model, **counts)


def step_mla(ctx: Ctx) -> None:
    """MLA decode over DeepSeek-V3's latent cache (128 heads on one 512 + 64 latent, 64-position pages)
    at 32k context against the measured copy bandwidth."""
    from kernels.attention.mla import mla_decode, mla_decode_ref, paged_latent_cache

    b, hq, dc, dr = _sz(ctx, 8, 2), _sz(ctx, 128, 4), _sz(ctx, 512, 32), _sz(ctx, 64, 16)
    length, page = _sz(ctx, 32768, 40), _sz(ctx, 64, 16)
    scale = 1.0 / math.sqrt(192.0)                                     # DeepSeek-V3: qk_nope 128 + rope 64
    latent, rope = ctx.randn(b, length, 1, dc), ctx.randn(b, length, 1, dr)
    lp, rp, table = paged_latent_cache(latent, rope, page)
    q_lat, q_rope = ctx.randn(b, hq, dc), ctx.randn(b, hq, dr)
    lens = torch.full((b,), length, device=ctx.device, dtype=torch.int32)
    size = f"B{b} Hq{hq} Dc{dc}+{dr} L{length} page {page}"
    run = lambda: mla_decode(q_lat, q_rope, lp, rp, table, lens, scale)   # noqa: E731
    ctx.close("mla_decode", size, run, lambda: mla_decode_ref(q_lat, q_rope, lp, rp, table, lens, scale),
              baseline=lambda: mla_decode_ref(q_lat, q_rope, lp, rp, table, lens, scale, upcast=False))
    ctx.row(size, "mla_decode", run, bytes_moved=2.0 * b * length * (dc + dr),
            flops=2.0 * b * hq * length * (2 * dc + dr))


def step_rows(ctx: Ctx) -> None:
    """Row kernels against eager PyTorch and the copy bandwidth: RMSNorm, LayerNorm, softmax, SwiGLU and
    RoPE forward at 16k tokens of Llama-3-8B's widths (bf16; softmax fp16 over a 32000 vocabulary)."""
    import torch.nn.functional as F

    from kernels.mlp.gated import swiglu, swiglu_ref
    from kernels.norm import layer_norm, rms_norm
    from kernels.norm.layer_norm import layer_norm_ref
    from kernels.norm.rms_norm import rms_norm_ref
    from kernels.position.rope import rope, rope_cos_sin, rope_frequencies, rope_ref
    from kernels.softmax import softmax
    from kernels.softmax.online import softmax_ref

    t, d, f = _sz(ctx, 16384, 5), _sz(ctx, 4096, 96), _sz(ctx, 14336, 80)
    x, w, bias = ctx.randn(t, d), ctx.randn(d), ctx.randn(d)
    two = 2.0 * x.numel() * 2
    cases = [("rms_norm", f"{t}x{d} bf16", lambda: rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (d,), w, 1e-6),
              lambda: rms_norm_ref(x, w, 1e-6), two),
             ("layer_norm", f"{t}x{d} bf16", lambda: layer_norm(x, w, bias, 1e-5),
              lambda: F.layer_norm(x, (d,), w, bias, 1e-5), lambda: layer_norm_ref(x, w, bias, 1e-5), two)]
    v = _sz(ctx, 32000, 300)
    s = ctx.randn(_sz(ctx, 4096, 3), v, dtype=torch.float16, scale=3.0)
    cases.append(("softmax", f"{s.shape[0]}x{v} fp16", lambda: softmax(s), lambda: torch.softmax(s, -1),
                  lambda: softmax_ref(s), 2.0 * s.numel() * 2))
    gate, up = ctx.randn(t, f), ctx.randn(t, f)
    cases.append(("swiglu", f"{t}x{f} bf16", lambda: swiglu(gate, up), lambda: F.silu(gate) * up,
                  lambda: swiglu_ref(gate, up), 3.0 * gate.numel() * 2))
    hq, hkv, hd = _sz(ctx, 32, 4), _sz(ctx, 8, 2), _sz(ctx, 128, 16)
    rq, rk = ctx.randn(1, t, hq, hd), ctx.randn(1, t, hkv, hd)
    cos, sin = rope_cos_sin(rope_frequencies(hd, 500000.0)[0].to(ctx.device), t)
    cos, sin = cos.to(ctx.device), sin.to(ctx.device)
    cases.append(("rope", f"{t} tokens {hq}+{hkv} heads D{hd} bf16", lambda: rope(rq, rk, cos, sin),
                  lambda: rope_ref(rq, rk, cos, sin), lambda: rope_ref(rq.float(), rk.float(), cos, sin),
                  2.0 * (rq.numel() + rk.numel()) * 2))
    for name, size, ours, eager, ref, nbytes in cases:
        flat = lambda fn: (lambda: _flat(_tuple(fn())))                                  # noqa: E731
        ctx.close(name, size, flat(ours), flat(ref), baseline=flat(eager), dtype=torch.bfloat16)
        ctx.row(size, f"eager {name}", eager, bytes_moved=nbytes, baseline=True, kernel=name)
        ctx.row(size, name, ours, bytes_moved=nbytes, kernel=name)


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def step_cross_entropy(ctx: Ctx) -> None:
    """The fused linear cross-entropy (forward + backward) against eager ``F.linear`` + ``F.cross_entropy``
    at Llama 3's 128256 vocabulary, 4096 tokens of width 4096, bf16: time and peak memory."""
    import torch.nn.functional as F

    from kernels.model.lm_head import fused_linear_cross_entropy

    n, c, vocab = _sz(ctx, 4096, 7), _sz(ctx, 4096, 32), _sz(ctx, 128256, 300)
    hidden, weight = ctx.randn(n, c, scale=0.5).requires_grad_(), ctx.randn(vocab, c, scale=0.05).requires_grad_()
    target = torch.randint(0, vocab, (n,), device=ctx.device)
    size = f"{n} tokens C{c} V{vocab} bf16"

    def step(loss_fn):
        def run():
            loss = loss_fn()
            return torch.autograd.grad(loss, (hidden, weight))
        return run

    ours = step(lambda: fused_linear_cross_entropy(hidden, weight, target))
    eager = step(lambda: F.cross_entropy(F.linear(hidden, weight).float(), target))
    ref = lambda: F.cross_entropy(F.linear(hidden.float(), weight.float()), target)      # noqa: E731
    ctx.close("fused_linear_cross_entropy (loss)", size, lambda: fused_linear_cross_entropy(hidden, weight, target).float(),
              ref, baseline=lambda: F.cross_entropy(F.linear(hidden, weight), target).float(), dtype=torch.bfloat16)
    ctx.close("fused_linear_cross_entropy (gradients)", size, lambda: _flat(ours()),
              lambda: _flat(_fp32_grads(lambda h, w: F.cross_entropy(F.linear(h, w), target), hidden, weight)),
              baseline=lambda: _flat(eager()),
              dtype=torch.bfloat16)
    flops = 3 * 2.0 * n * c * vocab                                        # logits, dL/dhidden, dL/dweight
    nbytes = 2.0 * (n * c + vocab * c) * 2                                 # read hidden, weight; write their grads
    for impl, fn, base in (("eager linear + cross_entropy", eager, True), ("fused_linear_cross_entropy", ours, False)):
        peak = ctx.peak_memory(fn)
        ctx.row(size, impl, fn, flops=flops, bytes_moved=nbytes, baseline=base, peak_bytes=peak)


def _flat(tensors) -> torch.Tensor:
    """Several results as one flat fp32 tensor, to check them in one comparison."""
    return torch.cat([t.flatten().float() for t in tensors])


def _fp32_grads(loss_fn, *leaves):
    """The gradients of ``loss_fn`` computed in fp32 from fp32 copies of ``leaves`` (the reference)."""
    wide = [t.detach().float().requires_grad_() for t in leaves]
    return torch.autograd.grad(loss_fn(*wide), wide)


def step_quant_gemv(ctx: Ctx) -> None:
    """W8A8, W4A16 (g128) and NF4 (g64) decode GEMVs (one token) against cuBLAS's bf16 GEMV and the copy
    bandwidth: Llama-3-8B's gate/up (14336 x 4096) and Llama-3-70B's (28672 x 8192)."""
    from kernels.quant import intq, nf4
    from kernels.quant.w4a16 import w4a16_matmul, w4a16_matmul_ref
    from kernels.quant.w8a8 import w8a8_matmul, w8a8_matmul_ref

    shapes = _sz(ctx, (("Llama-3-8B gate/up", 14336, 4096), ("Llama-3-70B gate/up", 28672, 8192)),
                 (("toy", 40, 256), ("toy wide", 24, 512)))
    for label, n, k in shapes:
        size = f"{label} decode M1 N{n} K{k}"
        x, w = ctx.randn(1, k, dtype=torch.float16), ctx.randn(n, k, dtype=torch.float32, scale=0.05)
        w16 = w.half()
        ctx.row(size, "torch.matmul fp16 (cuBLAS)", lambda: x @ w16.t(), bytes_moved=2.0 * n * k, flops=2.0 * n * k,
                baseline=True)
        xq, xs = intq.quantize_per_token(x.float())
        wq, ws = intq.quantize_per_channel(w)
        w8 = lambda: w8a8_matmul(xq, wq, xs, ws)                                    # noqa: E731
        ctx.close("w8a8_matmul", size, w8, lambda: w8a8_matmul_ref(xq, wq, xs, ws).float(), dtype=torch.float32)
        ctx.row(size, "w8a8_matmul", w8, bytes_moved=1.0 * n * k, flops=2.0 * n * k)
        s, z = intq.quant_params(w, 4, symmetric=False, granularity="group", group_size=128)
        packed = intq.pack_int4(intq.quantize_ref(w, s, z, 4, False))
        s16, z8 = s.half(), z.to(torch.uint8)
        w4 = lambda: w4a16_matmul(x, packed, s16, z8, 128)                          # noqa: E731
        w4_deq = intq.dequantize_ref(intq.unpack_int4(packed), s16.double(), z8.double()).half()
        ctx.close("w4a16_matmul", size, w4, lambda: w4a16_matmul_ref(x, packed, s16, z8, 128),
                  baseline=lambda: x @ w4_deq.t(), dtype=torch.float16)
        ctx.row(size, "w4a16_matmul g128", w4, bytes_moved=0.5 * n * k + 2.0 * n * k / 128 * 2, flops=2.0 * n * k)
        codes, absmax = nf4.quantize(w, 64)
        npacked = nf4.pack(codes)
        w_nf4 = lambda: nf4.nf4_matmul(x, npacked, absmax, 64)                      # noqa: E731
        nf4_deq = nf4.dequantize(codes, absmax).half()
        ctx.close("nf4_matmul", size, w_nf4, lambda: nf4.nf4_matmul_ref(x, npacked, absmax, 64),
                  baseline=lambda: x @ nf4_deq.t(), dtype=torch.float16)
        ctx.row(size, "nf4_matmul g64", w_nf4, bytes_moved=0.5 * n * k + 4.0 * n * k / 64, flops=2.0 * n * k)


def _routing(ctx, tokens, experts, top_k):
    """Expert offsets (E + 1,) of ``tokens * top_k`` routed rows, the counts drawn at random (a skewed
    but realistic load: a multinomial over a random expert popularity)."""
    g = torch.Generator().manual_seed(ctx.seed)
    popularity = torch.rand(experts, generator=g) + 0.5
    choice = torch.multinomial(popularity, tokens * top_k, replacement=True, generator=g)
    counts = torch.bincount(choice, minlength=experts)
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(ctx.device)


def step_moe(ctx: Ctx) -> None:
    """The MoE grouped GEMM against a per-expert loop of cuBLAS GEMMs (what an unfused MoE layer runs):
    Mixtral's gate+up (8 experts, 4096 -> 28672, top-2) and DeepSeek-V3's down (256 experts,
    2048 -> 7168, top-8), 4096 tokens, bf16."""
    from kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_ref

    configs = _sz(ctx, (("Mixtral gate+up top-2", 8, 4096, 28672, 2), ("DeepSeek-V3 down top-8", 256, 2048, 7168, 8)),
                  (("toy", 4, 32, 48, 2), ("toy many experts", 6, 16, 40, 3)))
    tokens = _sz(ctx, 4096, 9)
    for label, e, k, n, top in configs:
        offsets = _routing(ctx, tokens, e, top)
        m = tokens * top
        a, w = ctx.randn(m, k), ctx.randn(e, k, n, scale=k ** -0.5)
        bounds = offsets.tolist()

        def loop():
            out = a.new_empty(m, n)
            for i in range(e):
                torch.matmul(a[bounds[i]:bounds[i + 1]], w[i], out=out[bounds[i]:bounds[i + 1]])
            return out

        size = f"{label} {tokens} tokens E{e} K{k} N{n}"
        ctx.close("grouped_gemm", size, lambda: grouped_gemm(a, w, offsets), lambda: grouped_gemm_ref(a, w, offsets),
                  baseline=loop)
        counts = dict(flops=2.0 * m * k * n, bytes_moved=2.0 * (m * k + e * k * n + m * n))
        ctx.row(size, "per-expert torch.matmul loop", loop, baseline=True, **counts)
        ctx.row(size, "grouped_gemm", lambda: grouped_gemm(a, w, offsets), **counts)


def step_adamw(ctx: Ctx) -> None:
    """The fused mixed-precision AdamW step against ``torch.optim.AdamW(fused=True)`` on the FP32 master
    plus the bf16 copy, 2**28 parameters; checked once past 2**31 elements (64-bit offsets) on the tail."""
    from kernels.model.adamw import fused_adamw_, fused_bytes_per_param

    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    n = _sz(ctx, 2 ** 28, 1000)
    master = ctx.randn(n, dtype=torch.float32)
    grad = ctx.randn(n).to(torch.bfloat16)
    m, v = ctx.randn(n, dtype=torch.float32, scale=0.1), ctx.randn(n, dtype=torch.float32, scale=0.1).abs()
    weight = master.to(torch.bfloat16)
    ours = lambda: fused_adamw_(weight, grad, master, m, v, step=10, **hp)           # noqa: E731
    p = torch.nn.Parameter(master.clone())
    p.grad = grad.float()
    opt = torch.optim.AdamW([p], **({"fused": True} if ctx.real else {"foreach": False}), **hp)   # fused: CUDA only
    w2 = weight.clone()

    def torch_step():
        opt.step()
        w2.copy_(p.detach())

    _adamw_tail_check(ctx, hp, _sz(ctx, 2 ** 31 + 2 ** 20 + 3, 1500))
    nbytes = float(fused_bytes_per_param()["total"] * n)
    ctx.row(f"{n} parameters", "torch.optim.AdamW(fused=True) + bf16 copy", torch_step, bytes_moved=nbytes,
            baseline=True)
    ctx.row(f"{n} parameters", "fused_adamw_", ours, bytes_moved=nbytes)


def _adamw_tail_check(ctx: Ctx, hp: dict, n: int) -> None:
    """One fused step over ``n`` parameters, its last 2**16 checked against torch.optim.AdamW on them alone
    (the update is elementwise, so the tail's reference needs only the tail)."""
    from kernels.model.adamw import fused_adamw_

    tail = min(n, 2 ** 16)
    size = f"{n} parameters, last {tail} checked"

    def run():
        master = torch.empty(n, device=ctx.device)
        master[-tail:] = ctx.randn(tail, dtype=torch.float32)
        grad = torch.empty(n, device=ctx.device, dtype=torch.bfloat16)
        grad[-tail:] = ctx.randn(tail)
        m = torch.zeros(n, device=ctx.device)
        v = torch.zeros(n, device=ctx.device)
        weight = torch.empty(n, device=ctx.device, dtype=torch.bfloat16)
        p = torch.nn.Parameter(master[-tail:].clone())
        p.grad = grad[-tail:].float()
        torch.optim.AdamW([p], foreach=False, **hp).step()
        fused_adamw_(weight, grad, master, m, v, step=1, **hp)
        assert_close(master[-tail:], p.detach(), name="fused_adamw_ master (tail)")
        del master, grad, m, v, weight
    ctx.check("fused_adamw_ (past 2**31)" if ctx.real else "fused_adamw_ (tail)", size, run)


def step_sampling(ctx: Ctx) -> None:
    """The fused sampler (temperature, top-k, top-p, min-p, one Philox draw) for a decode batch of 64 over
    Llama 3's 128256 vocabulary, and the speculative verify kernel (gamma 4), against the logits' read
    bandwidth and torch's softmax + multinomial (which does less: no top-k, top-p or min-p)."""
    from kernels.serving import sampling as S
    from kernels.speculative import sampling as V

    r, vocab = _sz(ctx, 64, 3), _sz(ctx, 128256, 130)
    logits = ctx.randn(r, vocab, dtype=torch.float32, scale=3.0)
    params = [S.SamplingParams(temperature=0.8, top_k=50 if i % 2 else None, top_p=0.9, min_p=0.05 * (i % 3))
              for i in range(r)]
    t, k, tp, mp = S._row_params(params, ctx.device)
    keys = torch.tensor([S.row_key(7, 0, i) for i in range(r)], dtype=torch.int64, device=ctx.device)
    size = f"R{r} V{vocab} fp32 logits"

    def same_tokens():
        got = S.sample(logits, t, k, tp, mp, keys)
        want = S.sample_ref(*(x.cpu() for x in (logits, t, k, tp, mp, keys)))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), "sample: tokens differ from sample_ref"
    ctx.check("sample", size, same_tokens)
    ctx.row(size, "torch softmax + multinomial", lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1),
            bytes_moved=4.0 * logits.numel(), baseline=True)
    ctx.row(size, "sample (fused)", lambda: S.sample(logits, t, k, tp, mp, keys), bytes_moved=4.0 * logits.numel())
    gamma = 4
    p = torch.softmax(ctx.randn(r, gamma + 1, vocab, dtype=torch.float32, scale=2.0), -1)
    q = torch.softmax(ctx.randn(r, gamma, vocab, dtype=torch.float32, scale=2.0), -1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1).view(r, gamma)
    u = torch.rand(r, gamma, device=ctx.device).clamp(1e-6, 1 - 1e-6)
    vsize = f"B{r} gamma {gamma} V{vocab}"

    def same_verdict():
        got = V.verify(p, q, draft, u, keys)
        want = V.verify_ref(*(x.cpu() for x in (p, q, draft, u, keys)))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), "verify: differs from verify_ref"
    ctx.check("speculative verify", vsize, same_verdict)
    ctx.row(vsize, "verify (fused)", lambda: V.verify(p, q, draft, u, keys), bytes_moved=4.0 * (p.numel() + q.numel()))


def step_cuda_graphs(ctx: Ctx) -> None:
    """The course's GPT decode step for 8 sequences: a captured CUDA graph replay against the same step
    launched eagerly (in the rehearsal, the eager static-buffer step stands in for the capture)."""
    from kernels.model.gpt import load_pretrained
    from kernels.serving.cuda_graphs import DecodeBuffers, GraphedDecodeRunner, decode_step
    from kernels.serving.engine import PagedRunner
    from kernels.serving.kv_cache import PagedKVCache

    model = load_pretrained().to(ctx.device)
    cfg = model.config
    runner = PagedRunner(model, 17, 16)
    runner.cache = PagedKVCache(cfg.n_layer, 17, cfg.n_kv_head, 16, cfg.head_dim, device=ctx.device)
    for pool in runner.cache.k + runner.cache.v:
        pool.copy_(ctx.randn(*pool.shape, dtype=pool.dtype))
    batch = _sz(ctx, 8, 2)
    graphed = GraphedDecodeRunner(runner, (batch,), scratch_page=16, capture=ctx.real)
    ids, pos = list(range(5, 5 + batch)), [3 + 5 * b for b in range(batch)]
    tables = [[(3 * b + j) % 16 for j in range(3)] for b in range(batch)]
    buf = DecodeBuffers.empty(batch, graphed.width, cfg.vocab_size, 16, ctx.device)
    buf.fill(ids, pos, tables, 16)

    def eager():
        with torch.no_grad():
            return decode_step(model, runner.cache, buf)

    size = f"tiny GPT ({cfg.n_layer} layers) decode, batch {batch}"
    ctx.close("cuda graph replay", size, lambda: graphed.replay(ids, pos, tables), eager, dtype=torch.float32)
    graph = graphed.graphs[batch]
    ctx.row(size, "eager decode step", eager, baseline=True)
    ctx.row(size, "CUDA graph replay" if ctx.real else "eager static step (rehearsal)", graph.replay)


CHAIN_LENGTHS = (16, 64, 256)


def step_graph_chain(ctx: Ctx) -> None:
    """kernels/cuda/graph_chain.cu, built for this GPU: chains of N tiny kernels launched one by one and
    as one captured CUDA graph, the program's own host clock (mean over 200 chains), same bits checked. In
    the rehearsal the program is built and linked for sm90 (it cannot run without a GPU) and a chain of N
    in-place torch ops on the CPU stands in for its rows."""
    from kernels.serving.cuda_graphs import build_chain_program, parse_chain_line, run_chain_program

    cap = torch.cuda.get_device_capability() if ctx.real else (9, 0)
    exe = build_chain_program(arch=f"sm{cap[0]}{cap[1]}")
    for n in CHAIN_LENGTHS:
        case = f"chain of {n} kernels, x <- a x + b on 256 floats"
        if ctx.real:
            res = run_chain_program(exe, kernels=n, reps=200)
            ctx.check("graph chain", case, lambda res=res, n=n: _chain_ok(res, n))
            timer = "graph_chain's host clock around a stream synchronize, mean of 200 chains"
            eager_us, graph_us = res["eager_us_per_chain"], res["graph_us_per_chain"]
        else:
            res = parse_chain_line(f"kernels {n} nodes {n} reps 1 eager_us_per_chain 0 graph_us_per_chain 0 same 1")
            ctx.check("graph chain (built, not run)", case, lambda res=res, n=n: _chain_ok(res, n))
            x = torch.zeros(256)
            start = time.perf_counter()
            for k in range(n):
                x.mul_(1.0 - 1e-3 * (k % 7)).add_(1e-2 * (k % 5))
            eager_us = graph_us = (time.perf_counter() - start) * 1e6
            timer = "REHEARSAL: wall clock of n CPU torch ops, not the program"
        rows = (("eager launches", eager_us, True), ("one CUDA graph launch", graph_us, False))
        for impl, us, base in rows:
            ctx.measured(case, impl, us / 1e3, baseline=base, timer=timer, kernels=n, us_per_kernel=us / n)


def _chain_ok(res: dict, n: int) -> None:
    assert res["same"] == 1, "the graph's result differs from the eager chain's"
    assert res["nodes"] == n and res["kernels"] == n, f"expected {n} nodes, got {res['nodes']}"


# ---------------------------------------------------------------------------------------------------
# The native test pass.

GPU_ONLY_MARKS = ("mark.gpu", "on_gpu", "cuda.is_available")
# Test files with nothing for a GPU to check: the tooling (environment pins, notebooks, labs, the site, the
# compiler page's ~200 CPU compiles), the server soak, and this run's own CPU rehearsal.
NOT_NATIVE = {"test_environment.py", "test_notebooks.py", "test_labs.py", "test_site.py", "test_compiler_page.py",
              "test_server_soak.py", "test_gpu_rehearsal.py"}


def test_files() -> list[Path]:
    """The test files the native pass runs: ``tests/test_*.py`` but :data:`NOT_NATIVE`, those with GPU-only
    tests first (nothing else ever runs them), so the time cap cuts the others first."""
    files = sorted(p for p in (ROOT / "tests").glob("test_*.py") if p.name not in NOT_NATIVE)
    return sorted(files, key=lambda p: not any(m in p.read_text() for m in GPU_ONLY_MARKS))


def pytest_command(path: Path, junit: Path) -> list[str]:
    """pytest on one file with the GPU-only tests enabled (they run wherever a GPU is), notebooks and
    the book build left out; the course's addopts (nbval) are replaced."""
    return [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-p", "no:nbval", "-p",
            "no:xdist", "-o", "addopts=", "-m", "not slow", f"--junitxml={junit}"]


def junit_results(path: Path) -> dict:
    """{"passed", "failed", "skipped", "failures": [{"test", "error"}]} from a junit XML report."""
    root = ET.parse(path).getroot()
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            out["failed"] += 1
            text = "\n".join(t for t in (bad.get("message"), bad.text) if t)       # collection errors: in the text
            out["failures"].append({"test": case.get("name"), "error": text[:1500]})
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def run_tests(ctx: Ctx, files: list[Path] | None = None, *, cap_s: float = TESTS_CAP_S,
              workers: int = TEST_WORKERS, tmp: Path | None = None, root: Path = ROOT) -> None:
    """Each test file in its own pytest process started in ``root``, ``workers`` at a time, until ``cap_s``:
    one check per file."""
    import tempfile

    files = test_files() if files is None else files
    missing = [m for m in TEST_NEEDS if importlib_missing(m)]
    if missing:
        ctx.checks.append({"kernel": "tests/", "size": "native", "ok": False,
                           "error": f"not run: {', '.join(missing)} not installed in this interpreter (pytest and what "
                                    "conftest.py imports); the real-size checks of the benchmark steps still run"})
        return
    tmp = Path(tmp or tempfile.mkdtemp(prefix="gpu-tests-"))
    deadline = time.monotonic() + cap_s
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def one(path: Path) -> dict:
        left = deadline - time.monotonic()
        entry = {"kernel": f"tests/{path.name}", "size": "test sizes"}
        if left <= 1:
            return {**entry, "ok": False, "error": f"not run: the {cap_s:.0f} s cap of the test pass was reached"}
        junit = tmp / f"{path.stem}.xml"
        try:
            proc = subprocess.run(pytest_command(path, junit), cwd=root, env=env, capture_output=True, text=True,
                                  timeout=left)
        except subprocess.TimeoutExpired:
            return {**entry, "ok": False, "error": f"not finished: cut off at the {cap_s:.0f} s cap"}
        if not junit.is_file():
            return {**entry, "ok": False, "error": f"pytest exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
        res = junit_results(junit)
        missing = {m for f in res["failures"] for m in re.findall(r"No module named '([\w.]+)'", f["error"])}
        if missing and all("No module named" in f["error"] for f in res["failures"]):
            return {**entry, "ok": False, "error": f"not run: needs {', '.join(sorted(missing))} (not installed here)"}
        ok = proc.returncode in (0, 5) and res["failed"] == 0            # 5: every test deselected
        return {**entry, "ok": ok, **res}

    with ThreadPoolExecutor(workers) as pool:
        ctx.checks.extend(pool.map(one, files))


TEST_NEEDS = ("pytest", "hypothesis", "nbformat", "nbclient")     # pytest, and conftest.py's imports


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


# ---------------------------------------------------------------------------------------------------
# The plan: one table drives both the run and `make gpu-plan`.

@dataclass(frozen=True)
class Step:
    """One step of the run: its group (one JSON file), the real size, the distinct kernel compilations it
    triggers and its timed rows (the two costs of a step on a GPU), and the function that runs it."""

    name: str
    group: str
    size: str
    compiles: int
    rows: int
    run: Callable[[Ctx], None]
    extra_s: float = 0.0          # references, allocation and set-up beyond compiles and rows
    min_capability: tuple[int, int] | None = None

    @property
    def estimate_s(self) -> float:
        return self.compiles * COMPILE_S + self.rows * ROW_S + self.extra_s


STEPS = (
    Step("ceilings", "ceilings", "D2D copy 1 GiB; cuBLAS bf16 8192^3", 0, 2, step_ceilings, 2.0),
    Step("gemm", "gemm", "ladder + cuBLAS, 4096^3 and 8192^3, fp16/bf16", 8, 16, step_gemm, 8.0),
    Step("fp8 gemm", "gemm", "fp8_matmul vs torch._scaled_mm, 4096^3 and 8192^3", 2, 4, step_fp8_gemm, 3.0, (8, 9)),
    Step("flash forward", "attention", "B*N=16k, H32 D128, N 4k/16k, causal/full: FA2, FA3, SDPA flash/cuDNN", 8, 16,
         step_flash_forward, 6.0, (8, 0)),
    Step("flash backward", "attention", "same shapes: FA2 backward vs SDPA flash/cuDNN backward", 8, 12,
         step_flash_backward, 8.0),
    Step("decode", "decode", "Llama-3-70B heads 64/8 D128, B8 at 32k: flash_decode, paged, SDPA; B1 at 32k: "
         "split vs one pass", 7, 5,
         step_decode, 6.0),
    Step("mla decode", "decode", "DeepSeek-V3 128 heads, 512+64 latent, B8 at 32k, page 64", 3, 1, step_mla, 4.0),
    Step("row kernels", "rows", "16k tokens x 4096 (14336 for SwiGLU), softmax 4096x32000, RoPE 32+8 heads", 6, 10,
         step_rows, 4.0),
    Step("fused linear cross-entropy", "rows", "4096 tokens, C4096, V128256, bf16, fwd+bwd, peak memory", 3, 2,
         step_cross_entropy, 4.0),
    Step("quantized GEMVs", "quant", "W8A8, W4A16 g128, NF4 g64 at 14336x4096 and 28672x8192, M=1", 6, 8,
         step_quant_gemv, 6.0),
    Step("moe grouped gemm", "moe", "Mixtral 8x(4096->28672) top-2, DeepSeek-V3 256x(2048->7168) top-8, 4096 tokens",
         4, 4, step_moe, 6.0),
    Step("adamw", "optimizer", "2**28 params timed; one step past 2**31 checked", 1, 2, step_adamw, 10.0),
    Step("sampling", "sampling", "64 x 128256 sampler; verify gamma 4", 2, 3, step_sampling, 6.0),
    Step("cuda graphs", "cuda_graphs", "tiny GPT decode step, batch 8", 0, 2, step_cuda_graphs, 5.0),
    Step("graph chain", "cuda_graphs", "graph_chain.cu: 16, 64, 256 kernels eager vs one graph, 200 chains each",
         0, 6, step_graph_chain, 12.0),
)


def plan_text(steps=STEPS) -> str:
    """Every step with its size and estimated compile and run time, and the total against the budget."""
    lines = [f"{'step':28s} {'compiles':>8s} {'~compile s':>10s} {'rows':>5s} {'~run s':>7s}  size"]
    bench_s = 0.0
    for s in steps:
        bench_s += s.estimate_s
        lines.append(f"{s.name:28s} {s.compiles:8d} {s.compiles * COMPILE_S:10.0f} {s.rows:5d} "
                     f"{s.rows * ROW_S + s.extra_s:7.0f}  {s.size}")
    total = STARTUP_S + TESTS_CAP_S + bench_s
    lines += [
        "",
        f"start-up (imports, CUDA context, provenance)       {STARTUP_S:5.0f} s",
        f"native tests: {len(test_files())} files, {TEST_WORKERS} pytest processes, hard cap  {TESTS_CAP_S:5.0f} s",
        f"benchmarks: {sum(s.compiles for s in steps)} compiles x {COMPILE_S:.0f} s + "
        f"{sum(s.rows for s in steps)} rows x {ROW_S} s + set-up           {bench_s:5.0f} s",
        f"TOTAL                                              {total:5.0f} s of a {BUDGET_S:.0f} s budget "
        f"({'fits' if total <= BUDGET_S else 'OVER BUDGET'})",
        "",
        "Reasoning: a Triton kernel compiles once per distinct (constexprs, dtypes, 16-divisibility); every",
        "real size is a multiple of 16, so 4096 and 8192 share one compilation and the count above is per",
        "kernel variant, not per row. The run's process compiles one kernel at a time: ahead-of-time compiles",
        "for sm90 on this course's CPU machine take 0.5-1 CPU-s each for the small kernels, and",
        f"{COMPILE_S:.0f} s allows for the attention backward's larger ones. A do_bench row is its 25 ms",
        f"warm-up, 5 estimation calls and 100 ms of repetitions, about {ROW_S} s with L2 flushes; the",
        "set-up seconds are the fp32 references of the real-size checks and the allocation of inputs.",
        f"The test pass is not estimated but capped: files still running at {TESTS_CAP_S:.0f} s are reported",
        "as not finished, never as passed.",
    ]
    return "\n".join(lines)


def applicable(step: Step, ctx: Ctx) -> str | None:
    """Why a step cannot run on this device (None when it can): an architecture it needs."""
    if ctx.real and step.min_capability and torch.cuda.get_device_capability() < step.min_capability:
        cap = torch.cuda.get_device_capability()
        return f"needs sm{step.min_capability[0]}{step.min_capability[1]}+, this GPU is sm{cap[0]}{cap[1]}"
    return None


def context_usable(ctx: Ctx) -> bool:
    """Whether the device still runs work after a step failed. A sticky CUDA error (an illegal address,
    a trap in a kernel) poisons the process's context, and every later launch in it fails too."""
    if not ctx.real:
        return True
    try:
        torch.ones(8, device=ctx.device).sum().item()
        torch.cuda.synchronize()
        return True
    except Exception:                                                 # noqa: BLE001
        return False


def run_rest_in_fresh_process(ctx: Ctx, names: list[str], *, rehearse: bool) -> dict[str, dict]:
    """Run the steps ``names`` in a new process (a fresh CUDA context) with this run's measured ceilings,
    and return its groups. How the run survives a step that poisoned the context."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "groups.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--no-tests", "--groups-json", str(out),
               "--ceilings", json.dumps(ctx.ceilings), "--steps", *names] + (["--rehearse"] if rehearse else [])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(proc.stdout[proc.stdout.find("benchmarks:"):].rstrip(), flush=True)
        if proc.returncode != 0 or not out.is_file():
            return {"errors": {"rows": [], "checks": [], "seconds": {},
                               "errors": [{"step": ", ".join(names), "error": "the fresh process failed: "
                                           + _error_text(RuntimeError(proc.stderr[-1500:]))}]}}
        return json.loads(out.read_text())


def merge_groups(groups: dict[str, dict], more: dict[str, dict]) -> dict[str, dict]:
    """``groups`` with the rows, checks, errors and step seconds of ``more`` appended, group by group."""
    for name, g in more.items():
        mine = groups.setdefault(name, {"rows": [], "checks": [], "errors": [], "seconds": {}})
        for key in ("rows", "checks", "errors"):
            mine[key] += g.get(key, [])
        mine["seconds"].update(g.get("seconds", {}))
    return groups


def run_steps(ctx: Ctx, steps=STEPS, *, rehearse: bool = False) -> dict[str, dict]:
    """Run every step; each group's rows, checks and errors (a failing step never stops the run: where it
    left the CUDA context unusable, the steps after it run in a fresh process)."""
    groups: dict[str, dict] = {}
    for i, step in enumerate(steps):
        g = groups.setdefault(step.group, {"rows": [], "checks": [], "errors": [], "seconds": {}})
        reason = applicable(step, ctx)
        start = time.perf_counter()
        ctx.rows, ctx.checks = [], []
        if reason:
            g["errors"].append({"step": step.name, "skipped": reason})
        else:
            try:
                step.run(ctx)
            except Exception as exc:                                  # noqa: BLE001
                g["errors"].append({"step": step.name, "error": _error_text(exc),
                                    "traceback": traceback.format_exc(limit=6)[-3000:]})
                if not context_usable(ctx):
                    rest = [s.name for s in steps[i + 1:]]
                    g["errors"].append({"step": step.name, "error": f"the CUDA context was lost; {len(rest)} "
                                        "later steps ran in a fresh process"})
                    g["rows"] += add_ratios(ctx.rows)
                    g["checks"] += ctx.checks
                    g["seconds"][step.name] = round(time.perf_counter() - start, 2)
                    return merge_groups(groups, run_rest_in_fresh_process(ctx, rest, rehearse=rehearse)) if rest else groups
        g["rows"] += add_ratios(ctx.rows)
        g["checks"] += ctx.checks
        g["seconds"][step.name] = round(time.perf_counter() - start, 2)
        print(f"  {step.name:28s} {g['seconds'][step.name]:7.1f} s  "
              f"{sum(c['ok'] for c in ctx.checks)}/{len(ctx.checks)} checks passed, {len(ctx.rows)} rows"
              + (f"  [{reason}]" if reason else "") + (f"  [error: {g['errors'][-1]['error'][:120]}]"
                                                       if g["errors"] and g["errors"][-1].get("step") == step.name
                                                       and "error" in g["errors"][-1] else ""), flush=True)
        if ctx.real:
            torch.cuda.empty_cache()
    return groups


SYSTEM_CUDA_BIN = Path("/usr/local/cuda/bin")


def use_system_nvcc() -> None:
    """Put the system CUDA toolkit's bin/ on PATH when no nvcc is found otherwise, so the CUDA C++ kernels
    (``kernels.inspect.tool``: the pip copy first, then PATH) build with it on a machine without the pip one."""
    from kernels import inspect as ki

    try:
        ki.tool("nvcc")
    except ki.ToolMissingError:
        if (SYSTEM_CUDA_BIN / "nvcc").is_file():
            os.environ["PATH"] = f"{SYSTEM_CUDA_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def versions() -> dict:
    """Device, driver, torch, triton, CUDA and nvcc versions (``kernels.bench.provenance`` plus nvcc)."""
    from kernels import inspect as ki

    info = bench.provenance(bench.command_line())
    try:
        nvcc = ki.tool("nvcc")
    except ki.ToolMissingError:
        nvcc = None
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        info["nvcc"] = f"{out[-1] if out else 'unknown'} ({nvcc})"
    else:
        info["nvcc"] = "absent"
    return info


def version_problem(info: dict) -> str | None:
    """Why this torch/triton is older than the run supports (None when new enough)."""
    if _version(info["torch"]) < MIN_TORCH or _version(info["triton"]) < MIN_TRITON:
        return (f"torch >= {'.'.join(map(str, MIN_TORCH))} and triton >= {'.'.join(map(str, MIN_TRITON))} are "
                f"needed, found torch {info['torch']} and triton {info['triton']}")
    return None


def write_results(groups: dict, info: dict, out: Path, *, rehearsal: bool) -> list[Path]:
    """One JSON per group in ``out`` (``kernels.bench.load`` reads them): provenance, rows, checks, errors."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, g in groups.items():
        data = {"name": name, "provenance": {**info, "ceilings": g.get("ceilings")}, **g}
        if rehearsal:
            data["provenance"]["note"] = REHEARSAL_NOTE
        path = out / f"{name}.json"
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")
        paths.append(path)
    return paths


def _compute_bound(row: dict, ceilings: dict) -> bool:
    """Whether the row's FLOPs per byte lie past the measured ridge point (cuBLAS FLOP/s over copy B/s)."""
    if not row.get("flops") or not row.get("bytes") or not ceilings.get("copy_gbs"):
        return False
    ridge = ceilings["gemm_tflops"] * 1e12 / (ceilings["copy_gbs"] * 1e9)
    return row["flops"] / row["bytes"] > ridge


def _cell(row: dict, ceilings: dict) -> str:
    """One row as ``impl median ms (p20-p80 spread) ratio-to-library fraction-of-ceiling``."""
    if "ms" not in row:
        return f"{row['impl']} ERROR"
    ceil = row.get("of_cublas_peak") if _compute_bound(row, ceilings) else row.get("of_copy_bw")
    return (f"{row['impl']} {row['ms']:.3g} ms ±{(row['ms_p80'] - row['ms_p20']) / 2:.1g}"
            + (f" {row['vs_baseline']:.2f}x" if "vs_baseline" in row else "")
            + (f" {ceil:.0%}" if ceil is not None else ""))


def summary(groups: dict) -> str:
    """One screen: a line per case (its rows: median and half the p20-p80 spread, the ratio to the library
    baseline, the first row of a case being the baseline, and the fraction of the measured ceiling the row
    is bound by), then the checks that failed or did not run, and the steps that errored or were skipped."""
    ceilings = next((g.get("ceilings") or {} for g in groups.values()), {})
    lines = ["group       case                                 rows: impl median ±spread, x library speed, % of ceiling"]
    for name, g in groups.items():
        cases: dict[str, list] = {}
        for r in g["rows"]:
            cases.setdefault(str(r["case"]), []).append(r)
        for case, rows in cases.items():
            rows = sorted(rows, key=lambda r: not r.get("baseline"))
            lines.append(f"{name:11s} {case[:36]:36s} " + " | ".join(_cell(r, ceilings) for r in rows))
    checks = [c for g in groups.values() for c in g["checks"]]
    failed = [c for c in checks if not c["ok"]]
    lines.append(f"checks: {len(checks) - len(failed)} of {len(checks)} passed")
    lines += [f"  {'NOT RUN' if str(c.get('error', '')).startswith('not ') else 'FAILED'} {c['kernel']} "
              f"[{c['size']}]: {str(c.get('error', c.get('failures', '')))[:150]}" for c in failed]
    errors = [(n, e) for n, g in groups.items() for e in g["errors"]]
    lines += [f"  step {e['step']}: {e.get('skipped') or e.get('error', '')[:150]}" for _, e in errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory for one JSON per group (e.g. benchmarks/results/<date>)")
    parser.add_argument("--plan", action="store_true", help="print the steps and their estimates; run nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every step at a toy size through the interpreter on the CPU (not performance)")
    parser.add_argument("--steps", nargs="*", help="run only these steps (names from --plan)")
    parser.add_argument("--no-tests", action="store_true", help="skip the native pytest pass")
    parser.add_argument("--ceilings", type=json.loads, help=argparse.SUPPRESS)       # from a parent run
    parser.add_argument("--groups-json", type=Path, help=argparse.SUPPRESS)          # where a child run reports
    args = parser.parse_args(argv)
    unknown = sorted(set(args.steps or ()) - {s.name for s in STEPS})
    if unknown:
        parser.error(f"--steps: no step named {', '.join(map(repr, unknown))}; `--plan` lists them")
    if args.plan:
        print(plan_text())
        return 0
    steps = [s for s in STEPS if not args.steps or s.name in args.steps]
    rt = runtime.runtime()
    if not args.rehearse and not rt.on_gpu:
        print("benchmarks.gpu: no CUDA GPU here (torch.cuda.is_available() is False, or TRITON_INTERPRET=1): "
              "this run measures kernels on a GPU and refuses to time the interpreter. "
              "`make gpu-plan` shows what it would run; `--rehearse` runs it at toy sizes on the CPU.", file=sys.stderr)
        return 2
    use_system_nvcc()
    info = versions()
    for key in ("device", "capability", "driver", "torch", "triton", "cuda", "nvcc", "python", "date"):
        print(f"{key:10s} {info.get(key, '-')}")
    if rt.on_gpu and (problem := version_problem(info)):
        print(f"benchmarks.gpu: {problem}", file=sys.stderr)
        return 2
    if args.rehearse:
        print(REHEARSAL_NOTE)
    ctx = Ctx(real=not args.rehearse, device=rt.device, ceilings=dict(args.ceilings or {}))
    if args.ceilings:                      # a child run: the parent measured the ceilings already
        steps = [s for s in steps if s.name != "ceilings"]
    groups = {}
    if not args.no_tests and not args.rehearse:
        print(f"native tests (cap {TESTS_CAP_S:.0f} s):", flush=True)
        start = time.perf_counter()
        run_tests(ctx)
        groups["tests"] = {"rows": [], "checks": ctx.checks, "errors": [],
                           "seconds": {"tests": round(time.perf_counter() - start, 1)}}
        ctx.checks = []
    print("benchmarks:", flush=True)
    merge_groups(groups, run_steps(ctx, steps, rehearse=args.rehearse))
    for g in groups.values():
        g["ceilings"] = dict(ctx.ceilings)
    if args.groups_json:
        args.groups_json.write_text(json.dumps(groups, default=str))
        return 0
    if args.out:
        for path in write_results(groups, info, args.out, rehearsal=args.rehearse):
            print(f"wrote {path}")
    print(summary(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
