"""The row kernels (softmax, LayerNorm, RMSNorm, add+RMSNorm) and the GLU kernels compiled ahead of
time for sm_90a at the widths of real models. The row kernels' jobs are their launches (each module's
``launch_jobs`` builds the launcher's own arguments on meta tensors with the launch
:func:`kernels.rows.row_launch` decides, and :func:`kernels.inspect.launch_job` specialises them as
Triton's binder does on a GPU): no register spills, and row offsets computed in 64 bits. One compile
for the whole file (about 45 s).

Widths: 4096 (LLaMA-7B), 8192 (Llama 2/3 70B), 16384 (Llama 3 405B), and 65536 for the tiled path.
"""
from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import kernels  # noqa: F401  (before triton)
import pytest
import torch
import triton
import triton.language as tl

from kernels.inspect import TritonJob, compile_triton_many, launch_job
from kernels.rows import BACKWARD, FORWARD, SOFTMAX, RowLaunch, row_launch

softmax_mod = importlib.import_module("kernels.softmax.online")
ln_mod = importlib.import_module("kernels.norm.layer_norm")
rms_mod = importlib.import_module("kernels.norm.rms_norm")
arn_mod = importlib.import_module("kernels.norm.add_rms_norm")
glu_mod = importlib.import_module("kernels.mlp.gated")

WIDTHS = (4096, 8192, 16384)
ROW_MODULES = (softmax_mod, ln_mod, rms_mod, arn_mod)




