"""tcgen05 and tensor memory (TMEM), emulated: the instruction descriptor, the sm100 shared-memory
descriptor, the TMEM allocator and address space, ``tcgen05.mma`` into TMEM, ``tcgen05.ld``'s
32x32b access pattern, swizzled K-major operands, and the CTA pair (``cta_group::2``).

Sources: the PTX ISA (``nvidia2025ptx``), "TensorCore 5th Generation Family Instructions"
(Tensor Memory, its allocation and addressing, the instruction descriptor, the shared-memory
descriptor, data-path layouts, ``tcgen05.ld`` shapes); CuTe's ``UMMA::InstrDescriptor`` and
``UMMA::SmemDescriptor`` (``include/cute/arch/mma_sm100_desc.hpp``, ``nvidia2025cuteumma``).

* TMEM: 128 lanes x 512 columns of 32-bit cells per SM (256 KiB); an address is
  ``(lane << 16) | column``. ``tcgen05.alloc`` gives a CTA N columns of all 128 lanes, N a power of
  two from 32 to 512; ``tcgen05.dealloc`` returns them.
* The instruction descriptor (32 bits, kind::f16): D format at bits [4,6) (1 = f32), A and B
  formats at [7,10) and [10,13) (0 = f16, 1 = bf16), negate A/B at 13/14, A/B major at 15/16
  (0 = K-major), N >> 3 at [17,23), M >> 4 at [24,29).
* The shared-memory descriptor is sm90's (``kernels.ptx.wgmma``) with a version field of 1 at
  bits [46,48), a leading-offset mode bit at 52 and a 3-bit layout at [61,64): 0 none, 1 128B with
  32B atoms, 2 128B, 4 64B, 6 32B: the sm90 2-bit code moved one bit down.
* For M = 128 and one CTA, row i of D is TMEM lane i and column j is column ``base + j``.
  ``tcgen05.ld .32x32b`` lets warp w touch only lanes 32 (w % 4) .. 32 (w % 4) + 31; thread t gets
  lane 32 (w % 4) + t, consecutive columns in consecutive registers.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import numpy as np
import torch

from kernels.ptx import wgmma

LANES, COLUMNS = 128, 512
LAYOUT_CODE = {"none": 0, "128B_base32B": 1, "128B": 2, "64B": 4, "32B": 6}   # sm100 bits [61,64)
AB_FORMAT = {torch.float16: 0, torch.bfloat16: 1}
D_FORMAT = {torch.float16: 0, torch.float32: 1}


# ---------------------------------------------------------------------------------------------
# Descriptors


@dataclass(frozen=True)
class InstrDesc:
    """The fields of a kind::f16 instruction descriptor this chapter uses."""

    m: int
    n: int
    ab_dtype: torch.dtype = torch.float16
    d_dtype: torch.dtype = torch.float32
    a_mn_major: bool = False
    b_mn_major: bool = False


def encode_idesc(d: InstrDesc) -> int:
    """The 32-bit instruction descriptor; M in {64, 128, 256}, N a multiple of 8 (16 for M=256) up to 256."""
    if d.m not in (64, 128, 256) or d.n % (16 if d.m == 256 else 8) or not 8 <= d.n <= 256:
        raise ValueError(f"M must be 64, 128 or 256 and N a multiple of 8 (16 for M=256) in 8..256, got M={d.m}, N={d.n}")
    if d.ab_dtype not in AB_FORMAT or d.d_dtype not in D_FORMAT:
        raise ValueError(f"kind::f16 takes A/B in {list(AB_FORMAT)} and D in {list(D_FORMAT)}")
    return (D_FORMAT[d.d_dtype] << 4 | AB_FORMAT[d.ab_dtype] << 7 | AB_FORMAT[d.ab_dtype] << 10
            | int(d.a_mn_major) << 15 | int(d.b_mn_major) << 16 | (d.n >> 3) << 17 | (d.m >> 4) << 24)


def decode_idesc(bits: int) -> InstrDesc:
    ab = {v: k for k, v in AB_FORMAT.items()}
    dd = {v: k for k, v in D_FORMAT.items()}
    a_fmt, b_fmt = (bits >> 7) & 7, (bits >> 10) & 7
    if a_fmt != b_fmt or a_fmt not in ab or (bits >> 4) & 3 not in dd:
        raise ValueError(f"not a kind::f16 descriptor this emulation covers: {bits:#010x}")
    return InstrDesc(((bits >> 24) & 0x1F) << 4, ((bits >> 17) & 0x3F) << 3, ab[a_fmt], dd[(bits >> 4) & 3],
                     bool(bits >> 15 & 1), bool(bits >> 16 & 1))


class _CuteInstrBits(ctypes.LittleEndianStructure):
    """CuTe's ``UMMA::InstrDescriptor`` bit fields, transcribed (the independent encoding)."""

    _fields_ = [("sparse_id2", ctypes.c_uint16, 2), ("sparse_flag", ctypes.c_uint16, 1), ("saturate", ctypes.c_uint16, 1),
                ("c_format", ctypes.c_uint16, 2), ("_r0", ctypes.c_uint16, 1), ("a_format", ctypes.c_uint16, 3),
                ("b_format", ctypes.c_uint16, 3), ("a_negate", ctypes.c_uint16, 1), ("b_negate", ctypes.c_uint16, 1),
                ("a_major", ctypes.c_uint16, 1),
                ("b_major", ctypes.c_uint16, 1), ("n_dim", ctypes.c_uint16, 6), ("_r1", ctypes.c_uint16, 1),
                ("m_dim", ctypes.c_uint16, 5), ("_r2", ctypes.c_uint16, 1), ("max_shift", ctypes.c_uint16, 2)]


