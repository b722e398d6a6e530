"""Which of a warp's 32 threads holds which matrix element: ``ldmatrix`` and ``mma.sync.m16n8k16``.

Everything here is transcribed from the PTX ISA (``nvidia2025ptx``): section "Warp-level matrix
load instruction: ldmatrix" and section "Matrix Fragments for mma.m16n8k16" (floating-point types,
``.f16`` A/B and ``.f32`` C/D). The names follow the ISA:

    groupID           = laneid >> 2      (0..7: which group of four threads)
    threadID_in_group = laneid % 4       (0..3: position inside the group)

**ldmatrix** loads 8x8 matrices of 16-bit elements from shared memory. Each row of a matrix is 16
contiguous bytes whose address one thread supplies (threads 0-7 for matrix 0, 8-15 for matrix 1,
16-23 for matrix 2, 24-31 for matrix 3; ``.x1`` uses only threads 0-7 and ``.x2`` threads 0-15).
Every thread receives one 32-bit register per matrix, holding two consecutive elements:

    without .trans: register r of lane l = M_r[l // 4][2 (l % 4) + j],  j = 0, 1
    with .trans:    register r of lane l = M_r[2 (l % 4) + j][l // 4]

**mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32** computes D (16x8) = A (16x16) B (16x8) + C.
Per thread: A in four ``.f16x2`` registers (a0..a7), B in two (b0..b3), C and D in four ``.f32``:

    A: a_i at row = groupID + 8 * ((i // 2) % 2),  col = 2 threadID_in_group + (i % 2) + 8 * (i // 4)
    B: b_i at row (k) = 2 threadID_in_group + (i % 2) + 8 * (i // 2),  col (n) = groupID
    C: c_i at row = groupID + 8 * (i // 2),  col = 2 threadID_in_group + (i % 2)

A layout here is an integer array ``(32, n, 2)``: ``layout[lane, i] = (row, col)`` of element ``i``
held by ``lane``. The emulation of the instruction is: gather the matrices the tensor core sees
from the 32 threads' registers with the layouts, multiply, scatter D back. So the layouts ARE the
content; they are checked (1) by being bijections onto the matrix, (2) against each other, since
``ldmatrix.x4`` and ``ldmatrix.x2.trans`` written from their own section of the ISA must produce
exactly mma's A and B fragments, and (3) on a GPU, against the real instructions
(``kernels/cuda/ldmatrix.cu``, ``kernels/cuda/mma.cu``).
"""
from __future__ import annotations

import numpy as np
import torch

WARP = 32
LDMATRIX_NUMS = (1, 2, 4)
MMA_SHAPE = (16, 8, 16)  # (M, N, K) of mma.m16n8k16
OPERAND_SHAPES = {"a": (16, 16), "b": (16, 8), "c": (16, 8)}
ELEMENTS_PER_THREAD = {"a": 8, "b": 4, "c": 4}


def group_id(lane):
    return lane >> 2


def thread_in_group(lane):
    return lane % 4


def _lanes():
    return np.arange(WARP)


# ----------------------------------------------------------------------------------------------
# ldmatrix


def _check_num(num: int) -> None:
    if num not in LDMATRIX_NUMS:
        raise ValueError(f"ldmatrix loads .x1, .x2 or .x4: num must be 1, 2 or 4, got {num!r}")


def ldmatrix_layout(num: int, trans: bool = False) -> np.ndarray:
    """``(32, num, 2, 3)``: for lane l, register r, half j -> (matrix, row, col) that it receives."""
    _check_num(num)
    out = np.zeros((WARP, num, 2, 3), dtype=np.int64)
    for lane in range(WARP):
        for r in range(num):
            for j in range(2):
                if trans:
                    row, col = 2 * (lane % 4) + j, lane // 4
                else:
                    row, col = lane // 4, 2 * (lane % 4) + j
                out[lane, r, j] = (r, row, col)
    return out


def ldmatrix_address_lanes(num: int) -> range:
    """The lanes whose row addresses ldmatrix reads: 8 per matrix, from lane 0 up."""
    _check_num(num)
    return range(8 * num)


