"""wgmma's shared-memory matrix descriptors, the swizzle modes and the accumulator layout, emulated.

Sources: the PTX ISA (``nvidia2025ptx``), "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
Instructions" with its subsections "Matrix Descriptor Format", "Shared Memory Matrix Layout" and
"Register Fragments" (the ``.m64nNk16`` accumulator); CuTe's ``GmmaDescriptor``
(``include/cute/arch/mma_sm90_desc.hpp``, ``nvidia2024cutegmmadesc``) for the bit fields and
``make_gmma_desc`` / ``Layout_K_SW*_Atom`` (``include/cute/atom/mma_traits_sm90_gmma.hpp``,
``nvidia2024cutegmmatraits``) for the canonical K-major layouts.

A descriptor is 64 bits: start address >> 4 in bits [0,14), leading byte offset (LBO) >> 4 in
[16,30), stride byte offset (SBO) >> 4 in [32,46), base offset in [49,52), swizzle mode in [62,64)
(0 none, 1 128B, 2 64B, 3 32B). Everything here is K-major (each row of the operand, M rows of A or
N rows of B^T, has its K elements contiguous), with 16-bit elements and one k16 step per
instruction; the 16 elements of a row are two 16-byte chunks. Byte address of element (row, k):

* no swizzle: 8x8 "core matrices" of 8 rows x 16 bytes:
  ``start + 16 (row % 8) + SBO (row // 8) + LBO (k // 8) + 2 (k % 8)``;
* swizzle of width W in {32, 64, 128} bytes: rows W bytes apart, groups of 8 rows SBO apart, the
  two chunks adjacent (LBO unused), then the address is swizzled: its 16-byte chunk index (bits
  [4,7)) is XOR-ed with bits [7,10) of the address, keeping log2(W/16) of them. The pattern is a
  function of the absolute address, so tiles are aligned to 1024 bytes and ``base_offset`` stays 0.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

SWIZZLE_CODE = {"none": 0, "128B": 1, "64B": 2, "32B": 3}   # the 2-bit field at [62,64)
SWIZZLE_WIDTH = {"none": 16, "32B": 32, "64B": 64, "128B": 128}   # bytes of one swizzled row
_FIELDS = {  # name: (first bit, width)
    "start_address": (0, 14), "lbo": (16, 14), "sbo": (32, 14), "base_offset": (49, 3), "swizzle": (62, 2),
}


@dataclass(frozen=True)
class Descriptor:
    """A shared-memory matrix descriptor, in bytes (the encoding drops the low 4 bits)."""

    start_address: int
    lbo: int
    sbo: int
    swizzle: str = "none"
    base_offset: int = 0


def encode(d: Descriptor) -> int:
    """The 64-bit descriptor: each byte quantity >> 4 in its 14-bit field; the swizzle's code."""
    for name in ("start_address", "lbo", "sbo"):
        v = getattr(d, name)
        if v < 0 or v % 16 or v >> 4 >= 1 << 14:
            raise ValueError(f"{name} must be a multiple of 16 below {16 << 14} bytes, got {v}")
    if d.swizzle not in SWIZZLE_CODE:
        raise ValueError(f"swizzle must be one of {', '.join(SWIZZLE_CODE)}, got {d.swizzle!r}")
    if not 0 <= d.base_offset < 8:
        raise ValueError(f"base_offset is 3 bits, got {d.base_offset}")
    return ((d.start_address >> 4) | (d.lbo >> 4) << 16 | (d.sbo >> 4) << 32
            | d.base_offset << 49 | SWIZZLE_CODE[d.swizzle] << 62)


def decode(bits: int) -> Descriptor:
    """Inverse of :func:`encode`; an error if a reserved bit is set."""
    if not 0 <= bits < 1 << 64:
        raise ValueError(f"a descriptor is 64 bits, got {bits}")
    used = sum(((1 << w) - 1) << lo for lo, w in _FIELDS.values())
    if bits & ~used:
        raise ValueError(f"reserved bits set: {bits & ~used:#x}")
    field = {n: (bits >> lo) & ((1 << w) - 1) for n, (lo, w) in _FIELDS.items()}
    mode = {v: k for k, v in SWIZZLE_CODE.items()}[field["swizzle"]]
    return Descriptor(field["start_address"] << 4, field["lbo"] << 4, field["sbo"] << 4, mode, field["base_offset"])