def cute_idesc_bits(d: InstrDesc) -> int:
    u = _CuteInstrBits(c_format=D_FORMAT[d.d_dtype], a_format=AB_FORMAT[d.ab_dtype], b_format=AB_FORMAT[d.ab_dtype],
                       a_major=int(d.a_mn_major), b_major=int(d.b_mn_major), n_dim=d.n >> 3, m_dim=d.m >> 4)
    return int.from_bytes(bytes(u), "little")


def encode_smem_desc(d: wgmma.Descriptor) -> int:
    """The sm100 shared-memory descriptor for the same fields as an sm90 :class:`wgmma.Descriptor`."""
    sm90 = wgmma.encode(wgmma.Descriptor(d.start_address, d.lbo, d.sbo, "none", d.base_offset))
    return sm90 | 1 << 46 | LAYOUT_CODE[d.swizzle] << 61


def decode_smem_desc(bits: int) -> wgmma.Descriptor:
    if (bits >> 46) & 3 != 1:
        raise ValueError(f"an sm100 shared-memory descriptor has version 1 at bits 46-47: {bits:#018x}")
    layout = {v: k for k, v in LAYOUT_CODE.items()}.get(bits >> 61)
    if layout is None or layout == "128B_base32B":
        raise ValueError(f"layout code {bits >> 61} is not one this emulation reads")
    base = wgmma.decode(bits & ((1 << 46) - 1) | (bits & (7 << 49)))
    return wgmma.Descriptor(base.start_address, base.lbo, base.sbo, layout, base.base_offset)


class _CuteSmemBits(ctypes.LittleEndianStructure):
    """CuTe's ``UMMA::SmemDescriptor`` bit fields, transcribed."""

    _fields_ = [("start_address", ctypes.c_uint16, 14), ("_r0", ctypes.c_uint16, 2),
                ("leading_byte_offset", ctypes.c_uint16, 14), ("_r1", ctypes.c_uint16, 2),
                ("stride_byte_offset", ctypes.c_uint16, 14), ("version", ctypes.c_uint16, 2),
                ("_r2", ctypes.c_uint8, 1), ("base_offset", ctypes.c_uint8, 3), ("lbo_mode", ctypes.c_uint8, 1),
                ("_r3", ctypes.c_uint8, 3), ("_r4", ctypes.c_uint8, 5), ("layout_type", ctypes.c_uint8, 3)]


def cute_smem_bits(d: wgmma.Descriptor) -> int:
    u = _CuteSmemBits(start_address=d.start_address >> 4, leading_byte_offset=d.lbo >> 4, stride_byte_offset=d.sbo >> 4,
                      version=1, base_offset=d.base_offset, layout_type=LAYOUT_CODE[d.swizzle])
    return int.from_bytes(bytes(u), "little")


