# Solutions for labs/14-ptx/mma-fragments.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution a-index
def a_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4                     # groupID, threadID_in_group
    row = g + 8 * ((i // 2) % 2)                   # registers 1 and 3 hold the bottom 8 rows
    col = 2 * t + (i % 2) + 8 * (i // 4)           # registers 2 and 3 hold columns 8-15
    return row, col

# %% wrong a-index: registers 1 and 2 swapped (columns +8 taken for rows +8) | hint: registers 1 and 2 are swapped
def a_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    row = g + 8 * (i // 4)
    col = 2 * t + (i % 2) + 8 * ((i // 2) % 2)
    return row, col

# %% wrong a-index: groupID and threadID_in_group swapped (g = lane % 4, t = lane // 4) | hint: is a column built from the other one?
def a_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane % 4, lane // 4
    row = g + 8 * ((i // 2) % 2)
    col = 2 * t + (i % 2) + 8 * (i // 4)
    return row, col

# %% wrong a-index: reads the ISA layout from the module | hint: write it yourself
def a_index(lane: int, i: int) -> tuple[int, int]:
    from kernels.ptx.fragments import mma_layout
    return tuple(int(v) for v in mma_layout("a")[lane, i])

# %% solution b-index
def b_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    k = 2 * t + (i % 2) + 8 * (i // 2)             # a register's two values are neighbours along k
    n = g                                          # a group of four threads shares column n
    return k, n

# %% wrong b-index: the pairs laid along n, as if B were row-major like A | hint: neighbours along k
def b_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + (i % 2)

# %% wrong b-index: a thread's four slots run on along k (k = 2t + i) into the next thread's | hint: lane 0, slot 2 and lane 1, slot 0 both hold element (2, 0)
def b_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return 2 * t + i, g

# %% wrong b-index: reads the ISA layout from the module | hint: write it yourself
def b_index(lane: int, i: int) -> tuple[int, int]:
    import kernels.ptx.fragments as fragments
    return tuple(int(v) for v in fragments.mma_layout("b")[lane, i])

# %% solution c-index
def c_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + (i % 2)

# %% wrong c-index: slots 1 and 2 swapped (the second value taken 8 rows down, not one column right) | hint: slots 1 and 2 are swapped
def c_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i % 2), 2 * t + (i // 2)

# %% wrong c-index: reads the ISA layout from the module | hint: write it yourself
def c_index(lane: int, i: int) -> tuple[int, int]:
    from kernels.ptx.fragments import mma_layout
    return tuple(int(v) for v in mma_layout("c")[lane, i])