@triton.jit
def _add_rms_norm_int32_rows_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr,
    n_rows, n, stride_x, stride_r, stride_h, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    """The add+RMSNorm forward as it was: rows in int32, so rows * stride wraps past 2**31."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)          # BROKEN: int32
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / n + eps)
    y = hf * rstd[:, None] * tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


def _cases() -> list[tuple[str, TritonJob]]:
    cases = []
    for mod in ROW_MODULES:
        for n in WIDTHS:
            cases += [(f"{label} fp16", job) for label, job in mod.launch_jobs(n, torch.float16)]
    cases += [(f"{label} bf16", job) for label, job in rms_mod.launch_jobs(8192, torch.bfloat16)]
    cases += [(f"{label} bf16", job) for label, job in softmax_mod.launch_jobs(16384, torch.bfloat16)]
    # The softmax holds rows of up to 32768 in one block: Llama 2's 32000-entry vocabulary, and 32768 in
    # bf16 and fp32 (the widest one-block launch of each).
    cases += [(f"{label} {name}", job) for n, dt, name in ((32000, torch.bfloat16, "bf16"),
                                                           (32768, torch.bfloat16, "bf16"),
                                                           (32768, torch.float32, "fp32"))
              for label, job in softmax_mod.launch_jobs(n, dt)]
    cases += [(f"{label} fp32", job) for n in (8192, 16384) for label, job in ln_mod.launch_jobs(n, torch.float32)]
    cases += [(f"{label} fp16", job) for label, job in rms_mod.launch_jobs(65536, torch.float16)]
    # Gemma 3 27B (5376, bf16): (1 + w) in both norm modules, and the plain RMSNorm at the same width to price it
    n = rms_mod.GEMMA_WIDTH[1]
    cases += [(f"{label} bf16", job) for mod in (rms_mod, arn_mod)
              for label, job in mod.launch_jobs(n, torch.bfloat16, weight_offset=1.0)]
    cases += [(f"{label} bf16", job) for label, job in rms_mod.launch_jobs(n, torch.bfloat16)]
    # The GLU kernels are elementwise over (tokens x hidden): one launch for every width.
    cases += [(f"{label} fp16", job) for label, job in glu_mod.launch_jobs(torch.float16)]
    return cases


def _broken_cases() -> list[tuple[str, TritonJob]]:
    """The old launch rule (whole row in one block, warps = BLOCK // 256 capped at 8) at 16384
    columns, as a launch; and the old int32 add+RMSNorm forward (its launch's job, with the kernel
    swapped). The old rule's forward at 32768 takes 250 registers and does not spill once the launch
    specialises its sizes, so the backward is the launch that shows the check can fail."""
    old_bwd = rms_mod.launch_jobs(16384, bwd=RowLaunch(1, 16384, 8, 1))[1][1]
    arn = dict(arn_mod.launch_jobs(4096, torch.float16))["add_rms_norm fwd 4096"]
    int32 = TritonJob(_add_rms_norm_int32_rows_kernel, arn.signature, constexprs=arn.constexprs,
                      num_warps=arn.num_warps, attrs=arn.attrs)
    x2 = torch.empty(4096, 65536, dtype=torch.bfloat16, device="meta")   # the softmax one block wider
    kernel, grid, args, kwargs = softmax_mod._forward_args(x2, torch.empty_like(x2), RowLaunch(1, 65536, 32, 1))
    wide = launch_job(kernel, *args, grid=grid, **kwargs)
    return [("old rms_norm bwd 16384, 8 warps", old_bwd), ("old add_rms_norm fwd, int32 rows", int32),
            ("old softmax fwd 65536 in one block, 32 warps", wide)]


@pytest.fixture(scope="module")
def builds():
    """Every case compiled in one process: {label: (job, Build)}."""
    cases = _cases() + _broken_cases()
    with pytest.MonkeyPatch.context() as mp:   # the compiler imports this module for the broken kernel
        tests_dir = str(Path(__file__).resolve().parent)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
        out = compile_triton_many([job for _, job in cases], archs=("sm90",))
    return {label: (job, b["sm90"]) for (label, job), b in zip(cases, out)}


def strides_widened(ttgir: str, names) -> dict[str, bool]:
    """For each stride argument, whether every use of it in the kernel's IR is a sign extension to
    64 bits, so that row * stride is a 64-bit product (an int32 product wraps past 2**31).
    An argument the kernel does not use (a residual stride when there is no residual) counts as
    widened: it takes part in no product."""
    body = [line for line in ttgir.splitlines() if "tt.func" not in line]   # not the signature
    result = {}
    for name in names:
        uses = [line for line in body if re.search(rf"%{name}\b", line)]
        result[name] = all(re.search(rf"arith\.extsi %{name} : i32 to i64", u) for u in uses)
    return result


def program_id_widened(ttgir: str) -> bool:
    """Whether each program id is sign-extended to 64 bits before any use (the GLU's flat offsets)."""
    ids = re.findall(r"(%[\w]+) = tt\.get_program_id", ttgir)
    uses = [line for pid in ids for line in ttgir.splitlines()
            if re.search(rf"{pid}\b", line) and "tt.get_program_id" not in line]
    return bool(ids) and all("arith.extsi" in u and "to i64" in u for u in uses)


def test_launch_rule_grows_warps_and_splits_wide_rows():
    assert [row_launch(n, torch.float16).num_warps for n in (1024, 4096, 8192, 16384)] == [2, 8, 16, 32]
    assert row_launch(16384, torch.float16).one_block and not row_launch(16385, torch.float16).one_block
    assert row_launch(65536, torch.float16).col_blocks == 4
    assert [row_launch(n, torch.float16, BACKWARD).num_warps for n in (4096, 8192, 16384)] == [16, 32, 32]
    assert row_launch(8192, torch.float16, BACKWARD).one_block                # Llama 2/3 70B: 3 passes, not 5
    assert row_launch(16384, torch.float16, BACKWARD).col_blocks == 2
    assert row_launch(300, torch.float32, n_rows=50).block_r == 8          # short rows share a program
    assert FORWARD.max_block == 16384 and BACKWARD.max_block == 8192 and SOFTMAX.max_block == 32768
    for dt in (torch.bfloat16, torch.float32):                             # the softmax: one block to 32768
        assert row_launch(32768, dt, SOFTMAX).one_block and row_launch(32768, dt, SOFTMAX).num_warps == 32
        assert row_launch(32769, dt, SOFTMAX).col_blocks == 2
    assert row_launch(4096, torch.float16, SOFTMAX) == row_launch(4096, torch.float16, FORWARD)   # same warps below
    assert row_launch(16384, torch.float32).col_blocks == 2                 # fp32: half the block
    assert row_launch(8192, torch.float32, BACKWARD).col_blocks == 2      # fp32: half the block


def test_no_spills_at_real_widths(builds):
    spilled = {label: (b.spills, b.metadata["stack_bytes"]) for label, (_, b) in builds.items()
               if not label.startswith("old") and (b.spills or b.metadata["stack_bytes"])}
    assert not spilled, f"register spills (STL+LDL, stack bytes): {spilled}"
    assert len(builds) > 40


def test_gemma_offset_costs_no_registers_or_shared_memory(builds):
    """Gemma's (1 + w) at Gemma 3 27B's width is one fp32 add on the loaded weight: the forward and the
    backward compile to the plain launch's registers and shared memory, without spills (the backward at
    its 64-register ceiling of 32 warps, as the plain one)."""
    for part in ("fwd", "bwd"):
        plain, gemma = builds[f"rms_norm {part} 5376 bf16"][1], builds[f"rms_norm {part} 5376 (1 + w) bf16"][1]
        assert gemma.metadata["registers"] == plain.metadata["registers"], part
        assert gemma.metadata["shared_bytes"] == plain.metadata["shared_bytes"], part
    assert builds["rms_norm bwd 5376 (1 + w) bf16"][1].metadata["registers"] <= 64
    assert builds["add_rms_norm fwd 5376 (1 + w) bf16"][1].metadata["num_warps"] == 16


def test_launches_compiled_are_the_launchers_own(builds):
    """The warps compiled are the rule's: 32 warps for a 16384-wide forward and for the backward's
    blocks of 8192, 16 for a 4096-wide backward."""
    assert builds["rms_norm fwd 16384 fp16"][1].metadata["num_warps"] == 32
    assert builds["rms_norm bwd 16384 dx fp16"][1].metadata["num_warps"] == 32
    assert builds["rms_norm bwd 4096 fp16"][1].metadata["num_warps"] == 16
    assert builds["softmax fwd 4096 fp16"][1].metadata["num_warps"] == 8


def test_broken_old_launches_spill(builds):
    """The check can fail: the old whole-row launch of the backward spills at 16384 columns, and the
    softmax held in one block one width past its limit (65536, 64 values a thread) spills."""
    for label in ("old rms_norm bwd 16384, 8 warps", "old softmax fwd 65536 in one block, 32 warps"):
        b = builds[label][1]
        assert b.spills > 0 and b.metadata["stack_bytes"] > 0, label


def test_softmax_holds_32768_columns_in_one_block(builds):
    """Rows of 16385 to 32768 columns take the one-block kernel (2 passes, not the online kernel's 3):
    the forward at 32768 and 32 warps needs at most the 64 registers a thread has there, in bf16 and
    fp32, and Llama 2's 32000 columns compile to the same one-block kernel."""
    for label in ("softmax fwd 32768 bf16", "softmax fwd 32768 fp32", "softmax fwd 32000 bf16"):
        job, b = builds[label]
        assert job.kernel is softmax_mod._softmax_kernel and b.metadata["num_warps"] == 32, label
        assert b.metadata["registers"] <= 64 and b.spills == 0 and b.metadata["stack_bytes"] == 0, label


def test_row_offsets_are_64_bit(builds):
    for label, (job, b) in builds.items():
        if label.startswith("old") or label.startswith("glu"):
            continue
        strides = [a for a in job.signature if a.startswith("stride")]
        assert strides, label
        widened = strides_widened(b.ttgir, strides)
        assert all(widened.values()), f"{label}: strides used in 32 bits: {widened}"
        assert re.search(r"arith\.muli .* : (tensor<.*xi64|i64)", b.ttgir), f"{label}: no 64-bit row offset"
    for label, (_, b) in builds.items():
        if label.startswith("glu"):
            assert program_id_widened(b.ttgir), f"{label}: program id * BLOCK computed in 32 bits"


def test_broken_int32_row_offsets_are_caught(builds):
    job, b = builds["old add_rms_norm fwd, int32 rows"]
    widened = strides_widened(b.ttgir, [a for a in job.signature if a.startswith("stride")])
    assert not any(widened.values()), widened
    assert not program_id_widened(b.ttgir)