_GDESC = re.compile(r"^UTCHMMA gdesc\[UR(\d+)\], gdesc\[UR(\d+)\]")
_UMOV = re.compile(r"^UMOV UR(\d+), (0x[0-9a-f]+)$")
_WRITES_UR = re.compile(r"^(?:@!?U?P\w+ )?\S+ UR(\d+),")      # destination first: ULOP3, UIADD3, R2UR, ...


def sass_descriptor_high_words(lines: list[str]) -> list[tuple[int | None, int | None]]:
    """For each ``UTCHMMA gdesc[URa], gdesc[URb], ...`` of a SASS listing (:func:`kernels.ptx.sass.listing`),
    the constants last moved into URa+1 and URb+1 before it: the upper 32 bits of A's and B's shared-memory
    descriptors (a 64-bit operand is the pair URn:URn+1), or None where that register was not set from an
    immediate. Those bits hold SBO, the version and the layout code; the start address is in the lower half."""
    last: dict[int, int] = {}
    out = []
    for line in lines:
        if m := _UMOV.match(line):
            last[int(m.group(1))] = int(m.group(2), 16)
        elif m := _GDESC.match(line):
            out.append(tuple(last.get(int(r) + 1) for r in m.groups()))
        elif w := _WRITES_UR.match(line):   # any other write to a uniform register forgets its constant
            last.pop(int(w.group(1)), None)
    return out


# ---------------------------------------------------------------------------------------------
# Tensor memory


def taddr(lane: int, column: int) -> int:
    """A TMEM address: lane in the upper 16 bits, column in the lower 16."""
    return lane << 16 | column


class TensorMemory:
    """One SM's TMEM (128 lanes x 512 columns of 32-bit cells) with its column allocator."""

    def __init__(self):
        self.cells = torch.full((LANES, COLUMNS), float("nan"))     # stale contents until written
        self.owner: list[str | None] = [None] * COLUMNS
        self.relinquished: set[str] = set()    # CTAs that gave up the right to allocate

    def alloc(self, ncols: int, who: str = "cta") -> int:
        """``tcgen05.alloc``: ``ncols`` columns (a power of two, 32..512), aligned to their size.
        Hardware blocks while none are free; here that is an error naming the holders."""
        if ncols < 32 or ncols > COLUMNS or ncols & (ncols - 1):
            raise ValueError(f"tcgen05.alloc takes a power of two from 32 to 512 columns, got {ncols}")
        if who in self.relinquished:
            raise RuntimeError(f"{who} executed tcgen05.relinquish_alloc_permit: the PTX ISA makes a later alloc illegal")
        for base in range(0, COLUMNS, ncols):
            if all(o is None for o in self.owner[base: base + ncols]):
                self.owner[base: base + ncols] = [who] * ncols
                return taddr(0, base)
        holders = sorted({o for o in self.owner if o})
        raise RuntimeError(f"no {ncols} free aligned columns (held by {', '.join(holders)}): tcgen05.alloc would block")

    def relinquish_alloc_permit(self, who: str = "cta") -> None:
        """``tcgen05.relinquish_alloc_permit``: ``who`` promises to allocate no more. Columns it holds
        stay allocated until it deallocates them."""
        self.relinquished.add(who)

    def dealloc(self, addr: int, ncols: int) -> None:
        col = addr & 0xFFFF
        if any(o is None for o in self.owner[col: col + ncols]):
            raise RuntimeError(f"dealloc of columns {col}..{col + ncols - 1} that are not all allocated")
        self.owner[col: col + ncols] = [None] * ncols

    def _check(self, col: int, n: int) -> None:
        if any(o is None for o in self.owner[col: col + n]) or col + n > COLUMNS:
            raise RuntimeError(f"columns {col}..{col + n - 1} are not allocated")

    def mma(self, d_addr: int, smem: torch.Tensor, adesc: int, bdesc: int, idesc: int, accumulate: bool) -> None:
        """``tcgen05.mma.cta_group::1.kind::f16``, M = 128: D[i][j] is lane i, column base + j."""
        shape = decode_idesc(idesc)
        if shape.m != 128 or shape.a_mn_major or shape.b_mn_major:
            raise NotImplementedError(f"emulated for M = 128 with K-major A and B, got {shape}")
        col = d_addr & 0xFFFF
        self._check(col, shape.n)
        A = wgmma.read_operand(smem, decode_smem_desc(adesc), 128)           # (128, 16)
        Bt = wgmma.read_operand(smem, decode_smem_desc(bdesc), shape.n)      # (N, 16)
        D = A.double() @ Bt.double().T
        old = self.cells[:, col: col + shape.n].double() if accumulate else 0.0
        self.cells[:, col: col + shape.n] = (old + D).float()

    def ld_32x32b(self, addr: int, warp: int, num: int) -> torch.Tensor:
        """``tcgen05.ld.sync.aligned.32x32b.x<num>`` by warp ``warp``: (32 threads, num registers)."""
        lane, col = addr >> 16, addr & 0xFFFF
        if lane != 32 * (warp % 4):
            raise ValueError(f"warp {warp} may access TMEM lanes {32 * (warp % 4)}..{32 * (warp % 4) + 31} only, "
                             f"got lane {lane}")
        self._check(col, num)
        return self.cells[lane: lane + 32, col: col + num].clone()

    def st_32x32b(self, addr: int, warp: int, regs: torch.Tensor) -> None:
        """``tcgen05.st.sync.aligned.32x32b.x<num>`` by warp ``warp``: thread t's ``num`` registers
        (``regs`` is (32, num)) go to lane 32 (warp % 4) + t, consecutive columns; ld's rule runs backwards."""
        lane, col = addr >> 16, addr & 0xFFFF
        if lane != 32 * (warp % 4):
            raise ValueError(f"warp {warp} may access TMEM lanes {32 * (warp % 4)}..{32 * (warp % 4) + 31} only, "
                             f"got lane {lane}")
        if regs.dim() != 2 or regs.shape[0] != 32:
            raise ValueError(f"regs must be (32 threads, num registers), got {tuple(regs.shape)}")
        self._check(col, regs.shape[1])
        self.cells[lane: lane + 32, col: col + regs.shape[1]] = regs.to(self.cells.dtype)


