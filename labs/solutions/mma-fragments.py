# Solutions for labs/14-ptx/mma-fragments.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution a-index
def a_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4                     # groupID, threadID_in_group
    row = g + 8 * ((i // 2) % 2)                   # registers 1 and 3 hold the bottom 8 rows
    col = 2 * t + (i % 2) + 8 * (i // 4)           # registers 2 and 3 hold columns 8-15
    return row, col

# %% wrong a-index: registers 1 and 2 swapped (columns +8 taken for rows +8)
def a_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    row = g + 8 * (i // 4)
    col = 2 * t + (i % 2) + 8 * ((i // 2) % 2)
    return row, col

# %% solution b-index
def b_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    k = 2 * t + (i % 2) + 8 * (i // 2)             # a register's two values are neighbours along k
    n = g                                          # a group of four threads shares column n
    return k, n

# %% wrong b-index: the pairs laid along n, as if B were row-major like A
def b_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + (i % 2)

# %% solution c-index
def c_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + (i % 2)

# %% wrong c-index: slots 1 and 2 swapped (the second value taken 8 rows down, not one column right)
def c_index(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i % 2), 2 * t + (i // 2)
