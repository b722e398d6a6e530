# Solutions for labs/15-distributed/one-f-one-b.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail.

# %% solution order
def one_f_one_b_order(stage, p, m):
    warm = min(p - 1 - stage, m)                     # fill the stages below this one
    order = [Op("F", i) for i in range(warm)]
    for i in range(m - warm):                        # steady state: one forward, one backward
        order += [Op("F", warm + i), Op("B", i)]
    return order + [Op("B", i) for i in range(m - warm, m)]   # cool-down

# %% wrong order: warm-up of p - s forwards (runs, same bubble, but holds one more micro-batch)
def one_f_one_b_order(stage, p, m):
    warm = min(p - stage, m)
    order = [Op("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [Op("F", warm + i), Op("B", i)]
    return order + [Op("B", i) for i in range(m - warm, m)]

# %% wrong order: backward first in the steady state (the last stage's B 0 before its F 0: deadlock)
def one_f_one_b_order(stage, p, m):
    warm = min(p - 1 - stage, m)
    order = [Op("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [Op("B", i), Op("F", warm + i)]
    return order + [Op("B", i) for i in range(m - warm, m)]

# %% solution bubble
def bubble_fraction(p, m):
    return (p - 1) / (m + p - 1)     # idle (p - 1)(T_F + T_B) of a step (m + p - 1)(T_F + T_B)

# %% wrong bubble: (p - 1) / m, the idle time over the busy time instead of the whole step
def bubble_fraction(p, m):
    return (p - 1) / m
