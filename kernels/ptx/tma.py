"""TMA, the Tensor Memory Accelerator: tensor maps, boxes, swizzle, out-of-bounds fill and multicast,
emulated; and a Triton kernel that loads through a tensor descriptor (TMA on sm90 and later).

Sources: the CUDA Driver API, ``cuTensorMapEncodeTiled`` (``nvidia2025driverapi``; the same text is
the doc comment in ``cuda.h`` of CUDA 13.2) for the tensor map's arguments and their rules; the PTX
ISA (``nvidia2025ptx``), "cp.async.bulk.tensor", for the copy, its mbarrier completion and
``.multicast::cluster``.

A tensor map describes a tensor in global memory (address, sizes and byte strides, innermost
dimension first) and a **box**, the tile one copy moves. A copy names the box's first coordinates;
elements outside the tensor are not read but filled, with zeros or (floating point only) NaN. The
box lands in shared memory packed row after row, each 16-byte chunk moved by the swizzle (the same
``Swizzle<B,4,3>`` as wgmma's layouts, ``kernels.ptx.wgmma.swizzle``), and the mbarrier named in
the copy is paid the **whole box's bytes**, filled elements included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.ptx import wgmma
from kernels.ptx.mbarrier import MBarrier

DATA_TYPE = {torch.uint8: 0, torch.int32: 3, torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
SWIZZLE = {"none": 0, "32B": 1, "64B": 2, "128B": 3}       # CUtensorMapSwizzle (not wgmma's codes)
OOB_FILL = {"zero": 0, "nan": 1}                            # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE / _NAN_REQUEST_ZERO_FMA


@dataclass(frozen=True)
class TensorMap:
    """The arguments of ``cuTensorMapEncodeTiled``, innermost dimension first as the driver takes them."""

    dtype: torch.dtype
    global_address: int
    global_dim: tuple[int, ...]
    global_strides: tuple[int, ...]      # bytes, for dimensions 1 .. rank-1
    box_dim: tuple[int, ...]
    element_strides: tuple[int, ...]
    swizzle: str = "none"
    oob_fill: str = "zero"

    @property
    def rank(self) -> int:
        return len(self.global_dim)

    @property
    def box_bytes(self) -> int:
        n = 1
        for b in self.box_dim:
            n *= b
        return n * torch.empty((), dtype=self.dtype).element_size()

    def arguments(self) -> dict:
        """What the driver call receives: enums as their integer values."""
        return {"tensorDataType": DATA_TYPE[self.dtype], "tensorRank": self.rank, "globalAddress": self.global_address,
                "globalDim": list(self.global_dim), "globalStrides": list(self.global_strides),
                "boxDim": list(self.box_dim), "elementStrides": list(self.element_strides), "interleave": 0,
                "swizzle": SWIZZLE[self.swizzle], "l2Promotion": 0, "oobFill": OOB_FILL[self.oob_fill]}


def encode_tiled(x: torch.Tensor, box: tuple[int, ...], *, swizzle: str = "none", oob_fill: str = "zero",
                 address: int | None = None) -> TensorMap:
    """A tensor map for ``x`` (torch order, outermost first) with ``box`` (torch order), refusing
    what ``cuTensorMapEncodeTiled`` refuses: rank 1..5, 16-byte aligned address, sizes 1..2**32,
    byte strides multiples of 16 below 2**40, box sides 1..256 with an inner side of a multiple of
    16 bytes, and with a swizzle an inner side of at most the swizzle's span."""
    if x.dtype not in DATA_TYPE:
        raise ValueError(f"x: dtype {x.dtype} has no tensor-map data type here; known: {list(DATA_TYPE)}")
    if not 1 <= x.dim() <= 5 or len(box) != x.dim():
        raise ValueError(f"x must have rank 1..5 and box one size per dimension, got {x.dim()} and {box}")
    if swizzle not in SWIZZLE or oob_fill not in OOB_FILL:
        raise ValueError(f"swizzle must be one of {list(SWIZZLE)} and oob_fill one of {list(OOB_FILL)}")
    if oob_fill == "nan" and not x.dtype.is_floating_point:
        raise ValueError("oob_fill='nan' needs a floating-point dtype")
    esize = x.element_size()
    addr = x.data_ptr() if address is None else address
    if addr % 16:
        raise ValueError(f"globalAddress must be 16-byte aligned, got {addr:#x}")
    if x.stride(-1) != 1:
        raise ValueError("x: the innermost dimension must be contiguous (stride 1)")
    strides = tuple(s * esize for s in reversed(x.stride()[:-1]))
    if any(s % 16 or s >= 2**40 for s in strides):
        raise ValueError(f"globalStrides must be multiples of 16 bytes below 2**40, got {strides}")
    if any(not 1 <= d <= 2**32 for d in x.shape):
        raise ValueError(f"globalDim must be in 1..2**32, got {tuple(x.shape)}")
    inner = box[-1] * esize
    if any(not 1 <= b <= 256 for b in box) or inner % 16:
        raise ValueError(f"boxDim sides must be 1..256 with the inner side a multiple of 16 bytes, got {box} ({inner} B)")
    if swizzle != "none" and inner > wgmma.SWIZZLE_WIDTH[swizzle]:
        raise ValueError(f"swizzle {swizzle} needs the box's inner side <= {wgmma.SWIZZLE_WIDTH[swizzle]} bytes, got {inner}")
    return TensorMap(x.dtype, addr, tuple(reversed(x.shape)), strides, tuple(reversed(box)), (1,) * x.dim(),
                     swizzle, oob_fill)


