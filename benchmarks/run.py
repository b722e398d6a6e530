"""Run a named GPU benchmark and record it: ``python -m benchmarks.run matmul``.

Each benchmark times a kernel and its PyTorch counterpart with ``kernels.bench.time_ms`` and writes
``benchmarks/results/<name>.json`` with the provenance ``kernels.bench.record`` adds. Every row
carries the minimum bytes and FLOPs of the pass, what the run achieved (GB/s, TFLOP/s) and the
fraction of the roofline of ``kernels.gpu.hardware`` it reached, when the table describes the GPU
it ran on (``hardware.identify``), so the first GPU run yields ratios, not just times. On a machine
without a GPU it refuses: interpreter timings are not kernel performance.
"""
from __future__ import annotations

import argparse
import sys

import kernels  # noqa: F401  (device choice before triton is imported)
import torch

from kernels import bench, runtime
from kernels.gpu import hardware, roofline

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}


def _timed(impl: str, fn, *, bytes_moved: float, flops: float = 0.0, dtype: torch.dtype, **config) -> dict:
    """One row: the median and (20%, 80%) quantiles of ``fn``'s time, and, on a GPU the hardware
    table describes, the achieved rates and the fraction of the roofline (see roofline.achieved)."""
    median, lo, hi = bench.time_ms(fn)
    row = {"impl": impl, **config, "dtype": str(dtype).removeprefix("torch."), "ms": median, "ms_p20": lo,
           "ms_p80": hi, "bytes": bytes_moved, "flops": flops,
           "gbs": bytes_moved / (median * 1e-3) / 1e9, "tflops": flops / (median * 1e-3) / 1e12}
    gpu = hardware.identify(torch.cuda.get_device_name())
    if gpu is not None:
        row.update(roofline.achieved(gpu, ms=median, bytes_moved=bytes_moved, flops=flops,
                                     dtype=_DTYPE_NAMES[dtype]))
    return row


def matmul() -> list[dict]:
    from kernels.gemm.matmul import matmul as triton_matmul

    rows = []
    for n in (1024, 2048, 4096, 8192):
        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        flops, nbytes = roofline.matmul_counts(n, n, n, a.element_size())
        for impl, fn in (("triton-tiled-64", lambda: triton_matmul(a, b)), ("torch.matmul", lambda: a @ b)):
            rows.append(_timed(impl, fn, bytes_moved=nbytes, flops=flops, dtype=a.dtype, M=n, N=n, K=n))
    return rows


GEMM_SIZES = (4096, 8192)
GEMM_STEPS = ("naive", "tiled", "grouped", "persistent", "torch.matmul")


def gemm_plan(sizes=GEMM_SIZES) -> list[tuple[str, str, int]]:
    """(impl, dtype, n) for every timed GEMM: each ladder step and cuBLAS in fp16 and bf16, the FP8
    kernel and cuBLAS's FP8 (torch._scaled_mm) in fp8. The naive step only at the smaller size (at
    8192^3 it runs for tens of seconds per call); the tiled step (kernels.gemm.matmul) has no bf16."""
    plan = []
    for n in sizes:
        for dtype in ("fp16", "bf16"):
            plan += [(step, dtype, n) for step in GEMM_STEPS
                     if not (step == "naive" and n > min(sizes)) and not (step == "tiled" and dtype == "bf16")]
        plan += [("fp8_matmul", "fp8", n), ("torch._scaled_mm", "fp8", n)]
    return plan


def add_cublas_fraction(rows: list[dict]) -> list[dict]:
    """Each row's time as a fraction of cuBLAS's at the same size and dtype: cublas_ms / ms."""
    cublas = {(r["M"], r["dtype"]): r["ms"] for r in rows if r["impl"] in ("torch.matmul", "torch._scaled_mm")}
    for r in rows:
        base = cublas.get((r["M"], r["dtype"]))
        r["fraction_of_cublas"] = base / r["ms"] if base else None
    return rows


