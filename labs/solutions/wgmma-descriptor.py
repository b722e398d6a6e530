# Solutions for labs/14-ptx/wgmma-descriptor.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution encode
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]   # the order is not by width
    return (start_address >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | code << 62

# %% wrong encode: swizzle codes numbered by width (32B = 1 ... 128B = 3), the intuitive order | hint: not in order of width
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "32B": 1, "64B": 2, "128B": 3}[swizzle]
    return (start_address >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | code << 62

# %% wrong encode: byte offsets stored without dropping their 4 low bits | hint: drop the 4 low bits
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]
    return (start_address >> 4) | (lbo & 0x3FFF) << 16 | (sbo & 0x3FFF) << 32 | code << 62

# %% wrong encode: the start address stored as bytes, not >> 4 (LBO and SBO shifted) | hint: the start address field holds the byte value itself
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]
    return start_address | (lbo >> 4) << 16 | (sbo >> 4) << 32 | code << 62

# %% wrong encode: the three 14-bit fields packed back to back at bits 0, 14, 28 | hint: reserved bits set: 0x80000000 (bit 31)
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]
    return (start_address >> 4) | (lbo >> 4) << 14 | (sbo >> 4) << 28 | code << 62

# %% wrong encode: calls the module's encoder | hint: write it yourself
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    from kernels.ptx.wgmma import Descriptor, encode
    return encode(Descriptor(start_address, lbo, sbo, swizzle))

# %% solution offsets
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    if swizzle == "none":
        return 16 * rows, 128           # LBO: next K core matrix, after all row blocks; SBO: next 8 rows
    width = {"32B": 32, "64B": 64, "128B": 128}[swizzle]
    return 16, 8 * width                # LBO unused; SBO: 8 rows of `width` bytes

# %% wrong offsets: LBO and SBO swapped for the unswizzled layout | hint: LBO and SBO are swapped
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    if swizzle == "none":
        return 128, 16 * rows
    width = {"32B": 32, "64B": 64, "128B": 128}[swizzle]
    return 16, 8 * width

# %% wrong offsets: SBO of one swizzled row instead of a group of eight | hint: steps between groups of 8 rows
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    if swizzle == "none":
        return 16 * rows, 128
    width = {"32B": 32, "64B": 64, "128B": 128}[swizzle]
    return 16, width

# %% wrong offsets: reads them off the module's canonical writer | hint: write it yourself
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    from kernels.ptx.wgmma import write_kmajor
    lay = write_kmajor(torch.zeros(16384, dtype=torch.uint8), 2048, torch.zeros(rows, 64, dtype=torch.float16), swizzle)
    return lay["lbo"], lay["sbo"]
