"""Layout and launch helpers shared by the row kernels (softmax, the norms): each program takes whole
rows of a (rows, n) view, so inputs are reshaped to that view, and :func:`row_launch` decides how a
row of ``n`` features is laid over one program's threads.

The launch rule. A row held in one block lives in registers: with ``W`` warps each of the
``32 W`` threads holds ``BLOCK_N / (32 W)`` of its values per live tensor. Too few warps and a
wide row needs more registers than a thread may have (255, and fewer as warps grow: an SM has
65536, so 16 warps leave 128 per thread and 32 warps leave 64), and the compiler spills to local
memory. So warps grow with the row, as in Triton's layer-norm tutorial (``BLOCK // 256`` warps,
at most 8; triton-lang/triton@545699290b851e70231ee3017481851170f1583d,
python/tutorials/05-layer-norm.py) and Liger-Kernel's ``calculate_settings`` (4 warps, then 8, 16 or 32
warps from 2048, 8192 and 32768 columns up; linkedin/Liger-Kernel@45621c83d3438b9f5acf30a90175f4949fd40855,
src/liger_kernel/ops/utils.py). Here the count comes from a per-thread budget measured by
compiling the kernels for sm_90a (the chapters print the table): each kernel family has a number of
values per thread that fits in registers without spills, and a widest block beyond which even 32
warps would spill. A row wider than that block is walked in column blocks: a first pass gathers the
row's statistic (sum of squares, mean and variance, max and sum, or the backward's dot products)
and a second pass re-reads the row to write it, one more read of the row than the one-block form.

The module also holds the device functions the row kernels share: :func:`tanh`, accurate near 0, which
the cross-entropy kernel's soft-cap uses (libdevice's tanh fails under the interpreter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_WARPS = 32          # 1024 threads: the most one CUDA block (one Triton program) may have


@dataclass(frozen=True)
class RowBudget:
    """What one kernel family can hold in registers: ``per_thread`` fp32 values of each row tile
    per thread (warps are added until a thread holds that many, up to 32 warps), and ``max_block``,
    the widest block (columns) that one program takes at once, measured at 32 warps, where a thread
    may hold more than ``per_thread``. ``fp32_block``: the widest block for fp32 inputs, which take
    twice the registers while they are loaded (None: half of ``max_block``)."""

    per_thread: int
    max_block: int
    fp32_block: int | None = None


# Measured for sm_90a on the launches' own specialisation (kernels.inspect.launch_job: strides and
# sizes divisible by 16 carry the hint; tests/test_row_kernels_aot.py checks that every launch these
# give has no spills on sm_90a; the compiler page adds sm_80 and sm_100a). A forward keeps one row tile live (x, then y):
# 16 values a thread, 32 registers at 16384 columns and 32 warps, half of the 64 allowed (a
# hand-written signature without the hints took 55). The norm backward keeps x, g, w, dx and the
# weight-gradient accumulator: 8 values a thread, 64 registers at 4096 columns and 16 warps, and at
# 8192 columns and 32 warps exactly the 64 allowed, without spills, so its widest block is 8192.
# (Without the hints the backward took 98 registers at 4096 and spilled at 8192: the rule was 4096.)
FORWARD = RowBudget(per_thread=16, max_block=16384)
# The softmax forward keeps one row tile and nothing per column beside it (no weight, no mean): at
# 32768 columns and 32 warps (32 values a thread) it takes 63 registers in bf16, 61 in fp16 and 53 in
# fp32 on sm_90a, without spills; its backward walks the row in blocks and takes 36 there. At 65536
# columns in one block (64 values a thread) the forward spills (144 stack bytes). So a row of up to
# 32768 (Llama 2's 32000-entry vocabulary, Mistral v0.3's 32768) is read once, not twice
# (tests/test_row_kernels_aot.py compiles these launches and the spilling one).
SOFTMAX = RowBudget(per_thread=16, max_block=32768, fp32_block=32768)
BACKWARD = RowBudget(per_thread=8, max_block=8192)
# Several short rows share one program up to this many elements per tile.
TILE_ELEMENTS = 4096


@dataclass(frozen=True)
class RowLaunch:
    """How a (rows, n) problem is launched: ``block_r`` rows of ``block_n`` columns per tile with
    ``num_warps`` warps; ``col_blocks`` column blocks per row (1: the row stays in registers)."""

    block_r: int
    block_n: int
    num_warps: int
    col_blocks: int

    @property
    def one_block(self) -> bool:
        return self.col_blocks == 1


def row_launch(n: int, dtype: torch.dtype, budget: RowBudget = FORWARD, *, n_rows: int | None = None,
               block_size: int | None = None) -> RowLaunch:
    """The launch for rows of ``n`` features of ``dtype`` under ``budget``; the launchers and the
    AOT spill test both call this, so the test compiles what runs.

    ``block_size`` (a power of two) overrides the budget's widest block; the tests use it to walk
    rows of a few hundred features in several blocks on the interpreter. The budget is stated for
    16-bit inputs; fp32 inputs take twice the registers while they are loaded (6 spilled values in
    the LayerNorm forward at 16384 fp32 columns, 32 warps), so their widest block is half as wide:
    the same bytes per block, as in Triton's tutorial, whose limit is 64 KB over the element size;
    a budget whose compile shows otherwise states its own ``fp32_block`` (the softmax's).
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"row_launch: dtype must be float16, bfloat16 or float32, got {dtype}")
    if n < 1:
        raise ValueError(f"row_launch: n must be at least 1, got {n}")
    check_block_size("row_launch", block_size)
    max_block = budget.max_block
    if torch.finfo(dtype).bits == 32:
        max_block = budget.max_block // 2 if budget.fp32_block is None else budget.fp32_block
    if block_size is not None:
        max_block = block_size
    block_n = min(triton.next_power_of_2(n), max_block)
    col_blocks = triton.cdiv(n, block_n)
    block_r = 1
    if col_blocks == 1:  # short rows: pack several into one tile
        block_r = max(1, min(TILE_ELEMENTS // block_n, triton.next_power_of_2(max(n_rows or 1, 1))))
    return RowLaunch(block_r, block_n, warps_for(block_r * block_n, budget), col_blocks)


def check_block_size(fn: str, block_size, minimum: int = 1) -> None:
    """A forced block must be a power of two of at least ``minimum`` (or None: the rule decides)."""
    if block_size is not None and (not isinstance(block_size, int) or block_size < minimum
                                   or block_size & (block_size - 1)):
        raise ValueError(f"{fn}: block_size must be a power of two >= {minimum} or None, got {block_size!r}")


def warps_for(tile_elements: int, budget: RowBudget = FORWARD) -> int:
    """Warps for a tile: ``budget.per_thread`` values per thread, 1 to 32 warps (a power of two)."""
    return min(max(tile_elements // (32 * budget.per_thread), 1), MAX_WARPS)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a (rows, n) view with unit feature stride when possible, else a contiguous copy."""
    n = x.shape[-1]
    if x.stride(-1) != 1 and n > 1:
        x = x.contiguous()
    rows = x.reshape(-1, n)  # a view when the leading dimensions collapse (e.g. a row-padded buffer)
    if rows.stride(1) != 1 and n > 1:
        rows = rows.contiguous()
    return rows


# ----------------------------------------------------------------------------------------------
# Device functions the row kernels share
#
# libdevice's functions (tanh, pow ...) fail under Triton's interpreter, so a kernel that must run on
# a CPU writes them from tl.exp and arithmetic, and how it writes them decides their accuracy. The
# tempting tanh(u) = 2 sigmoid(2u) - 1 subtracts two numbers near 1 when u is small and keeps only
# the absolute precision of 1 (about 6e-8), a relative error of about 6e-8 / u: 2e-6 at u = 0.03 (a
# logit of 1 under Gemma 2's cap of 30), where torch.tanh in fp32 is within 6e-8. :func:`tanh` has no
# such cancellation (tests/test_loss.py checks it against float64).

# Below this |u| the odd Taylor polynomial (9 terms, to u^17) is used: its truncation error there is
# under 1e-9 relative, below fp32's rounding. Above it the exponential form has no cancellation.
TANH_POLY_LIMIT = tl.constexpr(0.55)


@triton.jit
def tanh(u):
    """tanh(u) in fp32, with no cancellation near 0 (a drop-in for libdevice's tanh).

    |u| < 0.55:  tanh u = u (1 + u^2 P(u^2)), the Taylor series 1 - u^2/3 + 2u^4/15 - 17u^6/315 ...
                 in Horner form: every step adds a term smaller than the running sum, so the
                 relative error stays at fp32's rounding however small u is.
    |u| >= 0.55: tanh |u| = 1 - 2t / (1 + t), t = exp(-2|u|) <= 0.33: 2t / (1 + t) <= 0.5, so the
                 subtraction from 1 cancels nothing; t underflows to 0 for large |u| (tanh = 1 exactly).
    The sign is restored at the end (tanh is odd); NaN stays NaN, +-inf gives +-1, +-0 gives 0.
    """
    a = tl.abs(u)
    a2 = u * u
    p = -0.00023912911424355248 * a2 + 0.000590027440945586     # -443861162/1856156927625, 6404582/10854718875
    p = p * a2 - 0.0014558343870513183                           # -929569/638512875
    p = p * a2 + 0.003592128036572481                            # 21844/6081075
    p = p * a2 - 0.008863235529902197                            # -1382/155925
    p = p * a2 + 0.021869488536155203                            # 62/2835
    p = p * a2 - 0.05396825396825397                             # -17/315
    p = p * a2 + 0.13333333333333333                             # 2/15
    p = p * a2 - 0.3333333333333333                              # -1/3
    small = u + u * (p * a2)                                     # u (1 + u^2 P(u^2))
    t = tl.exp(-2.0 * a)                                         # in (0, 0.33] on this branch
    large = 1.0 - 2.0 * t / (1.0 + t)                            # tanh |u|
    large = tl.where(u < 0, -large, large)
    return tl.where(a < TANH_POLY_LIMIT, small, large)


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-cap cap * tanh(x / cap) in PyTorch (attention scores: cap 50; logits: cap 30), the
    reference for the kernels that apply it with :func:`tanh`; its derivative is 1 - tanh(x / cap)^2."""
    return cap * torch.tanh(x / cap)


def check_cap(cap, name: str) -> float:
    """A soft-cap must be a finite number > 0 (c(x) -> x as cap -> inf: no cap is None, not inf)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (0 < cap < float("inf")):
        raise ValueError(f"{name}: softcap must be a finite number > 0 (or None for no cap), got {cap!r}")
    return float(cap)