def gemm() -> list[dict]:
    """The GEMM ladder (kernels.gemm) and the FP8 GEMM (kernels.quant.fp8) against cuBLAS at 4096^3 and
    8192^3: times, TFLOP/s, fraction of the hardware peak (roofline.achieved) and of cuBLAS."""
    from kernels.gemm import ladder, persistent
    from kernels.gemm.matmul import matmul as tiled
    from kernels.quant import fp8

    torch_dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    rows = []
    for impl, dtype, n in gemm_plan():
        a = torch.randn(n, n, device="cuda")
        b = torch.randn(n, n, device="cuda")
        if dtype == "fp8":
            (aq, sa), (bq, sb) = fp8.quantize_current(a), fp8.quantize_current(b)
            bq_t = bq.t().contiguous().t()                    # cuBLAS's FP8 wants B column-major
            fns = {"fp8_matmul": lambda: fp8.fp8_matmul(aq, bq, sa, sb, out_dtype=torch.bfloat16),
                   "torch._scaled_mm": lambda: torch._scaled_mm(aq, bq_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
        else:
            a, b = a.to(torch_dtypes[dtype]), b.to(torch_dtypes[dtype])
            fns = {"naive": lambda: ladder.matmul_naive(a, b), "tiled": lambda: tiled(a, b, block_m=128, block_n=128, block_k=64),
                   "grouped": lambda: ladder.matmul(a, b), "persistent": lambda: persistent.matmul_persistent(a, b),
                   "torch.matmul": lambda: a @ b}
        flops, nbytes = roofline.matmul_counts(n, n, n, 1 if dtype == "fp8" else 2)
        rows.append(_timed(impl, fns[impl], bytes_moved=nbytes, flops=flops, dtype=torch_dtypes[dtype], M=n, N=n, K=n))
    return add_cublas_fraction(rows)


def flash_attention() -> list[dict]:
    """FlashAttention forward (kernels.attention.flash_attention) against SDPA's flash backend, fp16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.attention import flash_attention as triton_flash

    rows = []
    for causal in (False, True):
        for d in (64, 128):
            for n in (1024, 2048, 4096, 8192):
                b, h = 16384 // n, 16
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))

                def sdpa():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)   # QK^T and PV, 2 FLOP per MAC
                nbytes = 4 * b * h * n * d * q.element_size()                 # Q, K, V read once, O written once
                for impl, fn in (("triton-flash-v2", lambda: triton_flash(q, k, v, causal)), ("sdpa-flash", sdpa)):
                    rows.append(_timed(impl, fn, bytes_moved=nbytes, flops=flops, dtype=q.dtype,
                                       B=b, H=h, N=n, D=d, causal=causal, **{"pass": "forward"}))
    return rows


def flash_decode() -> list[dict]:
    """Split-K decode (kernels.attention.flash_decode) against decode_attention's single pass
    (num_splits=1), fp16, Llama-2-70B's attention shape (64 query heads, 8 K/V heads, d = 128)."""
    from kernels.attention import choose_num_splits, decode_attention
    from kernels.attention import flash_decode as split_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in (1, 8, 64):
        for length in (4096, 16384, 65536):
            q = torch.randn(batch, 64, 128, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.float16) for _ in range(2))
            lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
            splits = choose_num_splits(batch, 8, length, sms)
            nbytes = 2 * batch * 8 * length * 128 * k.element_size()     # the K and V cache, read once
            flops = 4 * batch * 64 * length * 128                          # q.k and p.v for every query head
            for impl, fn in ((f"flash_decode-{splits}-splits", lambda: split_decode(q, k, v, lens, splits)),
                             ("decode_attention-1-pass", lambda: decode_attention(q, k, v, lens, num_splits=1))):
                rows.append(_timed(impl, fn, bytes_moved=nbytes, flops=flops, dtype=q.dtype,
                                   B=batch, Hq=64, Hkv=8, L=length, D=128))
    return rows


def memory_copy() -> list[dict]:
    """The memory chapter's copy kernel against torch's clone, at three sizes."""
    from kernels.gpu.copy import bench_copy

    return bench_copy(record=False)


def _row_bench(impls, shape, dtype, counts: tuple[float, float]) -> list[dict]:
    """Time each (name, fn) of a forward pass against the (FLOPs, bytes) the pass must do at least."""
    flops, nbytes = counts
    return [_timed(impl, fn, bytes_moved=nbytes, flops=flops, dtype=dtype, shape=list(shape), **{"pass": "forward"})
            for impl, fn in impls]


def softmax() -> list[dict]:
    """kernels.softmax.softmax (one block per row up to 4096, online beyond) against torch.softmax, fp16;
    GB/s counts the minimum traffic, one read and one write per element."""
    from kernels.softmax import softmax as triton_softmax

    rows = []
    for n in (1024, 4096, 8192, 32000):
        x = torch.randn(16384 * 1024 // n, n, device="cuda", dtype=torch.float16)
        rows += _row_bench((("triton", lambda: triton_softmax(x)), ("torch.softmax", lambda: torch.softmax(x, -1))),
                           x.shape, x.dtype, roofline.softmax_counts(*x.shape, x.element_size()))
    return rows


def norms() -> list[dict]:
    """kernels.norm rms_norm and layer_norm forward against torch.nn.functional, bf16, LLaMA widths."""
    import torch.nn.functional as F

    from kernels.norm import layer_norm, rms_norm

    rows = []
    for d in (2048, 4096, 8192):
        x = torch.randn(16384, d, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(d, device="cuda", dtype=torch.bfloat16), torch.randn(d, device="cuda", dtype=torch.bfloat16)
        counts = roofline.rmsnorm_counts(*x.shape, x.element_size())   # LayerNorm: the same bytes, a few more FLOPs
        rows += _row_bench((("triton rms_norm", lambda: rms_norm(x, w, 1e-6)),
                            ("F.rms_norm", lambda: F.rms_norm(x, (d,), w, 1e-6)),
                            ("triton layer_norm", lambda: layer_norm(x, w, b, 1e-5)),
                            ("F.layer_norm", lambda: F.layer_norm(x, (d,), w, b, 1e-5))),
                           x.shape, x.dtype, counts)
    return rows


def gated_mlp() -> list[dict]:
    """kernels.mlp.swiglu against F.silu(gate) * up, bf16, LLaMA-7B's hidden width; GB/s counts 3 tensors."""
    import torch.nn.functional as F

    from kernels.mlp.gated import swiglu

    rows = []
    for tokens in (2048, 8192, 32768):
        gate, up = (torch.randn(tokens, 11008, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        rows += _row_bench((("triton swiglu", lambda: swiglu(gate, up)), ("F.silu(gate) * up", lambda: F.silu(gate) * up)),
                           gate.shape, gate.dtype,
                           # silu(g) * u: about 4 FLOP per element (exp, add, divide, multiply); gate, up, h
                           (4.0 * gate.numel(), 3.0 * gate.numel() * gate.element_size()))
    return rows


BENCHMARKS = {
    "softmax": softmax,
    "norms": norms,
    "gated-mlp": gated_mlp,
    "matmul": matmul,
    "gemm": gemm,
    "memory-copy": memory_copy,
    "flash_attention": flash_attention,
    "flash_decode": flash_decode,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("names", nargs="+", choices=sorted(BENCHMARKS))
    args = parser.parse_args(argv)
    if not runtime.runtime().on_gpu:
        print("no CUDA GPU here: benchmarks run only on a GPU (interpreter timings are not performance)", file=sys.stderr)
        return 2
    for name in args.names:
        path = bench.record(name, BENCHMARKS[name](), command=bench.command_line())
        print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
