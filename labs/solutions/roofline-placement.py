# Solutions for labs/02-gpu/roofline-placement.ipynb (format: tools/labs.py).
# CI runs the lab with each solution swapped in, and once per wrong block, expecting that task's
# check cell, and only that one, to fail, and its report to contain the block's hint.

# %% solution counts
def matmul_counts(m, n, k, itemsize):
    flops = 2.0 * m * n * k                          # one multiply and one add per term of m n dot products
    nbytes = float(m * k + k * n + m * n) * itemsize # A and B read once, C written once
    return flops, nbytes

# %% wrong counts: one FLOP per multiply-add | hint: counts each multiply-add as 2
def matmul_counts(m, n, k, itemsize):
    return float(m * n * k), float(m * k + k * n + m * n) * itemsize

# %% wrong counts: bytes counted in elements | hint: multiply by itemsize
def matmul_counts(m, n, k, itemsize):
    return 2.0 * m * n * k, float(m * k + k * n + m * n)

# %% wrong counts: the output's write forgotten | hint: the output is written once too
def matmul_counts(m, n, k, itemsize):
    return 2.0 * m * n * k, float(m * k + k * n) * itemsize

# %% wrong counts: calls the course's counts | hint: write it yourself
def matmul_counts(m, n, k, itemsize):
    from kernels.gpu.roofline import matmul_counts as course_counts
    return course_counts(m, n, k, itemsize)

# %% solution place
def place(gpu, flops, nbytes, dtype):
    t_compute = flops / (gpu.peak(dtype) * 1e12)     # under the compute roof
    t_memory = nbytes / gpu.bytes_per_s              # under the bandwidth roof
    return max(t_compute, t_memory), t_memory > t_compute

# %% wrong place: the two times added | hint: not their sum
def place(gpu, flops, nbytes, dtype):
    t_compute = flops / (gpu.peak(dtype) * 1e12)
    t_memory = nbytes / gpu.bytes_per_s
    return t_compute + t_memory, t_memory > t_compute

# %% wrong place: the bound's roles reversed (memory-bound when compute takes longer) | hint: memory-bound means the bandwidth time is the larger
def place(gpu, flops, nbytes, dtype):
    t_compute = flops / (gpu.peak(dtype) * 1e12)
    t_memory = nbytes / gpu.bytes_per_s
    return max(t_compute, t_memory), t_compute > t_memory

# %% wrong place: calls the course's roofline | hint: write it yourself
def place(gpu, flops, nbytes, dtype):
    from kernels.gpu.hardware import ridge_point, roofline_time_s
    return roofline_time_s(gpu, flops, nbytes, dtype), flops / nbytes < ridge_point(gpu, dtype)
