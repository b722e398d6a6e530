# Solutions for labs/14-ptx/wgmma-descriptor.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution encode
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]   # the order is not by width
    return (start_address >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | code << 62

# %% wrong encode: swizzle codes numbered by width (32B = 1 ... 128B = 3), the intuitive order
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "32B": 1, "64B": 2, "128B": 3}[swizzle]
    return (start_address >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | code << 62

# %% wrong encode: byte offsets stored without dropping their 4 low bits
def encode_descriptor(start_address: int, lbo: int, sbo: int, swizzle: str) -> int:
    code = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]
    return (start_address >> 4) | (lbo & 0x3FFF) << 16 | (sbo & 0x3FFF) << 32 | code << 62

# %% solution offsets
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    if swizzle == "none":
        return 16 * rows, 128           # LBO: next K core matrix, after all row blocks; SBO: next 8 rows
    width = {"32B": 32, "64B": 64, "128B": 128}[swizzle]
    return 16, 8 * width                # LBO unused; SBO: 8 rows of `width` bytes

# %% wrong offsets: LBO and SBO swapped for the unswizzled layout
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    if swizzle == "none":
        return 128, 16 * rows
    width = {"32B": 32, "64B": 64, "128B": 128}[swizzle]
    return 16, 8 * width

# %% wrong offsets: SBO of one swizzled row instead of a group of eight
def offsets(swizzle: str, rows: int) -> tuple[int, int]:
    if swizzle == "none":
        return 16 * rows, 128
    width = {"32B": 32, "64B": 64, "128B": 128}[swizzle]
    return 16, width