# ---------------------------------------------------------------------------------------------
# The kernel's computation, and the CTA pair


B_OFFSET = 16384                 # byte offset of B^T in the shared memory of every tcgen05_gemm* kernel
SW_SMEM_BYTES = B_OFFSET + 64 * 128   # tcgen05_gemm_sw<W>'s shared buffer: room for the 128-byte case


def swizzled_image(A: torch.Tensor, Bt: torch.Tensor, mode: str) -> tuple[torch.Tensor, dict[str, int]]:
    """The shared-memory image of ``tcgen05_gemm_sw<W>`` in kernels/cuda/tcgen05.cu: A (128 x K) at byte 0 and
    B^T (64 x K) at :data:`B_OFFSET`, both K-major in ``mode``'s canonical swizzled layout (CuTe's
    ``Layout_K_SW<W>_Atom``, written by :func:`wgmma.write_kmajor`), so K = W / 2. Returns the uint8 image
    (the kernel's whole shared buffer, zero past the operands)
    and the LBO / SBO a descriptor needs (the same for A and B^T)."""
    if mode not in ("32B", "64B", "128B") or A.shape[0] != 128 or Bt.shape[0] != 64:
        raise ValueError(f"mode must be 32B, 64B or 128B, A 128 x K and Bt 64 x K, got {mode!r}, "
                         f"{tuple(A.shape)}, {tuple(Bt.shape)}")
    smem = torch.zeros(SW_SMEM_BYTES, dtype=torch.uint8)
    lay = wgmma.write_kmajor(smem, 0, A, mode)
    wgmma.write_kmajor(smem, B_OFFSET, Bt, mode)
    return smem, lay