def load_box(tmap: TensorMap, x: torch.Tensor, coords: tuple[int, ...]) -> torch.Tensor:
    """The box at ``coords`` (innermost first, as in PTX), torch order, with out-of-bounds elements
    filled. ``x`` is the tensor the map describes."""
    if len(coords) != tmap.rank:
        raise ValueError(f"coords needs {tmap.rank} coordinates (innermost first), got {coords}")
    fill = float("nan") if tmap.oob_fill == "nan" else 0
    box = torch.full(tuple(reversed(tmap.box_dim)), fill, dtype=x.dtype)
    src, dst = [], []
    for c, b, n in zip(reversed(coords), reversed(tmap.box_dim), reversed(tmap.global_dim)):
        lo, hi = max(c, 0), min(c + b, n)                     # the part of this side inside the tensor
        if hi <= lo:
            return box
        src.append(slice(lo, hi))
        dst.append(slice(lo - c, hi - c))
    box[tuple(dst)] = x[tuple(src)]
    return box


def smem_image(tmap: TensorMap, box: torch.Tensor) -> torch.Tensor:
    """The bytes the box occupies in shared memory (a uint8 tensor, from a 1024-byte aligned
    address): packed rows, each 16-byte chunk placed by the swizzle. The emulation covers inner box
    sides equal to the swizzle's span (or no swizzle)."""
    raw = box.contiguous().view(torch.uint8).reshape(-1)
    if tmap.swizzle == "none":
        return raw.clone()
    row_bytes = box.shape[-1] * box.element_size()
    if row_bytes != wgmma.SWIZZLE_WIDTH[tmap.swizzle]:
        raise NotImplementedError(f"emulated for inner box == swizzle span ({wgmma.SWIZZLE_WIDTH[tmap.swizzle]} B), "
                                  f"got {row_bytes} B")
    out = torch.empty_like(raw)
    chunks = raw.reshape(-1, 16)
    dest = torch.tensor([wgmma.swizzle(16 * i, tmap.swizzle) // 16 for i in range(chunks.shape[0])])
    out.reshape(-1, 16)[dest] = chunks
    return out


def tma_load(tmap: TensorMap, x: torch.Tensor, coords: tuple[int, ...], smem: torch.Tensor, offset: int,
             bar: MBarrier) -> None:
    """``cp.async.bulk.tensor ... mbarrier::complete_tx::bytes``: write the box's image at byte
    ``offset`` of ``smem`` and pay ``bar`` the box's bytes (filled elements count too)."""
    if tmap.swizzle != "none" and offset % 1024:
        raise ValueError(f"a swizzled box must land at a 1024-byte aligned offset here, got {offset}")
    image = smem_image(tmap, load_box(tmap, x, coords))
    smem[offset: offset + image.numel()] = image
    bar.complete_tx(image.numel())


def tma_load_multicast(tmap: TensorMap, x: torch.Tensor, coords: tuple[int, ...], smems: list[torch.Tensor],
                       offset: int, bars: list[MBarrier], cta_mask: int) -> None:
    """``.multicast::cluster``: one read of the box, written at the same ``offset`` into the shared
    memory of every CTA whose bit is set in ``cta_mask`` (16 bits), each CTA's barrier paid."""
    if not 0 < cta_mask < 1 << 16 or cta_mask >> len(smems):
        raise ValueError(f"cta_mask must name CTAs 0..{len(smems) - 1} of the cluster, got {cta_mask:#x}")
    for rank in range(len(smems)):
        if cta_mask >> rank & 1:
            tma_load(tmap, x, coords, smems[rank], offset, bars[rank])


def box_from_image(tmap: TensorMap, image: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`smem_image`: the box (torch order) whose shared-memory image is ``image``."""
    shape = tuple(reversed(tmap.box_dim))
    if tmap.swizzle == "none":
        return image.clone().view(dtype).reshape(shape)
    chunks = image.reshape(-1, 16)
    src = torch.tensor([wgmma.swizzle(16 * i, tmap.swizzle) // 16 for i in range(chunks.shape[0])])
    return chunks[src].reshape(-1).view(dtype).reshape(shape)


def tma_store(tmap: TensorMap, x: torch.Tensor, coords: tuple[int, ...], smem: torch.Tensor, offset: int,
              *, add: bool = False) -> None:
    """``cp.async.bulk.tensor ... .global.shared::cta.bulk_group``: un-swizzle the box image at
    ``offset`` of ``smem`` and write it into ``x`` at ``coords`` (innermost first). Elements of the box
    that fall outside the tensor are **not written**: the store clips where the load fills.
    ``add``: ``cp.reduce.async.bulk.tensor ... .add``, which adds the box to ``x`` instead."""
    if len(coords) != tmap.rank:
        raise ValueError(f"coords needs {tmap.rank} coordinates (innermost first), got {coords}")
    box = box_from_image(tmap, smem[offset: offset + tmap.box_bytes], x.dtype)
    src, dst = [], []
    for c, b, n in zip(reversed(coords), reversed(tmap.box_dim), reversed(tmap.global_dim)):
        lo, hi = max(c, 0), min(c + b, n)                     # the part of this side inside the tensor
        if hi <= lo:
            return
        dst.append(slice(lo, hi))
        src.append(slice(lo - c, hi - c))
    if add:
        x[tuple(dst)] += box[tuple(src)]
    else:
        x[tuple(dst)] = box[tuple(src)]


def check_bulk_copy(size: int, *addresses: int) -> None:
    """The rules of a 1-D ``cp.async.bulk``: a size that is a positive multiple of 16 bytes and
    16-byte aligned source and destination (PTX ISA, cp.async.bulk)."""
    if size <= 0 or size % 16:
        raise ValueError(f"size must be a positive multiple of 16 bytes, got {size}")
    bad = [hex(a) for a in addresses if a % 16]
    if bad:
        raise ValueError(f"cp.async.bulk addresses must be 16-byte aligned, got {', '.join(bad)}")


# ---------------------------------------------------------------------------------------------
# The same load in Triton: a tensor descriptor (TMA on sm90+, emulated by the interpreter on a CPU)


@triton.jit
def _box_copy_kernel(in_desc, out_ptr, out_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tile = in_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N])          # (BLOCK_M, BLOCK_N), out of bounds filled
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)      # int64: rows * out_cols may pass 2**31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[:, None] * out_cols + cols[None, :], tile)


def box_copy_ref(x: torch.Tensor, block: tuple[int, int], fill: float = 0.0) -> torch.Tensor:
    """``x`` padded up to whole blocks with ``fill``: what copying every box of the map gives."""
    m, n = x.shape
    bm, bn = block
    out = torch.full((-(-m // bm) * bm, -(-n // bn) * bn), fill, dtype=x.dtype)
    out[:m, :n] = x
    return out


def box_copy(x: torch.Tensor, block: tuple[int, int] = (64, 64), padding: str = "zero") -> torch.Tensor:
    """Copy every (block) box of the 2-D ``x`` through a Triton tensor descriptor into a buffer
    padded to whole blocks; the padding shows the descriptor's out-of-bounds fill."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    if (x.stride(0) * x.element_size()) % 16:
        raise ValueError(f"x: the row stride ({x.stride(0) * x.element_size()} bytes) must be a multiple of 16 for a tensor map")
    if padding not in ("zero", "nan"):
        raise ValueError(f"padding must be 'zero' or 'nan', got {padding!r}")
    bm, bn = block
    out = torch.empty(-(-x.shape[0] // bm) * bm, -(-x.shape[1] // bn) * bn, dtype=x.dtype, device=x.device)
    grid, args, kwargs = _box_copy_args(x, out, block, padding)
    _box_copy_kernel[grid](*args, **kwargs)
    return out


def _box_copy_args(x: torch.Tensor, out: torch.Tensor, block: tuple[int, int], padding: str):
    """(grid, args, kwargs) of one launch of :func:`_box_copy_kernel` (a host tensor descriptor over
    ``x``), shared by :func:`box_copy` and :func:`launch_job` so the AOT build is the launch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn = block
    desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bn], padding=padding)
    return (out.shape[0] // bm, out.shape[1] // bn), (desc, out, out.shape[1]), dict(BLOCK_M=bm, BLOCK_N=bn)


def launch_job(rows: int, cols: int, block: tuple[int, int] = (128, 64), *, padding: str = "zero",
               dtype=torch.float16, target: str = "sm90"):
    """The job of the GPU launch :func:`box_copy` makes for a contiguous (rows, cols) tensor, on meta tensors."""
    from kernels import inspect as ki

    bm, bn = block
    x = torch.empty(rows, cols, dtype=dtype, device="meta")
    out = torch.empty(-(-rows // bm) * bm, -(-cols // bn) * bn, dtype=dtype, device="meta")
    grid, args, kwargs = _box_copy_args(x, out, block, padding)
    return ki.launch_job(_box_copy_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """The 128 x 64 fp16 box over two of Llama-3-8B's weight matrices: the query projection
    (4096 x 4096) and the MLP's up projection (14336 x 4096)."""
    return {"Llama-3-8B W_q (4096 x 4096) in 128x64 fp16 boxes": launch_job(4096, 4096),
            "Llama-3-8B W_up (14336 x 4096) in 128x64 fp16 boxes": launch_job(14336, 4096)}
