# Solutions for labs/15-distributed/one-f-one-b.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution order
def interleaved_order(stage, p, m, v):
    def op(kind, k):                                  # the k-th chunk-forward (or -backward) of a rank
        group = (k // p) % v                          # which pass of p micro-batches through the chunks
        chunk = group if kind == "F" else v - 1 - group
        return Op(kind, (k // (p * v)) * p + k % p, chunk)

    total = m * v
    warm = min(2 * (p - stage - 1) + (v - 1) * p, total)   # round trip through the later ranks + earlier chunks
    order = [op("F", k) for k in range(warm)]
    for i in range(total - warm):                     # steady state: one chunk-forward, one chunk-backward
        order += [op("F", warm + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warm, total)]   # cool-down

# %% wrong order: 1F1B's warm-up p - s - 1, without the round trip and the earlier chunks | hint: warm-up chunk-forwards
def interleaved_order(stage, p, m, v):
    def op(kind, k):
        group = (k // p) % v
        chunk = group if kind == "F" else v - 1 - group
        return Op(kind, (k // (p * v)) * p + k % p, chunk)

    total = m * v
    warm = min(p - stage - 1, total)
    order = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        order += [op("F", warm + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warm, total)]

# %% wrong order: backwards through the chunks in forward order (chunk 0 first) | hint: reverse order, chunk v - 1 first
def interleaved_order(stage, p, m, v):
    def op(kind, k):
        return Op(kind, (k // (p * v)) * p + k % p, (k // p) % v)

    total = m * v
    warm = min(2 * (p - stage - 1) + (v - 1) * p, total)
    order = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        order += [op("F", warm + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warm, total)]

# %% wrong order: each micro-batch through all its chunks before the next (depth first, no groups of p) | hint: groups of p micro-batches
def interleaved_order(stage, p, m, v):
    def op(kind, k):
        chunk = k % v if kind == "F" else v - 1 - k % v
        return Op(kind, k // v, chunk)

    total = m * v
    warm = min(2 * (p - stage - 1) + (v - 1) * p, total)
    order = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        order += [op("F", warm + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warm, total)]

# %% wrong order: calls the course's schedule | hint: write it yourself
def interleaved_order(stage, p, m, v):
    from kernels.dist.pipeline import interleaved_1f1b
    return interleaved_1f1b(p, m, v)[stage]

# %% solution bubble
def bubble_fraction(p, m, v):
    idle = (p - 1) / v            # fill and drain in chunk ops of 1/v, in units of T_F + T_B
    return idle / (m + idle)      # over the whole step: m busy units plus the idle ones

# %% wrong bubble: (p - 1) / (v m), idle over the ideal time (Narayanan et al.'s definition) | hint: idle over the ideal (busy) time
def bubble_fraction(p, m, v):
    return (p - 1) / (v * m)

# %% wrong bubble: 1F1B's (p - 1) / (m + p - 1), the chunks forgotten | hint: that is 1F1B's bubble
def bubble_fraction(p, m, v):
    return (p - 1) / (m + p - 1)

# %% wrong bubble: measures the reference schedule with the course's simulator | hint: write it yourself
def bubble_fraction(p, m, v):
    from kernels.dist.pipeline import interleaved_1f1b
    return simulate(interleaved_1f1b(p, m, v), t_f=1.0, t_b=2.0, v=v).bubble_fraction