def tcgen05_gemm(A: torch.Tensor, Bt: torch.Tensor, idesc: int | None = None, *, swizzle: str = "none",
                 desc_swizzle: str | None = None) -> torch.Tensor:
    """The loop of the kernels in kernels/cuda/tcgen05.cu on the emulated TMEM: A (128 x K) and B^T (64 x K)
    stored K-major, K / 16 MMAs into 64 allocated columns, then four warps read the accumulator with
    ``tcgen05.ld 32x32b``. ``swizzle="none"`` is ``tcgen05_gemm`` (8x8 core matrices, K a multiple of 16 up
    to 64; the next k16 step is two K-blocks on); "128B", "64B" or "32B" is ``tcgen05_gemm_sw<W>`` (one
    swizzle atom per 8 rows, K = W / 2; the next k16 step starts 32 bytes further inside the swizzled row).
    ``idesc`` overrides the instruction descriptor and ``desc_swizzle`` the layout named in the shared-memory
    descriptors (to show that a wrong one is caught)."""
    K = A.shape[1]
    if swizzle == "none":
        if A.shape[0] != 128 or Bt.shape[0] != 64 or Bt.shape[1] != K or K % 16 or K > 64:
            raise ValueError(f"A must be 128 x K and Bt 64 x K with K a multiple of 16 up to 64, got {tuple(A.shape)}, {tuple(Bt.shape)}")
        smem = torch.zeros(128 * 64 * 2 + 64 * 64 * 2, dtype=torch.uint8)
        la = wgmma.write_kmajor(smem, 0, A, "none")                   # (lbo, sbo) = (128 rows x 16 B, 128)
        lb = wgmma.write_kmajor(smem, B_OFFSET, Bt, "none")           # (64 x 16, 128)
        step_a, step_b = 2 * la["lbo"], 2 * lb["lbo"]
    else:
        smem, la = swizzled_image(A, Bt, swizzle)                     # (lbo, sbo) = (16, 8 x W)
        lb, step_a, step_b = la, 32, 32
    mode = swizzle if desc_swizzle is None else desc_swizzle
    idesc = encode_idesc(InstrDesc(128, 64)) if idesc is None else idesc
    tmem = TensorMemory()
    base = tmem.alloc(64)
    for k in range(K // 16):
        adesc = encode_smem_desc(wgmma.Descriptor(k * step_a, la["lbo"], la["sbo"], mode))
        bdesc = encode_smem_desc(wgmma.Descriptor(B_OFFSET + k * step_b, lb["lbo"], lb["sbo"], mode))
        tmem.mma(base, smem, adesc, bdesc, idesc, accumulate=k > 0)
    rows = [tmem.ld_32x32b(base + taddr(32 * w, 0), w, 64) for w in range(4)]
    tmem.dealloc(base, 64)
    return torch.cat(rows)


def tcgen05_ref(A: torch.Tensor, Bt: torch.Tensor) -> torch.Tensor:
    return A.float() @ Bt.float().T


def pair_mma(A: torch.Tensor, Bt: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, int]]:
    """``cta_group::2`` with M = 256: CTA r holds rows 128r..128r+127 of A and half of B^T's rows
    (N/2 columns of B) in its shared memory; the pair's MMA gives CTA r the accumulator rows
    128r..128r+127 for all N columns in its own TMEM. Returns both CTAs' D and the operand bytes
    each CTA keeps in shared memory (against one CTA doing 128 x N alone with all of B)."""
    if A.shape[0] != 256 or Bt.shape[0] % 16:
        raise ValueError(f"A must have 256 rows and Bt a multiple of 16, got {tuple(A.shape)}, {tuple(Bt.shape)}")
    n = Bt.shape[0]
    halves_b = [Bt[: n // 2], Bt[n // 2:]]                    # each CTA stages half of B
    full_b = torch.cat(halves_b)                              # the pair's MMA reads both halves
    D = [(A[128 * r: 128 * (r + 1)].double() @ full_b.double().T).float() for r in range(2)]
    per_cta = {"A bytes": 128 * A.shape[1] * 2, "B bytes": (n // 2) * Bt.shape[1] * 2}
    return D, per_cta


def tmem_layout_owner() -> np.ndarray:
    """(128, 64): which (warp, thread) reads D[i][j] after ``tcgen05.ld 32x32b``: warp i // 32, thread i % 32."""
    i = np.arange(128)[:, None].repeat(64, 1)
    return np.stack([i // 32, i % 32], -1)