class _CuteGmmaBits(ctypes.LittleEndianStructure):
    """CuTe's ``GmmaDescriptor::bitfield``, transcribed field for field (an independent encoding:
    the C compiler's bit-field packing, as ctypes reproduces it, instead of shifts and masks)."""

    _fields_ = [("start_address", ctypes.c_uint16, 14), ("_pad0", ctypes.c_uint16, 2),
                ("leading_byte_offset", ctypes.c_uint16, 14), ("_pad1", ctypes.c_uint16, 2),
                ("stride_byte_offset", ctypes.c_uint16, 14), ("_pad2", ctypes.c_uint16, 2),
                ("_pad3", ctypes.c_uint8, 1), ("base_offset", ctypes.c_uint8, 3), ("_pad4", ctypes.c_uint8, 4),
                ("_pad5", ctypes.c_uint8, 6), ("layout_type", ctypes.c_uint8, 2)]


def cute_union_bits(d: Descriptor) -> int:
    """The 64 bits CuTe's union holds for ``d`` (fields in 16-byte units, as CuTe stores them)."""
    u = _CuteGmmaBits(start_address=d.start_address >> 4, leading_byte_offset=d.lbo >> 4,
                      stride_byte_offset=d.sbo >> 4, base_offset=d.base_offset, layout_type=SWIZZLE_CODE[d.swizzle])
    return int.from_bytes(bytes(u), "little")


def swizzle(addr: int, mode: str) -> int:
    """The swizzled byte address: chunk bits [4,7) ^= address bits [7,10), masked to the mode."""
    keep = SWIZZLE_WIDTH[mode] // 16 - 1              # 0, 1, 3 or 7: how many chunk bits flip
    return addr ^ (((addr >> 7) & keep) << 4)