def ldmatrix(smem: torch.Tensor, row_addresses, num: int, trans: bool = False, *, layout=None) -> torch.Tensor:
    """Emulate ``ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16``.

    ``smem`` is shared memory as a 1-D tensor of 16-bit elements; ``row_addresses[lane]`` is the
    element offset of the row that lane supplies (only lanes ``0 .. 8*num-1`` are read; each
    address must be 16-byte aligned, a multiple of 8 elements). Returns ``(32, num, 2)``: what
    each lane's register r holds, low half first.
    """
    addresses = _row_addresses(smem, row_addresses, num, "ldmatrix")
    # rows[m][r] = the 8 elements of row r of matrix m, read from the address lane 8m + r supplied
    rows = torch.empty((num, 8, 8), dtype=smem.dtype)
    for lane in ldmatrix_address_lanes(num):
        rows[lane // 8, lane % 8] = smem[addresses[lane]:addresses[lane] + 8]
    lay = ldmatrix_layout(num, trans) if layout is None else np.asarray(layout)
    m, r, c = (torch.as_tensor(lay[..., k]) for k in range(3))
    return rows[m, r, c]  # (32, num, 2)


def _row_addresses(smem: torch.Tensor, row_addresses, num: int, op: str) -> list[int]:
    """The 32 lanes' row addresses, checked as ``ldmatrix``/``stmatrix`` need them (lanes 0 .. 8 num - 1
    read: 16-byte aligned, inside ``smem``, a 1-D tensor of 16-bit elements)."""
    _check_num(num)
    if not isinstance(smem, torch.Tensor) or smem.dim() != 1 or smem.element_size() != 2:
        raise ValueError(f"{op}: smem must be a 1-D tensor of 16-bit elements (float16, bfloat16, int16)")
    addresses = [int(a) for a in row_addresses]
    if len(addresses) != WARP:
        raise ValueError(f"{op}: row_addresses needs one entry per lane (32), got {len(addresses)}")
    for lane in ldmatrix_address_lanes(num):
        a = addresses[lane]
        if a % 8:
            raise ValueError(f"{op}: lane {lane}'s row address {a} is not 16-byte aligned (a multiple of 8 elements)")
        if a < 0 or a + 8 > smem.numel():
            raise ValueError(f"{op}: lane {lane}'s row {a}..{a + 7} is outside shared memory of {smem.numel()} elements")
    return addresses


def stmatrix(smem: torch.Tensor, row_addresses, regs: torch.Tensor, trans: bool = False) -> torch.Tensor:
    """Emulate ``stmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16`` (sm_90): ldmatrix run backwards.

    ``regs`` (32, num, 2) is what each lane's register r holds, low half first, in ldmatrix's layout;
    lane 8m + r supplies the address of row r of matrix m. Writes those rows into ``smem`` (in place)
    and returns it."""
    if regs.dim() != 3 or regs.shape[0] != WARP or regs.shape[2] != 2:
        raise ValueError(f"stmatrix: regs must be (32, num, 2), got {tuple(regs.shape)}")
    num = regs.shape[1]
    addresses = _row_addresses(smem, row_addresses, num, "stmatrix")
    lay = ldmatrix_layout(num, trans)
    rows = torch.empty((num, 8, 8), dtype=smem.dtype)
    rows[tuple(torch.as_tensor(lay[..., k]) for k in range(3))] = regs.to(smem.dtype)
    for lane in ldmatrix_address_lanes(num):
        smem[addresses[lane]:addresses[lane] + 8] = rows[lane // 8, lane % 8]
    return smem


def movmatrix(regs: torch.Tensor) -> torch.Tensor:
    """Emulate ``movmatrix.sync.aligned.m8n8.trans.b16``: ``regs`` (32, 2) hold an 8x8 matrix M in the
    ldmatrix layout (lane l: row l // 4, columns 2 (l % 4) + j); returns the registers of M^T in the
    same layout. A transpose across the warp's registers, no shared memory."""
    if tuple(regs.shape) != (WARP, 2):
        raise ValueError(f"movmatrix: regs must be (32, 2), got {tuple(regs.shape)}")
    lay = ldmatrix_layout(1)[:, 0]                       # (32, 2, 3): (matrix, row, col) per lane and half
    r, c = torch.as_tensor(lay[..., 1]), torch.as_tensor(lay[..., 2])
    M = torch.empty((8, 8), dtype=regs.dtype)
    M[r, c] = regs
    return M.T[r, c]


# ----------------------------------------------------------------------------------------------
# mma.m16n8k16, f16 inputs, f32 accumulators


def mma_layout(operand: str) -> np.ndarray:
    """``(32, n, 2)`` for operand "a", "b" or "c" (C and D share a layout): ``[lane, i] = (row, col)``."""
    lanes = _lanes()
    g, t = group_id(lanes), thread_in_group(lanes)
    if operand == "a":
        i = np.arange(8)
        row = g[:, None] + 8 * ((i[None, :] // 2) % 2)
        col = 2 * t[:, None] + (i[None, :] % 2) + 8 * (i[None, :] // 4)
    elif operand == "b":
        i = np.arange(4)
        row = 2 * t[:, None] + (i[None, :] % 2) + 8 * (i[None, :] // 2)
        col = np.broadcast_to(g[:, None], (WARP, 4))
    elif operand in ("c", "d"):
        i = np.arange(4)
        row = g[:, None] + 8 * (i[None, :] // 2)
        col = 2 * t[:, None] + (i[None, :] % 2)
    else:
        raise ValueError(f"operand must be 'a', 'b' or 'c' (C and D share a layout), got {operand!r}")
    return np.stack([row, col], axis=-1).astype(np.int64)


def layout_from_function(index, operand: str) -> np.ndarray:
    """A layout array from a function ``index(lane, i) -> (row, col)`` (how the lab's mapping is read)."""
    op = "c" if operand == "d" else operand
    n = ELEMENTS_PER_THREAD[op]
    out = np.zeros((WARP, n, 2), dtype=np.int64)
    for lane in range(WARP):
        for i in range(n):
            rc = index(lane, i)
            try:
                row, col = (int(v) for v in rc)
            except (TypeError, ValueError):
                raise TypeError(f"index({lane}, {i}) must return (row, col), got {rc!r}") from None
            out[lane, i] = (row, col)
    return out


def check_layout(layout, operand: str) -> None:
    """Raise ValueError unless ``layout`` puts every element of the operand in exactly one (lane, slot).
    The message names the mapping's mistake: the first (lane, slot) sent outside the matrix (and how far
    that coordinate reaches over the warp), or two (lane, slot)s that hold the same element."""
    op = "c" if operand == "d" else operand
    rows, cols = OPERAND_SHAPES[op]
    name = operand.upper()
    lay = np.asarray(layout)
    want = (WARP, ELEMENTS_PER_THREAD[op], 2)
    if lay.shape != want:
        raise ValueError(f"{operand} layout must have shape {want}, got {lay.shape}")
    r, c = lay[..., 0], lay[..., 1]
    bad = np.argwhere((r < 0) | (r >= rows) | (c < 0) | (c >= cols))
    if len(bad):
        lane, i = (int(v) for v in bad[0])
        row, col = (int(v) for v in lay[lane, i])
        axis, values, size = ("row", r, rows) if not 0 <= row < rows else ("column", c, cols)
        raise ValueError(
            f"{name} layout: lane {lane}, slot {i} is mapped to ({row}, {col}), outside the {rows}x{cols} {name}: "
            f"over the warp your {axis}s run {int(values.min())}..{int(values.max())}, {name}'s run 0..{size - 1} "
            f"(groupID = lane // 4 runs 0..7, threadID_in_group = lane % 4 runs 0..3: is a {axis} built from the other one?)")
    flat = (r * cols + c).ravel()
    counts = np.bincount(flat, minlength=rows * cols)
    if (counts != 1).any():              # in range and 32 x n = rows x cols slots: a duplicate leaves a hole
        e, hole = int(np.argmax(counts > 1)), int(np.argmax(counts == 0))
        (l1, s1), (l2, s2) = (divmod(int(k), lay.shape[1]) for k in np.flatnonzero(flat == e)[:2])
        raise ValueError(
            f"{name} layout: lane {l1}, slot {s1} and lane {l2}, slot {s2} both hold element ({e // cols}, {e % cols}), "
            f"which is held {int(counts[e])} times, and element ({hole // cols}, {hole % cols}) is held by no (lane, slot): "
            f"each of the {rows * cols} elements of {name} sits in exactly one of the warp's 32 x {lay.shape[1]} slots")


def to_fragments(matrix: torch.Tensor, operand: str, layout=None) -> torch.Tensor:
    """Distribute a matrix over the warp: ``(32, n)``, entry ``[lane, i]`` = what lane holds in slot i."""
    op = "c" if operand == "d" else operand
    if tuple(matrix.shape) != OPERAND_SHAPES[op]:
        raise ValueError(f"operand {operand} must be {OPERAND_SHAPES[op]}, got {tuple(matrix.shape)}")
    lay = mma_layout(op) if layout is None else np.asarray(layout)
    return matrix[torch.as_tensor(lay[..., 0]), torch.as_tensor(lay[..., 1])]


def from_fragments(fragments: torch.Tensor, operand: str, layout=None) -> torch.Tensor:
    """Gather ``(32, n)`` fragments back into the matrix (elements no slot names stay NaN)."""
    op = "c" if operand == "d" else operand
    lay = mma_layout(op) if layout is None else np.asarray(layout)
    out = torch.full(OPERAND_SHAPES[op], float("nan"), dtype=fragments.dtype)
    out[torch.as_tensor(lay[..., 0]), torch.as_tensor(lay[..., 1])] = fragments
    return out


def mma_m16n8k16(a_frag: torch.Tensor, b_frag: torch.Tensor, c_frag: torch.Tensor | None = None, *,
                 layouts: dict | None = None) -> torch.Tensor:
    """Emulate one warp's ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``: the D fragments.

    ``a_frag`` (32, 8) and ``b_frag`` (32, 4) are fp16, ``c_frag`` (32, 4) fp32 (zeros if None).
    fp16 x fp16 products are exact in fp32; the sum over k is done in float64 and rounded once to
    fp32, so for inputs whose products and partial sums are exact (small integers) D is exact.
    ``layouts`` overrides the ISA layouts (to show that a wrong one gives a wrong product).
    """
    lay = {"a": mma_layout("a"), "b": mma_layout("b"), "c": mma_layout("c"), **(layouts or {})}
    for name, frag, want, dtype in (("a_frag", a_frag, (32, 8), torch.float16), ("b_frag", b_frag, (32, 4), torch.float16)):
        if tuple(frag.shape) != want or frag.dtype != dtype:
            raise ValueError(f"mma_m16n8k16: {name} must be {dtype} of shape {want}, got {frag.dtype} {tuple(frag.shape)}")
    if c_frag is None:
        c_frag = torch.zeros((32, 4), dtype=torch.float32)
    if tuple(c_frag.shape) != (32, 4) or c_frag.dtype != torch.float32:
        raise ValueError(f"mma_m16n8k16: c_frag must be float32 of shape (32, 4), got {c_frag.dtype} {tuple(c_frag.shape)}")
    A = from_fragments(a_frag.double(), "a", lay["a"])   # (16, 16) what the tensor core sees
    B = from_fragments(b_frag.double(), "b", lay["b"])   # (16, 8)
    C = from_fragments(c_frag.double(), "c", lay["c"])   # (16, 8)
    D = (A @ B + C).float()                              # D = A B + C, one rounding to fp32
    return to_fragments(D, "c", lay["c"])


def mma_from_matrices(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor | None = None) -> torch.Tensor:
    """D = A B + C through the warp: distribute by the ISA layouts, emulate mma, gather D."""
    c = None if C is None else to_fragments(C.float(), "c")
    d = mma_m16n8k16(to_fragments(A.half(), "a"), to_fragments(B.half(), "b"), c)
    return from_fragments(d, "c")



def c_to_a(c_left: torch.Tensor, c_right: torch.Tensor) -> torch.Tensor:
    """The A fragments (32, 8) fp16 of a 16x16 tile whose columns 0..7 are the accumulator ``c_left``
    and 8..15 ``c_right`` (each (32, 4) fp32). By the layouts, a_i = c_left's c_i for i < 4 and
    c_right's c_(i-4) for i >= 4 *in the same lane*: each thread only rounds and packs its own values
    (FlashAttention-2's P kept in registers for P V)."""
    for name, c in (("c_left", c_left), ("c_right", c_right)):
        if tuple(c.shape) != (32, 4) or c.dtype != torch.float32:
            raise ValueError(f"c_to_a: {name} must be float32 of shape (32, 4), got {c.dtype} {tuple(c.shape)}")
    return torch.cat([c_left, c_right], dim=1).half()


def mma_k32_layout(operand: str) -> np.ndarray:
    """``[lane, i] = (row, col)`` of the 8-bit operands of ``mma.m16n8k32`` (``.e4m3``/``.e5m2``, and
    ``.s8``/``.u8``): A (16x32, row) 16 elements per lane, B (32x8, col) 8. C/D is m16n8k16's."""
    lanes = _lanes()
    g, t = group_id(lanes), thread_in_group(lanes)
    if operand == "a":
        i = np.arange(16)[None, :]
        row = g[:, None] + 8 * ((i // 4) % 2)
        col = 4 * t[:, None] + (i % 4) + 16 * (i // 8)
    elif operand == "b":
        i = np.arange(8)[None, :]
        row = 4 * t[:, None] + (i % 4) + 16 * (i // 4)
        col = np.broadcast_to(g[:, None], (WARP, 8))
    else:
        raise ValueError(f"operand must be 'a' or 'b' (C/D is the m16n8k16 layout), got {operand!r}")
    row, col = np.broadcast_arrays(row, col)
    return np.stack([row, col], axis=-1).astype(np.int64)


def register_bytes(layout: np.ndarray, operand: str, elem_bytes: int) -> list[list[frozenset]]:
    """For each lane and 32-bit register, the bytes it holds as (line, byte) pairs, where a line is a
    row of A or a column of B (the K-contiguous direction of a row-major A and a "col" B)."""
    lay = np.asarray(layout)
    per_reg = 4 // elem_bytes
    out = []
    for lane in range(lay.shape[0]):
        regs = []
        for r in range(lay.shape[1] // per_reg):
            cells = set()
            for row, col in lay[lane, r * per_reg:(r + 1) * per_reg]:
                line, k = (row, col) if operand == "a" else (col, row)
                cells.update((int(line), int(k) * elem_bytes + j) for j in range(elem_bytes))
            regs.append(frozenset(cells))
        out.append(regs)
    return out


# ----------------------------------------------------------------------------------------------
# ldmatrix feeding mma: the composition a real kernel uses


def a_tile_addresses(row_stride: int = 16) -> list[int]:
    """Row addresses for ``ldmatrix.x4`` of a row-major 16x16 A tile: lane l -> &A[l % 16][8 (l // 16)]."""
    return [(lane % 16) * row_stride + 8 * (lane // 16) for lane in range(WARP)]


def b_tile_addresses(row_stride: int = 8) -> list[int]:
    """Row addresses for ``ldmatrix.x2.trans`` of a row-major (k-major) 16x8 B tile: lane l -> &B[l % 16][0]."""
    return [(lane % 16) * row_stride for lane in range(WARP)]


def ldmatrix_a_fragments(A: torch.Tensor) -> torch.Tensor:
    """mma A fragments (32, 8) of a row-major fp16 16x16 tile, loaded with ldmatrix.x4."""
    regs = ldmatrix(A.half().contiguous().view(-1), a_tile_addresses(), 4)  # (32, 4, 2)
    return regs.reshape(WARP, 8)


def ldmatrix_b_fragments(B: torch.Tensor) -> torch.Tensor:
    """mma B fragments (32, 4) of a row-major (K x N) fp16 16x8 tile, loaded with ldmatrix.x2.trans."""
    regs = ldmatrix(B.half().contiguous().view(-1), b_tile_addresses(), 2, trans=True)  # (32, 2, 2)
    return regs.reshape(WARP, 4)


# ----------------------------------------------------------------------------------------------
# Registers as the GPU stores them: two 16-bit halves in one 32-bit word, element 0 in the low half


def pack_halves(x: torch.Tensor) -> torch.Tensor:
    """``(..., 2k)`` fp16/bf16 -> ``(..., k)`` int32 words, low half = even element (little-endian)."""
    if x.element_size() != 2 or x.shape[-1] % 2:
        raise ValueError("pack_halves needs a 16-bit tensor with an even last dimension")
    return x.contiguous().view(torch.int32)


def unpack_halves(words: torch.Tensor, dtype=torch.float16) -> torch.Tensor:
    """Inverse of :func:`pack_halves`."""
    return words.contiguous().view(dtype)


# ----------------------------------------------------------------------------------------------
# A whole GEMM from m16n8k16 steps, as kernels/cuda/mma.cu's mma_gemm computes it


def mma_gemm(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """D = A @ B (fp32) for fp16 A (M, K), B (K, N) with M % 16 == N % 8 == K % 16 == 0, one emulated
    warp per 16x8 tile of D stepping K by 16, the accumulator carried in the C/D fragments."""
    M, K = A.shape
    K2, N = B.shape
    if K != K2 or M % 16 or N % 8 or K % 16:
        raise ValueError(f"mma_gemm needs A (M, K), B (K, N) with M % 16 == 0, N % 8 == 0, K % 16 == 0; "
                         f"got A {tuple(A.shape)} and B {tuple(B.shape)}")
    D = torch.empty(M, N, dtype=torch.float32)
    for m0 in range(0, M, 16):
        for n0 in range(0, N, 8):
            d = torch.zeros(WARP, 4)
            for k0 in range(0, K, 16):
                d = mma_m16n8k16(to_fragments(A[m0:m0 + 16, k0:k0 + 16].half(), "a"),
                                 to_fragments(B[k0:k0 + 16, n0:n0 + 8].half(), "b"), d)
            D[m0:m0 + 16, n0:n0 + 8] = from_fragments(d, "c")
    return D


# ----------------------------------------------------------------------------------------------
# Shared-memory banks under ldmatrix


def ldmatrix_bank_conflicts(row_addresses_bytes, num: int = 4) -> int:
    """The worst n-way bank conflict of an ldmatrix: each 8x8 matrix is read in one phase of
    8 rows x 16 bytes = 128 bytes, which is conflict-free only if its 8 rows fall in 8 distinct
    groups of 4 banks (32 banks of 4 bytes: CUDA C++ Programming Guide, shared memory).
    Returns 1 for conflict-free, 8 when all 8 rows of a matrix hit the same 4 banks."""
    _check_num(num)
    addrs = [int(a) for a in row_addresses_bytes]
    worst = 1
    for m in range(num):
        phase = addrs[8 * m: 8 * m + 8]
        banks: dict[int, set] = {}
        for a in phase:
            for word in range(a // 4, a // 4 + 4):       # the 4 banks a 16-byte row covers
                banks.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(words) for words in banks.values()))
    return worst


# ----------------------------------------------------------------------------------------------
# The lab: a learner's index functions, checked by reconstructing the product


def product_through_mapping(A: torch.Tensor, B: torch.Tensor, *, a_index=None, b_index=None, c_index=None) -> torch.Tensor:
    """A @ B computed by the emulated warp, with the learner's mapping for any of A, B, C.

    The given ``*_index(lane, i) -> (row, col)`` functions decide where the learner puts each
    element of A and B into the 32 threads' registers, and where they read each element of D
    back; the tensor core itself (the emulation) uses the ISA's layouts. Only a mapping equal to
    the ISA's gives back A @ B.
    """
    lay = {}
    for op, fn in (("a", a_index), ("b", b_index), ("c", c_index)):
        lay[op] = mma_layout(op) if fn is None else layout_from_function(fn, op)
        check_layout(lay[op], op)
    a = to_fragments(A.half(), "a", lay["a"])
    b = to_fragments(B.half(), "b", lay["b"])
    d = mma_m16n8k16(a, b)                       # the hardware: ISA layouts
    return from_fragments(d, "c", lay["c"])