def operand_address(d: Descriptor, row: int, k: int, elem_bytes: int = 2) -> int:
    """Byte address wgmma reads for element (row, k) of a K-major operand through descriptor ``d``."""
    chunk, within = divmod(k * elem_bytes, 16)        # which 16-byte chunk of the row, byte inside it
    if d.swizzle == "none":                           # core matrices: 8 rows x 16 bytes, LBO along K
        return d.start_address + 16 * (row % 8) + d.sbo * (row // 8) + d.lbo * chunk + within
    width = SWIZZLE_WIDTH[d.swizzle]
    linear = d.start_address + width * (row % 8) + d.sbo * (row // 8) + 16 * chunk + within
    return swizzle(linear, d.swizzle)


def read_operand(smem: torch.Tensor, d: Descriptor, rows: int, k: int = 16) -> torch.Tensor:
    """The (rows, k) fp16 operand wgmma sees in ``smem`` (a uint8 tensor) through descriptor ``d``."""
    if smem.dtype != torch.uint8 or smem.dim() != 1:
        raise ValueError(f"smem must be a 1-D uint8 tensor, got {smem.dtype} with shape {tuple(smem.shape)}")
    addr = torch.tensor([[operand_address(d, r, c) for c in range(k)] for r in range(rows)])
    if addr.max() + 2 > smem.numel():
        raise ValueError(f"descriptor reads byte {int(addr.max()) + 1}, past the {smem.numel()}-byte shared memory")
    halves = smem.view(torch.int16)                   # addresses are even: element index = addr / 2
    return halves[addr // 2].view(torch.float16)


# ---------------------------------------------------------------------------------------------
# Writing tiles the way a TMA copy or CuTe's layout atoms do (an encoding independent of the reader)


def cute_swizzle(offset: int, bits: int, base: int = 4, shift: int = 3) -> int:
    """CuTe's ``Swizzle<B, M, S>``: XOR the B bits at [M+S, M+S+B) into the B bits at [M, M+B)."""
    yyy_mask = ((1 << bits) - 1) << (base + shift)
    return offset ^ ((offset & yyy_mask) >> shift)


def write_kmajor(smem: torch.Tensor, base: int, tile: torch.Tensor, mode: str) -> dict[str, int]:
    """Store an fp16 ``tile`` (rows, K) K-major at byte ``base`` of ``smem`` in ``mode``'s canonical
    layout, and return the LBO and SBO a descriptor needs for it.

    Swizzled: CuTe's ``Layout_K_SW<W>_Atom`` (8 rows x W bytes, ``Swizzle<log2(W/16), 4, 3>`` on
    the byte offset), atoms stacked along the rows, so K must be W / 2 elements. No swizzle: the
    tile is cut into 8x8 core matrices, K-blocks outermost (LBO = rows * 16, SBO = 128).
    """
    rows, K = tile.shape
    if tile.dtype != torch.float16 or rows % 8:
        raise ValueError(f"tile must be fp16 with rows a multiple of 8, got {tile.dtype} {tuple(tile.shape)}")
    halves = smem.view(torch.int16)
    bits = tile.view(torch.int16)
    if mode == "none":
        if K % 8:
            raise ValueError(f"K must be a multiple of 8 without swizzle, got {K}")
        blocks = bits.reshape(rows // 8, 8, K // 8, 8).permute(2, 0, 1, 3).reshape(-1)   # (k-block, row-block, 8, 8)
        halves[base // 2: base // 2 + blocks.numel()] = blocks
        return {"lbo": rows * 16, "sbo": 128}
    width = SWIZZLE_WIDTH[mode]
    if K * 2 != width:
        raise ValueError(f"a {mode} K-major atom row is {width} bytes: K must be {width // 2}, got {K}")
    b = {32: 1, 64: 2, 128: 3}[width]
    for r in range(rows):
        for c in range(K):
            halves[(base + cute_swizzle(r * width + 2 * c, b)) // 2] = bits[r, c]
    return {"lbo": 16, "sbo": 8 * width}


def read_through(tile: torch.Tensor, mode: str, *, encode_fn=None, offsets_fn=None, base: int = 2048,
                 smem_bytes: int = 16384) -> torch.Tensor:
    """Write ``tile`` (rows, K) K-major in ``mode``'s canonical layout at byte ``base`` of a shared-memory
    image, then read it back one k16 step at a time through descriptors, as the tensor core does.
    ``encode_fn(start, lbo, sbo, mode) -> int`` builds each descriptor and ``offsets_fn(mode, rows) ->
    (lbo, sbo)`` gives the offsets (each defaults to this module's); the wgmma lab passes its own. A
    descriptor that cannot be decoded (a reserved bit set) or that reads past the image raises
    :class:`DescriptorError`, naming the k16 step, the fields asked for and what the bits decode to."""
    smem = torch.zeros(smem_bytes, dtype=torch.uint8)
    lay = write_kmajor(smem, base, tile, mode)
    lbo, sbo = offsets_fn(mode, tile.shape[0]) if offsets_fn else (lay["lbo"], lay["sbo"])
    encode_fn = encode_fn or (lambda start, l, s, m: encode(Descriptor(start, l, s, m)))
    steps = []
    for k0 in range(0, tile.shape[1], 16):
        start = base + (2 * k0 if mode != "none" else 0)     # swizzled: the next k16 step is 32 bytes on
        asked = Descriptor(start, lbo, sbo, mode)
        bits = encode_fn(start, lbo, sbo, mode)
        try:
            d = decode(bits)
        except ValueError as err:                            # not 64 bits, or a reserved bit set
            raise DescriptorError(f"k16 step {k0 // 16}: the descriptor for {_fields(asked)} is {_hex(bits)}: {err}"
                                  f"{_reserved_bits(bits)}") from None
        try:
            steps.append(read_operand(smem, d, tile.shape[0]))
        except ValueError as err:                            # an address past the image
            raise DescriptorError(f"k16 step {k0 // 16}: the descriptor for {_fields(asked)} decodes to {_fields(d)}, "
                                  f"and it {err.args[0].removeprefix('descriptor ')}{_unshifted(asked, d)}") from None
    return torch.cat(steps, 1)


class DescriptorError(ValueError):
    """A descriptor that :func:`read_through` cannot follow: it names the mistake in the descriptor's fields."""


def _fields(d: Descriptor) -> str:
    return f"start {d.start_address}, LBO {d.lbo}, SBO {d.sbo}, {d.swizzle}"


def _hex(bits) -> str:
    return f"{bits:#018x}" if isinstance(bits, int) and bits >= 0 else repr(bits)


def _reserved_bits(bits) -> str:
    """Which reserved bits are set, and where the fields are, for a descriptor :func:`decode` refused."""
    if not isinstance(bits, int) or not 0 <= bits < 1 << 64:
        return ""
    used = sum(((1 << w) - 1) << lo for lo, w in _FIELDS.values())
    stray = [b for b in range(64) if (bits & ~used) >> b & 1]
    return (f" (bit{'s' if len(stray) > 1 else ''} {', '.join(map(str, stray))}): the fields are 14 bits at bits 0, 16 "
            "and 32 (start, LBO, SBO, each byte value >> 4), 3 at bit 49 (base offset) and 2 at bit 62 (swizzle), "
            "so a field is at the wrong bit or holds a value too wide for it")


def _unshifted(asked: Descriptor, d: Descriptor) -> str:
    """A note when a decoded field is 16 times the one asked for: the byte value was stored without >> 4."""
    names = [n for n, a, b in (("start address", asked.start_address, d.start_address), ("LBO", asked.lbo, d.lbo),
                               ("SBO", asked.sbo, d.sbo)) if a != b and b == (a << 4) % (16 << 14)]
    if not names:
        return ""
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f": the {listed} field{'s hold' if len(names) > 1 else ' holds'} the byte value itself (a field is value >> 4)"


# ---------------------------------------------------------------------------------------------
# The accumulator and the instruction


def accumulator_layout(n: int) -> np.ndarray:
    """(128, n // 2, 2): the (row, col) of D that thread t's accumulator register i holds in
    ``wgmma .m64nNk16`` with an f32 accumulator. Warp w = t // 32 owns rows 16w..16w+15; inside
    them, g = lane // 4 and q = lane % 4 follow mma.m16n8's C layout, repeated every 8 columns."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"N must be a multiple of 8 in 8..256, got {n}")
    t = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    w, g, q = t // 32, (t % 32) // 4, t % 4
    row = 16 * w + g + 8 * ((i // 2) % 2)
    col = 8 * (i // 4) + 2 * q + (i % 2)
    return np.stack(np.broadcast_arrays(row, col), -1)


def to_accumulator(D: torch.Tensor) -> torch.Tensor:
    """Distribute a 64 x N matrix over the warpgroup's registers: (128, N/2)."""
    lay = accumulator_layout(D.shape[1])
    return D[lay[..., 0], lay[..., 1]]


def from_accumulator(frags: torch.Tensor, layout: np.ndarray | None = None) -> torch.Tensor:
    """Gather (128, N/2) registers back into the 64 x N matrix (with ``layout``, or the ISA's)."""
    lay = accumulator_layout(2 * frags.shape[1]) if layout is None else layout
    D = torch.full((64, 2 * frags.shape[1]), float("nan"), dtype=frags.dtype)
    D[lay[..., 0], lay[..., 1]] = frags
    return D


def wgmma_ref(A: torch.Tensor, Bt: torch.Tensor) -> torch.Tensor:
    """D = A B with B given as B^T (N x K): the product in float32 from fp16 inputs."""
    return A.float() @ Bt.float().T


def wgmma(smem: torch.Tensor, desc_a: int, desc_b: int, n: int, acc: torch.Tensor | None = None) -> torch.Tensor:
    """Emulate ``wgmma.mma_async m64nNk16.f32.f16.f16`` with both operands in shared memory:
    decode the descriptors, read A (64 x 16) and B^T (N x 16), return the (128, N/2) accumulator
    registers (``acc`` + A B, summed in float64 and rounded once)."""
    A = read_operand(smem, decode(desc_a), 64)
    Bt = read_operand(smem, decode(desc_b), n)
    D = A.double() @ Bt.double().T
    out = to_accumulator(D)
    return (out if acc is None else out + acc.double()).float()


def gemm_sw128(A: torch.Tensor, Bt: torch.Tensor, mode: str = "128B") -> torch.Tensor:
    """The loop of ``wgmma_gemm_sw128``: A (64 x 64) and B^T (64 x 64) written with the 128-byte
    swizzle, four k16 steps whose descriptors start 32 bytes further each, D row-major.
    ``mode`` other than "128B" builds the descriptors with that swizzle (the wrong-variant test)."""
    if A.shape != (64, 64) or Bt.shape != (64, 64):
        raise ValueError(f"A and Bt must be 64 x 64, got {tuple(A.shape)} and {tuple(Bt.shape)}")
    smem = torch.zeros(16384, dtype=torch.uint8)
    lay = write_kmajor(smem, 0, A, "128B")
    write_kmajor(smem, 8192, Bt, "128B")
    acc = torch.zeros(128, 32)
    for kk in range(4):
        da = encode(Descriptor(0 + 32 * kk, lay["lbo"], lay["sbo"], mode))
        db = encode(Descriptor(8192 + 32 * kk, lay["lbo"], lay["sbo"], mode))
        acc = wgmma(smem, da, db, 64, acc)
    return from_accumulator(acc)
